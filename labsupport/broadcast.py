"""Weight sync, hardened: ``labsupport.core.sync``'s phases (``announce``, ``plan``, ``send_bucket`` /
``receive_bucket``, ``finish``) plus what production needs, each against a failure the core lets through (Lab 3):

- handshake and metadata vote: ``announce`` only when some rank lacks the metadata (a round trip every step);
  every receiver checks names, dtypes and shapes, none missing unless ``partial``, and all ranks vote before a
  byte moves (a renamed, transposed or dropped tensor, or one on one receiver only);
- grouped launches: ``plan``'s buckets leave as one launch from the trainer's own tensors, only small ones
  packed (copies competing with NCCL for memory bandwidth);
- double buffering: the next bucket is packed, or the last one loaded, while one is on the wire (an idle wire);
- staging, checksums and votes (``finish`` carrying each rank's verdict): a receiver changes no weight until every
  bucket is in and its checksum matched on every rank, and a last vote reports a failed ``load`` (a sender dying
  mid-update leaving old and new weights mixed; corrupted bytes; a failed load nobody notices). ``staged=False``
  saves the copy: buckets land in ``into`` or two reused buffers, loaded as they come (a dead sender: that mix);
- deadlines: every wait is bounded, a dead peer a ``SyncTimeout`` naming it (one dead rank hanging all), and
  kernels are loaded before a transfer (``checksums.load_kernels``: one loaded behind it could block the host).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from labsupport import checksums, metadata
from labsupport.core import buckets, sync
from labsupport.core.buckets import ALIGN, Entry, Meta
from labsupport.core.sync import Batch
from labsupport.groups import GroupError, StatelessGroup

MODES = ("per_tensor", "bucketed", "packed")
SMALL = 1 << 20  # bucketed mode packs tensors under 1 MiB (norms, biases): a launch costs more than their copy
NONE = -(2**63)  # a receiver's share of the trainer's header fields (the handshake's all-reduce takes the max)

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


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
    def gbps(self) -> float:  # payload bandwidth in GB/s (1e9 bytes per second)
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def as_dict(self) -> dict[str, Any]:  # (with the bandwidth: for JSON)
        return {**asdict(self), "gb_per_s": self.gbps}

    def __str__(self) -> str:
        return (f"{self.mode}{f', bucket {self.bucket_bytes / 2**20:g} MiB' if self.mode == 'bucketed' else ''}: "
                f"{self.bytes / 1e6:.1f} MB, {self.n_tensors} tensors in {self.n_collectives} broadcasts, "
                f"{self.seconds * 1e3:.2f} ms ({self.gbps:.2f} GB/s){', verified' if self.verified else ''}")


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


# ---------------------------------------------------------------------------- the plan: core.sync.plan's buckets
@dataclass
class Bucket:
    """One launch: a bucket of ``core.sync.plan`` (its entries, size), and whether it travels packed in one buffer."""
    entries: list[Entry]
    nbytes: int  # the layout's size
    packed: bool  # copied into a buffer on the trainer and out of one on the receivers


def plan_buckets(metas: list[Meta], bucket_bytes: int, mode: str = "bucketed") -> list[Bucket]:
    """Both sides' plan: ``core.sync.plan``'s buckets of at most ``bucket_bytes``, ``per_tensor`` one tensor each,
    ``bucketed`` small tensors packed apart from the rest, ``packed`` all; unpacked ones first (the wire starts)."""
    live = [m for m in metas if buckets.nbytes(m)]  # (an empty tensor has nothing to send)
    cut = {"per_tensor": 0, "packed": math.inf}.get(mode, min(SMALL, bucket_bytes // 64))  # (relative to the bucket)
    small, large = [m for m in live if buckets.nbytes(m) < cut], [m for m in live if buckets.nbytes(m) >= cut]
    plan = [Bucket(*b, len(b[0]) > 1) for b in sync.plan(small, bucket_bytes)]  # (alone: from its own memory)
    plan += [Bucket(*b, False) for b in sync.plan(large, 0 if mode == "per_tensor" else bucket_bytes)]
    return sorted(plan, key=lambda b: b.packed)


class _Side:
    """One side of a run of updates, and what it keeps from one to the next: the last plan, two staging buffers."""

    def __init__(self, group: StatelessGroup, src: int, timeout_s: float | None) -> None:
        self.group, self.src, self.timeout_s, self.expected = group, src, timeout_s, None
        self.agreed: tuple[int, list[Meta]] | None = None  # (key, metas) of the layout every rank accepted last
        self.plan: tuple[tuple, list[Bucket], Any] | None = None  # ((key, mode, bucket size), plan, landing)
        self.buffers: list[torch.Tensor] = []  # two staging buffers, grown to the largest bucket that needs one

    def release(self) -> None:
        """Drop the staging buffers (back to PyTorch's cache); the next update that needs them makes them again."""
        self.buffers, self.pending = [], []

    def _update(self, header: list[int] | None, key: int, metas: list[Meta] | None, payload: Any) -> SyncStats:
        """The protocol, the same on both sides (the trainer's has a ``header``; receivers check and load): handshake
        (and, for a layout some rank lacks, the metadata and its vote), transfer, verification vote, load vote."""
        t0 = time.perf_counter()
        # One all-reduce (max): the header, each rank's layout key (0: none); NCCL: from pinned memory, no stream wait
        vals = torch.tensor((header or [NONE] * 4) + [key, -key], dtype=torch.int64)
        if self.group.backend == "nccl":
            vals = vals.pin_memory().to(self.group.device, non_blocking=True)
        version, mode, bucket_bytes, flags, top, neg = _agree(self.group, vals, "the handshake", self.timeout_s)
        if top != -neg:  # some rank lacks this layout: the trainer announces it, every receiver checks it, all vote
            self.agreed = None
            with guard(self.group, "the handshake"):
                key, metas = sync.announce(self.group, (key, metas) if header else None, self.src)
            _vote(self.group, "the metadata vote", version, self._problems(metas, flags & 2), self.timeout_s)
        self.agreed, t_hand = (key, metas), time.perf_counter() - t0
        if self.plan is None or self.plan[0] != (key, mode, bucket_bytes):
            plan = plan_buckets(metas, bucket_bytes, MODES[mode])
            self.plan = ((key, mode, bucket_bytes), plan, None if header else self._landing(plan))
        _, plan, land = self.plan
        checksums.load_kernels(self.group.device, {m.dtype for m in metas})  # (launched while broadcasts may spin)
        with torch.no_grad(), guard(self.group, "the transfer"):
            sums, errors = self._transfer(plan, land, bool(flags & 1), payload)
        _vote(self.group, "the verification vote", version, errors, self.timeout_s, sums, plan, self.src)
        with torch.no_grad():  # (a staged receiver's update goes in only now)
            _vote(self.group, "the load vote", version, [] if header else self._commit(land), self.timeout_s)
        launches = sum(1 if b.packed or self.group.backend == "nccl" else len(b.entries) for b in plan)
        return SyncStats(sum(buckets.nbytes(m) for m in metas), time.perf_counter() - t0, launches, MODES[mode],
                         bucket_bytes, len(metas), version, t_hand, bool(flags & 1))

    def _problems(self, metas: list[Meta], partial: int) -> list[str]:  # (the sender's expected is None)
        return metadata.describe(metas, self.expected, partial=bool(partial)) if self.expected is not None else []

    def _staging(self, nbytes: int) -> list[torch.Tensor]:
        if nbytes and (not self.buffers or self.buffers[0].numel() < nbytes):
            self.buffers = [torch.empty(nbytes, dtype=torch.uint8, device=self.group.device) for _ in range(2)]
        return self.buffers


# ---------------------------------------------------------------------------- trainer side
class Sender(_Side):
    """The trainer's side (rank ``src``) of a run of updates, one ``send`` per optimizer step."""

    def __init__(self, group: StatelessGroup, *, src: int = 0, mode: str = "bucketed", bucket_bytes: int = 256 << 20,
                 verify: bool = True, timeout_s: float | None = None) -> None:
        if mode not in MODES or bucket_bytes < ALIGN:
            raise ValueError(f"mode must be in {list(MODES)} and bucket_bytes >= {ALIGN}; got {mode!r}, {bucket_bytes}")
        if group.rank != src:
            raise WeightSyncError(f"a Sender runs on the source rank {src}; this is rank {group.rank} (use a Receiver)")
        super().__init__(group, src, timeout_s)
        self.mode, self.bucket_bytes, self.verify = mode, bucket_bytes, verify
        self.layout: tuple[list, list[Meta], int] | None = None  # (signature, metas, key) of the tensors sent last

    def send(self, named_tensors: NamedTensors, *, version: int = 0, partial: bool = False) -> SyncStats:
        """Broadcast named tensors to every other rank; returns once every receiver has loaded them. Raises
        ``WeightSyncError`` on rejected metadata (nothing loaded anywhere; a tensor a receiver expects is missing
        unless ``partial``), a checksum mismatch or a failed ``load``; ``SyncTimeout`` if a peer stops answering."""
        items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
        sig = [(n, t.dtype, t.shape, t.device) for n, t in items] + [partial]  # (partial: in the key, voted again)
        if self.layout is None or self.layout[0] != sig:  # (the metadata and its key, made again on a change)
            dev, name = self.group.device, next((n for n, t in items if t.device != self.group.device), None)
            if name is not None:  # (refused here: in the transfer, the receivers would wait for it in vain)
                raise WeightSyncError(f"tensor '{name}' is on {dict(items)[name].device}, but this group sends from "
                                      f"{dev}; move the model to {dev} first.")
            metas = buckets.metas(items)
            digest = hashlib.sha256(repr((metas, partial)).encode()).digest()
            self.layout = (sig, metas, int.from_bytes(digest[:8], "little") >> 2 | 1)  # (never 0: "no layout")
        header = [version, MODES.index(self.mode), self.bucket_bytes, int(self.verify) | 2 * partial]  # flags
        return self._update(header, self.layout[2], self.layout[1], dict(items))

    def _transfer(self, plan: list[Bucket], _: Any, verify: bool, tensors: Mapping[str, torch.Tensor]) -> tuple:
        """Start every bucket's broadcast: packed ones through the two staging buffers in turn, the others from the
        tensors' own memory; then the current stream waits for all. Returns the buckets' checksums."""
        bufs = self._staging(max((b.nbytes for b in plan if b.packed), default=0))
        works, sums = [], []
        for k, b in enumerate(plan):
            if b.packed:
                if k >= 2:  # buffer k % 2 is free once bucket k - 2's broadcast is done
                    self.group.wait_work(works[k - 2], "bucket broadcast")
                dst = [bufs[k % 2][: b.nbytes]]
                buckets.pack(dst[0], b.entries, [tensors[e.name] for e in b.entries])
            else:
                dst = [tensors[e.name].contiguous() for e in b.entries]
            works.append(self.group.broadcast_many(dst, self.src))
            if verify:  # (reads the bucket beside the broadcast: both only read it)
                sums.append(checksums.of_bytes(checksums.cat_bytes(dst)))
        for w in works:
            self.group.wait_work(w, "bucket broadcast")
        return (torch.stack(sums) if sums else None), []


# ---------------------------------------------------------------------------- receiver side
class Receiver(_Side):
    """A receiver's side of a run of updates, one ``receive`` per update. ``expected`` (from ``expected_from``;
    None accepts anything) and ``into`` (its own tensors by name, written where dtype, shape and device match) are
    read here, once: make a new Receiver when they change. The rest goes to ``load`` as ``[(name, view)]``, valid
    during the call: once per update after it verified (``staged=False``: per bucket as it arrives)."""

    def __init__(self, group: StatelessGroup, *, expected: Mapping[str, Meta] | None, load: Callable[[Batch], None],
                 into: Mapping[str, torch.Tensor] | None = None, src: int = 0, timeout_s: float | None = None,
                 staged: bool = True) -> None:
        if group.rank == src:
            raise WeightSyncError(f"a Receiver runs on the receivers; rank {src} is the source (use a Sender).")
        super().__init__(group, src, timeout_s)
        self.expected = dict(expected) if expected is not None else None
        self.into, self.load, self.staged, self.pending = dict(into or {}), load, staged, []

    def receive(self) -> SyncStats:
        """Receive one update (voting on its metadata if not accepted yet); raises as ``Sender.send``, on every rank."""
        return self._update(None, *(self.agreed or (0, None)), None)

    def _landing(self, plan: list[Bucket]) -> list[list[torch.Tensor | None]]:
        """Per bucket, the tensor of ``into`` each entry lands in where it can (None: it goes to ``load``)."""
        fits = {n: t for n, t in self.into.items() if t.is_contiguous() and t.device == self.group.device}
        return [[fits[e.name] if e.name in fits and buckets.meta(e.name, fits[e.name]) == e[:3] else None
                 for e in b.entries] for b in plan]

    def _transfer(self, plan: list[Bucket], land: list, verify: bool, _: Any) -> tuple[torch.Tensor | None, list[str]]:
        """Receive bucket after bucket: staged, each into memory of its own, all kept for ``_commit``; else into its
        homes or one of two buffers, loaded while the next one arrives (double buffering). Returns the checksums and
        the failed ``load`` calls (receiving goes on, so that the other ranks do not hang)."""
        land = [[None] * len(b.entries) for b in plan] if self.staged else land  # (staged: homes written in _commit)
        mine = [b.packed or None in homes for b, homes in zip(plan, land)]  # (a lone tensor too: the same buffers)
        two = [] if self.staged else self._staging(max((b.nbytes for b, s in zip(plan, mine) if s), default=0))
        bufs = [(two[k % 2][: b.nbytes] if two else torch.empty(b.nbytes, dtype=torch.uint8, device=self.group.device))
                if mine[k] else None for k, b in enumerate(plan)]
        sums, errors, slots, self.pending = [], [], {}, []

        def issue(k: int) -> None:  # bucket k lands in its homes, else in its buffer
            b, homes, buf = plan[k], land[k], bufs[k]
            views = buckets.unpack(buf, b.entries) if mine[k] else [(e.name, h) for e, h in zip(b.entries, homes)]
            dst = [buf] if b.packed else [h if h is not None else v for h, (_, v) in zip(homes, views)]
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
            self.pending += [views] if self.staged else []
            if b.packed:  # packed tensors with a home (in ``into``): copied out of the buffer
                buckets.load_into(self.into, [nv for h, nv in zip(land[k], views) if h is not None])
            if not (errors or self.staged):
                errors += self._load([(n, v) for h, (n, v) in zip(land[k], views) if h is None])
        return (torch.stack(sums) if sums else None), errors

    def _commit(self, land: list) -> list[str]:
        """Staged: the verified update into ``into`` and, in one call, ``load``; what failed."""
        homes = [h for hs in land for h in hs]  # (a home is into's tensor of that name)
        views, self.pending = [nv for vs in self.pending for nv in vs], []
        buckets.load_into(self.into, [nv for h, nv in zip(homes, views) if h is not None])
        return self._load([nv for h, nv in zip(homes, views) if h is None])

    def _load(self, batch: Batch) -> list[str]:
        try:
            if batch:
                self.load(batch)
        except Exception as exc:  # (the vote reports it)
            return [f"load() failed on '{batch[0][0]}': {type(exc).__name__}: {exc}"]
        return []


def send(group: StatelessGroup, named_tensors: NamedTensors, *, src: int = 0, mode: str = "bucketed",
         bucket_bytes: int = 256 << 20, version: int = 0, verify: bool = True, timeout_s: float | None = None,
         partial: bool = False) -> SyncStats:
    """One update from a one-shot ``Sender``: the metadata goes again, and the buffers go with it."""
    return Sender(group, src=src, mode=mode, bucket_bytes=bucket_bytes, verify=verify,
                  timeout_s=timeout_s).send(named_tensors, version=version, partial=partial)


def receive(group: StatelessGroup, *, src: int = 0, expected: Mapping[str, Meta] | None,
            load: Callable[[Batch], None], device: str | torch.device | None = None,
            into: Mapping[str, torch.Tensor] | None = None, timeout_s: float | None = None) -> SyncStats:
    """One update into a one-shot staged ``Receiver`` (it votes on the metadata every time); ``device``: the group's."""
    if device is not None and torch.device(device).type != group.device.type:
        raise ValueError(f"receive(device={str(device)!r}): this group receives on {group.device}")
    return Receiver(group, expected=expected, load=load, into=into, src=src, timeout_s=timeout_s).receive()


# ---------------------------------------------------------------------------- handshake and votes
_VERDICTS = {  # what a failed vote says: its heading, and what the caller should do
    "the metadata vote": ("rejected before any weight changed", "Nothing was loaded on any receiver. Fix the "
                          "names/dtypes/shapes (or expected; partial=True for a subset on purpose), send again."),
    "the verification vote": ("failed on a receiver", "Staged receivers changed nothing: send again."),
    "the load vote": ("failed to load on a receiver", "The others hold it, that one what its load left: send again."),
}


def _vote(group: StatelessGroup, what: str, version: int, problems: list[str], timeout_s: float | None,
          sums: torch.Tensor | None = None, plan: list[Bucket] = (), src: int = 0) -> None:
    """One all-reduce (max) of [objects?, sums, -sums]: if any rank objects, or the checksums differ (max != min),
    every rank raises ``WeightSyncError`` listing every rank's problems, at most five each."""
    vec = torch.full((1,), int(bool(problems)), dtype=torch.int64, device=group.device)  # (a fill: no stream wait)
    vec = vec if sums is None else torch.cat([vec, sums, -sums])
    vals, n = _agree(group, vec, what, timeout_s), len(vec) // 2
    if not vals[0] and all((vals[1 + k] + vals[1 + n + k]) % 2**64 == 0 for k in range(n)):
        return
    with guard(group, what):
        everyone = group.all_gather_object((list(problems), sums.tolist() if sums is not None else []))
    lines = []
    for r, (probs, theirs) in enumerate(everyone):
        probs += [f"checksum mismatch in bucket {k} (" + ", ".join(e.name for e in plan[k].entries[:4])
                  + ("..." if len(plan[k].entries) > 4 else "") + ")"
                  for k in [k for k, (a, b) in enumerate(zip(theirs, everyone[src][1])) if a != b][:5]]
        more = [f"... and {len(probs) - 5} more"] if len(probs) > 5 else []
        lines += [f"  rank {r}: {p}" for p in probs[:5] + more]
    head, tail = _VERDICTS[what]
    raise WeightSyncError(f"weight update v{version} {head}:\n" + "\n".join(lines) + f"\n{tail}")


def _agree(group: StatelessGroup, votes: torch.Tensor, what: str, timeout_s: float | None) -> list[int]:
    """``core.sync.finish`` carrying ``votes``: their maximum over the ranks, within the deadline."""
    with guard(group, what):
        return sync.finish(group, timeout_s, votes, what)
