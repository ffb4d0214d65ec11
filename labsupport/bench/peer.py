"""``python -m labsupport bench peer``: the capstone against TRL's GRPOTrainer (vLLM co-located),
side by side.

Both train the capstone's 0.5B policy (built offline, the same warm start per seed) on the same task
and reward, with the same group size, prompts per step, completion length, learning rate, KL weight,
clip range, trainer precision and number of steps, each in its own child process on one GPU (one
process tree, one run; ``--gpus N`` runs N of them side by side, each on a GPU of its own, TRL and
the capstone of a seed together). Per step it records the wall time and its parts, and every
``--eval-every`` steps the held-out accuracy, computed the same way for both: greedy answers of the
trainer's own weights to the 64 held-out prompts (outside the timed step).

The capstone runs in one or more configurations of its co-located mechanisms
(``--capstone-configs``, names of ``rl.colocated.CONFIGS`` joined by "+"): the first is compared
with TRL on every seed, the others (ablations) run on the first seed only. Its parts come from its
own timeline. TRL has no per-phase breakdown of its own: its ``profiling_context`` blocks (weight
sync, vLLM generation, rewards, the no-gradient forward passes, input preparation) are recorded from
outside, and the rest of the step (the forward with gradients, backward and optimizer step) is its
training.

Writes ``results/bench_peer.<machine>.json`` and a figure (ms per step by part; held-out accuracy
per step).
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

PARTS = ("generate", "sync", "wake", "sleep", "offload", "score", "logprobs", "train", "other")

# Settings both runs share (stated, so that the chapter can say what is equal)
EQUAL = {
    "model and task": "the capstone's warm-started 0.5B policy per seed, its prompts, rule reward "
                      "and held-out set",
    "prompts": "the same prompts in the same order, step by step: the capstone's stream for the "
               "run's seed (TRL's sampler keeps the dataset's order: shuffle_dataset=False)",
    "batch": "prompts per step x samples per prompt in one generation call and one optimizer step "
             "(TRL: per_device_train_batch_size = prompts x group, steps_per_generation 1, vLLM "
             "max_num_seqs the same)",
    "optimization": "AdamW at the same learning rate (constant, no warm-up, no weight decay), "
                    "gradient clipping at 1.0, the same KL weight (k3 estimator against the frozen "
                    "reference) and clip range",
    "precision": "the same trainer precision (--precision): fp32, or bf16 autocast over float32 "
                 "master weights (TRL's bf16=True through accelerate; the capstone's "
                 "precision='bf16')",
    "activation checkpointing": "off in both (TRL defaults to on; at 0.5B nothing needs it)",
    "engine": "vLLM in bfloat16 with the same share of GPU memory (--engine-share) and context "
              "length (64), asked for token ids only (detokenize=False: each tool decodes the "
              "reward's texts itself)",
    "evaluation": "the same greedy held-out check, between steps and not timed, in the trainer's "
                  "precision (TRL's model under accelerate's autocast, the capstone's under its "
                  "own)",
}
# Settings that differ, and why (the chapter names each); run-specific ones are added by _unequal()
UNEQUAL = {
    "behaviour log-probabilities": "the capstone takes the engine's log-probabilities as the "
                                   "behaviour policy; TRL recomputes them with the trainer in one "
                                   "more forward pass (no gradient) and masks sequences by the "
                                   "engine/trainer ratio (its default "
                                   "vllm_importance_sampling_correction): TRL's default, kept",
    "engine process": "TRL runs vLLM's worker inside the trainer's process "
                      "(distributed_executor_backend='external_launcher'); the capstone runs "
                      "vLLM's engine core in a process of its own and reaches its worker by RPC, "
                      "unless its configuration says 'inline'",
    "vLLM batching limit": "TRL sets max_num_batched_tokens=4096; the capstone keeps vLLM's "
                           "default (every prompt of a step fits one batch either way)",
    "random streams": "TRL seeds vLLM's sampler with 0, the capstone with the run's seed",
    "vLLM requests": "TRL's colocate mode sends vLLM one request per sample (each prompt repeated, "
                     "n=1); the capstone sends each prompt once and asks for its group (n = "
                     "samples per prompt): TRL's default, kept (its server mode asks as the "
                     "capstone does)",
}


# ---- the capstone's configurations and TRL's settings
# ------------------------------------------------------------

def capstone_switches(name: str, a: argparse.Namespace) -> dict[str, Any]:
    """The RLConfig fields of capstone configuration ``name`` in this benchmark (``--precision`` for
    both tools)."""
    from labsupport.rl.colocated import config_overrides

    return {**config_overrides(name), "precision": a.precision, "engine_share": a.engine_share}


def trl_sleeps(a: argparse.Namespace) -> bool:
    """TRL's colocate sleep mode: its default (off) unless the compared capstone configuration
    sleeps, or as asked."""
    from labsupport import rl

    if a.trl_sleep != "auto":
        return a.trl_sleep == "on"
    return rl.RLConfig(**capstone_switches(a.configs[0], a)).sleep_level > 0


def trl_mechanisms(a: argparse.Namespace) -> dict[str, Any]:
    """TRL's co-located mechanisms, read in its source (trl 1.16: generation/vllm_generation.py)."""
    return {"update": "load_weights per parameter (model_runner.model.load_weights), then "
                      "reset_prefix_cache",
            "sleep_level": 2 if trl_sleeps(a) else 0, "optimizer_offload": False,
            "cuda_graphs": True, "inline_engine": True, "precision": a.precision, "compile": False}


