"""Assignment 3: a weight sync over a stateless group: metadata, then one broadcast per bucket, then load.

The trainer (rank ``src``) calls ``send``; every inference rank calls ``receive`` at the same time, in the same
group (``labsupport.groups.create_group``: NCCL between GPUs, gloo on the CPU; the same calls on both). In order:

1. metadata: the trainer sends every tensor's meta and the bucket size as one small object
   (``group.broadcast_object(obj, src)``, which returns the object on every rank);
2. buckets: both sides split the metas into the same buckets (Assignment 2's ``split``); per bucket the trainer
   packs its tensors into one ``uint8`` buffer on ``group.device`` and broadcasts it (``group.broadcast(buf,
   src)``, in place), and each receiver receives into an empty buffer of the same size;
3. load: the receiver slices each bucket back into named views and hands them to ``load``, bucket by bucket,
   once the bucket has arrived (a vLLM worker would call ``model.load_weights(weights=...)``);
4. done: both sides end with one ``group.all_reduce(torch.ones(1, device=group.device))`` and
   ``group.synchronize("the weight sync")``, so that no rank returns (and no host moves on) before every
   bucket reached every rank, and a dead peer is an error within the group's deadline, not a hang.

Given: ``labsupport.core.buckets`` (Assignment 2's functions: the course's, or yours in the student copy).
Graded by ``grading/test_a3_sync.py`` (3 processes over gloo; on 2+ GPUs also over NCCL).
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from labsupport.core import buckets  # noqa: F401  (given: meta, nbytes, split, layout, pack, unpack)
from labsupport.groups import StatelessGroup

Batch = list[tuple[str, torch.Tensor]]


def send(group: StatelessGroup, state: Mapping[str, torch.Tensor], bucket_bytes: int = 64 << 20,
         src: int = 0, *, timeout_s: float | None = None) -> int:
    """Trainer side: broadcast ``state`` (name -> tensor, in its order) to every other rank with one
    ``broadcast_object`` and then exactly one ``broadcast`` per bucket; returns the tensors' bytes (unpadded)."""
    raise NotImplementedError


def receive(group: StatelessGroup, load: Callable[[Batch], None], src: int = 0, *,
            timeout_s: float | None = None) -> int:
    """Receiver side: receive one update from ``src``, calling ``load`` once per bucket with that bucket's
    ``[(name, view)]`` after it has arrived; returns the bytes received (as ``send`` counts them)."""
    raise NotImplementedError


def copy_into(state: Mapping[str, torch.Tensor]) -> Callable[[Batch], None]:
    """A ``load`` that copies each received tensor into ``state[name]`` *in place*: the receiver's own tensors
    (a model's parameters) change, and nothing keeps a view into the bucket, which the next bucket may reuse."""
    raise NotImplementedError
