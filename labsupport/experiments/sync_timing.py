"""Timing a weight sync on a group you have: how fast ``labsupport.broadcast`` moves a transformer's
weights.

``transformer_shapes`` gives a Qwen2-shaped bf16 state of any size; on an existing group, every rank
calls ``bench_on_group``, which measures a raw single-buffer broadcast of the same bytes (the
ceiling), per-tensor broadcast, and for each bucket size the four ways ``send``/``receive`` can move
it (``BUCKET_MODES``); ``format_rows`` prints the rows and ``plot_bench`` draws bandwidth against
bucket size. Lab 3 calls these from its Ray actors; ``python -m labsupport bench sync`` runs them in
fresh processes and saves the result.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from labsupport.broadcast import Receiver, Sender, SyncStats, expected_from
from labsupport.core.buckets import ALIGN
from labsupport.core.sync import copy_into
from labsupport.groups import StatelessGroup


def transformer_shapes(target_bytes: int, bytes_per_param: int = 2,
                       min_layers: int = 20) -> list[tuple[str, tuple[int, ...]]]:
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
    """Seconds per call of ``fn`` on every rank, from a common start to the last rank done (one
    all-reduce)."""
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


def _weights(group: StatelessGroup, size: int,
             src: int) -> tuple[dict[str, torch.Tensor], Any, Any]:
    """A random bfloat16 model of about ``size`` bytes on rank ``src`` (no loader, no expected
    metadata); elsewhere zeros of the same shapes, a loader into them and their metadata."""
    dev = group.device
    shapes = transformer_shapes(size)
    gen = torch.Generator(device=dev).manual_seed(size)
    if group.rank == src:
        return {n: torch.randn(s, device=dev, generator=gen, dtype=torch.float32).to(torch.bfloat16)
                for n, s in shapes}, None, None
    model = {n: torch.zeros(s, dtype=torch.bfloat16, device=dev) for n, s in shapes}
    return model, copy_into(model), expected_from(model)


def bench_on_group(group: StatelessGroup, sizes_bytes: list[int], buckets_bytes: list[int], *,
                   iters: int = 5, warmup: int = 1, src: int = 0,
                   modes: tuple[str, ...] = ("raw", "per_tensor", *BUCKET_MODES),
                   progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Every rank calls this; rank ``src`` returns the measured rows (others return []).

    For each model size: ``raw`` (one broadcast of a single buffer of the same total bytes),
    ``per_tensor`` (landing in place, no checksums), and for every bucket size: ``bucketed`` landing
    in the receivers' own tensors (with and without checksums), ``bucketed_load`` (landing in
    staging buffers that ``load`` copies out of, as an inference engine's ``load_weights`` needs)
    and ``packed`` (copied into buffers on the trainer, out of them on the receivers). Each kind is
    a run of updates through one ``Sender`` and ``Receiver``."""
    dev = group.device
    rows: list[dict[str, Any]] = []
    for size in sizes_bytes:
        model, load, exp = _weights(group, size, src)
        total = sum(t.numel() * 2 for t in model.values())
        base = {"size_bytes": total, "n_tensors": len(model), "world_size": group.world_size,
                "backend": group.backend}

        def record(mode: str, bucket: int, times: list[float], stats: SyncStats | None) -> None:
            med = statistics.median(times)
            row = {**base, "mode": mode, "bucket_bytes": bucket, "seconds": med,
                   "seconds_min": min(times), "gb_per_s": total / med / 1e9,
                   "n_collectives": stats.n_collectives if stats else 1,
                   "handshake_s": stats.handshake_s if stats else 0.0}
            rows.append(row)
            if progress:
                progress(f"{total / 1e9:6.2f} GB {mode:>22} bucket {bucket / 2**20:8.2f} MiB: "
                         f"{med * 1e3:8.2f} ms {row['gb_per_s']:8.2f} GB/s")

        if "raw" in modes:
            buf = torch.empty(total, dtype=torch.uint8, device=dev)
            record("raw", total, _timed(group, lambda: group.broadcast(buf, src), iters, warmup),
                   None)
            del buf

        def one(mode: str, bucket: int, verify: bool,
                in_place: bool) -> tuple[list[float], SyncStats]:
            """Time a run of updates of one kind, with the Sender or Receiver held from one to the
            next."""
            last: list[SyncStats] = []
            if group.rank == src:
                side = Sender(group, src=src, mode=mode, bucket_bytes=bucket, verify=verify)
                times = _timed(group, lambda: last.append(side.send(model)), iters, warmup)
            else:
                side = Receiver(group, src=src, expected=exp, load=load, into=model if in_place
                                else None, staged=False)
                times = _timed(group, lambda: last.append(side.receive()), iters, warmup)
            return times, last[-1]

        if "per_tensor" in modes:
            record("per_tensor", 0, *one("per_tensor", ALIGN, False, True))
        for bucket in buckets_bytes:
            for name, (mode, verify, in_place) in BUCKET_MODES.items():
                if name in modes:
                    record(name, bucket, *one(mode, bucket, verify, in_place))
        model = load = None  # (free this size's weights before the next one)
    return rows if group.rank == src else []


