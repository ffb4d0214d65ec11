"""The weight-update protocol from a trainer into a vLLM engine: the trainer's calls, and worker
extensions receiving over a stateless group (``WorkerExtension``) or co-located IPC handles
(``ColocateWorkerExtension``). Against failures (Lab 4): ``call`` raises a worker's error naming
every failed rank (the next call gets its own replies); every call has a deadline
(``EngineTimeout``, then the engine refuses calls: ``EngineUnusable``); a dead engine raises
``EngineDead`` at once; ``alongside`` sends beside an engine RPC waiting for it, with a deadline;
updates are checked before any weight changes, loaded whole layers at a time, all or nothing on
every worker (``push_ipc``: a failed bucket undoes every bucket). Trainer, rank 0::

    group, ranks = alongside(lambda: call(llm, "init_weight_update_group", addr, port, 1, tp + 1),
                             lambda: stateless_init_process_group(addr, port, 0, tp + 1, device))
    push_weights(group, model.named_parameters(), llm)  # mode="bucketed" or per_tensor; push_ipc"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import torch

from labsupport import broadcast, checksums, groups, ipc, vllm_plan, vllm_weights
from labsupport.core import devices
from labsupport.core.buckets import Meta, dtype_name, metas as metas_of
from labsupport.vllm_handles import buckets_for, device_id, layer_buckets, pack_ipc_handles
from labsupport.vllm_weights import WeightUpdateError, WorkerFailed, worker_rpc, worker_state

log = logging.getLogger(__name__)
TIMEOUT_S = 300.0  # default deadline of one call on the workers
GRACE_S = 2.0  # how long a failed send waits for the engine's error, to attach it


class EngineDead(broadcast.WeightSyncError):
    """The engine's process died (vLLM marked it dead): no call will answer; start a new engine."""


class EngineTimeout(broadcast.WeightSyncError, TimeoutError):
    """An engine call missed its deadline; if it runs later, ``push_ipc``'s handles are dead."""


class EngineUnusable(EngineDead):
    """A call timed out in it and may still run: no other runs beside it (vLLM: not thread-safe)."""


def mark_unusable(engine: Any, why: str | None) -> None:  # and its core: every wrapper sees it
    for obj in (engine, owner(engine)):  # (an object taking no attributes: left as is)
        with contextlib.suppress(AttributeError):
            obj.labsupport_unusable = why


def check_usable(engine: Any) -> None:
    if why := getattr(engine, "labsupport_unusable", None) or getattr(
            owner(engine), "labsupport_unusable", None):
        raise EngineUnusable(f"this engine is unusable: {why}, and that call may still run in it; "
                             "restart the engine")


def within(fn: Callable[[], Any] | concurrent.futures.Future, timeout: float, what: str,
           engine: Any = None) -> Any:
    """``fn()`` on a daemon thread (or a future's result) within ``timeout`` s, else
    ``EngineTimeout`` (``engine`` refused after), or ``EngineDead`` once vLLM marks it dead."""
    fut = fn if isinstance(fn, concurrent.futures.Future) else groups.in_thread(fn)
    marks = getattr(owner(engine), "resources", None)  # (vLLM marks a dead engine there)
    end, dead = time.monotonic() + timeout, lambda: marks is not None and marks.engine_dead is True
    while not concurrent.futures.wait([fut], timeout=0.5).done and not dead():
        if time.monotonic() > end:
            mark_unusable(engine, f"{what} did not return within {timeout:.0f} s")
            raise EngineTimeout(f"{what} did not return within {timeout:.0f} s")
    failed = marks is not None and fut.done() and fut.exception()
    grace = time.monotonic() + (GRACE_S if failed else 0.0)
    while not dead() and time.monotonic() < grace:
        time.sleep(0.1)  # (vLLM marks the engine dead a moment after its calls fail)
    if dead():
        raise EngineDead(f"{what}: the engine died; start a new one") from (
            fut.exception() if fut.done() else None)
    return fut.result()


