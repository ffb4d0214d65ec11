"""A memory timeline in straight lines: bytes by role at the edges of each phase, and their plot.

The caller says which tensors play which role (``track("weights", model.parameters)``); each ``with
tl.phase("generate"):`` block samples as it begins and as it ends: the time, the phase, each role's
bytes on the device, and on a GPU what PyTorch's allocator holds. ``labsupport.memory`` hardens it.
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
        if self.gpu and self.device.index is None:  # "cuda": the current GPU (tensors say "cuda:0")
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.roles: dict[str, Callable[[], Iterable[torch.Tensor]]] = {}
        self.samples: list[dict[str, Any]] = []
        self.phases: list[str] = []
        self._t0 = time.perf_counter()

    def track(self, role: str, tensors: Callable[[], Iterable[torch.Tensor]]) -> None:
        """Count under ``role``, at every sample, the bytes of the tensors ``tensors()`` returns."""
        self.roles[role] = tensors

    def _sample(self, phase: str, event: str) -> dict[str, Any]:
        """Record the bytes of every role now (and the allocator's count on a GPU)."""
        if self.gpu:
            torch.cuda.synchronize(self.device)  # what has been allocated by the work queued so far
        roles = {role: sum(t.nbytes for t in get() if t.device == self.device)
                 for role, get in self.roles.items()}
        s = {"t": time.perf_counter() - self._t0, "phase": phase, "event": event, "roles": roles,
             "allocated": torch.cuda.memory_allocated(self.device) if self.gpu else None}
        self.samples.append(s)
        return s

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Mark a phase of the step: one sample as it begins, one as it ends."""
        self.phases.append(name)
        self._sample(name, "begin")
        try:
            yield
        finally:  # a phase that raises still gets its end sample
            self._sample(name, "end")


def plot(tl: Timeline, unit: float = 1e6, ax: Any = None) -> Any:
    """A stacked bar of bytes by role per sample, phases shaded; on a GPU, the allocator's tick."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3))
    x, bottom = range(len(tl.samples)), [0.0] * len(tl.samples)
    for role in tl.roles:
        height = [s["roles"][role] / unit for s in tl.samples]
        ax.bar(x, height, 0.8, bottom=bottom, label=role)
        bottom = [b + h for b, h in zip(bottom, height)]
    if tl.gpu:
        ax.plot(x, [s["allocated"] / unit for s in tl.samples], "k_", markersize=14,
                label="allocated")
    for k, name in enumerate(tl.phases):  # samples 2k and 2k + 1 are phase k's begin and end
        ax.axvspan(2 * k - 0.5, 2 * k + 1.5, color="0.93" if k % 2 else "0.98", zorder=0)
        ax.text(2 * k + 0.5, 1.01, name, transform=ax.get_xaxis_transform(), ha="center",
                va="bottom", fontsize=7)
    ax.set_xticks(list(x), [s["event"] for s in tl.samples], fontsize=6)
    ax.set_ylabel(f"bytes / {unit:g}")
    ax.legend(loc="upper left", fontsize=7)
    return ax
