"""Where the bytes go across RLHF phases: a memory timeline recorder and its summaries.

``MemoryTimeline`` records phases (``with tl.phase("generate"): ...``), samples of PyTorch's CUDA caching
allocator (allocated, reserved, peak) at phase edges and from a background thread, and the bytes held by each
role (weights, gradients, optimizer, kv_cache, activations) counted from the tensors the lab registers (on CPU,
only these). Roles are counted only on the thread that runs the step (at phase edges and ``tl.sample()``):
reading ``p.grad`` or a tensor's storage from a second thread while autograd or ``zero_grad`` frees it
crashes the process (a segfault, seen on CPU with torch 2.13), so the background thread reads the allocator
only. ``move_optimizer_state`` offloads Adam's moments to host memory and back; ``format_peak_table`` and
``plot_timelines`` show a timeline. The RLHF step it records is ``labsupport.strategies``.
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

from labsupport.course.hardware import synchronize as _sync

ROLES = ("weights", "gradients", "optimizer", "kv_cache", "activations", "other")


# ---------------------------------------------------------------- what a registered source yields
def _tensors_of(role: str, obj: Any) -> Callable[[], Iterable[torch.Tensor]]:
    """A getter that lists the tensors of obj now (so later changes, e.g. a freed cache, show up)."""
    if isinstance(obj, torch.nn.Module):
        if role == "gradients":
            return lambda: [p.grad for p in obj.parameters() if p.grad is not None]
        return lambda: [*obj.parameters(), *obj.buffers()]
    if isinstance(obj, torch.optim.Optimizer):  # its state (register the model for its gradients)
        return lambda: [t for s in list(obj.state.values()) for t in list(s.values()) if isinstance(t, torch.Tensor)]
    if isinstance(obj, torch.Tensor):
        ref = weakref.ref(obj)  # do not keep a registered tensor alive
        return lambda: [t] if (t := ref()) is not None else []
    if isinstance(obj, (list, tuple, dict)):
        return lambda: list(obj.values()) if isinstance(obj, dict) else list(obj)
    if callable(obj):
        return obj
    raise TypeError(f"register() takes a Module, Optimizer, Tensor, list/tuple/dict of tensors or a callable "
                    f"returning tensors; found {type(obj).__name__}")


class MemoryTimeline:
    """Phases, allocator samples and bytes by role over time, for one device: ``tl.register("weights", model)``,
    then ``with tl.sampling(), tl.phase("generate"): ...``."""

    def __init__(self, device: str | torch.device, *, name: str = "", interval_s: float = 0.01) -> None:
        dev = torch.device(device)
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("MemoryTimeline(device='cuda') needs a CUDA GPU; found none. "
                                   "Use device='cpu' to count tensor bytes by role without the allocator.")
            dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
        self.device, self.gpu, self.name = dev, dev.type == "cuda", name
        self.capacity = torch.cuda.get_device_properties(dev).total_memory if self.gpu else None
        self.interval_s = interval_s  # the background thread's allocator reads (GPU only)
        self.samples: list[dict[str, Any]] = []
        self.phases: list[dict[str, Any]] = []
        self._sources: list[tuple[str, str, Callable]] = []  # (role, name, tensor getter)
        self._act_refs: list[weakref.ref] = []  # tensors saved for backward (track_activations)
        self._lock = threading.Lock()  # guards samples and _act_refs
        self._current, self._thread, self._stop = None, None, threading.Event()  # phase, sampler thread
        self._ticks, self._sample_s, self._history = 0, 0.0, False
        self._t0 = time.perf_counter()
        self.register("activations", self._live_activations, name="saved for backward")

    # ------------------------------------------------------------ registration
    def register(self, role: str, obj: Any, name: str | None = None) -> None:
        """Count obj's tensors under role: a Module (parameters and buffers; for "gradients" their .grad), an
        Optimizer (its state), a Tensor, or a list/dict/callable of tensors (read at every sample)."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}: expected one of {ROLES}")
        self._sources.append((role, name or type(obj).__name__, _tensors_of(role, obj)))

    def unregister(self, name: str) -> None:
        """Stop counting the source registered under this name."""
        before = len(self._sources)
        self._sources = [s for s in self._sources if s[1] != name]
        if len(self._sources) == before:
            raise KeyError(f"no source named {name!r}; registered: {[n for _, n, _ in self._sources]}")

    def forget_sources(self) -> None:
        """Drop the registered objects (keeping what was recorded): a finished timeline keeps nothing alive."""
        self._sources = [(role, name, lambda: []) for role, name, _ in self._sources]

    @contextlib.contextmanager
    def track_activations(self) -> Iterator[None]:
        """Count tensors that autograd saves for backward (role "activations") while they are alive."""
        def pack(t: torch.Tensor) -> torch.Tensor:
            with self._lock:
                self._act_refs.append(weakref.ref(t))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    def _live_activations(self) -> list[torch.Tensor]:
        with self._lock:
            self._act_refs = [r for r in self._act_refs if r() is not None]
            refs = list(self._act_refs)
        return [t for r in refs if (t := r()) is not None]

    def role_bytes(self) -> tuple[dict[str, int], int]:
        """Bytes per role on this device, and registered bytes sitting in host memory (offloaded). Each storage
        counts once, under the first role in ROLES order that holds it (a weight saved for backward stays a weight)."""
        out, host, seen = dict.fromkeys(ROLES, 0), 0, set()
        for role, _, tensors in sorted(self._sources, key=lambda s: ROLES.index(s[0])):  # stable within a role
            for t in tensors():
                if not isinstance(t, torch.Tensor):
                    continue
                st = t.untyped_storage()
                key = (t.device.type, t.device.index, st.data_ptr())
                if st.data_ptr() == 0 or key in seen:  # no memory behind it (empty, meta), or counted already
                    continue
                seen.add(key)
                if t.device == self.device:
                    out[role] += st.nbytes()
                elif t.device.type == "cpu":
                    host += st.nbytes()
        return out, host

    # ------------------------------------------------------------ sampling
    def sample(self, event: str = "mark", roles: bool = True) -> dict[str, Any]:
        """Record one sample now: time, phase, allocator counters (GPU) and bytes by role. Call it from the thread
        that runs the step (e.g. after a forward pass, where activations peak): counting roles reads tensors."""
        t_start = time.perf_counter()
        s: dict[str, Any] = {"t": t_start - self._t0, "event": event,
                             "phase": self._current["name"] if self._current else None}
        if self.gpu:  # one call to the allocator's stats (memory_allocated() & co. each flatten all of them)
            st = torch.cuda.memory_stats_as_nested_dict(self.device)
            s["allocated"] = st["allocated_bytes"]["all"]["current"]
            s["reserved"] = st["reserved_bytes"]["all"]["current"]
            s["peak"] = st["allocated_bytes"]["all"]["peak"]
        if roles:
            r, host = self.role_bytes()
            if self.gpu:  # what the allocator holds that no registered tensor explains
                r["other"] = max(0, s["allocated"] - sum(v for k, v in r.items() if k != "other"))
            s["roles"], s["host"] = r, host
        with self._lock:
            self.samples.append(s)
            self._sample_s += time.perf_counter() - t_start
        return s

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample("tick", roles=False)  # the allocator's counters only: never touch the step's tensors here
            self._ticks += 1

    def start(self) -> None:
        """Start the background sampler: the allocator's counters every interval_s seconds. On CPU there is no
        allocator to read, so no thread starts: the timeline has its phase edges and marks."""
        if self._thread is not None:
            raise RuntimeError("the sampler is already running; call stop() first")
        if not self.gpu:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="memory-timeline", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the background sampler and wait for its thread to end."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(f"memory sampler thread did not stop within {timeout_s} s")
        self._thread = None

    @property
    def sampling_active(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @contextlib.contextmanager
    def sampling(self) -> Iterator["MemoryTimeline"]:
        """Run the background sampler for the duration of the block."""
        self.start()
        try:
            yield self
        finally:
            self.stop()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Mark a phase; samples at both edges; on GPU the phase's allocator peak is recorded."""
        if self._current is not None:
            raise RuntimeError(f"phase {name!r} started inside phase {self._current['name']!r}; "
                               "phases must not overlap: end the first one before starting the next")
        if self.gpu:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        ph: dict[str, Any] = {"name": name, "start": time.perf_counter() - self._t0}
        self._current = ph
        self.sample("begin")
        try:
            yield
        finally:
            if self.gpu:
                torch.cuda.synchronize(self.device)
                ph["peak_allocated"] = torch.cuda.max_memory_allocated(self.device)
                ph["peak_reserved"] = torch.cuda.max_memory_reserved(self.device)
            self.sample("end")
            ph["end"] = time.perf_counter() - self._t0
            self._current = None
            self.phases.append(ph)

    # ------------------------------------------------------------ PyTorch memory history
    def start_history(self) -> None:
        """Start PyTorch's allocator history (every alloc/free with a Python stack) for memory_viz."""
        if not self.gpu:
            raise RuntimeError("PyTorch's memory history records the CUDA caching allocator; "
                               "it needs a GPU (this timeline is on CPU). Skip it on the CPU path.")
        torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python", device=self.device)
        self._history = True

    def save_snapshot(self, path: str | Path) -> Path:
        """Write the history as a pickle that https://pytorch.org/memory_viz opens (drag and drop), and stop it."""
        if not self._history:
            raise RuntimeError("no memory history is being recorded; call start_history() before the step")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)
        self._history = False
        return path

    # ------------------------------------------------------------ summaries
    def to_dict(self) -> dict[str, Any]:
        """Everything recorded, as plain JSON-able data (what plots and save_result take)."""
        with self._lock:
            samples = [dict(s) for s in self.samples]
        return {"name": self.name, "device": str(self.device), "gpu": self.gpu, "capacity_bytes": self.capacity,
                "roles": list(ROLES), "sources": [{"role": r, "name": n} for r, n, _ in self._sources],
                "interval_s": self.interval_s,
                "phases": [dict(p) for p in self.phases], "samples": samples,
                "sampler": {"ticks": self._ticks, "busy_s": round(self._sample_s, 6),
                            "mean_sample_ms": round(1e3 * self._sample_s / max(1, len(samples)), 4)}}


