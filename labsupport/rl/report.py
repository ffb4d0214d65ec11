"""Reading a run's results: plots (curves, Gantt timelines, per-phase breakdown, the notebook's live
plot), the scalar summary, peak memory per phase and the text table."""

from __future__ import annotations

from typing import Any

from labsupport.rl.spans import PHASES

COLORS = {"generate": "tab:blue", "score": "tab:purple", "train": "tab:orange", "sync": "tab:red",
          "wake": "tab:green", "sleep": "tab:olive", "offload": "tab:brown", "idle": "0.85",
          "eval": "0.6"}


def plot_curves(results: dict[str, dict[str, Any]], x: str = "step", ax=None):
    """Held-out accuracy (solid) and batch reward (dotted) per architecture, against steps or wall
    time."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    for i, (arch, d) in enumerate(results.items()):
        color = f"C{i}"
        xs = [c["step"] if x == "step" else c["t"] - d["curve"][0]["t"] for c in d["curve"]]
        ax.plot(xs, [c["eval_acc"] for c in d["curve"]], color=color,
                label=f"{arch}: held-out accuracy")
        if x == "step":
            ax.plot([s["step"] + 1 for s in d["steps"]], [s["reward"] for s in d["steps"]], ":",
                    color=color, label=f"{arch}: batch reward")
    ax.set_xlabel("step" if x == "step" else "wall time since the first step (s)")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return ax


def draw_live(ax, arch: str, engine: str, steps: list[dict[str, Any]], curve: list[dict[str, Any]],
              total: int) -> None:
    """What :func:`~labsupport.rl.loop.run` redraws in a notebook after each step: batch reward and
    held-out accuracy so far."""
    plot_curves({arch: {"curve": curve, "steps": steps}}, "step", ax)
    ax.set_xlim(0, total)
    ax.set_title(f"{arch} ({engine} engine): step {len(steps)} of {total}", fontsize=9)


def plot_timeline(data: dict[str, Any], ax=None, steps: tuple[int, int] | None = None,
                  title: str | None = None):
    """Gantt chart of one run: a row per lane (trainer, engine), a bar per span, coloured by
    phase."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 1.8))
    lo, hi = steps or (0, len(data["steps"]))
    evs = [e for e in data["events"] if lo <= e["step"] < hi or (e["phase"] == "eval"
                                                                 and lo < e["step"] <= hi)]
    lanes = ["engine", "trainer"]
    for y, lane in enumerate(lanes):
        for e in evs:
            if e["lane"] == lane and e["end"] > e["start"]:
                phase = e["phase"]
                ax.broken_barh([(e["start"], e["end"] - e["start"])], (y - 0.4, 0.8),
                               color=COLORS[phase], edgecolor="none" if phase == "idle" else "k",
                               linewidth=0.3)
    ax.set_yticks(range(len(lanes)), lanes)
    if evs:
        ax.set_xlim(min(e["start"] for e in evs), max(e["end"] for e in evs))
    ax.set_xlabel("wall time (s)")
    ax.set_title(title or f"{data['arch']} ({data['engine']} engine, {data['devices']['trainer']} "
                          f"/ {data['devices']['engine']}): steps {lo}-{hi - 1}", fontsize=9)
    ax.legend(handles=[Patch(color=COLORS[p], label=p) for p in PHASES], fontsize=7, ncol=6,
              loc="upper center", bbox_to_anchor=(0.5, -0.45), frameon=False)
    return ax


