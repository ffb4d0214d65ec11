"""Assignment 2: named tensors into one flat, aligned byte buffer, and back.

Problem: a weight update moves hundreds of tensors of mixed dtypes and shapes. Sending each one costs a
collective (or an IPC handle) apiece; packing them into one flat ``uint8`` buffer costs one. Design the layout
that sender and receiver agree on without exchanging anything but the metas, the copy in and out, and the
split of a long list into buckets of bounded size.

Invariants the grader checks (``grading/test_a2_buckets.py``): every byte survives the round trip, for any
dtype (bool and 8-byte ones too), a 0-d or empty tensor, and a non-contiguous view; every tensor starts at a
multiple of ``ALIGN`` and nothing is wasted beyond that rounding; what comes out is a view of the buffer;
a buffer may be a slice of a larger allocation; and both sides derive the same buckets from the same metas.

Given (from ``labsupport.core.buckets``): a *meta* ``(name, dtype name, shape)`` describes a tensor, and
``meta(name, t)`` makes one; an *entry* is a meta plus ``(byte offset, nbytes)``; ``ALIGN`` (256 bytes) is
where every tensor must start, so that its slice can be viewed as any dtype; ``round_up(n)`` rounds ``n`` up to
a multiple of ``ALIGN``; ``groups(sizes, limit)`` is greedy bucketing of a list of sizes.

Graded by ``grading/test_a2_buckets.py`` (``make grade``); Lab 3 runs the course's own version first.
"""

from __future__ import annotations

import torch

from labsupport.core.buckets import ALIGN, Entry, Meta, dtype_name, groups, meta, round_up  # noqa: F401  (given)


def nbytes(m: Meta) -> int:
    """The bytes of the tensor that ``m`` describes, for any dtype (0 for an empty tensor; a 0-d tensor holds
    one element)."""
    raise NotImplementedError


def layout(metas: list[Meta]) -> tuple[list[Entry], int]:
    """Where each tensor sits in the buffer, in the order given, and the buffer's size in bytes.

    Each tensor starts at the first multiple of ``ALIGN`` at or after the previous one's end; the size is the
    last end rounded up to a multiple of ``ALIGN``, and at least ``ALIGN`` (an empty list still gets a buffer):
    the tightest layout in which every tensor is aligned, so that buffers can sit back to back.
    Returns ``([(name, dtype name, shape, offset, nbytes), ...], size)``.
    """
    raise NotImplementedError


@torch.no_grad()
def pack(buf: torch.Tensor, entries: list[Entry], tensors: list[torch.Tensor]) -> None:
    """Write each tensor into its entry's place in the ``uint8`` buffer ``buf`` (on the tensors' device), and
    nothing outside ``buf`` (it may be a slice of a larger allocation).

    A tensor may be a non-contiguous view (a transposed weight, a slice of a fused one): what lands in the
    buffer is the values it shows, in row-major order, not the storage under it.
    """
    raise NotImplementedError


def unpack(buf: torch.Tensor, entries: list[Entry]) -> list[tuple[str, torch.Tensor]]:
    """``[(name, tensor)]`` in the entries' order, each with its dtype and shape and each a *view* into ``buf``
    (which may be a slice of a larger allocation): nothing is copied, so a receiver loads straight from the
    bucket and a write to a view lands in ``buf``."""
    raise NotImplementedError


def split(metas: list[Meta], bucket_bytes: int) -> list[list[Meta]]:
    """``metas`` in consecutive buckets, in order, greedily: a bucket takes the next tensor as long as its
    ``layout`` still fits in ``bucket_bytes`` (a bucket filled exactly is full, not over); a tensor larger than
    that gets a bucket of its own. No bucket is empty, and no tensors give no buckets. A pure function of its
    arguments: sender and receiver call it on the same list and must get the same buckets."""
    raise NotImplementedError