def format_rows(rows: list[dict[str, Any]]) -> str:
    """The benchmark's table: one line per (size, mode, bucket), with the fraction of raw
    bandwidth."""
    raw = {r["size_bytes"]: r["gb_per_s"] for r in rows if r["mode"] == "raw"}
    head = (f"{'size GB':>8} {'tensors':>7} {'mode':>22} {'bucket MiB':>10} {'ms':>9} {'GB/s':>8} "
            f"{'of raw':>7} {'launch':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        frac = r["gb_per_s"] / raw[r["size_bytes"]] if r["size_bytes"] in raw else float("nan")
        bucket = f"{r['bucket_bytes'] / 2**20:g}" if r["mode"] in BUCKET_MODES else "-"
        lines.append(f"{r['size_bytes'] / 1e9:8.3f} {r['n_tensors']:7d} {r['mode']:>22} "
                     f"{bucket:>10} {r['seconds'] * 1e3:9.2f} {r['gb_per_s']:8.2f} {frac:7.1%} "
                     f"{r['n_collectives']:6d}")
    return "\n".join(lines)


MODE_STYLE = {"bucketed": ("o-", "bucketed, in place, checksums"),
              "bucketed_noverify": (".:", "bucketed, in place, no checksums"),
              "bucketed_load_noverify": ("x-.", "bucketed, via staging + load()"),
              "packed_noverify": ("s--", "packed: copied in and out")}


def plot_bench(data: dict[str, Any], title: str = ""):
    """Left: bucketed bandwidth vs bucket size, one colour per model size (dashed: raw single
    buffer, dotted: per tensor). Right: the largest model, every way of sending it, against the raw
    line."""
    import matplotlib.pyplot as plt

    rows = data["rows"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.3), sharey=True)
    sizes = sorted({r["size_bytes"] for r in rows})
    for i, size in enumerate(sizes):
        color = plt.cm.viridis(i / max(1, len(sizes) - 1) * 0.9)
        rs = [r for r in rows if r["size_bytes"] == size]
        pts = sorted((r["bucket_bytes"] / 2**20, r["gb_per_s"]) for r in rs
                     if r["mode"] == "bucketed")
        if pts:
            ax.plot(*zip(*pts), "o-", color=color, label=f"{size / 1e9:.2g} GB, "
                                                         f"{rs[0]['n_tensors']} tensors")
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
        ax2.axhline(raw["gb_per_s"], linestyle="--", color="k", linewidth=1.0,
                    label="raw single buffer")
        ax2.axhline(0.9 * raw["gb_per_s"], linestyle=":", color="r", linewidth=1.0,
                    label="90% of raw")
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
