"""GRPO, the learning code shared by every orchestration: group advantages, the clipped surrogate
with a KL penalty, per-token log-probabilities under a model, the trainer's step, and the correction
for an engine whose log-probabilities are not the trainer's: their distribution
(:func:`mismatch_stats`) and the truncated (TIS) or masked (MIS) importance weights that correct the
loss for it (Chapter 9, Lab 9)."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

from labsupport.rl.rollout import Rollout, left_pad

# the trainer's: float32, or bfloat16 autocast over float32 master weights
PRECISIONS = ("fp32", "bf16")


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6, scale: bool = True) -> torch.Tensor:
    """GRPO's baseline: each reward minus its group's mean, divided by the group's std (rewards: [B,
    G]).

    A group whose members all got the same reward has zero advantage: it teaches nothing.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [prompts, group], found shape {list(rewards.shape)}")
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale:
        return centred
    return centred / (rewards.std(dim=1, keepdim=True, unbiased=True).nan_to_num(0.0) + eps)


def grpo_loss(logp: torch.Tensor, logp_old: torch.Tensor, logp_ref: torch.Tensor,
              advantages: torch.Tensor, mask: torch.Tensor, clip_eps: float = 0.2,
              beta: float = 0.02, token_weights: torch.Tensor | None = None) -> tuple[torch.Tensor,
                                                                                      dict[str,
                                                                                           float]]:
    """GRPO's clipped surrogate with a KL penalty to the reference, averaged per sequence, then over
    sequences.

    logp/logp_old/logp_ref/mask: [N, T] per completion token (policy now, behaviour policy that
    sampled it, frozen reference); advantages: [N]. ratio = exp(logp - logp_old) corrects for
    samples that came from an older policy (asynchronous loop); KL uses the k3 estimator exp(ref -
    logp) - (ref - logp) - 1 >= 0. ``token_weights`` ([N, T], no gradient) multiply each token's
    surrogate: the TIS/MIS correction of :class:`GRPOTrainer` when ``logp_old`` is the trainer's own
    and the engine's log-probabilities differ.
    """
    loss, stats = _loss(logp, logp_old, logp_ref, advantages, mask, clip_eps, beta, token_weights)
    return loss, _floats(stats)


def _loss(logp, logp_old, logp_ref, advantages, mask, clip_eps, beta, token_weights):
    """:func:`grpo_loss` with its statistics left on the device (read once, after the optimizer
    step: a read in between would make the host wait for the forward pass before it could queue the
    backward pass)."""
    mask = mask.to(logp.dtype)
    adv = advantages[:, None].to(logp.dtype)
    ratio = torch.exp(logp - logp_old)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    if token_weights is not None:
        surrogate = surrogate * token_weights.detach()
    d = logp_ref - logp
    kl = torch.exp(d) - d - 1
    per_token = -(surrogate - beta * kl)
    per_seq = (per_token * mask).sum(1) / mask.sum(1).clamp(min=1)
    loss = per_seq.mean()
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        clipped = ((ratio - 1).abs() > clip_eps).to(mask.dtype)
        stats = {"loss": loss.detach(), "kl": (kl * mask).sum() / n,
                 "ratio_mean": (ratio * mask).sum() / n, "ratio_max": _masked_max(ratio,
                                                                                  mask.bool(), 1.0),
                 "clip_frac": (clipped * mask).sum() / n}
    return loss, stats


def _masked_max(x: torch.Tensor, mask: torch.Tensor, empty: float) -> torch.Tensor:
    """The largest of ``x`` where ``mask`` is set (``empty`` if none is), without a read to the
    host."""
    top = torch.where(mask, x, torch.full_like(x, -torch.inf)).max()
    return torch.where(mask.any(), top, torch.full_like(top, empty))


