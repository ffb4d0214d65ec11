"""``python -m labsupport bench peer2``: the three architectures on one task, and the two on two
GPUs against TRL.

Jobs (``--jobs``), each in a child process of its own, on one lane of ``--lane`` GPUs (``--gpus``
split into lanes; a pair's two runs start together on two lanes):

- ``capstone:colocated``: the capstone's co-located loop on the lane's first GPU
  (``--capstone-config``, as ``bench peer`` compares it with TRL's colocate mode);
- ``capstone:disaggregated`` and ``capstone:async``: trainer on the lane's first GPU, vLLM in a
  process of its own on the second, weights over the course's own group (``rl.run``);
- ``trl:server``: ``trl vllm-serve`` (TRL 1.16's command line for ``vllm serve`` with vLLM's NCCL
  weight transfer) on the second GPU, ``GRPOTrainer(use_vllm=True, vllm_mode="server")`` on the
  first;
- ``trl:async``: the same server, and ``trl.experimental.async_grpo.AsyncGRPOTrainer`` with its
  rollout worker.

Every run trains the capstone's warm-started 0.5B policy of its seed on the capstone's prompts in
the capstone's order, with the same group size, prompts per step, answer length, learning rate, clip
range and precision (KL as far as the tool has one), and every ``--eval-every`` steps the held-out
accuracy of the trainer's own weights, the same greedy check for all, outside the timed step. A
step's time is the time between the ends of consecutive optimizer steps less any evaluation in
between, so it holds the step's weight push wherever a tool makes it.

From the runs it computes the pairs' ratios (capstone over TRL, per seed) and the three
architectures at equal work (median ms per step, samples per second per GPU, seconds of steps to a
held-out accuracy ``--target``), the async loop's overlap (its step over the longer of the next
rollout's generation and its own learning) and staleness. Writes
``results/bench_peer2.<machine>.json``; ``--summarize FILE`` recomputes the summaries from a saved
one, ``--summarize A B`` makes one record of runs saved apart (other seeds, another half hour).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

JOBS = ("trl:server", "capstone:disaggregated", "trl:async", "capstone:async", "capstone:colocated")
GPUS = {"capstone:colocated": 1}  # every other job: two (trainer, engine)
PAIRS = {"disaggregated": ("capstone:disaggregated", "trl:server"),
         "async": ("capstone:async", "trl:async")}
ARCHS = {"colocated": "capstone:colocated", "disaggregated": "capstone:disaggregated",
         "async": "capstone:async"}

EQUAL = {
    "model and task": "the capstone's warm-started 0.5B policy per seed, its prompts, rule reward "
                      "and held-out set",
    "prompts": "the capstone's prompt stream for the run's seed, in its order (TRL: "
               "shuffle_dataset=False; the async rollout worker walks its dataset in order)",
    "batch": "prompts per step x samples per prompt per optimizer step; vLLM's max_num_seqs the "
             "same (all of a step's samples in one batch)",
    "optimization": "AdamW at the same learning rate (constant, no warm-up, no weight decay), "
                    "gradient clipping at 1.0, the same clip range",
    "precision": "the trainer's (--precision): bf16 autocast over float32 master weights, or fp32; "
                 "vLLM in bf16",
    "engine": "vLLM 0.26 on a GPU of its own, the same share of its memory (--engine-share), "
              "context length 64, CUDA graphs on",
    "evaluation": "the same greedy held-out check of the trainer's weights, between steps and not "
                  "timed",
    "step time": "between the ends of consecutive optimizer steps, less the evaluation between "
                 "them: a step holds its weight push wherever the tool makes it",
}
UNEQUAL = {
    "weight transfer": "TRL streams each parameter through vLLM's native NCCL weight-transfer "
                       "engine (packed broadcast, driven by HTTP calls: start, update, finish, "
                       "then a prefix-cache reset) in the trainer's dtype (float32 master weights; "
                       "vLLM casts on load); the capstone broadcasts bfloat16 buckets over its own "
                       "group, announced, checksummed and voted on, into vLLM's worker",
    "server": "TRL talks to vLLM's OpenAI-compatible server (API process, engine-core process) "
              "over HTTP, which also detokenizes; the capstone's engine process runs vLLM's engine "
              "core inline and asks for token ids only",
    "behaviour log-probabilities (server mode)": "GRPOTrainer recomputes them with the trainer "
                                                 "(one more forward, no gradient) and corrects by "
                                                 "the engine/trainer ratio (its default); the "
                                                 "capstone and AsyncGRPOTrainer take the engine's",
    "KL term (async)": "AsyncGRPOTrainer has no KL term (no beta, no reference model); the "
                       "capstone keeps its KL weight (--beta) and the reference model's forward "
                       "pass in every architecture",
    "requests (async)": "AsyncGRPOTrainer's rollout worker sends one request per sample (n=1), up "
                        "to max_inflight_tasks at a time, and a step takes the first prompts x "
                        "group scored samples to arrive; the capstone sends each step's prompts in "
                        "one call with n = group",
    "staleness (async)": "the capstone's lag is exactly one step (rollout k+1 generated with the "
                         "weights after step k); AsyncGRPOTrainer lets samples lag up to "
                         "max_staleness versions and drops older ones (--trl-max-staleness, "
                         "--trl-weight-sync-steps): the histograms show what each did",
    "micro-batches (async)": "AsyncGRPOTrainer's token_budget is set to 0 (one forward and "
                             "backward over a step's samples, as the capstone does); its default, "
                             "the server's max_model_len, would split a step into many",
    "prompt format (async)": "AsyncGRPOTrainer takes conversations only: each prompt is one user "
                             "message, rendered by a chat template that writes <bos> and the "
                             "content verbatim (the capstone's tokens)",
}


# ---- the servers TRL trains against
# -------------------------------------------------------------------------------

def server_command(a: argparse.Namespace, model: str, port: int) -> list[str]:
    """``trl vllm-serve``'s command (TRL's own ``build_command``: ``vllm serve`` with its NCCL
    weight transfer), with the capstone's engine settings."""
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    args = ScriptArguments(model=model, host="127.0.0.1", port=port,
                           gpu_memory_utilization=a.engine_share,
                           max_model_len=64, dtype="bfloat16")
    return build_command(args, ["--max-num-seqs", str(a.prompts * a.group), "--seed", str(a.seed)])


