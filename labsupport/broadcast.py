"""Weight sync from a trainer to inference ranks over a stateless group: handshake, buckets, verification.

``send`` (trainer, rank ``src``) and ``receive`` (every other rank) run concurrently:

1. handshake: a small header (version, metadata hash, mode, bucket size) is broadcast; the full list of
   names/dtypes/shapes follows only when it changed. Every receiver checks it against the tensors it
   expects and all ranks vote (one all-reduce): a single objection makes *every* rank raise
   ``WeightSyncError`` naming the tensor, before any weight changes.
2. transfer: ``per_tensor`` (one broadcast per tensor, the baseline) or ``bucketed`` (tensors packed into
   fixed-size buffers; two buffers alternate on two side streams, so packing bucket k+1 overlaps the
   transfer of bucket k, and the receiver unpacks bucket k while k+1 arrives). Tensors larger than a bucket
   travel alone, straight from/into their own memory.
3. verification: an integer checksum per bucket, computed on the device on both sides (no host sync in the
   loop), compared at the end with one more all-reduce that also reports receivers whose ``load`` failed.

``python -m labsupport bench sync`` measures per-tensor, bucketed and raw single-buffer broadcast.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch

from labsupport.groups import GroupError, StatelessGroup, create_group, free_port, run_ranks

ALIGN = 256  # every packed tensor starts on a 256-byte boundary (any dtype can view it)
MAGIC = 0x5EED_2026
MODES = {"per_tensor": 0, "bucketed": 1}
_CHECK_ROW = 2048  # int32 words per checksum row (8 KiB)
_P = 2**31 - 1


class WeightSyncError(Exception):
    """A weight update was rejected or failed; the message says which tensor/rank and what to do."""


class SyncTimeout(WeightSyncError, TimeoutError):
    """A peer stopped answering during a sync (it probably died); raised instead of hanging."""


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver needs to allocate and validate one tensor: name, dtype name, shape."""

    name: str
    dtype: str  # e.g. "bfloat16"
    shape: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize


@dataclass
class SyncStats:
    """What one sync moved and how long it took (``seconds`` covers handshake, transfer and verification)."""

    bytes: int
    seconds: float
    n_collectives: int  # data broadcasts (the handshake's few small collectives are not counted)
    mode: str
    bucket_bytes: int
    n_tensors: int = 0
    version: int = 0
    handshake_s: float = 0.0
    verified: bool = False

    @property
    def gbps(self) -> float:
        """Payload bandwidth in GB/s (1e9 bytes per second)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gbps": self.gbps}

    def __str__(self) -> str:
        extra = f", bucket {self.bucket_bytes / 2**20:g} MiB" if self.mode == "bucketed" else ""
        return (f"{self.mode}{extra}: {self.bytes / 1e6:.1f} MB, {self.n_tensors} tensors in "
                f"{self.n_collectives} broadcasts, {self.seconds * 1e3:.2f} ms ({self.gbps:.2f} GB/s)"
                f"{', verified' if self.verified else ''}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _items(named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]):
    return list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)


def metadata_of(named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> list[TensorMeta]:
    """``TensorMeta`` for each (name, tensor), in order."""
    return [TensorMeta(n, _dtype_name(t.dtype), tuple(t.shape)) for n, t in _items(named_tensors)]


def expected_from(named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> dict[str, TensorMeta]:
    """The ``expected`` argument of ``receive`` for a receiver that holds these tensors."""
    return {m.name: m for m in metadata_of(named_tensors)}


def copy_into(targets: Mapping[str, torch.Tensor]) -> Callable[[list[tuple[str, torch.Tensor]]], None]:
    """A ``load`` callback that copies each received tensor into ``targets[name]`` (in place, no grad)."""

    def load(batch: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in batch:
                targets[name].copy_(tensor)

    return load


# ---------------------------------------------------------------------------- checksums

def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def _checksum(u8: torch.Tensor) -> torch.Tensor:
    """Position-sensitive integer checksum of a flat uint8 tensor, as a 0-d int64 tensor on its device.

    Rows of 8 KiB are summed as int32 words (one fast reduction over the data), then the row sums are
    combined with position weights, all modulo a prime so nothing overflows; no host synchronisation.
    """
    n = u8.numel()
    row = _CHECK_ROW * 4
    main = n // row * row
    total = torch.zeros((), dtype=torch.int64, device=u8.device)
    if main:
        rows = u8[:main].view(torch.int32).view(-1, _CHECK_ROW).sum(dim=1, dtype=torch.int64)
        weights = torch.arange(1, rows.numel() + 1, dtype=torch.int64, device=u8.device).remainder_(65521).add_(1)
        total = total + rows.remainder_(_P).mul_(weights).remainder_(_P).sum()
    if n > main:
        tail = u8[main:].to(torch.int64)
        pos = torch.arange(1, tail.numel() + 1, dtype=torch.int64, device=u8.device)
        total = total + (tail * pos).sum() * 7919
    return total + n


def tensor_checksums(named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """``{name: checksum}`` of each tensor's bytes (computed on its device; equal bytes give equal numbers)."""
    items = _items(named_tensors)
    if not items:
        return {}
    sums = [_checksum(_as_bytes(t.detach().contiguous())) for _, t in items]
    values = torch.stack([x.to(sums[0].device) for x in sums]).tolist()  # one host sync
    return {n: int(v) for (n, _), v in zip(items, values)}


