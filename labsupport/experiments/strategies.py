"""One RLHF step (generate -> reward -> train) under three memory strategies, recorded phase by
phase (Lab 2).

``rlhf_step`` runs a small Qwen2 policy (``labsupport.course.models``) through generation into a KV
pool allocated up front, a rule-based reward and a policy-gradient update with Adam, each phase a
``with tl.phase(...)`` block of a ``labsupport.core.timeline.Timeline`` (or its
``labsupport.memory.MemoryTimeline``). The strategies differ in what stays on the GPU
(``STRATEGY_TEXT``). ``measure_overhead`` times the step with and without a timeline.
"""
from __future__ import annotations

import contextlib
import gc
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from labsupport.core import timeline
from labsupport.core.devices import synchronize as _sync
from labsupport.course import models, progress
from labsupport.memory import MemoryTimeline, move_optimizer_state

STRATEGIES = ("resident", "kv_freed", "offloaded")
STRATEGY_TEXT = {"resident": "everything resident: KV pool, gradients and Adam state stay on the "
                             "GPU",
                 "kv_freed": "KV pool freed after generation, gradients freed after the optimizer "
                             "step",
                 "offloaded": "KV freed, and Adam state parked in pinned host memory outside "
                              "training"}


@dataclass
class StepConfig:
    """Model shape and rollout/training sizes of the demo RLHF step (fp32 weights and Adam)."""
    layers: int = 2
    hidden: int = 128
    heads: int = 2
    kv_heads: int = 2
    intermediate: int = 256
    batch: int = 8  # rollouts per step
    prompt_len: int = 8
    new_tokens: int = 8
    # KV pool length per sequence, allocated up front like an inference engine's pool
    kv_len: int = 256
    micro_batch: int = 4
    lr: float = 1e-4
    seed: int = 0

    def overrides(self) -> dict[str, int]:
        return dict(num_hidden_layers=self.layers, hidden_size=self.hidden,
                    num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                    intermediate_size=self.intermediate, head_dim=64,
                    max_position_embeddings=max(self.kv_len, 256))


CPU_CONFIG = StepConfig()
# ~206M parameters (0.82 GB of fp32 weights); KV pool 64 x 1024 tokens = 8.6 GB, larger than the
# gradients plus one micro-batch's activations, so each strategy has a different peak.
GPU_CONFIG = StepConfig(layers=16, hidden=1024, heads=16, kv_heads=16, intermediate=2816, batch=64,
                        prompt_len=32, new_tokens=64, kv_len=1024, micro_batch=16)


@dataclass
class RLHFState:
    """The policy, its Adam optimizer and its KV pool, kept between steps."""
    strategy: str
    config: StepConfig
    device: torch.device
    model: Any
    optimizer: torch.optim.Optimizer
    kv: list[torch.Tensor] = field(default_factory=list)  # the KV pool's tensors (empty when freed)
    cache: Any = None
    steps: int = 0


def make_state(strategy: str, config: StepConfig | None = None,
               device: str | torch.device = "cpu") -> RLHFState:
    """Build the policy (a Qwen2 from labsupport.course.models, random init) and Adam on device."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: expected one of {STRATEGIES}")
    cfg = config or CPU_CONFIG
    model = models.build_model(seed=cfg.seed, **cfg.overrides()).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    return RLHFState(strategy, cfg, torch.device(device), model, opt)


def register_roles(tl: MemoryTimeline, state: RLHFState) -> None:
    """Tell the timeline which tensors are weights, gradients, optimizer state and KV cache."""
    tl.register("weights", state.model, name="policy")
    tl.register("gradients", state.model, name="policy.grad")
    tl.register("optimizer", state.optimizer, name="adam")
    tl.register("kv_cache", state.kv, name="kv pool")


def _generate(state: RLHFState, g: torch.Generator) -> torch.Tensor:
    """Prompts and ``new_tokens`` sampled answers, through a KV pool allocated up front as an
    engine's is."""
    from transformers import StaticCache

    c, dev, model = state.config, state.device, state.model
    if state.cache is None:
        state.cache = StaticCache(config=model.config, max_cache_len=c.kv_len)
        state.cache.early_initialization(batch_size=c.batch, num_heads=c.kv_heads, head_dim=64,
                                         dtype=next(model.parameters()).dtype, device=dev)
        state.kv[:] = [t for layer in state.cache.layers for t in (layer.keys, layer.values)]
    else:
        state.cache.reset()
    prompts = torch.randint(3, model.config.vocab_size, (c.batch, c.prompt_len), device=dev,
                            generator=g)
    seq, tok_in, pos = prompts, prompts, torch.arange(c.prompt_len, device=dev)
    for _ in range(c.new_tokens):
        logits = model(tok_in, past_key_values=state.cache, cache_position=pos,
                       use_cache=True).logits[:, -1]
        tok_in = torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=g)
        seq = torch.cat([seq, tok_in], 1)
        pos = pos[-1:] + 1
    return seq


