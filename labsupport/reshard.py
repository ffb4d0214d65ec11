"""Resharding FSDP shards into a tensor-parallel engine (Chapter 7, Lab 7): the arithmetic, checked
before anything moves (``vllm_reshard`` moves the bytes). :func:`qwen2_layout`: where each box of
each checkpoint tensor lands in a TP engine's fused parameters (``qkv_proj``, ``gate_up_proj``;
row- and column-parallel splits; vocabulary padded to a multiple of 64); :func:`make_plan` cuts
them by the rows each FSDP rank owns (:class:`PlanError` unless every engine element is written
exactly once); :func:`vote` refuses, on every rank, a plan that some rank's tensors contradict.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from labsupport import groups
from labsupport.core.buckets import groups as bucket_groups  # greedy bucketing, one copy

Box = tuple[tuple[int, int], ...]  # [start, stop) per dimension
VOCAB_PAD = 64  # vLLM pads the vocabulary of embed_tokens and lm_head to a multiple of this


class PlanError(ValueError):
    """Engine elements left unwritten or written twice, boxes that do not fit: found before any
    byte moves (nothing has talked to vLLM or a process group yet)."""


def _refuse(probs: list[str]) -> None:
    if probs:
        shown = probs[:8] + ([f"... and {len(probs) - 8} more"] if len(probs) > 8 else [])
        raise PlanError("resharding plan refused, no weight was changed:\n  " + "\n  ".join(shown))


# ----------------------------------------------------------------------------- 1. the layout
@dataclass(frozen=True)
class Piece:
    """Box ``src`` of checkpoint tensor ``name`` -> box ``dst`` of ``param`` on TP rank ``rank``."""
    name: str | None  # None: padding rows, which the engine fills with zeros
    param: str
    rank: int
    src: Box | None
    dst: Box
    numel = property(lambda self: math.prod(b - a for a, b in self.dst))


@dataclass
class Layout:
    pieces: list[Piece]
    engine: dict[tuple[int, str], tuple[int, ...]]  # (TP rank, vLLM parameter) -> its shape there
    checkpoint: dict[str, tuple[int, ...]]  # HF name -> full shape


def _cut(shape: Sequence[int], a: int, b: int, dim: int = 0) -> Box:
    """All of ``shape`` but ``[a, b)`` along ``dim``."""
    return tuple((a, b) if d == dim else (0, int(s)) for d, s in enumerate(shape))


def _split(out: Layout, tp: int, param: str, parts: list[tuple[str, tuple[int, ...], int]],
           dim: int = 0) -> None:
    """On rank t, ``blocks / tp`` blocks (heads, rows) along ``dim`` of each part (name, shape,
    blocks), stacked: column (``dim=0``) or row (``dim=1``) parallel. With fewer blocks than ranks
    (KV heads; 1: replicated), ``tp / blocks`` ranks share one."""
    for t in range(tp):
        off = 0
        for name, shape, blocks in parts:
            per = shape[dim] // blocks
            a, n = t * blocks // tp * per, max(blocks // tp, 1) * per
            out.pieces.append(Piece(name, param, t, _cut(shape, a, a + n, dim),
                                    _cut(shape, off, off + n, dim)))
            off += n
        out.engine[(t, param)] = tuple(off if d == dim else s for d, s in enumerate(parts[0][1]))
    out.checkpoint.update({name: shape for name, shape, _ in parts})


def _vocab(out: Layout, tp: int, name: str, vocab: int, h: int) -> None:
    """Vocabulary parallel: rows split after padding to a multiple of ``VOCAB_PAD`` with zeros."""
    per = math.ceil(vocab / VOCAB_PAD) * VOCAB_PAD // tp
    for t in range(tp):
        a, b = t * per, min((t + 1) * per, vocab)
        if b > a:
            out.pieces.append(Piece(name, name, t, _cut((vocab, h), a, b),
                                    _cut((per, h), 0, b - a)))
        if b - a < per:
            out.pieces.append(Piece(None, name, t, None, _cut((per, h), max(b - a, 0), per)))
        out.engine[(t, name)] = (per, h)
    out.checkpoint[name] = (vocab, h)


def qwen2_layout(cfg: Any, tp: int) -> Layout:
    """Where each tensor of a Qwen2 checkpoint (HF config ``cfg``) lands in a ``tp``-rank engine."""
    h, nh, nkv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    hd, inter = getattr(cfg, "head_dim", None) or h // nh, cfg.intermediate_size
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
            _split(out, tp, f"{a}.qkv_proj.{kind}", qkv)
        _split(out, tp, f"{a}.o_proj.weight", [(f"{a}.o_proj.weight", (h, nh * hd), nh)], dim=1)
        gate_up = [(f"{m}.{p}_proj.weight", (inter, h), inter) for p in ("gate", "up")]
        _split(out, tp, f"{m}.gate_up_proj.weight", gate_up)
        _split(out, tp, f"{m}.down_proj.weight", [(f"{m}.down_proj.weight", (h, inter), tp)], dim=1)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            name = f"model.layers.{i}.{norm}.weight"
            _split(out, tp, name, [(name, (h,), 1)])  # replicated
    _split(out, tp, "model.norm.weight", [("model.norm.weight", (h,), 1)])
    if not cfg.tie_word_embeddings:
        _vocab(out, tp, "lm_head.weight", cfg.vocab_size, h)
    return out


# ----------------------------------------------------------------------------- 2. the plan
@dataclass(frozen=True)
class Transfer:
    """Box ``src`` of trainer rank ``trainer``'s local shard of ``name`` -> ``dst`` of ``param``."""
    trainer: int
    engine: int  # the TP rank that holds ``param``
    name: str
    param: str
    src: Box
    dst: Box
    numel = Piece.numel