def _as_dict(tl: MemoryTimeline | dict[str, Any]) -> dict[str, Any]:
    return tl.to_dict() if isinstance(tl, MemoryTimeline) else tl


def role_total(sample: dict[str, Any]) -> int:
    """Sum of role bytes in one sample (0 if it carried no role counts)."""
    return sum((sample.get("roles") or {}).values())


def peak_by_phase(tl: MemoryTimeline | dict[str, Any]) -> list[dict[str, Any]]:
    """One row per phase: {phase, seconds, peak_allocated, peak_reserved (GPU), peak_roles, roles_at_peak}."""
    d = _as_dict(tl)
    rows = []
    for ph in d["phases"]:
        inside = [s for s in d["samples"] if s.get("roles") and ph["start"] <= s["t"] <= ph["end"]]
        top = max(inside, key=role_total, default=None)
        rows.append({"phase": ph["name"], "seconds": ph["end"] - ph["start"],
                     "peak_allocated": ph.get("peak_allocated"), "peak_reserved": ph.get("peak_reserved"),
                     "peak_roles": role_total(top) if top else 0, "roles_at_peak": dict(top["roles"]) if top else {}})
    return rows


def peak_bytes(tl: MemoryTimeline | dict[str, Any]) -> int:
    """The timeline's peak: the allocator's on GPU, the largest registered role total on CPU."""
    d = _as_dict(tl)
    if d["gpu"]:
        return max([p.get("peak_allocated") or 0 for p in d["phases"]] + [s.get("peak", 0) for s in d["samples"]])
    return max((role_total(s) for s in d["samples"]), default=0)


