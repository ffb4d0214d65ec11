"""Assignment 3, seeded bug: one broadcast per tensor instead of per bucket (the bytes arrive, but a model of
hundreds of tensors pays hundreds of collective launches: the latency that bucketing exists to remove)."""

import torch

from grading.reference import a2 as buckets

LOSES = {"test_each_bucket_is_loaded_after_it_arrived",
         "test_one_object_then_one_broadcast_per_bucket",
         "test_any_rank_can_be_the_source",
         "test_no_rank_returns_before_every_rank_has_every_bucket"}


def send(group, state, bucket_bytes=64 << 20, src=0):
    metas = [buckets.meta(n, t) for n, t in state.items()]
    group.broadcast_object((metas, bucket_bytes), src)
    for name, _, _ in metas:  # the bug: every tensor on its own
        group.broadcast(state[name].detach().contiguous().clone(), src)
    return sum(buckets.nbytes(m) for m in metas)


def receive(group, load, src=0):
    metas, _ = group.broadcast_object(None, src)
    for name, dtype, shape in metas:
        t = torch.empty(shape, dtype=getattr(torch, dtype), device=group.device)
        group.broadcast(t, src)
        load([(name, t)])
    return sum(buckets.nbytes(m) for m in metas)
