"""Zero-copy weight handoff on one machine (Lab 5): ``core.handoff`` plus, each against a failure:

- a guard per export, checked at each rebuild and use of a mapping: a released buffer mapped while
  its memory holds other tensors (garbage weights, no error);
- release by ``ack`` (``Exporter.release`` waits for the acks up to a deadline, gives torch's CUDA
  IPC count back if no other process acked; a timed-out reader's block kept until its engine
  answers again, ``free_kept``): memory freed under a reader, a wait for ever, a leak;
- the exporter's liveness (a lock the kernel drops when it dies; the receiver that finds it dead
  removes its files): a handle from a crashed trainer, its files left in ``/dev/shm``;
- the host's boot id in each handle, errors naming the GPUs a process sees: a handle used on
  another machine or an unseen GPU failing obscurely;
- names, dtypes, shapes checked before any write, bad input before allocating: a half-written copy;
- ``Receiver`` maps each handle once, ``update_bucket`` repacks in place, ``export_tensor`` shares
  a tensor itself: a per-handle cost on every update, a copy where none is needed.

Limits: the liveness check is not atomic with the mapping; views rebuilt before a release stay
valid; a child forked by the exporter inherits its lock; one host, one ``/dev/shm``.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import itertools
import os
import time
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from labsupport import metadata, shm
from labsupport.core import buckets, handoff
from labsupport.core.devices import gpu_uuid, synchronize

Named = Iterable[tuple[str, torch.Tensor]]
Kept = collections.namedtuple("Kept", "owner memory handle guard")
KEPT: list[Kept] = []  # exports killed with release(keep=owner), freed once their owner answers
_EXPORTERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # guard path -> Exporter
_BOOT = Path("/proc/sys/kernel/random/boot_id")  # the machine, for IPC (else: the host's name)
HOST_ID = _BOOT.read_text().strip() if _BOOT.exists() else os.uname().nodename


class IpcError(RuntimeError):
    """A handle cannot be used here: released, exporter gone, wrong machine or GPU, or bad input."""
    crosses_processes = True  # course.peer.Peer re-raises it as itself, not as a RuntimeError


@dataclass(frozen=True)
class Handle(handoff.Handle):
    """The core's handle plus its exporter; guard slot ``slot`` holds ``serial`` until release."""
    host: str  # the kernel's boot id
    pid: int  # the exporter's process
    guard: str  # the exporter's guard file
    slot: int
    serial: int

    @property
    def names(self) -> list[str]:
        return [e[0] for e in self.entries]

    @property
    def metas(self) -> dict[str, tuple[str, tuple[int, ...]]]:  # {name: (dtype, shape)}
        return {name: (dtype, tuple(shape)) for name, dtype, shape, _, _ in self.entries}

    @property
    def nbytes(self) -> int:  # the tensors' bytes: what an update moves
        return sum(e[4] for e in self.entries)


def _show(meta: tuple[str, tuple[int, ...]] | None) -> str:  # (dtype, shape)
    return f"{meta[0]}{list(meta[1])}" if meta else "no tensor"


@dataclass
class _Export:
    handle: Handle
    keep: torch.Tensor | None  # the memory behind the handle, as flat bytes: alive until release
    receivers: int
    nbytes: int  # what was exported: a bucket's buffer, or the shared tensor


def _give_back(handle: Handle, guard: str) -> None:
    """Remove ``handle``'s acks; on a GPU with no other process's ack (read here, never opened, or
    its receiver died) give torch's CUDA IPC count back, which only an opener gives: else the
    block would wait for exit."""
    acks = shm.acks(guard, handle.serial)
    if handle.gpu is not None and all(p.endswith(f"-{os.getpid()}.ack") for p in acks):
        args = dict(zip(inspect.signature(rebuild_cuda_tensor).parameters, handle.where))
        torch.UntypedStorage._release_ipc_counter_cuda(args["ref_counter_handle"],
                                                       args["ref_counter_offset"])
    for path in acks:
        shm.unlink(path)


def kept_by(owner: object) -> list[Kept]:
    return [k for k in KEPT if k.owner is owner]


