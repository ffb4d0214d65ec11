"""Weight sync over NCCL in straight lines: metadata first, then one broadcast per bucket, then load.

The trainer (rank ``src``) calls ``send``; every inference rank calls ``receive`` at the same time, in the same
group (a ``labsupport.groups`` group: NCCL between GPUs, gloo on the CPU stand-in; one code path). In order:

1. metadata: the trainer sends every tensor's name, dtype and shape, and the bucket size, as one small object;
2. buckets: both sides split the same list into the same buckets; per bucket the trainer packs its tensors
   into one flat buffer and broadcasts it, and each receiver receives into a buffer of the same size;
3. load: the receiver slices the buffer back into named tensors and hands them to ``load`` (a vLLM worker
   would call ``model.load_weights(weights=...)``; here, a copy into the receiver's own weights).

``labsupport.broadcast`` is this plus what production needs; Lab 3 lists each addition and what it guards against.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from labsupport.core import buckets
from labsupport.groups import StatelessGroup

Batch = list[tuple[str, torch.Tensor]]


def send(group: StatelessGroup, state: Mapping[str, torch.Tensor], bucket_bytes: int = 64 << 20,
         src: int = 0) -> int:
    """Trainer side: broadcast ``state`` (name -> tensor) to every other rank; returns the bytes sent."""
    metas = [buckets.meta(name, t) for name, t in state.items()]
    group.broadcast_object((metas, bucket_bytes), src)  # 1. metadata
    for bucket in buckets.split(metas, bucket_bytes):  # 2. one broadcast per bucket
        entries, size = buckets.layout(bucket)
        buf = torch.empty(size, dtype=torch.uint8, device=group.device)
        buckets.pack(buf, entries, [state[name] for name, _, _ in bucket])
        group.broadcast(buf, src)
    return sum(buckets.nbytes(m) for m in metas)


def receive(group: StatelessGroup, load: Callable[[Batch], None], src: int = 0) -> int:
    """Receiver side: receive one update from ``src`` and ``load`` it, bucket by bucket; returns the bytes."""
    metas, bucket_bytes = group.broadcast_object(None, src)  # 1. metadata
    for bucket in buckets.split(metas, bucket_bytes):  # 2. the same buckets, in the same order
        entries, size = buckets.layout(bucket)
        buf = torch.empty(size, dtype=torch.uint8, device=group.device)
        group.broadcast(buf, src)
        load(buckets.unpack(buf, entries))  # 3. load: views into the bucket, nothing copied yet
    return sum(buckets.nbytes(m) for m in metas)


def copy_into(state: Mapping[str, torch.Tensor]) -> Callable[[Batch], None]:
    """A ``load`` that copies each received tensor into ``state[name]``, in place."""
    @torch.no_grad()
    def load(batch: Batch) -> None:
        for name, t in batch:
            state[name].copy_(t)

    return load
