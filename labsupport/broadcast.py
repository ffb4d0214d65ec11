"""``core.sync``'s phases, hardened with what production needs, each against a failure (Lab 3):

- metadata vote: ``announce`` only for a layout some rank lacks; receivers check names, dtypes,
  shapes (none missing unless ``partial``), all vote before a byte moves (a renamed, transposed or
  dropped tensor); grouped launches, only small tensors packed (copies competing with NCCL);
- double buffering: a bucket is packed, or loaded, while another is on the wire (an idle wire);
- staging, checksums, votes (``finish`` carrying verdicts): no weight changes until every bucket
  matched its checksum on every rank, a last vote reports a failed ``load`` (a sender dying
  mid-update: weights mixed; corrupted bytes; an unseen failed load; ``staged=False``: no copy);
- deadlines: every wait bounded, a dead peer a ``SyncTimeout`` naming it (one dead rank hanging
  all); kernels load first (``checksums.load_kernels``: loading mid-transfer blocks the host)."""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple

import torch

from labsupport import checksums, metadata
from labsupport.core import buckets, sync
from labsupport.core.buckets import ALIGN, Entry, Meta
from labsupport.core.sync import Batch
from labsupport.groups import GroupError, StatelessGroup

MODES = ("per_tensor", "bucketed", "packed")
SMALL = 1 << 20  # bucketed packs tensors under 1 MiB (norms, biases): a launch costs more than this


class WeightSyncError(Exception):
    """A weight update was rejected or failed; the message says which tensor/rank and what to do."""


class SyncTimeout(WeightSyncError, TimeoutError):
    """A peer died or stopped answering during a sync (the message names it); the group is lost."""


@dataclass
class SyncStats:
    """What one sync moved and how long it took (``seconds``: handshake, transfer, verification)."""
    bytes: int
    seconds: float
    n_collectives: int  # data launches (the handshake's few small collectives are not counted)
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
        bucket = f", bucket {self.bucket_bytes / 2**20:g} MiB" if self.mode == "bucketed" else ""
        return (f"{self.mode}{bucket}: {self.bytes / 1e6:.1f} MB, {self.n_tensors} tensors in "
                f"{self.n_collectives} broadcasts, {self.seconds * 1e3:.2f} ms ({self.gbps:.2f} "
                f"GB/s){', verified' if self.verified else ''}")


def expected_from(named_tensors: checksums.NamedTensors) -> dict[str, Meta]:
    """A receiver's ``expected``: the ``Meta`` of each of its tensors, by name."""
    return {m.name: m for m in buckets.metas(named_tensors)}


@contextlib.contextmanager
def guard(group: StatelessGroup, what: str) -> Iterator[None]:
    """A peer lost during ``what`` (a step of a sync) becomes ``SyncTimeout``; the group aborts."""
    try:
        yield
    except GroupError as exc:
        group.abort()
        raise SyncTimeout(f"weight sync failed during {what}: {exc}") from exc


class Bucket(NamedTuple):
    """One launch: a ``core.sync.plan`` bucket (entries, size), and whether it travels packed."""
    entries: list[Entry]
    nbytes: int
    packed: bool  # copied into a buffer on the trainer and out of one on the receivers


