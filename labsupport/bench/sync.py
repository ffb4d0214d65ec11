"""``python -m labsupport bench sync``: how fast ``labsupport.broadcast`` moves a transformer's weights.

For each model size (a Qwen2-shaped bf16 state, ``transformer_shapes``) every rank of one group measures a
raw single-buffer broadcast of the same bytes (the ceiling), per-tensor broadcast, and for each bucket size
the four ways ``send``/``receive`` can move it (``BUCKET_MODES``). ``bench_on_group`` runs on a group you
already have (Lab 3 calls it from Ray actors); ``main`` starts fresh processes, prints the table and writes
``results/bench_sync.<machine>.json`` and its plot (Chapter 4 and Lab 3 read them).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from labsupport import hardware, progress, results
from labsupport.broadcast import ALIGN, SyncStats, copy_into, expected_from, receive, release_buffers, send
from labsupport.ranks import run_ranks
from labsupport.groups import StatelessGroup, create_group, free_port


def transformer_shapes(target_bytes: int, bytes_per_param: int = 2, min_layers: int = 20) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a Qwen2-style decoder of about ``target_bytes`` (embeddings ~20% of it).

    Picks the widest hidden size that still gives ``min_layers`` layers, so the list has hundreds of
    tensors of realistic sizes: big MLP matrices, mid-size attention, tiny norms and biases.
    """
    params = target_bytes / bytes_per_param
    best = None
    for h in (256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 5120, 8192):
        head_dim = 64 if h < 1024 else 128
        kv = max(1, h // head_dim // 6) * head_dim
        inter = max(256, round(h * 5.25 / 256) * 256)
        vocab = min(151936, max(1024, round(0.1 * params / h / 64) * 64))
        per_layer = 2 * h * h + 2 * kv * h + h + 2 * kv + 3 * h * inter + 2 * h
        layers = round((params - 2 * vocab * h - h) / per_layer)
        if best is None or layers >= min_layers:
            best = (h, kv, inter, vocab, max(1, layers))
        if layers < min_layers:
            break
    h, kv, inter, vocab, layers = best
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.q_proj.bias", (h,)),
                (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.k_proj.bias", (kv,)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.v_proj.bias", (kv,)),
                (p + "self_attn.o_proj.weight", (h, h)),
                (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                (p + "mlp.down_proj.weight", (h, inter))]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    return out


def _timed(group: StatelessGroup, fn: Callable[[], Any], iters: int, warmup: int) -> list[float]:
    """Seconds per call of ``fn`` on every rank, from a common start to the last rank done (one all-reduce)."""
    tick = torch.zeros(1, device=group.device)
    times = []
    for it in range(warmup + iters):
        group.all_reduce(tick)
        group.synchronize("benchmark barrier")
        t0 = time.perf_counter()
        fn()
        group.all_reduce(tick)  # completes only when every rank has finished fn
        group.synchronize("benchmark barrier")
        if it >= warmup:
            times.append(time.perf_counter() - t0)
    return times


BUCKET_MODES = {  # bench row name -> (send mode, verify, receiver lands in its own tensors)
    "bucketed": ("bucketed", True, True),
    "bucketed_noverify": ("bucketed", False, True),
    "bucketed_load_noverify": ("bucketed", False, False),
    "packed_noverify": ("packed", False, False),
}


def bench_on_group(group: StatelessGroup, sizes_bytes: list[int], buckets_bytes: list[int], *, iters: int = 5,
                   warmup: int = 1, src: int = 0, modes: tuple[str, ...] = ("raw", "per_tensor", *BUCKET_MODES),
                   progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Every rank calls this; rank ``src`` returns the measured rows (others return []).

    For each model size: ``raw`` (one broadcast of a single buffer of the same total bytes), ``per_tensor``
    (landing in place, no checksums), and for every bucket size: ``bucketed`` landing in the receivers' own
    tensors (with and without checksums), ``bucketed_load`` (landing in staging buffers that ``load`` copies
    out of, as an inference engine's ``load_weights`` needs) and ``packed`` (copied into buffers on the trainer,
    out of them on the receivers).
    """
    dev = group.device
    rows: list[dict[str, Any]] = []
    for size in sizes_bytes:
        shapes = transformer_shapes(size)
        total = sum(math.prod(s) * 2 for _, s in shapes)
        gen = torch.Generator(device=dev).manual_seed(size)
        if group.rank == src:
            model = {n: torch.randn(s, device=dev, generator=gen, dtype=torch.float32).to(torch.bfloat16)
                     for n, s in shapes}
            load, exp = None, None
        else:
            model = {n: torch.zeros(s, dtype=torch.bfloat16, device=dev) for n, s in shapes}
            load, exp = copy_into(model), expected_from(model)
        base = {"size_bytes": total, "n_tensors": len(shapes), "world_size": group.world_size,
                "backend": group.backend}

        def record(mode: str, bucket: int, times: list[float], stats: SyncStats | None) -> None:
            med = statistics.median(times)
            row = {**base, "mode": mode, "bucket_bytes": bucket, "seconds": med, "seconds_min": min(times),
                   "gb_per_s": total / med / 1e9, "n_collectives": stats.n_collectives if stats else 1,
                   "handshake_s": stats.handshake_s if stats else 0.0}
            rows.append(row)
            if progress:
                progress(f"{total / 1e9:6.2f} GB {mode:>22} bucket {bucket / 2**20:8.2f} MiB: "
                         f"{med * 1e3:8.2f} ms {row['gb_per_s']:8.2f} GB/s")

        if "raw" in modes:
            buf = torch.empty(total, dtype=torch.uint8, device=dev)
            times = _timed(group, lambda: group.broadcast(buf, src), iters, warmup)
            record("raw", total, times, None)
            del buf
        last: list[SyncStats] = []

        def one(mode: str, bucket: int, verify: bool, in_place: bool) -> None:
            if group.rank == src:
                last.append(send(group, model, src=src, mode=mode, bucket_bytes=bucket, verify=verify))
            else:
                last.append(receive(group, src=src, expected=exp, load=load, into=model if in_place else None))

        if "per_tensor" in modes:
            times = _timed(group, lambda: one("per_tensor", ALIGN, False, True), iters, warmup)
            record("per_tensor", 0, times, last[-1])
        for bucket in buckets_bytes:
            for name, (mode, verify, in_place) in BUCKET_MODES.items():
                if name in modes:
                    times = _timed(group, lambda: one(mode, bucket, verify, in_place), iters, warmup)
                    record(name, bucket, times, last[-1])
        model = load = None  # (free this size's weights before the next one)
        release_buffers(group)
    return rows if group.rank == src else []


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
    group = create_group("127.0.0.1", cfg.port, rank, world_size, device=dev, timeout_s=cfg.timeout_s)
    n = len(cfg.sizes_bytes) * (2 + len(cfg.buckets_bytes) * len(BUCKET_MODES))  # raw, per tensor, buckets x modes
    bar = progress.bar(total=n, desc="bench sync", unit="config", disable=rank != 0)

    def say(line: str) -> None:  # rank 0: a line per measurement, and the bar
        progress.write(line)
        bar.update()

    try:
        return bench_on_group(group, cfg.sizes_bytes, cfg.buckets_bytes, iters=cfg.iters, warmup=cfg.warmup,
                              progress=say if rank == 0 else None)
    finally:
        bar.close()
        group.destroy()


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model size: raw, per-tensor and best bucketed bandwidth, and bucketed as a fraction of raw."""
    out = []
    for size in sorted({r["size_bytes"] for r in rows}):
        rs = [r for r in rows if r["size_bytes"] == size]
        raw = next((r for r in rs if r["mode"] == "raw"), None)
        per = next((r for r in rs if r["mode"] == "per_tensor"), None)
        s = {"size_bytes": size, "size_gb": size / 1e9, "n_tensors": rs[0]["n_tensors"],
             "raw_gb_per_s": raw["gb_per_s"] if raw else None, "per_tensor_gb_per_s": per["gb_per_s"] if per else None}
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
                f"{r['mode']} {r['bucket_bytes'] / 2**20:g} MiB ({r['gb_per_s'] / raw['gb_per_s']:.1%})"
                for r in sorted(rs, key=lambda r: -r["gb_per_s"])
                if r["mode"] != "raw" and r["gb_per_s"] >= 0.9 * raw["gb_per_s"]]
        out.append(s)
    return out


def check_bar(summary: list[dict[str, Any]], frac: float = 0.9, min_gb: float = 2.0) -> dict[str, Any] | None:
    """The issue's bar: bucketed sync of every size >= ``min_gb`` reaches ``frac`` of the raw broadcast
    measured in the same run; says which configurations did (None if no size is large enough)."""
    big = [s for s in summary if s["size_gb"] >= min_gb]
    if not big:
        return None
    met = {m: all((s.get(f"best_{m}_frac_of_raw") or 0) >= frac for s in big) for m in ("bucketed", "bucketed_noverify")}
    return {"threshold_frac_of_raw": frac, "sizes_gb": [s["size_gb"] for s in big],
            "met_bucketed_verified": met["bucketed"], "met_bucketed_without_checksums": met["bucketed_noverify"],
            "met_by": {f"{s['size_gb']:.2f} GB": s.get("configs_at_90pct_of_raw", []) for s in big}}


def format_rows(rows: list[dict[str, Any]]) -> str:
    """The benchmark's table: one line per (size, mode, bucket), with the fraction of raw bandwidth."""
    raw = {r["size_bytes"]: r["gb_per_s"] for r in rows if r["mode"] == "raw"}
    head = f"{'size GB':>8} {'tensors':>7} {'mode':>22} {'bucket MiB':>10} {'ms':>9} {'GB/s':>8} {'of raw':>7} {'launch':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        frac = r["gb_per_s"] / raw[r["size_bytes"]] if r["size_bytes"] in raw else float("nan")
        bucket = f"{r['bucket_bytes'] / 2**20:g}" if r["mode"] in BUCKET_MODES else "-"
        lines.append(f"{r['size_bytes'] / 1e9:8.3f} {r['n_tensors']:7d} {r['mode']:>22} {bucket:>10} "
                     f"{r['seconds'] * 1e3:9.2f} {r['gb_per_s']:8.2f} {frac:7.1%} {r['n_collectives']:6d}")
    return "\n".join(lines)


MODE_STYLE = {"bucketed": ("o-", "bucketed, in place, checksums"),
              "bucketed_noverify": (".:", "bucketed, in place, no checksums"),
              "bucketed_load_noverify": ("x-.", "bucketed, via staging + load()"),
              "packed_noverify": ("s--", "packed: copied in and out")}


def plot_bench(data: dict[str, Any], title: str = ""):
    """Left: bucketed bandwidth vs bucket size, one colour per model size (dashed: raw single buffer,
    dotted: per tensor). Right: the largest model, every way of sending it, against the raw line."""
    import matplotlib.pyplot as plt

    rows = data["rows"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.3), sharey=True)
    sizes = sorted({r["size_bytes"] for r in rows})
    for i, size in enumerate(sizes):
        color = plt.cm.viridis(i / max(1, len(sizes) - 1) * 0.9)
        rs = [r for r in rows if r["size_bytes"] == size]
        pts = sorted((r["bucket_bytes"] / 2**20, r["gb_per_s"]) for r in rs if r["mode"] == "bucketed")
        if pts:
            ax.plot(*zip(*pts), "o-", color=color, label=f"{size / 1e9:.2g} GB, {rs[0]['n_tensors']} tensors")
        for mode, style in (("raw", "--"), ("per_tensor", ":")):
            r = next((r for r in rs if r["mode"] == mode), None)
            if r:
                ax.axhline(r["gb_per_s"], linestyle=style, color=color, linewidth=1.0)
    big = [r for r in rows if r["size_bytes"] == sizes[-1]] if sizes else []
    for mode, (style, label) in MODE_STYLE.items():
        pts = sorted((r["bucket_bytes"] / 2**20, r["gb_per_s"]) for r in big if r["mode"] == mode)
        if pts:
            ax2.plot(*zip(*pts), style, label=label)
    raw = next((r for r in big if r["mode"] == "raw"), None)
    if raw:
        ax2.axhline(raw["gb_per_s"], linestyle="--", color="k", linewidth=1.0, label="raw single buffer")
        ax2.axhline(0.9 * raw["gb_per_s"], linestyle=":", color="r", linewidth=1.0, label="90% of raw")
    ticks = sorted({r["bucket_bytes"] / 2**20 for r in rows if r["mode"] in MODE_STYLE})
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        if ticks:
            a.set_xticks(ticks, [f"{t:g}" for t in ticks], fontsize=7)
            a.minorticks_off()
        a.set_xlabel("bucket size (MiB)")
        a.grid(alpha=0.3)
    ax.set_ylabel("payload bandwidth (GB/s)")
    ax.plot([], [], "k--", label="raw single-buffer broadcast")
    ax.plot([], [], "k:", label="per-tensor broadcast")
    ax.set_title("bucketed (in place, checksums) by model size", fontsize=9)
    ax2.set_title(f"{sizes[-1] / 1e9:.2g} GB: four ways" if sizes else "", fontsize=9)
    ax.legend(fontsize=7, loc="best")
    ax2.legend(fontsize=7, loc="best")
    fig.suptitle(title or "Weight sync bandwidth vs bucket size", fontsize=10)
    fig.tight_layout()
    return fig