# ---------------------------------------------------------------------------- bucket plan

@dataclass
class _Bucket:
    items: list[tuple[int, int, int]] = field(default_factory=list)  # (tensor index, byte offset, nbytes)
    nbytes: int = 0  # bytes on the wire
    direct: bool = False  # one tensor, sent from / received into its own memory


def _round_up(x: int, a: int = ALIGN) -> int:
    return (x + a - 1) // a * a


def plan_buckets(metas: list[TensorMeta], bucket_bytes: int, mode: str = "bucketed") -> list[_Bucket]:
    """Split tensors, in order, into buckets of at most ``bucket_bytes`` (both sides compute the same plan)."""
    out: list[_Bucket] = []
    if mode == "per_tensor":
        return [_Bucket([(i, 0, m.nbytes)], m.nbytes, True) for i, m in enumerate(metas) if m.nbytes]
    cur = _Bucket()
    for i, m in enumerate(metas):
        n = m.nbytes
        if n == 0:
            continue
        if n > bucket_bytes:  # too big for a bucket: its own broadcast, no copy
            out.append(_Bucket([(i, 0, n)], n, True))
            continue
        off = _round_up(cur.nbytes)
        if cur.items and off + n > bucket_bytes:
            out.append(cur)
            cur, off = _Bucket(), 0
        cur.items.append((i, off, n))
        cur.nbytes = off + n
    if cur.items:
        out.append(cur)
    for b in out:
        if not b.direct:
            b.nbytes = _round_up(b.nbytes)  # whole 256-byte lines: the checksum reads full words
    return out


def _meta_hash(metas: list[TensorMeta]) -> tuple[int, int]:
    h = hashlib.sha256(repr([(m.name, m.dtype, m.shape) for m in metas]).encode()).digest()
    return int.from_bytes(h[:8], "little", signed=True), int.from_bytes(h[8:16], "little", signed=True)


