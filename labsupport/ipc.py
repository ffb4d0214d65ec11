"""Zero-copy weight handoff between processes on one machine: CUDA IPC, or shared memory on CPU.

The owner (a trainer) *exports* a tensor, or a bucket of named tensors packed into one flat buffer, as a
small picklable handle; another process (an inference engine) *rebuilds* it into a tensor over the same
memory: nothing is copied. The backend follows the tensor. A CUDA tensor goes through CUDA IPC, whose
handles name the physical GPU by UUID, so a receiver that sees it under another index (another
``CUDA_VISIBLE_DEVICES``, as Ray sets for fractional-GPU actors) still maps the right device. A CPU tensor
goes through a POSIX shared-memory file in ``/dev/shm``: the stand-in that runs the labs without a GPU.

Lifetimes (Lab 5 runs them): an :class:`Exporter` keeps each buffer alive until ``release()``, which refuses
until each declared receiver *process* has acked: the receiver calls :func:`ack` (or ``Receiver.drop()``) after
its last read, and that leaves a file beside the guard that the exporter counts (:mod:`labsupport.shm`).
After release, rebuilding the handle raises :class:`IpcError` instead of mapping memory that may hold something
else. Every rebuild checks a tiny "guard" file per exporter (a serial per export, and a lock that the kernel
drops if the exporter dies). Limits: the check is not atomic with the mapping; views rebuilt *before* a
release are not invalidated, so a receiver drops its views before it acks (a forced release skips the acks);
a child forked by the exporter inherits its lock, hiding the exporter's death; all processes must share one
host and one ``/dev/shm``.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import secrets
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from labsupport import metadata, shm
from labsupport.course import versions
from labsupport.core import buckets
from labsupport.core.buckets import dtype_name, groups, round_up  # one bucket layout for NCCL and IPC
from labsupport.course.hardware import gpu_uuid as device_uuid  # the physical GPU, whatever CUDA_VISIBLE_DEVICES says


class IpcError(RuntimeError):
    """A handle cannot be used here: released, exporter gone, wrong machine/GPU, or bad input."""


# ---- Handles: what travels between processes (a few hundred bytes, picklable) ---------------------

@dataclass(frozen=True)
class Guard:
    """Where the liveness of one export is recorded: slot ``slot`` of ``path`` holds ``serial`` while live."""

    path: str
    slot: int
    serial: int


@dataclass(frozen=True)
class IpcHandle:
    """A picklable reference to one exported tensor (CUDA IPC or shared memory)."""

    kind: str  # "cuda" or "shm"
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    host: str
    device_uuid: str | None  # physical GPU (None for shm)
    payload: tuple  # cuda: torch's reduce_tensor args; shm: (path, storage_nbytes, offset, stride)
    guard: Guard
    pid: int  # exporting process


@dataclass(frozen=True)
class BucketEntry:
    """One tensor inside a bucket: ``nbytes`` bytes at byte ``offset``, viewed as ``dtype``/``shape``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BucketHandle:
    """One handle for many named tensors packed into one flat uint8 buffer."""

    buffer: IpcHandle
    entries: tuple[BucketEntry, ...]

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    @property
    def metas(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """``{name: (dtype, shape)}``: what a receiver checks its own weights against."""
        return {e.name: (e.dtype, e.shape) for e in self.entries}

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def guard(self) -> Guard:
        return self.buffer.guard


def split_buckets(named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Group tensors, in order, into buckets of at most ``bucket_bytes`` (a bigger tensor gets its own)."""
    named = list(named)
    return [[named[i] for i in g] for g in groups([round_up(t.numel() * t.element_size()) for _, t in named],
                                                   bucket_bytes)]


@torch.no_grad()  # parameters (requires_grad=True) are packed as plain bytes
def _pack(flat: torch.Tensor, entries: Sequence[BucketEntry], tensors: Sequence[torch.Tensor]) -> None:
    for (_, view), t in zip(bucket_views(flat, entries), tensors):
        if view.numel():
            view.copy_(t)


def bucket_views(flat: torch.Tensor, entries: Sequence[BucketEntry]) -> list[tuple[str, torch.Tensor]]:
    """Slice a flat uint8 buffer back into named tensors: one as_strided per entry (a few µs each)."""
    typed: dict[str, tuple[torch.Tensor, int, int]] = {}
    out = []
    for e in entries:
        if e.dtype not in typed:  # the whole buffer as this dtype (its size is a multiple of ALIGN)
            t = flat.view(getattr(torch, e.dtype))
            typed[e.dtype] = (t, t.storage_offset(), t.itemsize)
        t, base, size = typed[e.dtype]
        stride = [math.prod(e.shape[i + 1:]) for i in range(len(e.shape))]  # contiguous, row-major
        out.append((e.name, t.as_strided(e.shape, stride, base + e.offset // size)))
    return out


# ---- Exporter: the owner's side -------------------------------------------------------------------

@dataclass
class _Export:
    handle: IpcHandle
    keep: torch.Tensor  # keeps the memory alive (a bucket: its whole aligned buffer)
    receivers: int
    shm_path: str | None  # shm segment behind this export (CPU backend)


_EXPORTERS: "weakref.WeakValueDictionary[str, Exporter]" = weakref.WeakValueDictionary()  # guard path -> owner


class Exporter:
    """Owns exported buffers: keeps each alive until ``release()``, which waits for its receivers' acks."""

    def __init__(self) -> None:
        shm.sweep_stale()  # files of exporters that crashed earlier
        self.prefix = f"{shm.PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        self._guard = shm.GuardFile(os.path.join(shm.SHM_DIR, f"{self.prefix}.guard"))
        self._ids = itertools.count(1)  # serials of exports and numbers of segment files
        self._live: dict[int, _Export] = {}
        self._segments: dict[int, str] = {}  # CPU storage data_ptr -> its /dev/shm file
        self._finalizer = weakref.finalize(self, Exporter._cleanup, self._guard, self._segments)
        _EXPORTERS[self._guard.path] = self

    def export_tensor(self, t: torch.Tensor, receivers: int = 1) -> IpcHandle:
        """Share ``t`` itself; ``receivers``: the processes that must ack before ``release()``. On CPU ``t`` first
        moves into shared memory, once, like ``Tensor.share_memory_()``: other views of its old storage keep the
        old memory, so export a model's parameters, not slices of them."""
        if receivers < 1:
            raise IpcError(f"receivers must be >= 1, found {receivers}")
        if not self._guard.free:
            raise IpcError(f"{shm.GUARD_SLOTS} exports are live in this Exporter; release some first")
        serial = next(self._ids)
        handle = self._handle(t, Guard(self._guard.path, self._guard.take(serial), serial))
        self._live[serial] = _Export(handle, t.detach(), receivers, None if t.is_cuda else handle.payload[0])
        return handle

    def export_bucket(self, named: Iterable[tuple[str, torch.Tensor]], receivers: int = 1) -> BucketHandle:
        """Pack ``named`` tensors into one new flat buffer on their device and export it as one handle."""
        named = list(named)
        devices = {t.device for _, t in named}
        if len(devices) != 1:
            raise IpcError("export_bucket needs at least one (name, tensor) pair, all on one device; "
                           f"found tensors on {sorted(map(str, devices))}")
        (device,) = devices
        names = [name for name, _ in named]
        if len(set(names)) < len(names):
            twice = next(name for i, name in enumerate(names) if name in names[:i])
            raise IpcError(f"tensor name {twice!r} appears twice in one bucket; names must be unique")
        # the layout (each tensor at an ALIGN-aligned byte offset) is the core's: one copy for NCCL and IPC
        layout, total = buckets.layout([buckets.meta(name, t) for name, t in named])
        entries = [BucketEntry(*e) for e in layout]
        flat = (torch.empty(total, dtype=torch.uint8, device=device) if device.type == "cuda"
                else self._new_segment(total))
        _pack(flat, entries, [t for _, t in named])
        return BucketHandle(self.export_tensor(flat, receivers), tuple(entries))

    def export_buckets(self, named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = 512 << 20,
                       receivers: int = 1) -> list[BucketHandle]:
        """Export a whole state dict as buckets of at most ``bucket_bytes`` each."""
        return [self.export_bucket(g, receivers) for g in split_buckets(list(named), bucket_bytes)]

    def update_bucket(self, handle: BucketHandle, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Repack new values (same names, dtypes, shapes; checked first) into a live bucket, in place."""
        exp = self._get(handle)
        named = list(named)
        if [n for n, _ in named] != handle.names:
            raise IpcError(f"update_bucket: expected tensors {handle.names[:4]}... in bucket order, "
                           f"found {[n for n, _ in named][:4]}...")
        bad = metadata.problems([(n, dtype_name(t), tuple(t.shape)) for n, t in named],
                                {e.name: (e.dtype, e.shape) for e in handle.entries})
        if bad:
            name = bad[0][0]
            e, t = dict(zip(handle.names, handle.entries))[name], dict(named)[name]
            raise IpcError(f"update_bucket: {name} expected {e.dtype}{list(e.shape)}, "
                           f"found {dtype_name(t)}{list(t.shape)}; nothing was written")
        _pack(exp.keep, handle.entries, [t for _, t in named])
        if exp.keep.is_cuda:
            torch.cuda.current_stream(exp.keep.device).synchronize()

    def buffer(self, handle: IpcHandle | BucketHandle) -> torch.Tensor:
        """The exported tensor itself, in this process (a bucket: its flat uint8 buffer)."""
        return self._get(handle).keep

    def acks(self, handle: IpcHandle | BucketHandle) -> int:
        """How many receiver processes have acked ``handle`` (called :func:`ack` after their last read)."""
        self._get(handle)
        return len(shm.acks(self._guard.path, handle.guard.serial))

    def release(self, handle: IpcHandle | BucketHandle, force: bool = False) -> int:
        """Kill ``handle`` and free its buffer once every receiver acked (or ``force``); returns bytes released."""
        exp = self._get(handle)
        acked = self.acks(handle)
        if acked < exp.receivers and not force:
            raise IpcError(f"export #{handle.guard.serial}: {acked} of {exp.receivers} receiver process(es) acked; "
                           "one may still read this memory. Each receiver calls ipc.ack(handle) (or Receiver.drop()) "
                           "after its last read; or release(handle, force=True).")
        self._guard.clear(handle.guard.slot)  # from now on rebuild() raises IpcError
        for path in shm.acks(self._guard.path, handle.guard.serial):
            shm.unlink(path)
        del self._live[handle.guard.serial]
        if exp.shm_path and all(e.shm_path != exp.shm_path for e in self._live.values()):
            # the last export of its segment: remove the file's name (pages go with the last mapping)
            self._segments.pop(exp.keep.untyped_storage().data_ptr(), None)
            shm.unlink(exp.shm_path)
        nbytes, is_cuda = exp.keep.nbytes, exp.keep.is_cuda
        exp.keep = None  # type: ignore[assignment]  # close() still holds exp: drop the buffer itself
        if is_cuda:
            torch.cuda.ipc_collect()  # free blocks whose receivers have let go
        return nbytes

    def close(self) -> None:
        """Release everything (forced) and remove the shared files."""
        for e in list(self._live.values()):
            self.release(e.handle, force=True)
        self._finalizer()

    def __enter__(self) -> "Exporter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def live_bytes(self) -> int:
        """Bytes of exported buffers this exporter keeps alive."""
        return sum(e.keep.nbytes for e in self._live.values())

    def _get(self, handle: IpcHandle | BucketHandle) -> _Export:
        exp = self._live.get(handle.guard.serial)
        if exp is None or handle.guard.path != self._guard.path:
            raise IpcError(f"export #{handle.guard.serial} is not live in this Exporter (already released, "
                           "or exported by another process/Exporter)")
        return exp

    def _handle(self, t: torch.Tensor, guard: Guard) -> IpcHandle:
        """CUDA: torch's IPC arguments for ``t``. CPU: its shared file and layout (``t`` moved there first)."""
        if t.is_cuda:
            kind, uuid, payload = "cuda", device_uuid(t.device.index), tuple(reduce_tensor(t.detach())[1])
        else:
            old = t.untyped_storage()
            if old.data_ptr() not in self._segments:  # like share_memory_(): move the storage, once
                flat = self._new_segment(max(old.nbytes(), 1))
                flat[: old.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(old))
                with torch.no_grad():
                    t.set_(flat.untyped_storage(), t.storage_offset(), t.shape, t.stride())
            storage = t.untyped_storage()
            path = self._segments[storage.data_ptr()]
            kind, uuid, payload = "shm", None, (path, storage.nbytes(), t.storage_offset(), tuple(t.stride()))
        return IpcHandle(kind, dtype_name(t.dtype), tuple(t.shape), t.nbytes, host_id(), uuid, payload, guard,
                         os.getpid())

    def _new_segment(self, nbytes: int) -> torch.Tensor:
        """A new /dev/shm file of ``nbytes``, mapped MAP_SHARED, as a flat uint8 tensor."""
        path = os.path.join(shm.SHM_DIR, f"{self.prefix}-{next(self._ids)}.shm")
        storage = shm.create_segment(path, nbytes)
        self._segments[storage.data_ptr()] = path
        return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))

    @staticmethod
    def _cleanup(guard: shm.GuardFile, segments: dict[int, str]) -> None:
        guard.close()
        for path in [*segments.values(), *shm.acks(guard.path)]:  # acks of forced releases, or late ones
            shm.unlink(path)


# ---- Receiving side -------------------------------------------------------------------------------

def rebuild(handle: IpcHandle) -> torch.Tensor:
    """Map a live exported tensor into this process, zero-copy, on its GPU (:func:`check_handle` first)."""
    if not isinstance(handle, IpcHandle):
        raise IpcError(f"rebuild expects an IpcHandle, found {type(handle).__name__}"
                       + ("; use rebuild_bucket() for a bucket" if isinstance(handle, BucketHandle) else ""))
    check_handle(handle)
    return _rebuild_cuda(handle) if handle.kind == "cuda" else _rebuild_shm(handle)


def _rebuild_cuda(handle: IpcHandle) -> torch.Tensor:
    if handle.pid == os.getpid():  # CUDA cannot open its own IPC handle: hand back the original
        owner = _EXPORTERS.get(handle.guard.path)
        if owner is not None and handle.guard.serial in owner._live:
            return owner._live[handle.guard.serial].keep
    args = list(handle.payload)
    args[versions.storage_device_slot()] = local_index(handle.device_uuid or "")  # remap: the exporter's index -> ours
    try:
        return rebuild_cuda_tensor(*args)
    except RuntimeError as err:
        raise IpcError(f"could not open the CUDA IPC handle of export #{handle.guard.serial} "
                       f"(pid {handle.pid}): {err}") from err


def _rebuild_shm(handle: IpcHandle) -> torch.Tensor:
    path, storage_nbytes, offset, stride = handle.payload
    if not os.path.exists(path):  # checked first: from_file would create a missing file
        raise IpcError(f"shared-memory segment {path} of export #{handle.guard.serial} is gone (released)")
    storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=storage_nbytes)
    try:
        check_handle(handle)  # released between the first check and the mapping?
    except IpcError:
        shm.unlink(path)  # from_file may have re-created the file; it belongs to a dead export
        raise
    return torch.empty(0, dtype=getattr(torch, handle.dtype)).set_(storage, offset, handle.shape, stride)


