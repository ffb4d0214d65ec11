"""Weight sync over NCCL in straight lines: metadata, then one broadcast per bucket, then load.

The trainer (rank ``src``) calls ``send`` while every inference rank calls ``receive`` in one
``labsupport.groups`` group (NCCL or gloo); ``labsupport.broadcast`` hardens it (Lab 3). Phases:

1. ``announce``: the trainer's names, dtypes, shapes and bucket size, one small object;
2. ``plan``: both sides split the same list into the same buckets, each one flat buffer;
3. ``send_bucket`` / ``receive_bucket``: one broadcast per bucket; each receiver hands the bucket's
   views to ``load`` (vLLM: ``model.load_weights(weights=...)``; here ``copy_into`` its tensors);
4. ``finish``: one tiny all-reduce that every rank must reach, waited for with a deadline
   (``GroupTimeout``). On NCCL a broadcast only queues work: without this wait, a receiver whose
   peer died would return, and load a partly received bucket later.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from labsupport.core import buckets
from labsupport.core.buckets import Entry, Meta

if TYPE_CHECKING:  # (a name for the reader only: the core imports nothing outside core/)
    from labsupport.groups import StatelessGroup

Batch = list[tuple[str, torch.Tensor]]
Bucket = tuple[list[Entry], int]  # a bucket's layout: its entries, and its buffer's size


def send(group: StatelessGroup, state: Mapping[str, torch.Tensor], bucket_bytes: int = 64 << 20,
         src: int = 0, *, timeout_s: float | None = None) -> int:
    """Trainer side: broadcast ``state`` to every other rank, within ``timeout_s``; the bytes."""
    metas = buckets.metas(state)
    announce(group, (metas, bucket_bytes), src)
    for bucket in plan(metas, bucket_bytes):
        send_bucket(group, bucket, state, src)
    finish(group, timeout_s)
    return sum(buckets.nbytes(m) for m in metas)


def receive(group: StatelessGroup, load: Callable[[Batch], None], src: int = 0, *,
            timeout_s: float | None = None) -> int:
    """Receiver side: one update from ``src``, ``load``-ed bucket by bucket; the bytes."""
    metas, bucket_bytes = announce(group, None, src)
    for bucket in plan(metas, bucket_bytes):
        load(receive_bucket(group, bucket, src))  # views into the bucket, nothing copied yet
    finish(group, timeout_s)
    return sum(buckets.nbytes(m) for m in metas)


def copy_into(state: Mapping[str, torch.Tensor]) -> Callable[[Batch], None]:
    """A ``load`` that copies each received tensor into ``state[name]``, in place."""
    return lambda batch: buckets.load_into(state, batch)


def announce(group: StatelessGroup, metadata: Any, src: int = 0) -> Any:
    """1. The trainer's ``metadata`` (None on receivers): one object from ``src`` to every rank."""
    return group.broadcast_object(metadata, src)


def plan(metas: list[Meta], bucket_bytes: int) -> list[Bucket]:
    """2. The same buckets on every rank: consecutive tensors, at most ``bucket_bytes`` each."""
    return [buckets.layout(b) for b in buckets.split(metas, bucket_bytes)]


def send_bucket(group: StatelessGroup, bucket: Bucket, state: Mapping[str, torch.Tensor],
                src: int = 0) -> None:
    """3. Trainer side: pack the bucket's tensors into one buffer and broadcast it."""
    entries, size = bucket
    buf = torch.empty(size, dtype=torch.uint8, device=group.device)
    buckets.pack(buf, entries, [state[e.name] for e in entries])
    group.broadcast(buf, src)


def receive_bucket(group: StatelessGroup, bucket: Bucket, src: int = 0) -> Batch:
    """3. Receiver side: receive the bucket into a buffer; returns ``[(name, view)]`` into it."""
    entries, size = bucket
    buf = torch.empty(size, dtype=torch.uint8, device=group.device)
    group.broadcast(buf, src)
    return buckets.unpack(buf, entries)


def finish(group: StatelessGroup, timeout_s: float | None = None, votes: torch.Tensor | None = None,
           what: str = "the weight sync") -> list:
    """4. An all-reduce (max) that every rank must reach, and a host wait of at most ``timeout_s``
    (default: the group's). ``votes``: what this rank adds (default: a one); returns the maximum."""
    votes = torch.ones(1, device=group.device) if votes is None else votes
    group.all_reduce(votes, "max")  # every rank gets here ...
    group.synchronize(what, timeout_s)  # ... and the host waits for that, with a deadline
    return votes.tolist()
