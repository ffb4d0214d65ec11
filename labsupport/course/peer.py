"""A second process to talk to, with deadlines: the labs' two-process experiments and the capstone's
engine process.

``Peer`` spawns a process running ``fn(inbox, outbox, *args)`` and exchanges picklable messages with
it, never hanging (timeouts) and reporting the child's exceptions. ``experiments.sharing`` uses it
to show what a second process sees of a ``labsupport.ipc`` handle.
"""

from __future__ import annotations

import os
import queue as queue_mod
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import torch


def _peer_main(fn: Callable, inbox: Any, outbox: Any, env: dict[str, str], args: tuple) -> None:
    os.environ.update(env)  # before anything initialises CUDA (e.g. CUDA_VISIBLE_DEVICES)
    try:
        fn(inbox, outbox, *args)
    # raised in the parent, as a RuntimeError or, if its class says it crosses
    except BaseException as err:
        # processes (ipc.IpcError: callers catch it), as itself
        text = "".join(traceback.format_exception(err))
        cls = type(err) if getattr(type(err), "crosses_processes", False) else RuntimeError
        outbox.put(cls(f"in peer process: {text.strip().splitlines()[-1]}\n{text}"))


class Peer:
    """A spawned process running ``fn(inbox, outbox, *args)`` (module-level; ``env`` set before CUDA
    starts), talked to with send() and recv(), which raises TimeoutError if nothing comes and
    RuntimeError if it died."""

    def __init__(self, fn: Callable, *args: Any, env: Mapping[str, str] | None = None) -> None:
        self.name = getattr(fn, "__name__", "peer")
        ctx = torch.multiprocessing.get_context("spawn")
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_peer_main, args=(fn, self.inbox, self.outbox,
                                                         dict(env or {}), args),
                                daemon=True)
        self.proc.start()

    def send(self, obj: Any) -> None:
        self.inbox.put(obj)

    def recv(self, timeout_s: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                msg = self.outbox.get(timeout=0.2)
                break
            except queue_mod.Empty:
                if not self.proc.is_alive():
                    raise RuntimeError(f"peer process {self.name} exited (code "
                                       f"{self.proc.exitcode}) without answering") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"peer process {self.name} sent no message in {timeout_s:g} "
                                       "s") from None
        if isinstance(msg, Exception):  # the child failed (see _peer_main)
            raise msg
        return msg

    def call(self, msg: Any, timeout_s: float = 60.0) -> Any:
        self.send(msg)
        return self.recv(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        if self.proc.is_alive():
            self.inbox.put(None)
            self.proc.join(timeout_s)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        for q in (self.inbox, self.outbox):  # never block interpreter exit on undelivered messages
            q.cancel_join_thread()
            q.close()

    def __enter__(self) -> "Peer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
