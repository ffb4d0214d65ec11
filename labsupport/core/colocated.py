"""The co-located update in straight lines: a trainer and a vLLM engine take turns on one GPU.

As in vLLM's ``examples/rl/rlhf_colocate.py``, the trainer exports its weights in the engine's dtype
into one bucket (``core.handoff``). Every worker loads it through vLLM's ``load_weights`` (the safe
path, ``load``; hardened: ``vllm_ext.push_ipc``), or keeps it mapped and copies it into its
parameters (the mapped path, ``copy``, the trainer ``refresh``-ing the bucket after each optimizer
step; hardened: ``fast_update``), drops its views, and the trainer releases the bucket. One turn
(``colocated_step``), in vLLM's order: sleep (level 1 keeps the weights in host memory and drops the
KV cache; 2 drops both); train; wake the weights only (the KV cache after the update: a lower
peak); update; wake the KV cache; reset the prefix cache (no block of the old weights is reused).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from labsupport.core import handoff
from labsupport.core.devices import synchronize

Named = list[tuple[str, torch.Tensor]]


def engine_order(named: Iterable[tuple[str, torch.Tensor]]) -> Named:
    """Weights, then biases (a stable sort): what vLLM fuses (q, k, v; gate, up) sits together."""
    return sorted(named, key=lambda item: item[0].endswith(".bias"))


def in_dtype(model: torch.nn.Module, dtype: torch.dtype) -> Named:
    """The trainer's parameters in ``engine_order``, cast to ``dtype`` (not copied if in it)."""
    return [(n, p.detach().to(dtype)) for n, p in engine_order(model.named_parameters())]


# ---- trainer side --------------------------------------------------------------------------------
@torch.no_grad()
def refresh(views: list[torch.Tensor], model: torch.nn.Module) -> None:
    """The mapped path, after each optimizer step: the weights cast into ``views``, waited for."""
    torch._foreach_copy_(views, [p.detach() for _, p in engine_order(model.named_parameters())])
    if views:
        synchronize(views[0].device)


# ---- engine side: in every vLLM worker (``collective_rpc`` passes the worker first) -------------
def load(worker: Any, handle: handoff.Handle) -> int:
    """The safe path: map the bucket, hand its views to vLLM's loader, wait, drop the views."""
    views = handoff.rebuild(handle)
    worker.model_runner.model.load_weights(weights=views)
    nbytes = sum(v.nbytes for _, v in views)
    if views:
        synchronize(views[0][1].device)  # done reading the trainer's memory ...
    del views  # ... and nothing here maps it any more: the trainer may release it
    return nbytes


@torch.no_grad()
def copy(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """The mapped path: each ``(dst, src)`` (a parameter's slice, its mapped view) copied."""
    for dst, src in copies:
        dst.copy_(src)
    if copies:
        synchronize(copies[0][0].device)
    return sum(src.nbytes for _, src in copies)


# ---- one turn ------------------------------------------------------------------------------------
def push(llm: Any, named: Named) -> int:
    """The update: export ``named`` as one bucket, every worker loads it, release it; the bytes."""
    buf, handle = handoff.export(named)  # the trainer keeps the buffer until the release
    try:
        return llm.collective_rpc(load, args=(handle,))[0]
    finally:
        del buf  # the owner's last reference, then the memory goes back
        handoff.release(handle)


def colocated_step(llm: Any, model: torch.nn.Module, train: Callable[[torch.nn.Module], Any], *,
                   level: int = 1, push: Callable[[Any, Named], Any] = push) -> None:
    """One turn: ``llm`` sleeps at ``level`` while ``train(model)`` runs, wakes its weights, takes
    the new ones in its dtype (``push``: ours or ``vllm_ext.push_ipc``), then wakes its KV cache."""
    llm.sleep(level=level)
    train(model)
    llm.wake_up(tags=["weights"])
    push(llm, in_dtype(model, llm.llm_engine.model_config.dtype))
    llm.wake_up(tags=["kv_cache"])
    llm.reset_prefix_cache()
