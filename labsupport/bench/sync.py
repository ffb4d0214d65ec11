"""``python -m labsupport bench sync``: how fast ``labsupport.broadcast`` moves a transformer's
weights.

For each model size (a Qwen2-shaped bf16 state) every rank of one group measures a raw single-buffer
broadcast of the same bytes (the ceiling), per-tensor broadcast, and each bucket size the four ways
``send``/``receive`` can move it: ``labsupport.experiments.sync_timing.bench_on_group``, which Lab 3
calls on a group it already has. ``main`` starts fresh processes, prints the table and writes
``results/bench_sync.<machine>.json`` and its plot (Chapter 4 and Lab 3 read them).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any

from labsupport.course import hardware, progress, results
from labsupport.core.buckets import ALIGN
from labsupport.groups import create_group, free_port
from labsupport.course.ranks import run_ranks
from labsupport.experiments.sync_timing import BUCKET_MODES, bench_on_group, format_rows, plot_bench


@dataclass
class BenchConfig:
    sizes_bytes: list[int]
    buckets_bytes: list[int]
    iters: int
    warmup: int
    device_kind: str  # "cuda" or "cpu"
    port: int
    timeout_s: float


def _bench_rank(rank: int, world_size: int, cfg: BenchConfig) -> list[dict[str, Any]]:
    dev = f"cuda:{rank}" if cfg.device_kind == "cuda" else "cpu"
    group = create_group("127.0.0.1", cfg.port, rank, world_size, device=dev,
                         timeout_s=cfg.timeout_s)
    # raw, per tensor, buckets x modes
    n = len(cfg.sizes_bytes) * (2 + len(cfg.buckets_bytes) * len(BUCKET_MODES))
    bar = progress.bar(total=n, desc="bench sync", unit="config", disable=rank != 0)

    def say(line: str) -> None:  # rank 0: a line per measurement, and the bar
        progress.write(line)
        bar.update()

    try:
        return bench_on_group(group, cfg.sizes_bytes, cfg.buckets_bytes, iters=cfg.iters,
                              warmup=cfg.warmup, progress=say if rank == 0 else None)
    finally:
        bar.close()
        group.destroy()


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model size: raw, per-tensor and best bucketed bandwidth, and bucketed as a fraction of
    raw."""
    out = []
    for size in sorted({r["size_bytes"] for r in rows}):
        rs = [r for r in rows if r["size_bytes"] == size]
        raw = next((r for r in rs if r["mode"] == "raw"), None)
        per = next((r for r in rs if r["mode"] == "per_tensor"), None)
        s = {"size_bytes": size, "size_gb": size / 1e9, "n_tensors": rs[0]["n_tensors"],
             "raw_gb_per_s": raw["gb_per_s"] if raw else None,
             "per_tensor_gb_per_s": per["gb_per_s"] if per else None}
        for mode in BUCKET_MODES:
            bs = [r for r in rs if r["mode"] == mode]
            if bs:
                best = max(bs, key=lambda r: r["gb_per_s"])
                s[f"best_{mode}_gb_per_s"] = best["gb_per_s"]
                s[f"best_{mode}_bucket_mib"] = best["bucket_bytes"] / 2**20
                s[f"best_{mode}_frac_of_raw"] = best["gb_per_s"] / raw["gb_per_s"] if raw else None
        if per and raw:
            s["per_tensor_frac_of_raw"] = per["gb_per_s"] / raw["gb_per_s"]
        if raw:  # every configuration within 90 % of raw, best first
            s["configs_at_90pct_of_raw"] = [
                f"{r['mode']} {r['bucket_bytes'] / 2**20:g} MiB "
                f"({r['gb_per_s'] / raw['gb_per_s']:.1%})"
                for r in sorted(rs, key=lambda r: -r["gb_per_s"])
                if r["mode"] != "raw" and r["gb_per_s"] >= 0.9 * raw["gb_per_s"]]
        out.append(s)
    return out


def check_bar(
    summary: list[dict[str, Any]], frac: float = 0.9, min_gb: float = 2.0
) -> dict[str, Any] | None:
    """The issue's bar: bucketed sync of every size >= ``min_gb`` reaches ``frac`` of the raw
    broadcast measured in the same run; says which configurations did (None if no size is large
    enough)."""
    big = [s for s in summary if s["size_gb"] >= min_gb]
    if not big:
        return None
    met = {m: all((s.get(f"best_{m}_frac_of_raw") or 0) >= frac for s in big) for m in ("bucketed",
                                                                                        "bucketed_noverify")}
    return {"threshold_frac_of_raw": frac, "sizes_gb": [s["size_gb"] for s in big],
            "met_bucketed_verified": met["bucketed"],
            "met_bucketed_without_checksums": met["bucketed_noverify"],
            "met_by": {f"{s['size_gb']:.2f} GB": s.get("configs_at_90pct_of_raw", []) for s in big}}


