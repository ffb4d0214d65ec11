"""Bytes by role across RLHF phases (Lab 2): ``core.timeline`` plus, each against a misreading:

- a background thread reading the allocator between phase edges (GPU), ``sample()`` marks inside
  a phase: a peak that two edge samples miss;
- the allocator's counters, each phase's peak, "other" (allocated bytes no role explains): logits
  and temporaries that no registered tensor shows;
- each storage counted once, under its first role in ``ROLES``: a tensor counted twice;
- weak references to registered tensors, ``forget_sources``: a freed KV cache kept alive;
- autograd's saved tensors (``track_activations``): training's largest transient uncounted;
- registered bytes in host memory, ``move_optimizer_state``: offloaded state vanishing, not moving;
- phases that must not overlap, a checked ``register``, PyTorch's memory history: double-counted
  phases, a typo that counts nothing, no allocation-level view.

The thread reads only the allocator (reading ``p.grad`` while autograd frees it crashes the
process): roles are counted on the step's own thread. ``experiments.memory_report`` plots one.
"""
from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from labsupport.core import timeline
from labsupport.core.devices import synchronize as _sync

ROLES = ("weights", "gradients", "optimizer", "kv_cache", "activations", "other")


def _tensors_of(role: str, obj: Any) -> Callable[[], Iterable[torch.Tensor]]:
    """A getter that lists obj's tensors at each call (so later changes, a freed cache, show up)."""
    if isinstance(obj, torch.nn.Module):
        if role == "gradients":
            return lambda: [p.grad for p in obj.parameters() if p.grad is not None]
        return lambda: [*obj.parameters(), *obj.buffers()]
    if isinstance(obj, torch.optim.Optimizer):  # its state (register the model for its gradients)
        return lambda: [t for s in list(obj.state.values()) for t in list(s.values())
                        if isinstance(t, torch.Tensor)]
    if isinstance(obj, torch.Tensor):
        ref = weakref.ref(obj)  # do not keep a registered tensor alive
        return lambda: [t] if (t := ref()) is not None else []
    if isinstance(obj, (list, tuple, dict)):
        return lambda: list(obj.values()) if isinstance(obj, dict) else list(obj)
    if callable(obj):
        return obj
    raise TypeError("register() takes a Module, Optimizer, Tensor, list/tuple/dict of tensors or a "
                    f"callable returning tensors; found {type(obj).__name__}")


