"""A stateless process group: one trainer rank plus N inference ranks, outside torch.distributed's globals.

RLHF trainers already own a default process group (data parallel) and vLLM builds its own; the weight-sync
group must coexist with both. So we never call ``init_process_group``: a TCPStore does the rendezvous and a
``ProcessGroupNCCL`` (GPU) or ``ProcessGroupGloo`` (CPU) is built directly on it, as in vLLM's
``stateless_init_torch_distributed_process_group``. Every wait has a timeout; failures name the missing rank.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import socket
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore


class GroupError(RuntimeError):
    """The group could not be formed or used (port in use, world sizes disagree, duplicate rank, ...)."""


class GroupTimeout(GroupError, TimeoutError):
    """A peer did not show up (or answer) in time; the message names the missing ranks."""


def create_group(master_address: str, master_port: int, rank: int, world_size: int, *,
                 device: str | torch.device | None = None, timeout_s: float = 60.0) -> StatelessGroup:
    """Join (rank 0: host) a stateless group of ``world_size`` ranks: NCCL on a CUDA ``device``, gloo on the CPU
    (the default). Raises ``GroupError`` for a port in use, a duplicate rank or disagreeing world sizes,
    ``GroupTimeout`` naming the ranks that never arrived."""
    if not 0 <= rank < world_size:
        raise GroupError(f"rank must be in [0, {world_size}) for world_size={world_size}; got rank={rank}.")
    device = torch.device(device if device is not None else "cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":  # (never torch.cuda.set_device: the caller's current device stays as it was)
        device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
    address = f"{master_address}:{master_port}"
    try:
        store = TCPStore(master_address, master_port, None, rank == 0, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)
    except Exception as exc:
        if rank == 0 and ("EADDRINUSE" in str(exc) or "in use" in str(exc)):
            raise GroupError(
                f"port {master_port} on {master_address} is already in use, so rank 0 cannot host the group "
                "there. Pick a free port (labsupport.groups.free_port()) and pass it to every rank.") from None
        if rank != 0:
            raise GroupTimeout(
                f"rank {rank} could not reach the group's master (rank 0) at {address} within {timeout_s:.0f} s. "
                "Is rank 0 running, and do all ranks use the same address and port?") from None
        raise GroupError(f"rank 0 could not start the group's store at {address}: {exc}") from exc

    # Arrival: each rank registers once and states the world size it expects.
    if store.add(f"join/{rank}", 1) > 1:
        raise GroupError(f"rank {rank} joined group {address} twice; give every process a distinct rank.")
    store.set(f"world/{rank}", str(world_size))
    try:
        _await_arrivals(store, rank, world_size, timeout_s, address)
    except GroupError as exc:
        with contextlib.suppress(Exception):  # (rank 0's store may be gone)
            store.set(f"failed/{rank}", "1")
        if rank == 0 and not isinstance(exc, GroupTimeout):  # linger: the others read our world size from our store
            end = time.monotonic() + min(2.0, timeout_s)
            while time.monotonic() < end and not all(
                    store.check([f"failed/{r}"]) for r in range(1, world_size) if store.check([f"world/{r}"])):
                time.sleep(0.05)
        raise

    pg = _make_backend(PrefixStore("pg", store), rank, world_size, backend, timeout_s)
    pg._set_sequence_number_for_group()  # as torch does for its own groups (debug/flight-recorder bookkeeping)
    group = StatelessGroup(store, pg, rank, world_size, backend, device, timeout_s, address)
    # One tiny collective now: NCCL builds its communicator here rather than inside the first timed sync.
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        group.all_reduce(torch.full((1,), rank, dtype=torch.int32, device=device), "sum")
        group.synchronize("group warm-up")
    return group


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now (bind to port 0 and ask the OS which one it picked)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# What a backend says when a peer died or stopped answering (or it was torn down because of one). Anything else
# (a tensor on another device, an unknown op, NCCL's "invalid argument/usage") is a programming error: raised as is.
_PEER_GONE = re.compile(r"abort|remote process exited|network error|system error|Broken pipe|"
                        r"Connection (reset|closed|refused)|closed by peer|timed? ?out|timeout", re.I)


class StatelessGroup:
    """Trainer + receivers: tensor collectives on the backend, small Python objects through rank 0's TCPStore."""

    def __init__(self, store: TCPStore, pg: Any, rank: int, world_size: int, backend: str,
                 device: torch.device, timeout_s: float, address: str) -> None:
        self.store, self.pg, self.rank, self.world_size = store, pg, rank, world_size
        self.backend, self.device, self.timeout_s, self.address = backend, device, timeout_s, address  # "host:port"
        self._obj = PrefixStore("obj", store)  # object collectives' keys; _my_keys: this rank's, not yet freed
        self._seq, self._my_keys, self._closed = 0, [], False
        self.sync: Any = None  # labsupport.broadcast's SyncState: what it remembers between syncs

    def __repr__(self) -> str:
        return (f"StatelessGroup(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r}, "
                f"device={str(self.device)!r}, master={self.address})")

    # ------------------------------------------------------------------ tensor collectives (backend)
    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream: Any = None) -> None:
        """Broadcast ``tensor`` in place from ``src``, on NCCL ordered after ``stream`` (default: the current one)."""
        with torch.cuda.stream(stream) if stream is not None and self.backend == "nccl" else contextlib.nullcontext():
            self.wait_work(self.broadcast_many([tensor], src), "broadcast")

    def broadcast_many(self, tensors: list[torch.Tensor], src: int = 0) -> Any:
        """Start one launch (an NCCL group) broadcasting tensors from ``src``; returns what ``wait_work`` takes."""
        self._check_open()
        self._check_args(tensors, "broadcast", src)
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        if self.backend != "nccl" or len(tensors) == 1:  # gloo cannot group: one broadcast per tensor
            return [self._issue(lambda t=t: self.pg.broadcast([t], opts), "broadcast") for t in tensors]

        def grouped() -> Any:
            self.pg._start_coalescing()
            for t in tensors:
                self.pg.broadcast([t], opts)
            return self.pg._end_coalescing()

        return self._issue(grouped, "broadcast")

    def exchange(self, ops: list[tuple[str, torch.Tensor, int, int]]) -> Any:
        """Point-to-point: start every ``(kind, tensor, peer, tag)`` op, kind "send" or "recv", at once (one NCCL
        group: no pair waits for another; gloo matches each send to the recv with the same peer and tag).
        Returns what ``wait_work`` takes. Tensors must be contiguous and stay alive until it is waited on."""
        self._check_open()
        for kind, t, peer, _ in ops:
            self._check_args([t], kind, peer)

        def issue() -> Any:
            if self.backend == "nccl" and len(ops) > 1:
                self.pg._start_coalescing()
            works = [(self.pg.send if kind == "send" else self.pg.recv)([t], peer, tag) for kind, t, peer, tag in ops]
            return self.pg._end_coalescing() if self.backend == "nccl" and len(ops) > 1 else works

        return self._issue(issue, "send/recv") if ops else []

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        """In-place all-reduce (``op`` = "sum" | "max" | "min") of a tensor on this group's device."""
        self._check_open()
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        if op not in ops:
            raise ValueError(f"all_reduce op must be one of {list(ops)}, got {op!r}")
        self._check_args([tensor], "all_reduce")
        opts = dist.AllreduceOptions()
        opts.reduceOp = ops[op]
        self.wait_work(self._issue(lambda: self.pg.allreduce([tensor], opts), f"all_reduce({op})"), f"all_reduce({op})")

    def wait_work(self, work: Any, what: str = "collective") -> None:
        """Wait for a Work (or a list): on NCCL the current stream waits, on gloo the host (with a timeout)."""
        try:
            with torch.cuda.device(self.device) if self.backend == "nccl" else contextlib.nullcontext():
                for w in work if isinstance(work, list) else [work]:
                    w.wait()  # on NCCL: the group's device's current stream waits
        except Exception as exc:  # gloo timeout, a peer that closed its connection, an aborted communicator
            if not _peer_gone(exc):
                raise  # (not a lost peer: the group is left as it is)
            raise self._lost(what, exc) from exc

    def synchronize(self, what: str = "work") -> None:
        """Block the host until the device work queued so far is done, but never longer than the timeout: NCCL
        kernels waiting on a dead peer spin forever, so we poll an event, then abort and raise ``GroupTimeout``."""
        if self.backend != "nccl":
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))  # this group's device, whatever the current one is
        start = time.monotonic()
        while not event.query():
            now = time.monotonic()
            if now - start > 0.5:  # spin first (accurate timings), then poll gently
                time.sleep(0.001)
            if now - start > self.timeout_s:
                raise self._lost(what, waited_s=self.timeout_s)

    @property
    def closed(self) -> bool:
        """True once destroyed, or aborted after a lost peer; every later collective then raises ``GroupError``."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise GroupError(f"{self!r} was destroyed (or aborted after an error); create a new group.")

    def _check_args(self, tensors: list[torch.Tensor], what: str, peer: int | None = None) -> None:
        """Programming errors, raised at once (``ValueError``) and leaving the group usable: a rank out of range, a
        tensor on another device than the group's (NCCL would fail or, worse, use the wrong GPU)."""
        if peer is not None and not 0 <= peer < self.world_size:
            raise ValueError(f"{what}: rank {peer} is not in this group of {self.world_size} ranks (0..{self.world_size - 1})")
        for t in tensors:
            if t.device.type != self.device.type or (self.device.type == "cuda" and t.device != self.device):
                raise ValueError(f"{what}: expected a tensor on this group's device {self.device}, found one on "
                                 f"{t.device} (shape {tuple(t.shape)}, {t.dtype}); move it with .to({str(self.device)!r})")

    def _issue(self, fn: Callable[[], Any], what: str) -> Any:
        """Start a collective (on the group's device); a backend torn down by a dead peer becomes ``GroupTimeout``,
        any other error (a programming error) is raised as it is and leaves the group usable."""
        try:
            with torch.cuda.device(self.device) if self.backend == "nccl" else contextlib.nullcontext():
                return fn()
        except RuntimeError as exc:  # DistBackendError "NCCL communicator was aborted", broken store pipe, ...
            if _peer_gone(exc):
                raise self._lost(what, exc) from exc
            raise

    def _lost(self, what: str, exc: BaseException | None = None, waited_s: float | None = None) -> GroupTimeout:
        """Abort the backend and build the error for a collective that failed: which peers stopped answering."""
        self.abort()
        cause = f"did not finish within {waited_s:.0f} s" if waited_s is not None else (
            f"failed ({type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]})" if exc else "failed")
        gone = self.unresponsive_peers()
        if 0 in gone and self.rank != 0 and not self._store_answers():
            who = "rank 0 vanished (it hosts the group's store, and its store no longer answers)"
        elif gone:
            who = f"rank(s) {gone} did not answer a liveness check through the store (dead or hung)"
        else:
            who = "every peer still answers, so one of them probably called a different collective"
        return GroupTimeout(f"rank {self.rank}: {what} on group {self.address} {cause}: {who}. "
                            "The group was aborted; check those ranks' logs, then create a new group.")

    def unresponsive_peers(self) -> list[int]:
        """After a failure: ranks that do not check in through the store within timeout + 1 s (at most 20 s);
        [0] if rank 0's store is gone."""
        gone = None
        try:
            self.store.set(f"alive/{self.rank}", "1")
            deadline = time.monotonic() + min(self.timeout_s + 1.0, 20.0)
            while True:
                gone = [r for r in range(self.world_size) if r != self.rank and not self.store.check([f"alive/{r}"])]
                if not gone or time.monotonic() > deadline:
                    return gone
                time.sleep(0.05)
        except Exception:  # the store's host (rank 0) is gone: now (it had answered), or from the start
            return gone if gone is not None and 0 not in gone else ([0] if self.rank != 0 else [])

    def _store_answers(self) -> bool:
        """Whether rank 0's store still answers (rank 0 alive, if perhaps hung)."""
        try:
            self.store.check(["alive/0"])
            return True
        except Exception:
            return False

    # ------------------------------------------------------------------ object collectives (store)
    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Send a picklable object from ``src`` to every rank; returns it on all ranks."""
        self._check_open()
        self._seq += 1
        key = f"op{self._seq}"
        if self.rank == src:
            self._store_op(lambda: self._obj.set(key, pickle.dumps(obj)), "broadcast_object")
            self._my_keys.append(key)
            return obj
        self._wait_keys({src: key}, "broadcast_object")
        return pickle.loads(self._store_op(lambda: self._obj.get(key), "broadcast_object"))

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's object, in rank order."""
        self._check_open()
        self._seq += 1
        keys = {r: f"op{self._seq}/{r}" for r in range(self.world_size)}
        self._store_op(lambda: self._obj.set(keys[self.rank], pickle.dumps(obj)), "all_gather_object")
        self._wait_keys(keys, "all_gather_object")
        out = [obj if r == self.rank else pickle.loads(self._store_op(lambda k=k: self._obj.get(k), "all_gather_object"))
               for r, k in keys.items()]
        # Everyone has now passed every earlier op, so keys this rank wrote before are no longer read.
        for k in self._my_keys:
            with contextlib.suppress(Exception):  # (a key the store already lost: nothing to free)
                self._obj.delete_key(k)
        self._my_keys = [keys[self.rank]]
        return out

    def barrier(self) -> None:
        """Wait until every rank gets here (through the store, with the group's timeout)."""
        self.all_gather_object(None)

    def _wait_keys(self, keys: dict[int, str], what: str) -> None:
        try:
            self._obj.wait(list(keys.values()), timedelta(seconds=self.timeout_s))
        except Exception as exc:
            try:
                missing = [r for r, k in keys.items() if not self._obj.check([k])]
            except Exception:  # the store itself is gone (rank 0 died)
                missing = [0]
            raise GroupTimeout(
                f"rank {self.rank}: {what} waited {self.timeout_s:.0f} s; rank(s) {missing or '?'} never "
                f"answered on group {self.address}. Did they die, or call a different sequence of collectives?"
            ) from exc

    def _store_op(self, fn: Callable[[], Any], what: str) -> Any:
        try:
            return fn()
        except Exception as exc:  # the store's host died (broken pipe, connection reset)
            raise self._lost(what, exc) from exc

    # ------------------------------------------------------------------ teardown
    def abort(self) -> None:
        """Tear the backend down without waiting for peers (after an error); the group is unusable after."""
        self._close("abort", "shutdown")

    def destroy(self) -> None:
        """Release the backend (NCCL communicators, gloo sockets) without waiting for the peers. Safe to call twice.

        NCCL's graceful ``shutdown`` (``ncclCommFinalize`` + ``ncclCommDestroy``) returns only once every rank has
        called it. A trainer and an engine tear down one after the other (the engine's RPC returns, then the
        trainer leaves), so it hung (Lab 4 on 2x H100). Every operation of this group has been waited for by then
        (each sync ends with a synchronize), so NCCL's abort, which is local, loses nothing."""
        if self.backend == "nccl":
            self._close("abort", "shutdown")
        else:
            self._close("shutdown")
        self.pg = None

    def _close(self, *ways: str) -> None:
        """Mark the group closed (once) and call the first of the backend's teardown methods that works."""
        if self._closed:
            return
        self._closed = True
        for way in ways:
            with contextlib.suppress(Exception):  # (a backend a dead peer already broke may raise here)
                return getattr(self.pg, way)()


