"""Assignment 4: a CUDA IPC handoff: export, rebuild in another process by GPU UUID, load, release.

The owner (a trainer) packs named tensors into one flat buffer and exports it as a small picklable ``Handle``;
another process on the same machine (an inference engine) rebuilds the buffer from it, which maps the owner's
memory (nothing is copied), loads the views into its own weights and drops them; then the owner releases the
buffer. One code path, two kinds of memory:

- GPU: CUDA IPC. ``torch.multiprocessing.reductions.reduce_tensor(buf)`` returns ``(rebuild_cuda_tensor,
  args)``; ``rebuild_cuda_tensor(*args)`` in the other process maps the memory. ``args`` names the GPU by the
  owner's CUDA index, which means nothing in a process whose ``CUDA_VISIBLE_DEVICES`` numbers the GPUs
  differently: the handle carries the GPU's UUID (``gpu_uuid(index)``), and the receiver puts *its* index of
  that GPU in the ``storage_device`` argument. The owner's copies into the buffer are queued on the GPU:
  they must have finished before the handle leaves the owner.
- CPU stand-in: a file in ``SHM_DIR`` (``/dev/shm``) that both processes map *shared*
  (``torch.UntypedStorage.from_file(path, shared=True, nbytes=size)``); the handle's ``where`` is
  ``(path, size)``, and releasing removes the file.

Given: ``Handle(gpu, where, entries)`` (``gpu``: the UUID, or None on the CPU), Assignment 2's functions in
``labsupport.core.buckets``, and ``gpu_uuid``. Graded by ``grading/test_a4_handoff.py`` (a second process;
a simulated remap on the CPU; real CUDA IPC on a GPU).
"""

from __future__ import annotations

import inspect  # noqa: F401  (the storage_device argument's position: inspect.signature(rebuild_cuda_tensor))
import os  # noqa: F401
from typing import Mapping

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor  # noqa: F401

from labsupport.core import buckets  # noqa: F401  (given)
from labsupport.core.handoff import SHM_DIR, Handle  # noqa: F401  (given)
from labsupport.course.hardware import gpu_uuid  # noqa: F401  (given)


def export(named: list[tuple[str, torch.Tensor]], path: str | None = None) -> tuple[torch.Tensor, Handle]:
    """Owner side: pack ``named`` into a new shared buffer on their device (a new ``/dev/shm`` file on the CPU);
    returns the buffer (the owner keeps it alive until ``release``) and its handle, safe to send at once."""
    raise NotImplementedError


def rebuild(handle: Handle) -> list[tuple[str, torch.Tensor]]:
    """Receiver side: map the owner's buffer into this process (on a GPU, on this process's index of the
    handle's GPU) and return ``[(name, view)]``: views of the owner's memory, not copies."""
    raise NotImplementedError


def local_index(gpu: str) -> int:
    """This process's CUDA index of the GPU whose UUID is ``gpu``; a ``RuntimeError`` naming the GPUs this
    process sees if it is not among them."""
    raise NotImplementedError


@torch.no_grad()
def load(params: Mapping[str, torch.Tensor], views: list[tuple[str, torch.Tensor]]) -> int:
    """Copy each view into ``params[name]`` in place; returns the bytes copied. On a GPU, wait for the copies
    before returning: the owner may release its memory once every receiver has returned."""
    raise NotImplementedError


def release(handle: Handle) -> None:
    """Owner side, once every receiver has dropped its views and the owner its buffer: free the memory
    (CPU: remove the file; GPU: ``torch.cuda.ipc_collect()``)."""
    raise NotImplementedError