# ---------------------------------------------------------------- moving state off the GPU
def move_optimizer_state(opt: torch.optim.Optimizer, device: str | torch.device) -> int:
    """Move Adam's moment tensors to device (to "cpu": into pinned host memory) and wait for the copies.
    Returns the bytes moved. Scalars such as Adam's step counter stay where they are."""
    dev, moved, devices = torch.device(device), 0, set()
    for st in opt.state.values():
        for k, v in st.items():
            if not isinstance(v, torch.Tensor) or v.dim() == 0 or _on(v, dev):
                continue
            if dev.type == "cpu":  # v is on a GPU
                st[k] = torch.empty(v.shape, dtype=v.dtype, pin_memory=True).copy_(v, non_blocking=True)
            else:
                st[k] = v.to(dev, non_blocking=True)
            devices |= {v.device, st[k].device}  # each copy is queued on the source or the destination GPU
            moved += v.nbytes
    for d in devices:  # wait for those GPUs, not the current one (a state on cuda:1 moved while cuda:0 is current)
        _sync(d)
    return moved


def _on(t: torch.Tensor, dev: torch.device) -> bool:
    """Whether t is already on dev ("cuda" without an index: any GPU)."""
    return t.device.type == dev.type and (dev.index is None or t.device.index == dev.index)


# ---------------------------------------------------------------- tables and plots
GB = 1e9
ROLE_COLORS = {"weights": "#4c72b0", "gradients": "#dd8452", "optimizer": "#c44e52", "kv_cache": "#55a868",
               "activations": "#8172b3", "other": "#b0b0b0"}


