"""Assignment 4, seeded bug: the receiver maps the shared-memory file privately (``shared=False``, the default
of ``UntypedStorage.from_file``): it reads the owner's bytes, but its pages are copy-on-write, so nothing is
shared: memory doubles, and writes (an in-place update of the receiver's side) never reach the owner."""

import torch

from grading.reference import a2 as buckets
from grading.reference import a4 as ref

LOSES = {"test_rebuild_maps_the_owners_memory"}


def rebuild(handle):
    if handle.gpu is not None:
        return ref.rebuild(handle)
    path, size = handle.where
    storage = torch.UntypedStorage.from_file(path, shared=False, nbytes=size)  # the bug: shared=False
    buf = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (size,), (1,))
    return buckets.unpack(buf, handle.entries)
