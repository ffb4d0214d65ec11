"""Assignment 6: the GRPO loss with group advantages, and its TIS/MIS correction.

GRPO samples a group of G completions per prompt and needs no value model: each completion's advantage is its
reward against its group's. The loss is PPO's clipped surrogate per token with a KL penalty to a frozen
reference policy. When the sampler is not the trainer (vLLM's kernels, its precision, or weights one step
behind), the engine's log-probabilities differ from the trainer's for the same tokens; truncated importance
sampling (TIS) weights each token by the trainer-to-engine probability ratio, capped, and masked importance
sampling (MIS) drops the tokens whose ratio is out of range.

Contract (``grading/test_a6_grpo.py``): values match the formulas below token by token, at every parameter
(not only the defaults), in the inputs' dtype; the *gradient* with respect to ``logp`` is the formula's (a
loss can be right in value and push the policy the wrong way); weights and masks carry no gradient; a policy
trained with your loss learns the rewarded action. Chapter 9 explains the correction; the capstone (Lab 10)
trains with this loss.
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6, scale: bool = True) -> torch.Tensor:
    """``rewards`` [B prompts, G completions] -> advantages [B, G]: each reward minus its group's mean, divided
    (``scale``) by the group's standard deviation (unbiased; 0 for a group of one) plus ``eps``, in the
    rewards' dtype. A group whose rewards are all equal has advantage 0. A tensor that is not 2-D raises
    ``ValueError`` saying the shape it expected and the one it got."""
    raise NotImplementedError


def grpo_loss(logp: torch.Tensor, logp_old: torch.Tensor, logp_ref: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, clip_eps: float = 0.2, beta: float = 0.02,
              token_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO's loss and its statistics.

    ``logp``, ``logp_old``, ``logp_ref``, ``mask``: [N, T] per completion token (the policy being trained, the
    behaviour policy that sampled the token, the frozen reference; mask 1 for real tokens); ``advantages``: [N].
    Per token: ``ratio = exp(logp - logp_old)``, surrogate ``min(ratio * A, clip(ratio, 1 - clip_eps,
    1 + clip_eps) * A)``, multiplied by ``token_weights`` [N, T] when given (treated as constants: no gradient
    through them), and ``kl = exp(d) - d - 1`` with ``d = logp_ref - logp``; the token's loss is
    ``-(surrogate - beta * kl)``. Average over each sequence's masked tokens, then over sequences. ``mask`` may
    be bool or float; the loss is in ``logp``'s dtype, and its gradient reaches ``logp`` through every term
    that depends on it (both branches of the surrogate, the KL), and nothing else.

    Returns ``(loss, stats)`` with floats ``stats["loss"]``, ``"kl"`` (mean over masked tokens), ``"ratio_mean"``
    and ``"ratio_max"`` (over masked tokens), ``"clip_frac"`` (share of masked tokens with |ratio - 1| > clip_eps).
    """
    raise NotImplementedError


def tis_weights(logp_trainer: torch.Tensor, logp_engine: torch.Tensor, cap: float = 2.0) -> torch.Tensor:
    """Truncated importance sampling: per-token weights ``min(exp(logp_trainer - logp_engine), cap)`` in
    ``logp_trainer``'s dtype, without gradient (a constant factor of each token's loss)."""
    raise NotImplementedError


def mis_mask(logp_trainer: torch.Tensor, logp_engine: torch.Tensor, cap: float = 2.0) -> torch.Tensor:
    """Masked importance sampling: 1.0 for tokens whose ratio ``exp(logp_trainer - logp_engine)`` lies in
    ``[1/cap, cap]`` (the bounds included), 0.0 for the rest, in ``logp_trainer``'s dtype, without gradient."""
    raise NotImplementedError