def bench(world_size: int, sizes_gb: list[float], buckets_mb: list[float], *, iters: int = 5, warmup: int = 1,
          device_kind: str | None = None, timeout_s: float = 170.0) -> dict[str, Any]:
    """Run the sweep in ``world_size`` fresh processes (rank r on GPU r, or CPU/gloo); return the result data."""
    kind = device_kind or ("cuda" if hardware.gpu_count() >= world_size else "cpu")
    cfg = BenchConfig([int(s * 1e9) for s in sizes_gb], [max(ALIGN, int(b * 2**20)) for b in buckets_mb],
                      iters, warmup, kind, free_port(), min(60.0, timeout_s))
    res = run_ranks(_bench_rank, world_size, (cfg,), timeout_s=timeout_s,
                    cpu_threads=1 if kind == "cpu" else None)
    bad = [(r, out) for r, (ok, out) in enumerate(res) if not ok]
    if bad:
        r, (name, msg, tb) = bad[0]
        raise RuntimeError(f"bench sync: rank {r} failed: {name}: {msg}\n{tb}")
    rows = res[0][1]
    return {"world_size": world_size, "backend": "nccl" if kind == "cuda" else "gloo", "iters": iters,
            "warmup": warmup, "sizes_gb": sizes_gb, "buckets_mb": buckets_mb, "rows": rows,
            "summary": summarize(rows)}