def _floats(stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """Scalar tensors as floats, in one read from the device."""
    return dict(zip(stats, torch.stack([v.float() for v in stats.values()]).tolist()))


def scoring_inputs(prompt_ids: Sequence[Sequence[int]], completion_ids: torch.Tensor,
                   device) -> dict[str, torch.Tensor]:
    """The model inputs that score completions: each prompt left-padded, then its completion, with
    the attention mask and positions (built once a step, for the policy's and the reference's
    pass)."""
    ids, att = left_pad(prompt_ids, device)
    comp = completion_ids.to(device)
    att = torch.cat([att, torch.ones_like(comp)], 1)
    return {"input_ids": torch.cat([ids, comp], 1), "attention_mask": att,
            "position_ids": (att.cumsum(-1) - 1).clamp(min=0)}


def token_logprobs(model, prompt_ids: Sequence[Sequence[int]], completion_ids: torch.Tensor,
                   inputs: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Log-probability under ``model`` of each completion token given its prompt: [N, T]
    (``inputs``: :func:`scoring_inputs`' of these, if already built). No KV cache is built: nothing
    decodes after it."""
    inputs = inputs or scoring_inputs(prompt_ids, completion_ids, next(model.parameters()).device)
    width = completion_ids.shape[1]
    logits = model(**inputs, use_cache=False).logits[:, -width - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, inputs["input_ids"][:, -width:,
                                                                        None]).squeeze(-1)


def compile_layers(model, graphs: bool = False) -> None:
    """Regional compilation: each decoder layer of a transformers model compiled in place for fixed
    shapes. The layers share their code, so one compilation serves them all, and a first step
    compiles one layer, not the whole model. ``graphs``: the compiled layers are also recorded as
    CUDA graphs and replayed (``mode="reduce-overhead"``), forward and backward: one launch per
    layer instead of one per kernel. A replay reuses its output memory, so a training step begins
    with ``torch.compiler.cudagraph_mark_step_begin()``. Attention becomes the plain composition of
    matrix products and softmax, compiled with the rest of the layer: with a few tokens per sequence
    and hundreds of sequences, torch's fused attention kernels (cuDNN's first, on recent GPUs) made
    the step slower than the composition does."""
    model.set_attn_implementation("eager")
    for layer in model.model.layers:
        layer.compile(dynamic=False, mode="reduce-overhead" if graphs else None)


class GRPOTrainer:
    """The learning code, identical in every orchestration: one optimizer step per batch of
    rollouts."""

    def __init__(self, model, *, lr: float = 2e-3, beta: float = 0.02, clip_eps: float = 0.2,
                 correction: str | None = None, is_cap: float = 2.0, precision: str = "fp32",
                 compile: bool = False, graphs: bool = True) -> None:
        """``correction``: None uses the engine's log-probabilities as the behaviour policy (the PPO
        ratio then corrects staleness and sampler/trainer mismatch together); "tis" or "mis"
        recomputes them with the trainer and weights each token by the engine-to-trainer ratio,
        truncated at ``is_cap`` (TIS) or masked outside [1/is_cap, is_cap] (MIS), as verl and TRL do
        (:func:`token_weights`). ``precision``: "fp32", or "bf16" mixed precision: the forward
        passes (policy and reference) run under ``torch.autocast`` in bfloat16 while the weights,
        gradients and Adam stay float32 (master weights), as ``accelerate``'s
        ``mixed_precision="bf16"`` (TRL's ``bf16=True``) does. The loss is float32 either way.
        ``compile``: the scoring passes (policy and reference, forward and backward) run compiled.
        At a small model's size they are bound by launching thousands of small kernels from Python;
        see :func:`compile_layers`. ``graphs``: on a GPU the compiled passes also replay as CUDA
        graphs, unless False (``rl.loop`` says False beside an engine whose own CUDA graphs live in
        this process: :func:`labsupport.rl.colocated.trainer_graphs`). The weights, the optimizer
        and the held-out check (eager: :func:`~labsupport.rl.rollout.sample`) are unchanged."""
        _check_correction(correction)
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        self.correction, self.is_cap, self.precision = correction, is_cap, precision
        self.model = model
        self.ref = copy.deepcopy(model).eval().requires_grad_(False)
        # one fused kernel per step on a GPU (as transformers' default)
        cuda = next(model.parameters()).is_cuda
        self.graphs = compile and cuda and graphs
        if compile:
            for m in (model, self.ref):
                compile_layers(m, graphs=self.graphs)
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, fused=True if cuda
                                     else None)
        self.beta, self.clip_eps = beta, clip_eps
        self.version = 0  # bumped by each optimizer step

    def autocast(self) -> torch.autocast:
        """The trainer's precision for a forward pass: bfloat16 autocast under "bf16", nothing under
        "fp32"."""
        device = next(self.model.parameters()).device
        return torch.autocast(device.type, torch.bfloat16, enabled=self.precision == "bf16")

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p.detach()) for n, p in self.model.named_parameters()]

    def step(self, rollout: Rollout, rewards: torch.Tensor) -> dict[str, float]:
        """One GRPO update from ``rollout`` scored with ``rewards`` ([N]); returns loss and
        staleness stats."""
        adv = group_advantages(rewards.view(-1, rollout.n)).view(-1)
        device = next(self.model.parameters()).device
        mask = rollout.mask.to(device)
        inputs = scoring_inputs(rollout.prompt_ids, rollout.completion_ids, device)
        if self.graphs:
            # a new step: the last one's graph outputs may be reused
            torch.compiler.cudagraph_mark_step_begin()
        self.model.train()
        with self.autocast():
            with torch.no_grad():
                ref = token_logprobs(self.ref, rollout.prompt_ids, rollout.completion_ids, inputs)
            logp = token_logprobs(self.model, rollout.prompt_ids, rollout.completion_ids, inputs)
        # with a correction, the behaviour log-probabilities are the trainer's own (these weights,
        # before the step: the forward pass just made, without its gradient), and the engine's enter
        # through the weights
        old = logp.detach() if self.correction else None
        engine_lp = rollout.logprobs.to(device)
        weights = None if old is None else token_weights(old, engine_lp, self.correction,
                                                         self.is_cap)
        loss, stats = _loss(logp, engine_lp if old is None else old, ref, adv.to(device), mask,
                            self.clip_eps, self.beta, weights)
        if old is not None:
            m, ratio = mask.bool(), torch.exp(old - engine_lp)
            affected = (
                ratio > self.is_cap
                if self.correction == "tis"
                else mis_mask(old, engine_lp, self.is_cap) == 0
            )
            n = m.sum().clamp(min=1)
            stats.update(is_ratio_max=_masked_max(ratio, m, 1.0), is_weight_mean=(weights * m).sum()
                         / n, is_affected=(affected & m).sum() / n)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)  # the gradients' memory is free while the engine works
        self.model.eval()
        stats = _floats(stats)  # the step's one read from the device, after everything is queued
        stats["staleness"] = self.version - rollout.version
        self.version += 1
        return stats


# ----------------------------------------------------------------------------- sampler/trainer
# mismatch

CORRECTIONS = (None, "tis", "mis")


def _check_correction(correction: str | None) -> None:
    if correction not in CORRECTIONS:
        raise ValueError(f"correction must be None, 'tis' or 'mis', got {correction!r}")


def mismatch_stats(logp_trainer: torch.Tensor, logp_engine: torch.Tensor, mask: torch.Tensor,
                   cap: float = 2.0) -> dict[str, float]:
    """The distribution of the per-token difference d = trainer - engine log-probability (the log of
    the importance ratio the loss should use): quantiles of abs(d), the ratio's range, the share of
    tokens a TIS cap would truncate or MIS would mask, and the effective sample size of the raw and
    truncated weights."""
    d = (logp_trainer - logp_engine)[mask.bool()].double()
    ratio = d.exp()
    # 1.0: every token counts fully
    ess = lambda w: (w.sum() ** 2 / (w ** 2).sum() / w.numel()).item()
    q = torch.quantile(d.abs(), torch.tensor([0.5, 0.9, 0.99], dtype=torch.double))
    return {"tokens": int(d.numel()), "mean_d": d.mean().item(), "std_d": d.std().item(),
            "abs_d_p50": q[0].item(), "abs_d_p90": q[1].item(), "abs_d_p99": q[2].item(),
            "abs_d_max": d.abs().max().item(), "ratio_min": ratio.min().item(),
            "ratio_max": ratio.max().item(), "truncated": (ratio > cap).double().mean().item(),
            "masked": ((ratio > cap) | (ratio < 1 / cap)).double().mean().item(),
            "ess": ess(ratio), "ess_tis": ess(ratio.clamp(max=cap))}


def tis_weights(logp_trainer: torch.Tensor, logp_engine: torch.Tensor,
                cap: float = 2.0) -> torch.Tensor:
    """Truncated importance sampling: per-token weights min(pi_trainer / pi_engine, cap), without
    gradient. Multiplying the policy-gradient loss by them corrects for the engine's distribution
    with bounded variance."""
    return torch.exp(logp_trainer.detach() - logp_engine).clamp(max=cap)


def mis_mask(logp_trainer: torch.Tensor, logp_engine: torch.Tensor,
             cap: float = 2.0) -> torch.Tensor:
    """Masked importance sampling: 1 for tokens whose ratio lies in [1/cap, cap], 0 for the rest
    (dropped from the loss: the engine sampled them from a distribution too far from the
    trainer's)."""
    ratio = torch.exp(logp_trainer.detach() - logp_engine)
    return ((ratio <= cap) & (ratio >= 1 / cap)).to(logp_trainer.dtype)


def token_weights(logp_trainer: torch.Tensor, logp_engine: torch.Tensor, correction: str | None,
                  cap: float = 2.0) -> torch.Tensor:
    """Per-token weights without gradient: 1 (``None``: the mismatch ignored), the ratio truncated
    at ``cap`` (``"tis"``), or the ratio where it lies in [1/cap, cap] and 0 elsewhere
    (``"mis"``)."""
    _check_correction(correction)
    if correction == "tis":
        return tis_weights(logp_trainer, logp_engine, cap)
    if correction == "mis":
        return torch.exp(logp_trainer.detach() - logp_engine) * mis_mask(logp_trainer, logp_engine,
                                                                         cap)
    return torch.ones_like(logp_trainer)


def corrected_pg_loss(logp: torch.Tensor, logp_engine: torch.Tensor, advantages: torch.Tensor,
                      mask: torch.Tensor, correction: str | None = "tis",
                      cap: float = 2.0) -> torch.Tensor:
    """A policy-gradient loss on engine samples, -mean(w * logp * A) per token, with w from
    ``correction`` (:func:`token_weights`)."""
    w, m = token_weights(logp, logp_engine, correction, cap), mask.to(logp.dtype)
    return -(w * logp * advantages[:, None] * m).sum() / m.sum().clamp(min=1)
