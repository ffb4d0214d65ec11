"""Reading memory numbers: a memory timeline's peaks, table and plots (``labsupport.memory``; Labs 2
and 10, Chapter 2, ``bench memory``) and the planner's tables (``labsupport.course.planner``;
``python -m labsupport plan``). Plain data in, text or figures out: nothing here needs torch."""
from __future__ import annotations

from typing import Any

from labsupport.course.planner import GB, LayoutPlan, zero_table

ROLE_COLORS = {"weights": "#4c72b0", "gradients": "#dd8452", "optimizer": "#c44e52",
               "kv_cache": "#55a868",
               # a timeline's roles, in its "roles" order
               "activations": "#8172b3", "other": "#b0b0b0"}


def _as_dict(tl: Any) -> dict[str, Any]:
    """A timeline's data: a ``MemoryTimeline``'s ``to_dict()``, or that dict itself (e.g. read from
    results/)."""
    return tl if isinstance(tl, dict) else tl.to_dict()


def role_total(sample: dict[str, Any]) -> int:
    """Sum of role bytes in one sample (0 if it carried no role counts)."""
    return sum((sample.get("roles") or {}).values())


def peak_by_phase(tl: Any) -> list[dict[str, Any]]:
    """One row per phase: {phase, seconds, peak_allocated, peak_reserved (GPU), peak_roles,
    roles_at_peak}."""
    d = _as_dict(tl)
    rows = []
    for ph in d["phases"]:
        inside = [s for s in d["samples"] if s.get("roles") and ph["start"] <= s["t"] <= ph["end"]]
        top = max(inside, key=role_total, default=None)
        rows.append({"phase": ph["name"], "seconds": ph["end"] - ph["start"],
                     "peak_allocated": ph.get("peak_allocated"),
                     "peak_reserved": ph.get("peak_reserved"), "peak_roles": role_total(top) if top
                     else 0, "roles_at_peak": dict(top["roles"]) if top else {}})
    return rows


def peak_bytes(tl: Any) -> int:
    """The timeline's peak: the allocator's on GPU, the largest registered role total on CPU."""
    d = _as_dict(tl)
    if d["gpu"]:
        return max([p.get("peak_allocated") or 0 for p in d["phases"]] + [s.get("peak", 0)
                                                                          for s in d["samples"]])
    return max((role_total(s) for s in d["samples"]), default=0)


# ---------------------------------------------------------------- the planner's tables
def fmt_gb(x: float) -> str:
    return f"{x / GB:,.2f}" if x < 100 * GB else f"{x / GB:,.1f}"


def format_table(rows: list[list], header: list[str]) -> str:
    """Plain-text table, the first column left-aligned and the others right-aligned (what the CLI
    prints)."""
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "  ".join(c.rjust(w) if i else c.ljust(w) for i,
                               (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in cells[1:]])


def zero_report(params: float, n_gpus: int) -> str:
    names = ["0 baseline", "1 P_os", "2 P_os+g", "3 P_os+g+p"]
    rows = [[names[s], fmt_gb(z.weights), fmt_gb(z.grads), fmt_gb(z.optimizer), fmt_gb(z.total)]
            for s, z in enumerate(zero_table(params, n_gpus))]
    return (f"ZeRO model states per GPU: {params / 1e9:g}B params, {n_gpus} GPUs, mixed-precision "
            "Adam (2+2+12 = 16 bytes/param), GB = 1e9\n"
            + format_table(rows, ["stage", "weights GB", "grads GB", "optimizer GB", "total GB"]))


def layout_report(plan: LayoutPlan, gpu_bytes: float | None = None) -> str:
    rows = []
    for g in plan.groups:
        for ph, comps in g.phases.items():
            # (no row for a model left out)
            rows += [[g.name, g.n_gpus, ph, c, fmt_gb(v)] for c, v in comps.items() if v]
            rows.append([g.name, g.n_gpus, ph, "= total", fmt_gb(sum(comps.values()))])
        if g.host_bytes_per_gpu:
            rows.append([g.name, g.n_gpus, "(host)", "offloaded per GPU",
                         fmt_gb(g.host_bytes_per_gpu)])
    out = f"layout {plan.layout}: {plan.n_gpus} GPUs, peak {fmt_gb(plan.peak)} GB per GPU"
    if gpu_bytes:
        out += f" -> {'fits' if plan.fits(gpu_bytes) else 'does NOT fit'} in {fmt_gb(gpu_bytes)} GB"
    return out + "\n" + format_table(rows, ["group", "GPUs", "phase", "component", "GB/GPU"])