def _peer_gone(exc: BaseException) -> bool:
    """Whether a backend error means a peer died or stopped answering (see ``_PEER_GONE``)."""
    return isinstance(exc, dist.DistNetworkError) or bool(_PEER_GONE.search(str(exc)))


def _make_backend(store: Any, rank: int, world_size: int, backend: str, timeout_s: float) -> Any:
    """Build the backend object directly (no default group, nothing registered globally)."""
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout_s))
    opts = dist.ProcessGroupNCCL.Options()
    # The watchdog waits longer than our host-side waits, so our clear GroupTimeout comes first; error handling
    # "2" cleans up the communicator without killing the process (torch's default, 3, kills it).
    opts._timeout = timedelta(seconds=timeout_s * 2 + 30)
    opts.is_high_priority_stream = True  # a broadcast ready beside copy kernels gets the SMs first
    # Set for the constructor only, which reads it from the environment alone (Options has no field for it):
    old = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = old or "2"
    try:
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    finally:
        if old is None:
            os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)


def _await_arrivals(store: Any, rank: int, world_size: int, timeout_s: float, address: str) -> None:
    """Wait until every rank has joined and check that all expect the same world size."""
    deadline = time.monotonic() + timeout_s
    seen: dict[int, int] = {}
    while True:
        try:
            for r in range(world_size):
                if r not in seen and store.check([f"world/{r}"]):
                    seen[r] = int(store.get(f"world/{r}"))
        except Exception as exc:
            raise GroupError(
                f"rank {rank} lost contact with rank 0 (the host of group {address}) while joining; rank 0 "
                f"probably failed: see its error. ({str(exc).splitlines()[0][:200]})") from None
        wrong = {r: w for r, w in seen.items() if w != world_size}
        if wrong:
            raise GroupError(
                f"ranks disagree on world_size in group {address}: rank {rank} expects {world_size}, but "
                + ", ".join(f"rank {r} expects {w}" for r, w in sorted(wrong.items()))
                + ". Pass the same world_size (1 trainer + number of receivers) to every rank.")
        if len(seen) == world_size:
            return
        if time.monotonic() > deadline:
            missing = [r for r in range(world_size) if r not in seen]
            raise GroupTimeout(
                f"rank {rank}: rank(s) {missing} never joined group {address} within {timeout_s:.0f} s "
                f"(world_size={world_size}). Start them with the same address/port, or raise timeout_s.")
        time.sleep(0.02)
