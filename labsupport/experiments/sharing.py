"""What a second process sees of an exported handle: Lab 5's proof that nothing is copied.

``probe_in_peer`` rebuilds a ``labsupport.ipc`` handle in a fresh process (a ``course.peer.Peer``)
and reports what it sees: the device, the values, and ``memory_probe`` before and after. Lab 5 and
the tests use it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from labsupport.core.devices import gpu_uuid, synchronize
from labsupport.course.peer import Peer
from labsupport.ipc import IpcError, ack, device_of, rebuild


def memory_probe(device: str | torch.device = "cpu") -> dict[str, int]:
    """Numbers that show sharing: CUDA allocator and device free bytes, or /proc's private and
    shared RSS."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        return {"allocated": torch.cuda.memory_allocated(device),
                "reserved": torch.cuda.memory_reserved(device), "device_free": free,
                "device_total": total}
    keys = {"RssAnon": "rss_anon", "RssShmem": "rss_shmem", "VmRSS": "rss"}
    with open("/proc/self/status") as f:
        fields = [line.partition(":") for line in f]
    return {keys[k]: int(v.split()[0]) * 1024 for k, _, v in fields if k in keys}


def _probe_peer(inbox: Any, outbox: Any) -> None:
    """Peer loop: rebuild each handle received (once), report what this process sees, write when
    asked; "drop" lets go of a handle's views and acks it."""
    # by (guard path, serial): serials restart per Exporter
    views: dict[tuple[str, int], list[torch.Tensor]] = {}
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
            outbox.put({"device": str(ts[0].device), "uuid": gpu_uuid(ts[0].device.index)
                        if ts[0].is_cuda else None,
                        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "sum": total,
                        "head": ts[0].flatten()[:4].tolist(), "before": before, "after": after})
            ts = t = None  # only `views` may keep the mapping alive (until "drop")
        except IpcError as err:
            outbox.put({"error": str(err)})


def probe_in_peer(handle: Any, *, fill: float | None = None,
                  env: Mapping[str, str] | None = None, timeout_s: float = 120.0) -> dict:
    """Rebuild ``handle`` in a fresh process (with ``env``, e.g. CUDA_VISIBLE_DEVICES="1,0"),
    writing ``fill`` through it if given, then drop and ack it; returns what it saw (device, UUID,
    sum, head, memory before/after) or ``{"error": ...}``."""
    with Peer(_probe_peer, env=env) as peer:
        out = peer.call(("fill" if fill is not None else "read", handle, fill), timeout_s)
        peer.call(("drop", handle), timeout_s)
        return out
