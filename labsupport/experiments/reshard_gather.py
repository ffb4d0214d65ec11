"""Lab 7's gather modes, the baselines that ``vllm_reshard``'s shard to shard (mode c) is measured
against: every trainer rank gathers full tensors, rank 0 sends them with ``vllm_ext.push_weights``:
(a) all first, (b) ``overlap``: a bucket gathered while the last is on the wire. Each returns its
peak extra memory (``vllm_reshard.Peak``: GPU: the allocator's; CPU: its buffers' bytes, counted).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from labsupport import broadcast, groups, reshard as rs, vllm_ext
from labsupport.core.buckets import metas
from labsupport.vllm_reshard import Peak, sharded_params


def send_gathered(model: torch.nn.Module, layout: rs.Layout, *, rank: int,
                  group: groups.StatelessGroup | None = None, call: Callable | None = None,
                  dtype: torch.dtype | None = None, bucket_bytes: int = 256 << 20,
                  overlap: bool = False, timeout_s: float = 300.0) -> dict[str, Any]:
    """Modes a and b, in every trainer rank: gather full tensors; rank 0 sends them with
    ``vllm_ext.push_weights`` (``group``, ``call``: rank 0 only). (a) all first (extra memory: the
    whole model); (b) ``overlap``: rank 0 sends bucket k of whole layers (``bucket_bytes / 2``)
    while all gather k + 1 (a send still running ``timeout_s`` after it: ``TimeoutError``)."""
    params = sharded_params(model)
    peak, t0 = Peak(next(iter(params.values())).device), time.perf_counter()
    nbytes = {n: p.numel() * (dtype or p.dtype).itemsize for n, p in params.items()}

    def gather(names: list[str]) -> list[tuple[str, torch.Tensor]]:
        got = []
        for n in names:
            t = params[n].full_tensor() if hasattr(params[n], "full_tensor") else params[n]
            got.append((n, t.detach().to(dtype or t.dtype)))
            peak.hold(nbytes[n])
            if rank != 0:  # the other ranks drop each tensor at once
                got.pop()
                peak.hold(-nbytes[n])
        return got

    def push(items: list[tuple[str, torch.Tensor]]) -> None:
        plan = broadcast.plan_buckets(metas(items), bucket_bytes)
        staging = 2 * max((b.nbytes for b in plan if b.packed), default=0)  # push_weights' buffers
        vllm_ext.push_weights(group, items, call, mode="bucketed", bucket_bytes=bucket_bytes,
                              partial=overlap)
        peak.hold(staging)
        peak.hold(-staging - sum(nbytes[n] for n, _ in items))

    buckets = rs.module_buckets(layout, nbytes, bucket_bytes // 2) if overlap else [list(params)]
    with torch.no_grad():
        items = gather(buckets[0])
        for following in [*buckets[1:], []]:
            if rank == 0:
                items = vllm_ext.alongside(lambda sent=items: push(sent),
                                           lambda: gather(following), timeout_s)[0]
            else:
                items = gather(following)
    return {"mode": "b_bucket_overlap" if overlap else "a_gather_all",
            "seconds": time.perf_counter() - t0, "buckets": len(buckets), **peak.result()}
