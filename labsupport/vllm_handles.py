"""The IPC buckets a trainer sends a co-located vLLM engine: whole layers each (``layer_buckets``),
keyed by each worker's GPU UUID (``CUDA_VISIBLE_DEVICES`` does not renumber it; ``cpu:<host>`` on
the CPU), pickled (``pack_ipc_handles``) or as the plain dicts vLLM's RPC encoder makes of them."""

from __future__ import annotations

import pickle
import socket
from collections.abc import Mapping
from typing import Any

import torch

from labsupport import ipc
from labsupport.core import devices
from labsupport.core.buckets import groups as groups_of
from labsupport.vllm_weights import WeightUpdateError


def device_id(device: torch.device) -> str:
    """The id a trainer keys IPC handles by: the GPU's UUID, or ``cpu:<hostname>``."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return devices.gpu_uuid(index)
    return f"cpu:{socket.gethostname()}"


def pack_ipc_handles(handles: Mapping[str, Any]) -> bytes:
    """``{device_id: ipc.Handle | [ipc.Handle]}`` as bytes for ``update_weights_from_ipc``."""
    return pickle.dumps(dict(handles))


def layer_buckets(named: list[tuple[str, torch.Tensor]], bucket_bytes: int
                  ) -> list[list[tuple[str, torch.Tensor]]]:
    """Buckets of <= ``bucket_bytes`` never splitting a decoder layer (one may exceed it alone)."""
    by_layer: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, t in named:
        layer = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else name
        by_layer.setdefault(layer, []).append((name, t))
    layers = list(by_layer.values())
    sizes = [sum(t.nbytes for _, t in layer) for layer in layers]
    return [[item for i in idx for item in layers[i]] for idx in groups_of(sizes, bucket_bytes)]


def buckets_for(device: torch.device, handles: bytes | Mapping[str, Any]) -> list[ipc.Handle]:
    """The bucket handles for ``device`` in ``{device_id: handle or [handles]}``."""
    if isinstance(handles, (bytes, bytearray, memoryview)):
        handles = pickle.loads(bytes(handles))
    me = device_id(device)
    if me not in handles:
        raise WeightUpdateError(f"no IPC handle for this worker's device {me}; got handles for "
                                f"{sorted(handles)}. Key the trainer's handles by "
                                "report_device_id().")
    mine = handles[me]
    return [_as_bucket_handle(b) for b in (mine if isinstance(mine, (list, tuple)) else [mine])]


def _as_bucket_handle(h: Any) -> Any:
    """An ``ipc.Handle``, also from vLLM's plain dict (lists back to tuples: compared, to torch)."""
    def tuples(x: Any) -> Any:
        return tuple(tuples(v) for v in x) if isinstance(x, list) else x
    if isinstance(h, ipc.Handle):
        return h
    if not isinstance(h, Mapping) or "where" not in h or "entries" not in h:
        raise WeightUpdateError(f"expected a labsupport.ipc.Handle, found {type(h).__name__}; "
                                "export the weights with ipc.Exporter().export_bucket and send "
                                "pack_ipc_handles({device_id: handle})")
    return ipc.Handle(**{**h, "where": tuples(h["where"]),
                         "entries": [(n, d, tuple(s), off, k) for n, d, s, off, k in h["entries"]]})