def call(llm: Any, method: str | Callable[..., Any], *args: Any, kwargs: dict | None = None,
         timeout: float | None = TIMEOUT_S) -> list[Any]:
    """``llm.collective_rpc(method, args=args)`` on an ``LLM`` or Ray actor: the per-rank results;
    else ``WeightUpdateError`` naming each failed worker, ``EngineTimeout``, ``EngineDead``."""
    check_usable(llm)  # (an actor checks its own engine: cluster.EngineActor)
    timeout = TIMEOUT_S if timeout is None else timeout  # (None, as vLLM's clients pass it)
    method = worker_rpc(method) if callable(method) else method  # (it replies with its error too)
    what = f"collective_rpc({getattr(method, '__name__', method)!r})"
    rpc, kept = llm.collective_rpc, ipc.kept_by(owner(llm))  # (late calls' buckets, before this)
    if hasattr(rpc, "remote"):  # a Ray actor (or cluster.InProcess): it calls with the deadline
        ref = rpc.remote(method, args=args, kwargs=kwargs, timeout=timeout)
        fut = ref.future() if hasattr(ref, "future") else groups.in_thread(lambda: ref)
        timeout += GRACE_S  # (and is given a little more)
    else:
        fut = groups.in_thread(lambda: rpc(method, timeout=timeout, args=args, kwargs=kwargs))
    replies = within(fut, timeout, what, llm)
    ipc.free_kept(kept)  # it answered: any call sent before this one has ended
    return check_replies(method, replies)


def owner(engine: Any) -> Any:
    """The engine behind ``engine`` (``LLM``, ``AsyncLLM``, a client): its core client, if any."""
    return getattr(getattr(engine, "llm_engine", engine), "engine_core", None) or engine


def check_replies(method: str | Callable[..., Any], replies: list[Any]) -> list[Any]:
    """``replies`` unchanged, or ``WeightUpdateError`` naming every rank that replied its error."""
    if failed := [f for f in replies if isinstance(f, WorkerFailed)]:
        lines = "".join(f"\n  worker rank {f.rank}: {f.message}" for f in failed)
        raise WeightUpdateError(f"{getattr(method, '__name__', method)} failed on {len(failed)} "
                                f"of {len(replies)} workers:{lines}")
    return replies


def alongside(rpc: Callable[[], Any], send: Callable[[], Any],
              timeout: float = TIMEOUT_S, refuse: Any = None) -> tuple[Any, Any]:
    """Both results of ``send()`` here beside ``rpc()`` (an engine call waiting for it) on a thread;
    a send error gets its outcome noted (``GRACE_S``); silent: EngineTimeout, ``refuse`` refused."""
    engine = groups.in_thread(rpc)
    try:
        sent = send()
    except BaseException as exc:
        done = concurrent.futures.wait([engine], timeout=min(timeout, GRACE_S)).done
        err = engine.exception() if done else None
        side = (f"{type(err).__name__}: {err}" if err else "returned" if done
                else f"no answer after {GRACE_S:.0f} s")
        exc.add_note(f"the engine's side: {side}")
        raise
    return sent, within(engine, timeout, "the engine's side", refuse)


def stateless_init_process_group(master_address: str, master_port: int, rank: int, world_size: int,
                                 device: str | torch.device, store: Any = None
                                 ) -> groups.StatelessGroup:
    """The trainer's end of the update group, as vLLM's rlhf_utils (``store``: a ``host_store``)."""
    return groups.create_group(master_address, master_port, rank, world_size, device=device,
                               store=store)


def announced(named: list[tuple[str, torch.Tensor]]) -> dict[str, list]:
    """The names, dtypes, shapes an update announces up front (as vLLM's NCCL ``update_info``)."""
    return {"names": [n for n, _ in named], "dtype_names": [dtype_name(t) for _, t in named],
            "shapes": [list(t.shape) for _, t in named]}


def push_weights(group: groups.StatelessGroup, named_tensors: Iterable[tuple[str, torch.Tensor]],
                 llm: Any, *, mode: str = "bucketed", bucket_bytes: int = 256 << 20,
                 dtype: torch.dtype | None = None, timeout: float = TIMEOUT_S,
                 partial: bool = False) -> dict[str, Any]:
    """Stats of a send beside the workers' receive: ``"per_tensor"`` (vLLM's rlhf.py loop) or
    ``"bucketed"``; ``dtype``: cast first; ``partial``: bucketed, some tensors on purpose."""
    if mode not in ("per_tensor", "bucketed"):
        raise ValueError(f"mode must be 'per_tensor' or 'bucketed', got {mode!r}")
    items = [(n, t.detach() if dtype is None else t.detach().to(dtype)) for n, t in named_tensors]
    out: dict[str, Any] = {"mode": mode, "n_tensors": len(items), "n_collectives": len(items),
                           "bytes": sum(t.nbytes for _, t in items)}
    t0 = time.perf_counter()
    if mode == "per_tensor":
        for name, t in items:  # each broadcast is ordered after the work queued on this stream
            rpc = functools.partial(call, llm, "update_weight", name, dtype_name(t), list(t.shape),
                                    timeout=timeout)
            alongside(rpc, lambda: group.broadcast(t.contiguous(), src=0), timeout)
        group.synchronize("per-tensor sync")
    else:
        rpc = functools.partial(call, llm, "update_weights_bucketed", timeout=timeout,  # up front
                                kwargs={**announced(items), "partial": partial})  # by name
        stats, out["workers"] = alongside(rpc, lambda: broadcast.send(
            group, items, src=0, mode="bucketed", bucket_bytes=bucket_bytes, partial=partial),
            timeout)
        out["n_collectives"] = stats.n_collectives
    return {**out, "seconds": time.perf_counter() - t0}


