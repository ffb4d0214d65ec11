"""Diagnosis lab 1's system: a weight sync with one fault. Learners: do not read this module (the lab says why).

A trainer and two receivers run in three processes, joined in a stateless group (gloo on the CPU, NCCL with
3 GPUs). The trainer takes an optimizer step and syncs, twice: ``labsupport.core.sync.send``, received by a
receiver that keeps one buffer per bucket between syncs (so it allocates nothing after the first). After each
sync the trainer publishes its checksums; each receiver reports its version, its checksums, and the tensors
that differ from the trainer's. With one or two GPUs (NCCL puts no two ranks of a group on one GPU), every
rank's weights live on the first GPU and the buckets travel over gloo through host memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diagnosis import Fault, drawn, seed
from diagnosis.instruments import difference, label, short, table
from labsupport import groups
from labsupport.checksums import tensor_checksums
from labsupport.core import buckets, sync
from labsupport.course import hardware, models
from labsupport.course.ranks import run_ranks

LOOK_SIZE = "the size of each difference (largest |receiver - trainer|, absolute and relative)"
FAULTS = {
    "bucket_loaded_early": Fault("a receiver loads one bucket from its buffer before that bucket's broadcast "
                                 "has arrived", "the bucket's number in the bucket map",
                                 "the bucket map beside the version each tensor matches"),
    "wrong_offset": Fault("a receiver slices one tensor out of its bucket at the wrong byte offset",
                          "the tensor's name", LOOK_SIZE),
    "receiver_not_updated": Fault("one receiver loads every update into a copy of its weights, not into the "
                                  "weights it serves", "the receiver's rank (1 or 2)",
                                  "the version each receiver reports beside the version its checksums match"),
    "lossy_cast": Fault("one tensor travels in bfloat16 and is cast back to float32 when it arrives",
                        "the tensor's name", LOOK_SIZE),
}
VARIANTS = [("bucket_loaded_early", b) for b in ("1", "2", "4", "5")] \
    + [("wrong_offset", f"model.layers.{n}") for n in ("0.self_attn.k_proj.weight", "0.mlp.gate_proj.weight",
                                                        "1.mlp.down_proj.weight")] \
    + [("receiver_not_updated", r) for r in ("1", "2")] \
    + [("lossy_cast", n) for n in ("model.layers.0.self_attn.v_proj.weight", "model.layers.1.mlp.up_proj.weight",
                                   "lm_head.weight")]
BUCKET_BYTES = 256 << 10  # seven buckets for the tiny model's 1.4 MB
SYNCS = 2
WORLD = 3  # the trainer and two receivers


@dataclass
class Seen:
    """What the instruments saw: the bucket map, the trainer's checksums per version (0 = before any step), and
    per sync each receiver's reported version, checksums, and the tensors that differ from the trainer's."""
    buckets: list[list[str]]
    trainer: list[dict[str, int]]
    syncs: list[dict[int, dict]]  # [{rank: {"version": int, "sums": {name: int}, "differing": {name: tensor}}}]
    weights: list[dict[str, torch.Tensor]] = field(repr=False, default_factory=list)  # the trainer's versions
    device: str = "cpu"


def versions(steps: int = SYNCS, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """The tiny model's weights before training and after each of ``steps`` optimizer steps."""
    tok, model = models.build_tokenizer(), models.build_model(seed)
    out = [{n: t.detach().clone() for n, t in model.state_dict().items()}]
    for k in range(steps):
        models.train_pattern(model, tok, steps=1, seed=k, batch_size=8)
        out.append({n: t.detach().clone() for n, t in model.state_dict().items()})
    return out


def _views(buf: torch.Tensor, entries: list, fault: str, where: str) -> list[tuple[str, torch.Tensor]]:
    """The bucket's tensors as views, as the receiver slices them."""
    if fault == "wrong_offset":
        entries = [(n, d, s, off - buckets.ALIGN if n == where else off, nb) for n, d, s, off, nb in entries]
    views = buckets.unpack(buf, entries)
    if fault == "lossy_cast":
        views = [(n, v.to(torch.bfloat16).to(v.dtype) if n == where else v) for n, v in views]
    return views


def _receive(group: groups.StatelessGroup, load, buffers: dict[int, torch.Tensor], fault: str, where: str) -> None:
    """``core.sync.receive`` with one buffer per bucket kept between syncs, and the fault."""
    metas, bucket_bytes = group.broadcast_object(None, 0)
    for k, bucket in enumerate(buckets.split(metas, bucket_bytes)):
        entries, size = buckets.layout(bucket)
        buf = buffers.setdefault(k, torch.zeros(size, dtype=torch.uint8, device=group.device))
        early = fault == "bucket_loaded_early" and where == str(k)
        if early:
            load(buckets.unpack(buf, entries))
        group.broadcast(buf, 0)
        if not early:
            load(_views(buf, entries, fault, where))
    group.all_reduce(torch.ones(1, device=group.device))  # the core's closing step: every rank got here
    group.synchronize("the weight sync")