def bench(world_size: int, sizes_gb: list[float], buckets_mb: list[float], *, iters: int = 5,
          warmup: int = 1, device_kind: str | None = None, timeout_s: float = 170.0) -> dict[str,
                                                                                             Any]:
    """Run the sweep in ``world_size`` fresh processes (rank r on GPU r, or CPU/gloo); return the
    result data."""
    kind = device_kind or ("cuda" if hardware.gpu_count() >= world_size else "cpu")
    cfg = BenchConfig([int(s * 1e9) for s in sizes_gb], [max(ALIGN, int(b * 2**20))
                                                         for b in buckets_mb],
                      iters, warmup, kind, free_port(), min(60.0, timeout_s))
    res = run_ranks(_bench_rank, world_size, (cfg,), timeout_s=timeout_s,
                    cpu_threads=1 if kind == "cpu" else None)
    bad = [(r, out) for r, (ok, out) in enumerate(res) if not ok]
    if bad:
        r, (name, msg, tb) = bad[0]
        raise RuntimeError(f"bench sync: rank {r} failed: {name}: {msg}\n{tb}")
    rows = res[0][1]
    return {"world_size": world_size, "backend": "nccl" if kind == "cuda" else "gloo",
            "iters": iters, "warmup": warmup, "sizes_gb": sizes_gb, "buckets_mb": buckets_mb,
            "rows": rows, "summary": summarize(rows)}


def main(argv: list[str]) -> int:
    """``python -m labsupport bench sync``: per-tensor vs bucketed vs raw broadcast, table + JSON +
    plot."""
    gpus = hardware.gpu_count()
    ap = argparse.ArgumentParser(prog="python -m labsupport bench sync", description=main.__doc__)
    ap.add_argument("--world-size", type=int, default=None,
                    help="processes: 1 trainer + receivers (default: every GPU; 2 on CPU)")
    ap.add_argument("--sizes-gb", default=None, help="comma-separated bf16 model sizes in GB")
    ap.add_argument("--buckets-mb", default=None, help="comma-separated bucket sizes in MiB")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="fewer sizes/buckets (a smoke run)")
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU even if GPUs are present")
    ap.add_argument("--timeout", type=float, default=170.0, help="seconds before the run is killed")
    ap.add_argument("--no-save", action="store_true", help="do not write "
                                                           "results/bench_sync.*.json/png")
    args = ap.parse_args(argv)
    gpu = gpus >= 2 and not args.cpu
    if gpu:
        sizes = "0.5,2.5" if args.quick else "0.1,0.5,1,2.5,5"
        buckets = "16,256,1024" if args.quick else "1,4,16,64,128,256,512,1024"
        iters = args.iters or (3 if args.quick else 8)
        world = args.world_size or gpus
    else:
        sizes = "0.002,0.01" if args.quick else "0.002,0.01,0.04"
        buckets = "0.0625,1,4" if args.quick else "0.0625,0.25,1,4,16"
        iters = args.iters or 2
        world = args.world_size or 2
    sizes_gb = [float(x) for x in (args.sizes_gb or sizes).split(",")]
    buckets_mb = [float(x) for x in (args.buckets_mb or buckets).split(",")]
    if gpu and world > gpus:
        print(f"--world-size {world} needs {world} GPUs; this machine shows {gpus}.",
              file=sys.stderr)
        return 2
    print(f"bench sync: {world} ranks over {'NCCL, one GPU each' if gpu else 'gloo on CPU'}; "
          f"sizes {sizes_gb} GB bf16; buckets {buckets_mb} MiB; {iters} iterations (median)",
          flush=True)
    t0 = time.perf_counter()
    data = bench(world, sizes_gb, buckets_mb, iters=iters, warmup=args.warmup,
                 device_kind="cuda" if gpu else "cpu", timeout_s=args.timeout)
    data["wall_s"] = time.perf_counter() - t0
    print(format_rows(data["rows"]))
    print()
    for s in data["summary"]:
        print(f"{s['size_gb']:.2f} GB ({s['n_tensors']} tensors): raw {s['raw_gb_per_s']:.1f} "
              f"GB/s, per-tensor {s['per_tensor_gb_per_s']:.1f} GB/s "
              f"({s.get('per_tensor_frac_of_raw', 0):.0%}), best bucketed "
              f"{s.get('best_bucketed_gb_per_s', 0):.1f} GB/s at "
              f"{s.get('best_bucketed_bucket_mib', 0):g} MiB "
              f"({s.get('best_bucketed_frac_of_raw', 0):.1%} of raw; without checksums "
              f"{s.get('best_bucketed_noverify_frac_of_raw', 0):.1%} at "
              f"{s.get('best_bucketed_noverify_bucket_mib', 0):g} MiB; via load() "
              f"{s.get('best_bucketed_load_noverify_frac_of_raw') or 0:.1%}; packed "
              f"{s.get('best_packed_noverify_frac_of_raw') or 0:.1%})")
    bar = check_bar(data["summary"]) if gpu else None
    if bar is not None:
        data["bar"] = bar
        data["bar_90pct_of_raw_at_2gb_plus"] = (
            bar["met_bucketed_verified"] or bar["met_bucketed_without_checksums"]
        )
        print("bar (bucketed >= 90% of raw, sizes >= 2 GB, raw measured in this run): with "
              f"checksums {'MET' if bar['met_bucketed_verified'] else 'NOT MET'}, without "
              f"checksums {'MET' if bar['met_bucketed_without_checksums'] else 'NOT MET'}")
        for size, configs in bar["met_by"].items():
            print(f"  {size}: configurations at >= 90% of raw: {', '.join(configs) or 'none'}")
    print(f"wall time {data['wall_s']:.1f} s")
    if not args.no_save:
        tag = results.machine_tag()
        fig = plot_bench(data, f"Weight sync, {world} ranks ({tag}, {data['backend']})")
        path = results.save_result("bench_sync", data, figure=fig)
        print("wrote", path, "and", path.with_suffix(".png"))
    return 0