def format_peak_table(tl: MemoryTimeline | dict[str, Any], unit: float = GB) -> str:
    """The peak-by-phase table as text (GB = 1e9 bytes; pass unit=1e6 for MB)."""
    u = "GB" if unit == GB else ("MB" if unit == 1e6 else f"x{unit:g} B")
    head = ["phase", "s", f"alloc peak {u}", f"reserved {u}", f"registered {u}"] + [r[:8] for r in ROLES]
    rows = []
    for r in peak_by_phase(tl):
        f = lambda v: "n/a (CPU)" if v is None else f"{v / unit:.3f}"
        rows.append([r["phase"], f"{r['seconds']:.3f}", f(r["peak_allocated"]), f(r["peak_reserved"]),
                     f"{r['peak_roles'] / unit:.3f}"] + [f"{r['roles_at_peak'].get(k, 0) / unit:.3f}" for k in ROLES])
    cells = [head] + rows
    w = [max(len(str(c[i])) for c in cells) for i in range(len(head))]
    return "\n".join("  ".join(str(c).rjust(w[i]) if i else str(c).ljust(w[i]) for i, c in enumerate(row))
                     for row in cells)


def plot_timeline(tl: MemoryTimeline | dict[str, Any], ax: Any, title: str, unit: float = GB) -> None:
    """Stacked area of bytes by role over time, with phase bands, allocator lines (GPU), capacity, peak."""
    d = tl.to_dict() if isinstance(tl, MemoryTimeline) else tl
    u = "GB" if unit == GB else ("MB" if unit == 1e6 else "bytes")
    rs = [s for s in d["samples"] if s.get("roles")]
    t = [s["t"] for s in rs]
    ax.stackplot(t, *[[s["roles"].get(r, 0) / unit for s in rs] for r in ROLES], labels=ROLES,
                 colors=[ROLE_COLORS[r] for r in ROLES], alpha=0.85, step="post")  # a value holds until the next sample
    top = max([role_total(s) for s in rs] + [0])
    if d["gpu"]:
        al = [s for s in d["samples"] if "allocated" in s]
        ax.plot([s["t"] for s in al], [s["allocated"] / unit for s in al], color="black", lw=1.2, label="allocated")
        ax.plot([s["t"] for s in al], [s["reserved"] / unit for s in al], color="black", lw=1, ls="--",
                label="reserved")
        top = max([top] + [s["reserved"] for s in al])
    else:
        ax.text(0.99, 0.97, "CPU: allocator lines n/a\n(registered tensor bytes only)", transform=ax.transAxes,
                ha="right", va="top", fontsize=7, color="dimgray")
    if d["gpu"] and any(s.get("host") for s in rs):
        ax.plot(t, [s.get("host", 0) / unit for s in rs], color=ROLE_COLORS["optimizer"], lw=1, ls=":",
                label="in host memory")
    span = (d["phases"][-1]["end"] - d["phases"][0]["start"]) if d["phases"] else 1.0
    level = 0
    for i, ph in enumerate(d["phases"]):
        ax.axvspan(ph["start"], ph["end"], color="0.85" if i % 2 else "0.93", zorder=0)
        narrow = (ph["end"] - ph["start"]) < 0.04 * span  # stagger labels of short neighbouring phases
        level = (level + 1) % 3 if narrow else 0
        ax.text((ph["start"] + ph["end"]) / 2, 0.02 + 0.3 * level, ph["name"], transform=ax.get_xaxis_transform(),
                rotation=90, ha="center", va="bottom", fontsize=7,
                bbox=dict(boxstyle="square,pad=0.1", fc="white", ec="none", alpha=0.7))
    peak = peak_bytes(d)
    ax.axhline(peak / unit, color="crimson", lw=0.8, ls=":")
    ax.annotate(f"peak {peak / unit:.3g} {u}", xy=(0.01, peak / unit), xycoords=("axes fraction", "data"),
                va="bottom", fontsize=8, color="crimson")
    cap = d.get("capacity_bytes")
    if cap and cap <= 1.5 * max(top, 1):  # a capacity far above the data would flatten it
        ax.axhline(cap / unit, color="red", lw=1.5, label="GPU capacity")
    elif cap:
        ax.text(0.99, 0.97, f"GPU capacity {cap / unit:.1f} {u} (above this axis)", transform=ax.transAxes,
                ha="right", va="top", fontsize=7, color="red")
    ax.set_xlabel("time (s)")
    ax.set_ylabel(f"{u} on {d['device']}")
    ax.set_title(title, fontsize=10)


def plot_timelines(timelines: dict[str, MemoryTimeline | dict[str, Any]], *, unit: float = GB) -> Any:
    """Timelines side by side under their titles, with a shared y axis, so the peaks compare at a glance."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(timelines), figsize=(4.6 * len(timelines), 4), sharey=True, squeeze=False)
    for i, (ax, (title, tl)) in enumerate(zip(axes[0], timelines.items())):
        plot_timeline(tl, ax, title, unit)
        if i:
            ax.set_ylabel("")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig
