"""Weight sync, hardened: ``labsupport.core.sync`` plus what production needs (Lab 3 lists each addition).

The shape is the core's: metadata, then buckets in the core's layout (``core.buckets``), then load, then a
timed closing wait. What it adds, each against a failure the core lets through:

- handshake and metadata vote: every receiver checks names, dtypes and shapes against its own tensors and all
  ranks vote before a byte moves (a renamed or transposed tensor loaded as garbage, or on one receiver only);
  the metadata travels only when some rank does not hold it yet (a round trip on every update);
- landing in place: a bucket leaves as one grouped launch from the trainer's tensors and lands in the
  receiver's own (``into``); only small tensors are packed (copies competing with NCCL for memory bandwidth);
- double buffering: two staging buffers, reused, so that a bucket is loaded while the next one arrives (the wire
  idle during a load, an allocation per bucket);
- checksum vote: a checksum per bucket on both sides, compared in a closing all-reduce that also reports a failed
  ``load`` (corrupted bytes or a half-done load that no one notices);
- deadlines: every wait is bounded; a dead peer becomes ``SyncTimeout`` naming it (one dead rank hanging all).

What one update leaves for the next (the agreed layout, the plan, the buffers) lives in the objects the caller
holds, a ``Sender`` and a ``Receiver``; ``send`` and ``receive`` are one-shot wrappers around them.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from labsupport import checksums, metadata
from labsupport.core import buckets
from labsupport.core.buckets import ALIGN, Entry, Meta
from labsupport.groups import GroupError, StatelessGroup

MODES = ("per_tensor", "bucketed", "packed")
SMALL = 1 << 20  # bucketed mode packs tensors under 1 MiB (norms, biases): a launch costs more than their copy
NONE = -(2**63)  # a receiver's share of the trainer's header fields (the handshake's all-reduce takes the max)

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
Batch = list[tuple[str, torch.Tensor]]


class WeightSyncError(Exception):
    """A weight update was rejected or failed; the message says which tensor/rank and what to do."""


class SyncTimeout(WeightSyncError, TimeoutError):
    """A peer died or stopped answering during a sync (the message names it); the group is then unusable."""


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


def expected_from(named_tensors: NamedTensors) -> dict[str, Meta]:
    """A receiver's ``expected``: the ``Meta`` of each of its tensors, by name."""
    return {m.name: m for m in buckets.metas(named_tensors)}


@contextlib.contextmanager
def guard(group: StatelessGroup, what: str) -> Iterator[None]:
    """Steps of a sync: a peer lost during ``what`` becomes ``SyncTimeout`` (and the group is aborted)."""
    try:
        yield
    except GroupError as exc:
        group.abort()
        raise SyncTimeout(f"weight sync failed during {what}: {exc}") from exc


# ---------------------------------------------------------------------------- the plan: core.buckets' layout
@dataclass
class Bucket:
    """One broadcast launch: its tensors in the core's layout, and whether they travel packed in one buffer."""
    entries: list[Entry]
    packed: bool  # copied into a buffer on the trainer and out of one on the receivers
    nbytes: int  # the layout's size


