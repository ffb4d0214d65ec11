"""``python -m labsupport bench peer``: the capstone against TRL's GRPOTrainer (vLLM co-located), side by side.

Both train the capstone's 0.5B policy (built offline, the same warm start per seed) on the same task and reward,
with the same group size, prompts per step, completion length, learning rate, KL weight, clip range and number of
steps, in fp32, each in its own child process on the same GPU (one process tree, one run). Per step it records the
wall time and its parts, and every ``--eval-every`` steps the held-out accuracy, computed the same way for both:
greedy answers of the trainer's own weights to the 64 held-out prompts (outside the timed step). TRL has no
per-phase breakdown of its own: its ``profiling_context`` blocks (weight sync, vLLM generation, reward) are
recorded from outside, and the rest of the step is its training.

Writes ``results/bench_peer.<machine>.json`` and a figure (ms per step by part; held-out accuracy per step).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# What is equal in both runs, and what is not (the chapter names each difference and why)
UNEQUAL = {
    "behaviour log-probabilities": "the capstone takes the engine's log-probabilities as the behaviour policy; TRL "
                                   "recomputes them with the trainer and masks sequences by the engine/trainer "
                                   "ratio (its default vllm_importance_sampling_correction)",
    "engine memory": "both give vLLM the same share of the GPU (--engine-share)",
    "evaluation": "the same greedy held-out check for both, run between steps and not timed",
}


def held_out_accuracy(model) -> float:
    """Greedy answers of ``model`` to the held-out prompts, scored by the task's reward (as the capstone's loop)."""
    from labsupport.course import models
    from labsupport.rl import rollout, task

    tok, prompts = models.build_tokenizer(), task.eval_prompts()
    toks, _, mask = rollout.sample(model, [tok(p)["input_ids"] for p in prompts], task.ANSWER_LEN, 0.0)
    texts = [tok.decode(t[m].tolist(), skip_special_tokens=True) for t, m in zip(toks, mask)]
    return sum(task.reward(t, p) for t, p in zip(texts, prompts)) / len(prompts)


def _trl_config(a: argparse.Namespace, out_dir: str):
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=out_dir, max_steps=a.steps, per_device_train_batch_size=a.prompts * a.group,
        num_generations=a.group, max_completion_length=a.answer_len, learning_rate=a.lr, beta=a.beta,
        epsilon=a.clip, temperature=1.0, loss_type="grpo", scale_rewards="group", lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, bf16=False, fp16=False, seed=a.seed,
        use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True, vllm_gpu_memory_utilization=a.engine_share,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True)


def run_trl(a: argparse.Namespace) -> dict[str, Any]:
    """TRL's GRPOTrainer in colocate mode on the capstone's model and task; per-step times, parts and accuracy."""
    import torch
    import trl.extras.profiling as profiling
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from labsupport.rl import policy, task

    path = str(policy.warmstart_dir(seed=a.seed, size=a.size))
    parts: list[tuple[str, float]] = []
    plain = profiling.ProfilingContext._log_metrics

    def record(self, duration: float) -> None:  # TRL's own timers, read from outside
        parts.append((self.name.rsplit(".", 1)[-1] if "generate" not in self.name else "generate", duration))
        plain(self, duration)

    profiling.ProfilingContext._log_metrics = record

    def reward(prompts, completions, **_):
        return [task.reward(c, p) for p, c in zip(prompts, completions)]

    steps, curve = [], []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            torch.cuda.synchronize()
            parts.clear()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kw):
            torch.cuda.synchronize()
            wall = time.perf_counter() - self.t0
            got = {k: sum(d for n, d in parts if n == k) for k in ("generate", "sync_weights", "reward")}
            steps.append({"step": state.global_step, "wall_s": wall, "generate": got["generate"],
                          "sync": got["sync_weights"], "score": got["reward"],
                          "train": wall - sum(got.values())})
            if state.global_step % a.eval_every == 0 or state.global_step == a.steps:
                curve.append({"step": state.global_step, "eval_acc": held_out_accuracy(model)})

    prompts = task.train_prompts(a.steps * a.prompts, random.Random(a.seed))
    with tempfile.TemporaryDirectory() as tmp:
        trainer = GRPOTrainer(model=path, reward_funcs=reward, args=_trl_config(a, tmp),
                              train_dataset=Dataset.from_dict({"prompt": prompts}), callbacks=[Clock()])
        curve.append({"step": 0, "eval_acc": held_out_accuracy(trainer.model)})
        t0 = time.perf_counter()
        trainer.train()
        loop_s = time.perf_counter() - t0
    return {"steps": steps, "curve": curve, "loop_s": loop_s}


def run_capstone(a: argparse.Namespace) -> dict[str, Any]:
    """The capstone's co-located loop with vLLM; per-step times, parts and accuracy from its own timeline."""
    from labsupport import rl

    cfg = rl.RLConfig(steps=a.steps, prompts_per_step=a.prompts, group_size=a.group, lr=a.lr, beta=a.beta,
                      clip_eps=a.clip, seed=a.seed, eval_every=a.eval_every)
    d = rl.run("colocated", cfg, engine="vllm", size=a.size, verbose=False, memory=False)
    steps = [{"step": s["step"] + 1, "wall_s": s["wall_s"], "generate": s["time"]["engine"]["generate"],
              "sync": s["time"]["engine"]["sync"], "score": s["time"]["trainer"]["score"],
              "train": s["time"]["trainer"]["train"]} for s in d["steps"]]
    for s in steps:  # what the lanes do not explain: sleep/wake, hand-offs, Python between phases
        s["other"] = s["wall_s"] - s["generate"] - s["sync"] - s["score"] - s["train"]
    return {"steps": steps, "curve": [{"step": c["step"], "eval_acc": c["eval_acc"]} for c in d["curve"]],
            "loop_s": d["loop_s"]}


