"""Co-located weight updates at the copy floor (Chapter 5, Lab 6), ``core.colocated``'s mapped path
hardened: the engine maps the trainer's exported buffer (``SharedWeights``) once, loads it through
the safe path, plans (``vllm_plan``) the copies that fill its parameters (a layer vLLM transforms
after loading keeps the safe path); an update is then one RPC of copies. Refused: a sync once a
trainer's parameter left the buffer, a plan that disagrees with vLLM's loader, engine parameters
moved since the plan, a released or dead export. Write no parameter until ``sync`` returns."""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from labsupport import ipc, vllm_ext
from labsupport.core import colocated, devices
from labsupport.core.buckets import Meta, unpack
from labsupport.vllm_plan import Plan, plan_for
from labsupport.vllm_weights import WeightUpdateError, WorkerState, worker_rpc, worker_state

log = logging.getLogger(__name__)


class SharedWeights:
    """The trainer's weights in one exported bucket: without ``dtype`` the parameters move into it
    (create it before the optimizer; write in place); with the engine's ``dtype`` (``rl.colocated``)
    a cast copy, overwritten by ``refresh`` after each optimizer step."""

    def __init__(self, model: torch.nn.Module, exporter: ipc.Exporter | None = None,
                 dtype: torch.dtype | None = None) -> None:
        self.exporter, self.model, self.dtype = exporter or ipc.Exporter(), model, dtype
        named = colocated.engine_order(model.named_parameters())
        self.handle = self.exporter.export_bucket(colocated.in_dtype(model, dtype) if dtype
                                                  else named)  # one copy
        self.names = [n for n, _ in named]
        self.views = [v for _, v in unpack(self.exporter.buffer(self.handle), self.handle.entries)]
        if dtype is None:  # the parameters now live in the exported buffer
            for (_, p), view in zip(named, self.views):
                p.data = view
        self.device = named[0][1].device
        self.addresses = {n: p.data_ptr() for n, p in model.named_parameters()}  # where they stay
        self._seen()

    def _seen(self) -> None:  # what check compares, no walk of names (0.5-1.7 ms at 7B): modules'
        # children and parameters as objects (a swap shows in its parent), parameters' addresses
        self._mods = list(self.model.modules())
        self._members, self._params = self._tree(), list(self.model.parameters())
        self._ptrs = [p.data_ptr() for p in self._params]

    def _tree(self) -> list[Any]:
        return [v for m in self._mods for v in (*m._modules.values(), *m._parameters.values())]

    def check(self) -> None:
        """Raise ``WeightUpdateError`` if a parameter left the buffer (with ``dtype``: no check)."""
        if self.dtype is not None:
            return
        now = self._tree()
        if len(now) == len(self._members) and not any(map(operator.is_not, now, self._members)) \
                and [p.data_ptr() for p in self._params] == self._ptrs:
            return
        now = {n: p.data_ptr() for n, p in self.model.named_parameters()}
        moved = sorted({n for n, _ in now.items() ^ self.addresses.items()})  # moved, added, gone
        if moved:
            raise WeightUpdateError(
                f"{len(moved)} of the trainer's parameters no longer live in the exported buffer "
                f"({', '.join(moved[:3])}{' ...' if len(moved) > 3 else ''}): p.data = ..., "
                "model.to(...) or load_state_dict(assign=True) replaced their memory (the engine "
                "would serve the stale buffer); nothing was sent. Write them in place, or map "
                "again: shared.close(); shared = SharedWeights(model); map_engine(llm, shared).")
        self._seen()  # (what changed moved nothing: a module without parameters, say)

    def refresh(self, model: torch.nn.Module | None = None) -> None:
        """The trainer's current weights in the bucket, queued writes finished; with ``dtype``, one
        grouped cast-copy of ``model``'s (default: the exported one) once names and shapes match."""
        if self.dtype is None:
            self.check()
            devices.synchronize(self.device)
            return
        named = colocated.engine_order((model or self.model).named_parameters())
        if [n for n, _ in named] != self.names or any(
                p.shape != v.shape for (_, p), v in zip(named, self.views)):
            raise WeightUpdateError("the trainer's model no longer has the parameters its bucket "
                                    "was exported with (names or shapes changed): nothing was "
                                    "sent; export a new bucket and map it")
        colocated.refresh(self.views, model or self.model)

    def packed(self) -> bytes:
        """The handle for ``map_trainer_weights``, keyed by its device (``report_device_id``)."""
        self.check()
        return vllm_ext.pack_ipc_handles({vllm_ext.device_id(self.device): self.handle})

    def close(self) -> None:
        """Release the export (an engine that still maps it gets an error on its next sync)."""
        self.exporter.close()


