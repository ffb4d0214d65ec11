"""``python -m labsupport bench memory``: one RLHF step under each memory strategy, and the
sampler's cost.

Records ``labsupport.experiments.strategies.run_strategy`` for the three strategies, prints each
peak-by-phase table, measures what the background sampler costs a step
(``strategies.measure_overhead``, which Lab 2 also calls) and writes
``results/memory_timeline.<machine>.json`` with its plot (Chapter 2 and Lab 2 read them). The table
and plots are ``labsupport.experiments.memory_report``'s, which Labs 2 and 10 use too.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict

from labsupport.course import hardware, progress, results
from labsupport.experiments.memory_report import format_peak_table, peak_bytes, plot_timelines
from labsupport.course.planner import GB
from labsupport.experiments.strategies import (CPU_CONFIG, GPU_CONFIG, STRATEGIES, STRATEGY_TEXT,
                                               measure_overhead,
                                   run_strategy)


def main(argv: list[str] | None = None) -> int:
    """`python -m labsupport bench memory`: record the three strategies, print peaks, save JSON +
    PNG."""
    p = argparse.ArgumentParser(prog="python -m labsupport bench memory", description=main.__doc__)
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--interval", type=float, default=0.02, help="allocator sampling interval (s), "
                                                                "GPU only; roles are counted at "
                                                                "phase edges and marks")
    p.add_argument("--repeats", type=int, default=5, help="step pairs for the overhead measurement "
                                                          "(0: skip)")
    p.add_argument("--no-snapshot", action="store_true", help="do not write the memory_viz "
                                                              "snapshot (GPU)")
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
        snap = results.RESULTS_DIR / (
            f"memory_timeline.{results.machine_tag()}.offloaded.snapshot.pickle"
        )
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
              f"{over['step_s_without']:.3f} s without a timeline, {over['step_s_with']:.3f} s "
              "with; "
              + (f"allocator every {a.interval * 1e3:.0f} ms; " if device == "cuda"
                 else "no sampler thread on CPU; ")
              + f"sampler thread busy {100 * over['sampler_busy_fraction']:.2f}% of the step)")
    if a.no_save:
        return 0
    fig = plot_timelines({f"{s} (peak {peaks[s] / unit:.2f} {u})": tls[s] for s in STRATEGIES},
                         unit=unit)
    data = {"device": device, "config": asdict(cfg), "params": infos["resident"]["params"],
            "strategies": {s: tls[s].to_dict() for s in STRATEGIES}, "peaks": peaks,
            "steps": infos, "overhead": over, "snapshot": snap.name if snap else None,
            "strategy_text": STRATEGY_TEXT}
    path = results.save_result("memory_timeline", data, figure=fig)
    print(f"wrote {path} and {path.with_suffix('.png')}" + (f" and {snap}" if snap else ""))
    return 0