def push_ipc(llm: Any, named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = 1 << 30,
             timeout: float = TIMEOUT_S, partial: bool = False) -> int:
    """Tensors loaded into a co-located engine in IPC buckets of whole layers, one at a time, all or
    nothing (``whole_update``: a missing layer, unless ``partial``, refused before any load)."""
    ids, loaded, named = call(llm, "report_device_id", timeout=timeout), 0, list(named)
    with whole_update(llm, metas_of(named), partial, timeout), ipc.Exporter() as ex:
        for items in layer_buckets([(n, t.detach()) for n, t in named], bucket_bytes):
            bucket = ex.export_bucket(items, receivers=ids.count(ids[0]))  # CPU: one device
            try:  # partial: a bucket of layers (the whole was checked above)
                loaded += call(llm, "update_weights_from_ipc",
                               pack_ipc_handles({ids[0]: bucket}), True, timeout=timeout)[0]
            except EngineTimeout:  # a late open is refused; a late read keeps the memory
                ex.release(bucket, force=True, keep=owner(llm))
                raise
            ex.release(bucket)  # every worker acked after loading
    return loaded


@contextlib.contextmanager
def whole_update(llm: Any, metas: Sequence[Meta], partial: bool = False,
                 timeout: float = TIMEOUT_S) -> Iterator[None]:
    """The loads inside land on every worker or none (``metas``: the update, checked first)."""
    call(llm, "begin_update", metas, partial, timeout=timeout)
    try:
        yield
    except BaseException as exc:  # (a timed-out engine is refused already: it may still load)
        if not isinstance(exc, EngineTimeout):  # a load failed on some worker: all undo all
            _end_update(llm, timeout, exc)
        raise
    _end_update(llm, timeout)


def _end_update(llm: Any, timeout: float, failed: BaseException | None = None) -> None:
    """Every worker keeps the update or undoes it (``failed`` noted); if one can't: refused."""
    try:
        call(llm, "end_update", failed is None, timeout=timeout)
    except Exception as exc:
        mark_unusable(llm, f"ending an update failed, its workers may hold a mix of weights: {exc}")
        if failed is None:
            raise
        return failed.add_note(f"undoing it failed too, the engine is refused from now on: {exc}")
    if failed is not None:
        failed.add_note("every worker put its old weights back: the engine holds the old weights")


async def push_ipc_async(engine: Any, named: Iterable[tuple[str, torch.Tensor]],
                         bucket_bytes: int = 1 << 30, timeout: float = TIMEOUT_S) -> int:
    """:func:`push_ipc` into an ``AsyncLLM``, on a thread; its calls run on the free event loop."""
    def on_loop(*args: Any, **kw: Any) -> Any:  # the engine's collective_rpc, on its loop
        return asyncio.run_coroutine_threadsafe(engine.collective_rpc(*args, **kw), loop).result()
    loop = asyncio.get_running_loop()
    client = SimpleNamespace(collective_rpc=on_loop,
                             engine_core=getattr(engine, "engine_core", None))
    return await asyncio.to_thread(push_ipc, client, named, bucket_bytes, timeout)  # (marked late)


def _worker_checksums(worker: Any) -> dict[str, int]:  # runs in each worker
    return checksums.engine_checksums(worker.model_runner.get_model(), worker.model_config.dtype)


def engine_sums(llm: Any, timeout: float = TIMEOUT_S) -> list[dict[str, int]]:
    """``checksums.engine_checksums`` of what every worker of ``llm`` computes with, by TP rank."""
    return call(llm, _worker_checksums, timeout=timeout)


# ---- Worker side ---------------------------------------------------------------------------------
class _ExtensionBase:  # (state_type: a WorkerState subclass, where it keeps more)
    @worker_rpc
    def check_weights_changed(self) -> bool:
        """True if this worker's weights differ from the last call (first: from before updates)."""
        ew = worker_state(self).weights
        if ew.pending:
            log.warning("%d tensors wait for the rest of their layer: %s", len(ew.pending),
                        sorted(ew.pending)[:4])
        return ew.changed()


