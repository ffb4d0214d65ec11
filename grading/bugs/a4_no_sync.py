"""Assignment 4, seeded bug (seen on a GPU only): the handle is sent while the copies into the buffer are still
queued on the owner's GPU. An engine that loads on a stream of its own reads the buffer before they land."""

import torch
from torch.multiprocessing.reductions import reduce_tensor

from grading.reference import a2 as buckets
from grading.reference import a4 as ref
from labsupport.core.devices import gpu_uuid

LOSES = {"test_cuda_handle_is_safe_to_send_at_once"}
GPU_ONLY = True  # on the CPU the copies are done when pack returns: nothing to see


def export(named):
    device = named[0][1].device
    if device.type != "cuda":
        return ref.export(named)
    entries, size = buckets.layout([buckets.meta(n, t) for n, t in named])
    buf = torch.empty(size, dtype=torch.uint8, device=device)
    buckets.pack(buf, entries, [t for _, t in named])  # the bug: no torch.cuda.synchronize(device) after this
    return buf, ref.Handle(gpu_uuid(device.index), tuple(reduce_tensor(buf)[1]), entries)
