"""Timing an IPC weight update here and now: a realistic state, and an update against plain copies.

``model_state`` builds a decoder-LM tensor list of any size (embeddings, attention, MLP, norms,
biases) to export; ``time_update_vs_copy`` times, in the receiving process, an update through
``labsupport.ipc`` against device-to-device copies of the same bytes. Lab 5 calls both; ``python -m
labsupport bench ipc`` runs them between two processes and saves the result.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from labsupport.core import buckets
from labsupport.core.devices import synchronize as _sync
from labsupport.ipc import Handle, Receiver

# Qwen2.5-3B-like widths (hidden 2048, MLP 11008, 2 KV heads x 128, vocab 151936), as many layers as
# the target size needs; "cpu" is a small layout for the shared-memory stand-in.
SHAPES = {"cuda": dict(hidden=2048, inter=11008, kv=256, vocab=151936),
          "cpu": dict(hidden=256, inter=1024, kv=64, vocab=4096)}


def model_state(target_bytes: int, device: str | torch.device, dtype: torch.dtype = torch.bfloat16,
                preset: str | None = None) -> list[tuple[str, torch.Tensor]]:
    """A realistic decoder-LM tensor list (embeddings, attention, MLP, norms, biases) of
    ~``target_bytes``."""
    device = torch.device(device)
    p = SHAPES[preset or device.type]
    h, i, kv, v = p["hidden"], p["inter"], p["kv"], p["vocab"]
    per_layer = {"self_attn.q_proj.weight": (h, h), "self_attn.q_proj.bias": (h,),
                 "self_attn.k_proj.weight": (kv, h), "self_attn.k_proj.bias": (kv,),
                 "self_attn.v_proj.weight": (kv, h), "self_attn.v_proj.bias": (kv,),
                 "self_attn.o_proj.weight": (h, h), "mlp.gate_proj.weight": (i, h),
                 "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
                 "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
    esize = torch.empty(0, dtype=dtype).element_size()
    layer_bytes = sum(torch.Size(s).numel() for s in per_layer.values()) * esize
    fixed = (2 * v * h + h) * esize
    layers = max(1, -(-(target_bytes - fixed) // layer_bytes))
    shapes = [("model.embed_tokens.weight", (v, h))]
    shapes += [(f"model.layers.{n}.{k}", s) for n in range(layers) for k, s in per_layer.items()]
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    gen = torch.Generator(device=device).manual_seed(0)
    return [(name, torch.randn(s, generator=gen, device=device, dtype=torch.float32).to(dtype)
             if len(s) > 1 or device.type == "cpu" else torch.ones(s, device=device, dtype=dtype))
            for name, s in shapes]


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds ``fn`` takes on ``device``, from a synchronized start to a synchronized end."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def time_update_vs_copy(handles: Sequence[Handle], dest: Mapping[str, torch.Tensor],
                        receiver: Receiver | None = None, rounds: int = 3) -> dict[str, Any]:
    """Time an IPC update of ``dest`` from ``handles`` against plain copies of the same bytes, here
    and now.

    ``ipc_s``: Receiver.copy_into for every bucket (mappings cached); ``d2d_s``: the same per-tensor
    copies from a local buffer with the bucket layout; ``flat_s``: one copy of the same total bytes.
    """
    receiver = receiver or Receiver()
    device = next(iter(dest.values())).device
    local = torch.empty(max(off + n for h in handles for *_, off, n in h.entries),
                        dtype=torch.uint8, device=device)
    total = sum(h.nbytes for h in handles)
    flat_src = torch.zeros(total, dtype=torch.uint8, device=device)
    flat_dst = torch.empty(total, dtype=torch.uint8, device=device)

    def ipc_update() -> None:
        for h in handles:
            receiver.copy_into(h, dest)

    def local_copies() -> None:
        with torch.no_grad():
            for h in handles:
                for name, view in buckets.unpack(local, h.entries):
                    dest[name].copy_(view, non_blocking=True)

    out: dict[str, Any] = {"bytes": total, "ipc_s": [], "d2d_s": [], "flat_s": []}
    ipc_update(), local_copies(), flat_dst.copy_(flat_src)  # warm up: map pages, first-touch memory
    for _ in range(rounds):
        out["ipc_s"].append(timed(ipc_update, device))
        out["d2d_s"].append(timed(local_copies, device))
        out["flat_s"].append(timed(lambda: flat_dst.copy_(flat_src), device))
    ipc_update()  # leave dest holding the exported values
    _sync(device)
    return out