def main(argv: list[str]) -> int:
    """``python -m labsupport bench sync``: per-tensor vs bucketed vs raw broadcast, table + JSON + plot."""
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
    ap.add_argument("--no-save", action="store_true", help="do not write results/bench_sync.*.json/png")
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
        print(f"--world-size {world} needs {world} GPUs; this machine shows {gpus}.", file=sys.stderr)
        return 2
    print(f"bench sync: {world} ranks over {'NCCL, one GPU each' if gpu else 'gloo on CPU'}; "
          f"sizes {sizes_gb} GB bf16; buckets {buckets_mb} MiB; {iters} iterations (median)", flush=True)
    t0 = time.perf_counter()
    data = bench(world, sizes_gb, buckets_mb, iters=iters, warmup=args.warmup,
                 device_kind="cuda" if gpu else "cpu", timeout_s=args.timeout)
    data["wall_s"] = time.perf_counter() - t0
    print(format_rows(data["rows"]))
    print()
    for s in data["summary"]:
        print(f"{s['size_gb']:.2f} GB ({s['n_tensors']} tensors): raw {s['raw_gb_per_s']:.1f} GB/s, per-tensor "
              f"{s['per_tensor_gb_per_s']:.1f} GB/s ({s.get('per_tensor_frac_of_raw', 0):.0%}), best bucketed "
              f"{s.get('best_bucketed_gb_per_s', 0):.1f} GB/s at {s.get('best_bucketed_bucket_mib', 0):g} MiB "
              f"({s.get('best_bucketed_frac_of_raw', 0):.1%} of raw; without checksums "
              f"{s.get('best_bucketed_noverify_frac_of_raw', 0):.1%} at {s.get('best_bucketed_noverify_bucket_mib', 0):g}"
              f" MiB; via load() {s.get('best_bucketed_load_noverify_frac_of_raw') or 0:.1%}; packed "
              f"{s.get('best_packed_noverify_frac_of_raw') or 0:.1%})")
    bar = check_bar(data["summary"]) if gpu else None
    if bar is not None:
        data["bar"] = bar
        data["bar_90pct_of_raw_at_2gb_plus"] = bar["met_bucketed_verified"] or bar["met_bucketed_without_checksums"]
        print(f"bar (bucketed >= 90% of raw, sizes >= 2 GB, raw measured in this run): with checksums "
              f"{'MET' if bar['met_bucketed_verified'] else 'NOT MET'}, without checksums "
              f"{'MET' if bar['met_bucketed_without_checksums'] else 'NOT MET'}")
        for size, configs in bar["met_by"].items():
            print(f"  {size}: configurations at >= 90% of raw: {', '.join(configs) or 'none'}")
    print(f"wall time {data['wall_s']:.1f} s")
    if not args.no_save:
        tag = results.machine_tag()
        fig = plot_bench(data, f"Weight sync, {world} ranks ({tag}, {data['backend']})")
        path = results.save_result("bench_sync", data, figure=fig)
        print("wrote", path, "and", path.with_suffix(".png"))
    return 0
