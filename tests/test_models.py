"""labsupport.course.models: offline tokenizer and tiny LM, trained to a checkable behaviour."""

import pytest
import torch

from labsupport.course import models


def test_tokenizer_roundtrip_and_bos():
    tok = models.build_tokenizer()
    ids = tok("cde+12=?")["input_ids"]
    assert ids[0] == models.BOS_ID and len(ids) == 1 + len("cde+12=?")
    assert tok.decode(ids, skip_special_tokens=True) == "cde+12=?"
    assert max(ids) < models.VOCAB_SIZE and len(models.VOCAB) <= models.VOCAB_SIZE


def test_model_shape_and_determinism():
    a, b = models.build_model(seed=1), models.build_model(seed=1)
    assert a.config.hidden_size // a.config.num_attention_heads == 64  # vLLM CPU attention needs >= 64
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
    assert models.build_model(seed=2, num_hidden_layers=3).config.num_hidden_layers == 3


def test_expected_continuation():
    assert models.pattern_prompts()[0] == "cde"
    assert models.expected_continuation("cde", 4) == "fghi"
    assert models.expected_continuation("xyz", 3) == "abc"  # wraps around


def test_training_learns_the_pattern():
    tok = models.build_tokenizer()
    model = models.build_model(seed=0)
    prompts = models.pattern_prompts()
    expected = [models.expected_continuation(p, 6) for p in prompts]
    assert models.greedy_generate(model, tok, prompts, 6) != expected  # random init writes gibberish
    losses = models.train_pattern(model, tok)
    assert losses[-1] < 0.5 * losses[0]
    assert models.greedy_generate(model, tok, prompts, 6) == expected


def test_saved_dir_reloads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = models.tiny_model_dir("trained")
    assert (path / "config.json").exists() and (path / "tokenizer.json").exists()
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = models.pattern_prompts()
    assert models.greedy_generate(model, tok, prompts, 6) == [models.expected_continuation(p, 6) for p in prompts]
    with pytest.raises(ValueError, match="kind must be"):
        models.tiny_model_dir("huge")


def test_checkpoint_bytes_counts_every_tensor(tmp_path):
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16)}, str(tmp_path / "m.safetensors"))
    assert models.checkpoint_bytes(tmp_path) == 3 * 4 * 4 + 5 * 2


def test_weight_bytes_are_counted_in_the_engine_dtype(tmp_path):
    """A bf16 engine loaded from an fp32 checkpoint holds half the file's bytes: memory() and sleep() must say so."""
    model = models.build_model()
    model.save_pretrained(tmp_path)  # fp32 on disk
    n = sum(p.numel() for p in model.parameters())
    assert models.checkpoint_bytes(tmp_path) == 4 * n
    assert models.weight_bytes(tmp_path, torch.bfloat16) == 2 * n
    assert models.weight_bytes(tmp_path, torch.float32) == 4 * n
