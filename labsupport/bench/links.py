"""``python -m labsupport bench links``: the bandwidth of each link a weight update can take.

On a GPU machine: a copy inside GPU 0, pinned and pageable host<->device copies, and GPU 0 to every
other GPU; on a CPU machine, a host memcpy. The measurement is
``labsupport.course.hardware.measure_links`` (Lab 1 calls it too); this command prints its table and
writes ``results/links.<machine>.json`` and a bar chart (Lab 1 plots the reference run's next to
this machine's; the planner's link presets quote them).
"""

from __future__ import annotations

import argparse
from typing import Any

from labsupport.course import results
from labsupport.course.hardware import links_table, measure_links


def plot_links(rows: list[dict[str, Any]], title: str = ""):
    """Horizontal bar chart of link bandwidths (log scale)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 0.45 * len(rows) + 1.2))
    ax.barh([r["link"] for r in rows], [r["gb_per_s"] for r in rows], color="#4C72B0")
    ax.set_xscale("log")
    ax.set_xlabel("GB/s (bytes moved per second)")
    ax.invert_yaxis()
    for i, r in enumerate(rows):
        ax.text(r["gb_per_s"], i, f" {r['gb_per_s']:.1f}", va="center", fontsize=8)
    ax.set_title(title or "Measured link bandwidths")
    fig.tight_layout()
    return fig


def main(argv: list[str]) -> int:
    """``python -m labsupport bench links [--size-mib N] [--iters K] [--no-save]``."""
    ap = argparse.ArgumentParser(prog="python -m labsupport bench links",
                                 description=measure_links.__doc__)
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    rows = measure_links(args.size_mib, args.iters)
    print(links_table(rows, ["link", "gb_per_s", "seconds", "note"]))
    if not args.no_save:
        fig = plot_links(rows, f"Link bandwidths ({results.machine_tag()})")
        path = results.save_result("links", {"size_mib": args.size_mib, "iters": args.iters,
                                             "rows": rows},
                                   figure=fig)
        print("wrote", path)
    return 0