def plot_timelines(results: dict[str, dict[str, Any]], steps: tuple[int, int] = (1, 6)):
    """The architectures' timelines one above the other, on the same time scale (same number of
    steps)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(9, 2.3 * len(results)), squeeze=False)
    width = 0.0
    for ax, d in zip(axes[:, 0], results.values()):
        plot_timeline(d, ax, steps)
        x0, x1 = ax.get_xlim()
        width = max(width, x1 - x0)
    for ax in axes[:, 0]:
        x0, _ = ax.get_xlim()
        ax.set_xlim(x0, x0 + width)
    fig.tight_layout()
    return fig


def plot_breakdown(results: dict[str, dict[str, Any]], ax=None):
    """Mean seconds per step in each phase, stacked, for the trainer and the engine of each
    architecture."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3))
    labels, bottoms = [], []
    i = 0
    for arch, d in results.items():
        for lane in ("trainer", "engine"):
            b = 0.0
            for p in PHASES:
                # (runs recorded before a phase existed)
                v = d["mean_breakdown"][lane].get(p, 0.0) * 1e3
                ax.bar(i, v, bottom=b, color=COLORS[p], label=p if i == 0 else None, edgecolor="k",
                       linewidth=0.3)
                b += v
            labels.append(f"{arch}\n{lane}")
            bottoms.append(b)
            i += 1
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("ms per step")
    ax.legend(fontsize=7, ncol=3)
    return ax


def summary(data: dict[str, Any]) -> dict[str, Any]:
    """The scalar facts of one run (what the book and the lab's table quote)."""
    b = data["mean_breakdown"]
    return {"engine": data["engine"], "steps": data["steps_done"], "s_per_step": data["s_per_step"],
            "loop_s": data["loop_s"], "setup_s": data["setup_s"],
            "initial_acc": data["initial_acc"], "final_acc": data["final_acc"],
            "engine_final_acc": data["engine_final_acc"], "mean_staleness": data["mean_staleness"],
            **{f"{lane}_{p}_s": b[lane].get(p, 0.0) for lane in ("trainer", "engine")
               for p in PHASES}}


def peak_memory(data: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Peak bytes per phase of a GPU run's first ``memory_steps`` steps: ``device_used`` (the whole
    GPU, vLLM's engine process included, sampled after each trainer phase and engine op) and
    ``trainer_allocated`` (torch.cuda.max_memory_allocated of the trainer's process inside each
    phase)."""
    used: dict[str, int] = {}
    for u in data.get("device_memory") or []:
        key = f"{u['lane']}: {u['after']}"
        used[key] = max(used.get(key, 0), u["bytes"])
    alloc: dict[str, int] = {}
    for ph in (data.get("memory") or {}).get("phases", []):
        if ph.get("peak_allocated") is not None:
            alloc[ph["name"]] = max(alloc.get(ph["name"], 0), ph["peak_allocated"])
    return {"device_used": used, "trainer_allocated": alloc}


def sleep_peaks(data: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The :func:`peak_memory` records of a co-located GPU run with the engine asleep and awake, as
    ``python -m labsupport rl`` records them: the main run's, and its second, short run's with the
    other sleep setting."""
    main, slept = data.get("peak_memory"), data.get("engine_sleeps", True)
    other = (data.get("no_sleep") if slept else data.get("asleep")) or {}
    return (main, other.get("peak_memory")) if slept else (other.get("peak_memory"), main)


def runs_table(results: dict[str, dict[str, Any]]) -> str:
    """One line per architecture: time per step, where it goes, and the accuracy reached."""
    head = (f"{'arch':14s} {'engine':12s} {'ms/step':>8s} {'gen':>6s} {'train':>6s} {'sync':>6s} "
            f"{'t.idle':>6s} {'e.idle':>6s} {'stale':>5s} {'acc0':>5s} {'acc':>5s}")
    lines = [head]
    for arch, d in results.items():
        b = d["mean_breakdown"]
        lines.append(f"{arch:14s} {d['engine']:12s} {d['s_per_step'] * 1e3:8.1f} "
                     f"{b['engine']['generate'] * 1e3:6.1f} {b['trainer']['train'] * 1e3:6.1f} "
                     f"{b['trainer']['sync'] * 1e3:6.1f} {b['trainer']['idle'] * 1e3:6.1f} "
                     f"{b['engine']['idle'] * 1e3:6.1f} {d['mean_staleness']:5.2f} "
                     f"{d['initial_acc']:5.2f} {d['final_acc']:5.2f}")
    return "\n".join(lines)
