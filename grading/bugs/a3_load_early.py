"""Assignment 3, seeded bug: each bucket is handed to ``load`` before the broadcast that fills it (the receiver
loads whatever its fresh buffer held: a silent wrong update, every byte "received")."""

import torch

from grading.reference import a2 as buckets

LOSES = {"test_receivers_hold_the_trainers_bytes",
         "test_each_bucket_is_loaded_after_it_arrived",
         "test_any_rank_can_be_the_source"}


def receive(group, load, src=0):
    metas, bucket_bytes = group.broadcast_object(None, src)
    for bucket in buckets.split(metas, bucket_bytes):
        entries, size = buckets.layout(bucket)
        buf = torch.zeros(size, dtype=torch.uint8, device=group.device)
        load(buckets.unpack(buf, entries))  # the bug: loaded before it arrived
        group.broadcast(buf, src)
    group.all_reduce(torch.ones(1, device=group.device))  # the reference's closing step, as the sender expects
    group.synchronize("the weight sync")
    return sum(buckets.nbytes(m) for m in metas)