def wait_ready(url: str, proc: subprocess.Popen, deadline_s: float, log: Path) -> float:
    """Poll ``url``/health until it answers 200; seconds it took. Raises at once if the server
    exits, and TimeoutError after ``deadline_s``, each with the end of its log."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < deadline_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with {proc.returncode} before it was "
                               "ready; its log ends:\n"
                               f"{_tail(log)}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return time.perf_counter() - t0
        time.sleep(2)
    raise TimeoutError(f"the vLLM server at {url} was not ready after {deadline_s:.0f} s "
                       "(--server-timeout); its log "
                       f"ends:\n{_tail(log)}")


def _tail(log: Path, n: int = 3000) -> str:
    return log.read_text(errors="replace")[-n:] if log.exists() else "(no log)"


def stop_server(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM to the server's process group (API server, engine core), SIGKILL after
    ``grace_s``."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@contextlib.contextmanager
def vllm_server(a: argparse.Namespace, model: str, gpu: str, log: Path):
    """A server on ``gpu`` for the run's lifetime; its URL and start-up seconds. Stopped however the
    run ends."""
    port = _free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "CUDA_VISIBLE_DEVICES": gpu}
    with open(log, "w") as out:
        proc = subprocess.Popen(server_command(a, model, port), env=env, stdout=out,
                                stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        yield url, wait_ready(url, proc, a.server_timeout, log)
    finally:
        stop_server(proc)


def _free_port() -> int:
    from labsupport.groups import free_port

    return free_port()


# ---- TRL's runs
# -------------------------------------------------------------------------------------------------

def trl_reward(prompts, completions, **_) -> list[float]:
    """The capstone's reward for TRL (module level: AsyncGRPOTrainer pickles it into its rollout
    worker); a conversation's prompt and completion are their messages' text."""
    from labsupport.rl import task

    text = lambda x: x if isinstance(x, str) else "".join(m["content"] for m in x)  # noqa: E731
    return [task.reward(text(c), text(p)) for p, c in zip(prompts, completions)]


class StepClock:
    """TRL callback pieces: a step is the time between consecutive optimizer-step ends, less the
    held-out evaluation between them; ``parts()`` gives the step's parts from whatever the run
    records."""

    def __init__(self, a: argparse.Namespace, parts) -> None:
        self.a, self.parts, self.steps, self.curve = a, parts, [], []
        self.last: float | None = None
        self.eval_s = 0.0

    def begin(self) -> None:
        if self.last is None:
            self._sync()
            self.last = time.perf_counter()

    def end(self, step: int, model) -> None:
        self._sync()
        now = time.perf_counter()
        wall = now - self.last - self.eval_s
        self.steps.append({"step": step, "wall_s": wall, **self.parts(wall)})
        self.eval_s = 0.0
        if step % self.a.eval_every == 0 or step == self.a.steps:
            self.curve.append({"step": step, "eval_acc": self.evaluate(model)})
            self.eval_s = time.perf_counter() - now
        self.last = now

    def evaluate(self, model) -> float:
        import torch

        from labsupport.rl import rollout

        dev = next(model.parameters()).device.type
        with torch.autocast(dev, torch.bfloat16, enabled=self.a.precision == "bf16" and dev
                            == "cuda"):
            return rollout.held_out_accuracy(model)

    @staticmethod
    def _sync() -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()


def callback(clock: StepClock):
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            clock.begin()

        def on_step_end(self, args, state, control, model=None, **kw):
            clock.end(state.global_step, model)

    return Clock()


def _trl_common(a: argparse.Namespace, out_dir: str) -> dict[str, Any]:
    return dict(output_dir=out_dir, max_steps=a.steps, per_device_train_batch_size=a.prompts
                * a.group,
                num_generations=a.group, max_completion_length=3, learning_rate=a.lr,
                epsilon=a.clip,
                temperature=1.0, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                max_grad_norm=1.0,
                bf16=a.precision == "bf16", fp16=False, gradient_checkpointing=False, seed=a.seed,
                logging_steps=1,
                report_to="none", save_strategy="no", disable_tqdm=True)


def server_config(a: argparse.Namespace, out_dir: str, url: str):
    """GRPOTrainer in server mode, as ``bench peer`` sets up its colocate mode (same loss, KL
    weight, batch)."""
    from trl import GRPOConfig

    return GRPOConfig(**_trl_common(a, out_dir), beta=a.beta, loss_type="grpo",
                      scale_rewards="group",
                      shuffle_dataset=False, use_vllm=True, vllm_mode="server",
                      vllm_server_base_url=url,
                      vllm_group_port=_free_port(), vllm_server_timeout=a.server_timeout)


def async_config(a: argparse.Namespace, out_dir: str, url: str):
    """AsyncGRPOTrainer against the same server: float32 master weights, one micro-batch a step
    (token_budget 0)."""
    from trl.experimental.async_grpo import AsyncGRPOConfig

    return AsyncGRPOConfig(**_trl_common(a, out_dir), dtype="float32", vllm_server_base_url=url,
                           vllm_server_timeout=a.server_timeout, token_budget=0,
                           max_staleness=a.trl_max_staleness,
                           weight_sync_steps=a.trl_weight_sync_steps)


def _profiled(parts: list[tuple[str, float]]) -> None:
    """Record TRL's own profiling contexts from outside (as ``bench peer`` does)."""
    import trl.extras.profiling as profiling

    plain = profiling.ProfilingContext._log_metrics

    def record(self, duration: float) -> None:
        parts.append(("generate" if "generate" in self.name else self.name.rsplit(".", 1)[-1],
                      duration))
        plain(self, duration)

    profiling.ProfilingContext._log_metrics = record