def free_kept(kept: list[Kept]) -> int:
    """Free blocks ``release(keep=owner)`` held, once their late reader is done (its engine
    answered a call sent after them: an engine serves its calls in order); the bytes."""
    KEPT[:], nbytes = [k for k in KEPT if all(k is not g for g in kept)], 0
    while kept:  # (dropping the last references: the blocks go to torch's IPC limbo, collected)
        k = kept.pop()
        _give_back(k.handle, k.guard)
        nbytes, k = nbytes + k.memory.nbytes, None
    if nbytes and torch.cuda.is_initialized():
        torch.cuda.ipc_collect()
    return nbytes


class Exporter(contextlib.AbstractContextManager):
    """Owns exported buffers: keeps each alive until ``release()``, which waits for the acks."""

    def __init__(self) -> None:
        shm.sweep_stale()  # files of exporters that crashed earlier
        self.prefix = f"{shm.PREFIX}{os.getpid()}-{os.urandom(4).hex()}"
        self._guard = shm.GuardFile(os.path.join(handoff.SHM_DIR, f"{self.prefix}.guard"))
        self._ids = itertools.count(1)  # serials of exports and numbers of segment files
        self._live: dict[int, _Export] = {}
        self._finalizer = weakref.finalize(self, self._guard.close)  # removes the files too
        _EXPORTERS[self._guard.path] = self

    def export_bucket(self, named: Named, receivers: int = 1) -> Handle:
        """Pack ``named`` into a new buffer (``handoff.export``), for ``receivers`` processes."""
        named = self._checked(named, receivers)
        flat, core = handoff.export(named, None if named[0][1].is_cuda else self._segment_path())
        return self._export(flat, core.where, core.entries, receivers, flat.nbytes)

    def export_buckets(self, named: Named, bucket_bytes: int = 512 << 20,
                       receivers: int = 1) -> list[Handle]:
        """Export a whole state dict as buckets of at most ``bucket_bytes`` (``buckets.split``)."""
        named = list(named)
        rest = iter(named)
        return [self.export_bucket([next(rest) for _ in group], receivers)
                for group in buckets.split(buckets.metas(named), bucket_bytes)]

    def export_tensor(self, t: torch.Tensor, receivers: int = 1, name: str = "tensor") -> Handle:
        """Share ``t`` itself, as a handle with one entry ``name``. On the CPU ``t`` first moves
        into a shared file, once (like ``share_memory_()``): export parameters, not slices."""
        self._checked([(name, t)], receivers)
        if not t.is_contiguous():
            raise IpcError(f"export_tensor shares {name} as it is, so it must be contiguous (its "
                           f"stride is {t.stride()}): export a contiguous copy, or export_bucket")
        ptr = t.untyped_storage().data_ptr()  # CPU: the file that t already lives in, if any
        path = next((e.handle.where[0] for e in self._live.values()
                     if e.handle.gpu is None and e.keep.data_ptr() == ptr), None)
        if not t.is_cuda and path is None:
            moved, core = handoff.export([(name, t)], self._segment_path())
            with torch.no_grad():
                t.set_(moved.untyped_storage(), 0, t.shape, t.stride())
            path = core.where[0]
        flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
        where = tuple(reduce_tensor(flat)[1]) if t.is_cuda else (path, flat.nbytes)
        entry = (*buckets.meta(name, t), t.storage_offset() * t.element_size(), t.nbytes)
        return self._export(flat, where, [entry], receivers, t.nbytes)

    def update_bucket(self, handle: Handle, named: Named) -> None:
        """Repack new values (same names in order, dtypes, shapes; checked first) into an export."""
        exp, found = self._get(handle), dict(named)
        if list(found) != handle.names:
            raise IpcError(f"update_bucket: expected tensors {handle.names[:4]}... in bucket "
                           f"order, found {list(found)[:4]}...")
        if bad := metadata.problems([buckets.meta(n, t) for n, t in found.items()], handle.metas):
            name = bad[0][0]
            raise IpcError(f"update_bucket: {name} expected {_show(handle.metas[name])}, found "
                           f"{_show(buckets.meta(name, found[name])[1:])}; nothing was written")
        buckets.pack(exp.keep, handle.entries, list(found.values()))
        synchronize(exp.keep.device)  # the bytes are there before a receiver reads them

    def buffer(self, handle: Handle) -> torch.Tensor:
        """The exported memory itself, here, as flat bytes (``buckets.unpack`` slices it)."""
        return self._get(handle).keep

    def acks(self, handle: Handle) -> int:
        """How many receiver processes have acked ``handle`` (:func:`ack` after their last read)."""
        self._get(handle)
        return len(shm.acks(self._guard.path, handle.serial))

    def release(self, handle: Handle, force: bool = False, timeout_s: float = 0.0,
                keep: object = None) -> int:
        """Kill ``handle``, free its memory once each receiver process acked (waiting up to
        ``timeout_s``; ``force``: at once); returns the bytes. ``keep``: the owner (an engine) of a
        late call that may still read: the memory stays until ``free_kept`` (not pulled away)."""
        exp, deadline = self._get(handle), time.monotonic() + timeout_s
        while not force and (acked := self.acks(handle)) < exp.receivers:
            if time.monotonic() >= deadline:
                raise IpcError(f"export #{handle.serial}: {acked} of {exp.receivers} receiver "
                               f"process(es) acked within {timeout_s:g} s; one may still read this "
                               "memory. Each receiver calls ipc.ack(handle) (or Receiver.drop()) "
                               "after its last read; or release(force=True).")
            time.sleep(0.01)
        self._guard.clear(handle.slot)  # from now on rebuild() raises IpcError
        if keep is not None:
            KEPT.append(Kept(keep, exp.keep, handle, self._guard.path))
        else:
            _give_back(handle, self._guard.path)
        del self._live[handle.serial]
        on_gpu, exp.keep = exp.keep.is_cuda, None  # close() still holds exp: drop the memory itself
        if on_gpu or all(e.handle.where[0] != handle.where[0] for e in self._live.values()):
            handoff.release(handle)  # CPU: the file's name goes (pages with the last mapping)
        return exp.nbytes

    def close(self) -> None:
        """Release everything (forced) and remove the shared files."""
        for e in list(self._live.values()):
            self.release(e.handle, force=True)
        self._finalizer()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def live_bytes(self) -> int:
        """Bytes of exported memory this exporter keeps alive."""
        return sum(e.nbytes for e in self._live.values())

    def _checked(self, named: Named, receivers: int) -> list[tuple[str, torch.Tensor]]:
        named = list(named)
        if receivers < 1:
            raise IpcError(f"receivers must be >= 1, found {receivers}")
        if not self._guard.free:
            raise IpcError(f"{shm.GUARD_SLOTS} exports are live here; release some first")
        if len(devices := sorted({str(t.device) for _, t in named})) != 1:
            raise IpcError("an export needs at least one (name, tensor) pair, all on one device; "
                           f"found {devices}")
        if twice := [n for n, k in collections.Counter(n for n, _ in named).items() if k > 1]:
            raise IpcError(f"tensor name {twice[0]!r} appears twice in one bucket: rename one")
        return named

    def _export(self, flat: torch.Tensor, where: tuple, entries: list, receivers: int,
                nbytes: int) -> Handle:
        serial = next(self._ids)
        handle = Handle(gpu_uuid(flat.device.index) if flat.is_cuda else None, where, entries,
                        HOST_ID, os.getpid(), self._guard.path, self._guard.take(serial), serial)
        self._live[serial] = _Export(handle, flat, receivers, nbytes)
        return handle

    def _get(self, handle: Handle) -> _Export:
        exp = self._live.get(handle.serial)
        if exp is None or handle.guard != self._guard.path:
            raise IpcError(f"export #{handle.serial} is not live in this Exporter (already "
                           "released, or exported by another process/Exporter)")
        return exp

    def _segment_path(self) -> str:
        return os.path.join(handoff.SHM_DIR, f"{self.prefix}-{next(self._ids)}.shm")