def map_engine(llm: Any, shared: SharedWeights) -> list[dict[str, Any]]:
    """Every worker maps ``shared`` and plans its updates; returns their reports."""
    return vllm_ext.call(llm, "map_trainer_weights", shared.packed())


def sync(llm: Any, shared: SharedWeights, timeout: float = vllm_ext.TIMEOUT_S) -> list[dict]:
    """The trainer's current weights into the engine: ``shared.refresh()``, then one RPC."""
    shared.refresh()
    return vllm_ext.call(llm, "sync_mapped_weights", timeout=timeout)


def unmap_engine(llm: Any) -> None:
    """Every worker drops its mapping (then ``shared.close()`` frees the buffer)."""
    vllm_ext.call(llm, "unmap_trainer_weights")


@dataclass
class MappedState(WorkerState):
    """``WorkerState`` plus the mapped buckets with their plan, and the syncs served."""
    mapped: tuple[list[ipc.Handle], Plan] | None = None
    version: int = 0

    def unmap(self) -> bool:
        """Drop the plan's views (the last references to the mapped memory), then ack it."""
        if self.mapped is None:
            return False
        buckets, self.mapped = self.mapped[0], None
        for b in buckets:
            ipc.ack(b)  # (waits for this process's queued reads first)
        return True


class FastColocateExtension(vllm_ext.RLHFWorkerExtension):
    """Every update pattern of ``RLHFWorkerExtension``, plus the mapped, planned co-located path."""

    state_type = MappedState

    @worker_rpc
    def map_trainer_weights(self, handles: bytes | Mapping[str, Any]) -> dict[str, Any]:
        """Map the trainer's exported weights for good, check them, load them once, plan copies."""
        t0, st = time.perf_counter(), worker_state(self)
        buckets, ew = vllm_ext.buckets_for(self.device, handles), st.weights
        ew.check([Meta(n, d, tuple(s)) for b in buckets for n, d, s, _, _ in b.entries])
        st.unmap()  # a previous mapping first
        views = dict(v for b in buckets for v in ipc.rebuild(b))
        t1 = time.perf_counter()
        ew.load(list(views.items()))  # the safe path, once: what the plan is checked against
        devices.synchronize(ew.device)
        t2 = time.perf_counter()
        plan = plan_for(self, ew.model, views, ew.module_of)
        if not all(torch.equal(dst, src) for dst, src in plan.copies):  # what the loader wrote?
            raise WeightUpdateError("the copy plan disagrees with vLLM's loader (a layout bug): "
                                    "refusing the fast path; use update_weights_from_ipc")
        for module, why in plan.fallback.items():
            log.warning("fast update: %s keeps the safe path: %s", module, why)
        st.mapped = (buckets, plan)
        return {"planned_params": len(plan.owners), "copies": len(plan.copies),
                "copied_bytes": plan.copied_bytes, "fallback": dict(plan.fallback),
                "open_s": t1 - t0, "first_load_s": t2 - t1, "plan_s": time.perf_counter() - t2}

    @worker_rpc
    def sync_mapped_weights(self) -> dict[str, Any]:
        """Copy the mapped weights in per the plan, safe-load the fallback layers (``entered``,
        ``left``: ``time.monotonic()``, one clock for the machine's processes)."""
        entered, st = time.monotonic(), worker_state(self)
        if st.mapped is None:
            raise WeightUpdateError("no mapped trainer weights: map_engine(llm, shared) first")
        buckets, plan = st.mapped
        for b in buckets:
            ipc.check_handle(b)  # exporter alive, export not released (microseconds)
        if any(p.data_ptr() != ptr for p, ptr in plan.owners):
            raise WeightUpdateError("engine parameters were reallocated since the plan was made: "
                                    "map again")
        t0 = time.perf_counter()
        if plan.fallback_items:
            st.weights.load(plan.fallback_items)
        t1 = time.perf_counter()
        colocated.copy(plan.copies)  # (a loop of copies beats one _foreach_copy_ over them)
        devices.synchronize(self.device)
        st.version += 1
        return {"version": st.version, "copied_bytes": plan.copied_bytes, "entered": entered,
                "copies": len(plan.copies), "fallback_layers": len(plan.fallback),
                "copy_s": time.perf_counter() - t1, "fallback_s": t1 - t0, "left": time.monotonic()}

    @worker_rpc
    def unmap_trainer_weights(self) -> bool:
        """Drop the mapping and ack it (the trainer may free its buffer); True if it was mapped."""
        return worker_state(self).unmap()