def run_trl_server(a: argparse.Namespace) -> dict[str, Any]:
    from datasets import Dataset
    from trl import GRPOTrainer

    from labsupport.bench.peer import trl_parts
    from labsupport.rl import policy, task

    model = str(policy.warmstart_dir(seed=a.seed, size=a.size))
    parts: list[tuple[str, float]] = []
    _profiled(parts)

    def step_parts(wall: float) -> dict[str, float]:
        out = trl_parts(parts, wall)
        parts.clear()
        return out

    clock = StepClock(a, step_parts)
    prompts = task.train_prompts(a.steps * a.prompts, random.Random(a.seed))
    with tempfile.TemporaryDirectory() as tmp, vllm_server(a, model, a.server_gpu,
                                                           Path(tmp) / "server.log") as (
            url, ready_s):
        trainer = GRPOTrainer(model=model, reward_funcs=trl_reward, args=server_config(a, tmp, url),
                              train_dataset=Dataset.from_dict({"prompt": prompts}),
                              callbacks=[callback(clock)])
        clock.curve.append({"step": 0, "eval_acc": clock.evaluate(trainer.model)})
        t0 = time.perf_counter()
        trainer.train()
        loop_s = time.perf_counter() - t0
    return {"steps": clock.steps, "curve": clock.curve, "loop_s": loop_s, "server_ready_s": ready_s}