def _one(group: groups.StatelessGroup, weights: list[dict[str, torch.Tensor]], variant: tuple[str, str],
         device: torch.device) -> list:
    """One run of the system on this rank, its weights on ``device``: ``SYNCS`` syncs; what it saw after each."""
    fault, where = variant
    rank = group.rank
    staged = device != group.device  # the buckets travel through host memory: copies on the way in and out
    state = {n: t.to(device, copy=True) for n, t in weights[0].items()}
    target = state
    if fault == "receiver_not_updated" and where == str(rank):
        target = {n: t.clone() for n, t in state.items()}  # loaded into a copy: the served weights never change
    buffers: dict[int, torch.Tensor] = {}
    out = []
    for version in range(1, len(weights)):
        if rank == 0:
            for n, t in state.items():
                t.copy_(weights[version][n])  # the optimizer step
            sync.send(group, {n: t.to(group.device) for n, t in state.items()} if staged else state, BUCKET_BYTES)
            group.broadcast_object((version, tensor_checksums(state)), 0)
            out.append(None)
            continue
        load = sync.copy_into(target)
        _receive(group, (lambda batch: load([(n, v.to(device)) for n, v in batch])) if staged else load,
                 buffers, fault, where)
        trainer_version, trainer_sums = group.broadcast_object(None, 0)
        sums = tensor_checksums(state)
        out.append({"version": trainer_version, "sums": sums,
                    "differing": {n: state[n].to("cpu", copy=True).numpy() for n in sums if sums[n] != trainer_sums[n]}})
        # (numpy arrays: a torch tensor in a result would travel as shared memory that dies with this process)
    return out


def _rank(rank: int, world: int, port: int, weights: list, variants: list, gpu: bool) -> list:
    nccl = gpu and torch.cuda.device_count() >= world
    device = torch.device(f"cuda:{rank}" if nccl else "cuda:0" if gpu else "cpu")  # where this rank's weights live
    group = groups.create_group("127.0.0.1", port, rank, world, device=device if nccl else "cpu", timeout_s=120)
    try:
        return [_one(group, weights, v, device) for v in variants]
    finally:
        group.destroy()


def run_all(variants: list[tuple[str, str]], gpu: bool | None = None) -> list[Seen]:
    """Run the system once per variant (one group, three processes); what the instruments saw in each. ``gpu``:
    the weights on GPUs (NCCL with 3, else all on the first GPU over gloo); default: with 3 GPUs."""
    gpu = hardware.gpu_count() >= WORLD if gpu is None else gpu
    weights = versions()
    results = run_ranks(_rank, WORLD, (groups.free_port(), weights, variants, gpu), timeout_s=600)
    failed = [f"rank {r}: {out[0]}: {out[1]}" for r, (ok, out) in enumerate(results) if not ok]
    if failed:
        raise RuntimeError("the sync's processes failed: " + "; ".join(failed))
    metas = [buckets.meta(n, t) for n, t in weights[0].items()]
    bucket_map = [[m[0] for m in b] for b in buckets.split(metas, BUCKET_BYTES)]
    trainer = [tensor_checksums(w) for w in weights]
    return [Seen(bucket_map, trainer, [{r: results[r][1][i][s] for r in range(1, WORLD)} for s in range(SYNCS)],
                 weights, "cuda" if gpu else "cpu") for i in range(len(variants))]


def run(gpu: bool | None = None) -> Seen:
    """The learner's system: the variant their seed draws, run once."""
    return run_all([drawn("d1", seed()[0])], gpu)[0]


def show(seen: Seen, limit: int = 12) -> None:
    """Print the instruments: the bucket map, each receiver's reported version, the trainer version each
    receiver's tensor matches after each sync, and the size of every difference from the trainer's."""
    print("Bucket map (bucket: tensors, in the order they travel):")
    for k, names in enumerate(seen.buckets):
        print(f"  {k}: " + ", ".join(short(n) for n in names))
    for s, ranks in enumerate(seen.syncs, 1):
        print(f"After sync {s} the trainer is at version {s}; the receivers report: "
              + ", ".join(f"rank {r} version {d['version']}" for r, d in ranks.items()))
    bucket_of = {n: k for k, names in enumerate(seen.buckets) for n in names}
    header = ["tensor", "bucket"] + [f"sync {s} r{r}" for s, ranks in enumerate(seen.syncs, 1) for r in ranks]
    rows = [[short(n), bucket_of[n]] + [label(seen.trainer, n, d["sums"][n]) for ranks in seen.syncs
                                        for d in ranks.values()] for n in seen.trainer[0]]
    print("\nThe trainer version each receiver's tensor matches, by checksum (vK: version K; none: no version):")
    print(table(header, rows))
    diffs = [[s, r, short(n), *(f"{x:.3g}" for x in difference(torch.from_numpy(t), seen.weights[s][n]))]
             for s, ranks in enumerate(seen.syncs, 1) for r, d in ranks.items() for n, t in d["differing"].items()]
    print(f"\nEvery tensor that differs from the trainer's after a sync ({len(diffs)}):")
    if diffs:
        print(table(["sync", "rank", "tensor", "largest |diff|", "relative"], diffs[:limit]))
        if len(diffs) > limit:
            print(f"  ... and {len(diffs) - limit} more")
