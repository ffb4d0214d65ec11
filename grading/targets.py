"""The performance targets of the assignments, measured on GPUs, and the record a class puts on a leaderboard.

Each target is a ratio against what the hardware does without the learner's code (a device copy, a raw
broadcast of the same bytes), measured in the same run. At 256 MB, fixed costs (launches, the handshake, a
process's round trip) are part of each ratio, with a share that differs from one GPU model to the next, so the
goal is relative: at most ``factor`` times the staff reference's ratio on the same GPU model, which
``make grade IMPL=reference`` records in ``results/grade_record.reference.<machine>.json`` (the course ships
the ones it measured; an instructor with another GPU model records their own). ``make grade`` (one
implementation) measures the targets that this machine has the GPUs for, reports the others as skipped with
the reason, and writes ``grade_record.json``: the score, the targets, the machine, the versions and the date.
"""

from __future__ import annotations

import datetime as _dt
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

MB = 1 << 20
FACTOR = 1.5  # a target's goal: at most this times the staff reference's ratio on the same GPU model
STATE_BYTES = 256 * MB  # the state moved by each target
REPEATS = 5


@dataclass
class Target:
    key: str  # "a3"
    name: str  # what is measured
    gpus: int  # GPUs it needs
    measure: Callable[[str, str], float]  # (implementation, key) -> the ratio
    factor: float = FACTOR  # the ratio must be at most this times the staff reference's on the same GPU model

    @property
    def goal(self) -> str:
        return f"at most {self.factor:g}x the staff reference's ratio on the same GPU model"

    def row(self, status: str, ratio: float | None = None, reason: str = "",
            reference: dict[str, Any] | None = None) -> dict[str, Any]:
        """One target's line of the record; ``reference``: the staff's recorded ratio on this GPU model."""
        limit = None if reference is None else self.factor * reference["ratio"]
        met = None if ratio is None or limit is None else ratio <= limit
        if status == "measured" and limit is None:
            reason = (f"no staff reference recorded on this GPU model ({gpu_model()}): `make grade IMPL=reference` "
                      "here records one in results/")
        return {"key": self.key, "name": self.name, "goal": self.goal, "factor": self.factor, "limit": limit,
                "reference": reference, "gpus": self.gpus, "status": status, "ratio": ratio, "met": met,
                "reason": reason}


def gpu_model() -> str | None:
    """This machine's GPU model, named as the records name it (``results.machine_info``); None without a GPU."""
    from labsupport.course.results import machine_info

    return next((g["name"] for g in machine_info()["gpus"]), None)


def reference_ratios(model: str | None, folder: Path | None = None) -> dict[str, dict[str, Any]]:
    """The staff reference's measured ratio of each target on GPU model ``model``, from the newest
    ``grade_record.reference.*.json`` under ``results/`` that measured it: {key: {ratio, machine_tag, date}}."""
    import json

    from labsupport.course.results import REPO_ROOT

    out: dict[str, dict[str, Any]] = {}
    recs = [json.loads(p.read_text()) for p in (folder or REPO_ROOT / "results").glob("grade_record.reference.*.json")]
    for rec in sorted(recs, key=lambda r: r["date"]):
        if model and any(g.get("name") == model for g in rec["machine"].get("gpus", [])):
            for t in rec["targets"]:
                if t["status"] == "measured":
                    out[t["key"]] = {"ratio": t["ratio"], "machine_tag": rec["machine_tag"], "date": rec["date"]}
    return out