class _StalenessTee(dict):
    """AsyncGRPOTrainer's metric sink, passed through, with each consumed sample's staleness counted
    on the way."""

    def __init__(self, inner, hist: dict[str, int]) -> None:
        super().__init__()
        self.inner, self.hist = inner, hist

    def __getitem__(self, key):
        got = self.inner[key]
        if key != "sample/staleness_max":
            return got
        hist = self.hist

        class Counting(list):
            def append(self, x) -> None:
                got.append(x)
                hist[str(int(x))] = hist.get(str(int(x)), 0) + 1

        return Counting()

    def __getattr__(self, name):
        return getattr(self.inner, name)


def tree_attention_fallback():
    """A torch function with the arguments of FlashAttention's ``flash_attn_varlen_func`` that
    AsyncGRPOTrainer's tree attention calls: each segment's queries attend to its path's keys,
    causally aligned to the path's end."""
    import torch
    import torch.nn.functional as F

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=True,
               window_size=(-1, -1), **_):
        seg_q = torch.repeat_interleave(torch.arange(len(cu_q) - 1, device=q.device),
                                        cu_q.diff().long())
        seg_k = torch.repeat_interleave(torch.arange(len(cu_k) - 1, device=q.device),
                                        cu_k.diff().long())
        shift = (cu_k.diff() - cu_q.diff()).long()  # a segment's own tokens end its path
        pos_q = torch.arange(q.shape[0], device=q.device) - cu_q.long()[seg_q] + shift[seg_q]
        pos_k = torch.arange(k.shape[0], device=q.device) - cu_k.long()[seg_k]
        mask = (seg_q[:, None] == seg_k[None, :]) & (pos_k[None, :] <= pos_q[:, None])
        rep = q.shape[1] // k.shape[1]
        k, v = (x.repeat_interleave(rep, dim=1) for x in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], attn_mask=mask,
                                             scale=softmax_scale)
        return out[0].transpose(0, 1)

    return type("TorchVarlen", (), {"flash_attn_varlen_func": staticmethod(varlen)})


def attention_kernel() -> str:
    """FlashAttention-3 from the ``kernels`` hub cache if it loads (offline), else the torch
    fallback, installed in TRL's tree attention; which one, for the record."""
    import trl.experimental.async_grpo.packing as packing

    try:
        packing._flash_attn()
        return "flash-attn3 (kernels)"
    except Exception as exc:  # noqa: BLE001 (no network, no cache, no kernels package)
        fallback = tree_attention_fallback()
        packing._flash_attn = lambda: fallback
        return ("torch SDPA with a per-segment mask (FlashAttention-3 did not load: "
                f"{type(exc).__name__})")


def async_tokenizer(model: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return tok


def run_trl_async(a: argparse.Namespace) -> dict[str, Any]:
    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOTrainer
    from trl.experimental.async_grpo import async_grpo_trainer as agt

    from labsupport.rl import policy, task

    model = str(policy.warmstart_dir(seed=a.seed, size=a.size))
    attention, hist, sync = attention_kernel(), {}, []
    plain_init = agt.RolloutQueueDataset.__init__

    def init(self, *args, **kw):
        plain_init(self, *args, **kw)
        self.metrics = _StalenessTee(self.metrics, hist)

    agt.RolloutQueueDataset.__init__ = init

    def step_parts(wall: float) -> dict[str, float]:
        s = sum(sync)
        sync.clear()
        return {"sync": s, "train": wall - s}  # (generation runs in its rollout worker, overlapped)

    clock = StepClock(a, step_parts)
    prompts = task.train_prompts(a.steps * a.prompts, random.Random(a.seed))
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in prompts]})
    with tempfile.TemporaryDirectory() as tmp, vllm_server(a, model, a.server_gpu,
                                                           Path(tmp) / "server.log") as (
            url, ready_s):
        trainer = AsyncGRPOTrainer(model=model, reward_funcs=trl_reward,
                                   args=async_config(a, tmp, url),
                                   train_dataset=data, processing_class=async_tokenizer(model),
                                   callbacks=[callback(clock)])
        plain_sync = trainer._sync_weight

        def timed_sync():
            t0 = time.perf_counter()
            plain_sync()
            sync.append(time.perf_counter() - t0)

        trainer._sync_weight = timed_sync
        clock.curve.append({"step": 0, "eval_acc": clock.evaluate(trainer.model)})
        t0 = time.perf_counter()
        try:
            trainer.train()
        finally:
            with contextlib.suppress(Exception):
                trainer.rollout_worker.stop()
        loop_s = time.perf_counter() - t0
    return {"steps": clock.steps, "curve": clock.curve, "loop_s": loop_s, "server_ready_s": ready_s,
            "attention": attention,
            "staleness_histogram": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
            "settings": {"max_staleness": a.trl_max_staleness,
                         "weight_sync_steps": a.trl_weight_sync_steps}}


# ---- the capstone's runs
# ----------------------------------------------------------------------------------------

def run_capstone(a: argparse.Namespace) -> dict[str, Any]:
    """``rl.run`` in the job's architecture: co-located on one GPU, else trainer on cuda:0 and
    engine on cuda:1."""
    from labsupport import rl
    from labsupport.rl.colocated import config_overrides

    arch = a.worker.split(":")[1]
    cfg = rl.RLConfig(steps=a.steps, prompts_per_step=a.prompts, group_size=a.group, lr=a.lr,
                      beta=a.beta,
                      clip_eps=a.clip, seed=a.seed, eval_every=a.eval_every, precision=a.precision,
                      engine_share=a.engine_share, **config_overrides(a.capstone_config))
    gpu = a.device == "cuda"
    devices = ("cuda:0", "cuda:0" if arch == "colocated" else "cuda:1") if gpu else ("cpu", "cpu")
    d = rl.run(arch, cfg, engine=a.engine, devices=devices, size=a.size, verbose=False,
               memory=False)
    steps = [{"step": s["step"] + 1, "wall_s": s["wall_s"],
              **{k.removesuffix("_s"): v for k, v in s["phases"].items()}} for s in d["steps"]]
    return {"steps": steps,
            "curve": [{"step": c["step"], "eval_acc": c["eval_acc"]} for c in d["curve"]],
            "loop_s": d["loop_s"], "setup_s": d["setup_s"], "mechanisms": d["mechanisms"],
            "weights_match": d["weights_match"], "engine_final_acc": d["engine_final_acc"],
            "staleness_histogram": d["staleness_histogram"], "overlap": d["overlap"],
            "sync_errors": d["sync_errors"]}


WORKERS = {"capstone": run_capstone, "trl:server": run_trl_server, "trl:async": run_trl_async}


# ---- the summary
# -------------------------------------------------------------------------------------------------

def time_to_target(run: dict[str, Any], target: float) -> float | None:
    """Seconds of steps until the first evaluation at or above ``target`` (0.0 if the start already
    is); None if never reached. (Evaluations come every ``--eval-every`` steps: the time is that of
    the step evaluated.)"""
    walls = [s["wall_s"] for s in run["steps"]]
    for c in run["curve"]:
        if c["eval_acc"] >= target:
            return sum(walls[:c["step"]])
    return None


def summarize(run: dict[str, Any], skip: int, samples: int, gpus: int,
              target: float) -> dict[str, Any]:
    """``bench peer``'s medians after ``skip`` warm-up steps, and samples per second per GPU,
    seconds to the target accuracy, the async overlap's median and the mean staleness of the samples
    trained on."""
    from labsupport.bench.peer import summarize as medians

    out = medians(run, skip)
    out["samples_per_s_per_gpu"] = samples / (out["ms_per_step"] / 1e3) / gpus
    out["time_to_target_s"] = time_to_target(run, target)
    if run.get("overlap"):
        body = run["overlap"][skip:] or run["overlap"]
        out["overlap_median"] = statistics.median(body)
    hist = run.get("staleness_histogram")
    if hist:
        out["mean_staleness"] = sum(int(k) * n for k, n in hist.items()) / sum(hist.values())
    return out


def _median(xs: list[float | None]) -> float | None:
    return None if not xs or any(x is None for x in xs) else statistics.median(xs)


def compare(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The pairs (capstone over TRL in ms per step, per seed and their mean) and the architectures
    (medians over seeds of the capstone's runs; time to target None unless every seed reached
    it)."""
    ok = [r for r in runs if "summary" in r]
    pairs = {}
    for name, (cap, trl) in PAIRS.items():
        per_seed = {}
        for seed in sorted({r["seed"] for r in ok}):
            c = [r for r in ok if r["job"] == cap and r["seed"] == seed]
            t = [r for r in ok if r["job"] == trl and r["seed"] == seed]
            if c and t:
                per_seed[str(seed)] = (c[0]["summary"]["ms_per_step"]
                                       / t[0]["summary"]["ms_per_step"])
        pairs[name] = {"per_seed": per_seed, "mean": statistics.fmean(per_seed.values())
                       if per_seed else None}
    archs = {}
    for arch, job in ARCHS.items():
        mine = [r["summary"] for r in ok if r["job"] == job]
        if mine:
            archs[arch] = {"gpus": GPUS.get(job, 2), "seeds": len(mine),
                           **{k: _median([s.get(k) for s in mine]) for k in
                              ("ms_per_step", "samples_per_s_per_gpu", "time_to_target_s",
                               "final_acc")}}
    return {"pairs": pairs, "architectures": archs}


# ---- the parent: jobs on lanes
# ------------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    from labsupport.bench.peer import task_args

    p = task_args(argparse.ArgumentParser(prog="python -m labsupport bench peer2",
                                          description=__doc__.split("\n\n")[0]),
                  beta_help="KL weight (AsyncGRPOTrainer has none)")
    p.add_argument("--engine-share", type=float, default=0.15,
                   help="vLLM's share of its GPU's memory (all)")
    p.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--jobs", default=",".join(JOBS),
                   help=f"any of {', '.join(JOBS)}, joined by ','")
    p.add_argument("--capstone-config", default="fastest",
                   help="rl.colocated.CONFIGS names joined by '+'")
    p.add_argument("--trl-max-staleness", type=int, default=1,
                   help="AsyncGRPOTrainer's (the capstone's lag is 1)")
    p.add_argument("--trl-weight-sync-steps", type=int, default=1, help="AsyncGRPOTrainer's")
    p.add_argument("--target", type=float, default=0.8,
                   help="held-out accuracy for the time-to-target column")
    p.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the medians")
    p.add_argument("--timeout", type=float, default=900,
                   help="seconds for one job (its child is killed then)")
    p.add_argument("--server-timeout", type=float, default=420,
                   help="seconds for a vLLM server to be ready")
    p.add_argument("--gpus", type=int, default=4, help="GPUs to use, split into lanes of --lane")
    p.add_argument("--lane", type=int, default=2, help="GPUs per lane (2: trainer and engine)")
    p.add_argument("--engine", default="vllm", choices=["vllm", "transformers"],
                   help="the capstone's engine")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: the capstone's jobs only, a check of the plumbing (no TRL)")
    p.add_argument("--summarize", default=None, nargs="+", metavar="JSON",
                   help="recompute a saved result's summaries; several (the same settings, other "
                        "seeds, e.g. one machine's half hour each): one record of all their runs")
    p.add_argument("--out-name", default="bench_peer2", help=argparse.SUPPRESS)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--server-gpu", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p


def jobs(a: argparse.Namespace) -> list[tuple[str, int]]:
    """(job, seed) in run order: per seed each pair's two runs side by side, then the co-located
    run."""
    chosen = a.jobs.split(",")
    bad = [j for j in chosen if j not in JOBS]
    if bad:
        raise ValueError(f"unknown job(s) {bad}; known: {', '.join(JOBS)}")
    return [(j, int(s)) for s in a.seeds.split(",") for j in JOBS if j in chosen]


def lanes(a: argparse.Namespace, visible: str | None) -> list[list[str]]:
    """The GPU ids of each lane: ``--gpus`` of the visible GPUs in groups of ``--lane``."""
    ids = visible.split(",") if visible else [str(i) for i in range(a.gpus)]
    if a.device == "cpu":
        return [[] for _ in range(max(1, a.gpus // a.lane))]
    if a.gpus > len(ids) or a.gpus < a.lane:
        raise ValueError(f"--gpus {a.gpus} with lanes of {a.lane}, but {len(ids)} GPU(s) are "
                         f"visible ({visible})")
    return [ids[i:i + a.lane] for i in range(0, a.gpus - a.lane + 1, a.lane)]


def child_env(job: str, lane: list[str]) -> dict[str, str]:
    """The child's GPUs: the capstone sees its lane (co-located: its first GPU); TRL's trainer sees
    the first and its server gets the second (passed on, not visible to the trainer)."""
    if not lane:
        return {}
    if job.startswith("trl:"):
        return {"CUDA_VISIBLE_DEVICES": lane[0]}
    return {"CUDA_VISIBLE_DEVICES": ",".join(lane[:GPUS.get(job, 2)])}


def run_child(argv: list[str], a: argparse.Namespace, job: str, seed: int,
              lane: list[str]) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, "-m", "labsupport", "bench", "peer2", *argv, "--worker", job,
               "--seed", str(seed),
               "--out", f.name, *(["--server-gpu", lane[1]] if job.startswith("trl:") and len(lane)
                                  > 1 else [])]
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), **os.environ,
               "LABSUPPORT_PROGRESS": "0", **child_env(job, lane)}
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, timeout=a.timeout, env=env, start_new_session=True)
        return {"wall_s": time.perf_counter() - t0, **json.loads(Path(f.name).read_text())}


def run_jobs(argv: list[str], a: argparse.Namespace,
             ended: Any = lambda runs, left: None) -> list[dict[str, Any]]:
    """Every job, one per free lane; a job that fails is recorded with its error and the others go
    on. ``ended(runs, left)`` hears of the runs so far as each ends, in the jobs' order."""
    import queue
    from concurrent.futures import ThreadPoolExecutor

    free: queue.Queue[list[str]] = queue.Queue()
    all_lanes = lanes(a, os.environ.get("CUDA_VISIBLE_DEVICES"))
    for lane in all_lanes:
        free.put(lane)
    samples = a.prompts * a.group

    def one(item: tuple[str, int]) -> dict[str, Any]:
        job, seed = item
        lane = free.get()
        r: dict[str, Any] = {"job": job, "seed": seed, "lane": lane}
        try:
            print(f"== {job}, seed {seed}, GPUs {lane}", flush=True)
            r.update(run_child(argv, a, job, seed, lane))
            r["summary"] = summarize(r, a.skip, samples, GPUS.get(job, 2), a.target)
        except (subprocess.SubprocessError, OSError, ValueError, KeyError, IndexError) as exc:
            r["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            free.put(lane)
        shown = ({"error": r["error"]} if "error" in r else
                 {k: round(v, 3) for k, v in r["summary"].items() if isinstance(v, float)})
        print(json.dumps({"job": job, "seed": seed, **shown}), flush=True)
        return r

    todo, done = jobs(a), []
    with ThreadPoolExecutor(len(all_lanes)) as pool:
        for r in pool.map(one, todo):
            done.append(r)
            ended(done, len(todo) - len(done))
    return done


def unequal(a: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, str]:
    """UNEQUAL, plus what a run recorded: TRL async's attention kernel, the capstone's
    configuration."""
    out = dict(UNEQUAL)
    kernels = sorted({r["attention"] for r in runs if r.get("attention")})
    if kernels:
        out["attention (async)"] = ("AsyncGRPOTrainer's tree attention ran on "
                                    + "; ".join(kernels) +
                                    "; the capstone's trainer runs transformers' default attention")
    out["capstone configuration"] = (f"the capstone runs configuration {a.capstone_config!r} "
                                     "(rl.colocated.CONFIGS) in every architecture; TRL runs as "
                                     "set up out of the box, but for the settings named equal")
    return out


SETTINGS = ("steps", "prompts", "group", "lr", "beta", "clip", "size", "seeds", "eval_every",
            "engine_share",
            "precision", "jobs", "capstone_config", "trl_max_staleness", "trl_weight_sync_steps",
            "target", "skip",
            "gpus", "lane", "engine", "device")


def record(a: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"settings": {k: getattr(a, k) for k in SETTINGS}, "completion_tokens": 3,
            "equal": EQUAL,
            "unequal": unequal(a, runs), "runs": runs, **compare(runs),
            "shared_host": ("lanes of GPUs side by side on one host: a pair's two runs started "
                            "together, sharing the host's CPUs, and one run's start-up overlapped "
                            "another's timed steps")}


def main(argv: list[str]) -> int:
    a = parser().parse_args(argv)
    from labsupport.rl.colocated import config_overrides

    config_overrides(a.capstone_config)  # an unknown name fails now
    if a.worker:
        fn = WORKERS["capstone" if a.worker.startswith("capstone:") else a.worker]
        Path(a.out).write_text(json.dumps(fn(a), default=str))
        return 0
    if a.summarize:
        return resummarize([Path(p) for p in a.summarize])
    if a.device == "cpu" and any(j.startswith("trl:") for j in a.jobs.split(",")):
        raise SystemExit("--device cpu runs the capstone's jobs only: pass --jobs with "
                         "capstone:... jobs")
    from labsupport.course import results

    def ended(runs: list[dict[str, Any]], left: int) -> None:  # a machine taken away mid-run
        if left:  # leaves the runs that ended, and says how many did not
            results.save_result(a.out_name, {**record(a, runs), "unfinished": left})

    runs = run_jobs(argv, a, ended)
    data = record(a, runs)
    print(json.dumps({"pairs": data["pairs"], "architectures": data["architectures"]}, indent=1))
    print("wrote", results.save_result(a.out_name, data))
    return 0


def merged(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """One record of runs saved apart (their settings equal but for the seeds, no run twice)."""
    first, runs = recs[0], [r for rec in recs for r in rec["data"]["runs"]]
    for rec in recs[1:]:
        if diff := [k for k in SETTINGS if k not in ("seeds", "gpus")
                    and rec["data"]["settings"].get(k) != first["data"]["settings"].get(k)]:
            raise ValueError(f"these runs differ in {', '.join(diff)}: only runs of the same "
                             "settings (other seeds) make one record")
    keys = [(r["job"], r["seed"]) for r in runs]
    if twice := sorted({k for k in keys if keys.count(k) > 1}):
        raise ValueError(f"runs recorded twice (job, seed): {twice}; merge one of each")
    seeds = sorted({int(s) for rec in recs
                    for s in str(rec["data"]["settings"]["seeds"]).split(",")})
    left = sum(rec["data"].get("unfinished", 0) for rec in recs)  # jobs a cut run never ended
    data = {k: v for k, v in first["data"].items() if k != "unfinished"}
    return {**first, "command": "; ".join(rec["command"] for rec in recs),
            "date": max(rec["date"] for rec in recs),
            "data": {**data, "runs": runs, **({"unfinished": left} if left else {}),
                     "settings": {**first["data"]["settings"],
                                  "seeds": ",".join(map(str, seeds))}}}


def resummarize(paths: list[Path]) -> int:
    """Rewrite a saved result's summaries and comparisons from the steps it recorded; of several,
    one record (``merged``) as ``bench_peer2.<machine>.json`` beside the first."""
    from labsupport.course import results

    rec = merged([json.loads(p.read_text()) for p in paths])
    data, st = rec["data"], rec["data"]["settings"]
    for r in data["runs"]:
        if "steps" in r:
            r["summary"] = summarize(r, st["skip"], st["prompts"] * st["group"],
                                     GPUS.get(r["job"], 2), st["target"])
    data.update(compare(data["runs"]))
    path = paths[0] if len(paths) == 1 else paths[0].with_name(
        f"bench_peer2.{rec['machine_tag']}.json")
    rec["summarized"] = "python -m labsupport bench peer2 --summarize " + " ".join(
        p.name for p in paths)
    results.write_record(path, rec, None)
    print("rewrote" if len(paths) == 1 else "wrote", path)
    return 0


# ---- what the book prints
# ---------------------------------------------------------------------------------------

def _fmt(x: float | None, spec: str, unit: str = "") -> str:
    return "not reached" if x is None else f"{x:{spec}}{unit}"


def architecture_lines(data: dict[str, Any]) -> list[str]:
    """The architectures at equal work, one line each (medians over seeds), then the async loop's
    overlap and staleness, for the chapters' cells."""
    target = data["settings"]["target"]
    lines = [f"{'architecture':14s} {'GPUs':>4s} {'ms/step':>8s} {'samples/s/GPU':>14s} "
             f"{f'to acc {target:.2f}':>12s} {'final acc':>9s}"]
    for arch, s in data["architectures"].items():
        lines.append(f"{arch:14s} {s['gpus']:4d} {_fmt(s['ms_per_step'], '8.0f')} "
                     f"{_fmt(s['samples_per_s_per_gpu'], '14.0f')} "
                     f"{_fmt(s['time_to_target_s'], '11.1f', ' s'):>12s} "
                     f"{_fmt(s['final_acc'], '9.2f')}")
    for r in data["runs"]:
        s = r.get("summary", {})
        if r["job"].endswith("async") and "summary" in r:
            lines.append(f"{r['job']} seed {r['seed']}: staleness histogram (samples per lag) "
                         f"{r.get('staleness_histogram')}"
                         + (f", step / max(generate, learn) median {s['overlap_median']:.2f}"
                            if "overlap_median" in s
                                                              else ""))
    return lines


def pair_lines(data: dict[str, Any]) -> list[str]:
    """Each pair's capstone-over-TRL ratio (per seed and mean), and any run that failed, for the
    chapters' cells."""
    lines = []
    for name, p in data["pairs"].items():
        cap, trl = PAIRS[name]
        seeds = ", ".join(f"seed {k}: {v:.2f}" for k, v in p["per_seed"].items())
        lines.append(f"{cap} / {trl}, ms per step: "
                     + (f"{p['mean']:.2f} ({seeds})" if p["mean"] is not None
                                                        else "no pair completed"))
    lines += [f"{r['job']} seed {r['seed']} failed: {r['error'][:200]}" for r in data["runs"]
              if "error" in r]
    return lines