def _trl_config(a: argparse.Namespace, out_dir: str):
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=out_dir, max_steps=a.steps, per_device_train_batch_size=a.prompts * a.group,
        num_generations=a.group, max_completion_length=a.answer_len, learning_rate=a.lr,
        beta=a.beta,
        epsilon=a.clip, temperature=1.0, loss_type="grpo", scale_rewards="group",
        lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, bf16=a.precision == "bf16", fp16=False,
        gradient_checkpointing=False, seed=a.seed, shuffle_dataset=False, use_vllm=True,
        vllm_mode="colocate",
        vllm_enable_sleep_mode=trl_sleeps(a), vllm_gpu_memory_utilization=a.engine_share,
        vllm_max_model_length=64,
        # token ids only, as the capstone asks (TRL decodes them itself)
        generation_kwargs={"detokenize": False},
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True)


# ---- the two workers (each in a child process)
# ------------------------------------------------------------------

def trl_parts(parts: list[tuple[str, float]], wall: float) -> dict[str, float]:
    """One TRL step's parts from its profiling contexts, in the order they ended: the forward passes
    that end before ``_prepare_inputs`` does are the no-gradient ones (the trainer's own
    log-probabilities, the reference's)."""
    names = [n for n, _ in parts]
    end = names.index("_prepare_inputs") if "_prepare_inputs" in names else len(parts)
    got = lambda key: sum(d for n, d in parts if n == key)  # noqa: E731
    prepare = got("_prepare_inputs")
    out = {"generate": got("generate"), "sync": got("sync_weights"),
           "score": got("_calculate_rewards"),
           "logprobs": sum(d for n, d in parts[:end] if n == "_get_per_token_logps_and_entropies")}
    # forward with gradients, backward, optimizer step, the trainer's bookkeeping
    out["train"] = wall - prepare
    # sleep/wake, padding
    out["other"] = prepare - sum(out[k] for k in ("generate", "sync", "score", "logprobs"))
    return out


