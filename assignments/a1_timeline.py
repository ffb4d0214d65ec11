"""Assignment 1: a memory timeline of one RLHF step by role, and its plot.

Problem: an RLHF step runs out of memory in one phase and not in the others, and the fix depends on which
phase holds the peak and which role (weights, gradients, optimizer state, KV cache) fills it. Build the
instrument that answers this: the caller names the roles, marks the phases, and reads the bytes back.

Contract (what the grader checks, ``grading/test_a1_timeline.py``):

- every phase leaves exactly two samples, one as it begins and one as it ends, also when the phase raises (the
  error reaches the caller unchanged: an out-of-memory error is when the timeline is read);
- a role's bytes are the bytes of the tensors it holds *at that sample* and that live on the timeline's
  device: a view counts its own elements, not the storage it is a view of;
- times are seconds since the timeline was made, never decreasing;
- on a GPU, each sample also has the bytes the caching allocator has *allocated* (not reserved) once the
  work queued before the sample has finished; on the CPU there is no allocator, and that field is None.

Lab 2 runs the course's own timeline first and shows the step this records.
"""

from __future__ import annotations

import contextlib
import time  # noqa: F401
from typing import Any, Callable, Iterable, Iterator

import torch


class Timeline:
    """Phases and samples of bytes by role on one device.

    ``phases``: the phase names in the order they ran. ``samples``: one dict per phase edge with keys ``t``
    (seconds, non-decreasing), ``phase``, ``event`` ("begin"/"end"), ``roles`` ({role: bytes}, every tracked
    role, in the order tracked) and ``allocated`` (``torch.cuda.memory_allocated`` on a GPU, None on the CPU).
    """

    def __init__(self, device: str | torch.device) -> None:
        """A timeline of ``device`` ("cpu", "cuda", "cuda:1"; "cuda" means the current GPU). Its clock starts
        now: every sample's ``t`` is measured from here."""
        raise NotImplementedError

    def track(self, role: str, tensors: Callable[[], Iterable[torch.Tensor]]) -> None:
        """From now on, every sample counts under ``role`` the bytes of the tensors that ``tensors()`` returns
        at that sample (the list may change between samples) and that live on this timeline's device (tensors
        elsewhere, e.g. offloaded to the CPU, do not count). Roles appear in samples in the order tracked."""
        raise NotImplementedError

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A context manager marking one phase: ``name`` joins ``phases``, and the timeline gains a "begin"
        sample before the block and an "end" sample after it, whether the block returns or raises (an exception
        propagates unchanged). On a GPU a sample reflects the work queued before it, finished."""
        raise NotImplementedError


def plot(tl: Timeline, unit: float = 1e6, ax: Any = None) -> Any:
    """Draw ``tl`` on ``ax`` (a new figure if None) and return ``ax``. A reader must see, per sample in order,
    the total bytes as one bar whose segments are the roles (heights in ``unit`` bytes, one bar series per role
    labelled with the role, stacked in the order tracked: the bar's top is the total), each phase's name once
    over its two samples (as the axes' texts, in order), a legend naming the roles, and on a GPU the
    allocator's count. The grader reads the bars' heights and bottoms, the texts and the legend."""
    raise NotImplementedError
