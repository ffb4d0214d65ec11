"""Assignment 2 (assignments/a2_buckets.py): named tensors into one flat, aligned buffer and back."""

from __future__ import annotations

import pytest
import torch

from grading.support import ALIGN, mixed_state, sha


def metas_of(impl, state: dict[str, torch.Tensor]) -> list:
    return [impl.meta(n, t) for n, t in state.items()]


@pytest.mark.points(3)
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


@pytest.mark.points(2)
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


@pytest.mark.points(2)
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


@pytest.mark.points(2)
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


@pytest.mark.points(2)
def test_layout_rounds_every_end_up(impl):
    """Ends that fall on, just past, or short of a multiple of ALIGN; dtypes of 1, 2, 4 and 8 bytes."""
    cases = [([("a", "uint8", (256,)), ("b", "uint8", (1,)), ("c", "float32", (3,))], [0, 256, 512], 768),
             ([("a", "uint8", (257,))], [0], 512),
             ([("a", "float64", (32,))], [0], 256),
             ([("a", "bfloat16", (129,)), ("b", "float64", (1,))], [0, 512], 768)]
    for metas, offsets, size in cases:
        entries, got = impl.layout(metas)
        assert [e[3] for e in entries] == offsets and got == size, \
            f"for {metas}: expected offsets {offsets} and size {size}, got {[e[3] for e in entries]} and {got}"
    for m, n in [(("e", "float64", (0, 5)), 0), (("m", "bool", (3,)), 3), (("h", "float16", (2, 3, 4)), 48)]:
        assert impl.nbytes(m) == n, f"expected nbytes({m}) = {n}, got {impl.nbytes(m)}"


def check_split(impl, metas: list, limit: int) -> None:
    """The contract of ``split``, whatever the sizes: every meta once in order, no empty bucket, each bucket's
    layout within the limit (or a single tensor), and greedy (the next tensor would not have fit)."""
    out = impl.split(metas, limit)
    names = [[m[0] for m in b] for b in out]
    assert [m for b in out for m in b] == metas, f"limit {limit}: expected every meta once, in order, got {names}"
    assert all(out), f"limit {limit}: expected no empty bucket, got {names}"
    for b in out:
        size = impl.layout(b)[1]
        assert size <= limit or len(b) == 1, f"limit {limit}: expected each bucket within it, got {size} for {names}"
    for b, nxt in zip(out, out[1:]):
        together = impl.layout(b + nxt[:1])[1]
        assert together > limit, \
            f"limit {limit}: expected {nxt[0][0]} to join the bucket before it ({together} bytes fit), got {names}"


@pytest.mark.points(2)
def test_split_at_its_boundaries(impl):
    """A first tensor larger than a bucket, tensors that fill a bucket exactly, an empty list, and random lists."""
    u8 = [(f"t{i}", "uint8", (n,)) for i, n in enumerate([5000, 100, 1000, 1024, 1024, 2048, 3000, 1])]
    for limit in (256, 1024, 2048, 4096, 5120, 10 ** 6):
        check_split(impl, u8, limit)
    exact = [("a", "float32", (256,)), ("b", "float32", (256,)), ("c", "float32", (512,))]  # 1 KiB, 1 KiB, 2 KiB
    got = [[m[0] for m in b] for b in impl.split(exact, 2048)]
    assert got == [["a", "b"], ["c"]], f"expected [['a', 'b'], ['c']] (two 1 KiB tensors fill 2 KiB), got {got}"
    assert impl.split([], 1024) == [], f"expected no bucket for no tensor, got {impl.split([], 1024)}"
    g = torch.Generator().manual_seed(0)
    dtypes = ["uint8", "bfloat16", "float32", "float64", "bool"]
    for case in range(20):
        n = int(torch.randint(1, 12, (1,), generator=g))
        metas = [(f"r{case}_{i}", dtypes[int(torch.randint(5, (1,), generator=g))],
                  (int(torch.randint(0, 700, (1,), generator=g)),)) for i in range(n)]
        check_split(impl, metas, int(torch.randint(200, 3000, (1,), generator=g)))


@pytest.mark.points(2)
def test_pack_and_unpack_in_a_slice_of_a_larger_buffer(impl):
    """A bucket may be a slice of a larger allocation (a pool, a bucket reused at an offset): the tensors go in
    and come out of the slice, not of the storage underneath it."""
    state = mixed_state(4)
    entries, size = impl.layout(metas_of(impl, state))
    pool = torch.full((size + 2 * ALIGN,), 0xAB, dtype=torch.uint8)
    buf = pool[ALIGN:ALIGN + size]
    impl.pack(buf, entries, list(state.values()))
    assert bool((pool[:ALIGN] == 0xAB).all()) and bool((pool[ALIGN + size:] == 0xAB).all()), \
        "expected pack to write only inside the buffer it was given, not before or after it in the storage"
    out = dict(impl.unpack(buf, entries))
    wrong = sorted(n for n, t in state.items() if sha(out[n]) != sha(t))
    assert not wrong, f"expected the tensors back from the slice; these came back with other bytes: {wrong}"
