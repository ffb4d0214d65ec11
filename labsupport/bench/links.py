"""``python -m labsupport bench links``: the bandwidth of each link a weight update can take.

On a GPU machine: a copy inside GPU 0, pinned and pageable host<->device copies, and GPU 0 to every other
GPU; on a CPU machine, a host memcpy. Prints a table and writes ``results/links.<machine>.json`` and a bar
chart (Lab 1 plots the reference run's next to this machine's; the planner's link presets quote them).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from labsupport import results
from labsupport.hardware import gpu_count


def _time(fn, iters: int, sync) -> float:
    """Median seconds of ``fn`` over ``iters`` runs after one warm-up."""
    fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def measure_links(size_mib: int = 256, iters: int = 5) -> list[dict[str, Any]]:
    """Bandwidth of the links a weight update can take, in GB/s (1e9 bytes/s) of bytes moved.

    GPU: device copy, pinned and pageable host<->device, and GPU-to-GPU copies. CPU: memcpy.
    """
    nbytes = size_mib << 20
    rows: list[dict[str, Any]] = []

    def add(link: str, src: torch.Tensor, dst: torch.Tensor, sync, note: str = "") -> None:
        sec = _time(lambda: dst.copy_(src, non_blocking=True), iters, sync)
        rows.append({"link": link, "bytes": nbytes, "seconds": sec, "gb_per_s": nbytes / sec / 1e9, "note": note})

    n = gpu_count()
    if n == 0:
        a = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
        b = torch.empty_like(a)
        add("host memcpy (CPU)", a, b, lambda: None, "torch copy_ on CPU tensors")
        return rows
    sync = torch.cuda.synchronize
    d0 = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0").fill_(1)
    d0b = torch.empty_like(d0)
    add("device copy (GPU0)", d0, d0b, sync, "bytes copied; HBM traffic is twice this")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    pageable = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    add("host->device pinned", pinned, d0b, sync)
    add("device->host pinned", d0, pinned, sync)
    add("host->device pageable", pageable, d0b, sync)
    add("device->host pageable", d0, pageable, sync)
    for j in range(1, n):
        dj = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{j}")
        add(f"GPU0->GPU{j} copy", d0, dj, sync, "peer copy" if torch.cuda.can_device_access_peer(0, j) else "via host")
        del dj
    return rows


def links_table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    """A plain fixed-width table (benchmarks print these)."""
    def fmt(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    line = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths))  # noqa: E731
    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line(r) for r in cells])


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
    ap = argparse.ArgumentParser(prog="python -m labsupport bench links", description=measure_links.__doc__)
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    rows = measure_links(args.size_mib, args.iters)
    print(links_table(rows, ["link", "gb_per_s", "seconds", "note"]))
    if not args.no_save:
        fig = plot_links(rows, f"Link bandwidths ({results.machine_tag()})")
        path = results.save_result("links", {"size_mib": args.size_mib, "iters": args.iters, "rows": rows},
                                   figure=fig)
        print("wrote", path)
    return 0
