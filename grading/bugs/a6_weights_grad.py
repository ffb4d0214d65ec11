"""Assignment 6, seeded bug: the token weights are multiplied in without ``detach()``: when they were computed
from the policy's log-probabilities, the loss also pushes on the weights, a gradient the correction never meant."""

import torch

LOSES = {"test_token_weights_scale_the_surrogate_as_constants"}


def grpo_loss(logp, logp_old, logp_ref, advantages, mask, clip_eps=0.2, beta=0.02, token_weights=None):
    mask = mask.to(logp.dtype)
    adv = advantages[:, None].to(logp.dtype)
    ratio = torch.exp(logp - logp_old)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    if token_weights is not None:
        surrogate = surrogate * token_weights  # the bug: not token_weights.detach()
    d = logp_ref - logp
    kl = torch.exp(d) - d - 1
    per_seq = (-(surrogate - beta * kl) * mask).sum(1) / mask.sum(1).clamp(min=1)
    loss = per_seq.mean()
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        stats = {"loss": loss.item(), "kl": ((kl * mask).sum() / n).item(),
                 "ratio_mean": ((ratio * mask).sum() / n).item(), "ratio_max": ratio[mask.bool()].max().item(),
                 "clip_frac": ((((ratio - 1).abs() > clip_eps).to(mask.dtype) * mask).sum() / n).item()}
    return loss, stats
