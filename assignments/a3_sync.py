"""Assignment 3: a weight sync over a stateless group: the trainer's tensors into every inference rank.

Problem: after each optimizer step the trainer (rank ``src``) must get its weights into every inference rank,
which then loads them into its model. Every rank calls in at the same time, in the same group
(``labsupport.groups.create_group``: NCCL between GPUs, gloo on the CPU; the same calls on both). Only the
trainer knows what it sends; the receivers learn the names, dtypes and shapes from it.

Contract (``grading/test_a3_sync.py``: a trainer and two receivers over gloo, on 2+ GPUs over NCCL):

- every receiver's own tensors end up holding the trainer's bytes; the trainer's tensors are unchanged;
- the cost is one small object and then one broadcast per bucket (Assignment 2's ``split`` of the trainer's
  tensors, in the trainer's order, at the trainer's ``bucket_bytes``), never one per tensor;
- ``load`` is called once per bucket, with that bucket's tensors, only once they have arrived;
- no rank returns before every rank has every bucket, and none waits forever: a dead or stuck peer is an
  error (an exception) within the group's deadline. Over NCCL a collective only queues work on the GPU:
  the host must wait for it with a deadline (``group.synchronize`` does that);
- any rank may be the trainer (``src``), and the same group serves one sync after another.

Given: ``labsupport.core.buckets`` (Assignment 2's functions: the course's, or yours in the student copy) and
the group's methods (``broadcast_object``, ``broadcast``, ``all_reduce``, ``synchronize``). Lab 3 runs the
course's own sync first; Chapter 4 explains the design.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from labsupport.core import buckets  # noqa: F401  (given: meta, nbytes, split, layout, pack, unpack)
from labsupport.groups import StatelessGroup

Batch = list[tuple[str, torch.Tensor]]


def send(group: StatelessGroup, state: Mapping[str, torch.Tensor], bucket_bytes: int = 64 << 20,
         src: int = 0, *, timeout_s: float | None = None) -> int:
    """Trainer side (this rank is ``src``): get ``state`` (name -> tensor, in its order) to every other rank,
    in buckets of at most ``bucket_bytes``. Returns the tensors' bytes (unpadded) once every rank has every
    bucket; raises if a peer fails or the deadline passes: ``timeout_s`` seconds for the final wait (None: the
    group's own deadline). ``state`` is left unchanged."""
    raise NotImplementedError


def receive(group: StatelessGroup, load: Callable[[Batch], None], src: int = 0, *,
            timeout_s: float | None = None) -> int:
    """Receiver side: take one update from rank ``src``, calling ``load`` once per bucket with that bucket's
    ``[(name, tensor)]`` after it has arrived (the tensors may be views into a buffer reused afterwards).
    Returns the bytes received, as ``send`` counts them, once every rank has every bucket; raises if a peer
    fails or the deadline passes (``timeout_s`` as in ``send``)."""
    raise NotImplementedError


def copy_into(state: Mapping[str, torch.Tensor]) -> Callable[[Batch], None]:
    """A ``load`` that writes each received tensor into the tensor ``state[name]`` *in place*: the receiver's
    own tensor objects (a model's parameters, which its kernels hold) change, the mapping's entries stay the
    same objects, and nothing keeps a reference into the bucket, which the next bucket may reuse."""
    raise NotImplementedError
