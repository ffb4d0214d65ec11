"""Named tensors in one flat byte buffer: the one bucket layout (broadcast buckets and IPC handles).

A ``Meta``, ``(name, dtype name, shape)``, is all a receiver needs to slice the bytes back into
tensors, each at a multiple of ``ALIGN`` bytes (viewable as any dtype); ``load_into`` copies what
arrived into the receiver's own tensors.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import torch

ALIGN = 256  # bytes; a multiple of every dtype's item size (and of the GPU's widest loads)


class Meta(NamedTuple):
    """What a receiver needs to allocate and check one tensor."""
    name: str
    dtype: str  # e.g. "bfloat16"
    shape: tuple[int, ...]


class Entry(NamedTuple):
    """A tensor's ``Meta`` and where its bytes sit in the buffer."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # bytes from the buffer's start, a multiple of ALIGN
    nbytes: int


def dtype_name(t: torch.Tensor | torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: how a dtype travels between processes."""
    return str(t if isinstance(t, torch.dtype) else t.dtype).removeprefix("torch.")


def round_up(n: int, align: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``align``."""
    return -(-n // align) * align


def meta(name: str, t: torch.Tensor) -> Meta:
    """``(name, dtype name, shape)`` of a tensor."""
    return Meta(name, dtype_name(t), tuple(t.shape))


def metas(named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> list[Meta]:
    """The ``Meta`` of each ``(name, tensor)`` (or of a ``{name: tensor}`` mapping), in order."""
    return [meta(n, t) for n, t in (named.items() if isinstance(named, Mapping) else named)]


def nbytes(m: Meta) -> int:
    """The bytes of the tensor that ``m`` describes."""
    return math.prod(m[2]) * getattr(torch, m[1]).itemsize


def groups(sizes: list[int], limit: int) -> list[list[int]]:
    """Indices of ``sizes`` in consecutive groups of at most ``limit`` (a larger item alone)."""
    out: list[list[int]] = []
    used = 0  # in the last group
    for i, n in enumerate(sizes):
        if not out or used + n > limit:
            out.append([])
            used = 0
        out[-1].append(i)
        used += n
    return out


def split(metas: list[Meta], bucket_bytes: int) -> list[list[Meta]]:
    """Consecutive buckets of at most ``bucket_bytes`` each (a larger tensor gets one alone)."""
    sizes = [round_up(nbytes(m)) for m in metas]
    return [[metas[i] for i in g] for g in groups(sizes, bucket_bytes)]


def layout(metas: list[Meta]) -> tuple[list[Entry], int]:
    """Where each tensor sits in the buffer, and the buffer's size."""
    entries, off = [], 0
    for m in metas:
        entries.append(Entry(*m, off, nbytes(m)))
        off += round_up(nbytes(m))
    return entries, max(off, ALIGN)


@torch.no_grad()
def pack(buf: torch.Tensor, entries: list[Entry], tensors: list[torch.Tensor]) -> None:
    """Copy each tensor into its place in the uint8 buffer ``buf``, all in one multi-tensor copy."""
    if entries:
        torch._foreach_copy_([v for _, v in unpack(buf, entries)], [t.detach() for t in tensors])


def unpack(buf: torch.Tensor, entries: list[Entry]) -> list[tuple[str, torch.Tensor]]:
    """``[(name, view)]``: each tensor as a view into ``buf`` (nothing is copied)."""
    return [(name, buf[off:off + n].view(getattr(torch, dtype)).view(shape))
            for name, dtype, shape, off, n in entries]


@torch.no_grad()
def load_into(params: Mapping[str, torch.Tensor], views: list[tuple[str, torch.Tensor]], *,
              non_blocking: bool = False) -> int:
    """Copy each ``(name, view)`` into ``params[name]`` in place, one grouped copy; the bytes."""
    if views:
        dst, src = [params[n] for n, _ in views], [v for _, v in views]
        torch._foreach_copy_(dst, src, non_blocking=non_blocking)
    return sum(v.nbytes for _, v in views)