def run_trl(a: argparse.Namespace) -> dict[str, Any]:
    """TRL's GRPOTrainer in colocate mode on the capstone's model and task; per-step times, parts
    and accuracy."""
    import torch
    import trl.extras.profiling as profiling
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from labsupport.rl import policy, rollout, task

    path = str(policy.warmstart_dir(seed=a.seed, size=a.size))
    parts: list[tuple[str, float]] = []
    plain = profiling.ProfilingContext._log_metrics

    def record(self, duration: float) -> None:  # TRL's own timers, read from outside
        parts.append(("generate" if "generate" in self.name else self.name.rsplit(".", 1)[-1],
                      duration))
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
            steps.append({"step": state.global_step, "wall_s": wall, **trl_parts(parts, wall)})
            if state.global_step % a.eval_every == 0 or state.global_step == a.steps:
                curve.append({"step": state.global_step,
                              "eval_acc": rollout.held_out_accuracy(model)})

    # the capstone's, step by step
    prompts = task.train_prompts(a.steps * a.prompts, random.Random(a.seed))
    with tempfile.TemporaryDirectory() as tmp:
        trainer = GRPOTrainer(model=path, reward_funcs=reward, args=_trl_config(a, tmp),
                              train_dataset=Dataset.from_dict({"prompt": prompts}),
                              callbacks=[Clock()])
        # (accelerate's, from train())
        with torch.autocast("cuda", torch.bfloat16, enabled=a.precision == "bf16"):
            curve.append({"step": 0, "eval_acc": rollout.held_out_accuracy(trainer.model)})
        t0 = time.perf_counter()
        trainer.train()
        loop_s = time.perf_counter() - t0
    return {"steps": steps, "curve": curve, "loop_s": loop_s, "mechanisms": trl_mechanisms(a)}


def capstone_parts(step: dict[str, Any]) -> dict[str, float]:
    """One capstone step's parts from its timeline: the engine's (generate, update, wake, sleep) and
    the trainer's (bucket refresh, offload, score, train) spans; ``other`` is what none of them
    covers (Python between phases)."""
    e, t = step["time"]["engine"], step["time"]["trainer"]
    out = {"generate": e["generate"], "sync": e["sync"] + t["sync"], "wake": e.get("wake", 0.0),
           "sleep": e.get("sleep", 0.0), "offload": t.get("offload", 0.0), "score": t["score"],
           "train": t["train"]}
    out["other"] = step["wall_s"] - sum(out.values())
    return out


def run_capstone(a: argparse.Namespace) -> dict[str, Any]:
    """The capstone's co-located loop with vLLM in configuration ``a.config``; per-step times,
    parts, accuracy."""
    from labsupport import rl

    steps = a.steps if a.config == a.configs[0] else a.ablation_steps
    cfg = rl.RLConfig(steps=steps, prompts_per_step=a.prompts, group_size=a.group, lr=a.lr,
                      beta=a.beta,
                      clip_eps=a.clip, seed=a.seed, eval_every=a.eval_every,
                      **capstone_switches(a.config, a))
    d = rl.run("colocated", cfg, engine="vllm", size=a.size, verbose=False, memory=False)
    out = [{"step": s["step"] + 1, "wall_s": s["wall_s"], **capstone_parts(s)} for s in d["steps"]]
    return {"steps": out,
            "curve": [{"step": c["step"], "eval_acc": c["eval_acc"]} for c in d["curve"]],
            "loop_s": d["loop_s"], "mechanisms": d["mechanisms"],
            "weights_match": d["weights_match"],
            "engine_final_acc": d["engine_final_acc"]}


# ---- the parent: runs, summary, table, plot
# ---------------------------------------------------------------------

def summarize(run: dict[str, Any], skip: int) -> dict[str, float]:
    """The median ms per step and the median ms of each part, over the steps after the first
    ``skip`` (warm-up), and the mean step (which a rare slow step, such as a garbage collection
    inside a phase, moves)."""
    body = run["steps"][skip:] or run["steps"]
    keys = [k for k in body[0] if k not in ("step", "wall_s")]
    return {"ms_per_step": 1e3 * statistics.median(s["wall_s"] for s in body),
            **{f"{k}_ms": 1e3 * statistics.median(s[k] for s in body) for k in keys},
            "mean_ms_per_step": 1e3 * statistics.fmean(s["wall_s"] for s in body),
            "final_acc": run["curve"][-1]["eval_acc"]}


def label(r: dict[str, Any]) -> str:
    return "TRL" if r["tool"] == "trl" else f"capstone {r['config']}"


