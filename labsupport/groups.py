"""A stateless process group: one trainer rank plus N inference ranks, outside torch.distributed.

A TCPStore rendezvous and a ``ProcessGroupNCCL`` (GPU) or ``ProcessGroupGloo`` (CPU) on it, as
vLLM's stateless groups are: beside the trainer's default group and vLLM's. Every wait has a
deadline (NCCL's at ``synchronize()``, the start's on a thread); a failure names the lost rank."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import pickle
import re
import socket
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore

_ENV_LOCK = threading.Lock()  # (around the NCCL constructor's environment: _make_backend)
_PEER_GONE = re.compile(r"\babort|remote process exited|network error|system error|Broken pipe|"
                        r"Connection (reset|closed|refused)|closed by peer|timed? ?out", re.I)


class GroupError(RuntimeError):
    """The group could not be formed or used (port in use, world sizes disagree, duplicate rank)."""


class GroupTimeout(GroupError, TimeoutError):
    """A peer did not show up (or answer) in time; the message names the missing ranks."""


def create_group(master_address: str, master_port: int, rank: int, world_size: int, *,
                 device: str | torch.device | None = None, timeout_s: float = 60.0,
                 store: TCPStore | None = None) -> StatelessGroup:
    """Join a group of ``world_size`` ranks (rank 0 hosts it, or brings ``host_store()``'s): NCCL
    on a CUDA ``device``, else gloo. ``GroupError``: a port in use, a rank twice, world sizes that
    disagree; ``GroupTimeout``: names the ranks that never came."""
    if not 0 <= rank < world_size or (store is not None and rank != 0):  # (the others: its address)
        raise GroupError(f"rank must be in [0, {world_size}) for world_size={world_size}, and only "
                         f"rank 0 brings a store; got rank={rank}, store={store is not None}.")
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda" and device.index is None:  # (the caller's current device stays so)
        device = torch.device("cuda", torch.cuda.current_device())
    address = f"{master_address}:{master_port if store is None else store.port}"
    try:
        store = store or (host_store(master_address, timeout_s, master_port) if rank == 0 else
                          TCPStore(master_address, master_port, timeout=timedelta(0, timeout_s)))
    except Exception as exc:  # (rank 0: its store could not start, the others: reach it)
        if rank != 0:
            raise GroupTimeout(f"rank {rank} could not reach the group's master (rank 0) at "
                               f"{address} within {timeout_s:.0f} s. Is rank 0 running, and do all "
                               "ranks use the same address and port?") from exc
        if "EADDRINUSE" not in str(exc) and "in use" not in str(exc):
            raise GroupError(f"rank 0 could not start the group store at {address}: {exc}") from exc
        raise GroupError(f"port {master_port} on {master_address} is already in use, so rank 0 "
                         "cannot host the group there. Pick a free port (labsupport.groups."
                         "free_port()), or host the store first (labsupport.groups.host_store()), "
                         "and pass its port to every rank.") from exc
    if store.add(f"join/{rank}", 1) > 1:  # arrival: each rank once, with the world size it expects
        raise GroupError(f"rank {rank} joined group {address} twice; give each process a rank.")
    store.set(f"world/{rank}", str(world_size))
    try:
        _await_arrivals(store, rank, world_size, timeout_s, address)
    except GroupError as exc:  # say so; rank 0 stays a moment: the others read its world size
        with contextlib.suppress(Exception):  # (rank 0's store may be gone)
            store.set(f"failed/{rank}", "1")
        end = time.monotonic() + min(2.0, timeout_s)
        while (rank == 0 and not isinstance(exc, GroupTimeout) and time.monotonic() < end
               and not all(store.check([f"failed/{r}"]) for r in range(1, world_size)
                           if store.check([f"world/{r}"]))):
            time.sleep(0.05)
        raise
    group = StatelessGroup(store, rank, world_size, device, timeout_s, address)
    # The backend's start under our deadline (gloo's connect, NCCL's lazy init: a dead rank's hang)
    if not (done := _bounded(group._start, timeout_s + 1.0)) or _peer_gone(done[0]):
        raise _lost(group, "the group's start", *((done[0], None) if done else (None, timeout_s)))
    if done[0] is not None:
        raise done[0]
    return group


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free now; another process may take it before rank 0 listens (see host_store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def host_store(address: str = "127.0.0.1", timeout_s: float = 60.0, port: int = 0) -> TCPStore:
    """Rank 0's store; ``port`` 0: the OS picks one as it listens (``.port``): nobody takes it."""
    return TCPStore(address, port, None, True, timeout=timedelta(seconds=timeout_s),
                    wait_for_workers=False)


class StatelessGroup:
    """Trainer + receivers: tensor collectives on the backend, small objects through the store."""

    def __init__(self, store: TCPStore, rank: int, world_size: int, device: torch.device,
                 timeout_s: float, address: str) -> None:
        self.store, self.pg, self.rank, self.world_size = store, None, rank, world_size  # (_start)
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.device, self.timeout_s, self.address = device, timeout_s, address  # "host:port"
        self._obj = PrefixStore("obj", store)  # object collectives' keys (the last reader deletes)
        self._seq, self.closed = 0, False  # closed: destroyed, or aborted after a lost peer

    def __repr__(self) -> str:
        return (f"StatelessGroup(rank={self.rank}, world_size={self.world_size}, "
                f"backend={self.backend!r}, device={str(self.device)!r}, master={self.address})")

    def _start(self) -> None:  # the backend, and a collective (NCCL makes its communicator there)
        self.pg = _make_backend(PrefixStore("pg", self.store), self.rank, self.world_size,
                                self.backend, self.timeout_s)
        self.pg._set_sequence_number_for_group()  # as torch does for its groups (flight recorder)
        self.all_reduce(torch.full((1,), self.rank, dtype=torch.int32, device=self.device), "sum")
        self.synchronize("group warm-up")

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream: Any = None) -> None:
        """Broadcast ``tensor`` in place from ``src``, after ``stream``'s work (as vLLM's does)."""
        with torch.cuda.stream(stream if self.backend == "nccl" else None):  # (None: no change)
            self.wait_work(self.broadcast_many([tensor], src), "broadcast")

    def broadcast_many(self, tensors: list[torch.Tensor], src: int = 0) -> Any:
        """Start one launch broadcasting ``tensors`` from ``src``, for ``wait_work``."""
        self._check_args(tensors, "broadcast", src)
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        return self._launch([lambda t=t: self.pg.broadcast([t], opts) for t in tensors],
                            "broadcast")

    def exchange(self, ops: list[tuple[str, torch.Tensor, int, int]]) -> Any:
        """Start every ``(kind, tensor, peer, tag)`` op ("send" or "recv") in one launch (gloo
        matches by peer and tag), for ``wait_work``; keep the tensors alive until then."""
        for kind, t, peer, _ in ops:
            self._check_args([t], kind, peer)
        return self._launch([lambda k=k, t=t, p=p, g=g: getattr(self.pg, k)([t], p, g)
                             for k, t, p, g in ops], "send/recv", p2p=True)

    def _launch(self, calls: list[Callable[[], Any]], what: str, p2p: bool = False) -> Any:
        """The calls as one launch: an NCCL group (gloo: a Work per call); ``p2p`` even alone (torch
        gives a lone send/recv a 2-rank communicator, a peer's grouped ones the group's: a hang)."""
        with self._step(what):  # (no calls: no work; NCCL's empty group would give None)
            if group := self.backend == "nccl" and (len(calls) > 1 or p2p and len(calls) == 1):
                self.pg._start_coalescing()
            works = [c() for c in calls]
            return self.pg._end_coalescing() if group else works

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        """In-place all-reduce (``op``: "sum", "max" or "min") of a tensor on the group's device."""
        if op not in ("sum", "max", "min"):
            raise ValueError(f"all_reduce op must be one of ['sum', 'max', 'min'], got {op!r}")
        self._check_args([tensor], "all_reduce")
        opts = dist.AllreduceOptions()
        opts.reduceOp, what = getattr(dist.ReduceOp, op.upper()), f"all_reduce({op})"
        self.wait_work(self._launch([lambda: self.pg.allreduce([tensor], opts)], what), what)

    def wait_work(self, work: Any, what: str = "collective") -> None:
        """Wait for a Work (or a list): on NCCL the current stream waits, on gloo the host."""
        with self._step(what):
            for w in work if isinstance(work, list) else [work]:
                w.wait()

    def synchronize(self, what: str = "work", timeout_s: float | None = None) -> None:
        """Block the host until the work queued so far is done, at most ``timeout_s`` (default: the
        group's): a dead peer's NCCL kernels spin forever, so past it: ``GroupTimeout``."""
        if self.backend != "nccl":
            return  # (on gloo every collective has already waited on the host)
        limit, start = (self.timeout_s if timeout_s is None else timeout_s), time.monotonic()
        (event := torch.cuda.Event()).record(torch.cuda.current_stream(self.device))
        while not event.query():
            if (waited := time.monotonic() - start) > 0.5:  # spin (accurate timings), then poll
                time.sleep(0.001)
            if waited > limit:
                raise _lost(self, what, waited_s=limit)
        if hasattr(self.pg, "get_error") and (error := self.pg.get_error().name) != "SUCCESS":
            raise _lost(self, what, RuntimeError(f"NCCL's error handling aborted it ({error})"))

    def _check_args(self, tensors: list[torch.Tensor], what: str, peer: int | None = None) -> None:
        """A closed group; programming errors (a rank out of range, a tensor on another device)."""
        if self.closed:
            raise GroupError(f"{self!r} was destroyed (or aborted after an error); make a new one.")
        if peer is not None and not 0 <= peer < self.world_size:
            raise ValueError(f"{what}: rank {peer} is not in this group of {self.world_size} ranks "
                             f"(0..{self.world_size - 1})")
        for t in tensors:
            if t.device != self.device and (t.device.type, self.device.type) != ("cpu", "cpu"):
                raise ValueError(f"{what}: expected a tensor on this group's device {self.device}, "
                                 f"found one on {t.device} (shape {tuple(t.shape)}, {t.dtype}); "
                                 f"move it with .to({str(self.device)!r})")

    @contextlib.contextmanager
    def _step(self, what: str, store: bool = False) -> Iterator[None]:
        """Backend (or ``store``) calls on the group's device; a lost peer: ``GroupTimeout``."""
        try:
            with torch.cuda.device(self.device if self.device.type == "cuda" else -1):  # (-1: none)
                yield
        except Exception as exc:
            if not (store or _peer_gone(exc)):
                raise
            raise _lost(self, what, exc) from exc

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Send a picklable object from ``src`` to every rank; returns it on all ranks."""
        return self._objects(obj, [src], "broadcast_object")[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's object, in rank order."""
        return self._objects(obj, list(range(self.world_size)), "all_gather_object")

    def barrier(self) -> None:
        """Wait until every rank gets here (through the store, with the group's timeout)."""
        self.all_gather_object(None)

    def _objects(self, obj: Any, writers: list[int], what: str) -> list[Any]:
        """The objects of ``writers`` (this rank's: ``obj``) via the store; last reader cleans."""
        self._check_args([], what, writers[0] if len(writers) == 1 else None)  # (source in range?)
        self._seq += 1
        op, keys = f"op{self._seq}", {r: f"op{self._seq}/{r}" for r in writers}
        if self.rank in keys:
            data = pickle.dumps(obj)
            with self._step(what, store=True):
                self._obj.set(keys[self.rank], data)
        others = {r: k for r, k in keys.items() if r != self.rank}
        try:
            self._obj.wait(list(others.values()), timedelta(seconds=self.timeout_s))
        except Exception as exc:
            with contextlib.suppress(Exception):  # (the store itself is gone if rank 0 died)
                others = {r: k for r, k in others.items() if not self._obj.check([k])}
            raise GroupTimeout(f"rank {self.rank}: {what} waited {self.timeout_s:.0f} s; rank(s) "
                               f"{list(others)} never answered on group {self.address}. Did they "
                               "die, or call a different sequence of collectives?") from exc
        with self._step(what, store=True):
            got = {r: self._obj.get(k) for r, k in others.items()}
            if self._obj.add(f"{op}/read", 1) == self.world_size:
                for k in [*keys.values(), f"{op}/read"]:
                    self._obj.delete_key(k)
        return [obj if r == self.rank else pickle.loads(got[r]) for r in writers]

    def abort(self) -> None:
        """Tear the backend down without waiting for peers (after an error); unusable after."""
        self._close("abort", "shutdown")

    def destroy(self) -> None:  # (NCCL: a local abort, as a shutdown waits for every rank)
        """Release the backend and store (rank 0: its port) not waiting for peers; idempotent."""
        self._close(*(["abort"] if self.backend == "nccl" else []), "shutdown")
        self.pg = self.store = self._obj = None

    def _close(self, *ways: str) -> None:  # closed (once): the first teardown that works in time
        for way in ways if not self.closed else ():  # (an NCCL abort can wait on a hung init)
            done = _bounded(lambda w=way: getattr(self.pg, w)(), min(self.timeout_s, 5.0))
            if not done or done[0] is None:  # (it ended, or is stuck: then the next would be too)
                break
        self.closed = True


