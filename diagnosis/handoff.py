"""Diagnosis lab 2's system: an IPC weight handoff with one fault. Learners: do not read this module (the lab
says why).

An owner (the trainer) and a receiver (an engine) run in two processes on one device (CUDA IPC on a GPU, a
shared-memory file on the CPU), with ``labsupport.core.handoff``: each round the owner takes an optimizer step,
exports its weights, and sends the handle over a small gloo group; the receiver rebuilds, loads, and reports
its version and checksums; the owner releases. The owner records a memory timeline of every round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diagnosis import Fault, drawn, seed
from diagnosis.instruments import label, short, table
from diagnosis.sync import versions
from labsupport import groups
from labsupport.checksums import tensor_checksums
from labsupport.core import handoff
from labsupport.core.timeline import Timeline
from labsupport.course import hardware
from labsupport.course.ranks import run_ranks

LOOK_MATCH = "which trainer tensor and version each of the receiver's tensors matches, round by round"
FAULTS = {
    "stale_handle": Fault("the receiver maps a handle once and reuses that mapping for later updates",
                          "", LOOK_MATCH),
    "lost_update": Fault("the receiver loads every update into a copy of its weights, not the weights it serves",
                         "", LOOK_MATCH),
    "leaked_buffer": Fault("the owner never releases an exported buffer", "",
                           "the memory timeline: the owner's bytes by role at the end of each round"),
    "dropped_tensor": Fault("the owner's export leaves one tensor out", "the tensor's name", LOOK_MATCH),
    "crossed_names": Fault("the owner pairs two tensors' names with each other's bytes",
                           "either of the two tensors' names", LOOK_MATCH),
}
PARTNER = {"q_proj": "k_proj", "k_proj": "q_proj", "gate_proj": "up_proj", "up_proj": "gate_proj"}
VARIANTS = [("stale_handle", "-"), ("lost_update", "-"), ("leaked_buffer", "-")] \
    + [("dropped_tensor", n) for n in ("model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight",
                                       "model.embed_tokens.weight")] \
    + [("crossed_names", n) for n in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.gate_proj.weight")]
ROUNDS = 3


def partner(name: str) -> str:
    """The tensor whose name ``crossed_names`` pairs with ``name``'s bytes (same shape)."""
    mod = name.split(".")[-2]
    return name.replace(f".{mod}.", f".{PARTNER[mod]}.")


def places(fault: str, where: str) -> list[str]:
    """The answers that name the place of ``(fault, where)``."""
    return [where, partner(where)] if fault == "crossed_names" else [where]


@dataclass
class Seen:
    """What the instruments saw: the trainer's checksums per version (0 = before any step), per round the
    version the receiver reports and its checksums, and the owner's memory timeline (samples and phases)."""
    trainer: list[dict[str, int]]
    rounds: list[dict]  # [{"version": int, "sums": {name: int}}]
    samples: list[dict]
    phases: list[str]
    device: str = "cpu"

    def timeline(self) -> Timeline:
        """The owner's timeline, for ``labsupport.core.timeline.plot``."""
        tl = Timeline("cpu")
        tl.samples, tl.phases, tl.gpu = self.samples, self.phases, self.device != "cpu"
        tl.roles = {role: list for role in self.samples[0]["roles"]}
        return tl


def _named(state: dict[str, torch.Tensor], fault: str, where: str) -> list[tuple[str, torch.Tensor]]:
    """The owner's ``[(name, tensor)]`` for the export."""
    if fault == "dropped_tensor":
        return [(n, t) for n, t in state.items() if n != where]
    if fault == "crossed_names":
        swap = {where: partner(where), partner(where): where}
        return [(n, state[swap.get(n, n)]) for n in state]
    return list(state.items())


