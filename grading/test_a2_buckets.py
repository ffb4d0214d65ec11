"""Assignment 2 (assignments/a2_buckets.py): named tensors into one flat, aligned buffer and back."""

from __future__ import annotations

import pytest
import torch

from grading.support import ALIGN, mixed_state, sha


def metas_of(impl, state: dict[str, torch.Tensor]) -> list:
    return [impl.meta(n, t) for n, t in state.items()]


@pytest.mark.points(4)
def test_round_trip_keeps_every_byte(impl):
    state = mixed_state()
    entries, size = impl.layout(metas_of(impl, state))
    buf = torch.zeros(size, dtype=torch.uint8)
    impl.pack(buf, entries, list(state.values()))
    out = impl.unpack(buf, entries)
    assert [n for n, _ in out] == list(state), f"expected the names in order {list(state)}, got {[n for n, _ in out]}"
    for (name, t), (_, v) in zip(state.items(), out):
        assert (v.dtype, tuple(v.shape)) == (t.dtype, tuple(t.shape)), \
            f"{name}: expected {t.dtype} {tuple(t.shape)}, got {v.dtype} {tuple(v.shape)}"
        assert sha(v) == sha(t), f"{name}: expected the bytes of the packed tensor, got other bytes"


@pytest.mark.points(4)
def test_layout_is_aligned_and_tight(impl):
    state = mixed_state()
    metas = metas_of(impl, state)
    entries, size = impl.layout(metas)
    assert [e[:3] for e in entries] == metas, "expected each entry to start with its meta (name, dtype, shape)"
    off = 0
    for (name, _, _, offset, n), t in zip(entries, state.values()):
        assert n == t.numel() * t.element_size(), f"{name}: expected nbytes {t.numel() * t.element_size()}, got {n}"
        assert offset % ALIGN == 0, f"{name}: expected an offset that is a multiple of {ALIGN}, got {offset}"
        assert offset == off, \
            f"{name}: expected offset {off} (right after the previous tensor, rounded up), got {offset}"
        off += -(-n // ALIGN) * ALIGN
    assert size == max(off, ALIGN), f"expected a buffer of {max(off, ALIGN)} bytes, got {size}"
    assert impl.layout([])[1] == ALIGN, f"expected an empty layout to take {ALIGN} bytes, got {impl.layout([])[1]}"
    assert impl.nbytes(("x", "bfloat16", (3, 5))) == 30 and impl.nbytes(("s", "float32", ())) == 4, \
        "expected nbytes 30 for a (3, 5) bfloat16 tensor and 4 for a 0-d float32 one"


@pytest.mark.points(3)
def test_unpack_returns_views_not_copies(impl):
    state = mixed_state()
    entries, size = impl.layout(metas_of(impl, state))
    buf = torch.zeros(size, dtype=torch.uint8)
    impl.pack(buf, entries, list(state.values()))
    views = dict(impl.unpack(buf, entries))
    q = views["q"]
    assert q.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr(), \
        "expected 'q' to be a view into the buffer (same storage), got a copy"
    buf.zero_()
    assert bool((q == 0).all()), "expected a write to the buffer to show in the view"


@pytest.mark.points(4)
def test_split_keeps_order_and_the_limit(impl):
    sizes = [3000, 100, 100, 9000, 0, 2000, 2000, 5, 4096]  # uint8 tensors of these many bytes
    metas = [(f"t{i}", "uint8", (n,)) for i, n in enumerate(sizes)]
    limit = 4096
    out = impl.split(metas, limit)
    assert [m for b in out for m in b] == metas, "expected every meta once, in order"
    for b in out:
        size = impl.layout(b)[1]
        assert size <= limit or len(b) == 1, f"expected each bucket to fit {limit} bytes, got {size} for {b}"
    # greedy: a bucket closes only when the next tensor would not fit
    for b, nxt in zip(out, out[1:]):
        together = impl.layout(b + nxt[:1])[1]
        assert together > limit, f"expected {nxt[0][0]} to join the bucket before it ({together} <= {limit} bytes)"
    assert len(out) == 5, f"expected 5 buckets, got {len(out)}: {[[m[0] for m in b] for b in out]}"
