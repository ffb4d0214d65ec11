"""Assignment 2, seeded bug: the buffer's size is the last tensor's end, not rounded up to ALIGN: a bucket that
ends on an odd byte is a few bytes short of the next aligned offset (a pool of such buckets misaligns)."""

from grading.reference import a2 as ref

LOSES = {"test_layout_rounds_every_end_up", "test_split_at_its_boundaries"}  # (split is checked through layout)


def layout(metas):
    entries, off, end = [], 0, 0
    for m in metas:
        entries.append(ref.Entry(*m, off, ref.nbytes(m)))
        end = off + ref.nbytes(m)
        off += ref.round_up(ref.nbytes(m))
    return entries, max(end, ref.ALIGN)  # the bug: the last end, not rounded up
