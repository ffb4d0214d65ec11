"""A CUDA IPC weight handoff in straight lines: export, rebuild with device remap, load, release.

The owner (a trainer) packs named tensors into one flat buffer and *exports* it as a small picklable
``Handle``; another process on the machine (an inference engine) *rebuilds* the buffer (mapping the
owner's memory: nothing is copied), *loads* the views into its weights and drops them; the owner
*releases* the buffer. A GPU buffer goes through CUDA IPC (``reduce_tensor``), its handle naming the
GPU by UUID for the receiver to find among its own indices (``CUDA_VISIBLE_DEVICES`` may renumber
them); a CPU buffer is a file in ``/dev/shm``. ``labsupport.ipc`` hardens it (Lab 5).
"""

from __future__ import annotations

import os
import uuid as uuidlib
from dataclasses import dataclass
from typing import Mapping

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from labsupport.core import buckets
from labsupport.core.devices import gpu_uuid, storage_device_slot

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


@dataclass(frozen=True)
class Handle:
    """What travels to the other process (a few hundred bytes): where the buffer is, its layout."""
    gpu: str | None  # the GPU's UUID; None: a shared-memory file on the CPU
    where: tuple  # CUDA: reduce_tensor's arguments; CPU: (file path, size)
    entries: list[buckets.Entry]


def export(named: list[tuple[str, torch.Tensor]],
           path: str | None = None) -> tuple[torch.Tensor, Handle]:
    """Owner side: ``named`` packed into a new shared buffer (keep it until ``release``; on the CPU
    the file ``path``, default a new one in ``SHM_DIR``) and its handle (for the receiver)."""
    entries, size = buckets.layout([buckets.meta(name, t) for name, t in named])
    device = named[0][1].device
    if device.type == "cuda":
        buf = torch.empty(size, dtype=torch.uint8, device=device)
        buckets.pack(buf, entries, [t for _, t in named])
        torch.cuda.synchronize(device)  # the bytes are there before anyone maps them
        return buf, Handle(gpu_uuid(device.index), tuple(reduce_tensor(buf)[1]), entries)
    path = path or os.path.join(SHM_DIR, f"labsupport-core-{uuidlib.uuid4().hex}.shm")
    with open(path, "xb") as f:
        f.truncate(size)
    buf = _mapped(path, size)
    buckets.pack(buf, entries, [t for _, t in named])
    return buf, Handle(None, (path, size), entries)


def _mapped(path: str, size: int) -> torch.Tensor:
    """The file ``path`` mapped shared into this process, as ``size`` bytes."""
    storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=size)
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (size,), (1,))


def rebuild(handle: Handle) -> list[tuple[str, torch.Tensor]]:
    """Receiver side: map the owner's buffer into this process; returns ``[(name, view)]``."""
    if handle.gpu is None:
        buf = _mapped(*handle.where)
    else:
        args = list(handle.where)
        args[storage_device_slot()] = local_index(handle.gpu)  # device remap: theirs -> ours
        buf = rebuild_cuda_tensor(*args)
    return buckets.unpack(buf, handle.entries)


def local_index(gpu: str) -> int:
    """This process's CUDA index of the GPU with UUID ``gpu``."""
    here = [gpu_uuid(i) for i in range(torch.cuda.device_count())]
    if gpu not in here:
        raise RuntimeError(
            f"this process cannot see GPU {gpu} (it sees {here or 'no GPU'}; CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}): CUDA IPC works on one physical "
            "GPU; place the receiver there, or send the weights over NCCL (labsupport.broadcast)")
    return here.index(gpu)


def load(params: Mapping[str, torch.Tensor], views: list[tuple[str, torch.Tensor]]) -> int:
    """Copy each view into ``params[name]`` (the engine's own weights); returns the bytes copied."""
    nbytes = buckets.load_into(params, views)
    if views and views[0][1].is_cuda:
        torch.cuda.synchronize(views[0][1].device)  # done reading the owner's memory
    return nbytes


def release(handle: Handle) -> None:
    """Owner side, once every receiver dropped its views and the owner its buffer: free it."""
    if handle.gpu is None:
        os.unlink(handle.where[0])  # the file's pages go when the last process unmaps them
    else:
        torch.cuda.ipc_collect()  # the block returns to the allocator once no process holds it