def plot(runs: list[dict[str, Any]]):
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    seen: set[str] = set()  # each part in the legend once
    for i, r in enumerate(runs):
        s, bottom = r["summary"], 0.0
        for j, part in enumerate(PARTS):
            ms = s.get(f"{part}_ms", 0.0)
            left.bar(i, ms, bottom=bottom, color=f"C{j}", label=part if ms > 0 and part not in seen
                     else None)
            seen |= {part} if ms > 0 else set()
            bottom += ms
        compared = r["tool"] == "trl" or r["config"] == r["compared_config"]
        right.plot([c["step"] for c in r["curve"]], [c["eval_acc"] for c in r["curve"]],
                   "--" if r["tool"] == "trl" else "-" if compared else ":",
                   label=f"{label(r)} (seed {r['seed']})")
    left.set_xticks(range(len(runs)),
                    [f"{label(r)}\nseed {r['seed']}".replace("capstone ", "capstone\n")
                                       for r in runs], fontsize=7)
    left.set_ylabel("ms per step (median of each part)")
    left.legend(fontsize=7)
    right.set_xlabel("step")
    right.set_ylabel("held-out accuracy")
    right.set_ylim(-0.05, 1.05)
    right.grid(alpha=0.3)
    right.legend(fontsize=6)
    fig.tight_layout()
    return fig


def task_args(p: argparse.ArgumentParser, beta_help: str | None = None) -> argparse.ArgumentParser:
    """The task's settings, with the defaults every comparison with TRL runs (``bench peer``,
    ``bench peer2``)."""
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompts", type=int, default=32, help="prompts per step")
    p.add_argument("--group", type=int, default=16, help="samples per prompt")
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--beta", type=float, default=0.02, help=beta_help)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--size", default="0.5b")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--eval-every", type=int, default=5)
    return p