def _validate(metas: list[TensorMeta], expected: Mapping[str, Any] | None) -> list[str]:
    """Problems a receiver finds in an update's metadata (empty list: accept)."""
    if expected is None:
        return []
    exp = {k: (v if isinstance(v, TensorMeta) else TensorMeta(k, _dtype_name(v.dtype), tuple(v.shape)))
           for k, v in expected.items()}
    problems, seen = [], set()
    for m in metas:
        e = exp.get(m.name)
        if m.name in seen:
            problems.append(f"'{m.name}': sent twice")
        seen.add(m.name)
        if e is None:
            import difflib

            close = difflib.get_close_matches(m.name, list(exp), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            problems.append(f"'{m.name}': unknown name, expected one of this receiver's {len(exp)} tensors{hint}")
        elif e.dtype != m.dtype:
            problems.append(f"'{m.name}': dtype expected {e.dtype}, found {m.dtype}")
        elif tuple(e.shape) != tuple(m.shape):
            problems.append(f"'{m.name}': shape expected {tuple(e.shape)}, found {tuple(m.shape)}")
    return problems


# ---------------------------------------------------------------------------- shared machinery

def _streams(group: StatelessGroup) -> list[Any]:
    """Two side streams per group (GPU), created once; on CPU, two null placeholders."""
    if group.backend != "nccl":
        return [None, None]
    if "streams" not in group.cache:
        group.cache["streams"] = [torch.cuda.Stream(device=group.device) for _ in range(2)]
    return group.cache["streams"]


def _on(stream: Any):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _buffers(group: StatelessGroup, nbytes: int) -> list[torch.Tensor]:
    """Two reusable byte buffers of at least ``nbytes`` each (kept in the group; no per-sync allocation)."""
    have = group.cache.get("buffers")
    if have is None or have[0].numel() < nbytes:
        if have is not None:
            group.cache.pop("buffers")
            group.synchronize("freeing old buffers")
            del have
        group.cache["buffers"] = [torch.zeros(nbytes, dtype=torch.uint8, device=group.device) for _ in range(2)]
    return group.cache["buffers"]


def release_buffers(group: StatelessGroup) -> None:
    """Free the two bucket buffers this group keeps between syncs (2 x bucket_bytes of device memory)."""
    if group.cache.pop("buffers", None) is not None:
        group.synchronize("releasing buffers")


def _guard(group: StatelessGroup, fn: Callable[[], Any], what: str) -> Any:
    """Run a group step; a peer that died or timed out becomes ``SyncTimeout`` (and the group is aborted)."""
    try:
        return fn()
    except GroupError as exc:
        group.abort()
        raise SyncTimeout(f"weight sync failed during {what}: {exc}") from exc


def _vote(group: StatelessGroup, my_problems: list[str], what: str, dev: torch.device,
          device_flag: torch.Tensor | None = None,
          details: Callable[[], list[str]] | None = None) -> list[list[str]] | None:
    """All ranks agree on failure: returns every rank's problem list if any rank objects, else None.

    One all-reduce (max) of a flag; ``device_flag`` lets a check computed on the device join the vote
    without a host sync, and ``details`` explains it afterwards (only when someone objected).
    """
    flag = torch.tensor([1 if my_problems else 0], dtype=torch.int32, device=dev)
    if device_flag is not None:
        flag = torch.maximum(flag, device_flag.to(torch.int32).reshape(1))
    _guard(group, lambda: group.all_reduce(flag, "max"), f"the {what} vote")
    _guard(group, lambda: group.synchronize(f"the {what} vote"), f"the {what} vote")
    if int(flag.item()) == 0:
        return None
    mine = list(my_problems) + (details() if details is not None else [])
    return _guard(group, lambda: group.all_gather_object(mine), f"the {what} vote")


def _reject_message(version: int, per_rank: list[list[str]], head: str, tail: str) -> str:
    lines = []
    for r, probs in enumerate(per_rank):
        for p in (probs or [])[:5]:
            lines.append(f"  rank {r}: {p}")
        if probs and len(probs) > 5:
            lines.append(f"  rank {r}: ... and {len(probs) - 5} more")
    return f"weight update v{version} {head}:\n" + "\n".join(lines) + f"\n{tail}"


# ---------------------------------------------------------------------------- trainer side

def send(group: StatelessGroup, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *,
         src: int = 0, mode: str = "bucketed", bucket_bytes: int = 256 << 20, version: int = 0,
         verify: bool = True) -> SyncStats:
    """Broadcast named tensors from this rank (``src``) to every other rank of ``group``.

    Returns once every receiver has loaded the update (and, with ``verify``, matched its checksums).
    Raises ``WeightSyncError`` if any receiver rejects the metadata (nothing is sent then), reports a
    checksum mismatch or a failing ``load``; ``SyncTimeout`` if a peer stops answering.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    if group.rank != src:
        raise WeightSyncError(f"send() runs on the source rank {src}; this is rank {group.rank} (call receive()).")
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes must be at least {ALIGN}, got {bucket_bytes}")
    t0 = time.perf_counter()
    items = _items(named_tensors)
    dev = group.device
    for name, t in items:
        if t.device.type != dev.type or (dev.type == "cuda" and t.device != dev):
            raise WeightSyncError(f"tensor '{name}' is on {t.device}, but this group sends from {dev}; "
                                  f"move the model to {dev} first.")
    metas = metadata_of(items)
    key = _meta_hash(metas)
    full = group.cache.get("sent_meta") != key
    header = torch.tensor([MAGIC, version, key[0], key[1], len(metas), MODES[mode], bucket_bytes,
                           (1 if verify else 0) | (2 if full else 0)], dtype=torch.int64, device=dev)
    _guard(group, lambda: group.broadcast(header, src), "the handshake")
    if full:
        _guard(group, lambda: group.broadcast_object([(m.name, m.dtype, m.shape) for m in metas], src), "the handshake")
        group.cache["sent_meta"] = key
    rejected = _vote(group, [], "metadata", dev)
    if rejected is not None:
        raise WeightSyncError(_reject_message(version, rejected, "rejected before any weight changed",
                                              "Nothing was loaded on any receiver. Fix the names/dtypes/shapes "
                                              "(or the receiver's expected metadata) and send again."))
    t_hand = time.perf_counter() - t0

    plan = _cached_plan(group, key, metas, bucket_bytes, mode)
    packed_max = max((b.nbytes for b in plan if not b.direct), default=0)
    bufs = _buffers(group, packed_max) if packed_max else [None, None]
    streams = _streams(group)
    cur = torch.cuda.current_stream(dev) if group.backend == "nccl" else None
    for s in streams:
        if s is not None:
            s.wait_stream(cur)  # the side streams see the weights as the trainer last wrote them
    sums = torch.zeros(max(len(plan), 1), dtype=torch.int64, device=dev) if verify else None
    tensors = [t for _, t in items]
    pending: list[Any] = [None, None]

    def transfer() -> None:
        for k, b in enumerate(plan):
            i = k % 2
            with _on(streams[i]):
                if pending[i] is not None:  # buffer i is free once its previous broadcast is done
                    group.wait_work(pending[i][0], "bucket broadcast")
                    pending[i] = None
                if b.direct:
                    payload = _as_bytes(tensors[b.items[0][0]].detach().contiguous())
                else:
                    payload = bufs[i][: b.nbytes]
                    for idx, off, n in b.items:
                        payload[off:off + n].copy_(_as_bytes(tensors[idx].detach().contiguous()), non_blocking=True)
                if sums is not None:
                    sums[k] = _checksum(payload)
                pending[i] = (group.broadcast(payload, src, async_op=True), payload)
        for i in range(2):
            if pending[i] is not None:
                with _on(streams[i]):
                    group.wait_work(pending[i][0], "bucket broadcast")
                pending[i] = None
        for s in streams:
            if s is not None:
                cur.wait_stream(s)

    _guard(group, transfer, "the transfer")
    if sums is not None:
        _guard(group, lambda: group.broadcast(sums, src), "verification")
    failed = _vote(group, [], "verification", dev)
    if failed is not None:
        raise WeightSyncError(_reject_message(version, failed, "failed on a receiver",
                                              "Receivers may hold partly updated weights: send again."))
    return SyncStats(bytes=sum(m.nbytes for m in metas), seconds=time.perf_counter() - t0,
                     n_collectives=len(plan), mode=mode, bucket_bytes=bucket_bytes, n_tensors=len(metas),
                     version=version, handshake_s=t_hand, verified=verify)


def _cached_plan(group: StatelessGroup, key: tuple[int, int], metas: list[TensorMeta], bucket_bytes: int,
                 mode: str) -> list[_Bucket]:
    plans = group.cache.setdefault("plans", {})
    pk = (key, bucket_bytes, mode)
    if pk not in plans:
        if len(plans) > 16:
            plans.clear()
        plans[pk] = plan_buckets(metas, bucket_bytes, mode)
    return plans[pk]


# ---------------------------------------------------------------------------- receiver side

def receive(group: StatelessGroup, *, src: int = 0, expected: Mapping[str, Any] | None,
            load: Callable[[list[tuple[str, torch.Tensor]]], None], device: str | torch.device | None = None) -> SyncStats:
    """Receive one update from ``src``: validate its metadata, then call ``load`` per bucket (or tensor).

    ``expected`` maps name -> ``TensorMeta`` (or a tensor); ``None`` accepts any metadata. ``load`` gets
    ``[(name, tensor)]`` views into a reused buffer, valid only during the call: copy what you keep. On NCCL
    it runs on a side stream that is current during the call, so copies issued there are ordered correctly.
    """
    if group.rank == src:
        raise WeightSyncError(f"receive() runs on receivers; rank {src} is the source (call send()).")
    t0 = time.perf_counter()
    dev = torch.device(device) if device is not None else group.device
    header = torch.zeros(8, dtype=torch.int64, device=dev)
    _guard(group, lambda: group.broadcast(header, src), "the handshake (waiting for the trainer's header)")
    _guard(group, lambda: group.synchronize("waiting for the trainer's update header"), "the handshake")
    magic, version, h0, h1, n_tensors, mode_code, bucket_bytes, flags = header.tolist()
    if magic != MAGIC:
        raise WeightSyncError(f"rank {group.rank}: got a header that is not from labsupport.broadcast.send "
                              f"(magic {magic:#x}); are both sides calling send/receive in the same order?")
    mode = {v: k for k, v in MODES.items()}[mode_code]
    key = (h0, h1)
    cache = group.cache.setdefault("recv_meta", {})
    problems: list[str] = []
    if flags & 2:
        raw = _guard(group, lambda: group.broadcast_object(None, src), "the handshake")
        metas = [TensorMeta(n, d, tuple(s)) for n, d, s in raw]
        cache.clear()
        cache[key] = metas
    metas = cache.get(key)
    if metas is None:
        metas, problems = [], [f"metadata {key} was never received by this rank; create a new group"]
    problems = problems or _validate(metas, expected)
    rejected = _vote(group, problems, "metadata", dev)
    if rejected is not None:
        raise WeightSyncError(_reject_message(version, rejected, "rejected before any weight changed",
                                              "Nothing was loaded on any receiver."))
    t_hand = time.perf_counter() - t0

    verify = bool(flags & 1)
    plan = _cached_plan(group, key, metas, bucket_bytes, mode)
    packed_max = max((b.nbytes for b in plan if not b.direct), default=0)
    bufs = _buffers(group, packed_max) if packed_max else [None, None]
    streams = _streams(group)
    cur = torch.cuda.current_stream(dev) if group.backend == "nccl" else None
    for s in streams:
        if s is not None:
            s.wait_stream(cur)
    sums = torch.zeros(max(len(plan), 1), dtype=torch.int64, device=dev) if verify else None
    load_errors: list[str] = []
    slots: list[Any] = [None, None]

    def issue(k: int) -> None:
        b, i = plan[k], k % 2
        with _on(streams[i]):
            if b.direct:
                m = metas[b.items[0][0]]
                holder = torch.empty(m.shape, dtype=m.torch_dtype, device=dev)
                payload = _as_bytes(holder)
            else:
                holder, payload = None, bufs[i][: b.nbytes]
            slots[i] = (group.broadcast(payload, src, async_op=True), payload, holder)

    def transfer() -> None:
        if plan:
            issue(0)
        for k, b in enumerate(plan):
            if k + 1 < len(plan):
                issue(k + 1)  # the next bucket lands in the other buffer while we unpack this one
            i = k % 2
            work, payload, holder = slots[i]
            with _on(streams[i]):
                group.wait_work(work, "bucket broadcast")
                if sums is not None:
                    sums[k] = _checksum(payload)
                if holder is not None:
                    batch = [(metas[b.items[0][0]].name, holder)]
                else:
                    batch = []
                    for idx, off, n in b.items:
                        m = metas[idx]
                        batch.append((m.name, payload[off:off + n].view(m.torch_dtype).view(m.shape)))
                if not load_errors:
                    try:
                        load(batch)
                    except Exception as exc:  # keep receiving so the other ranks do not hang; report below
                        load_errors.append(f"load() failed on '{batch[0][0]}': {type(exc).__name__}: {exc}")
            slots[i] = None
        for s in streams:
            if s is not None:
                cur.wait_stream(s)

    _guard(group, transfer, "the transfer")
    dflag, details = None, None
    if sums is not None:
        theirs = torch.zeros_like(sums)
        _guard(group, lambda: group.broadcast(theirs, src), "verification")
        dflag = (theirs != sums).any()

        def details() -> list[str]:
            out = []
            for k in (theirs != sums).nonzero().flatten().tolist()[:5]:
                names = [metas[idx].name for idx, _, _ in plan[k].items]
                out.append(f"checksum mismatch in bucket {k} ({', '.join(names[:4])}"
                           f"{'...' if len(names) > 4 else ''})")
            return out

    failed = _vote(group, load_errors, "verification", dev, dflag, details)
    if failed is not None:
        raise WeightSyncError(_reject_message(version, failed, "failed on a receiver",
                                              "This receiver may hold partly updated weights: ask for a resend."))
    return SyncStats(bytes=sum(m.nbytes for m in metas), seconds=time.perf_counter() - t0,
                     n_collectives=len(plan), mode=mode, bucket_bytes=bucket_bytes, n_tensors=len(metas),
                     version=version, handshake_s=t_hand, verified=verify)
