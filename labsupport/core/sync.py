"""Weight sync over NCCL in straight lines: metadata first, then one broadcast per bucket, then load.

The trainer (rank ``src``) calls ``send``; every inference rank calls ``receive`` at the same time, in the same
group (a ``labsupport.groups`` group: NCCL between GPUs, gloo on the CPU stand-in; one code path). In order:

1. metadata: the trainer sends every tensor's name, dtype and shape, and the bucket size, as one small object;
2. buckets: both sides split the same list into the same buckets; per bucket the trainer packs its tensors
   into one flat buffer and broadcasts it, and each receiver receives into a buffer of the same size;
3. load: the receiver slices the buffer back into named tensors and hands them to ``load`` (a vLLM worker
   would call ``model.load_weights(weights=...)``; here, a copy into the receiver's own weights);
4. done: one tiny all-reduce that every rank must reach, and the host waits for it with a deadline. On NCCL a
   broadcast only queues work on the GPU, so without this wait a dead peer would go unnoticed: the receiver
   would return, and load a partly received bucket later. Here it raises ``GroupTimeout`` instead (the weights
   may then be partly updated: ``labsupport.broadcast`` checks them).

``labsupport.broadcast`` is this plus what production needs; Lab 3 lists each addition and what it guards against.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping

import torch

from labsupport.core import buckets

if TYPE_CHECKING:  # (a name for the reader only: the core imports nothing outside core/)
    from labsupport.groups import StatelessGroup

Batch = list[tuple[str, torch.Tensor]]


def send(group: StatelessGroup, state: Mapping[str, torch.Tensor], bucket_bytes: int = 64 << 20,
         src: int = 0, *, timeout_s: float | None = None) -> int:
    """Trainer side: broadcast ``state`` (name -> tensor) to every other rank; returns the bytes sent. Waits at most
    ``timeout_s`` (default: the group's timeout) for the last bucket."""
    metas = buckets.metas(state)
    group.broadcast_object((metas, bucket_bytes), src)  # 1. metadata
    for bucket in buckets.split(metas, bucket_bytes):  # 2. one broadcast per bucket
        entries, size = buckets.layout(bucket)
        buf = torch.empty(size, dtype=torch.uint8, device=group.device)
        buckets.pack(buf, entries, [state[m.name] for m in bucket])
        group.broadcast(buf, src)
    group.all_reduce(torch.ones(1, device=group.device))  # 4. done: every rank gets here ...
    group.synchronize("the weight sync", timeout_s)  # ... and the host waits for that, with a deadline
    return sum(buckets.nbytes(m) for m in metas)


def receive(group: StatelessGroup, load: Callable[[Batch], None], src: int = 0, *,
            timeout_s: float | None = None) -> int:
    """Receiver side: receive one update from ``src`` and ``load`` it, bucket by bucket; returns the bytes. Waits at
    most ``timeout_s`` (default: the group's timeout) for the last bucket."""
    metas, bucket_bytes = group.broadcast_object(None, src)  # 1. metadata
    for bucket in buckets.split(metas, bucket_bytes):  # 2. the same buckets, in the same order
        entries, size = buckets.layout(bucket)
        buf = torch.empty(size, dtype=torch.uint8, device=group.device)
        group.broadcast(buf, src)
        load(buckets.unpack(buf, entries))  # 3. load: views into the bucket, nothing copied yet
    group.all_reduce(torch.ones(1, device=group.device))  # 4. done: every rank gets here ...
    group.synchronize("the weight sync", timeout_s)  # ... and the host waits for that, with a deadline
    return sum(buckets.nbytes(m) for m in metas)


def copy_into(state: Mapping[str, torch.Tensor]) -> Callable[[Batch], None]:
    """A ``load`` that copies each received tensor into ``state[name]``, in place (one multi-tensor copy)."""
    @torch.no_grad()
    def load(batch: Batch) -> None:
        if batch:
            torch._foreach_copy_([state[name] for name, _ in batch], [t for _, t in batch])

    return load