def _owner(group, state: dict, weights: list, fault: str, where: str) -> dict:
    tl = Timeline(next(iter(state.values())).device)
    live: list[torch.Tensor] = []
    tl.track("weights", lambda: list(state.values()))
    tl.track("handoff buffers", lambda: live)
    kept = []
    try:
        for r in range(1, ROUNDS + 1):
            with tl.phase(f"step {r}"):
                for n, t in state.items():
                    t.copy_(weights[r][n])
            with tl.phase(f"export {r}"):
                buf, handle = handoff.export(_named(state, fault, where))
                live.append(buf)
            with tl.phase(f"load {r}"):
                group.broadcast_object((r, handle), 0)
                group.broadcast_object(None, 1)  # the receiver has loaded and dropped its views
            with tl.phase(f"release {r}"):
                if fault == "leaked_buffer":
                    kept.append(handle)
                else:
                    live.remove(buf)
                    del buf
                    handoff.release(handle)
    finally:
        live.clear()
        for handle in kept:  # (the leak ends with the run: nothing stays in /dev/shm)
            handoff.release(handle)
    return {"samples": tl.samples, "phases": tl.phases}


def _receiver(group, state: dict, fault: str) -> list[dict]:
    served = state
    target = {n: t.clone() for n, t in state.items()} if fault == "lost_update" else state
    mapped: dict[tuple, list] = {}
    out = []
    for _ in range(ROUNDS):
        version, handle = group.broadcast_object(None, 0)
        if fault == "stale_handle":  # mapped once per layout, then reused
            layout = tuple(e[:3] for e in handle.entries)
            if layout not in mapped:
                mapped[layout] = handoff.rebuild(handle)
            views = mapped[layout]
        else:
            views = handoff.rebuild(handle)
        handoff.load(target, views)
        del views
        out.append({"version": version, "sums": tensor_checksums(served)})
        group.broadcast_object("loaded", 1)
    mapped.clear()
    return out


def _rank(rank: int, world: int, port: int, weights: list, variants: list, gpu: bool) -> list:
    device = "cuda:0" if gpu else "cpu"
    group = groups.create_group("127.0.0.1", port, rank, world, timeout_s=120)  # gloo: handles and replies
    try:
        out = []
        for fault, where in variants:
            state = {n: t.to(device, copy=True) for n, t in weights[0].items()}
            out.append(_owner(group, state, weights, fault, where) if rank == 0 else _receiver(group, state, fault))
            group.barrier()
        return out
    finally:
        group.destroy()


def run_all(variants: list[tuple[str, str]], gpu: bool | None = None) -> list[Seen]:
    """Run the system once per variant (one owner and one receiver process); what the instruments saw."""
    gpu = hardware.gpu_count() >= 1 if gpu is None else gpu
    weights = versions(ROUNDS)
    results = run_ranks(_rank, 2, (groups.free_port(), weights, variants, gpu), timeout_s=600)
    failed = [f"rank {r}: {out[0]}: {out[1]}" for r, (ok, out) in enumerate(results) if not ok]
    if failed:
        raise RuntimeError("the handoff's processes failed: " + "; ".join(failed))
    trainer = [tensor_checksums(w) for w in weights]
    return [Seen(trainer, results[1][1][i], results[0][1][i]["samples"], results[0][1][i]["phases"],
                 "cuda" if gpu else "cpu") for i in range(len(variants))]


def run(gpu: bool | None = None) -> Seen:
    """The learner's system: the variant their seed draws, run once."""
    return run_all([drawn("d2", seed()[0])], gpu)[0]


def show(seen: Seen) -> None:
    """Print the instruments: the version the receiver reports each round, which trainer tensor and version each
    of its tensors matches, and the owner's bytes by role at the end of each phase."""
    print("Each round the trainer takes a step (round r: version r); the receiver reports: "
          + ", ".join(f"round {r} version {d['version']}" for r, d in enumerate(seen.rounds, 1)))
    rows = [[short(n)] + [label(seen.trainer, n, d["sums"][n]) for d in seen.rounds] for n in seen.trainer[0]]
    print("\nThe trainer tensor and version each receiver tensor matches, by checksum "
          "(vK: this tensor at version K; other@vK: another tensor; none: nothing):")
    print(table(["tensor"] + [f"round {r}" for r in range(1, len(seen.rounds) + 1)], rows))
    ends = [s for s in seen.samples if s["event"] == "end"]
    roles = list(ends[0]["roles"])
    print("\nThe owner's memory at the end of each phase (MB):")
    print(table(["phase", *roles] + (["allocated"] if seen.device != "cpu" else []),
                [[s["phase"], *(f"{s['roles'][r] / 1e6:.2f}" for r in roles)]
                 + ([f"{s['allocated'] / 1e6:.2f}"] if seen.device != "cpu" else []) for s in ends]))