def _make_backend(store: Any, rank: int, world_size: int, backend: str, timeout_s: float) -> Any:
    """Build the backend object directly (no default group, nothing registered globally)."""
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout_s))
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=timeout_s * 2 + 30)  # the watchdog fires after our deadlines
    opts.is_high_priority_stream = True  # a broadcast ready beside copy kernels gets the SMs first
    with _ENV_LOCK:  # error handling 2 cleans up without killing the process (3, the default, does)
        old = os.environ.get(key := "TORCH_NCCL_ASYNC_ERROR_HANDLING")
        os.environ[key] = old or "2"
        try:
            return dist.ProcessGroupNCCL(store, rank, world_size, opts)
        finally:
            if old is None:
                os.environ.pop(key)


def _await_arrivals(store: Any, rank: int, world_size: int, timeout_s: float, address: str) -> None:
    """Wait until every rank has joined and check that all expect the same world size."""
    deadline, seen = time.monotonic() + timeout_s, {}
    while missing := [r for r in range(world_size) if r not in seen]:
        if seen and time.monotonic() > deadline:  # (one look at least, even with timeout_s=0)
            raise GroupTimeout(f"rank {rank}: rank(s) {missing} never joined group {address} "
                               f"within {timeout_s:.0f} s (world_size={world_size}). Start them "
                               "with the same address/port, or raise timeout_s.")
        time.sleep(0.02 if seen else 0)  # (the first look at once)
        try:
            seen |= {r: int(store.get(f"world/{r}")) for r in range(world_size)
                     if r not in seen and store.check([f"world/{r}"])}
        except Exception as exc:
            raise GroupError(f"rank {rank} lost contact with rank 0 (the host of group {address}) "
                             "while joining; rank 0 probably failed: see its error. "
                             f"({str(exc).splitlines()[0][:200]})") from None
        if wrong := {r: w for r, w in seen.items() if w != world_size}:
            theirs = ", ".join(f"rank {r} expects {w}" for r, w in sorted(wrong.items()))
            raise GroupError(f"ranks disagree on world_size in group {address}: rank {rank} "
                             f"expects {world_size}, but {theirs}. Pass the same world_size (1 "
                             "trainer + number of receivers) to every rank.")