def summarize(run: dict[str, Any], skip: int) -> dict[str, float]:
    """Median ms per step and mean ms of each part, over the steps after the first ``skip`` (warm-up)."""
    body = run["steps"][skip:] or run["steps"]
    keys = [k for k in body[0] if k not in ("step", "wall_s")]
    return {"ms_per_step": 1e3 * statistics.median(s["wall_s"] for s in body),
            **{f"{k}_ms": 1e3 * statistics.fmean(s[k] for s in body) for k in keys},
            "final_acc": run["curve"][-1]["eval_acc"]}


def plot(runs: list[dict[str, Any]]):
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    labels, bottoms = [], []
    for i, r in enumerate(runs):
        s, bottom = r["summary"], 0.0
        for j, part in enumerate(("generate", "sync", "score", "train", "other")):
            ms = s.get(f"{part}_ms", 0.0)
            left.bar(i, ms, bottom=bottom, color=f"C{j}", label=part if i == 0 else None)
            bottom += ms
        labels.append(f"{r['tool']}\nseed {r['seed']}")
        bottoms.append(bottom)
        right.plot([c["step"] for c in r["curve"]], [c["eval_acc"] for c in r["curve"]],
                   "-" if r["tool"] == "capstone" else "--", color="C0" if r["tool"] == "capstone" else "C3",
                   label=f"{r['tool']} (seed {r['seed']})")
    left.set_xticks(range(len(runs)), labels, fontsize=8)
    left.set_ylabel("ms per step (mean of the parts)")
    left.legend(fontsize=7)
    right.set_xlabel("step")
    right.set_ylabel("held-out accuracy")
    right.set_ylim(-0.05, 1.05)
    right.grid(alpha=0.3)
    right.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m labsupport bench peer", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--prompts", type=int, default=32, help="prompts per step")
    p.add_argument("--group", type=int, default=16, help="samples per prompt")
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--beta", type=float, default=0.02)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--size", default="0.5b")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--engine-share", type=float, default=0.15, help="vLLM's share of GPU memory (both tools)")
    p.add_argument("--tools", default="capstone,trl")
    p.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the medians")
    p.add_argument("--timeout", type=float, default=1500, help="seconds for one tool's run")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    a.answer_len = 3
    if a.worker:  # one tool, one seed, in this (child) process
        data = (run_trl if a.worker == "trl" else run_capstone)(a)
        Path(a.out).write_text(json.dumps(data))
        return 0
    from labsupport.course import results

    runs = []
    for seed in [int(s) for s in a.seeds.split(",")]:
        for tool in a.tools.split(","):
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                cmd = [sys.executable, "-m", "labsupport", "bench", "peer", *argv, "--worker", tool,
                       "--seed", str(seed), "--out", f.name]
                print(f"== {tool}, seed {seed}", flush=True)
                t0 = time.perf_counter()
                subprocess.run(cmd, check=True, timeout=a.timeout, env={**os.environ, "LABSUPPORT_PROGRESS": "0"})
                r = {"tool": tool, "seed": seed, "wall_s": time.perf_counter() - t0, **json.loads(Path(f.name).read_text())}
            r["summary"] = summarize(r, a.skip)
            runs.append(r)
            print(json.dumps({"tool": tool, "seed": seed, **{k: round(v, 3) for k, v in r["summary"].items()}}))
    by = {t: [r["summary"] for r in runs if r["tool"] == t] for t in a.tools.split(",")}
    ratio = (statistics.fmean(s["ms_per_step"] for s in by["capstone"]) /
             statistics.fmean(s["ms_per_step"] for s in by["trl"])) if {"capstone", "trl"} <= set(by) else None
    print(f"{'tool':10s} {'seed':>4s} {'ms/step':>8s} {'generate':>9s} {'sync':>6s} {'train':>6s} {'acc':>5s}")
    for r in runs:
        s = r["summary"]
        print(f"{r['tool']:10s} {r['seed']:4d} {s['ms_per_step']:8.0f} {s['generate_ms']:9.0f} {s['sync_ms']:6.0f} "
              f"{s['train_ms']:6.0f} {s['final_acc']:5.2f}")
    if ratio is not None:
        print(f"capstone / TRL, ms per step: {ratio:.2f}")
    import matplotlib

    matplotlib.use("Agg")
    settings = {k: getattr(a, k) for k in ("steps", "prompts", "group", "lr", "beta", "clip", "size", "eval_every",
                                           "engine_share", "skip")}
    data = {"settings": settings, "completion_tokens": a.answer_len, "unequal": UNEQUAL, "runs": runs,
            "capstone_over_trl": ratio}
    print("wrote", results.save_result("bench_peer", data, figure=plot(runs)))
    return 0
