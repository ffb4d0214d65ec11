"""Assignment 6, seeded bug: the KL term's exponential is computed from a detached difference: the loss has the
right value, but the KL penalty's gradient is wrong (it pushes logp towards the reference with a constant
slope instead of the k3 estimator's), so the policy drifts from the reference more than beta allows."""

import torch

from grading.reference import a6 as ref  # noqa: F401

LOSES = {"test_grpo_loss_gradient_and_parameters"}


def grpo_loss(logp, logp_old, logp_ref, advantages, mask, clip_eps=0.2, beta=0.02, token_weights=None):
    mask = mask.to(logp.dtype)
    adv = advantages[:, None].to(logp.dtype)
    ratio = torch.exp(logp - logp_old)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    if token_weights is not None:
        surrogate = surrogate * token_weights.detach()
    d = logp_ref - logp
    kl = torch.exp(d.detach()) - d - 1  # the bug: exp of a detached difference
    per_seq = (-(surrogate - beta * kl) * mask).sum(1) / mask.sum(1).clamp(min=1)
    loss = per_seq.mean()
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        stats = {"loss": loss.item(), "kl": ((kl * mask).sum() / n).item(),
                 "ratio_mean": ((ratio * mask).sum() / n).item(), "ratio_max": ratio[mask.bool()].max().item(),
                 "clip_frac": ((((ratio - 1).abs() > clip_eps).to(mask.dtype) * mask).sum() / n).item()}
    return loss, stats