class WorkerExtension(_ExtensionBase):
    """Receive over a stateless group: per tensor (vLLM's rlhf.py protocol) or bucketed."""

    @worker_rpc
    def init_weight_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                 world_size: int, timeout_s: float = 60.0) -> int:
        """Join (leaving any other) as rank offset + own (replied); SyncTimeout after timeout_s."""
        st = worker_state(self)  # the model view is built now: a bad model fails here, not midway
        rank = vllm_weights.worker_rank(self.vllm_config, rank_offset)
        st.join_group(master_address, master_port, rank, world_size, device=self.device,
                      timeout_s=timeout_s)
        return rank

    @worker_rpc
    def update_weight(self, name: str, dtype_name: str, shape: Sequence[int]) -> None:
        """One tensor, loaded with its layer; a bad one is received (in step), then refused."""
        st = worker_state(self)
        group, ew = st.require_group(), st.weights
        dtype = getattr(torch, str(dtype_name).removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise WeightUpdateError(f"unknown dtype name {dtype_name!r}; send e.g. 'bfloat16' "
                                    "(dtype_name(tensor))")
        buf = torch.empty([int(s) for s in shape], dtype=dtype, device=ew.device)
        with broadcast.guard(group, f"update_weight('{name}')"):  # a timed wait: on NCCL a trainer
            group.broadcast(buf, src=0)  # that died first would otherwise hang the next forward
            group.synchronize(f"update_weight('{name}')")
        ew.check(metas_of([(name, buf)]), whole_layers=False, partial=True)
        ew.pending[name] = buf
        ew.flush(only_complete=True)

    @worker_rpc
    def pending_weight_names(self) -> list[str]:  # received per tensor, waiting for their layer
        return sorted(worker_state(self).weights.pending)

    @worker_rpc
    def update_weights_bucketed(self, names: Sequence[str] = (), dtype_names: Sequence[str] = (),
                                shapes: Sequence[Sequence[int]] = (), partial: bool = False
                                ) -> dict[str, Any]:
        """One ``broadcast.send``, planned (``vllm_plan``), all or nothing on every rank; replies
        stats, seconds per phase (``recv_wait_s``, ``aside_s``, ``copies_s``, ``fallback_s``...)."""
        st = worker_state(self)
        ew, st.planned = st.weights, st.planned or vllm_plan.PlannedReceive(self)
        ew.pending.clear()  # (tensors a per-tensor update left waiting for their layer)
        got = st.planned.receive(st, ew.loader(names, dtype_names, shapes, stream=True,
                                               partial=partial))
        return {**got, "loaded": got["n_tensors"], "staged_bytes": dict(ew.peak),
                "aside": ew.aside.type}

    @worker_rpc
    def destroy_weight_update_group(self) -> None:  # release gloo sockets / NCCL communicators
        worker_state(self).leave_group()


class ColocateWorkerExtension(_ExtensionBase):
    """Receive ``labsupport.ipc`` handles from a trainer on the same device: check, map, load."""

    @worker_rpc
    def report_device_id(self) -> str:  # the key of its handles (GPU UUID or ``cpu:<host>``)
        return device_id(self.device)

    @worker_rpc
    def begin_update(self, metas: Sequence[Meta], partial: bool = False) -> None:
        """Check the whole update before any load; then loads keep old layers till end_update."""
        ew = worker_state(self).weights
        ew.check([Meta(*m) for m in metas], partial=partial)
        ew.begin()

    @worker_rpc
    def end_update(self, keep: bool) -> None:  # keep the update begun, or put back all it loaded
        worker_state(self).weights.end(undo=not keep)

    @worker_rpc
    def update_weights_from_ipc(self, handles: bytes | Mapping, partial: bool = False) -> int:
        """Check, map, load this device's buckets (``buckets_for``); returns the tensor count."""
        t0 = time.perf_counter()
        st, buckets = worker_state(self), buckets_for(self.device, handles)
        st.weights.check([Meta(*e[:3]) for b in buckets for e in b.entries], partial=partial)
        t1 = time.perf_counter()
        views = [view for b in buckets for view in ipc.rebuild(b)]
        t2 = time.perf_counter()
        try:
            return st.weights.load(views)
        finally:
            del views
            devices.synchronize(st.weights.device)
            for b in buckets:  # this process has finished reading: the trainer may release them
                ipc.ack(b)
            st.timing = {"check_s": t1 - t0, "open_s": t2 - t1, "load_s": time.perf_counter() - t2}

    @worker_rpc
    def last_update_timing(self) -> dict[str, float]:  # the last IPC update's check/open/load_s
        return dict(worker_state(self).timing)


class RLHFWorkerExtension(WorkerExtension, ColocateWorkerExtension):
    """Both patterns on one engine: group broadcast (per tensor / bucketed) and IPC handles."""
