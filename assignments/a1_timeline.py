"""Assignment 1: a memory timeline of one RLHF step by role, and its plot.

The caller says which tensors play which role (``tl.track("weights", lambda: list(model.parameters()))``);
each ``with tl.phase("generate"):`` block records one sample as it begins and one as it ends: the seconds since
the timeline was made, the phase, the event ("begin" or "end"), the bytes each role holds on the timeline's
device, and on a GPU what PyTorch's caching allocator has allocated. On the CPU there is no allocator to ask:
the role bytes are the timeline.

Graded by ``grading/test_a1_timeline.py``; Lab 2 shows the step this records.
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
        """A timeline of ``device`` ("cpu", "cuda", "cuda:1"; "cuda" means the current GPU)."""
        raise NotImplementedError

    def track(self, role: str, tensors: Callable[[], Iterable[torch.Tensor]]) -> None:
        """At every sample, count under ``role`` the bytes of the tensors that ``tensors()`` returns *then*
        that live on this timeline's device (tensors elsewhere, e.g. offloaded to the CPU, do not count)."""
        raise NotImplementedError

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Mark a phase of the step: one sample as it begins, one as it ends (on a GPU, after the queued work
        has finished, so that the allocator's count is the one of the work done)."""
        raise NotImplementedError


def plot(tl: Timeline, unit: float = 1e6, ax: Any = None) -> Any:
    """Draw ``tl`` on ``ax`` (a new figure if None) and return ``ax``: one stacked bar per sample, in order, with
    one segment per role (``ax.bar(x, height, bottom=..., label=role)``, heights in ``unit`` bytes, roles in
    the order tracked, each stacked on the ones before), each phase's name written over its two samples
    (``ax.text``, one text per phase, in order), a legend, and on a GPU the allocator's count as a marker."""
    raise NotImplementedError
