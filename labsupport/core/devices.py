"""The three device facts the core needs (and every other module imports from here): a GPU's
identity, a wait for its queue, a CUDA IPC handle's device slot."""

from __future__ import annotations

import functools
import inspect

import torch


def gpu_uuid(index: int) -> str:
    """The physical GPU's UUID (``GPU-...``), the same whatever CUDA_VISIBLE_DEVICES says."""
    uuid = str(torch.cuda.get_device_properties(index).uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


def synchronize(device: str | torch.device) -> None:
    """Wait for the work queued on ``device`` (a CUDA device); nothing to wait for on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@functools.cache
def storage_device_slot() -> int:
    """Where the device index sits in the arguments of torch's ``rebuild_cuda_tensor`` (a CUDA IPC
    handle's payload), looked up by name: the position is not part of torch's API."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return list(inspect.signature(rebuild_cuda_tensor).parameters).index("storage_device")
