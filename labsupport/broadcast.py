"""Weight sync from a trainer to inference ranks over a stateless group: handshake, buckets, verification.

``send`` (trainer, rank ``src``) and ``receive`` (every other rank) run concurrently:

1. handshake: one all-reduce carries the header (version, metadata hash, mode, bucket size) from the
   trainer and, from each receiver, whether it must check the metadata again. The names/dtypes/shapes
   follow only when they changed; then every receiver checks them against the tensors it expects and all
   ranks vote: a single objection makes *every* rank raise ``WeightSyncError`` naming the tensor, before
   any weight changes. A layout everyone already accepted needs no second round trip.
2. transfer, three ways: ``per_tensor`` (one broadcast per tensor, the baseline); ``bucketed`` (tensors
   grouped into buckets of ``bucket_bytes``; each bucket leaves as one NCCL launch, a group of broadcasts
   straight from the tensors' own memory, and lands in the receiver's own tensors (``into``) or in one of
   two staging buffers that ``load`` empties while the next bucket arrives); ``packed`` (the classic: the
   trainer copies each bucket into one of two alternating buffers on side streams, packing bucket k+1
   while bucket k is on the wire, and the receiver unpacks). Copies compete with NCCL for memory
   bandwidth, which is why ``bucketed`` avoids them.
3. verification: an integer checksum per bucket, computed on the device on both sides, compared in the
   closing all-reduce that also reports receivers whose ``load`` failed.

A peer that dies makes every survivor raise ``SyncTimeout`` naming it (never a hang).
``python -m labsupport bench sync`` measures per-tensor, bucketed, packed and a raw single-buffer broadcast.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch

from labsupport.groups import GroupError, StatelessGroup, create_group, free_port, run_ranks

ALIGN = 256  # every packed tensor starts on a 256-byte boundary (any dtype can view it)
MAGIC = 0x5EED_2026
MODES = {"per_tensor": 0, "bucketed": 1, "packed": 2}


class WeightSyncError(Exception):
    """A weight update was rejected or failed; the message says which tensor/rank and what to do."""


class SyncTimeout(WeightSyncError, TimeoutError):
    """A peer died or stopped answering during a sync (timeout, aborted NCCL communicator, store gone);
    raised instead of hanging, with the rank(s) that vanished in the message. The group is then unusable."""


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
        return {**asdict(self), "gb_per_s": self.gbps}

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
        with torch.no_grad():  # one multi-tensor copy for the whole bucket, not one kernel launch per tensor
            torch._foreach_copy_([targets[name] for name, _ in batch], [t for _, t in batch])

    return load


# ---------------------------------------------------------------------------- checksums

def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (no copy)."""
    return t.reshape(-1).view(torch.uint8)


_ROW = 1024  # words per checksum row
_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _words(nbytes: int) -> torch.dtype:
    """The widest integer word that divides ``nbytes`` (both sides pick it from the size alone)."""
    return next(d for d in (torch.int64, torch.int32, torch.int16, torch.uint8) if nbytes % d.itemsize == 0)


def _row_weights(device: torch.device, rows: int) -> torch.Tensor:
    """Odd pseudo-random 32-bit multipliers, one per checksum row; made once per device, on the current
    stream (senders and receivers call this before their side streams start, so those see it ready)."""
    w = _WEIGHTS.get(device)
    if w is None or w.numel() <= rows:
        w = _WEIGHTS[device] = torch.arange(1, max(2 * rows + 2, 1 << 16) + 1, dtype=torch.int64, device=device) \
            .mul_(2654435761).remainder_(1 << 32).bitwise_or_(1)
    return w


def _checksum(u8: torch.Tensor) -> torch.Tensor:
    """Integer checksum of a flat uint8 tensor, as a 0-d int64 tensor on its device (no host sync).

    The bytes are read as the widest integer words their length allows; rows of 1024 words are summed (one
    bandwidth-bound reduction), then weighted by a pseudo-random odd number per row, so moving data between
    rows changes the result. Integer sums wrap the same way in any order: every device agrees.
    """
    n, dtype = u8.numel(), _words(u8.numel())
    if u8.storage_offset() % dtype.itemsize:
        u8 = u8.clone()  # (a view at an odd address: align it)
    words = u8.view(dtype)
    rows = words.numel() // _ROW
    w = _row_weights(u8.device, rows)
    total = words[rows * _ROW:].sum() * w[rows] + n
    if rows:
        total += (words[: rows * _ROW].view(rows, _ROW).sum(dim=1) * w[:rows]).sum()
    return total


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
    nbytes: int = 0  # size of the bucket's packed layout (every tensor at a 256-byte boundary)
    packed: bool = False  # travels as one buffer, copied in on the trainer and out on the receivers


SMALL = 1 << 20  # bucketed mode packs tensors under 1 MiB (norms, biases): one launch costs more than their copy
RAMP = (16, 4)  # bucketed mode: the first two grouped buckets are 1/16 and 1/4 of a bucket (see plan_buckets)


def _round_up(x: int, a: int = ALIGN) -> int:
    return (x + a - 1) // a * a


def _fill(sizes: list[int], idx: list[int], bucket_bytes: int, packed: bool, ramp: bool = False) -> list[_Bucket]:
    """Consecutive buckets of at most ``bucket_bytes`` (a larger tensor gets one of its own). ``ramp``: the
    first two buckets are capped at 1/16 and 1/4 of that, so the wire starts after a short launch."""
    out: list[_Bucket] = []
    used = 0
    for i in idx:
        off = _round_up(used)
        k = len(out) - 1  # the bucket being filled
        cap = bucket_bytes // RAMP[k] if ramp and 0 <= k < len(RAMP) else bucket_bytes
        if not out or off + sizes[i] > cap:
            out.append(_Bucket(packed=packed))
            off = 0
        out[-1].items.append((i, off, sizes[i]))
        used = off + sizes[i]
        out[-1].nbytes = _round_up(used)
    for b in out:
        b.packed = b.packed and len(b.items) > 1  # a tensor alone travels from and to its own memory
    return out