def _peer_gone(exc: BaseException | None) -> bool:
    """A lost peer: a store or network error, a backend's RuntimeError saying so; not a bug."""
    return isinstance(exc, (dist.DistNetworkError, dist.DistStoreError)) or (
        type(exc) in (RuntimeError, dist.DistBackendError) and bool(_PEER_GONE.search(str(exc))))


def _lost(group: StatelessGroup, what: str, exc: BaseException | None = None,
          waited_s: float | None = None) -> GroupTimeout:
    """Abort the group's backend; the error for a failed step: which peers stopped answering."""
    group.abort()
    cause = (f"did not finish within {waited_s:.0f} s" if waited_s is not None else "failed" + (
        f" ({type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]})" if exc else ""))
    limit, gone = min(group.timeout_s + 1.0, 8.0), []  # (<= 8 s: the error by the deadline + 10 s)

    def check_in() -> None:  # ranks not checking in through the store in time
        end = time.monotonic() + limit
        (store := group.store).set(f"alive/{group.rank}", "1")
        while not gone or gone[-1] and time.monotonic() < end:
            gone.append([r for r in range(group.world_size)
                         if r != group.rank and not store.check([f"alive/{r}"])])
            time.sleep(0.05)
    done = _bounded(check_in, limit + 1.0)  # (an error: rank 0, the store's host, is gone)
    missing = gone[-1] if done and (done[0] is None or gone and 0 not in gone[-1]) else None
    who = ("rank 0 vanished or stopped (it hosts the group's store, which no longer answers)"
           if missing is None else f"rank(s) {missing} did not answer a liveness check through the "
           "store (dead or hung)" if missing else
           "every peer still answers, so one of them probably called a different collective")
    return GroupTimeout(f"rank {group.rank}: {what} on group {group.address} {cause}: {who}. "
                        "The group was aborted; check those ranks' logs, then create a new group.")


def in_thread(fn: Callable[[], Any]) -> concurrent.futures.Future:
    """``fn()`` on a daemon thread (a hung call would hang an executor's exit) on this one's GPU."""
    fut: concurrent.futures.Future = concurrent.futures.Future()
    gpu = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    def run() -> None:
        try:
            if gpu is not None:
                torch.cuda.set_device(gpu)
            fut.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 (handed to the waiter)
            fut.set_exception(exc)
    threading.Thread(target=run, daemon=True, name="labsupport-call").start()
    return fut


def _bounded(fn: Callable[[], Any], limit: float) -> list[Any]:
    """``fn()`` on a daemon thread, at most ``limit`` s: ``[its result or exception]``, or []."""
    done = concurrent.futures.wait([fut := in_thread(fn)], limit).done
    return [fut.exception() or fut.result()] if done else []