def plan_buckets(metas: list[Meta], bucket_bytes: int, mode: str = "bucketed") -> list[Bucket]:
    """Both sides' plan: ``core.sync.plan``'s buckets of at most ``bucket_bytes``; ``per_tensor``:
    one tensor each, ``bucketed``: small tensors packed apart, ``packed``: all; unpacked first."""
    cut = {"per_tensor": 0, "packed": math.inf}.get(mode, min(SMALL, bucket_bytes // 64))
    small = [m for m in metas if 0 < buckets.nbytes(m) < cut]  # (packed, unless alone in a bucket)
    large = [m for m in metas if buckets.nbytes(m) >= max(cut, 1)]  # (empty: nothing to send)
    plan = [Bucket(*b, len(b[0]) > 1) for b in sync.plan(small, bucket_bytes)]
    plan += [Bucket(*b, False) for b in sync.plan(large, bucket_bytes * (mode != "per_tensor"))]
    return sorted(plan, key=lambda b: b.packed)


class _Side:
    """One side of a run of updates, and what it keeps between them: the last plan, two buffers."""

    def __init__(self, group: StatelessGroup, src: int, timeout_s: float | None) -> None:
        self.group, self.src, self.timeout_s, self.expected = group, src, timeout_s, None
        self.agreed = self.plan = None  # (key, metas) agreed; ((key, mode, size), plan, homes)
        self.buffers: list[torch.Tensor] = []  # two staging buffers, grown to the largest bucket

    def release(self) -> None:
        """Drop the staging buffers (to PyTorch's cache); the next update remakes them."""
        self.buffers, self.pending = [], []

    def _update(self, header: list[int] | None, key: int, metas: list[Meta] | None,
                payload: Any) -> SyncStats:
        """Both sides' protocol (the trainer's has a ``header``): handshake, then three votes."""
        t0, group = time.perf_counter(), self.group
        # One all-reduce (max): the header (receivers: -2**63), each rank's layout key (0: none)
        vals = torch.tensor((header or [-(2**63)] * 4) + [key, -key], dtype=torch.int64)
        if group.backend == "nccl":  # (from pinned host memory: no stream wait)
            vals = vals.pin_memory().to(group.device, non_blocking=True)
        with guard(group, "the handshake"):
            version, mode, bucket_bytes, flags, top, neg = sync.finish(group, self.timeout_s, vals,
                                                                       "the handshake")
        if top != -neg:  # some rank lacks this layout: the trainer announces it, all check and vote
            self.agreed = None
            with guard(group, "the handshake"):
                key, metas = sync.announce(group, (key, metas) if header else None, self.src)
            self._vote("the metadata vote", version, [] if self.expected is None else
                       metadata.describe(metas, self.expected, partial=bool(flags & 2)))
        self.agreed, t_hand = (key, metas), time.perf_counter() - t0
        if self.plan is None or self.plan[0] != (key, mode, bucket_bytes):
            plan = plan_buckets(metas, bucket_bytes, MODES[mode])
            self.plan = ((key, mode, bucket_bytes), plan, None if header else self._landing(plan))
        _, plan, land = self.plan
        checksums.load_kernels(group.device, {m.dtype for m in metas})  # (none mid-transfer)
        with torch.no_grad(), guard(group, "the transfer"):
            sums, errors = self._transfer(plan, land, bool(flags & 1), payload)
        self._vote("the verification vote", version, errors, sums, plan)
        with torch.no_grad():  # (a staged receiver's update goes in only now)
            self._vote("the load vote", version, [] if header else self._commit(land))
        launches = sum(1 if b.packed or group.backend == "nccl" else len(b.entries) for b in plan)
        return SyncStats(sum(map(buckets.nbytes, metas)), time.perf_counter() - t0, launches,
                         MODES[mode], bucket_bytes, len(metas), version, t_hand, bool(flags & 1))

    def _staging(self, sizes: Iterable[int]) -> list[torch.Tensor]:  # (two, of the largest size)
        if (n := max(sizes, default=0)) and (not self.buffers or self.buffers[0].numel() < n):
            self.buffers = list(torch.empty(2, n, dtype=torch.uint8, device=self.group.device))
        return self.buffers

    def _vote(self, what: str, version: int, problems: list[str], sums: torch.Tensor | None = None,
              plan: list[Bucket] = ()) -> None:
        """One all-reduce (max) of [objects?, sums, -sums]: if a rank objects, or the checksums
        differ (max != min), every rank raises ``WeightSyncError`` with each rank's problems."""
        vec = torch.full((1,), int(bool(problems)), dtype=torch.int64, device=self.group.device)
        vec = vec if sums is None else torch.cat([vec, sums, -sums])  # (a fill: no stream wait)
        with guard(self.group, what):  # (``core.sync.finish``: the maximum over the ranks, in time)
            vals, n = sync.finish(self.group, self.timeout_s, vec, what), len(vec) // 2
        if not vals[0] and all((a + b) % 2**64 == 0 for a, b in zip(vals[1:n + 1], vals[n + 1:])):
            return
        with guard(self.group, what):
            votes = self.group.all_gather_object((problems, [] if sums is None else sums.tolist()))
        lines = []
        for r, (probs, theirs) in enumerate(votes):
            bad = [k for k, (a, b) in enumerate(zip(theirs, votes[self.src][1])) if a != b][:5]
            names = [[e.name for e in plan[k].entries] for k in bad]  # (a bucket's first 4 named)
            probs += [f"checksum mismatch in bucket {k} ({', '.join(ns[:4])}"
                      f"{'...' if len(ns) > 4 else ''})" for k, ns in zip(bad, names)]
            lines += [f"  rank {r}: {p}" for p in probs[:5]]
            lines += [f"  rank {r}: ... and {len(probs) - 5} more"] if len(probs) > 5 else []
        head, tail = _VERDICTS[what]
        raise WeightSyncError(f"weight update v{version} {head}:\n" + "\n".join(lines + [tail]))


_VERDICTS = {  # what a failed vote says: its heading, and what the caller should do
    "the metadata vote": ("rejected before any weight changed", "Nothing was loaded on any "
                          "receiver. Fix the names/dtypes/shapes (or expected; partial=True for a "
                          "subset on purpose), send again."),
    "the verification vote": ("failed on a receiver", "Staged receivers changed nothing: resend."),
    "the load vote": ("failed to load on a receiver", "The others hold it, that one what its load "
                      "left: send again."),
}


class Sender(_Side):
    """The trainer's side (rank ``src``) of a run of updates, one ``send`` per optimizer step."""

    def __init__(self, group: StatelessGroup, *, src: int = 0, mode: str = "bucketed",
                 bucket_bytes: int = 256 << 20, verify: bool = True,
                 timeout_s: float | None = None) -> None:
        if mode not in MODES or bucket_bytes < ALIGN:
            raise ValueError(f"mode must be in {list(MODES)} and bucket_bytes >= {ALIGN}; got "
                             f"{mode!r}, {bucket_bytes}")
        if group.rank != src:
            raise WeightSyncError(f"rank {group.rank} is not the source ({src}): use a Receiver.")
        super().__init__(group, src, timeout_s)
        self.mode, self.bucket_bytes, self.verify = mode, bucket_bytes, verify
        self.layout: tuple[list, list[Meta], int] | None = None  # (signature, metas, key) sent last

    def send(self, named_tensors: checksums.NamedTensors, *, version: int = 0,
             partial: bool = False) -> SyncStats:
        """Broadcast named tensors to every rank, until all loaded them. ``WeightSyncError``:
        metadata rejected (nothing loaded), a checksum mismatch, a failed ``load``; SyncTimeout."""
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        sig = [(n, t.dtype, t.shape, t.device) for n, t in items] + [partial]  # (in the key, voted)
        if self.layout is None or self.layout[0] != sig:  # (the metadata and key, on a change)
            dev = self.group.device  # (checked here: in the transfer, receivers would wait in vain)
            if bad := next(((name, t.device) for name, t in items if t.device != dev), None):
                raise WeightSyncError(f"tensor '{bad[0]}' is on {bad[1]}, but this group sends "
                                      f"from {dev}; move the model to {dev} first.")
            metas = buckets.metas(items)
            digest = hashlib.sha256(repr((metas, partial)).encode()).digest()
            self.layout = (sig, metas, int.from_bytes(digest[:8], "little") >> 2 | 1)  # (never 0)
        header = [version, MODES.index(self.mode), self.bucket_bytes, self.verify | 2 * partial]
        return self._update(header, self.layout[2], self.layout[1], dict(items))

    def _transfer(self, plan: list[Bucket], _: Any, verify: bool,
                  tensors: Mapping[str, torch.Tensor]) -> tuple:
        """Every bucket's broadcast (packed: through two buffers in turn), waited for; checksums."""
        bufs = self._staging(b.nbytes for b in plan if b.packed)
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


class Receiver(_Side):
    """A receiver's side of a run of updates. ``expected`` (``expected_from``; None: anything) and
    ``into`` (tensors by name, written where dtype, shape, device match) are read once. ``load``
    gets the rest as ``[(name, view)]``, valid in the call: once, verified (unstaged: a bucket)."""

    def __init__(self, group: StatelessGroup, *, expected: Mapping[str, Meta] | None,
                 load: Callable[[Batch], None], into: Mapping[str, torch.Tensor] | None = None,
                 src: int = 0, timeout_s: float | None = None, staged: bool = True) -> None:
        if group.rank == src:
            raise WeightSyncError(f"rank {src} is the source: use a Sender, not a Receiver.")
        super().__init__(group, src, timeout_s)
        self.expected = dict(expected) if expected is not None else None
        self.into, self.load, self.staged, self.pending = dict(into or {}), load, staged, []

    def receive(self) -> SyncStats:
        """Receive one update (voting on its metadata if new); raises as ``Sender.send`` does."""
        return self._update(None, *(self.agreed or (0, None)), None)

    def _landing(self, plan: list[Bucket]) -> list[list[torch.Tensor | None]]:
        """Per bucket, the tensor of ``into`` each entry lands in if it can (None: to ``load``)."""
        fits = {n: t for n, t in self.into.items()
                if t.is_contiguous() and t.device == self.group.device}
        return [[t if (t := fits.get(e.name)) is not None and buckets.meta(e.name, t) == e[:3]
                 else None for e in b.entries] for b in plan]

    def _transfer(self, plan: list[Bucket], land: list, verify: bool,
                  _: Any) -> tuple[torch.Tensor | None, list[str]]:
        """Buckets: staged, each into memory of its own (for ``_commit``); else into its homes or
        two buffers, loaded while the next arrives. Checksums, failed ``load``s (nobody hangs)."""
        land = [[None] * len(b.entries) for b in plan] if self.staged else land  # (see _commit)
        mine = [b.packed or None in homes for b, homes in zip(plan, land)]  # (needs a buffer)
        two = [] if self.staged else self._staging(b.nbytes for b, m in zip(plan, mine) if m)
        dev, sums, errors, self.pending = self.group.device, [], [], []

        def issue(k: int) -> tuple:  # bucket k lands in its homes, else in a buffer
            b, homes = plan[k], land[k]
            buf = (two[k % 2][: b.nbytes] if two else torch.empty(b.nbytes, dtype=torch.uint8,
                                                                  device=dev)) if mine[k] else None
            got = buckets.unpack(buf, b.entries) if mine[k] else [(e.name, None) for e in b.entries]
            views = [(n, v if h is None or b.packed else h) for h, (n, v) in zip(homes, got)]
            dst = [buf] if b.packed else [v for _, v in views]
            return self.group.broadcast_many(dst, self.src), dst, views

        nxt = issue(0) if plan else None
        for k, b in enumerate(plan):  # the next bucket arrives in the other buffer while k loads
            (work, dst, views), nxt = nxt, issue(k + 1) if k + 1 < len(plan) else None
            self.group.wait_work(work, "bucket broadcast")
            if verify:
                sums.append(checksums.of_bytes(checksums.cat_bytes(dst)))
            self.pending += [views] if self.staged else []
            if b.packed:  # packed tensors with a home (in ``into``): copied out of the buffer
                buckets.load_into(self.into, [nv for h, nv in zip(land[k], views) if h is not None])
            if not (errors or self.staged):
                errors += self._load([nv for h, nv in zip(land[k], views) if h is None])
        return (torch.stack(sums) if sums else None), errors

    def _commit(self, land: list) -> list[str]:
        """Staged: the verified update into ``into`` and, in one call, ``load``; what failed."""
        pairs = [(h, nv) for hs, vs in zip(land, self.pending) for h, nv in zip(hs, vs)]
        self.pending = []  # (h: the tensor of ``into`` of that name, or None)
        buckets.load_into(self.into, [nv for h, nv in pairs if h is not None])
        return self._load([nv for h, nv in pairs if h is None])

    def _load(self, batch: Batch) -> list[str]:
        try:
            if batch:
                self.load(batch)
        except Exception as exc:  # (the vote reports it)
            return [f"load() failed on '{batch[0][0]}': {type(exc).__name__}: {exc}"]
        return []


def send(group: StatelessGroup, named_tensors: checksums.NamedTensors, *, src: int = 0,
         mode: str = "bucketed", bucket_bytes: int = 256 << 20, version: int = 0,
         verify: bool = True, timeout_s: float | None = None, partial: bool = False) -> SyncStats:
    """One update from a one-shot ``Sender``: the metadata goes again, and buffers go with it."""
    return Sender(group, src=src, mode=mode, bucket_bytes=bucket_bytes, verify=verify,
                  timeout_s=timeout_s).send(named_tensors, version=version, partial=partial)


def receive(group: StatelessGroup, *, src: int = 0, expected: Mapping[str, Meta] | None,
            load: Callable[[Batch], None], into: Mapping[str, torch.Tensor] | None = None,
            device: str | torch.device | None = None, timeout_s: float | None = None) -> SyncStats:
    """One update into a one-shot staged ``Receiver`` (a metadata vote each time) on ``device``."""
    if device is not None and torch.device(device).type != group.device.type:
        raise ValueError(f"receive(device={str(device)!r}): this group receives on {group.device}")
    return Receiver(group, expected=expected, load=load, into=into, src=src,
                    timeout_s=timeout_s).receive()