def rebuild(handle: Handle) -> list[tuple[str, torch.Tensor]]:
    """``handoff.rebuild`` of a live handle: ``[(name, view)]``, zero-copy, on the GPU it names."""
    check_handle(handle)
    owner = _EXPORTERS.get(handle.guard) if handle.pid == os.getpid() else None
    if owner is not None:  # CUDA cannot open its own IPC handle: hand back the original memory
        return buckets.unpack(owner.buffer(handle), handle.entries)
    if handle.gpu is None and not os.path.exists(handle.where[0]):  # from_file would create it
        raise IpcError(f"the file {handle.where[0]} of export #{handle.serial} is gone (released)")
    try:
        views = handoff.rebuild(handle)
    except RuntimeError as err:
        raise IpcError(f"cannot open export #{handle.serial} of pid {handle.pid}: {err}") from err
    if handle.gpu is None:  # released while we mapped it? (a file from_file re-made goes at close)
        check_handle(handle)
    return views


class Receiver:
    """Engine side: maps each handle once, re-checks it at each use; ``drop()`` lets go and acks."""

    def __init__(self) -> None:
        self._mapped: dict[tuple[str, int], tuple[Handle, list[tuple[str, torch.Tensor]]]] = {}

    def bucket(self, handle: Handle) -> list[tuple[str, torch.Tensor]]:
        """Views of the handle's tensors (zero-copy), rebuilt on first use."""
        key = (handle.guard, handle.serial)
        if key in self._mapped:
            check_handle(handle)
        else:
            self._mapped[key] = (handle, rebuild(handle))
        return self._mapped[key][1]

    def copy_into(self, handle: Handle, dest: Mapping[str, torch.Tensor]) -> int:
        """Copy the bucket into ``dest[name]`` (an inference copy), checked first; returns bytes."""
        have = {n: buckets.meta(n, d)[1:] for n in handle.names if (d := dest.get(n)) is not None}
        if bad := metadata.problems([e[:3] for e in handle.entries], have):
            name = bad[0][0]
            raise IpcError(f"{name}: bucket has {_show(handle.metas[name])}, destination has "
                           f"{_show(have.get(name))}; nothing was written")
        return buckets.load_into(dest, self.bucket(handle), non_blocking=True)

    def drop(self) -> None:
        """Wait for the copies queued on each mapped handle's device, forget the views, ack each."""
        handles = [h for h, _ in self._mapped.values()]
        for device in {device_of(h) for h in handles}:  # the handles' devices, whichever is current
            synchronize(device)
        self._mapped.clear()
        for h in handles:
            ack(h)


