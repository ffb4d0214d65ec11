"""Reading a memory timeline (``labsupport.memory``): the peak-by-phase table and the plots that Labs 2 and 10,
Chapter 2 and ``bench memory`` show."""
from __future__ import annotations

from typing import Any

from labsupport.memory import ROLES, MemoryTimeline, peak_by_phase, peak_bytes, role_total

GB = 1e9
ROLE_COLORS = {"weights": "#4c72b0", "gradients": "#dd8452", "optimizer": "#c44e52", "kv_cache": "#55a868",
               "activations": "#8172b3", "other": "#b0b0b0"}


def _unit(unit: float) -> str:
    return "GB" if unit == GB else ("MB" if unit == 1e6 else f"x{unit:g} B")


def format_peak_table(tl: MemoryTimeline | dict[str, Any], unit: float = GB) -> str:
    """The peak-by-phase table as text (GB = 1e9 bytes; pass unit=1e6 for MB)."""
    u = _unit(unit)
    head = ["phase", "s", f"alloc peak {u}", f"reserved {u}", f"registered {u}"] + [r[:8] for r in ROLES]
    f = lambda v: "n/a (CPU)" if v is None else f"{v / unit:.3f}"  # noqa: E731
    cells = [head] + [[r["phase"], f"{r['seconds']:.3f}", f(r["peak_allocated"]), f(r["peak_reserved"]),
                       f(r["peak_roles"])] + [f(r["roles_at_peak"].get(k, 0)) for k in ROLES] for r in peak_by_phase(tl)]
    w = [max(len(str(c[i])) for c in cells) for i in range(len(head))]
    return "\n".join("  ".join(str(c).rjust(w[i]) if i else str(c).ljust(w[i]) for i, c in enumerate(row))
                     for row in cells)


def plot_timeline(tl: MemoryTimeline | dict[str, Any], ax: Any, title: str, unit: float = GB) -> None:
    """Stacked area of bytes by role over time, with phase bands, allocator lines (GPU), capacity, peak."""
    d, u = tl.to_dict() if isinstance(tl, MemoryTimeline) else tl, _unit(unit)
    rs = [s for s in d["samples"] if s.get("roles")]
    t = [s["t"] for s in rs]
    ax.stackplot(t, *[[s["roles"].get(r, 0) / unit for s in rs] for r in ROLES], labels=ROLES,
                 colors=[ROLE_COLORS[r] for r in ROLES], alpha=0.85, step="post")  # a value holds until the next sample
    top = max([role_total(s) for s in rs] + [0])
    if d["gpu"]:
        al = [s for s in d["samples"] if "allocated" in s]
        for key, lw, ls in (("allocated", 1.2, "-"), ("reserved", 1, "--")):
            ax.plot([s["t"] for s in al], [s[key] / unit for s in al], color="black", lw=lw, ls=ls, label=key)
        top = max([top] + [s["reserved"] for s in al])
        if any(s.get("host") for s in rs):
            ax.plot(t, [s.get("host", 0) / unit for s in rs], color=ROLE_COLORS["optimizer"], lw=1, ls=":",
                    label="in host memory")
    else:
        ax.text(0.99, 0.97, "CPU: allocator lines n/a\n(registered tensor bytes only)", transform=ax.transAxes,
                ha="right", va="top", fontsize=7, color="dimgray")
    span, level = (d["phases"][-1]["end"] - d["phases"][0]["start"]) if d["phases"] else 1.0, 0
    for i, ph in enumerate(d["phases"]):
        ax.axvspan(ph["start"], ph["end"], color="0.85" if i % 2 else "0.93", zorder=0)
        level = (level + 1) % 3 if ph["end"] - ph["start"] < 0.04 * span else 0  # stagger short phases' labels
        ax.text((ph["start"] + ph["end"]) / 2, 0.02 + 0.3 * level, ph["name"], transform=ax.get_xaxis_transform(),
                rotation=90, ha="center", va="bottom", fontsize=7,
                bbox=dict(boxstyle="square,pad=0.1", fc="white", ec="none", alpha=0.7))
    peak, cap = peak_bytes(d), d.get("capacity_bytes")
    ax.axhline(peak / unit, color="crimson", lw=0.8, ls=":")
    ax.annotate(f"peak {peak / unit:.3g} {u}", xy=(0.01, peak / unit), xycoords=("axes fraction", "data"),
                va="bottom", fontsize=8, color="crimson")
    if cap and cap <= 1.5 * max(top, 1):  # a capacity far above the data would flatten it
        ax.axhline(cap / unit, color="red", lw=1.5, label="GPU capacity")
    elif cap:
        ax.text(0.99, 0.97, f"GPU capacity {cap / unit:.1f} {u} (above this axis)", transform=ax.transAxes,
                ha="right", va="top", fontsize=7, color="red")
    ax.set(xlabel="time (s)", ylabel=f"{u} on {d['device']}")
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