def rebuild_bucket(handle: BucketHandle) -> list[tuple[str, torch.Tensor]]:
    """Rebuild a bucket: ``[(name, view)]``, every view pointing into the exporter's one buffer."""
    if not isinstance(handle, BucketHandle):
        raise IpcError(f"rebuild_bucket expects a BucketHandle, found {type(handle).__name__}; "
                       "use rebuild() for a single tensor")
    return bucket_views(rebuild(handle.buffer), handle.entries)


class Receiver:
    """Engine side: maps each bucket once and reuses the mapping, re-checking liveness; drop() lets go and acks."""

    def __init__(self) -> None:
        self._views: dict[tuple[str, int], list[tuple[str, torch.Tensor]]] = {}
        self._handles: dict[tuple[str, int], BucketHandle] = {}

    def bucket(self, handle: BucketHandle) -> list[tuple[str, torch.Tensor]]:
        """Views of the bucket's tensors (zero-copy), rebuilt on first use."""
        key = (handle.guard.path, handle.guard.serial)
        if key in self._views:
            check_handle(handle)
        else:
            self._views[key] = rebuild_bucket(handle)
            self._handles[key] = handle
        return self._views[key]

    def copy_into(self, handle: BucketHandle, dest: Mapping[str, torch.Tensor]) -> int:
        """Copy the bucket into ``dest[name]`` (a separate inference copy), every entry checked first; returns bytes."""
        bad = metadata.problems([(e.name, e.dtype, e.shape) for e in handle.entries],
                                {e.name: (dtype_name(d), tuple(d.shape)) for e in handle.entries
                                 if (d := dest.get(e.name)) is not None})
        if bad:
            e, d = next(e for e in handle.entries if e.name == bad[0][0]), dest.get(bad[0][0])
            found = "no tensor" if d is None else f"{dtype_name(d)}{list(d.shape)}"
            raise IpcError(f"{e.name}: bucket has {e.dtype}{list(e.shape)}, destination has {found}; "
                           "nothing was written")
        with torch.no_grad():
            for name, view in self.bucket(handle):
                dest[name].copy_(view, non_blocking=True)
        return handle.nbytes

    def drop(self) -> None:
        """Forget every view, after pending copies finished, then ack each bucket: its exporter may release it."""
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        self._views.clear()
        for handle in self._handles.values():
            ack(handle)
        self._handles.clear()


