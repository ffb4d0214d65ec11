"""A second process to talk to, and what it sees of shared memory.

``Peer`` spawns a process running ``fn(inbox, outbox, *args)`` and exchanges picklable messages with it,
never hanging (timeouts) and reporting the child's exceptions. ``probe_in_peer`` rebuilds a ``labsupport.ipc``
handle in a fresh process and reports what it sees (device, values, ``memory_probe`` before and after): Lab 5
and the tests use it to show that nothing is copied.
"""

from __future__ import annotations

import os
import queue as queue_mod
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import torch

from labsupport.core.devices import gpu_uuid, synchronize
from labsupport.ipc import IpcError, ack, device_of, rebuild


def memory_probe(device: str | torch.device = "cpu") -> dict[str, int]:
    """Numbers that show sharing: CUDA allocator and device free bytes, or /proc's private and shared RSS."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        return {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device),
                "device_free": free, "device_total": total}
    keys = {"RssAnon": "rss_anon", "RssShmem": "rss_shmem", "VmRSS": "rss"}
    with open("/proc/self/status") as f:
        fields = [line.partition(":") for line in f]
    return {keys[k]: int(v.split()[0]) * 1024 for k, _, v in fields if k in keys}


def _peer_main(fn: Callable, inbox: Any, outbox: Any, env: dict[str, str], args: tuple) -> None:
    os.environ.update(env)  # before anything initialises CUDA (e.g. CUDA_VISIBLE_DEVICES)
    try:
        fn(inbox, outbox, *args)
    except BaseException as err:  # raised in the parent; IpcError stays one (callers catch it across processes)
        text = "".join(traceback.format_exception(err))
        cls = IpcError if isinstance(err, IpcError) else RuntimeError
        outbox.put(cls(f"in peer process: {text.strip().splitlines()[-1]}\n{text}"))


class Peer:
    """A spawned process running ``fn(inbox, outbox, *args)`` (module-level; ``env`` set before CUDA starts),
    talked to with send() and recv(), which raises TimeoutError if nothing comes and RuntimeError if it died."""

    def __init__(self, fn: Callable, *args: Any, env: Mapping[str, str] | None = None) -> None:
        self.name = getattr(fn, "__name__", "peer")
        ctx = torch.multiprocessing.get_context("spawn")
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_peer_main, args=(fn, self.inbox, self.outbox, dict(env or {}), args),
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
                    raise RuntimeError(f"peer process {self.name} exited (code {self.proc.exitcode}) without "
                                       "answering") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"peer process {self.name} sent no message in {timeout_s:g} s") from None
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


def _probe_peer(inbox: Any, outbox: Any) -> None:
    """Peer loop: rebuild each handle received (once), report what this process sees, write when asked;
    "drop" lets go of a handle's views and acks it."""
    views: dict[tuple[str, int], list[torch.Tensor]] = {}  # by (guard path, serial): serials restart per Exporter
    while (msg := inbox.get()) is not None:
        op, handle, *rest = msg
        try:
            key = (handle.guard, handle.serial)
            if op == "drop":
                dropped = views.pop(key, None)
                if dropped:
                    synchronize(dropped[0].device)  # writes through the views have landed
                    dropped = None
                    ack(handle)  # views gone: now the exporter may release it
                outbox.put({"dropped": True})
                continue
            device = device_of(handle)
            before = memory_probe(device)
            ts = views.get(key)
            if ts is None:
                ts = views[key] = [v for _, v in rebuild(handle)]
            if op == "fill":
                for t in ts:
                    t.fill_(rest[0])
            total = sum(float(t.sum()) for t in ts)  # reads every byte (no private copy)
            after = memory_probe(device)
            outbox.put({"device": str(ts[0].device), "uuid": gpu_uuid(ts[0].device.index) if ts[0].is_cuda else None,
                        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "sum": total,
                        "head": ts[0].flatten()[:4].tolist(), "before": before, "after": after})
            ts = t = None  # only `views` may keep the mapping alive (until "drop")
        except IpcError as err:
            outbox.put({"error": str(err)})


def probe_in_peer(handle: Any, *, fill: float | None = None,
                  env: Mapping[str, str] | None = None, timeout_s: float = 120.0) -> dict:
    """Rebuild ``handle`` in a fresh process (with ``env``, e.g. CUDA_VISIBLE_DEVICES="1,0"), writing ``fill``
    through it if given, then drop and ack it; returns what it saw (device, UUID, sum, head, memory before/after)
    or ``{"error": ...}``."""
    with Peer(_probe_peer, env=env) as peer:
        out = peer.call(("fill" if fill is not None else "read", handle, fill), timeout_s)
        peer.call(("drop", handle), timeout_s)
        return out
