"""The policy model: its sizes (``SIZES``), the memory a size needs on one GPU (checked before a
run), the warm start (plain next-token pre-training on :mod:`~labsupport.rl.task`'s alphabet runs),
the cached warm-started folder and loading it."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch

from labsupport.course import models, planner
from labsupport.course.planner import InsufficientMemory
from labsupport.rl.task import pretraining_text


def warmstart(model, tokenizer, steps: int = 150, lr: float = 5e-3, seed: int = 0,
              batch_size: int = 32, device: str | torch.device = "cpu") -> list[float]:
    """Pre-train on separator-marked alphabet runs (see
    :func:`~labsupport.rl.task.pretraining_text`); returns the losses.

    Plain next-token prediction, no prompt/answer split, no reward: it gives the policy something to
    sample from, as pre-training does for a real LLM.
    """
    rng = random.Random(seed)
    return models.train_next_token(model, tokenizer, lambda: [pretraining_text(rng)
                                                              for _ in range(batch_size)],
                                   # decay: settle the 10% rate
                                   steps=steps, lr=lr, device=device, decay=True,
                                   desc="warm start: pre-training")


# Model sizes: the same Qwen2 architecture and tokenizer (models.build_config), the same warm start.
# "0.5b" keeps Qwen2-0.5B's layer shape (hidden 896, 14 heads of 64, 2 KV heads, MLP 4864) with 32
# layers instead of 24: our 64-token vocabulary has no 136M-parameter embedding to make up the rest.
# A larger model needs a smaller learning rate (pre-training and RL alike); CPU runs use "tiny"
# only.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"config": {}, "warmstart_lr": 5e-3, "lr": 1e-3, "engine_bytes": 2e9},
    "0.5b": {"config": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=32,
                            num_attention_heads=14, num_key_value_heads=2),
             "warmstart_lr": 3e-4, "lr": 5e-5, "engine_bytes": 12e9},
}


def check_size(size: str) -> dict[str, Any]:
    """``SIZES[size]``, or a ValueError listing the sizes."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {list(SIZES)}, got {size!r}")
    return SIZES[size]


def model_params(size: str) -> int:
    """Parameter count of the capstone's model at ``size`` (built on the meta device: no memory, no
    time)."""
    with torch.device("meta"):
        m = models.build_model(0, **check_size(size)["config"])
    return sum(p.numel() for p in m.parameters())


def memory_needed(size: str, sequences: int = 512, seq_len: int = 8,
                  engine_bytes: float | None = None) -> dict[str, float]:
    """Bytes the co-located loop needs on one GPU at ``size``: the fp32 trainer (weights, gradients,
    Adam's two moments: planner.bytes_per_param("fp32"), plus the frozen reference), activations of
    one batch of ``sequences`` (planner.activation_bytes, doubled for fp32) and the vLLM engine's
    budget (``engine_bytes``, default the size's)."""
    n, c = model_params(size), models.build_config(**check_size(size)["config"])
    act = 2 * planner.activation_bytes(c.num_hidden_layers, c.hidden_size, c.num_attention_heads,
                                       seq_len, sequences)
    return {"trainer": n * (planner.bytes_per_param("fp32").total + 4), "activations": act,
            "engine": SIZES[size]["engine_bytes"] if engine_bytes is None else engine_bytes}


def check_fits(size: str, free_bytes: float, sequences: int = 512, offload: bool = False,
               engine_bytes: float | None = None) -> float:
    """Raise InsufficientMemory, naming the need, the free bytes and the largest size that fits,
    unless the co-located loop at ``size`` fits in ``free_bytes``; returns the bytes needed.
    ``offload``: Adam's moments leave the GPU while the engine works, so they do not count against
    the engine's budget."""
    def need_of(s: str) -> float:
        need = memory_needed(s, sequences, engine_bytes=engine_bytes if s == size else None)
        return sum(need.values()) - (model_params(s) * planner.bytes_per_param("fp32").optimizer
                                     if offload else 0)

    need = need_of(size)
    if need > free_bytes:
        fits = [s for s in SIZES if need_of(s) <= free_bytes]
        hint = f"size {fits[-1]!r} fits" if fits else ("no size fits: free the GPU (other "
                                                       "processes?)")
        raise InsufficientMemory(f"size {size!r} needs about {need / 1e9:.1f} GB of GPU memory "
                                 f"(trainer, activations, engine), but only {free_bytes / 1e9:.1f} "
                                 f"GB is free; {hint}")
    return need


OFFLOADS = ("auto", "on", "off")


def plan_offload(size: str, free_bytes: float, sequences: int = 512, sleep_level: int = 0,
                 offload: str = "auto", engine_bytes: float | None = None) -> bool:
    """Whether Adam's moments leave the GPU while the co-located engine works (checked with
    :func:`check_fits`).

    "on" and "off" as asked; "auto" only where the loop does not fit otherwise *and* the engine
    sleeps between generations: an awake engine (sleep level 0) keeps its memory reserved, so
    moments moved out would free nothing it could use, and where everything fits, two PCIe transfers
    a step buy nothing."""
    if offload not in OFFLOADS:
        raise ValueError(f"offload must be one of {OFFLOADS}, got {offload!r}")
    if offload == "auto":
        fits = sum(memory_needed(size, sequences, engine_bytes=engine_bytes).values()) <= free_bytes
        offload = "off" if fits or sleep_level == 0 else "on"
    check_fits(size, free_bytes, sequences, offload=offload == "on" and sleep_level > 0,
               engine_bytes=engine_bytes)
    return offload == "on"


def warmstart_dir(seed: int = 0, steps: int = 150, size: str = "tiny") -> Path:
    """A saved warm-started model (HF folder that transformers and vLLM load), cached under
    ``.cache/models``. Sizes other than "tiny" pre-train on the GPU when there is one."""
    spec = check_size(size)

    def build():
        torch.manual_seed(seed)
        tok, model = models.build_tokenizer(), models.build_model(seed, **spec["config"])
        device = "cuda" if size != "tiny" and torch.cuda.is_available() else "cpu"
        warmstart(model, tok, steps=steps, lr=spec["warmstart_lr"], seed=seed, device=device)
        return model.cpu(), tok

    name = (
        f"capstone-v4-seed{seed}-s{steps}"
        if size == "tiny"
        else (f"capstone-v4-{size}-seed{seed}-s{steps}")
    )
    return models.cached_model_dir(name, build)


def load_policy(path: str | os.PathLike, device: str | torch.device = "cpu"):
    """Load a saved tiny model (fp32) onto ``device``."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per load clutters notebooks
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device).eval()