# ---------------------------------------------------------------- a timeline's table and plots
def _unit(unit: float) -> str:
    return "GB" if unit == GB else ("MB" if unit == 1e6 else f"x{unit:g} B")


def format_peak_table(tl: Any, unit: float = GB) -> str:
    """The peak-by-phase table as text (GB = 1e9 bytes; pass unit=1e6 for MB)."""
    d, u = _as_dict(tl), _unit(unit)
    f = lambda v: "n/a (CPU)" if v is None else f"{v / unit:.3f}"  # noqa: E731
    rows = [[r["phase"], f"{r['seconds']:.3f}", f(r["peak_allocated"]), f(r["peak_reserved"]),
             f(r["peak_roles"])]
            + [f(r["roles_at_peak"].get(k, 0)) for k in d["roles"]] for r in peak_by_phase(d)]
    head = ["phase", "s", f"alloc peak {u}", f"reserved {u}", f"registered {u}"] + [
        r[:8] for r in d["roles"]
    ]
    return format_table(rows, head)


def plot_timeline(tl: Any, ax: Any, title: str, unit: float = GB) -> None:
    """Stacked area of bytes by role over time, with phase bands, allocator lines (GPU), capacity,
    peak."""
    d, u = _as_dict(tl), _unit(unit)
    rs, roles = [s for s in d["samples"] if s.get("roles")], d["roles"]
    t = [s["t"] for s in rs]
    ax.stackplot(t, *[[s["roles"].get(r, 0) / unit for s in rs] for r in roles], labels=roles,
                 # a value holds until the next sample
                 colors=[ROLE_COLORS[r] for r in roles], alpha=0.85, step="post")
    top = max([role_total(s) for s in rs] + [0])
    if d["gpu"]:
        al = [s for s in d["samples"] if "allocated" in s]
        for key, lw, ls in (("allocated", 1.2, "-"), ("reserved", 1, "--")):
            ax.plot([s["t"] for s in al], [s[key] / unit for s in al], color="black", lw=lw, ls=ls,
                    label=key)
        top = max([top] + [s["reserved"] for s in al])
        if any(s.get("host") for s in rs):
            ax.plot(t, [s.get("host", 0) / unit for s in rs], color=ROLE_COLORS["optimizer"], lw=1,
                    ls=":", label="in host memory")
    else:
        ax.text(0.99, 0.97, "CPU: allocator lines n/a\n(registered tensor bytes only)",
                transform=ax.transAxes, ha="right", va="top", fontsize=7, color="dimgray")
    span, level = (d["phases"][-1]["end"] - d["phases"][0]["start"]) if d["phases"] else 1.0, 0
    for i, ph in enumerate(d["phases"]):
        ax.axvspan(ph["start"], ph["end"], color="0.85" if i % 2 else "0.93", zorder=0)
        # stagger short phases' labels
        level = (level + 1) % 3 if ph["end"] - ph["start"] < 0.04 * span else 0
        ax.text((ph["start"] + ph["end"]) / 2, 0.02 + 0.3 * level, ph["name"],
                transform=ax.get_xaxis_transform(), rotation=90, ha="center", va="bottom",
                fontsize=7, bbox=dict(boxstyle="square,pad=0.1", fc="white", ec="none", alpha=0.7))
    peak, cap = peak_bytes(d), d.get("capacity_bytes")
    ax.axhline(peak / unit, color="crimson", lw=0.8, ls=":")
    ax.annotate(f"peak {peak / unit:.3g} {u}", xy=(0.01, peak / unit), xycoords=("axes fraction",
                                                                                 "data"),
                va="bottom", fontsize=8, color="crimson")
    if cap and cap <= 1.5 * max(top, 1):  # a capacity far above the data would flatten it
        ax.axhline(cap / unit, color="red", lw=1.5, label="GPU capacity")
    elif cap:
        ax.text(0.99, 0.97, f"GPU capacity {cap / unit:.1f} {u} (above this axis)",
                transform=ax.transAxes, ha="right", va="top", fontsize=7, color="red")
    ax.set(xlabel="time (s)", ylabel=f"{u} on {d['device']}")
    ax.set_title(title, fontsize=10)


def plot_timelines(timelines: dict[str, Any], *, unit: float = GB) -> Any:
    """Timelines side by side under their titles, with a shared y axis, so the peaks compare at a
    glance."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(timelines), figsize=(4.6 * len(timelines), 4), sharey=True,
                             squeeze=False)
    for i, (ax, (title, tl)) in enumerate(zip(axes[0], timelines.items())):
        plot_timeline(tl, ax, title, unit)
        if i:
            ax.set_ylabel("")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig
