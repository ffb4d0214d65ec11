"""Probe (a diagnosis, not a course command): the capstone trainer's step at 0.5B (bf16 autocast, 32 prompts x 16,
3 answer tokens, random weights) in variants of compilation, each in a child process on one GPU. Prints one row a
variant (median ms over 15 steps after 3 warm-up steps; first_s: the first step, with compilation) and writes them to
$OUT/probe_train_step.json. Results: results/logs/probe_train_step.<machine>.json.

    python3 tools/probe_train_step.py [VARIANT ...]     # PROBE_PROFILE=VARIANT: also a torch.profiler table

Variants: eager; full / full-graphs (torch.compile of the whole model, without / with CUDA graphs); regional /
regional-graphs (each decoder layer compiled); all four with torch's SDPA attention. prod: GRPOTrainer(compile=True)
(grpo.compile_layers: regional, CUDA graphs, the plain attention composition).
"""
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = ["eager", "full", "full-graphs", "regional", "regional-graphs", "prod"]


def trainer(variant: str):
    import torch

    from labsupport.course import models
    from labsupport.rl import grpo, policy

    torch.manual_seed(0)
    model = models.build_model(0, **policy.SIZES["0.5b"]["config"]).cuda()
    if variant == "prod":
        return grpo.GRPOTrainer(model, lr=5e-5, beta=0.02, precision="bf16", compile=True), False
    tr = grpo.GRPOTrainer(model, lr=5e-5, beta=0.02, precision="bf16", compile=False)
    graphs = variant.endswith("graphs")
    kw = dict(dynamic=False, mode="reduce-overhead" if graphs else None)
    for m in (tr.model, tr.ref):
        if variant.startswith("full"):  # in place, as Module.compile does for a layer
            m.compile(**kw)
        elif variant.startswith("regional"):
            for layer in m.model.layers:
                layer.compile(**kw)
    return tr, graphs


def child(variant: str) -> dict:
    import random

    import torch

    from labsupport.course import models
    from labsupport.rl import task
    from labsupport.rl.rollout import Rollout

    tr, graphs = trainer(variant)
    tok, rng = models.build_tokenizer(), random.Random(0)
    prompts = task.train_prompts(32, rng)
    pids = [tok(p)["input_ids"] for p in prompts for _ in range(16)]
    n = len(pids)
    ro = Rollout(prompts, 16, pids, torch.randint(3, 29, (n, 3)), -torch.rand(n, 3) * 3,
                 torch.ones(n, 3, dtype=torch.bool), ["abc"] * n)
    rewards = (torch.rand(n) > 0.5).float()

    def step():
        if graphs:  # the probe's own graphs: mark each step (GRPOTrainer does it for its own)
            torch.compiler.cudagraph_mark_step_begin()
        return tr.step(ro, rewards)

    times, losses = [], []
    for _ in range(18):
        torch.cuda.synchronize()
        t = time.perf_counter()
        losses.append(step()["loss"])
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    out = {"variant": variant, "first_s": round(times[0], 2), "median_ms": round(1e3 * statistics.median(times[3:]), 1),
           "min_ms": round(1e3 * min(times[3:]), 1), "max_ms": round(1e3 * max(times[3:]), 1),
           "loss0": losses[0], "loss_last": losses[-1], "peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2)}
    if os.environ.get("PROBE_PROFILE") == variant:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
        gpu = [e for e in prof.events() if e.device_type.name == "CUDA"]
        out["gpu_busy_ms_per_step"] = round(sum(e.device_time for e in gpu) / 3 / 1e3, 1)
    return out


def main(variants: list[str]) -> None:
    rows, deadline = [], time.time() + float(os.environ.get("PROBE_BUDGET_S", "480"))
    for v in variants:
        left = deadline - time.time()
        if left < 30:
            print(f"{v}: skipped (out of time)")
            continue
        try:
            p = subprocess.run([sys.executable, __file__, "--child", v], capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            print(v, "timed out", flush=True)
            continue
        found = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
        if not found:
            print(v, "failed, rc", p.returncode, p.stderr[-3000:], flush=True)
            continue
        rows.append(json.loads(found[-1][len("RESULT "):]))
        print(rows[-1], flush=True)
        print("\n".join(line for line in p.stdout.splitlines() if not line.startswith("RESULT "))[-6000:])
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "probe_train_step.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if sys.argv[1:2] == ["--child"]:
        print("RESULT " + json.dumps(child(sys.argv[2])), flush=True)
    else:
        main(sys.argv[1:] or VARIANTS)