def _train(state: RLHFState, seq: torch.Tensor, adv: torch.Tensor,
           tl: timeline.Timeline | None) -> float:
    """Policy-gradient backward passes over micro-batches; a ``MemoryTimeline`` also counts
    activations and samples after each forward pass, where they peak."""
    c, model = state.config, state.model
    full = isinstance(tl, MemoryTimeline)  # the core timeline samples at phase edges only
    gen, total, n_micro = seq[:, c.prompt_len:], 0.0, max(1, c.batch // c.micro_batch)
    model.train()
    for mb in range(n_micro):
        sl = slice(mb * c.micro_batch, (mb + 1) * c.micro_batch)
        with tl.track_activations() if full else contextlib.nullcontext():
            logits = model(seq[sl, :-1], use_cache=False).logits[:, c.prompt_len - 1:]
            logp = torch.log_softmax(logits.float(), -1).gather(-1, gen[sl, :, None]).squeeze(-1)
            loss = -(adv[sl, None] * logp).mean() / n_micro
        if full:
            tl.sample("forward")
        loss.backward()
        total += loss.item()
        del logits, logp, loss
    return total


def rlhf_step(state: RLHFState, tl: timeline.Timeline | None = None) -> dict[str, float]:
    """One RLHF step, phase by phase: generate (KV pool), [free KV], reward, [reload Adam], train,
    optimizer step, [offload Adam]. The bracketed phases depend on state.strategy."""
    c, dev, opt = state.config, state.device, state.optimizer
    phase = tl.phase if tl is not None else (lambda name: contextlib.nullcontext())
    g = torch.Generator(device=dev).manual_seed(c.seed + state.steps)
    t0 = time.perf_counter()
    with phase("generate"), torch.no_grad():
        state.model.eval()
        seq = _generate(state, g)
        _sync(dev)
    if state.strategy != "resident":
        with phase("free_kv"):
            state.kv.clear()
            state.cache = None
            if dev.type == "cuda":
                # give the pool back to the driver, as an engine's sleep() does
                torch.cuda.empty_cache()
    with phase("reward"):
        gen = seq[:, c.prompt_len:]
        # a rule-based reward: how often a token is its predecessor + 1 (the course's "succession"
        # pattern)
        reward = (gen[:, 1:] == gen[:, :-1] + 1).float().mean(1)
        adv = (reward - reward.mean()) / (reward.std() + 1e-6)
    if state.strategy == "offloaded" and state.steps > 0:
        with phase("reload_optimizer"):
            move_optimizer_state(opt, dev)
    with phase("train"):
        loss = _train(state, seq, adv, tl)
        _sync(dev)
    with phase("optimizer_step"):
        opt.step()
        opt.zero_grad(set_to_none=state.strategy != "resident")
        _sync(dev)
    if state.strategy == "offloaded":
        with phase("offload_optimizer"):
            move_optimizer_state(opt, "cpu")
    state.steps += 1
    return {"reward_mean": reward.mean().item(), "loss": loss, "step_s": time.perf_counter() - t0}


def release_state(state: RLHFState) -> None:
    """Free a state's KV pool, model and optimizer, and return cached GPU memory to the driver."""
    state.model = state.optimizer = state.cache = None
    state.kv.clear()
    gc.collect()
    if state.device.type == "cuda":
        torch.cuda.empty_cache()


def run_strategy(strategy: str, config: StepConfig, device: str | torch.device, *,
                 interval_s: float = 0.01, snapshot: str | Path
                 | None = None) -> tuple[MemoryTimeline, dict]:
    """Warm up one step (creates Adam state), then record one step of strategy on a fresh timeline.
    With snapshot= (GPU only) the recorded step's allocator history is saved for memory_viz."""
    state = make_state(strategy, config, device)
    try:
        rlhf_step(state)  # warm-up: Adam state exists from here on, and lazy CUDA init is done
        _sync(state.device)
        gc.collect()
        tl = MemoryTimeline(state.device, name=strategy, interval_s=interval_s)
        register_roles(tl, state)
        if snapshot:
            tl.start_history()
        with tl.sampling():
            info = rlhf_step(state, tl)
        info["params"] = sum(p.numel() for p in state.model.parameters())
        if snapshot:
            info["snapshot"] = str(tl.save_snapshot(snapshot))
        tl.forget_sources()
        return tl, info
    finally:
        release_state(state)


def measure_overhead(config: StepConfig | None = None, device: str | torch.device = "cpu", *,
                     repeats: int = 5, interval_s: float = 0.01) -> dict[str, float]:
    """Step time with the background sampler vs without any timeline (alternating, medians)."""
    state = make_state("kv_freed", config, device)
    try:
        rlhf_step(state)
        off, on, busy = [], [], []
        for _ in progress.bar(range(repeats), desc="sampler overhead: step pairs", unit="pair",
                              leave=False):
            off.append(rlhf_step(state)["step_s"])
            tl = MemoryTimeline(state.device, interval_s=interval_s)
            register_roles(tl, state)
            with tl.sampling():
                on.append(rlhf_step(state, tl)["step_s"])
            busy.append(tl.to_dict()["sampler"]["busy_s"] / on[-1])
        m_off, m_on = statistics.median(off), statistics.median(on)
        return {"step_s_without": m_off, "step_s_with": m_on, "overhead": (m_on - m_off) / m_off,
                "sampler_busy_fraction": statistics.median(busy), "interval_s": interval_s,
                "repeats": repeats, "steps_without": off, "steps_with": on}
    finally:
        release_state(state)