def plan_buckets(metas: list[Meta], bucket_bytes: int, mode: str = "bucketed") -> list[Bucket]:
    """Both sides' plan, consecutive buckets of at most ``bucket_bytes`` (``core.buckets.split``): ``per_tensor``,
    one tensor each; ``bucketed``, small tensors packed in buckets of their own and the rest grouped; ``packed``,
    everything packed. Buckets that need no packing go first: the wire starts while the others are packed."""
    live = [m for m in metas if buckets.nbytes(m)]  # (an empty tensor has nothing to send)
    if mode == "per_tensor":
        return [_bucket([m], False) for m in live]
    cut = math.inf if mode == "packed" else min(SMALL, bucket_bytes // 64)  # "small" is relative to the bucket too
    plan = [_bucket(b, True) for b in buckets.split([m for m in live if buckets.nbytes(m) < cut], bucket_bytes)]
    plan += [_bucket(b, False) for b in buckets.split([m for m in live if buckets.nbytes(m) >= cut], bucket_bytes)]
    return sorted(plan, key=lambda b: b.packed)


def _bucket(metas: list[Meta], packed: bool) -> Bucket:
    entries, size = buckets.layout(metas)
    return Bucket(entries, packed and len(metas) > 1, size)  # a tensor alone travels from its own memory


class _Side:
    """What a sender and a receiver keep between updates: the last plan and two staging buffers."""

    def __init__(self, group: StatelessGroup, src: int, timeout_s: float | None) -> None:
        self.group, self.src, self.timeout_s = group, src, timeout_s
        self.plan: tuple[Any, list[Bucket], Any] | None = None  # (key, plan, landing)
        self.buffers: list[torch.Tensor] = []

    @property
    def staging_bytes(self) -> int:
        """Bytes of the staging buffers kept for the next update."""
        return sum(b.numel() for b in self.buffers)

    def release(self) -> None:
        """Drop the staging buffers (back to PyTorch's cache); the next update that needs them makes them again."""
        self.buffers = []

    def _staging(self, nbytes: int) -> list[torch.Tensor]:
        """The two staging buffers, grown to ``nbytes`` each when a larger bucket comes."""
        if nbytes and (not self.buffers or self.buffers[0].numel() < nbytes):
            self.buffers = [torch.empty(nbytes, dtype=torch.uint8, device=self.group.device) for _ in range(2)]
        return self.buffers

    def _stats(self, t0: float, t_hand: float, metas: list[Meta], plan: list[Bucket], mode: str,
               bucket_bytes: int, version: int, verified: bool) -> SyncStats:
        launches = sum(1 if b.packed or self.group.backend == "nccl" else len(b.entries) for b in plan)
        return SyncStats(sum(buckets.nbytes(m) for m in metas), time.perf_counter() - t0, launches, mode,
                         bucket_bytes, len(metas), version, t_hand, verified)


# ---------------------------------------------------------------------------- trainer side
class Sender(_Side):
    """The trainer's side (rank ``src``) of a run of updates, one ``send`` per optimizer step."""

    def __init__(self, group: StatelessGroup, *, src: int = 0, mode: str = "bucketed", bucket_bytes: int = 256 << 20,
                 verify: bool = True, timeout_s: float | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
        if group.rank != src:
            raise WeightSyncError(f"a Sender runs on the source rank {src}; this is rank {group.rank} (use a Receiver).")
        if bucket_bytes < ALIGN:
            raise ValueError(f"bucket_bytes must be at least {ALIGN}, got {bucket_bytes}")
        super().__init__(group, src, timeout_s)
        self.mode, self.bucket_bytes, self.verify = mode, bucket_bytes, verify
        self.layout: tuple[list, list[Meta], int] | None = None  # (signature, metas, key) of the tensors sent last

    def send(self, named_tensors: NamedTensors, *, version: int = 0) -> SyncStats:
        """Broadcast named tensors to every other rank; returns once every receiver has loaded them (and matched
        the checksums). Raises ``WeightSyncError`` on rejected metadata (nothing loaded anywhere), a checksum
        mismatch or a failed ``load``; ``SyncTimeout`` if a peer stops answering within the deadline."""
        t0 = time.perf_counter()
        items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
        metas, key = self._metadata(items)
        header = [version, MODES.index(self.mode), self.bucket_bytes, int(self.verify), len(metas)]
        if not _handshake(self.group, header, key, self.timeout_s)[1]:  # some rank lacks this layout: send it
            with guard(self.group, "the handshake"):
                self.group.broadcast_object((key, metas), self.src)
            _vote(self.group, [], version, self.timeout_s)
        t_hand = time.perf_counter() - t0
        if self.plan is None or self.plan[0] != key:
            self.plan = (key, plan_buckets(metas, self.bucket_bytes, self.mode), None)
        plan = self.plan[1]
        with torch.no_grad(), guard(self.group, "the transfer"):
            sums = self._transfer(plan, dict(items))
        _finish(self.group, version, [], sums, plan, self.src, self.timeout_s)
        return self._stats(t0, t_hand, metas, plan, self.mode, self.bucket_bytes, version, self.verify)

    def _metadata(self, items: Batch) -> tuple[list[Meta], int]:
        """The metadata and its key, made again only when names, dtypes, shapes or devices changed."""
        sig = [(n, t.dtype, t.shape, t.device) for n, t in items]
        if self.layout is None or self.layout[0] != sig:
            dev = self.group.device
            for name, t in items:
                if t.device.type != dev.type or (dev.type == "cuda" and t.device != dev):
                    raise WeightSyncError(f"tensor '{name}' is on {t.device}, but this group sends from {dev}; "
                                          f"move the model to {dev} first.")
            metas = buckets.metas(items)
            digest = hashlib.sha256(repr(metas).encode()).digest()
            self.layout = (sig, metas, int.from_bytes(digest[:8], "little") >> 2 | 1)  # (never 0: "no layout")
        return self.layout[1], self.layout[2]

    def _transfer(self, plan: list[Bucket], tensors: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        """Start every bucket's broadcast: packed ones through the two staging buffers in turn, the others from the
        tensors' own memory; then the current stream waits for all. Returns the buckets' checksums."""
        bufs = self._staging(max((b.nbytes for b in plan if b.packed), default=0))
        works, sums, last, n_packed = [], [], [None, None], 0
        for b in plan:
            if b.packed:
                i, n_packed = n_packed % 2, n_packed + 1
                if last[i] is not None:  # the buffer is free once the broadcast that read it last is done
                    self.group.wait_work(last[i], "bucket broadcast")
                dst = [bufs[i][: b.nbytes]]
                buckets.pack(dst[0], b.entries, [tensors[e.name] for e in b.entries])
            else:
                dst = [tensors[e.name].contiguous() for e in b.entries]
            works.append(self.group.broadcast_many(dst, self.src))
            if b.packed:
                last[i] = works[-1]
            if self.verify:  # (reads the bucket beside the broadcast: both only read it)
                sums.append(checksums.of_bytes(checksums.cat_bytes(dst)))
        for w in works:
            self.group.wait_work(w, "bucket broadcast")
        return torch.stack(sums) if sums else None


# ---------------------------------------------------------------------------- receiver side
class Receiver(_Side):
    """A receiver's side of a run of updates, one ``receive`` per update. ``expected`` (from ``expected_from``;
    None accepts anything) and ``into`` (this receiver's own tensors by name, received in place where dtype,
    shape and device match) are read here, once: make a new Receiver when they change. The rest goes to ``load``
    as ``[(name, view)]``, valid only during the call."""

    def __init__(self, group: StatelessGroup, *, expected: Mapping[str, Meta] | None, load: Callable[[Batch], None],
                 into: Mapping[str, torch.Tensor] | None = None, src: int = 0, timeout_s: float | None = None) -> None:
        if group.rank == src:
            raise WeightSyncError(f"a Receiver runs on the receivers; rank {src} is the source (use a Sender).")
        super().__init__(group, src, timeout_s)
        self.expected = dict(expected) if expected is not None else None
        self.into, self.load = dict(into or {}), load
        self.layout: tuple[int, list[Meta]] | None = None  # (key, metas) of the layout this receiver voted for

    def receive(self) -> SyncStats:
        """Receive one update: vote on its metadata if this receiver has not accepted it yet, then land every
        tensor. Raises ``WeightSyncError`` (every rank does) or ``SyncTimeout`` as ``Sender.send``."""
        t0 = time.perf_counter()
        (version, mode, bucket_bytes, verify, _), agreed = _handshake(
            self.group, None, self.layout[0] if self.layout else 0, self.timeout_s)
        if not agreed:
            self.layout = None
            with guard(self.group, "the handshake"):
                key, metas = self.group.broadcast_object(None, self.src)
            _vote(self.group, _validate(metas, self.expected), version, self.timeout_s)
            self.layout = (key, metas)
        key, metas = self.layout
        t_hand = time.perf_counter() - t0
        if self.plan is None or self.plan[0] != (key, mode, bucket_bytes):
            plan = plan_buckets(metas, bucket_bytes, MODES[mode])
            self.plan = ((key, mode, bucket_bytes), plan, [[self._home(e) for e in b.entries] for b in plan])
        _, plan, land = self.plan
        with torch.no_grad(), guard(self.group, "the transfer"):
            sums, errors = self._transfer(plan, land, bool(verify))
        _finish(self.group, version, errors, sums, plan, self.src, self.timeout_s)
        return self._stats(t0, t_hand, metas, plan, MODES[mode], bucket_bytes, version, bool(verify))

    def _home(self, e: Entry) -> torch.Tensor | None:
        """The tensor of ``into`` that entry ``e`` lands in, if it can (else None: it goes to ``load``)."""
        t = self.into.get(e.name)
        ok = (t is not None and t.is_contiguous() and t.device == self.group.device
              and buckets.dtype_name(t) == e.dtype and tuple(t.shape) == tuple(e.shape))
        return t if ok else None

    def _transfer(self, plan: list[Bucket], land: list[list], verify: bool) -> tuple[torch.Tensor | None, list[str]]:
        """Receive bucket after bucket, each landing while the previous one is loaded (double buffering). Returns
        the checksums and the failed ``load`` calls (receiving goes on, so that the other ranks do not hang)."""
        staged = [b.packed or (len(b.entries) > 1 and None in homes) for b, homes in zip(plan, land)]
        bufs = self._staging(max((b.nbytes for b, s in zip(plan, staged) if s), default=0))
        sums, errors, slots = [], [], {}

        def issue(k: int) -> None:
            b, homes = plan[k], land[k]
            views = buckets.unpack(bufs[k % 2][: b.nbytes], b.entries) if staged[k] else [
                (e.name, h if h is not None else torch.empty(e.shape, dtype=getattr(torch, e.dtype),
                                                             device=self.group.device)) for e, h in zip(b.entries, homes)]
            dst = [bufs[k % 2][: b.nbytes]] if b.packed else [h if h is not None else v for h, (_, v) in zip(homes, views)]
            slots[k] = (self.group.broadcast_many(dst, self.src), dst, views)

        for k, b in enumerate(plan):
            if k == 0:
                issue(0)
            if k + 1 < len(plan):
                issue(k + 1)  # the next bucket arrives in the other buffer while this one is loaded
            work, dst, views = slots.pop(k)
            self.group.wait_work(work, "bucket broadcast")
            if verify:
                sums.append(checksums.of_bytes(checksums.cat_bytes(dst)))
            homes = [(h, v) for h, (_, v) in zip(land[k], views) if h is not None]
            if b.packed and homes:  # packed tensors with a home: copied out of the buffer
                torch._foreach_copy_([h for h, _ in homes], [v for _, v in homes])
            rest = [(n, v) for h, (n, v) in zip(land[k], views) if h is None]
            if rest and not errors:
                try:
                    self.load(rest)
                except Exception as exc:
                    errors.append(f"load() failed on '{rest[0][0]}': {type(exc).__name__}: {exc}")
        return (torch.stack(sums) if sums else None), errors


def send(group: StatelessGroup, named_tensors: NamedTensors, *, src: int = 0, mode: str = "bucketed",
         bucket_bytes: int = 256 << 20, version: int = 0, verify: bool = True,
         timeout_s: float | None = None) -> SyncStats:
    """One update from a one-shot ``Sender``: the metadata goes again, and the buffers go with it."""
    return Sender(group, src=src, mode=mode, bucket_bytes=bucket_bytes, verify=verify,
                  timeout_s=timeout_s).send(named_tensors, version=version)


def receive(group: StatelessGroup, *, src: int = 0, expected: Mapping[str, Meta] | None,
            load: Callable[[Batch], None], device: str | torch.device | None = None,
            into: Mapping[str, torch.Tensor] | None = None, timeout_s: float | None = None) -> SyncStats:
    """One update into a one-shot ``Receiver``, which votes on the metadata every time. ``device``, if given, must
    be the group's (where ``into`` and the staging live)."""
    if device is not None and torch.device(device).type != group.device.type:
        raise ValueError(f"receive(device={str(device)!r}): this group receives on {group.device}")
    return Receiver(group, expected=expected, load=load, into=into, src=src, timeout_s=timeout_s).receive()


# ---------------------------------------------------------------------------- handshake and votes
def _handshake(group: StatelessGroup, fields: list[int] | None, key: int,
               timeout_s: float | None) -> tuple[list[int], bool]:
    """One all-reduce (max) carries the trainer's header ``fields`` and every rank's layout ``key`` (0: none).
    Returns the fields, and whether every rank holds the same layout (its largest key equals its smallest)."""
    vals = torch.tensor((fields or [NONE] * 5) + [key, -key], dtype=torch.int64)
    if group.backend == "nccl":  # from pinned memory: the copy never waits for a stream (it may be stuck)
        vals = vals.pin_memory().to(group.device, non_blocking=True)
    out = _all_reduce_now(group, vals, "max", "the handshake", timeout_s)
    return out[:5], out[5] == -out[6]


def _validate(metas: list[Meta], expected: Mapping[str, Meta] | None) -> list[str]:
    """Problems a receiver finds in an update's metadata (empty list: accept)."""
    out = []
    for name, what, want, got in metadata.problems(metas, expected) if expected is not None else []:
        if what == "twice":
            out.append(f"'{name}': sent twice")
        elif what == "unknown":
            close = difflib.get_close_matches(name, list(expected), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            out.append(f"'{name}': unknown name, expected one of this receiver's {len(expected)} tensors{hint}")
        else:  # "dtype" or "shape"
            out.append(f"'{name}': {what} expected {want}, found {got}")
    return out


def _vote(group: StatelessGroup, my_problems: list[str], version: int, timeout_s: float | None) -> None:
    """The metadata vote: if any rank objects, every rank raises ``WeightSyncError`` with every rank's problems."""
    flag = torch.full((1,), int(bool(my_problems)), dtype=torch.int64, device=group.device)  # (a fill: no stream wait)
    if not _all_reduce_now(group, flag, "max", "the metadata vote", timeout_s)[0]:
        return
    with guard(group, "the metadata vote"):
        everyone = group.all_gather_object(list(my_problems))
    raise WeightSyncError(_reject_message(version, everyone, "rejected before any weight changed",
                                          "Nothing was loaded on any receiver. Fix the names/dtypes/shapes "
                                          "(or the receiver's expected metadata) and send again."))


def _finish(group: StatelessGroup, version: int, problems: list[str], sums: torch.Tensor | None,
            plan: list[Bucket], src: int, timeout_s: float | None) -> None:
    """The closing vote: all-reduce (max) of [failed?, sums, -sums]; the sums agree when max == min."""
    vec = torch.full((1,), int(bool(problems)), dtype=torch.int64, device=group.device)
    if sums is not None:
        vec = torch.cat([vec, sums, -sums])
    vals, n = _all_reduce_now(group, vec, "max", "the verification vote", timeout_s), len(vec) // 2
    if not vals[0] and all((vals[1 + k] + vals[1 + n + k]) % 2**64 == 0 for k in range(n)):
        return
    with guard(group, "the verification vote"):
        everyone = group.all_gather_object((list(problems), sums.tolist() if sums is not None else []))
    per_rank = []
    for probs, theirs in everyone:
        bad = [k for k, (a, b) in enumerate(zip(theirs, everyone[src][1])) if a != b][:5]
        per_rank.append(probs + [f"checksum mismatch in bucket {k} (" + ", ".join(e.name for e in plan[k].entries[:4])
                                 + ("..." if len(plan[k].entries) > 4 else "") + ")" for k in bad])
    raise WeightSyncError(_reject_message(version, per_rank, "failed on a receiver",
                                          "Receivers may hold partly updated weights: send again."))


def _reject_message(version: int, per_rank: list[list[str]], head: str, tail: str) -> str:
    """Every rank's problems, at most five each, under one heading."""
    lines = []
    for r, probs in enumerate(per_rank):
        lines += [f"  rank {r}: {p}" for p in probs[:5]] + ([f"  rank {r}: ... and {len(probs) - 5} more"]
                                                            if len(probs) > 5 else [])
    return f"weight update v{version} {head}:\n" + "\n".join(lines) + f"\n{tail}"


def _all_reduce_now(group: StatelessGroup, t: torch.Tensor, op: str, what: str, timeout_s: float | None) -> list[int]:
    """All-reduce ``t`` and wait for the result, never longer than the deadline."""
    with guard(group, what):
        group.all_reduce(t, op)
        group.synchronize(what, timeout_s)
    return t.tolist()