def ack(handle: Handle) -> bool:
    """Views dropped: wait for the handle's GPU, then ack it (idempotent); False if it is gone."""
    if shm.guard_serial(handle.guard, handle.slot) != handle.serial:
        return False
    if handle.gpu is not None and torch.cuda.is_initialized():
        synchronize(device_of(handle))  # reads queued on that GPU have finished before we say so
    shm.write_ack(handle.guard, handle.serial)
    return True


def device_of(handle: Handle) -> torch.device:
    """The device ``handle`` rebuilds on in this process: its GPU's local index here, or the CPU."""
    if handle.gpu is None:
        return torch.device("cpu")
    try:
        return torch.device("cuda", handoff.local_index(handle.gpu))
    except RuntimeError as err:
        raise IpcError(str(err)) from None


def check_handle(handle: Handle) -> None:
    """Raise IpcError unless ``handle`` is live: same host, exporter alive, not released (fast)."""
    if not isinstance(handle, Handle):
        raise IpcError("expected an ipc.Handle (from an ipc.Exporter, with its guard), found "
                       f"{type(handle).__name__}")
    if handle.host != HOST_ID:
        raise IpcError(f"handle exported on another machine (boot id {handle.host[:8]}..., here "
                       f"{HOST_ID[:8]}...): IPC works on one host; use labsupport.broadcast.")
    if (serial := shm.guard_serial(handle.guard, handle.slot)) < 0:
        raise IpcError(f"the exporter (pid {handle.pid}) has closed or exited: its memory is gone "
                       "(or this process is in another container). Ask for a fresh handle.")
    if serial != handle.serial:
        raise IpcError(f"export #{handle.serial} of pid {handle.pid} has been released: its memory "
                       "may already hold other data. Rebuild from the current export's handle.")