# ---- Module-level API: a default Exporter per process ---------------------------------------------

_DEFAULT: Exporter | None = None


def default_exporter() -> Exporter:
    """The process-wide Exporter behind the module-level export functions."""
    global _DEFAULT
    if _DEFAULT is None or not _DEFAULT._finalizer.alive:
        _DEFAULT = Exporter()
    return _DEFAULT


def export_tensor(t: torch.Tensor, receivers: int = 1) -> IpcHandle:
    """:meth:`Exporter.export_tensor` on the default Exporter."""
    return default_exporter().export_tensor(t, receivers)


def export_bucket(named: Iterable[tuple[str, torch.Tensor]], receivers: int = 1) -> BucketHandle:
    """:meth:`Exporter.export_bucket` on the default Exporter."""
    return default_exporter().export_bucket(named, receivers)


def ack(handle: IpcHandle | BucketHandle) -> bool:
    """Receiver side: tell the exporter that this process has finished reading ``handle`` (drop its views first).
    Waits for this process's queued work on the handle's GPU, then leaves the ack ``Exporter.release`` counts: one
    per process, so acking twice changes nothing. False when the export is already released (nothing to ack)."""
    h = handle.buffer if isinstance(handle, BucketHandle) else handle
    try:
        live = shm.guard_serial(h.guard.path, h.guard.slot) == h.guard.serial
    except (FileNotFoundError, ProcessLookupError):  # the exporter closed or died: nothing left to guard
        live = False
    if not live:
        return False
    if h.kind == "cuda" and torch.cuda.is_initialized():
        torch.cuda.synchronize(device_of(h))  # reads queued on that GPU have finished before we say so
    shm.write_ack(h.guard.path, h.guard.serial)
    return True


