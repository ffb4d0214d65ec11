"""A memory timeline in straight lines: bytes by role at the edges of each phase, and a plot of them.

The caller says which tensors play which role (``track("weights", lambda: list(model.parameters()))``); each
``with tl.phase("generate"):`` block records one sample as it begins and one as it ends: the time, the phase,
the bytes each role holds on the device, and on a GPU what PyTorch's caching allocator has allocated. On the
CPU stand-in there is no allocator to ask: the role bytes are the timeline (one code path, one more column).

``labsupport.memory`` is this plus what production needs; Lab 2 lists each addition and what it guards against.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterable, Iterator

import torch


class Timeline:
    """Phases and samples of bytes by role on one device."""

    def __init__(self, device: str | torch.device) -> None:
        self.device = torch.device(device)
        self.gpu = self.device.type == "cuda"
        if self.gpu and self.device.index is None:  # "cuda" is the current GPU (tensors say "cuda:0")
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.roles: dict[str, Callable[[], Iterable[torch.Tensor]]] = {}
        self.samples: list[dict[str, Any]] = []
        self.phases: list[str] = []
        self._t0 = time.perf_counter()

    def track(self, role: str, tensors: Callable[[], Iterable[torch.Tensor]]) -> None:
        """Count, at every sample, the bytes of the tensors that ``tensors()`` returns then, under ``role``."""
        self.roles[role] = tensors

    def sample(self, phase: str, event: str) -> dict[str, Any]:
        """Record the bytes of every role now (and the allocator's count on a GPU)."""
        if self.gpu:
            torch.cuda.synchronize(self.device)  # what has been allocated by the work queued so far
        s = {"t": time.perf_counter() - self._t0, "phase": phase, "event": event,
             "roles": {role: sum(t.nbytes for t in get() if t.device == self.device) for role, get in self.roles.items()},
             "allocated": torch.cuda.memory_allocated(self.device) if self.gpu else None}
        self.samples.append(s)
        return s

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Mark a phase of the step: one sample as it begins, one as it ends."""
        self.phases.append(name)
        self.sample(name, "begin")
        yield
        self.sample(name, "end")


def plot(tl: Timeline, unit: float = 1e6, ax: Any = None) -> Any:
    """Stacked bytes by role over the samples, phases shaded and named, the allocator's line on a GPU."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3))
    t = [s["t"] for s in tl.samples]
    ax.stackplot(t, [[s["roles"][r] / unit for s in tl.samples] for r in tl.roles], labels=list(tl.roles), step="post")
    if tl.gpu:
        ax.step(t, [s["allocated"] / unit for s in tl.samples], "k--", where="post", label="allocated")
    edges = [[s for s in tl.samples if s["event"] == e] for e in ("begin", "end")]
    for k, (begin, end) in enumerate(zip(*edges)):
        ax.axvspan(begin["t"], end["t"], color="0.9" if k % 2 else "0.97", zorder=0)
        ax.text((begin["t"] + end["t"]) / 2, 1.01, begin["phase"], transform=ax.get_xaxis_transform(),
                ha="center", va="bottom", fontsize=7)
    ax.set_xlabel("seconds")
    ax.set_ylabel(f"bytes / {unit:g}")
    ax.legend(loc="upper left", fontsize=7)
    return ax
