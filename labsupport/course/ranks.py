"""Run a function on N ranks, each in a fresh process, with a deadline: the launcher of the tests and benchmarks.

Not a mechanism the book teaches (trainers use torchrun, Ray or vLLM's own launchers), but what lets a
benchmark or a test start a trainer and its receivers on one machine and never hang: a rank that dies
silently or outlives the deadline is reported (and killed), not waited for.
"""

from __future__ import annotations

import pickle
import queue as queues
import time
import traceback
from typing import Any, Callable

import torch


def run_ranks(fn: Callable[..., Any], world_size: int, args: tuple = (), *, timeout_s: float = 120.0,
              cpu_threads: int | None = 1) -> list[tuple[bool, Any]]:
    """Run ``fn(rank, world_size, *args)`` in fresh processes (forked from a forkserver that imported torch once);
    return ``[(ok, result)]`` by rank. A failure gives ``(False, (type name, message, traceback))``: "Died" for a
    silent exit, "Timeout" for a rank killed after ``timeout_s`` (a hung collective never hangs the caller)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "labsupport.broadcast"])
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_entry, args=(fn, r, world_size, args, queue, cpu_threads), daemon=True)
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
            except Exception as exc:  # a result this process cannot unpickle: that rank's failure, named
                results[rank] = (False, (type(exc).__name__, f"rank {rank}'s result could not be unpickled: {exc}",
                                         traceback.format_exc()))
            for r, p in enumerate(procs):  # exited without reporting (its last message would be in the queue)
                if r not in results and p.exitcode is not None and queue.empty():
                    results[r] = (False, ("Died", f"rank {r} exited with code {p.exitcode}", ""))
    finally:
        for r, p in enumerate(procs):
            p.join(timeout=5 if r in results else 0.1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
            results.setdefault(r, (False, ("Timeout", f"rank {r} still running after {timeout_s:.0f} s; killed", "")))
    return [results[r] for r in range(world_size)]


def _rank_entry(fn: Callable[..., Any], rank: int, world_size: int, args: tuple, queue: Any,
                cpu_threads: int | None) -> None:
    if cpu_threads:
        torch.set_num_threads(cpu_threads)  # several ranks on few cores: avoid OpenMP oversubscription
    try:  # (pickled here, so that a result that cannot be pickled is reported as this rank's failure)
        queue.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException as exc:  # report every failure to the parent, with its type and message
        queue.put((rank, False, pickle.dumps((type(exc).__name__, str(exc), traceback.format_exc()))))
