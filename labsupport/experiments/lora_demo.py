"""Lab 8's LoRA demo around ``lora``: a base that writes the alphabet by twos (``"cde"`` ->
``"gikmoq"``) learns steps of one; greedy text from the engine; one update of each kind, timed (the
adapter; the merged weights)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from labsupport import lora, vllm_ext
from labsupport.course import models


def train(model, tokenizer, steps: int, *, step: int = 1, lr: float = 1e-2, batch_size: int = 16,
          seed: int = 0) -> list[float]:
    """Next-token training on alphabet runs advancing ``step`` letters (``step=2``: "acegi..."),
    where the model is. Only parameters with ``requires_grad`` move: with a peft model, the adapter.
    Returns the loss per step."""
    return models.train_pattern(model, tokenizer, steps, device=None, lr=lr, seed=seed,
                                batch_size=batch_size, stride=step)


def base_model_dir(seed: int = 0) -> Path:
    """A tiny model that writes the alphabet by twos (``"cde"`` -> ``"gikmoq"``), trained once."""

    def build():
        tok, model = models.build_tokenizer(), models.build_model(seed)
        train(model, tok, 40, step=2, lr=5e-3, batch_size=32, seed=seed)
        return model, tok

    return models.cached_model_dir(f"by-twos-v{models.CACHE_VERSION}-seed{seed}", build)


def generate(llm: Any, prompts: list[str], n: int, lora_request: Any = None) -> list[str]:
    """Greedy continuations from the engine, with an adapter when ``lora_request`` is given."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=n)
    return [o.outputs[0].text for o in llm.generate(prompts, params, lora_request=lora_request,
                                                    use_tqdm=False)]


def adapter_bytes(folder: str | Path) -> int:
    """Bytes that travel for one adapter version: its config and its tensors (what vLLM reads)."""
    files = ("adapter_config.json", "adapter_model.safetensors")
    return sum((Path(folder) / f).stat().st_size for f in files)


def send_adapter(llm: Any, peft_model, folder: str | Path, version: int, *,
                 dtype: torch.dtype | None = None, check: bool = True) -> dict[str, Any]:
    """One LoRA-only update, timed: save the adapter (trainer), load it as ``version`` (engine).
    Returns the ``request`` to generate with, the ``bytes`` moved and the ``seconds`` taken."""
    t0 = time.perf_counter()
    lora.save_adapter(peft_model, folder, dtype)
    req = lora.push_adapter(llm, folder, version, check=check)
    return {"request": req, "bytes": adapter_bytes(folder),
            "seconds": time.perf_counter() - t0}


def send_merged(llm: Any, peft_model, *, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """One full update of the merged weights, timed: merge a copy, send every tensor, load."""
    t0 = time.perf_counter()
    named = lora.merged_weights(peft_model, dtype)
    n, seconds = vllm_ext.push_ipc(llm, named), time.perf_counter() - t0
    return {"bytes": sum(t.numel() * t.element_size() for _, t in named), "seconds": seconds,
            "tensors": n}