def plan_buckets(metas: list[TensorMeta], bucket_bytes: int, mode: str = "bucketed") -> list[_Bucket]:
    """Split tensors into buckets of at most ``bucket_bytes``; both sides compute the same plan.

    ``per_tensor``: one bucket per tensor. ``packed``: every bucket is packed; single tensors (those larger
    than a bucket) go first, so the wire is busy while the first bucket is being packed. ``bucketed``: the
    tensors under 1 MiB (or 1/64 of a smaller bucket) are packed into buckets of their own (a few MB to
    copy); the rest travel as grouped launches of unpacked tensors. Launching a group costs host time per
    tensor (about 5 us), and nothing moves until the first group is launched, so the first two groups are
    small (1/16 and 1/4 of a bucket) and the packed buckets go second, packed while the first is on the wire.
    """
    sizes = [m.nbytes for m in metas]
    idx = [i for i, n in enumerate(sizes) if n]
    if mode == "per_tensor":
        return [_Bucket([(i, 0, sizes[i])], sizes[i]) for i in idx]
    if mode == "packed":
        return sorted(_fill(sizes, idx, bucket_bytes, True), key=lambda b: b.packed)
    cut = min(SMALL, bucket_bytes // 64)  # "small" is also relative to the bucket
    small = _fill(sizes, [i for i in idx if sizes[i] < cut], bucket_bytes, True)
    large = _fill(sizes, [i for i in idx if sizes[i] >= cut], bucket_bytes, False, ramp=True)
    return large[:1] + small + large[1:]


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


@dataclass
class _Plan:
    """Everything both sides derive once per (metadata, bucket size, mode) and reuse on every update."""

    metas: list[TensorMeta]
    buckets: list[_Bucket]
    dtypes: list[torch.dtype]
    shapes: list[tuple[int, ...]]
    total: int
    staging: int  # bytes of the largest multi-tensor bucket (the size of each of the two staging buffers)
    views: Any = None  # (buffers, per bucket: [(name, view into its buffer)]) made once per buffer pair

    def views_in(self, bufs: list[torch.Tensor]) -> list[list[tuple[str, torch.Tensor]]]:
        """Per multi-tensor bucket, each tensor's typed view into the bucket's buffer (cached: views cost
        Python time); [] for single-tensor buckets."""
        if self.views is None or self.views[0] is not bufs:
            self.views = (bufs, [[] if len(b.items) == 1 else
                                 [(self.metas[i].name, bufs[k % 2][off:off + n].view(self.dtypes[i]).view(self.shapes[i]))
                                  for i, off, n in b.items] for k, b in enumerate(self.buckets)])
        return self.views[1]


def _plan(group: StatelessGroup, key: tuple[int, int], metas: list[TensorMeta], bucket_bytes: int,
          mode: str) -> _Plan:
    plans = group.cache.setdefault("plans", {})
    pk = (key, bucket_bytes, mode)
    if pk not in plans:
        if len(plans) > 16:
            plans.clear()
        buckets = plan_buckets(metas, bucket_bytes, mode)
        plans[pk] = _Plan(metas, buckets, [m.torch_dtype for m in metas], [m.shape for m in metas],
                          sum(m.nbytes for m in metas),
                          max((b.nbytes for b in buckets if len(b.items) > 1), default=0))
    return plans[pk]


# ---------------------------------------------------------------------------- shared machinery

def _streams(group: StatelessGroup, plan: _Plan, verify: bool, dev: torch.device) -> tuple[list[Any], Any]:
    """Two side streams (created once per group), each after the current stream's work so far (the
    weights as last written, and the checksum multipliers, made here for the largest bucket so that no
    side stream creates them while the other reads them); returns them and the current stream. On CPU:
    placeholders."""
    if verify:  # (enough rows for any bucket, even read as single bytes: a gathered bucket may be odd-sized)
        _row_weights(dev, max((b.nbytes // _ROW + 1 for b in plan.buckets), default=0))
    if group.backend != "nccl":
        return [None, None], None
    if "streams" not in group.cache:
        group.cache["streams"] = [torch.cuda.Stream(device=group.device) for _ in range(2)]
    cur = torch.cuda.current_stream(group.device)
    for s in group.cache["streams"]:
        s.wait_stream(cur)
    return group.cache["streams"], cur


def _on(stream: Any):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _join(streams: list[Any], cur: Any) -> None:
    """The current stream continues after both side streams' work (GPU)."""
    for s in streams:
        if s is not None:
            cur.wait_stream(s)


def _buffers(group: StatelessGroup, nbytes: int) -> list[torch.Tensor]:
    """Two reusable byte buffers of at least ``nbytes`` each (kept in the group; no per-sync allocation)."""
    have = group.cache.get("buffers")
    if have is None or have[0].numel() < nbytes:
        del have
        release_buffers(group)
        group.cache["buffers"] = [torch.zeros(nbytes, dtype=torch.uint8, device=group.device) for _ in range(2)]
    return group.cache["buffers"]


def release_buffers(group: StatelessGroup) -> None:
    """Drop the two bucket buffers this group keeps between syncs (2 x bucket_bytes of device memory).

    The memory goes back to PyTorch's cache; call ``torch.cuda.empty_cache()`` too if another library
    (an inference engine's KV cache) should get it.
    """
    for plan in group.cache.get("plans", {}).values():
        plan.views = None  # (views into the buffers would keep them alive)
    if group.cache.pop("buffers", None) is not None:
        group.synchronize("releasing buffers")


def _cat_bytes(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The bytes of several tensors one after the other (a copy, made only to checksum a bucket that does
    not sit in one buffer)."""
    return _as_bytes(tensors[0]) if len(tensors) == 1 else torch.cat([_as_bytes(t) for t in tensors])


def _guard(group: StatelessGroup, fn: Callable[[], Any], what: str) -> Any:
    """Run a group step; a peer that died or timed out becomes ``SyncTimeout`` (and the group is aborted)."""
    try:
        return fn()
    except GroupError as exc:
        group.abort()
        raise SyncTimeout(f"weight sync failed during {what}: {exc}") from exc


def _header(group: StatelessGroup, fields: list[int] | None, stale: bool) -> list[int]:
    """The handshake's one collective, an all-reduce (sum): the sender contributes the header, each receiver
    zeros and, in the last slot, 1 if it must vote on the metadata again. Every rank gets the header and
    the number of such receivers."""
    if "header" not in group.cache:  # a pinned host slot and a device slot, reused (each sync ends synchronized)
        host = torch.zeros(9, dtype=torch.int64, pin_memory=group.backend == "nccl")
        group.cache["header"] = (host, torch.zeros(9, dtype=torch.int64, device=group.device))
    host, vals = group.cache["header"]
    host.numpy()[:] = (fields or [0] * 8) + [int(stale)]
    vals.copy_(host, non_blocking=True)  # from pinned memory: never waits for a stream (it may be stuck)
    _guard(group, lambda: group.all_reduce(vals, "sum"), "the handshake")
    _guard(group, lambda: group.synchronize("the handshake"), "the handshake")
    return vals.tolist()


def _vote(group: StatelessGroup, my_problems: list[str], what: str) -> list[list[str]] | None:
    """All ranks agree on failure: returns every rank's problem list if any rank objects, else None."""
    # torch.full is a device-side fill: unlike torch.tensor(..., device="cuda") it never waits for the
    # stream, which may be stuck behind a broadcast to a dead peer (we must reach our timed wait below).
    flag = torch.full((1,), 1 if my_problems else 0, dtype=torch.int32, device=group.device)
    _guard(group, lambda: group.all_reduce(flag, "max"), f"the {what} vote")
    _guard(group, lambda: group.synchronize(f"the {what} vote"), f"the {what} vote")
    if int(flag.item()) == 0:
        return None
    return _guard(group, lambda: group.all_gather_object(list(my_problems)), f"the {what} vote")


def _reject_message(version: int, per_rank: list[list[str]], head: str, tail: str) -> str:
    lines = []
    for r, probs in enumerate(per_rank):
        for p in (probs or [])[:5]:
            lines.append(f"  rank {r}: {p}")
        if probs and len(probs) > 5:
            lines.append(f"  rank {r}: ... and {len(probs) - 5} more")
    return f"weight update v{version} {head}:\n" + "\n".join(lines) + f"\n{tail}"


def _finish(group: StatelessGroup, version: int, problems: list[str], sums: torch.Tensor | None,
            plan: _Plan, src: int) -> None:
    """The closing vote (every rank), one all-reduce (max) of [failed?, checksums, -checksums]: all ranks hold
    the same checksums exactly when max == -max(-x) == min for every bucket. On any failure every rank
    raises ``WeightSyncError`` saying which rank failed and how."""
    dev = group.device
    vec = torch.full((1,), 1 if problems else 0, dtype=torch.int64, device=dev)
    if sums is not None:
        vec = torch.cat([vec, sums, -sums])
    _guard(group, lambda: group.all_reduce(vec, "max"), "the verification vote")
    _guard(group, lambda: group.synchronize("the verification vote"), "the verification vote")
    vals, n = vec.tolist(), (0 if sums is None else sums.numel())
    if not vals[0] and all((vals[1 + k] + vals[1 + n + k]) % 2**64 == 0 for k in range(n)):
        return
    mine = (list(problems), sums.tolist() if sums is not None else [])
    everyone = _guard(group, lambda: group.all_gather_object(mine), "the verification vote")
    ref = everyone[src][1]
    per_rank = []
    for probs, theirs in everyone:
        bad = [k for k, (a, b) in enumerate(zip(theirs, ref)) if a != b][:5]
        per_rank.append(probs + [f"checksum mismatch in bucket {k} ("
                                 + ", ".join(plan.metas[i].name for i, _, _ in plan.buckets[k].items[:4])
                                 + ("..." if len(plan.buckets[k].items) > 4 else "") + ")" for k in bad])
    raise WeightSyncError(_reject_message(version, per_rank, "failed on a receiver",
                                          "Receivers may hold partly updated weights: send again."))


# ---------------------------------------------------------------------------- trainer side

def _sender_metadata(group: StatelessGroup, items: list[tuple[str, torch.Tensor]]) -> tuple[list[TensorMeta], tuple[int, int], bool]:
    """Metadata and its hash, recomputed only when names/dtypes/shapes changed since the last send.

    Returns ``(metas, key, changed)``; the receivers get the full list only when ``changed``.
    """
    sig = [(n, t.dtype, t.shape) for n, t in items]  # (a tensor on another device: NCCL itself refuses it)
    last = group.cache.get("send_sig")
    if last is not None and last[0] == sig:
        return last[1], last[2], False
    dev = group.device
    for name, t in items:
        if t.device.type != dev.type or (dev.type == "cuda" and t.device != dev):
            raise WeightSyncError(f"tensor '{name}' is on {t.device}, but this group sends from {dev}; "
                                  f"move the model to {dev} first.")
    metas = metadata_of(items)
    key = _meta_hash(metas)
    group.cache["send_sig"] = (sig, metas, key)
    return metas, key, True


def send(group: StatelessGroup, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *,
         src: int = 0, mode: str = "bucketed", bucket_bytes: int = 256 << 20, version: int = 0,
         verify: bool = True) -> SyncStats:
    """Broadcast named tensors from this rank (``src``) to every other rank of ``group``.

    ``mode``: ``"bucketed"`` (one grouped launch per bucket, straight from the tensors' memory),
    ``"packed"`` (copied into two alternating buffers, one broadcast per bucket) or ``"per_tensor"``.
    Returns once every receiver has loaded the update (and, with ``verify``, matched its checksums).
    Raises ``WeightSyncError`` if any receiver rejects the metadata (no receiver loads anything then),
    reports a checksum mismatch or a failing ``load``; ``SyncTimeout`` if a peer stops answering.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    if group.rank != src:
        raise WeightSyncError(f"send() runs on the source rank {src}; this is rank {group.rank} (call receive()).")
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes must be at least {ALIGN}, got {bucket_bytes}")
    t0 = time.perf_counter()
    items = _items(named_tensors)
    metas, key, changed = _sender_metadata(group, items)
    hdr = _header(group, [MAGIC, version, key[0], key[1], len(metas), MODES[mode], bucket_bytes,
                          (1 if verify else 0) | (2 if changed else 0)], False)
    if changed or hdr[8]:  # new layout, or a receiver that has not checked this one: wait for the verdict
        if changed:
            _guard(group, lambda: group.broadcast_object([(m.name, m.dtype, m.shape) for m in metas], src),
                   "the handshake")
        rejected = _vote(group, [], "metadata")
        if rejected is not None:
            group.cache.pop("send_sig", None)
            raise WeightSyncError(_reject_message(version, rejected, "rejected before any weight changed",
                                                  "Nothing was loaded on any receiver. Fix the names/dtypes/shapes "
                                                  "(or the receiver's expected metadata) and send again."))
    t_hand = time.perf_counter() - t0

    plan = _plan(group, key, metas, bucket_bytes, mode)
    packed = any(b.packed for b in plan.buckets)
    bufs = _guard(group, lambda: _buffers(group, plan.staging), "buffer allocation") if packed else None
    views = plan.views_in(bufs) if packed else None
    sums = torch.zeros(max(len(plan.buckets), 1), dtype=torch.int64, device=group.device) if verify else None
    streams, cur = _streams(group, plan, verify, group.device)
    tensors = [t for _, t in items]  # (made contiguous bucket by bucket: Python time is wire time here)
    n_launch = 0

    def transfer() -> None:
        nonlocal n_launch
        works, pending = [], [None, None]
        for k, b in enumerate(plan.buckets):
            if b.packed:
                i = k % 2
                with _on(streams[i]):
                    if pending[i] is not None:  # buffer i is free once its previous broadcast is done
                        group.wait_work(pending[i], "bucket broadcast")
                    payload = bufs[i][: b.nbytes]  # pack: one multi-tensor copy kernel for the whole bucket
                    torch._foreach_copy_([v for _, v in views[k]], [tensors[j] for j, _, _ in b.items])
                    pending[i] = group.broadcast(payload, src, async_op=True)
                    n_launch += 1
                    if sums is not None:  # reads the bucket beside the broadcast (both only read it)
                        sums[k] = _checksum(payload)
            else:  # no copy: the bucket's tensors go out as one grouped launch, each from its own memory
                srcs = [tensors[j].contiguous() for j, _, _ in b.items]
                works.append(group.broadcast_many(srcs, src))
                n_launch += 1 if group.backend == "nccl" else len(srcs)
                if sums is not None:
                    sums[k] = _checksum(_cat_bytes(srcs))
        for w in works:
            group.wait_work(w, "bucket broadcast")
        for i in range(2):
            if pending[i] is not None:
                with _on(streams[i]):
                    group.wait_work(pending[i], "bucket broadcast")
        _join(streams, cur)

    with torch.no_grad():
        _guard(group, transfer, "the transfer")
    _finish(group, version, [], sums, plan, src)
    return SyncStats(bytes=plan.total, seconds=time.perf_counter() - t0, n_collectives=n_launch,
                     mode=mode, bucket_bytes=bucket_bytes, n_tensors=len(metas), version=version,
                     handshake_s=t_hand, verified=verify)


# ---------------------------------------------------------------------------- receiver side

def _landing(group: StatelessGroup, plan: _Plan, into: Mapping[str, torch.Tensor] | None,
             dev: torch.device) -> tuple[list[torch.Tensor | None], bool]:
    """Per tensor of the plan, the receiver's own tensor it can land in (contiguous, same dtype, shape and
    device) or None; and whether staging buffers are needed. Cached per (plan, ``into`` object), so build
    ``into`` once."""
    hit = group.cache.get("landing")
    if hit is not None and hit[0] is plan and hit[1] is into and hit[2] == len(into or ()):
        return hit[3], hit[4]
    land = []
    for m, dt, shape in zip(plan.metas, plan.dtypes, plan.shapes):
        t = (into or {}).get(m.name)
        ok = t is not None and t.is_contiguous() and t.device == dev and t.dtype == dt and tuple(t.shape) == shape
        land.append(t if ok else None)
    stage = any(b.packed or (len(b.items) > 1 and any(land[i] is None for i, _, _ in b.items)) for b in plan.buckets)
    group.cache["landing"] = (plan, into, len(into or ()), land, stage)
    return land, stage


def receive(group: StatelessGroup, *, src: int = 0, expected: Mapping[str, Any] | None,
            load: Callable[[list[tuple[str, torch.Tensor]]], None], device: str | torch.device | None = None,
            into: Mapping[str, torch.Tensor] | None = None) -> SyncStats:
    """Receive one update from ``src``: validate its metadata, then land every tensor.

    ``expected`` maps name -> ``TensorMeta`` (or a tensor); ``None`` accepts any metadata. A receiver checks
    a layout once and votes; later updates with the same layout and the same ``expected`` object skip the
    vote, so build ``expected`` once. ``into``: this receiver's own tensors by name (contiguous, matching
    dtype and shape); in ``bucketed`` and ``per_tensor`` modes those tensors are received in place, with no
    copy. Everything else arrives in a staging buffer and is handed to ``load`` as ``[(name, tensor)]``
    views, valid only during the call (copy what you keep). On NCCL ``load`` runs with a side stream
    current, so its copies are ordered after the data landed.
    """
    if group.rank == src:
        raise WeightSyncError(f"receive() runs on receivers; rank {src} is the source (call send()).")
    t0 = time.perf_counter()
    dev = torch.device(device) if device is not None else group.device
    accepted = group.cache.get("accepted")  # (key, expected, len) of the last layout this rank voted for
    stale = accepted is None or accepted[1] is not expected or accepted[2] != len(expected or ())
    magic, version, h0, h1, n_tensors, mode_code, bucket_bytes, flags, n_stale = _header(group, None, stale)
    if magic != MAGIC:
        group.abort()
        raise WeightSyncError(f"rank {group.rank}: got a header that is not from labsupport.broadcast.send "
                              f"(magic {magic:#x}); are both sides calling send/receive in the same order?")
    mode = {v: k for k, v in MODES.items()}[mode_code]
    key = (h0, h1)
    known = group.cache.setdefault("recv_meta", {})
    if flags & 2:
        raw = _guard(group, lambda: group.broadcast_object(None, src), "the handshake")
        known.clear()
        known[key] = [TensorMeta(n, d, tuple(s)) for n, d, s in raw]
    metas = known.get(key)
    if metas is None or not (flags & 2 or n_stale or accepted[0] == key):  # (one sender per group: cannot happen)
        group.abort()
        raise WeightSyncError(f"rank {group.rank}: update v{version} refers to metadata this rank never "
                              "accepted; create a new group.")
    if flags & 2 or n_stale:
        group.cache.pop("accepted", None)
        rejected = _vote(group, _validate(metas, expected), "metadata")
        if rejected is not None:
            raise WeightSyncError(_reject_message(version, rejected, "rejected before any weight changed",
                                                  "Nothing was loaded on any receiver."))
        group.cache["accepted"] = (key, expected, len(expected or ()))
    t_hand = time.perf_counter() - t0

    plan = _plan(group, key, metas, bucket_bytes, mode)
    land, need_stage = _landing(group, plan, into, dev)
    bufs = _guard(group, lambda: _buffers(group, plan.staging), "buffer allocation") if need_stage and plan.staging else None
    views = plan.views_in(bufs) if bufs is not None else None
    sums = torch.zeros(max(len(plan.buckets), 1), dtype=torch.int64, device=dev) if flags & 1 else None
    streams, cur = _streams(group, plan, bool(flags & 1), dev)
    load_errors: list[str] = []
    slots: list[Any] = [None, None]
    n_launch = 0

    def issue(k: int) -> None:
        nonlocal n_launch
        b, i = plan.buckets[k], k % 2
        with _on(streams[i]):
            homes = []
            if b.packed:  # lands in a staging buffer; tensors with a home in `into` are copied there after
                dst, staged = [bufs[i][: b.nbytes]], []
                for (j, _, _), (name, view) in zip(b.items, views[k]):
                    (homes.append((land[j], view)) if land[j] is not None else staged.append((name, view)))
                work = group.broadcast(dst[0], src, async_op=True)
                n_launch += 1
            else:
                dst, staged = [], []
                for n, (j, _, _) in enumerate(b.items):
                    t = land[j]
                    if t is None:
                        t = views[k][n][1] if len(b.items) > 1 else torch.empty(plan.shapes[j], dtype=plan.dtypes[j], device=dev)
                        staged.append((plan.metas[j].name, t))
                    dst.append(t)
                work = group.broadcast_many(dst, src)
                n_launch += 1 if group.backend == "nccl" else len(dst)
            slots[i] = (work, dst, staged, homes)

    def transfer() -> None:
        n = len(plan.buckets)
        if n:
            issue(0)
        for k in range(n):
            if k + 1 < n:
                issue(k + 1)  # the next bucket lands in the other buffer while this one is loaded
            i = k % 2
            work, dst, staged, homes = slots[i]
            with _on(streams[i]):
                group.wait_work(work, "bucket broadcast")
                if sums is not None:
                    sums[k] = _checksum(_cat_bytes(dst))
                if homes:
                    torch._foreach_copy_([h for h, _ in homes], [v for _, v in homes])
                if staged and not load_errors:
                    try:
                        load(staged)
                    except Exception as exc:  # keep receiving so the other ranks do not hang; report at the end
                        load_errors.append(f"load() failed on '{staged[0][0]}': {type(exc).__name__}: {exc}")
            slots[i] = None
        _join(streams, cur)

    with torch.no_grad():
        _guard(group, transfer, "the transfer")
    _finish(group, version, load_errors, sums, plan, src)
    return SyncStats(bytes=plan.total, seconds=time.perf_counter() - t0, n_collectives=n_launch,
                     mode=mode, bucket_bytes=bucket_bytes, n_tensors=len(metas), version=version,
                     handshake_s=t_hand, verified=sums is not None)


# ---------------------------------------------------------------------------- benchmark

def transformer_shapes(target_bytes: int, bytes_per_param: int = 2, min_layers: int = 20) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a Qwen2-style decoder of about ``target_bytes`` (embeddings ~20% of it).

    Picks the widest hidden size that still gives ``min_layers`` layers, so the list has hundreds of
    tensors of realistic sizes: big MLP matrices, mid-size attention, tiny norms and biases.
    """
    params = target_bytes / bytes_per_param
    best = None
    for h in (256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 5120, 8192):
        head_dim = 64 if h < 1024 else 128
        kv = max(1, h // head_dim // 6) * head_dim
        inter = max(256, round(h * 5.25 / 256) * 256)
        vocab = min(151936, max(1024, round(0.1 * params / h / 64) * 64))
        per_layer = 2 * h * h + 2 * kv * h + h + 2 * kv + 3 * h * inter + 2 * h
        layers = round((params - 2 * vocab * h - h) / per_layer)
        if best is None or layers >= min_layers:
            best = (h, kv, inter, vocab, max(1, layers))
        if layers < min_layers:
            break
    h, kv, inter, vocab, layers = best
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.q_proj.bias", (h,)),
                (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.k_proj.bias", (kv,)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.v_proj.bias", (kv,)),
                (p + "self_attn.o_proj.weight", (h, h)),
                (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                (p + "mlp.down_proj.weight", (h, inter))]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    return out


def _timed(group: StatelessGroup, fn: Callable[[], Any], iters: int, warmup: int) -> list[float]:
    """Seconds per call of ``fn`` on every rank, from a common start to the last rank done (one all-reduce)."""
    tick = torch.zeros(1, device=group.device)
    times = []
    for it in range(warmup + iters):
        group.all_reduce(tick)
        group.synchronize("benchmark barrier")
        t0 = time.perf_counter()
        fn()
        group.all_reduce(tick)  # completes only when every rank has finished fn
        group.synchronize("benchmark barrier")
        if it >= warmup:
            times.append(time.perf_counter() - t0)
    return times


BUCKET_MODES = {  # bench row name -> (send mode, verify, receiver lands in its own tensors)
    "bucketed": ("bucketed", True, True),
    "bucketed_noverify": ("bucketed", False, True),
    "bucketed_load_noverify": ("bucketed", False, False),
    "packed_noverify": ("packed", False, False),
}


def bench_on_group(group: StatelessGroup, sizes_bytes: list[int], buckets_bytes: list[int], *, iters: int = 5,
                   warmup: int = 1, src: int = 0, modes: tuple[str, ...] = ("raw", "per_tensor", *BUCKET_MODES),
                   progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Every rank calls this; rank ``src`` returns the measured rows (others return []).

    For each model size: ``raw`` (one broadcast of a single buffer of the same total bytes), ``per_tensor``
    (landing in place, no checksums), and for every bucket size: ``bucketed`` landing in the receivers' own
    tensors (with and without checksums), ``bucketed_load`` (landing in staging buffers that ``load`` copies
    out of, as an inference engine's ``load_weights`` needs) and ``packed`` (copied into buffers on the trainer,
    out of them on the receivers).
    """
    dev = group.device
    rows: list[dict[str, Any]] = []
    for size in sizes_bytes:
        shapes = transformer_shapes(size)
        total = sum(math.prod(s) * 2 for _, s in shapes)
        gen = torch.Generator(device=dev).manual_seed(size)
        if group.rank == src:
            model = {n: torch.randn(s, device=dev, generator=gen, dtype=torch.float32).to(torch.bfloat16)
                     for n, s in shapes}
            load, exp = None, None
        else:
            model = {n: torch.zeros(s, dtype=torch.bfloat16, device=dev) for n, s in shapes}
            load, exp = copy_into(model), expected_from(model)
        base = {"size_bytes": total, "n_tensors": len(shapes), "world_size": group.world_size,
                "backend": group.backend}

        def record(mode: str, bucket: int, times: list[float], stats: SyncStats | None) -> None:
            med = statistics.median(times)
            row = {**base, "mode": mode, "bucket_bytes": bucket, "seconds": med, "seconds_min": min(times),
                   "gb_per_s": total / med / 1e9, "n_collectives": stats.n_collectives if stats else 1,
                   "handshake_s": stats.handshake_s if stats else 0.0}
            rows.append(row)
            if progress:
                progress(f"{total / 1e9:6.2f} GB {mode:>22} bucket {bucket / 2**20:8.2f} MiB: "
                         f"{med * 1e3:8.2f} ms {row['gb_per_s']:8.2f} GB/s")

        if "raw" in modes:
            buf = torch.empty(total, dtype=torch.uint8, device=dev)
            times = _timed(group, lambda: group.broadcast(buf, src), iters, warmup)
            record("raw", total, times, None)
            del buf
        last: list[SyncStats] = []

        def one(mode: str, bucket: int, verify: bool, in_place: bool) -> None:
            if group.rank == src:
                last.append(send(group, model, src=src, mode=mode, bucket_bytes=bucket, verify=verify))
            else:
                last.append(receive(group, src=src, expected=exp, load=load, into=model if in_place else None))

        if "per_tensor" in modes:
            times = _timed(group, lambda: one("per_tensor", ALIGN, False, True), iters, warmup)
            record("per_tensor", 0, times, last[-1])
        for bucket in buckets_bytes:
            for name, (mode, verify, in_place) in BUCKET_MODES.items():
                if name in modes:
                    times = _timed(group, lambda: one(mode, bucket, verify, in_place), iters, warmup)
                    record(name, bucket, times, last[-1])
        model = load = None  # (free this size's weights before the next one)
        release_buffers(group)
    return rows if group.rank == src else []


@dataclass
class BenchConfig:
    sizes_bytes: list[int]
    buckets_bytes: list[int]
    iters: int
    warmup: int
    device_kind: str  # "cuda" or "cpu"
    port: int
    timeout_s: float


def _bench_rank(rank: int, world_size: int, cfg: BenchConfig) -> list[dict[str, Any]]:
    dev = f"cuda:{rank}" if cfg.device_kind == "cuda" else "cpu"
    group = create_group("127.0.0.1", cfg.port, rank, world_size, device=dev, timeout_s=cfg.timeout_s)
    say = (lambda m: print(m, flush=True)) if rank == 0 else None
    try:
        return bench_on_group(group, cfg.sizes_bytes, cfg.buckets_bytes, iters=cfg.iters, warmup=cfg.warmup,
                              progress=say)
    finally:
        group.destroy()


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model size: raw, per-tensor and best bucketed bandwidth, and bucketed as a fraction of raw."""
    out = []
    for size in sorted({r["size_bytes"] for r in rows}):
        rs = [r for r in rows if r["size_bytes"] == size]
        raw = next((r for r in rs if r["mode"] == "raw"), None)
        per = next((r for r in rs if r["mode"] == "per_tensor"), None)
        s = {"size_bytes": size, "size_gb": size / 1e9, "n_tensors": rs[0]["n_tensors"],
             "raw_gb_per_s": raw["gb_per_s"] if raw else None, "per_tensor_gb_per_s": per["gb_per_s"] if per else None}
        for mode in BUCKET_MODES:
            bs = [r for r in rs if r["mode"] == mode]
            if bs:
                best = max(bs, key=lambda r: r["gb_per_s"])
                s[f"best_{mode}_gb_per_s"] = best["gb_per_s"]
                s[f"best_{mode}_bucket_mib"] = best["bucket_bytes"] / 2**20
                s[f"best_{mode}_frac_of_raw"] = best["gb_per_s"] / raw["gb_per_s"] if raw else None
        if per and raw:
            s["per_tensor_frac_of_raw"] = per["gb_per_s"] / raw["gb_per_s"]
        if raw:  # every configuration within 90 % of raw, best first
            s["configs_at_90pct_of_raw"] = [
                f"{r['mode']} {r['bucket_bytes'] / 2**20:g} MiB ({r['gb_per_s'] / raw['gb_per_s']:.1%})"
                for r in sorted(rs, key=lambda r: -r["gb_per_s"])
                if r["mode"] != "raw" and r["gb_per_s"] >= 0.9 * raw["gb_per_s"]]
        out.append(s)
    return out


def check_bar(summary: list[dict[str, Any]], frac: float = 0.9, min_gb: float = 2.0) -> dict[str, Any] | None:
    """The issue's bar: bucketed sync of every size >= ``min_gb`` reaches ``frac`` of the raw broadcast
    measured in the same run; says which configurations did (None if no size is large enough)."""
    big = [s for s in summary if s["size_gb"] >= min_gb]
    if not big:
        return None
    met = {m: all((s.get(f"best_{m}_frac_of_raw") or 0) >= frac for s in big) for m in ("bucketed", "bucketed_noverify")}
    return {"threshold_frac_of_raw": frac, "sizes_gb": [s["size_gb"] for s in big],
            "met_bucketed_verified": met["bucketed"], "met_bucketed_without_checksums": met["bucketed_noverify"],
            "met_by": {f"{s['size_gb']:.2f} GB": s.get("configs_at_90pct_of_raw", []) for s in big}}


def format_rows(rows: list[dict[str, Any]]) -> str:
    """The benchmark's table: one line per (size, mode, bucket), with the fraction of raw bandwidth."""
    raw = {r["size_bytes"]: r["gb_per_s"] for r in rows if r["mode"] == "raw"}
    head = f"{'size GB':>8} {'tensors':>7} {'mode':>22} {'bucket MiB':>10} {'ms':>9} {'GB/s':>8} {'of raw':>7} {'launch':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        frac = r["gb_per_s"] / raw[r["size_bytes"]] if r["size_bytes"] in raw else float("nan")
        bucket = f"{r['bucket_bytes'] / 2**20:g}" if r["mode"] in BUCKET_MODES else "-"
        lines.append(f"{r['size_bytes'] / 1e9:8.3f} {r['n_tensors']:7d} {r['mode']:>22} {bucket:>10} "
                     f"{r['seconds'] * 1e3:9.2f} {r['gb_per_s']:8.2f} {frac:7.1%} {r['n_collectives']:6d}")
    return "\n".join(lines)


MODE_STYLE = {"bucketed": ("o-", "bucketed, in place, checksums"),
              "bucketed_noverify": (".:", "bucketed, in place, no checksums"),
              "bucketed_load_noverify": ("x-.", "bucketed, via staging + load()"),
              "packed_noverify": ("s--", "packed: copied in and out")}


def plot_bench(data: dict[str, Any], title: str = ""):
    """Left: bucketed bandwidth vs bucket size, one colour per model size (dashed: raw single buffer,
    dotted: per tensor). Right: the largest model, every way of sending it, against the raw line."""
    import matplotlib.pyplot as plt

    rows = data["rows"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.3), sharey=True)
    sizes = sorted({r["size_bytes"] for r in rows})
    for i, size in enumerate(sizes):
        color = plt.cm.viridis(i / max(1, len(sizes) - 1) * 0.9)
        rs = [r for r in rows if r["size_bytes"] == size]
        pts = sorted((r["bucket_bytes"] / 2**20, r["gb_per_s"]) for r in rs if r["mode"] == "bucketed")
        if pts:
            ax.plot(*zip(*pts), "o-", color=color, label=f"{size / 1e9:.2g} GB, {rs[0]['n_tensors']} tensors")
        for mode, style in (("raw", "--"), ("per_tensor", ":")):
            r = next((r for r in rs if r["mode"] == mode), None)
            if r:
                ax.axhline(r["gb_per_s"], linestyle=style, color=color, linewidth=1.0)
    big = [r for r in rows if r["size_bytes"] == sizes[-1]] if sizes else []
    for mode, (style, label) in MODE_STYLE.items():
        pts = sorted((r["bucket_bytes"] / 2**20, r["gb_per_s"]) for r in big if r["mode"] == mode)
        if pts:
            ax2.plot(*zip(*pts), style, label=label)
    raw = next((r for r in big if r["mode"] == "raw"), None)
    if raw:
        ax2.axhline(raw["gb_per_s"], linestyle="--", color="k", linewidth=1.0, label="raw single buffer")
        ax2.axhline(0.9 * raw["gb_per_s"], linestyle=":", color="r", linewidth=1.0, label="90% of raw")
    ticks = sorted({r["bucket_bytes"] / 2**20 for r in rows if r["mode"] in MODE_STYLE})
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        if ticks:
            a.set_xticks(ticks, [f"{t:g}" for t in ticks], fontsize=7)
            a.minorticks_off()
        a.set_xlabel("bucket size (MiB)")
        a.grid(alpha=0.3)
    ax.set_ylabel("payload bandwidth (GB/s)")
    ax.plot([], [], "k--", label="raw single-buffer broadcast")
    ax.plot([], [], "k:", label="per-tensor broadcast")
    ax.set_title("bucketed (in place, checksums) by model size", fontsize=9)
    ax2.set_title(f"{sizes[-1] / 1e9:.2g} GB: four ways" if sizes else "", fontsize=9)
    ax.legend(fontsize=7, loc="best")
    ax2.legend(fontsize=7, loc="best")
    fig.suptitle(title or "Weight sync bandwidth vs bucket size", fontsize=10)
    fig.tight_layout()
    return fig


def bench(world_size: int, sizes_gb: list[float], buckets_mb: list[float], *, iters: int = 5, warmup: int = 1,
          device_kind: str | None = None, timeout_s: float = 170.0) -> dict[str, Any]:
    """Run the sweep in ``world_size`` fresh processes (rank r on GPU r, or CPU/gloo); return the result data."""
    from labsupport import hardware

    kind = device_kind or ("cuda" if hardware.gpu_count() >= world_size else "cpu")
    cfg = BenchConfig([int(s * 1e9) for s in sizes_gb], [max(ALIGN, int(b * 2**20)) for b in buckets_mb],
                      iters, warmup, kind, free_port(), min(60.0, timeout_s))
    res = run_ranks(_bench_rank, world_size, (cfg,), timeout_s=timeout_s,
                    cpu_threads=1 if kind == "cpu" else None)
    bad = [(r, out) for r, (ok, out) in enumerate(res) if not ok]
    if bad:
        r, (name, msg, tb) = bad[0]
        raise RuntimeError(f"bench sync: rank {r} failed: {name}: {msg}\n{tb}")
    rows = res[0][1]
    return {"world_size": world_size, "backend": "nccl" if kind == "cuda" else "gloo", "iters": iters,
            "warmup": warmup, "sizes_gb": sizes_gb, "buckets_mb": buckets_mb, "rows": rows,
            "summary": summarize(rows)}


def bench_main(argv: list[str]) -> int:
    """``python -m labsupport bench sync``: per-tensor vs bucketed vs raw broadcast, table + JSON + plot."""
    from labsupport import hardware, results

    gpus = hardware.gpu_count()
    ap = argparse.ArgumentParser(prog="python -m labsupport bench sync", description=bench_main.__doc__)
    ap.add_argument("--world-size", type=int, default=None,
                    help="processes: 1 trainer + receivers (default: every GPU; 2 on CPU)")
    ap.add_argument("--sizes-gb", default=None, help="comma-separated bf16 model sizes in GB")
    ap.add_argument("--buckets-mb", default=None, help="comma-separated bucket sizes in MiB")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="fewer sizes/buckets (a smoke run)")
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU even if GPUs are present")
    ap.add_argument("--timeout", type=float, default=170.0, help="seconds before the run is killed")
    ap.add_argument("--no-save", action="store_true", help="do not write results/bench_sync.*.json/png")
    args = ap.parse_args(argv)
    gpu = gpus >= 2 and not args.cpu
    if gpu:
        sizes = "0.5,2.5" if args.quick else "0.1,0.5,1,2.5,5"
        buckets = "16,256,1024" if args.quick else "1,4,16,64,128,256,512,1024"
        iters = args.iters or (3 if args.quick else 8)
        world = args.world_size or gpus
    else:
        sizes = "0.002,0.01" if args.quick else "0.002,0.01,0.04"
        buckets = "0.0625,1,4" if args.quick else "0.0625,0.25,1,4,16"
        iters = args.iters or 2
        world = args.world_size or 2
    sizes_gb = [float(x) for x in (args.sizes_gb or sizes).split(",")]
    buckets_mb = [float(x) for x in (args.buckets_mb or buckets).split(",")]
    if gpu and world > gpus:
        print(f"--world-size {world} needs {world} GPUs; this machine shows {gpus}.", file=sys.stderr)
        return 2
    print(f"bench sync: {world} ranks over {'NCCL, one GPU each' if gpu else 'gloo on CPU'}; "
          f"sizes {sizes_gb} GB bf16; buckets {buckets_mb} MiB; {iters} iterations (median)", flush=True)
    t0 = time.perf_counter()
    data = bench(world, sizes_gb, buckets_mb, iters=iters, warmup=args.warmup,
                 device_kind="cuda" if gpu else "cpu", timeout_s=args.timeout)
    data["wall_s"] = time.perf_counter() - t0
    print(format_rows(data["rows"]))
    print()
    for s in data["summary"]:
        print(f"{s['size_gb']:.2f} GB ({s['n_tensors']} tensors): raw {s['raw_gb_per_s']:.1f} GB/s, per-tensor "
              f"{s['per_tensor_gb_per_s']:.1f} GB/s ({s.get('per_tensor_frac_of_raw', 0):.0%}), best bucketed "
              f"{s.get('best_bucketed_gb_per_s', 0):.1f} GB/s at {s.get('best_bucketed_bucket_mib', 0):g} MiB "
              f"({s.get('best_bucketed_frac_of_raw', 0):.1%} of raw; without checksums "
              f"{s.get('best_bucketed_noverify_frac_of_raw', 0):.1%} at {s.get('best_bucketed_noverify_bucket_mib', 0):g}"
              f" MiB; via load() {s.get('best_bucketed_load_noverify_frac_of_raw') or 0:.1%}; packed "
              f"{s.get('best_packed_noverify_frac_of_raw') or 0:.1%})")
    bar = check_bar(data["summary"]) if gpu else None
    if bar is not None:
        data["bar"] = bar
        data["bar_90pct_of_raw_at_2gb_plus"] = bar["met_bucketed_verified"] or bar["met_bucketed_without_checksums"]
        print(f"bar (bucketed >= 90% of raw, sizes >= 2 GB, raw measured in this run): with checksums "
              f"{'MET' if bar['met_bucketed_verified'] else 'NOT MET'}, without checksums "
              f"{'MET' if bar['met_bucketed_without_checksums'] else 'NOT MET'}")
        for size, configs in bar["met_by"].items():
            print(f"  {size}: configurations at >= 90% of raw: {', '.join(configs) or 'none'}")
    print(f"wall time {data['wall_s']:.1f} s")
    if not args.no_save:
        tag = results.machine_tag()
        fig = plot_bench(data, f"Weight sync, {world} ranks ({tag}, {data['backend']})")
        path = results.save_result("bench_sync", data, figure=fig)
        print("wrote", path, "and", path.with_suffix(".png"))
    return 0
