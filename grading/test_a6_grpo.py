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


@pytest.mark.points(2)
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


@pytest.mark.points(3)
def test_grpo_loss_matches_the_formula(impl):
    logp, old, ref, adv, mask = batch()
    loss, stats = impl.grpo_loss(logp, old, ref, adv, mask)
    want = by_hand_loss(logp, old, ref, adv, mask)
    assert loss.item() == pytest.approx(want["loss"], rel=1e-4, abs=1e-6), \
        f"expected loss {want['loss']:.6f}, got {loss.item():.6f}"
    for k, v in want.items():
        assert stats.get(k) == pytest.approx(v, rel=1e-4, abs=1e-6), \
            f"expected stats[{k!r}] = {v:.6f}, got {stats.get(k)}"


@pytest.mark.points(2)
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


@pytest.mark.points(1)
def test_token_weights_scale_the_surrogate_as_constants(impl):
    logp, old, ref, adv, mask = batch(1)
    w = (torch.rand(logp.shape, generator=torch.Generator().manual_seed(2)) * 2).requires_grad_()
    loss, _ = impl.grpo_loss(logp, old, ref, adv, mask, token_weights=w)
    want = by_hand_loss(logp, old, ref, adv, mask, w=w.detach())["loss"]
    assert loss.item() == pytest.approx(want, rel=1e-4, abs=1e-6), \
        f"expected the weighted loss {want:.6f}, got {loss.item():.6f}"
    loss.backward()
    assert w.grad is None or not w.grad.abs().any(), "expected no gradient into token_weights (they are constants)"


def torch_loss(logp, old, ref, adv, mask, clip_eps, beta):
    """The same formula in torch, to take its gradient: the surrogate through ratio = exp(logp - old) in both of
    its branches, the k3 KL through logp, averaged per sequence's masked tokens, then over sequences."""
    ratio = torch.exp(logp - old)
    a = adv[:, None]
    surr = torch.minimum(ratio * a, ratio.clamp(1 - clip_eps, 1 + clip_eps) * a)
    d = ref - logp
    per_tok = -(surr - beta * (torch.exp(d) - d - 1))
    return ((per_tok * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()


@pytest.mark.points(3)
def test_grpo_loss_gradient_and_parameters(impl):
    """The gradient with respect to ``logp`` is the formula's (a loss can be right in value and push the wrong
    way), at clip_eps and beta other than their defaults, in float64 with a bool mask."""
    for clip_eps, beta in ((0.2, 0.02), (0.1, 0.5)):
        logp, old, ref, adv, mask = batch(3)
        logp = logp.detach().double().requires_grad_()
        old, ref, adv = old.double(), ref.double(), adv.double()
        loss, stats = impl.grpo_loss(logp, old, ref, adv, mask.bool(), clip_eps=clip_eps, beta=beta)
        want = by_hand_loss(logp, old, ref, adv, mask, clip_eps, beta)
        assert loss.dtype == torch.float64, f"expected the loss in logp's dtype float64, got {loss.dtype}"
        assert loss.item() == pytest.approx(want["loss"], rel=1e-6), \
            f"clip_eps={clip_eps}, beta={beta}: expected loss {want['loss']:.6f}, got {loss.item():.6f}"
        assert stats["clip_frac"] == pytest.approx(want["clip_frac"]), \
            f"clip_eps={clip_eps}: expected clip_frac {want['clip_frac']:.4f}, got {stats['clip_frac']}"
        (grad,) = torch.autograd.grad(loss, logp)
        x = logp.detach().clone().requires_grad_()
        (expected,) = torch.autograd.grad(torch_loss(x, old, ref, adv, mask.double(), clip_eps, beta), x)
        assert torch.allclose(grad, expected, rtol=1e-6, atol=1e-9), (
            f"clip_eps={clip_eps}, beta={beta}: expected the gradient of the formula with respect to logp; the "
            f"largest difference is {(grad - expected).abs().max().item():.3g}")


@pytest.mark.points(1)
def test_group_advantages_eps_and_dtype(impl):
    rewards = [[1.0, 0.0, 0.0], [2.0, 4.0, 9.0]]
    for dtype in (torch.float64, torch.bfloat16):
        got = impl.group_advantages(torch.tensor(rewards, dtype=dtype), eps=0.5)
        want = torch.tensor(by_hand_advantages(rewards, eps=0.5), dtype=torch.float64)
        assert got.dtype == dtype, f"expected advantages in the rewards' dtype {dtype}, got {got.dtype}"
        assert torch.allclose(got.double(), want, rtol=2e-2 if dtype == torch.bfloat16 else 1e-9), \
            f"expected with eps=0.5 in {dtype} {rounded(want)}, got {rounded(got.double())}"


@pytest.mark.points(1)
def test_tis_and_mis_at_the_cap_and_in_other_dtypes(impl):
    """Ratios exactly at the cap's bounds count as inside; weights and mask come in the trainer's dtype; the cap
    is the one asked for."""
    zero = torch.zeros(1, 3, dtype=torch.float64)
    m = impl.mis_mask(zero, zero, cap=1.0)  # ratio 1 = cap = 1 / cap
    assert m.tolist() == [[1.0, 1.0, 1.0]], f"expected ratios exactly at the bounds [1/cap, cap] kept, got {m.tolist()}"
    for dtype in (torch.float64, torch.bfloat16):
        trainer = torch.log(torch.tensor([[0.5, 0.9, 0.02, 0.3]], dtype=dtype)).requires_grad_()
        engine = torch.log(torch.tensor([[0.5, 0.2, 0.2, 0.05]], dtype=dtype))  # ratios 1, 4.5, 0.1, 6
        w = impl.tis_weights(trainer, engine, cap=5.0)
        want = [1.0, 4.5, 0.1, 5.0]
        assert w.dtype == dtype and w.tolist()[0] == pytest.approx(want, rel=2e-2), \
            f"expected TIS weights {want} (cap 5) in {dtype}, got {w.tolist()} in {w.dtype}"
        m = impl.mis_mask(trainer, engine, cap=5.0)
        assert m.dtype == dtype and m.tolist() == [[1.0, 1.0, 0.0, 0.0]], \
            f"expected the MIS mask [[1, 1, 0, 0]] (cap 5) in {dtype}, got {m.tolist()} in {m.dtype}"
        assert not w.requires_grad and not m.requires_grad, "expected weights and mask without gradient"
