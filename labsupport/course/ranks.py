"""Run a function on N ranks, each in a fresh process, with a deadline: the launcher of the tests
and benchmarks.

Not a mechanism the book teaches (trainers use torchrun, Ray or vLLM's own launchers), but what lets
a benchmark or a test start a trainer and its receivers on one machine and never hang: a rank that
dies silently or outlives the deadline is reported (and killed), not waited for, with the Python
stack it hung in.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import queue as queues
import signal
import tempfile
import time
import traceback
from typing import Any, Callable

import torch


def run_ranks(fn: Callable[..., Any], world_size: int, args: tuple = (), *,
              timeout_s: float = 120.0, cpu_threads: int | None = 1) -> list[tuple[bool, Any]]:
    """Run ``fn(rank, world_size, *args)`` in fresh processes (forked from a forkserver that
    imported torch once); return ``[(ok, result)]`` by rank. A failure gives ``(False, (type name,
    message, traceback))``: "Died" for a silent exit, "Timeout" for a rank killed after
    ``timeout_s`` (a hung collective never hangs the caller; the traceback is every thread's stack
    at the deadline, where it hung)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "labsupport.broadcast"])
    queue, stacks = ctx.Queue(), tempfile.mkdtemp(prefix="ranks-")
    procs = [ctx.Process(target=_rank_entry, args=(fn, r, world_size, args, queue, cpu_threads,
                                                   stacks), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size and time.monotonic() < deadline:
            try:
                rank, ok, data = queue.get(timeout=0.5)
                results[rank] = (ok, pickle.loads(data))
            except queues.Empty:  # nothing within 0.5 s
                pass
            # a result this process cannot unpickle: that rank's failure, named
            except Exception as exc:
                results[rank] = (False, (type(exc).__name__, f"rank {rank}'s result could not be "
                                                             f"unpickled: {exc}",
                                         traceback.format_exc()))
            # exited without reporting (its last message would be in the queue)
            for r, p in enumerate(procs):
                if r not in results and p.exitcode is not None and queue.empty():
                    results[r] = (False, ("Died", f"rank {r} exited with code {p.exitcode}", ""))
    finally:
        for r, p in enumerate(procs):
            p.join(timeout=5 if r in results else 0.1)
            stack = _stack(p, f"{stacks}/{r}") if p.is_alive() and r not in results else ""
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
            hung = f"rank {r} still running after {timeout_s:.0f} s; killed"
            results.setdefault(r, (False, ("Timeout", hung, stack)))
        for r in range(world_size):
            with contextlib.suppress(OSError):
                os.unlink(f"{stacks}/{r}")
        os.rmdir(stacks)
    return [results[r] for r in range(world_size)]


def _stack(p: Any, path: str) -> str:
    """The stacks of a hung rank's threads (faulthandler writes them on SIGUSR1), read once they
    stop growing."""
    os.kill(p.pid, signal.SIGUSR1)
    text = ""
    for _ in range(20):  # (at most 2 s)
        time.sleep(0.1)
        with contextlib.suppress(OSError), open(path) as f:
            if (now := f.read()) and now == text:
                break
            text = now
    return text


def _rank_entry(fn: Callable[..., Any], rank: int, world_size: int, args: tuple, queue: Any,
                cpu_threads: int | None, stacks: str) -> None:
    # (kept open)
    faulthandler.register(signal.SIGUSR1, file=open(f"{stacks}/{rank}", "w"), all_threads=True)
    if cpu_threads:
        # several ranks on few cores: avoid OpenMP oversubscription
        torch.set_num_threads(cpu_threads)
    # (pickled here, so that a result that cannot be pickled is reported as this rank's failure)
    try:
        queue.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException as exc:  # report every failure to the parent, with its type and message
        queue.put((rank, False, pickle.dumps((type(exc).__name__, str(exc),
                                              traceback.format_exc()))))