def big_state(device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """About ``STATE_BYTES`` of weights: bfloat16 and float32 matrices, every fourth one transposed."""
    g = torch.Generator().manual_seed(seed)
    out, total, i = {}, 0, 0
    while total < STATE_BYTES:
        dtype = torch.bfloat16 if i % 2 else torch.float32
        t = torch.randn(1024, 1024, generator=g).to(dtype).to(device)
        out[f"w{i}"] = t.t() if i % 4 == 3 else t
        total, i = total + t.nbytes, i + 1
    return out


def timed(fn: Callable[[], Any], device: str) -> float:
    """The median seconds of ``fn`` over ``REPEATS`` runs after one warm-up, the GPU's work included."""
    fn()
    times = []
    for _ in range(REPEATS):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_time(nbytes: int, device: str) -> float:
    """One device-to-device copy of ``nbytes``: what the hardware does without the learner's code."""
    src, dst = torch.empty(nbytes, dtype=torch.uint8, device=device), torch.empty(nbytes, dtype=torch.uint8,
                                                                                   device=device)
    return timed(lambda: dst.copy_(src), device)


def pack_ratio(name: str, key: str) -> float:
    from grading.impl import load

    impl, dev = load(name, key), "cuda:0"
    state = big_state(dev)
    entries, size = impl.layout([impl.meta(n, t) for n, t in state.items()])
    buf = torch.empty(size, dtype=torch.uint8, device=dev)
    return timed(lambda: impl.pack(buf, entries, list(state.values())), dev) / copy_time(size, dev)


def _sync_rank(rank: int, world: int, port: int, name: str, key: str) -> float:
    """One rank of the sync target: the learner's sync, then a raw broadcast of the same bytes; rank 0's ratio."""
    from grading.impl import load
    from labsupport.groups import create_group

    impl, dev = load(name, key), f"cuda:{rank}"
    torch.cuda.set_device(dev)
    group = create_group("127.0.0.1", port, rank, world, device=dev, timeout_s=120)
    try:
        state = big_state(dev, seed=rank)
        nbytes = sum(t.nbytes for t in state.values())
        if rank == 0:
            sync = timed(lambda: impl.send(group, state, bucket_bytes=64 * MB), dev)
        else:
            sync = timed(lambda: impl.receive(group, impl.copy_into(state)), dev)
        raw = torch.empty(nbytes, dtype=torch.uint8, device=dev)

        def broadcast():
            group.broadcast(raw, 0)
            group.synchronize("the raw broadcast")

        return sync / timed(broadcast, dev)
    finally:
        group.destroy()


def sync_ratio(name: str, key: str) -> float:
    from labsupport.course.ranks import run_ranks
    from labsupport.groups import free_port

    (ok, res), *rest = run_ranks(_sync_rank, 2, (free_port(), name, key), timeout_s=600, cpu_threads=None)
    for good, r in [(ok, res), *rest]:
        if not good:
            raise RuntimeError(f"{r[0]}: {r[1]}")
    return res


def _handoff_receiver(inbox, outbox) -> None:
    """The target's receiving process: rebuild and load into tensors it keeps, on request."""
    from grading.impl import load

    own = None
    while (msg := inbox.get()) is not None:
        name, key, handle = msg
        impl = load(name, key)
        views = impl.rebuild(handle)
        own = own or {n: torch.empty_like(v) for n, v in views}
        impl.load(own, views)
        del views
        outbox.put("loaded")


def handoff_ratio(name: str, key: str) -> float:
    from grading.impl import load
    from labsupport.course.peer import Peer

    impl, dev = load(name, key), "cuda:0"
    state = list(big_state(dev).items())
    nbytes = sum(t.nbytes for _, t in state)
    with Peer(_handoff_receiver) as peer:
        def handoff():
            buf, handle = impl.export(state)
            assert peer.call((name, key, handle), 300) == "loaded"
            del buf
            impl.release(handle)

        return timed(handoff, dev) / copy_time(nbytes, dev)


TARGETS = [
    Target("a2", "pack of 256 MB of weights / one device copy of the same bytes", 1, pack_ratio),
    Target("a3", "sync of 256 MB in 64 MB buckets over NCCL / one raw broadcast of the same bytes, 2 GPUs", 2,
           sync_ratio),
    Target("a4", "handoff of 256 MB to another process (export, rebuild, load, release) / one device copy", 1,
           handoff_ratio),
]


def measure(name: str, keys: list[str] | None = None) -> list[dict[str, Any]]:
    """Each target of ``keys`` (all by default) on implementation ``name``: measured, or skipped with the reason."""
    from grading import impl as impls
    from labsupport.course.hardware import gpu_count

    have, rows, staff = gpu_count(), [], reference_ratios(gpu_model())
    for t in TARGETS:
        if keys and t.key not in keys:
            continue
        if have < t.gpus:
            rows.append(t.row("skipped", reason=f"needs {t.gpus} GPU(s), this machine has {have}"))
            continue
        try:
            rows.append(t.row("measured", t.measure(impls.effective(name, t.key), t.key),
                              reference=staff.get(t.key)))
        except Exception as exc:  # a learner's error is a result, not a crash of the grader
            rows.append(t.row("failed", reason=f"{type(exc).__name__}: {exc}"[:300]))
    return rows


def record(name: str, data: dict, targets: list[dict], command: str) -> dict[str, Any]:
    """The leaderboard record of one graded implementation."""
    from labsupport.course.results import machine_info, machine_tag, versions

    from grading.impl import effective

    parts: dict[str, dict[str, int]] = {}
    for r in data["results"]:
        if r["outcome"] == "skipped" or r["impl"] not in (None, effective(name, r["key"])):
            continue
        p = parts.setdefault(r["key"], {"points": 0, "possible": 0})
        p["possible"] += r["points"]
        p["points"] += r["points"] if r["outcome"] == "passed" else 0
    info = machine_info()
    return {"impl": name, "score": data["scores"][name], "parts": parts, "targets": targets, "machine": info,
            "machine_tag": machine_tag(info), "versions": versions(), "command": command,
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}


def report(targets: list[dict]) -> list[str]:
    """The lines ``make grade`` prints for the targets."""
    lines = ["Performance targets (GPU)"]
    for t in targets:
        what = {"measured": lambda: f"{t['ratio']:.2f} " + (
                    f"({'met' if t['met'] else 'not met'}: at most {t['limit']:.2f}, {t['factor']:g}x the staff "
                    f"reference's {t['reference']['ratio']:.2f} on {t['reference']['machine_tag']})"
                    if t["limit"] is not None else f"(no goal: {t['reason']})"),
                "skipped": lambda: f"skipped: {t['reason']}", "failed": lambda: f"failed: {t['reason']}"}
        lines.append(f"  {t['key']} {t['name']}: {what[t['status']]()}")
    return lines


def write(path: Path, rec: dict) -> Path:
    import json

    path.write_text(json.dumps(rec, indent=1, default=str))
    return path
