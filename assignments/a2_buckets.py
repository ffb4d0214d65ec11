"""Assignment 2: named tensors into one flat, aligned byte buffer, and back.

A weight update moves many tensors of mixed dtypes and shapes. Sending each one costs a collective (or an IPC
handle) apiece; packing them into one flat ``uint8`` buffer costs one. Your functions lay a list of tensors out
in such a buffer, copy them in, and slice them back out as views, and they split a long list into buckets.

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
    """The bytes of the tensor that ``m`` describes (0 for an empty tensor; a 0-d tensor holds one element)."""
    raise NotImplementedError


def layout(metas: list[Meta]) -> tuple[list[Entry], int]:
    """Where each tensor sits in the buffer, in the order given, and the buffer's size in bytes.

    Each tensor starts at a multiple of ``ALIGN`` right after the previous one (its end rounded up); the size is
    the last tensor's end rounded up to ``ALIGN``, and at least ``ALIGN`` (an empty list still gets a buffer).
    Returns ``([(name, dtype name, shape, offset, nbytes), ...], size)``.
    """
    raise NotImplementedError


@torch.no_grad()
def pack(buf: torch.Tensor, entries: list[Entry], tensors: list[torch.Tensor]) -> None:
    """Copy each tensor's bytes into its place in the ``uint8`` buffer ``buf`` (on the tensors' device).

    A tensor may be a non-contiguous view (a transposed weight, a slice of a fused one): copy the values it
    shows, in row-major order, not the storage under it.
    """
    raise NotImplementedError


def unpack(buf: torch.Tensor, entries: list[Entry]) -> list[tuple[str, torch.Tensor]]:
    """``[(name, tensor)]`` in the entries' order, each a *view* into ``buf`` with its dtype and shape: nothing
    is copied (a receiver loads straight from the bucket, and a write to a view lands in ``buf``)."""
    raise NotImplementedError


def split(metas: list[Meta], bucket_bytes: int) -> list[list[Meta]]:
    """``metas`` in consecutive buckets, in order, each laid out (``layout``) in at most ``bucket_bytes``; a
    tensor larger than that gets a bucket of its own. Sender and receiver call this on the same list and must
    get the same buckets."""
    raise NotImplementedError
