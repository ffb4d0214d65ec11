"""Assignment 4, seeded bug: the receiver opens the handle on the owner's CUDA index instead of looking the
GPU's UUID up: under another CUDA_VISIBLE_DEVICES it maps the wrong GPU, or fails."""

from torch.multiprocessing.reductions import rebuild_cuda_tensor

from grading.reference import a2 as buckets
from grading.reference import a4 as ref

LOSES = {"test_rebuild_opens_the_handle_on_this_process_index"}


def rebuild(handle):
    if handle.gpu is None:
        return ref.rebuild(handle)
    buf = rebuild_cuda_tensor(*handle.where)  # the bug: the owner's storage_device, unchanged
    return buckets.unpack(buf, handle.entries)
