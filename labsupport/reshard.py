"""Resharding from FSDP shards to a tensor-parallel engine (Chapter 7, Lab 7): the arithmetic,
checked before anything moves (``vllm_reshard`` moves the bytes). :func:`qwen2_layout` says where
every box of every checkpoint tensor lands in a TP engine's fused parameters (``qkv_proj``,
``gate_up_proj``; row- and column-parallel splits; the vocabulary padded to a multiple of 64);
:func:`make_plan` cuts those pieces by the rows each FSDP rank owns, refused with
:class:`PlanError` unless every engine element is written exactly once; :func:`vote` refuses, on
every rank, a plan that does not match what some rank holds.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from labsupport import groups
from labsupport.core.buckets import groups as bucket_groups  # greedy bucketing, one copy

Box = tuple[tuple[int, int], ...]  # [start, stop) per dimension
VOCAB_PAD = 64  # vLLM pads the vocabulary of embed_tokens and lm_head to a multiple of this


class PlanError(ValueError):
    """A layout or plan that would leave engine elements unwritten, write some twice, or not fit;
    raised before anything talks to vLLM or a process group."""


def _refuse(probs: list[str]) -> None:
    """Raise ``PlanError`` listing the first problems, if there are any."""
    if probs:
        more = f"\n  ... and {len(probs) - 8} more" if len(probs) > 8 else ""
        raise PlanError("resharding plan refused, no weight was changed:\n  "
                        + "\n  ".join(probs[:8]) + more)


# ----------------------------------------------------------------------------- 1. the layout
@dataclass(frozen=True)
class Piece:
    """Box ``src`` of checkpoint tensor ``name`` goes to box ``dst`` of engine parameter ``param``
    on TP rank ``rank``. ``name=None``: padding rows the engine fills with zeros."""

    name: str | None
    param: str
    rank: int
    src: Box | None
    dst: Box


@dataclass
class Layout:
    pieces: list[Piece]
    engine: dict[tuple[int, str], tuple[int, ...]]  # (TP rank, vLLM parameter) -> its shape there
    checkpoint: dict[str, tuple[int, ...]]  # HF name -> full shape


def _full(shape: Sequence[int]) -> Box:
    return tuple((0, int(s)) for s in shape)


def _rows(shape: Sequence[int], a: int, b: int) -> Box:
    return ((a, b),) + _full(shape[1:])


def _block_rows(blocks: int, size: int, tp: int, t: int) -> tuple[int, int]:
    """Rows ``[a, b)`` that TP rank ``t`` takes of ``blocks`` blocks (heads, rows) of ``size`` rows;
    fewer blocks than ranks (KV heads): ``tp / blocks`` ranks share each block."""
    if blocks >= tp:
        return t * blocks // tp * size, (t + 1) * blocks // tp * size
    first = t // (tp // blocks) * size
    return first, first + size


def _column(out: Layout, tp: int, param: str,
            parts: list[tuple[str, tuple[int, ...], int]]) -> None:
    """Column parallel: on rank t, its rows of each part (name, shape, row blocks), stacked; one
    block of rows: replicated."""
    for t in range(tp):
        off = 0
        for name, shape, blocks in parts:
            a, b = _block_rows(blocks, shape[0] // blocks, tp, t)
            dst = _rows(shape, off, off + b - a)
            out.pieces.append(Piece(name, param, t, _rows(shape, a, b), dst))
            off += b - a
        out.engine[(t, param)] = (off, *parts[0][1][1:])
    out.checkpoint.update({name: shape for name, shape, _ in parts})


def _row(out: Layout, tp: int, name: str, shape: tuple[int, int]) -> None:
    """Row parallel: on rank t, a range of columns (the input features of the heads it computes)."""
    cols = shape[1] // tp
    for t in range(tp):
        src = ((0, shape[0]), (t * cols, (t + 1) * cols))
        out.pieces.append(Piece(name, name, t, src, _full((shape[0], cols))))
        out.engine[(t, name)] = (shape[0], cols)
    out.checkpoint[name] = shape


def _vocab(out: Layout, tp: int, name: str, vocab: int, h: int) -> None:
    """Vocabulary parallel: rows split after padding to a multiple of ``VOCAB_PAD`` with zeros."""
    per = math.ceil(vocab / VOCAB_PAD) * VOCAB_PAD // tp
    for t in range(tp):
        a, b = t * per, min((t + 1) * per, vocab)
        if b > a:
            src = _rows((vocab, h), a, b)
            out.pieces.append(Piece(name, name, t, src, _rows((per, h), 0, b - a)))
        if b - a < per:
            out.pieces.append(Piece(None, name, t, None, _rows((per, h), max(b - a, 0), per)))
        out.engine[(t, name)] = (per, h)
    out.checkpoint[name] = (vocab, h)


def qwen2_layout(cfg: Any, tp: int) -> Layout:
    """Where each tensor of a Qwen2 checkpoint (HF config ``cfg``) lands in a ``tp``-rank engine."""
    h, nh, nkv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or h // nh
    inter = cfg.intermediate_size
    if nh % tp or inter % tp or (nkv % tp and tp % nkv):
        raise PlanError(f"TP={tp} must divide the heads ({nh}) and intermediate size ({inter}), "
                        f"and the {nkv} KV heads must divide by TP or TP by them")
    out = Layout([], {}, {})
    _vocab(out, tp, "model.embed_tokens.weight", cfg.vocab_size, h)
    for i in range(cfg.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        for kind, cols in (("weight", (h,)), ("bias", ())):
            qkv = [(f"{a}.{p}_proj.{kind}", (n * hd, *cols), n)
                   for p, n in (("q", nh), ("k", nkv), ("v", nkv))]
            _column(out, tp, f"{a}.qkv_proj.{kind}", qkv)
        _row(out, tp, f"{a}.o_proj.weight", (h, nh * hd))
        gate_up = [(f"{m}.{p}_proj.weight", (inter, h), inter) for p in ("gate", "up")]
        _column(out, tp, f"{m}.gate_up_proj.weight", gate_up)
        _row(out, tp, f"{m}.down_proj.weight", (h, inter))
        for norm in ("input_layernorm", "post_attention_layernorm"):
            name = f"model.layers.{i}.{norm}.weight"
            _column(out, tp, name, [(name, (h,), 1)])  # replicated
    _column(out, tp, "model.norm.weight", [("model.norm.weight", (h,), 1)])
    if not cfg.tie_word_embeddings:
        _vocab(out, tp, "lm_head.weight", cfg.vocab_size, h)
    return out


# ----------------------------------------------------------------------------- 2. the plan
@dataclass(frozen=True)
class Transfer:
    """Box ``src`` of trainer rank ``trainer``'s local shard of ``name`` -> box ``dst`` of ``param``
    on engine TP rank ``engine``."""

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
    engine: dict[tuple[int, str], tuple[int, ...]]  # (TP rank, parameter) -> shape, as predicted
    n_trainers: int

    def batches(self, bucket_numel: int) -> list[list[int]]:
        """Transfer indices in consecutive groups of at most ``bucket_numel`` elements; every rank
        computes the same groups and finishes one before starting the next."""
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
    """Raise ``PlanError`` naming every engine parameter not written exactly once, every bad box."""
    probs: list[str] = []
    by_param: dict[tuple[int, str], list[Piece]] = {}
    for p in layout.pieces:
        key = (p.rank, p.param)
        if key not in layout.engine:
            probs.append(f"{p.name} -> '{p.param}' on TP rank {p.rank}: the engine has no such "
                         "parameter")
            continue
        src_fits = p.src is None or (_inside(p.src, layout.checkpoint.get(p.name, ()))
                                     and [b - a for a, b in p.src] == [b - a for a, b in p.dst])
        if not (src_fits and _inside(p.dst, layout.engine[key])):
            probs.append(f"{p.name}{_fmt(p.src or ())} {layout.checkpoint.get(p.name)} -> "
                         f"'{p.param}'{_fmt(p.dst)} {layout.engine[key]} on TP rank {p.rank}: "
                         "the boxes do not fit")
        by_param.setdefault(key, []).append(p)
    for (rank, param), shape in layout.engine.items():
        pieces = by_param.get((rank, param), [])
        twice = [(x, y, both) for i, x in enumerate(pieces) for y in pieces[i + 1:]
                 if (both := _overlap(x.dst, y.dst))]
        probs += [f"'{param}' on TP rank {rank}: elements {_fmt(both)} written twice (by "
                  f"{x.name} and {y.name})" for x, y, both in twice]
        filled = sum(_volume(p.dst) for p in pieces)
        if filled < math.prod(shape) and not twice:  # (boxes inside, none overlapping: a gap)
            names = sorted({str(p.name) for p in pieces}) or "nothing"
            probs.append(f"'{param}' on TP rank {rank}: only {filled} of {math.prod(shape)} "
                         f"elements written (from {names})")
    used = {p.name for p in layout.pieces}
    probs += [f"checkpoint tensor {n} goes nowhere" for n in layout.checkpoint if n not in used]
    _refuse(probs)


def fsdp_rows(n_rows: int, world: int) -> list[tuple[int, int]]:
    """Rows ``[start, stop)`` of a dim-0 ``Shard(0)`` tensor on each of ``world`` FSDP2 ranks
    (torch.chunk's split: ceil(n / world) rows each, the last ranks get fewer, maybe none)."""
    per = -(-n_rows // world)
    return [(min(r * per, n_rows), min((r + 1) * per, n_rows)) for r in range(world)]


def make_plan(layout: Layout, n_trainers: int,
              owners: Mapping[str, list[tuple[int, int]]] | None = None) -> Plan:
    """Cut the layout's pieces by the rows each trainer rank owns (default: ``fsdp_rows``)."""
    check_layout(layout)
    transfers, pads = [], []
    for p in layout.pieces:
        if p.name is None:
            pads.append(p)
            continue
        rows = (owners or {}).get(p.name) or fsdp_rows(layout.checkpoint[p.name][0], n_trainers)
        for r, (s, e) in enumerate(rows):
            a, b = max(p.src[0][0], s), min(p.src[0][1], e)
            if a < b:
                d0 = p.dst[0][0] + a - p.src[0][0]
                transfers.append(Transfer(r, p.rank, p.name, p.param, ((a - s, b - s),) + p.src[1:],
                                          ((d0, d0 + b - a),) + p.dst[1:]))
    moved = sum(t.numel for t in transfers) + sum(_volume(p.dst) for p in pads)
    need = sum(map(math.prod, layout.engine.values()))
    if moved != need:
        raise PlanError(f"the trainer ranks' rows do not cover the checkpoint: {moved} elements "
                        f"planned for {need}; pass owners that partition every tensor")
    return Plan(transfers, pads, dict(layout.engine), n_trainers)


def module_buckets(layout: Layout, nbytes: Mapping[str, int], bucket_bytes: int) -> list[list[str]]:
    """Checkpoint names in groups of whole engine modules (q, k, v together: vLLM reloads whole
    layers), each group at most ``bucket_bytes`` unless one module alone is larger."""
    modules: dict[str, list[str]] = {}
    for p in layout.pieces:
        names = modules.setdefault(p.param.rpartition(".")[0], [])
        if p.name is not None and p.name not in names and p.rank == 0:  # (each name once)
            names.append(p.name)
    mods = list(modules.values())
    sizes = [sum(nbytes[n] for n in m) for m in mods]
    return [sum((mods[i] for i in g), []) for g in bucket_groups(sizes, bucket_bytes)]


def trainer_problems(plan: Plan, rank: int, shards: Mapping[str, Sequence[int]]) -> list[str]:
    """What trainer rank ``rank`` finds wrong with ``plan``: boxes outside its local ``shards``."""
    return [f"trainer rank {rank}: {tr.name}{_fmt(tr.src)} is not in its local shard "
            f"{tuple(shards[tr.name]) if tr.name in shards else '(missing)'}"
            for tr in plan.transfers
            if tr.trainer == rank and not (tr.name in shards and _inside(tr.src, shards[tr.name]))]


def engine_problems(plan: Plan, rank: int, shapes: Mapping[str, Sequence[int]]) -> list[str]:
    """What engine TP rank ``rank`` finds wrong with ``plan``, given its parameters' shapes: a
    parameter of another shape, one the plan never writes, elements not written exactly once."""
    mine = {k[1]: s for k, s in plan.engine.items() if k[0] == rank}
    probs = [f"TP rank {rank}: '{n}' has shape {shapes.get(n)}, the plan expects {tuple(s)}"
             for n, s in mine.items() if tuple(shapes.get(n, ())) != tuple(s)]
    probs += [f"TP rank {rank}: the plan never writes '{n}'" for n in shapes if n not in mine]
    if not probs:
        pieces = [Piece(t.name, t.param, rank, None, t.dst) for t in plan.transfers
                  if t.engine == rank] + [p for p in plan.pads if p.rank == rank]
        try:
            check_layout(Layout(pieces, {(rank, n): s for n, s in mine.items()}, {}))
        except PlanError as exc:
            probs.append(str(exc).split("\n", 1)[1])
    return probs


def vote(group: groups.StatelessGroup, problems: list[str]) -> None:
    """Every rank of ``group`` states its problems with the plan; if any has one, all raise."""
    every = group.all_gather_object(problems)
    _refuse([f"rank {r}: {p}" for r, ps in enumerate(every) for p in ps])