class MemoryTimeline(timeline.Timeline):
    """``tl.register("weights", model)``, then ``with tl.sampling(), tl.phase("generate"): ...``."""

    def __init__(self, device: str | torch.device, *, name: str = "",
                 interval_s: float = 0.01) -> None:
        super().__init__(device)
        self.name, self.interval_s = name, interval_s  # interval_s: between the thread's reads
        props = torch.cuda.get_device_properties(self.device) if self.gpu else None
        self.capacity = props.total_memory if props else None  # bytes
        self.sources: list[tuple[str, str, Callable]] = []  # (role, name, tensor getter)
        self._saved = weakref.WeakValueDictionary()  # id -> a tensor saved for backward, alive
        self._lock = threading.Lock()  # guards samples (the sampler thread appends)
        self._current: str | None = None  # the phase running now
        self._thread, self._stop = None, threading.Event()
        self._ticks, self._sample_s, self._history = 0, 0.0, False
        self.register("activations", lambda: list(self._saved.values()), name="saved for backward")

    def register(self, role: str, obj: Any, name: str | None = None) -> None:
        """Count obj's tensors under role (read at every sample): a Module (parameters and buffers;
        for "gradients" their .grad), an Optimizer (its state), a Tensor, a list/dict/callable."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}: expected one of {ROLES}")
        self.sources.append((role, name or type(obj).__name__, _tensors_of(role, obj)))
        self.track(role, lambda: [t for r, _, get in self.sources if r == role for t in get()])

    def unregister(self, name: str) -> None:
        """Stop counting the source registered under this name."""
        if name not in (names := [n for _, n, _ in self.sources]):
            raise KeyError(f"no source named {name!r}; registered: {names}")
        self.sources = [s for s in self.sources if s[1] != name]

    def forget_sources(self) -> None:
        """Drop the registered objects (the records stay): a finished timeline keeps none alive."""
        self.sources = [(role, name, lambda: []) for role, name, _ in self.sources]

    @contextlib.contextmanager
    def track_activations(self) -> Iterator[None]:
        """Count the tensors autograd saves for backward (role "activations") while they live."""
        with torch.autograd.graph.saved_tensors_hooks(  # pack: remember t, return it
                lambda t: self._saved.setdefault(id(t), t), lambda t: t):
            yield

    def role_bytes(self) -> tuple[dict[str, int], int]:
        """Bytes per role here, and registered bytes in host memory; a storage once, first role."""
        first: dict[tuple, tuple[str, int]] = {}  # (device, storage address) -> (role, bytes)
        for role in ROLES:
            for t in self.roles.get(role, list)():  # address 0: no memory behind it (empty, meta)
                if isinstance(t, torch.Tensor) and (st := t.untyped_storage()).data_ptr():
                    first.setdefault((t.device, st.data_ptr()), (role, st.nbytes()))
        here = [(role, n) for (d, _), (role, n) in first.items() if d == self.device]
        host = sum(n for (d, _), (_, n) in first.items() if d.type == "cpu" and d != self.device)
        return {r: sum(n for role, n in here if role == r) for r in ROLES}, host

    def sample(self, event: str = "mark", roles: bool = True) -> dict[str, Any]:
        """A sample now, in the running phase, e.g. after a forward pass; on the step's thread."""
        return self._sample(self._current, event, roles)

    def _sample(self, phase: str | None, event: str, roles: bool = True) -> dict[str, Any]:
        """The core's sample plus the allocator's counters (GPU), host bytes and "other"."""
        if self.gpu and event in ("begin", "end"):
            torch.cuda.synchronize(self.device)  # a phase's edges include the work queued inside it
        t_start = time.perf_counter()
        s: dict[str, Any] = {"t": t_start - self._t0, "phase": phase, "event": event}
        if self.gpu:  # one call to the allocator (memory_allocated() & co. each flatten all stats)
            st = torch.cuda.memory_stats_as_nested_dict(self.device)
            a, r = (st[f"{k}_bytes"]["all"] for k in ("allocated", "reserved"))
            s.update(allocated=a["current"], reserved=r["current"], peak=a["peak"],
                     peak_reserved=r["peak"])  # peaks: since the phase began (phase() resets)
        if roles:
            r, host = self.role_bytes()
            if self.gpu:  # what the allocator holds that no registered tensor explains
                r["other"] = max(0, s["allocated"] - sum(v for k, v in r.items() if k != "other"))
            s["roles"], s["host"] = r, host
        with self._lock:
            self.samples.append(s)
            self._sample_s += time.perf_counter() - t_start
        return s

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """The core's phase, refusing to overlap another; on a GPU the allocator's peak restarts."""
        if self._current is not None:
            raise RuntimeError(f"phase {name!r} started inside phase {self._current!r}; phases "
                               "must not overlap: end the first one before starting the next")
        if self.gpu:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self._current = name
        try:
            with super().phase(name):
                yield
        finally:
            self._current = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample("tick", roles=False)  # the allocator only: never the step's tensors
            self._ticks += 1

    def start(self) -> None:
        """Read the allocator every interval_s seconds on a thread (GPU; on CPU none starts)."""
        if self._thread is not None:
            raise RuntimeError("the sampler is already running; call stop() first")
        if self.gpu:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="memory-timeline", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the background sampler and wait for its thread to end."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise RuntimeError(f"memory sampler thread did not stop within {timeout_s} s")
            self._thread = None

    @property
    def sampling_active(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @contextlib.contextmanager
    def sampling(self) -> Iterator[MemoryTimeline]:
        """Run the background sampler for the duration of the block."""
        self.start()
        try:
            yield self
        finally:
            self.stop()

    def start_history(self) -> None:
        """Start PyTorch's allocator history for memory_viz (each alloc/free, Python stacks)."""
        if not self.gpu:
            raise RuntimeError("PyTorch's memory history records the CUDA caching allocator; "
                               "it needs a GPU (this timeline is on CPU). Skip it on the CPU path.")
        torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python",
                                                 device=self.device)
        self._history = True

    def save_snapshot(self, path: str | Path) -> Path:
        """Stop the history and write it as a pickle that https://pytorch.org/memory_viz opens."""
        if not self._history:
            raise RuntimeError("no memory history recorded: call start_history() before the step")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)
        self._history = False
        return path

    def to_dict(self) -> dict[str, Any]:
        """Everything, JSON-able; "phases": each finished one's times and allocator peaks (GPU)."""
        with self._lock:
            samples = [dict(s) for s in self.samples]
        edges = [s for s in samples if s["event"] in ("begin", "end")]  # phases do not overlap
        phases = [{"name": e["phase"], "start": b["t"], "end": e["t"],
                   "peak_allocated": e.get("peak"), "peak_reserved": e.get("peak_reserved")}
                  for b, e in zip(edges, edges[1:]) if (b["event"], e["event"]) == ("begin", "end")]
        busy = self._sample_s
        return {"name": self.name, "device": str(self.device), "gpu": self.gpu,
                "capacity_bytes": self.capacity, "roles": list(ROLES),
                "sources": [{"role": r, "name": n} for r, n, _ in self.sources],
                "interval_s": self.interval_s, "phases": phases, "samples": samples,
                "sampler": {"ticks": self._ticks, "busy_s": round(busy, 6),
                            "mean_sample_ms": round(1e3 * busy / max(1, len(samples)), 4)}}


def move_optimizer_state(opt: torch.optim.Optimizer, device: str | torch.device) -> int:
    """Move Adam's moment tensors to device (to "cpu": into pinned host memory) and wait for the
    copies. Returns the bytes moved. Scalars such as Adam's step counter stay where they are."""
    dev, moved, devices = torch.device(device), 0, set()
    for st in opt.state.values():
        for k, v in st.items():
            if (not isinstance(v, torch.Tensor) or v.dim() == 0  # (Adam's step counter)
                    or v.device.type == dev.type and dev.index in (None, v.device.index)):
                continue  # a scalar, or there already ("cuda": any GPU)
            if dev.type == "cpu":  # v is on a GPU
                st[k] = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
                st[k].copy_(v, non_blocking=True)
            else:
                st[k] = v.to(dev, non_blocking=True)
            devices |= {v.device, st[k].device}  # each copy is queued on the source or destination
            moved += v.nbytes
    for d in devices:  # those GPUs, not the current one (a state on cuda:1, cuda:0 current)
        _sync(d)
    return moved
