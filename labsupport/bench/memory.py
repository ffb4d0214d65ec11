"""``python -m labsupport bench memory``: one RLHF step under each memory strategy, and the sampler's cost.

Records ``labsupport.strategies.run_strategy`` for the three strategies, prints each peak-by-phase table,
measures what the background sampler costs a step (``measure_overhead``, which Lab 2 also calls) and
writes ``results/memory_timeline.<machine>.json`` with its plot (Chapter 2 and Lab 2 read them). The
table (``format_peak_table``) and the plots (``plot_timelines``) of a ``labsupport.memory.MemoryTimeline``
live here; Labs 2 and 7 draw their own timelines with them.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict
from typing import Any

import torch

from labsupport import hardware, progress, results
from labsupport.memory import ROLES, MemoryTimeline, peak_by_phase, peak_bytes, role_total
from labsupport.strategies import (CPU_CONFIG, GPU_CONFIG, STRATEGIES, STRATEGY_TEXT, StepConfig, make_state,
                                   register_roles, release_state, rlhf_step, run_strategy)

GB = 1e9
ROLE_COLORS = {"weights": "#4c72b0", "gradients": "#dd8452", "optimizer": "#c44e52", "kv_cache": "#55a868",
               "activations": "#8172b3", "other": "#b0b0b0"}


def measure_overhead(config: StepConfig | None = None, device: str | torch.device = "cpu", *, repeats: int = 5,
                     interval_s: float = 0.01) -> dict[str, float]:
    """Step time with the background sampler vs without any timeline (alternating, medians)."""
    state = make_state("kv_freed", config, device)
    try:
        rlhf_step(state)
        off, on, busy = [], [], []
        for _ in progress.bar(range(repeats), desc="sampler overhead: step pairs", unit="pair", leave=False):
            off.append(rlhf_step(state)["step_s"])
            tl = MemoryTimeline(state.device, interval_s=interval_s)
            register_roles(tl, state)
            with tl.sampling():
                on.append(rlhf_step(state, tl)["step_s"])
            busy.append(tl.to_dict()["sampler"]["busy_s"] / on[-1])
        m_off, m_on = statistics.median(off), statistics.median(on)
        return {"step_s_without": m_off, "step_s_with": m_on, "overhead": (m_on - m_off) / m_off,
                "sampler_busy_fraction": statistics.median(busy), "interval_s": interval_s,
                "repeats": repeats,
                "steps_without": off, "steps_with": on}
    finally:
        release_state(state)


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


def main(argv: list[str] | None = None) -> int:
    """`python -m labsupport bench memory`: record the three strategies, print peaks, save JSON + PNG."""
    p = argparse.ArgumentParser(prog="python -m labsupport bench memory", description=main.__doc__)
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--interval", type=float, default=0.02, help="allocator sampling interval (s), GPU only; roles are counted at phase edges and marks")
    p.add_argument("--repeats", type=int, default=5, help="step pairs for the overhead measurement (0: skip)")
    p.add_argument("--no-snapshot", action="store_true", help="do not write the memory_viz snapshot (GPU)")
    p.add_argument("--no-save", action="store_true", help="print only; write no result files")
    a = p.parse_args(argv)
    device = ("cuda" if hardware.gpu_count() else "cpu") if a.device == "auto" else a.device
    if device == "cuda":
        hardware.require_gpus(1, "bench memory --device cuda")
    cfg = GPU_CONFIG if device == "cuda" else CPU_CONFIG
    unit = GB if device == "cuda" else 1e6
    u = "GB" if unit == GB else "MB"
    print(f"RLHF step memory on {device}: {cfg}")

    snap = None
    if device == "cuda" and not a.no_snapshot and not a.no_save:
        snap = results.RESULTS_DIR / f"memory_timeline.{results.machine_tag()}.offloaded.snapshot.pickle"
    tls, infos = {}, {}
    for s in progress.bar(STRATEGIES, desc="bench memory", unit="strategy"):
        tls[s], infos[s] = run_strategy(s, cfg, device, interval_s=a.interval,
                                        snapshot=snap if s == "offloaded" else None)
        progress.write(f"\n== {s}: {STRATEGY_TEXT[s]}  (step {infos[s]['step_s']:.2f} s)")
        progress.write(format_peak_table(tls[s], unit))
    over = (measure_overhead(cfg, device, repeats=a.repeats, interval_s=a.interval)
            if a.repeats > 0 else None)

    peaks = {s: peak_bytes(tl) for s, tl in tls.items()}
    print(f"\npeak per strategy ({'allocator' if device == 'cuda' else 'registered tensors'}):")
    for s in STRATEGIES:
        print(f"  {s:10s} {peaks[s] / unit:8.3f} {u}")
    if over:
        print(f"sampler overhead: {100 * over['overhead']:+.2f}% of a step (median of {a.repeats}: "
              f"{over['step_s_without']:.3f} s without a timeline, {over['step_s_with']:.3f} s with; "
              + (f"allocator every {a.interval * 1e3:.0f} ms; " if device == "cuda" else "no sampler thread on CPU; ")
              + f"sampler thread busy {100 * over['sampler_busy_fraction']:.2f}% of the step)")
    if a.no_save:
        return 0
    fig = plot_timelines({f"{s} (peak {peaks[s] / unit:.2f} {u})": tls[s] for s in STRATEGIES}, unit=unit)
    data = {"device": device, "config": asdict(cfg), "params": infos["resident"]["params"],
            "strategies": {s: tls[s].to_dict() for s in STRATEGIES}, "peaks": peaks,
            "steps": infos, "overhead": over, "snapshot": snap.name if snap else None,
            "strategy_text": STRATEGY_TEXT}
    path = results.save_result("memory_timeline", data, figure=fig)
    print(f"wrote {path} and {path.with_suffix('.png')}" + (f" and {snap}" if snap else ""))
    return 0
