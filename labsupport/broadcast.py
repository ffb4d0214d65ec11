"""Weight sync from a trainer to inference ranks over a stateless group: handshake, buckets, verification.

``send`` (the trainer, rank ``src``) and ``receive`` (every other rank) run concurrently:

1. handshake: one all-reduce carries the trainer's header (version, metadata hash, mode, bucket size) and
   each receiver's "must I check the metadata again?". Names/dtypes/shapes follow only when they changed;
   receivers check them and all ranks vote: one objection makes *every* rank raise ``WeightSyncError``
   naming the tensor, before any weight changes.
2. transfer: ``per_tensor`` (one broadcast per tensor, the baseline); ``bucketed`` (a bucket is one NCCL
   launch straight from the tensors' memory, landing in the receiver's own tensors (``into``) or in a
   staging buffer that ``load`` empties while the next bucket arrives); ``packed`` (the classic: the trainer
   copies bucket k+1 into a buffer while bucket k is on the wire). Copies compete with NCCL for memory
   bandwidth, which is why ``bucketed`` avoids them.
3. verification: a checksum per bucket (``labsupport.checksums``) on both sides, compared in a closing
   all-reduce that also reports failed ``load`` calls. A dead peer makes every survivor raise ``SyncTimeout``.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch

from labsupport import checksums, metadata
from labsupport.checksums import tensor_checksums  # noqa: F401 (callers use broadcast.tensor_checksums)
from labsupport.core.buckets import ALIGN, dtype_name, round_up  # one copy, shared with ipc and the core
from labsupport.core.buckets import groups as bucket_groups  # greedy bucketing, one copy
from labsupport.groups import GroupError, StatelessGroup

MODES = {"per_tensor": 0, "bucketed": 1, "packed": 2}
VERIFY, NEW_LAYOUT = 1, 2  # header flags: checksums follow; the metadata follows (it changed)
SMALL = 1 << 20  # bucketed mode packs tensors under 1 MiB (norms, biases): one launch costs more than their copy
RAMP = (16, 4)  # bucketed mode: the first two grouped buckets are 1/16 and 1/4 of a bucket (see plan_buckets)

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
Batch = list[tuple[str, torch.Tensor]]


class WeightSyncError(Exception):
    """A weight update was rejected or failed; the message says which tensor/rank and what to do."""


class SyncTimeout(WeightSyncError, TimeoutError):
    """A peer died or stopped answering during a sync (the message names it); the group is then unusable."""


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
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.torch_dtype.itemsize


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


def _items(named_tensors: NamedTensors) -> Batch:
    return list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)


def metadata_of(named_tensors: NamedTensors) -> list[TensorMeta]:
    """``TensorMeta`` for each (name, tensor), in order."""
    return [TensorMeta(n, dtype_name(t), tuple(t.shape)) for n, t in _items(named_tensors)]


def expected_from(named_tensors: NamedTensors) -> dict[str, TensorMeta]:
    """The ``expected`` argument of ``receive`` for a receiver that holds these tensors."""
    return {m.name: m for m in metadata_of(named_tensors)}


def copy_into(targets: Mapping[str, torch.Tensor]) -> Callable[[Batch], None]:
    """A ``load`` callback that copies each received tensor into ``targets[name]`` (in place, no grad)."""
    def load(batch: Batch) -> None:
        with torch.no_grad():  # one multi-tensor copy for the whole bucket, not one kernel launch per tensor
            torch._foreach_copy_([targets[name] for name, _ in batch], [t for _, t in batch])

    return load


# ---------------------------------------------------------------------------- trainer side
def send(group: StatelessGroup, named_tensors: NamedTensors, *, src: int = 0, mode: str = "bucketed",
         bucket_bytes: int = 256 << 20, version: int = 0, verify: bool = True) -> SyncStats:
    """Broadcast named tensors from this rank (``src``) to every other rank; returns once every receiver has
    loaded them (and matched the checksums). Raises ``WeightSyncError`` on rejected metadata (nothing loaded
    anywhere), a checksum mismatch or a failed ``load``; ``SyncTimeout`` if a peer stops answering."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    if group.rank != src:
        raise WeightSyncError(f"send() runs on the source rank {src}; this is rank {group.rank} (call receive()).")
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes must be at least {ALIGN}, got {bucket_bytes}")
    t0 = time.perf_counter()
    items = _items(named_tensors)
    metas, key, changed = _sender_metadata(group, items)
    hdr = _header(group, [version, key[0], key[1], len(metas), MODES[mode], bucket_bytes,
                          (VERIFY if verify else 0) | (NEW_LAYOUT if changed else 0)], False)
    if changed or hdr[7]:  # new layout, or a receiver that has not checked this one: wait for the verdict
        if changed:
            _guard(group, lambda: group.broadcast_object([(m.name, m.dtype, m.shape) for m in metas], src),
                   "the handshake")
        _vote(group, [], version)
    t_hand = time.perf_counter() - t0

    plan = _plan(group, key, metas, bucket_bytes, mode)
    bufs, views, sums, streams, cur = _prepare(group, plan, any(b.packed for b in plan.buckets), verify, group.device)
    tensors = [t for _, t in items]  # (made contiguous bucket by bucket: Python time is wire time here)

    def transfer() -> None:
        works, pending = [], [None, None]
        for k, b in enumerate(plan.buckets):
            if b.packed:
                i = k % 2
                with _on(streams[i]):
                    if pending[i] is not None:  # buffer i is free once its previous broadcast is done
                        group.wait_work(pending[i], "bucket broadcast")
                    payload = bufs[i][: b.nbytes]  # pack: one multi-tensor copy kernel for the whole bucket
                    torch._foreach_copy_([v for _, v in views[k]], [tensors[j] for j, _, _ in b.items])
                    pending[i] = group.broadcast_many([payload], src)
                    if sums is not None:  # reads the bucket beside the broadcast (both only read it)
                        sums[k] = checksums.of_bytes(payload)
            else:  # no copy: the bucket's tensors go out as one grouped launch, each from its own memory
                srcs = [tensors[j].contiguous() for j, _, _ in b.items]
                works.append(group.broadcast_many(srcs, src))
                if sums is not None:
                    sums[k] = checksums.of_bytes(checksums.cat_bytes(srcs))
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
    return SyncStats(bytes=plan.total, seconds=time.perf_counter() - t0, n_collectives=plan.launches(group),
                     mode=mode, bucket_bytes=bucket_bytes, n_tensors=len(metas), version=version,
                     handshake_s=t_hand, verified=verify)


@dataclass
class SyncState:
    """What this module keeps on a group between syncs (``group.sync``), so that a repeated layout costs no
    second handshake, plan or allocation. Each field is one rank's own memory of the last sync."""
    sent: tuple | None = None  # sender: (signature, metas, key) of the layout announced last
    announced: list[TensorMeta] | None = None  # receiver: the layout announced last
    accepted: tuple | None = None  # receiver: (key, expected, len) of the layout it voted for last
    landing: tuple | None = None  # receiver: (plan, into, len, land, stage) of the last landing
    header: tuple | None = None  # the handshake's (pinned host slot, device slot)
    plans: dict = field(default_factory=dict)  # (key, bucket_bytes, mode) -> _Plan, the last 16
    buffers: list[torch.Tensor] | None = None  # two staging buffers, grown to the largest bucket seen
    streams: list | None = None  # two side streams (NCCL)


def _state(group: StatelessGroup) -> SyncState:
    if group.sync is None:
        group.sync = SyncState()
    return group.sync


def staging_bytes(group: StatelessGroup | None) -> int:
    """Bytes of the staging buffers this group keeps between syncs (0 for none)."""
    return sum(b.numel() for b in (group.sync.buffers or [])) if group is not None and group.sync else 0


def _sender_metadata(group: StatelessGroup, items: Batch) -> tuple[list[TensorMeta], tuple[int, int], bool]:
    """``(metas, key, changed)``: the metadata and its hash, recomputed only when the layout changed."""
    sig = [(n, t.dtype, t.shape) for n, t in items]
    last = _state(group).sent
    if last is not None and last[0] == sig:
        return last[1], last[2], False
    dev = group.device
    for name, t in items:
        if t.device.type != dev.type or (dev.type == "cuda" and t.device != dev):
            raise WeightSyncError(f"tensor '{name}' is on {t.device}, but this group sends from {dev}; "
                                  f"move the model to {dev} first.")
    metas = metadata_of(items)
    h = hashlib.sha256(repr([(m.name, m.dtype, m.shape) for m in metas]).encode()).digest()
    key = int.from_bytes(h[:8], "little", signed=True), int.from_bytes(h[8:16], "little", signed=True)
    group.sync.sent = (sig, metas, key)
    return metas, key, True


# ---------------------------------------------------------------------------- receiver side
def receive(group: StatelessGroup, *, src: int = 0, expected: Mapping[str, TensorMeta] | None,
            load: Callable[[Batch], None], device: str | torch.device | None = None,
            into: Mapping[str, torch.Tensor] | None = None) -> SyncStats:
    """Receive one update from ``src``: validate its metadata, then land every tensor. ``expected`` (from
    ``expected_from``; ``None`` accepts anything) is checked once per layout and object. ``into``: this receiver's
    own tensors by name, received in place in ``bucketed`` and ``per_tensor`` modes; the rest goes to ``load`` as
    ``[(name, view)]``, valid only during the call (on NCCL, on a side stream)."""
    if group.rank == src:
        raise WeightSyncError(f"receive() runs on receivers; rank {src} is the source (call send()).")
    t0 = time.perf_counter()
    dev = torch.device(device) if device is not None else group.device
    st = _state(group)
    accepted = st.accepted
    stale = accepted is None or accepted[1] is not expected or accepted[2] != len(expected or ())
    version, h0, h1, n_tensors, mode_code, bucket_bytes, flags, n_stale = _header(group, None, stale)
    mode, key = list(MODES)[mode_code], (h0, h1)
    if flags & NEW_LAYOUT:  # (otherwise it is the layout announced last, which this rank keeps)
        raw = _guard(group, lambda: group.broadcast_object(None, src), "the handshake")
        st.announced = [TensorMeta(n, d, tuple(s)) for n, d, s in raw]
    metas = st.announced
    if flags & NEW_LAYOUT or n_stale:
        st.accepted = None
        _vote(group, _validate(metas, expected), version)
        st.accepted = (key, expected, len(expected or ()))
    t_hand = time.perf_counter() - t0

    plan = _plan(group, key, metas, bucket_bytes, mode)
    land, stage = _landing(group, plan, into, dev)
    bufs, views, sums, streams, cur = _prepare(group, plan, stage, bool(flags & VERIFY), dev)
    load_errors: list[str] = []
    slots: list[Any] = [None, None]

    def issue(k: int) -> None:
        """Start bucket k's broadcast into its landing places, on side stream k % 2."""
        b, i = plan.buckets[k], k % 2
        with _on(streams[i]):
            dst, staged, homes = [], [], []
            if b.packed:  # lands in a staging buffer; tensors with a home in `into` are copied there after
                dst = [bufs[i][: b.nbytes]]
                homes = [(land[j], v) for (j, _, _), (_, v) in zip(b.items, views[k]) if land[j] is not None]
                staged = [(name, v) for (j, _, _), (name, v) in zip(b.items, views[k]) if land[j] is None]
            else:
                for n, (j, _, _) in enumerate(b.items):
                    t = land[j]
                    if t is None:
                        m = plan.metas[j]
                        t = views[k][n][1] if len(b.items) > 1 else torch.empty(m.shape, dtype=m.torch_dtype, device=dev)
                        staged.append((m.name, t))
                    dst.append(t)
            slots[i] = (group.broadcast_many(dst, src), dst, staged, homes)

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
                    sums[k] = checksums.of_bytes(checksums.cat_bytes(dst))
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
    return SyncStats(bytes=plan.total, seconds=time.perf_counter() - t0, n_collectives=plan.launches(group),
                     mode=mode, bucket_bytes=bucket_bytes, n_tensors=len(metas), version=version,
                     handshake_s=t_hand, verified=sums is not None)