def _parser() -> argparse.ArgumentParser:
    p = task_args(argparse.ArgumentParser(prog="python -m labsupport bench peer",
                                          description=__doc__.split("\n\n")[0]))
    p.add_argument("--engine-share", type=float, default=0.15,
                   help="vLLM's share of GPU memory (both tools)")
    p.add_argument("--precision", default="bf16", choices=["fp32", "bf16"],
                   help="the trainer's, for both tools (bf16: autocast over float32 master "
                        "weights; TRL's default)")
    p.add_argument("--tools", default="capstone,trl")
    p.add_argument("--capstone-configs",
                   default="fastest,fast,fastest+inline,fastest+safe,fastest+sleep2,fastest+no-graphs",
                   help="capstone configurations (rl.colocated.CONFIGS, joined by '+'); the first "
                        "is compared with TRL on every seed, the rest run on the first seed only")
    p.add_argument("--ablation-steps", type=int, default=15, help="steps of each ablation run")
    p.add_argument("--trl-sleep", default="auto", choices=["auto", "on", "off"],
                   help="TRL's vllm_enable_sleep_mode (auto: its default, off, unless the compared "
                        "capstone configuration sleeps)")
    p.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the medians")
    p.add_argument("--timeout", type=float, default=1500, help="seconds for one tool's run")
    p.add_argument("--gpus", type=int, default=1,
                   help="runs side by side, one per visible GPU (TRL and the capstone of a seed "
                        "start together)")
    p.add_argument("--summarize", default=None, metavar="JSON",
                   help="recompute a saved result's summaries, ratios and figure from its recorded "
                        "steps (no run)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--config", default=None, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p


def _unequal(a: argparse.Namespace) -> dict[str, str]:
    """UNEQUAL, plus the sleep setting where the capstone's configurations and TRL's differ."""
    from labsupport import rl

    out = dict(UNEQUAL)
    trl_level = 2 if trl_sleeps(a) else 0
    matched = trl_level and a.trl_sleep == "auto"
    other = [c for c in a.configs if rl.RLConfig(**capstone_switches(c, a)).sleep_level
             != trl_level]
    if other:
        out["sleep"] = ("TRL runs with sleep mode "
                        f"{'on (level 2)' if trl_level else 'off, its default'}"
                        f"{' to match the compared configuration' if matched else ''}; "
                        f"capstone configuration(s) {', '.join(other)} use another sleep level (an "
                        "ablation compares with the capstone's own default, not with TRL)")
    compiled = [c for c in a.configs if rl.RLConfig(**capstone_switches(c, a)).compile]
    if compiled:
        out["compiled forward passes"] = (
            f"capstone configuration(s) {', '.join(compiled)} run the trainer's scoring passes "
            "compiled (grpo.compile_layers: layer by layer, replayed as CUDA graphs unless the "
            "engine core is inline); TRL's torch_compile (a transformers TrainingArguments flag) "
            "is off by default and kept off: the comparison is with TRL as it is set up out of the "
            "box, and a no-compile ablation shows what compiling gives the capstone")
    return out


def _jobs(a: argparse.Namespace) -> list[tuple[str, str | None, int]]:
    """(tool, capstone configuration, seed) in run order: per seed TRL and the compared
    configuration, then the ablations on the first seed."""
    seeds, tools = [int(s) for s in a.seeds.split(",")], a.tools.split(",")
    jobs = [(t, a.configs[0] if t == "capstone" else None, s) for s in seeds for t in tools]
    return jobs + [("capstone", c, seeds[0]) for c in a.configs[1:] if "capstone" in tools]


def _child(argv: list[str], tool: str, config: str | None, seed: int, timeout: float,
           gpu: str | None) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, "-m", "labsupport", "bench", "peer", *argv, "--worker", tool,
               "--seed", str(seed),
               "--out", f.name, *(["--config", config] if config else [])]
        t0 = time.perf_counter()
        # TRL's colocate mode starts a one-rank torch.distributed group at MASTER_PORT (29500 unless
        # set): a free port, so that two runs side by side (one per GPU) do not collide
        from labsupport.groups import free_port

        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **os.environ,
               "LABSUPPORT_PROGRESS": "0",
               **({"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {})}
        subprocess.run(cmd, check=True, timeout=timeout, env=env)
        return {"wall_s": time.perf_counter() - t0, **json.loads(Path(f.name).read_text())}


def _run_jobs(argv: list[str], a: argparse.Namespace) -> list[dict[str, Any]]:
    """Every job of :func:`_jobs`, ``--gpus`` at a time, each child on a GPU of its own
    (``CUDA_VISIBLE_DEVICES``)."""
    import queue
    from concurrent.futures import ThreadPoolExecutor

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(a.gpus)]
    if a.gpus > len(ids):
        raise ValueError(f"--gpus {a.gpus}, but only {len(ids)} GPU(s) are visible ({visible})")
    free: queue.Queue[str | None] = queue.Queue()
    for i in ids[:a.gpus]:
        free.put(i if a.gpus > 1 else visible)  # one at a time: the GPUs as they are

    def one(job: tuple[str, str | None, int]) -> dict[str, Any]:
        tool, config, seed = job
        gpu = free.get()
        try:
            print(f"== {tool}{' ' + config if config else ''}, seed {seed}", flush=True)
            r = {"tool": tool, "config": config, "compared_config": a.configs[0], "seed": seed,
                 **_child(argv, tool, config, seed, a.timeout, gpu)}
        finally:
            free.put(gpu)
        r["summary"] = summarize(r, a.skip)
        print(json.dumps({"tool": tool, "config": config, "seed": seed,
                          **{k: round(v, 3) for k, v in r["summary"].items()}}), flush=True)
        return r

    with ThreadPoolExecutor(a.gpus) as pool:  # each job's child has its own deadline (--timeout)
        return list(pool.map(one, _jobs(a)))


def _ratios(runs: list[dict[str, Any]], compared: str) -> dict[str, Any]:
    """Capstone (configuration ``compared``) over TRL in ms per step: per seed, and the mean over
    seeds."""
    per_seed = {}
    for seed in sorted({r["seed"] for r in runs}):
        cap = [r for r in runs if r["seed"] == seed and r["tool"] == "capstone" and r["config"]
               == compared]
        trl = [r for r in runs if r["seed"] == seed and r["tool"] == "trl"]
        if cap and trl:
            per_seed[str(seed)] = (cap[0]["summary"]["ms_per_step"]
                                   / trl[0]["summary"]["ms_per_step"])
    return {"per_seed": per_seed, "mean": statistics.fmean(per_seed.values()) if per_seed else None}


def main(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    a.answer_len = 3
    a.configs = a.capstone_configs.split(",")
    from labsupport.rl.colocated import config_overrides

    for c in a.configs:
        config_overrides(c)  # an unknown name fails now, not after the first tool's run
    if a.worker:  # one tool, one seed (one configuration), in this (child) process
        data = (run_trl if a.worker == "trl" else run_capstone)(a)
        Path(a.out).write_text(json.dumps(data, default=str))
        return 0
    from labsupport.course import results

    if a.summarize:
        return resummarize(Path(a.summarize))
    runs = _run_jobs(argv, a)
    ratio = _ratios(runs, a.configs[0])
    head = "".join(f"{p[:8]:>9s}" for p in PARTS)
    print(f"{'run':26s} {'seed':>4s} {'ms/step':>8s}{head} {'acc':>5s}")
    for r in runs:
        s = r["summary"]
        cells = "".join(f"{s.get(f'{p}_ms', 0.0):9.0f}" for p in PARTS)
        print(f"{label(r):26s} {r['seed']:4d} {s['ms_per_step']:8.0f}{cells} {s['final_acc']:5.2f}")
    if ratio["mean"] is not None:
        print(f"capstone ({a.configs[0]}) / TRL, ms per step: {ratio['mean']:.2f} "
              f"(per seed: {', '.join(f'{k}: {v:.2f}' for k, v in ratio['per_seed'].items())})")
    import matplotlib

    matplotlib.use("Agg")
    keys = ("steps", "prompts", "group", "lr", "beta", "clip", "size", "eval_every", "engine_share",
            "precision",
            "skip", "ablation_steps", "trl_sleep", "capstone_configs", "gpus")
    data = {"settings": {k: getattr(a, k) for k in keys}, "completion_tokens": a.answer_len,
            "compared_config": a.configs[0], "equal": EQUAL, "unequal": _unequal(a),
            "parts": list(PARTS),
            "runs": runs, "capstone_over_trl": ratio["mean"],
            "capstone_over_trl_per_seed": ratio["per_seed"]}
    if a.gpus > 1:  # (what one run after the other on one GPU avoids)
        data["shared_host"] = (f"{a.gpus} runs at a time, each on a GPU of its own, sharing the "
                               "host's CPUs: TRL and the capstone of a seed started together, one "
                               "run's start-up (vLLM's and the trainer's compilation) overlapped "
                               "another's timed steps, and generation, bound by the host's work "
                               "per request, is slowed by what runs beside it")
    print("wrote", results.save_result("bench_peer", data, figure=plot(runs)))
    return 0


def resummarize(path: Path) -> int:
    """Rewrite a saved ``bench_peer`` result's summaries, ratios and figure with this module's
    ``summarize``, from the steps it recorded (the run's settings, steps and accuracies stay as
    measured)."""
    import matplotlib

    matplotlib.use("Agg")
    from labsupport.course import results

    rec = json.loads(path.read_text())
    data = rec["data"]
    for r in data["runs"]:
        r["summary"] = summarize(r, data["settings"]["skip"])
    ratio = _ratios(data["runs"], data["compared_config"])
    data["capstone_over_trl"], data["capstone_over_trl_per_seed"] = ratio["mean"], ratio["per_seed"]
    rec["summarized"] = "python -m labsupport bench peer --summarize " + path.name
    results.write_record(path, rec, plot(data["runs"]))
    print("rewrote", path, "and its figure; capstone / TRL per seed:",
          ", ".join(f"{k}: {v:.2f}" for k, v in ratio["per_seed"].items()))
    return 0
