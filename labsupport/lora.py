"""LoRA-only weight updates (Chapter 7, Lab 8): the engine receives only the trainer's low-rank
adapter, in peft's format (``add_lora``, a new ``lora_int_id`` per version: vLLM caches adapters by
id), or folded into a copy of the base and sent whole (``vllm_ext.push_ipc``). :func:`check_adapter`
names every problem of a bad adapter before the engine sees it; a refusal by vLLM's loader raises
``AdapterError``, the engine keeps its previous adapter. The lab's demo: ``experiments.lora_demo``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch

from labsupport.course import hardware

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # all


class AdapterError(ValueError):
    """An adapter refused before the engine loaded it (the message: what is wrong, what to do)."""


# ----------------------------------------------------------------------------- trainer side
def add_adapter(model, rank: int = 8, *, alpha: int | None = None,
                targets: tuple[str, ...] = TARGETS, seed: int = 0):
    """Wrap a transformers model with a fresh LoRA adapter (``B = 0``: it starts as the base)."""
    hardware.require("peft", what="lora.add_adapter")
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, bias="none",
                                            target_modules=list(targets), lora_dropout=0.0))


def save_adapter(peft_model, folder: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write only the adapter into ``folder``, in ``dtype`` if given (the engine's: fewer bytes)."""
    folder, state = Path(folder), peft_model.state_dict()
    state = None if dtype is None else {k: v.to(dtype) for k, v in state.items() if "lora_" in k}
    peft_model.save_pretrained(str(folder), safe_serialization=True, state_dict=state)
    (folder / "README.md").unlink(missing_ok=True)  # peft's model card: not part of the update
    return folder


@torch.no_grad()
def merged_weights(peft_model, dtype: torch.dtype | None = None) -> list[tuple[str, torch.Tensor]]:
    """The weights with the adapter folded in (``W + alpha/r * B @ A``), from a copy."""
    merged = copy.deepcopy(peft_model).merge_and_unload()
    return [(n, p.detach().to(dtype or p.dtype)) for n, p in merged.named_parameters()]


# ----------------------------------------------------------------------------- engine side
def adapter_spec(hf_config: Any, max_rank: int) -> dict[str, Any]:
    """What the engine accepts: ``max_rank``, each LoRA slot's ``(out, in)`` (of a meta model)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        ref = AutoModelForCausalLM.from_config(hf_config)
    shapes = {n: (m.out_features, m.in_features) for n, m in ref.named_modules()
              if isinstance(m, torch.nn.Linear) and n.rpartition(".")[2] in TARGETS}
    return {"max_rank": max_rank, "modules": shapes}


def check_adapter(folder: str | Path, spec: dict[str, Any]) -> None:
    """Raise ``AdapterError`` listing every problem of ``folder``'s adapter against ``spec``."""
    from safetensors import safe_open

    folder = Path(folder)
    try:
        cfg = json.loads((folder / "adapter_config.json").read_text())
        with safe_open(str(folder / "adapter_model.safetensors"), "pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{folder} is not a peft LoRA adapter folder ({exc}); write it with "
                           "save_adapter") from exc
    rank, most = max([cfg.get("r", 0), *(cfg.get("rank_pattern") or {}).values()]), spec["max_rank"]
    probs = [f"rank {rank} > the engine's max_lora_rank {most} (train with rank <= {most}, or "
             "restart the engine with a larger max_lora_rank)"] if rank > most else []
    if cfg.get("bias", "none") != "none" or cfg.get("modules_to_save"):
        probs.append("bias or modules_to_save: vLLM serves plain A/B adapters only")
    for key, shape in shapes.items():
        mod, _, ab = key.removeprefix("base_model.model.").rpartition(".lora_")
        out, inp = spec["modules"].get(mod, (None, None))
        want = (shape[0], inp) if ab.startswith("A") else (out, shape[1])
        if out is None:
            probs.append(f"'{mod}': the engine has no LoRA slot for this module (it has "
                         f"{', '.join(TARGETS)} in each decoder layer)")
        elif shape != want:
            probs.append(f"'{key}': shape {shape}, the engine's model needs {want}")
    if probs:
        more = f"\n  ... and {len(probs) - 6} more" if len(probs) > 6 else ""
        raise AdapterError(f"adapter {folder.name} refused, the engine keeps its current "
                           "adapter:\n  " + "\n  ".join(probs[:6]) + more)


def push_adapter(llm: Any, folder: str | Path, version: int, *, check: bool = True) -> Any:
    """Load ``folder`` as ``version`` (its ``lora_int_id``), checked (unless ``check=False``)
    against the engine's config (no RPC): the ``LoRARequest`` to generate with."""
    from vllm.lora.request import LoRARequest

    if check:
        cfg = llm.llm_engine.vllm_config
        if cfg.lora_config is None:
            raise AdapterError("this engine was started without enable_lora=True: start it "
                               "with LLM(..., enable_lora=True, max_lora_rank=R), or send merged "
                               "weights")
        check_adapter(folder, adapter_spec(cfg.model_config.hf_config,
                                           cfg.lora_config.max_lora_rank))
    req = LoRARequest(f"policy-v{version}", int(version), str(Path(folder).resolve()))
    try:
        llm.llm_engine.add_lora(req)
    except Exception as exc:  # vLLM refused it in its loader (a utility call: it keeps serving)
        raise AdapterError(f"vLLM refused adapter {req.lora_name}: {exc}") from exc
    return req


def retire(llm: Any, old: Any) -> None:
    """Drop a previous version's adapter from the engine (once the new one serves)."""
    llm.llm_engine.remove_lora(old.lora_int_id)