def _landing(group: StatelessGroup, plan: _Plan, into: Mapping[str, torch.Tensor] | None,
             dev: torch.device) -> tuple[list[torch.Tensor | None], bool]:
    """Per tensor, the matching tensor of ``into`` it lands in (or None); and whether staging is needed."""
    hit = _state(group).landing
    if hit is not None and hit[0] is plan and hit[1] is into and hit[2] == len(into or ()):
        return hit[3], hit[4]
    land = []
    for m in plan.metas:
        t = (into or {}).get(m.name)
        ok = (t is not None and t.is_contiguous() and t.device == dev and t.dtype == m.torch_dtype
              and tuple(t.shape) == m.shape)
        land.append(t if ok else None)
    stage = any(b.packed or (len(b.items) > 1 and any(land[i] is None for i, _, _ in b.items)) for b in plan.buckets)
    group.sync.landing = (plan, into, len(into or ()), land, stage)
    return land, stage


# ---------------------------------------------------------------------------- handshake and votes
def _header(group: StatelessGroup, fields: list[int] | None, stale: bool) -> list[int]:
    """The handshake: an all-reduce (sum) of the sender's header and the count of receivers that must vote."""
    st = _state(group)
    if st.header is None:  # a pinned host slot and a device slot, reused (each sync ends synchronized)
        host = torch.zeros(8, dtype=torch.int64, pin_memory=group.backend == "nccl")
        st.header = (host, torch.zeros(8, dtype=torch.int64, device=group.device))
    host, vals = st.header
    host.numpy()[:] = (fields or [0] * 7) + [int(stale)]
    vals.copy_(host, non_blocking=True)  # from pinned memory: never waits for a stream (it may be stuck)
    _all_reduce_now(group, vals, "sum", "the handshake")
    return vals.tolist()


