"""Assignment 4: an IPC handoff: one process's tensors into another's on the same machine, without a copy.

Problem: in a co-located layout the trainer (the owner) and an inference engine are two processes on one
machine, often on one GPU. The owner's weights must reach the engine's tensors without a trip through the
host and without a second copy in GPU memory: the engine *maps* the owner's memory and copies from it into
its own weights. Design the handle that travels between them and the four steps around it.

Contract (``grading/test_a4_handoff.py``: a second process; a simulated remap on the CPU; real CUDA IPC on a
GPU, with the GPUs numbered in reverse on the receiver's side where there are two):

- ``export`` returns a buffer the owner keeps and a small picklable ``Handle`` (a few hundred bytes plus its
  entries; no tensor in it), safe to send *at once*: on a GPU the buffer's bytes must be there before anyone
  maps it (the copies into it are queued on the owner's GPU);
- each export is independent: two can be live at once, and releasing one leaves the other intact;
- ``rebuild`` maps the owner's memory (a write through a view lands in the owner's buffer);
- the GPU is named by its UUID: ``CUDA_VISIBLE_DEVICES`` may number the GPUs differently in each process, so
  an index means nothing across processes;
- ``load`` writes into the receiver's own tensors in place; once it returns, the receiver no longer reads
  the owner's memory;
- ``release`` frees the memory, once every receiver has dropped its views and the owner its buffer.

Two kinds of memory, one code path. GPU: CUDA IPC (``torch.multiprocessing.reductions``: ``reduce_tensor``
gives ``(rebuild_cuda_tensor, args)``, and ``args`` holds a ``storage_device`` index). CPU stand-in: a file in
``SHM_DIR`` (``/dev/shm``) that both processes map *shared* (``torch.UntypedStorage.from_file``); the handle's
``where`` is ``(path, size)``.

Given: ``Handle(gpu, where, entries)`` (``gpu``: the UUID, or None on the CPU), Assignment 2's functions in
``labsupport.core.buckets``, and ``labsupport.core.devices.gpu_uuid``. Lab 5 runs the course's own handoff first.
"""

from __future__ import annotations

import inspect  # noqa: F401  (the storage_device argument's position: inspect.signature(rebuild_cuda_tensor))
import os  # noqa: F401
from typing import Mapping

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor  # noqa: F401

from labsupport.core import buckets  # noqa: F401  (given)
from labsupport.core.handoff import SHM_DIR, Handle  # noqa: F401  (given)
from labsupport.core.devices import gpu_uuid  # noqa: F401  (given)


def export(named: list[tuple[str, torch.Tensor]], path: str | None = None) -> tuple[torch.Tensor, Handle]:
    """Owner side: ``named`` (tensors on one device) in a new shareable buffer on that device, and its handle.
    Returns ``(buffer, handle)``: the owner keeps the buffer alive until ``release``; the handle may be pickled
    and sent at once, and another export may follow before this one is released. On the CPU the buffer is the
    shared-memory file ``path`` (None: a new name in ``SHM_DIR``); on a GPU ``path`` is not used."""
    raise NotImplementedError


def rebuild(handle: Handle) -> list[tuple[str, torch.Tensor]]:
    """Receiver side, in another process: ``[(name, view)]`` in the handle's order, each a view of the owner's
    memory (not a copy), on this process's own index of the handle's GPU. Raises (``local_index``'s error) if
    this process cannot see that GPU."""
    raise NotImplementedError


def local_index(gpu: str) -> int:
    """This process's CUDA index of the GPU whose UUID is ``gpu``. If this process cannot see it: a
    ``RuntimeError`` that names the GPUs (UUIDs) it does see, so that the person reading it can fix the
    placement."""
    raise NotImplementedError


@torch.no_grad()
def load(params: Mapping[str, torch.Tensor], views: list[tuple[str, torch.Tensor]]) -> int:
    """Write each view into the tensor ``params[name]`` in place (the same objects, whatever their strides);
    returns the bytes copied. When it returns the copies are done (on a GPU too): the owner may release its
    memory once every receiver has returned."""
    raise NotImplementedError


def release(handle: Handle) -> None:
    """Owner side, once every receiver has dropped its views and the owner its buffer: free this export's
    memory (on the CPU nothing of it may be left in ``SHM_DIR``), and nothing of any other export."""
    raise NotImplementedError
