"""Assignment 2, seeded bug: ``split`` starts with an open, empty bucket and closes it when the next tensor would
not fit, so a first tensor larger than a bucket leaves an empty bucket in front (a broadcast of nothing, and a
receiver that calls ``load`` with no tensor)."""

from grading.reference import a2 as ref

LOSES = {"test_split_at_its_boundaries"}


def split(metas, bucket_bytes):
    out, used = [[]], 0  # the bug: an empty bucket to start with
    for m in metas:
        n = ref.round_up(ref.nbytes(m))
        if used + n > bucket_bytes:
            out.append([])
            used = 0
        out[-1].append(m)
        used += n
    return out if metas else []
