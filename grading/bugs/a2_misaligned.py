"""Assignment 2, seeded bug: each tensor starts right after the previous one's last byte, not at the next
multiple of ALIGN (after a bfloat16 tensor of odd length, a float32 one sits at an offset no view allows)."""

from grading.reference import a2 as ref

LOSES = {"test_round_trip_keeps_every_byte",
         "test_layout_is_aligned_and_tight",
         "test_unpack_returns_views_not_copies",
         "test_split_keeps_order_and_the_limit",
         "test_layout_rounds_every_end_up",
         "test_pack_and_unpack_in_a_slice_of_a_larger_buffer",
         "test_split_at_its_boundaries"}


def layout(metas):
    entries, off = [], 0
    for m in metas:
        entries.append((*m, off, ref.nbytes(m)))
        off += ref.nbytes(m)  # the bug: not rounded up to ALIGN
    return entries, max(ref.round_up(off), ref.ALIGN)
