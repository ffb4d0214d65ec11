"""Resharding: from a trainer's FSDP shards to an inference engine's tensor-parallel layout.

A trainer sharded with FSDP2 (``fully_shard``) keeps on each of its N ranks a block of rows (``Shard(0)``)
of every tensor, under its Hugging Face name. A vLLM engine with tensor parallelism TP keeps on each of its
ranks a slice of *fused* parameters: ``qkv_proj`` = [q_t; k_t; v_t] and ``gate_up_proj`` = [gate_t; up_t]
(column parallel: rows split), ``o_proj`` and ``down_proj`` split along columns (row parallel),
``embed_tokens`` and ``lm_head`` split along the vocabulary padded to a multiple of 64, norms replicated.
Three steps: :func:`qwen2_layout` says where every box of every checkpoint tensor lands (written once);
:func:`make_plan` cuts those pieces by the rows each trainer rank owns into transfers, refused with
:class:`PlanError` unless every engine element is written exactly once; and three ways send them, in every
trainer rank: :func:`send_gathered` (a: gather all on rank 0, then ``vllm_ext.push_weights``; b, with
``overlap``: one bucket gathered while the previous one is on the wire) and :func:`send_shards` (c: point to
point, only what each engine rank needs), received by ``labsupport.vllm_reshard.ReshardExtension``
(the engine side, a vLLM worker extension) straight into its fused TP parameters.
Each returns its peak extra memory: ``torch.cuda.max_memory_allocated`` over the level before on GPUs; on
CPU the bytes of trainer-side buffers the mode holds at its peak, counted.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from labsupport import broadcast, groups, vllm_ext
from labsupport.core.buckets import groups as bucket_groups  # greedy bucketing, one copy
from labsupport.core.buckets import metas

Box = tuple[tuple[int, int], ...]  # [start, stop) per dimension
VOCAB_PAD = 64  # vLLM pads the vocabulary of embed_tokens and lm_head to a multiple of this


class PlanError(ValueError):
    """A layout or plan that would leave engine elements unwritten, write some twice, or not fit; nothing moved.
    Plain layout arithmetic, raised before anything talks to vLLM or a process group."""


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

    def fused(param: str, parts: list[tuple[str, tuple[int, ...], Callable[[int], int], int]]) -> None:
        """Column parallel: on rank t, ``n`` rows of each part from row ``first(t)``, stacked in order."""
        for t in range(tp):
            off = 0
            for name, shape, first, n in parts:
                out.pieces.append(Piece(name, param, t, _rows(shape, first(t), first(t) + n), _rows(shape, off, off + n)))
                off += n
            out.engine[(t, param)] = (off, *parts[0][1][1:])
        out.checkpoint.update({name: shape for name, shape, _, _ in parts})

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

    def q_row(t: int) -> int:
        return t * q

    def kv_row(t: int) -> int:  # fewer KV heads than TP ranks: TP / n_kv ranks share each head
        return t * nkv // tp * hd if nkv >= tp else t // (tp // nkv) * hd

    def mlp_row(t: int) -> int:
        return t * inter // tp

    vocab_parallel("model.embed_tokens.weight")
    for i in range(cfg.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        for kind, cols in (("weight", (h,)), ("bias", ())):
            fused(f"{a}.qkv_proj.{kind}", [(f"{a}.q_proj.{kind}", (nh * hd, *cols), q_row, q),
                                           (f"{a}.k_proj.{kind}", (nkv * hd, *cols), kv_row, per_kv),
                                           (f"{a}.v_proj.{kind}", (nkv * hd, *cols), kv_row, per_kv)])
        row_parallel(f"{a}.o_proj.weight", (h, nh * hd))
        fused(f"{m}.gate_up_proj.weight", [(f"{m}.{p}_proj.weight", (inter, h), mlp_row, inter // tp) for p in ("gate", "up")])
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
    engine: dict[tuple[int, str], tuple[int, ...]]  # (TP rank, parameter) -> shape, as the layout predicts
    n_trainers: int

    def batches(self, bucket_numel: int) -> list[list[int]]:
        """Transfer indices in consecutive groups of at most ``bucket_numel`` elements; every rank computes
        the same groups and finishes one before starting the next."""
        return bucket_groups([tr.numel for tr in self.transfers], bucket_numel)

    def bytes_between(self, elem_bytes: int) -> dict[tuple[int, int], int]:
        """Bytes each (trainer rank, engine rank) link carries."""
        out: Counter = Counter()
        for t in self.transfers:
            out[(t.trainer, t.engine)] += t.numel * elem_bytes
        return dict(out)


def _volume(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def _inside(box: Box, shape: Sequence[int]) -> bool:
    return len(box) == len(shape) and all(0 <= a <= b <= s for (a, b), s in zip(box, shape))


def _overlap(x: Box, y: Box) -> Box | None:
    both = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(x, y))
    return both if all(a < b for a, b in both) else None


def slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


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
        fits = _inside(p.dst, layout.engine[key]) and (p.src is None or (  # (None: source checked elsewhere)
            _inside(p.src, layout.checkpoint.get(p.name, ())) and [b - a for a, b in p.src] == [b - a for a, b in p.dst]))
        if not fits:
            probs.append(f"{p.name}{_fmt(p.src or ())} {layout.checkpoint.get(p.name)} -> '{p.param}'{_fmt(p.dst)} "
                         f"{layout.engine[key]} on TP rank {p.rank}: the boxes do not fit")
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
        for r, (s, e) in enumerate((owners or {}).get(p.name) or fsdp_rows(layout.checkpoint[p.name][0], n_trainers)):
            a, b = max(p.src[0][0], s), min(p.src[0][1], e)
            if a >= b:
                continue
            d0 = p.dst[0][0] + a - p.src[0][0]
            transfers.append(Transfer(r, p.rank, p.name, p.param, ((a - s, b - s),) + p.src[1:],
                                      ((d0, d0 + b - a),) + p.dst[1:]))
    moved, need = sum(t.numel for t in transfers) + sum(_volume(p.dst) for p in pads), sum(map(math.prod, layout.engine.values()))
    if moved != need:
        raise PlanError(f"the trainer ranks' rows do not cover the checkpoint: {moved} elements planned for "
                        f"{need}; pass owners that partition every tensor")
    return Plan(transfers, pads, dict(layout.engine), n_trainers)


def module_buckets(layout: Layout, nbytes: Mapping[str, int], bucket_bytes: int) -> list[list[str]]:
    """Checkpoint names in groups of whole engine modules (q, k, v together: vLLM reloads whole layers), each
    group at most ``bucket_bytes`` unless one module alone is larger."""
    modules: dict[str, list[str]] = {}
    for p in layout.pieces:
        names = modules.setdefault(p.param.rpartition(".")[0], [])
        if p.name is not None and p.name not in names and p.rank == 0:  # (a name goes to one module)
            names.append(p.name)
    mods = list(modules.values())
    return [sum((mods[i] for i in g), []) for g in bucket_groups([sum(nbytes[n] for n in m) for m in mods], bucket_bytes)]


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
        self.cuda, self.held, self.peak, self.lock = device.type == "cuda", 0, 0, threading.Lock()
        if self.cuda:
            torch.cuda.synchronize()
            self.base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()

    def hold(self, nbytes: int) -> None:  # (negative: released; mode (b) holds from two threads)
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
    peak, t0 = _Peak(next(iter(params.values())).device), time.perf_counter()
    nbytes = {n: p.numel() * (dtype or p.dtype).itemsize for n, p in params.items()}

    def gather(names: list[str]) -> list[tuple[str, torch.Tensor]]:
        got = []
        for n in names:
            t = (params[n].full_tensor() if hasattr(params[n], "full_tensor") else params[n]).detach()
            got.append((n, t.to(dtype) if dtype is not None else t))
            peak.hold(nbytes[n])
            if rank != 0:  # the other ranks drop each tensor at once
                got.pop()
                peak.hold(-nbytes[n])
        return got

    def push(items: list[tuple[str, torch.Tensor]]) -> None:
        plan = broadcast.plan_buckets(metas(items), bucket_bytes)
        staging = 2 * max((b.nbytes for b in plan if b.packed), default=0)  # push_weights' buffers, during the send
        vllm_ext.push_weights(group, items, call, mode="bucketed", bucket_bytes=bucket_bytes)
        peak.hold(staging)
        peak.hold(-staging - sum(nbytes[n] for n, _ in items))

    buckets = module_buckets(layout, nbytes, bucket_bytes // 2) if overlap else [list(params)]
    with torch.no_grad(), ThreadPoolExecutor(max_workers=1) as pool:
        sending = None
        for names in buckets:
            items = gather(names)  # (b): while the previous bucket is on the wire
            if sending is not None:
                sending.result()  # (re-raises the sender's error here)
            sending = pool.submit(push, items) if rank == 0 else None
            del items
        if sending is not None:
            sending.result()
    return {"mode": "b_bucket_overlap" if overlap else "a_gather_all", "seconds": time.perf_counter() - t0,
            "buckets": len(buckets), **peak.result()}


def send_shards(shards: Mapping[str, torch.Tensor], plan: Plan, group: groups.StatelessGroup, *, rank: int,
                dtype: torch.dtype | None = None, bucket_bytes: int = 256 << 20) -> dict[str, Any]:
    """Mode (c), in every trainer rank: send this rank's boxes to the engine ranks, batch by batch.

    ``group``: trainer ranks 0..N-1 and engine TP rank e as N + e. First every rank (engine ranks too, in
    ``ReshardExtension.receive_shards``) checks the plan against what it holds and all vote, so a bad plan
    fails everywhere before any byte moves. A box that is not a contiguous view of the shard (the column
    slices of o_proj and down_proj) or needs a cast is copied: those copies are the extra memory.
    """
    first = next(iter(shards.values()))
    peak, t0 = _Peak(first.device), time.perf_counter()
    mine = [tr for tr in plan.transfers if tr.trainer == rank]
    vote(group, [f"trainer rank {rank}: {tr.name}{_fmt(tr.src)} is not in its local shard "
                  f"{tuple(shards[tr.name].shape) if tr.name in shards else '(missing)'}"
                  for tr in mine if tr.name not in shards or not _inside(tr.src, shards[tr.name].shape)])
    n_bytes = 0
    with torch.no_grad():
        for batch in plan.batches(max(bucket_bytes // (dtype or first.dtype).itemsize, 1)):
            ops, held = [], 0
            for i in (i for i in batch if plan.transfers[i].trainer == rank):
                tr = plan.transfers[i]
                view = shards[tr.name][slices(tr.src)]
                t = (view.to(dtype) if dtype is not None else view).contiguous()
                held += t.numel() * t.element_size() if t.data_ptr() != view.data_ptr() else 0  # a copy
                n_bytes += t.numel() * t.element_size()
                ops.append(("send", t, plan.n_trainers + tr.engine, i))
            peak.hold(held)
            group.wait_work(group.exchange(ops), "shard send")
            group.synchronize("shard send")
            peak.hold(-held)
            del ops
    return {"mode": "c_shard_to_shard", "seconds": time.perf_counter() - t0, "bytes": n_bytes,
            "n_transfers": len(mine), **peak.result()}


def vote(group: groups.StatelessGroup, problems: list[str]) -> None:
    """Every rank of ``group`` states its problems with the plan; if any rank has one, every rank raises."""
    every = group.all_gather_object(problems)
    bad = [f"rank {r}: {p}" for r, ps in enumerate(every) for p in ps]
    if bad:
        raise PlanError("resharding plan refused, no weight was changed:\n  " + "\n  ".join(bad[:8]))
