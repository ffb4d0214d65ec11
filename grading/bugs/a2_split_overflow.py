"""Assignment 2, seeded bug: a bucket is closed only once it has grown past the limit, so buckets overflow
``bucket_bytes`` (a receiver's preallocated buffer, or the memory budget)."""

from grading.reference import a2 as ref

LOSES = {"test_split_keeps_order_and_the_limit",
         "test_split_at_its_boundaries"}


def split(metas, bucket_bytes):
    out, used = [], 0
    for m in metas:
        if not out or used > bucket_bytes:  # the bug: tests the bucket before adding, not with the new tensor
            out.append([])
            used = 0
        out[-1].append(m)
        used += ref.round_up(ref.nbytes(m))
    return out
