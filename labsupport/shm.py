"""``labsupport.ipc``'s files in ``core.handoff.SHM_DIR``, named ``labsupport-ipc-<pid>-<random>``:

*segments* (``...-<n>.shm``, by ``core.handoff.export``): tensor bytes every process maps shared
(the CPU stand-in for CUDA IPC); one *guard* (``....guard``): an int64 serial per export slot (0 =
released) and a lock the exporter holds and the kernel drops when it dies, so a receiver knows in
microseconds whether an export is live (the first to find its exporter dead removes its files);
*acks* (``...-<serial>-<pid>.ack``): empty files, one per receiver done with an export, which the
exporter counts before it releases (CUDA handles too).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import mmap
import os
import struct
import threading
import time

from labsupport.core import handoff

GUARD_SLOTS = 4096  # live exports per exporter (8 bytes each in the guard file)
PREFIX = "labsupport-ipc-"


class GuardFile:
    """Exporter side: creates the guard file, holds its lock, writes serials (0 = released)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(self.fd, 8 * GUARD_SLOTS)
            fcntl.flock(self.fd, fcntl.LOCK_EX)  # dropped by the kernel when this process dies
            self.mm = mmap.mmap(self.fd, 8 * GUARD_SLOTS)
        except BaseException:  # neither the fd nor the file outlives a failed start
            os.close(self.fd)
            unlink(path)
            raise
        self.free = list(range(GUARD_SLOTS - 1, -1, -1))

    def take(self, serial: int) -> int:
        """Write ``serial`` into a free slot and return the slot."""
        slot = self.free.pop()
        struct.pack_into("q", self.mm, 8 * slot, serial)
        return slot

    def clear(self, slot: int) -> None:
        struct.pack_into("q", self.mm, 8 * slot, 0)
        self.free.append(slot)

    def close(self) -> None:
        """Mark every slot released (for receivers' open fds), remove the guard and the
        exporter's other files (segments, acks). Call once."""
        self.mm[:] = bytes(len(self.mm))
        self.mm.close()
        unlink(self.path)
        os.close(self.fd)
        for path in files(self.path):
            unlink(path)


# receiver side: guard path -> an open fd; the lock: no thread closes an fd in use
_GUARDS: dict[str, int] = {}
_GUARDS_LOCK = threading.Lock()


def guard_serial(path: str, slot: int) -> int:
    """The serial in ``slot`` of guard ``path`` now, through a cached fd: 0 once released, -1 once
    the guard is gone (exporter closed, or another /dev/shm) or its exporter died."""
    with _GUARDS_LOCK:
        if path not in _GUARDS:
            for gone in [p for p, fd in _GUARDS.items() if _unlocked(fd)]:
                # else a receiver fed a new Exporter per update keeps one fd per exporter
                os.close(_GUARDS.pop(gone))
            try:
                _GUARDS[path] = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                return -1
        if not _unlocked(_GUARDS[path]):  # the exporter's mapping and this read share the pages
            return struct.unpack("q", os.pread(_GUARDS[path], 8, 8 * slot))[0]
        os.close(_GUARDS.pop(path))
    sweep_stale(0.0, only=path)  # a dead exporter's files go now, not at a later Exporter's sweep
    return -1


def _unlocked(fd: int) -> bool:
    """Whether the guard's exporter has let go of its lock (exited, closed): we get a shared one."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True


def write_ack(guard_path: str, serial: int) -> None:
    """Receiver side: done with export ``serial`` (one file per process: acking twice is one)."""
    path = f"{guard_path.removesuffix('.guard')}-{serial}-{os.getpid()}.ack"
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))


def acks(guard_path: str, serial: int | str = "*") -> list[str]:
    """The ack files of export ``serial`` of this guard's exporter (``"*"``: of all its exports)."""
    return glob.glob(f"{glob.escape(guard_path.removesuffix('.guard'))}-{serial}-*.ack")


def files(guard_path: str) -> list[str]:
    """The segments and ack files of the exporter that holds this guard (not the guard itself)."""
    return glob.glob(f"{glob.escape(guard_path.removesuffix('.guard'))}-*.shm") + acks(guard_path)


def sweep_stale(min_age_s: float = 30.0, only: str | None = None) -> list[str]:
    """Remove the files of exporters that died (lock free), and a dead process's torch and CUDA IPC
    files; returns their names. Guards younger than ``min_age_s`` are spared (still being made)."""
    removed, now = [], time.time()
    for path in [only] if only else glob.glob(os.path.join(handoff.SHM_DIR, f"{PREFIX}*.guard")):
        try:
            with open(path, "rb") as f:
                if now - os.fstat(f.fileno()).st_mtime < min_age_s or not _unlocked(f.fileno()):
                    continue  # still being made, or its exporter is alive
        except FileNotFoundError:
            continue
        pid = int(os.path.basename(path).removeprefix(PREFIX).split("-")[0])
        dead = [] if os.path.exists(f"/proc/{pid}") else [f"torch_{pid}_*", f"cuda.shm.*.{pid:x}.*"]
        theirs = [f for pattern in dead for f in glob.glob(f"{handoff.SHM_DIR}/{pattern}")]
        for stale in [path, *files(path), *theirs]:
            unlink(stale)
            removed.append(os.path.basename(stale))
    return removed


def unlink(path: str) -> None:
    """Remove ``path`` if it is still there."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
