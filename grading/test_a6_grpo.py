"""Assignment 6 (assignments/a6_grpo.py): the GRPO loss with group advantages, and its TIS/MIS correction.

Values are checked against the formulas written out here token by token, and a policy over four actions
trained with your loss must learn the rewarded one.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch


def by_hand_advantages(rewards: list[list[float]], eps: float = 1e-6, scale: bool = True) -> list[list[float]]:
    out = []
    for group in rewards:
        mean = statistics.fmean(group)
        std = statistics.stdev(group) if len(group) > 1 else 0.0
        out.append([(r - mean) / ((std + eps) if scale else 1.0) for r in group])
    return out


def rounded(t: torch.Tensor) -> list:
    return [[round(x, 3) for x in row] for row in t.tolist()]


@pytest.mark.points(4)
def test_group_advantages(impl):
    rewards = [[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 0.0, 3.0]]
    got = impl.group_advantages(torch.tensor(rewards))
    want = torch.tensor(by_hand_advantages(rewards))
    assert torch.allclose(got, want, atol=1e-5), f"expected advantages {rounded(want)}, got {rounded(got)}"
    got = impl.group_advantages(torch.tensor(rewards), scale=False)
    want = torch.tensor(by_hand_advantages(rewards, scale=False))
    assert torch.allclose(got, want, atol=1e-6), f"expected with scale=False {rounded(want)}, got {rounded(got)}"
    one = impl.group_advantages(torch.tensor([[5.0], [1.0]]))
    assert torch.equal(one, torch.zeros(2, 1)), f"expected 0 for groups of one, got {one.tolist()}"
    with pytest.raises(ValueError):
        impl.group_advantages(torch.tensor([1.0, 0.0]))


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n, t = 4, 6
    logp = (-torch.rand(n, t, generator=g) * 3).requires_grad_()
    old = logp.detach() + torch.randn(n, t, generator=g) * 0.3  # some ratios beyond the clip range
    ref = logp.detach() + torch.randn(n, t, generator=g) * 0.2
    adv = torch.tensor([1.5, -0.5, 0.0, -1.0])
    lengths = [6, 3, 1, 4]
    mask = torch.tensor([[1.0] * k + [0.0] * (t - k) for k in lengths])
    return logp, old, ref, adv, mask


def by_hand_loss(logp, old, ref, adv, mask, clip_eps=0.2, beta=0.02, w=None) -> dict[str, float]:
    """GRPO's loss and statistics, one token at a time."""
    logp = logp.detach()
    seqs, kls, ratios, clipped = [], [], [], 0
    for i in range(logp.shape[0]):
        terms = []
        for j in range(logp.shape[1]):
            if mask[i, j] == 0:
                continue
            lp, lo, lr = float(logp[i, j]), float(old[i, j]), float(ref[i, j])
            ratio = math.exp(lp - lo)
            surr = min(ratio * float(adv[i]), min(max(ratio, 1 - clip_eps), 1 + clip_eps) * float(adv[i]))
            surr *= 1.0 if w is None else float(w[i, j])
            d = lr - lp
            kl = math.exp(d) - d - 1
            terms.append(-(surr - beta * kl))
            kls.append(kl)
            ratios.append(ratio)
            clipped += abs(ratio - 1) > clip_eps
        seqs.append(sum(terms) / max(len(terms), 1))
    return {"loss": sum(seqs) / len(seqs), "kl": statistics.fmean(kls), "ratio_mean": statistics.fmean(ratios),
            "ratio_max": max(ratios), "clip_frac": clipped / len(ratios)}


@pytest.mark.points(4)
def test_grpo_loss_matches_the_formula(impl):
    logp, old, ref, adv, mask = batch()
    loss, stats = impl.grpo_loss(logp, old, ref, adv, mask)
    want = by_hand_loss(logp, old, ref, adv, mask)
    assert loss.item() == pytest.approx(want["loss"], rel=1e-4, abs=1e-6), \
        f"expected loss {want['loss']:.6f}, got {loss.item():.6f}"
    for k, v in want.items():
        assert stats.get(k) == pytest.approx(v, rel=1e-4, abs=1e-6), \
            f"expected stats[{k!r}] = {v:.6f}, got {stats.get(k)}"


@pytest.mark.points(3)
def test_grpo_learns_the_rewarded_action(impl):
    """Four actions, the third rewarded; 8 prompts x 8 samples per step: 40 steps of your loss must make it
    the likely one."""
    torch.manual_seed(0)
    logits = torch.zeros(4, requires_grad=True)
    ref = torch.log_softmax(torch.zeros(4), -1)
    opt = torch.optim.Adam([logits], lr=0.1)
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        with torch.no_grad():
            actions = torch.multinomial(torch.softmax(logits, -1), 64, replacement=True, generator=g)
        rewards = (actions == 2).float().view(8, 8)
        adv = impl.group_advantages(rewards).view(-1)
        logp = torch.log_softmax(logits, -1)[actions][:, None]
        loss, _ = impl.grpo_loss(logp, logp.detach(), ref[actions][:, None], adv, torch.ones(64, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    p = torch.softmax(logits, -1)[2].item()
    assert p > 0.9, f"expected the rewarded action's probability above 0.9 after training, got {p:.3f}"


@pytest.mark.points(2)
def test_tis_weights_and_mis_mask(impl):
    trainer = torch.log(torch.tensor([[0.5, 0.3, 0.9, 0.05]])).requires_grad_()
    engine = torch.log(torch.tensor([[0.5, 0.1, 0.3, 0.2]]))  # ratios 1, 3, 3, 0.25
    w = impl.tis_weights(trainer, engine, cap=2.0)
    want = [1.0, 2.0, 2.0, 0.25]
    assert w.tolist()[0] == pytest.approx(want, rel=1e-5), \
        f"expected TIS weights {want} (capped at 2), got {w.tolist()}"
    assert not w.requires_grad, "expected TIS weights without gradient"
    m = impl.mis_mask(trainer, engine, cap=2.0)
    assert m.tolist() == [[1.0, 0.0, 0.0, 0.0]] and m.dtype == trainer.dtype, \
        f"expected the MIS mask [[1, 0, 0, 0]] in {trainer.dtype}, got {m.tolist()} in {m.dtype}"
    assert not m.requires_grad, "expected the MIS mask without gradient"


@pytest.mark.points(2)
def test_token_weights_scale_the_surrogate_as_constants(impl):
    logp, old, ref, adv, mask = batch(1)
    w = (torch.rand(logp.shape, generator=torch.Generator().manual_seed(2)) * 2).requires_grad_()
    loss, _ = impl.grpo_loss(logp, old, ref, adv, mask, token_weights=w)
    want = by_hand_loss(logp, old, ref, adv, mask, w=w.detach())["loss"]
    assert loss.item() == pytest.approx(want, rel=1e-4, abs=1e-6), \
        f"expected the weighted loss {want:.6f}, got {loss.item():.6f}"
    loss.backward()
    assert w.grad is None or not w.grad.abs().any(), "expected no gradient into token_weights (they are constants)"
