"""Assignment 2, seeded bug: ``unpack`` returns copies "to be safe": every bucket is held twice while it loads,
and a write through a view (an IPC receiver's) never reaches the buffer."""

import torch

LOSES = {"test_unpack_returns_views_not_copies"}


def unpack(buf, entries):
    return [(name, buf[off:off + n].clone().view(getattr(torch, dtype)).view(shape))  # the bug: .clone()
            for name, dtype, shape, off, n in entries]