@dataclass
class Plan:
    transfers: list[Transfer]
    pads: list[Piece]  # engine boxes filled with zeros (vocabulary padding)
    engine: dict[tuple[int, str], tuple[int, ...]]  # (TP rank, parameter) -> shape, as predicted
    n_trainers: int

    def batches(self, bucket_numel: int) -> list[list[int]]:
        """Transfer indices in groups of at most ``bucket_numel`` elements, alike on all ranks."""
        return bucket_groups([tr.numel for tr in self.transfers], bucket_numel)

    def bytes_between(self, elem_bytes: int) -> dict[tuple[int, int], int]:
        """Bytes each (trainer rank, engine rank) link carries."""
        out: dict[tuple[int, int], int] = {}
        for t in self.transfers:
            out[(t.trainer, t.engine)] = out.get((t.trainer, t.engine), 0) + t.numel * elem_bytes
        return out


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
    by_param: dict[tuple[int, str], list[Piece]] = {key: [] for key in layout.engine}
    for p in layout.pieces:
        where, full = f"'{p.param}' on TP rank {p.rank}", layout.checkpoint.get(p.name)
        if (shape := layout.engine.get((p.rank, p.param))) is None:
            probs.append(f"{p.name} -> {where}: the engine has no such parameter")
            continue
        src_fits = p.src is None or (_inside(p.src, full or ())
                                     and [b - a for a, b in p.src] == [b - a for a, b in p.dst])
        if not (src_fits and _inside(p.dst, shape)):
            probs.append(f"{p.name}{_fmt(p.src or ())} {full} -> '{p.param}'{_fmt(p.dst)} {shape} "
                         f"on TP rank {p.rank}: the boxes do not fit")
        by_param[(p.rank, p.param)].append(p)
    for (rank, param), pieces in by_param.items():
        shape = layout.engine[(rank, param)]
        twice = [(x, y, both) for i, x in enumerate(pieces) for y in pieces[i + 1:]
                 if (both := _overlap(x.dst, y.dst))]
        probs += [f"'{param}' on TP rank {rank}: elements {_fmt(both)} written twice (by "
                  f"{x.name} and {y.name})" for x, y, both in twice]
        filled = sum(p.numel for p in pieces)
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
    transfers, pads = [], [p for p in layout.pieces if p.name is None]
    for p in (p for p in layout.pieces if p.name is not None):
        rows = (owners or {}).get(p.name) or fsdp_rows(layout.checkpoint[p.name][0], n_trainers)
        for r, (s, e) in enumerate(rows):
            a, b = max(p.src[0][0], s), min(p.src[0][1], e)
            if a < b:
                d0 = p.dst[0][0] + a - p.src[0][0]
                transfers.append(Transfer(r, p.rank, p.name, p.param, ((a - s, b - s),) + p.src[1:],
                                          ((d0, d0 + b - a),) + p.dst[1:]))
    moved = sum(t.numel for t in [*transfers, *pads])
    need = sum(map(math.prod, layout.engine.values()))
    if moved != need:
        raise PlanError(f"the trainer ranks' rows do not cover the checkpoint: {moved} elements "
                        f"planned for {need}; pass owners that partition every tensor")
    return Plan(transfers, pads, dict(layout.engine), n_trainers)


def module_buckets(layout: Layout, nbytes: Mapping[str, int], bucket_bytes: int) -> list[list[str]]:
    """Checkpoint names in groups of whole engine modules (q, k, v together: vLLM reloads whole
    layers), each group at most ``bucket_bytes`` unless one module alone is larger."""
    modules: dict[str, dict[str, None]] = {}  # (a dict: each name once, in order)
    for p in layout.pieces:
        if p.name is not None and p.rank == 0:
            modules.setdefault(p.param.rpartition(".")[0], {})[p.name] = None
    mods = [list(m) for m in modules.values()]
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
