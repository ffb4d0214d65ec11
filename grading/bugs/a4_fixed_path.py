"""Assignment 4, seeded bug: every export of a process uses the same shared-memory file name: a second export
while the first is still being read overwrites it, and releasing the first removes the second's file."""

import os

import torch

from grading.reference import a2 as buckets
from grading.reference import a4 as ref

LOSES = {"test_two_live_exports_are_independent"}


def export(named):
    if named[0][1].device.type == "cuda":
        return ref.export(named)
    entries, size = buckets.layout([buckets.meta(n, t) for n, t in named])
    path = os.path.join(ref.SHM_DIR, f"a4-export-{os.getpid()}.shm")  # the bug: one name per process
    with open(path, "wb") as f:
        f.truncate(size)
    storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=size)
    buf = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (size,), (1,))
    buckets.pack(buf, entries, [t for _, t in named])
    return buf, ref.Handle(None, (path, size), entries)
