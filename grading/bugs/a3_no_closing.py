"""Assignment 3, seeded bug: no closing collective and no wait on the host: over gloo the last broadcast's sender
returns once its bytes are on their way, over NCCL once it is queued; a trainer moves on (or a receiver loads a
bucket still arriving) and a dead peer goes unnoticed."""

import torch

from grading.reference import a2 as buckets

LOSES = {"test_no_rank_returns_before_every_rank_has_every_bucket"}


def send(group, state, bucket_bytes=64 << 20, src=0):
    metas = [buckets.meta(n, t) for n, t in state.items()]
    group.broadcast_object((metas, bucket_bytes), src)
    for bucket in buckets.split(metas, bucket_bytes):
        entries, size = buckets.layout(bucket)
        buf = torch.empty(size, dtype=torch.uint8, device=group.device)
        buckets.pack(buf, entries, [state[m.name] for m in bucket])
        group.broadcast(buf, src)
    return sum(buckets.nbytes(m) for m in metas)  # the bug: no all_reduce, no synchronize


def receive(group, load, src=0):
    metas, bucket_bytes = group.broadcast_object(None, src)
    for bucket in buckets.split(metas, bucket_bytes):
        entries, size = buckets.layout(bucket)
        buf = torch.empty(size, dtype=torch.uint8, device=group.device)
        group.broadcast(buf, src)
        load(buckets.unpack(buf, entries))
    return sum(buckets.nbytes(m) for m in metas)  # the bug: no all_reduce, no synchronize