def release(handle: IpcHandle | BucketHandle, force: bool = False) -> int:
    """:meth:`Exporter.release` on the default Exporter."""
    return default_exporter().release(handle, force=force)


# ---- Where am I: host identity, and the GPU's local index here (device remapping) -----------------

@functools.cache
def host_id() -> str:
    """This machine's identity for IPC purposes (the kernel boot id; shared by containers on one host)."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


@functools.cache  # an index once found stays right for the process; a miss is looked up again
def local_index(uuid: str) -> int:
    """Local CUDA index of the physical GPU ``uuid`` in this process; IpcError if it is not visible."""
    seen = [device_uuid(i) for i in range(torch.cuda.device_count())]  # UUIDs in local index order
    if uuid in seen:
        return seen.index(uuid)
    found = ", ".join(f"cuda:{i}={u}" for i, u in enumerate(seen)) or "no CUDA devices"
    raise IpcError(f"this handle lives on GPU {uuid.removeprefix('GPU-')}, which this process cannot see (it sees: "
                   f"{found}; CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}). CUDA IPC only "
                   "works on one physical GPU: place the receiver there, or send the weights over NCCL (broadcast).")


def device_of(handle: IpcHandle | BucketHandle) -> torch.device:
    """The device a handle rebuilds on in this process (its GPU's local index, or the CPU)."""
    h = handle.buffer if isinstance(handle, BucketHandle) else handle
    on_gpu = h.kind == "cuda" and h.device_uuid
    return torch.device("cuda", local_index(h.device_uuid)) if on_gpu else torch.device("cpu")


# ---- Liveness: is the export behind a handle still there? (the files are in labsupport.shm) --------

def check_handle(handle: IpcHandle | BucketHandle) -> None:
    """Raise IpcError unless ``handle`` is live: same host, exporter alive, not released (microseconds)."""
    h = handle.buffer if isinstance(handle, BucketHandle) else handle
    if h.host != host_id():
        raise IpcError(f"this handle was exported on another machine (boot id {h.host[:8]}..., here {host_id()[:8]}"
                       "...): IPC works on one host; across machines send the weights with labsupport.broadcast.")
    try:
        serial = shm.guard_serial(h.guard.path, h.guard.slot)
    except FileNotFoundError:
        raise IpcError(f"the exporter of this handle (pid {h.pid}) has closed or exited: its guard file "
                       f"{h.guard.path} is gone (or this process runs in another container / IPC namespace, "
                       "with its own /dev/shm). Ask the owner for a fresh handle.") from None
    except ProcessLookupError:
        raise IpcError(f"the exporter of this handle (pid {h.pid}) has exited; its memory is gone.") from None
    if serial != h.guard.serial:
        raise IpcError(f"this handle (export #{h.guard.serial} of pid {h.pid}) has been released by its exporter; "
                       "its memory may already hold other data. Rebuild from the handle of the current export.")