def _validate(metas: list[TensorMeta], expected: Mapping[str, TensorMeta] | None) -> list[str]:
    """Problems a receiver finds in an update's metadata (empty list: accept)."""
    if expected is None:
        return []
    out = []
    for name, what, want, got in metadata.problems([(m.name, m.dtype, m.shape) for m in metas],
                                                   {n: (e.dtype, e.shape) for n, e in expected.items()}):
        if what == "twice":
            out.append(f"'{name}': sent twice")
        elif what == "unknown":
            close = difflib.get_close_matches(name, list(expected), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            out.append(f"'{name}': unknown name, expected one of this receiver's {len(expected)} tensors{hint}")
        else:  # "dtype" or "shape"
            out.append(f"'{name}': {what} expected {want}, found {got}")
    return out


def _vote(group: StatelessGroup, my_problems: list[str], version: int) -> None:
    """The metadata vote: if any rank objects, every rank raises ``WeightSyncError`` with every rank's problems."""
    # torch.full is a device-side fill: unlike torch.tensor(..., device="cuda") it never waits for the
    # stream, which may be stuck behind a broadcast to a dead peer (we must reach our timed wait below).
    flag = torch.full((1,), 1 if my_problems else 0, dtype=torch.int32, device=group.device)
    _all_reduce_now(group, flag, "max", "the metadata vote")
    if int(flag.item()) == 0:
        return
    everyone = _guard(group, lambda: group.all_gather_object(list(my_problems)), "the metadata vote")
    _state(group).sent = None  # (the sender announces the layout again next time)
    raise WeightSyncError(_reject_message(version, everyone, "rejected before any weight changed",
                                          "Nothing was loaded on any receiver. Fix the names/dtypes/shapes "
                                          "(or the receiver's expected metadata) and send again."))


def _finish(group: StatelessGroup, version: int, problems: list[str], sums: torch.Tensor | None,
            plan: _Plan, src: int) -> None:
    """The closing vote: all-reduce (max) of [failed?, sums, -sums]; the sums agree when max == min."""
    vec = torch.full((1,), 1 if problems else 0, dtype=torch.int64, device=group.device)
    if sums is not None:
        vec = torch.cat([vec, sums, -sums])
    _all_reduce_now(group, vec, "max", "the verification vote")
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


def _reject_message(version: int, per_rank: list[list[str]], head: str, tail: str) -> str:
    """Every rank's problems, at most five each, under one heading."""
    lines = []
    for r, probs in enumerate(per_rank):
        lines += [f"  rank {r}: {p}" for p in probs[:5]]
        if len(probs) > 5:
            lines.append(f"  rank {r}: ... and {len(probs) - 5} more")
    return f"weight update v{version} {head}:\n" + "\n".join(lines) + f"\n{tail}"


def _all_reduce_now(group: StatelessGroup, t: torch.Tensor, op: str, what: str) -> None:
    """All-reduce ``t`` and wait for the result (never longer than the group's timeout)."""
    _guard(group, lambda: (group.all_reduce(t, op), group.synchronize(what)), what)


def _guard(group: StatelessGroup, fn: Callable[[], Any], what: str) -> Any:
    """Run a group step; a peer that died or timed out becomes ``SyncTimeout`` (and the group is aborted)."""
    try:
        return fn()
    except GroupError as exc:
        group.abort()
        raise SyncTimeout(f"weight sync failed during {what}: {exc}") from exc


# ---------------------------------------------------------------------------- bucket plan
@dataclass
class _Bucket:
    items: list[tuple[int, int, int]] = field(default_factory=list)  # (tensor index, byte offset, nbytes)
    nbytes: int = 0  # size of the bucket's packed layout (every tensor at a 256-byte boundary)
    packed: bool = False  # travels as one buffer, copied in on the trainer and out on the receivers


def plan_buckets(metas: list[TensorMeta], bucket_bytes: int, mode: str = "bucketed") -> list[_Bucket]:
    """Split tensors into buckets of at most ``bucket_bytes``; both sides compute the same plan. ``packed``:
    tensors larger than a bucket go first, alone, so the wire is busy while bucket 1 is packed. ``bucketed``: small
    tensors are packed in buckets of their own, the rest go as grouped launches; a group costs host time per
    tensor (~5 us) before anything moves, so the first two are small and packing comes second."""
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


def _fill(sizes: list[int], idx: list[int], bucket_bytes: int, packed: bool, ramp: bool = False) -> list[_Bucket]:
    """Consecutive buckets of at most ``bucket_bytes``; with ``ramp`` the first two are smaller (``RAMP``)."""
    cap = (lambda k: bucket_bytes // RAMP[k] if k < len(RAMP) else bucket_bytes) if ramp else bucket_bytes
    out = []
    for group in bucket_groups([round_up(sizes[i]) for i in idx], cap):
        b, off = _Bucket(packed=packed and len(group) > 1), 0  # a tensor alone travels from its own memory
        for j in group:
            b.items.append((idx[j], off, sizes[idx[j]]))
            off += round_up(sizes[idx[j]])
        b.nbytes = off
        out.append(b)
    return out


@dataclass
class _Plan:
    """Everything both sides derive once per (metadata, bucket size, mode) and reuse on every update."""
    metas: list[TensorMeta]
    buckets: list[_Bucket]
    total: int
    staging: int  # bytes of the largest multi-tensor bucket (the size of each of the two staging buffers)
    views: Any = None  # (buffers, per bucket: [(name, view into its buffer)]) made once per buffer pair

    def views_in(self, bufs: list[torch.Tensor]) -> list[Batch]:
        """Per bucket, each tensor's typed view into its buffer ([] for a single tensor); cached: views cost time."""
        if self.views is None or self.views[0] is not bufs:
            per_bucket = []
            for k, b in enumerate(self.buckets):
                metas = [self.metas[i] for i, _, _ in b.items] if len(b.items) > 1 else []
                per_bucket.append([(m.name, bufs[k % 2][off:off + n].view(m.torch_dtype).view(m.shape))
                                   for m, (_, off, n) in zip(metas, b.items)])
            self.views = (bufs, per_bucket)
        return self.views[1]

    def launches(self, group: StatelessGroup) -> int:
        """Broadcast launches per sync: one per bucket on NCCL; gloo cannot group, so one per unpacked tensor."""
        return sum(1 if b.packed or group.backend == "nccl" else len(b.items) for b in self.buckets)


def _plan(group: StatelessGroup, key: tuple[int, int], metas: list[TensorMeta], bucket_bytes: int, mode: str) -> _Plan:
    """The plan for this layout, bucket size and mode, from the group's cache (the last 16 kept)."""
    plans = _state(group).plans
    pk = (key, bucket_bytes, mode)
    if pk not in plans:
        if len(plans) > 16:
            plans.clear()
        buckets = plan_buckets(metas, bucket_bytes, mode)
        plans[pk] = _Plan(metas, buckets, sum(m.nbytes for m in metas),
                          max((b.nbytes for b in buckets if len(b.items) > 1), default=0))
    return plans[pk]


# ---------------------------------------------------------------------------- buffers and streams (GPU vs CPU)
def _prepare(group: StatelessGroup, plan: _Plan, stage: bool, verify: bool, dev: torch.device) -> tuple:
    """``(buffers, views, sums, streams, current stream)``: staging buffers if ``stage``, checksum slots if
    ``verify``, and two side streams that start after the current stream's work (the weights as last written,
    the checksum multipliers made here). On gloo the streams are ``[None, None], None`` (all inline)."""
    bufs = views = None
    if stage:  # two byte buffers kept in the group, grown when a larger bucket comes (no allocation per sync)
        st = _state(group)
        if st.buffers is None or st.buffers[0].numel() < plan.staging:
            _guard(group, lambda: release_buffers(group), "buffer allocation")
            st.buffers = [torch.zeros(plan.staging, dtype=torch.uint8, device=group.device) for _ in range(2)]
        bufs = st.buffers
        views = plan.views_in(bufs)
    sums = torch.zeros(max(len(plan.buckets), 1), dtype=torch.int64, device=dev) if verify else None
    if verify:
        checksums.reserve(dev, max((b.nbytes for b in plan.buckets), default=0))
    if group.backend != "nccl":
        return bufs, views, sums, [None, None], None
    st = _state(group)
    if st.streams is None:
        st.streams = [torch.cuda.Stream(device=group.device) for _ in range(2)]
    cur = torch.cuda.current_stream(group.device)
    for s in st.streams:
        s.wait_stream(cur)
    return bufs, views, sums, st.streams, cur


def _on(stream: Any):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _join(streams: list[Any], cur: Any) -> None:
    """The current stream continues after both side streams' work (GPU)."""
    if cur is not None:
        for s in streams:
            cur.wait_stream(s)


def release_buffers(group: StatelessGroup) -> None:
    """Drop the two bucket buffers this group keeps between syncs (back to PyTorch's cache, not the driver)."""
    st = _state(group)
    for plan in st.plans.values():
        plan.views = None  # (views into the buffers would keep them alive)
    if st.buffers is not None:
        st.buffers = None
        group.synchronize("releasing buffers")
