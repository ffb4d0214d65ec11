"""Where the time goes (the bytes are ``labsupport.memory``'s): :class:`SpanLog` records spans of
work per lane (trainer, engine) and phase, and :func:`breakdown` turns them into seconds per phase
inside each step."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

# wake, sleep: the co-located engine's memory coming back and going (vLLM sleep mode); offload:
# Adam's moments leaving the GPU and coming back; sync: weights into the engine (both sides' parts);
# idle: what no span covers
PHASES = ("generate", "score", "train", "sync", "wake", "sleep", "offload", "idle", "eval")


class SpanLog:
    """Spans of work per lane ("trainer", "engine"), in seconds since the run started (one clock for
    all processes: ``time.perf_counter`` is CLOCK_MONOTONIC on Linux, shared by every process)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.events: list[dict[str, Any]] = []
        # GPU bytes in use (all processes) after phases and engine ops
        self.device_used: list[dict[str, Any]] = []

    def add(self, lane: str, phase: str, step: int, start: float, end: float,
            detail: str = "") -> None:
        """Record a span given in absolute ``perf_counter`` seconds."""
        self.events.append({"lane": lane, "phase": phase, "step": step, "start": start - self.t0,
                            "end": end - self.t0, "detail": detail})

    @contextlib.contextmanager
    def span(self, lane: str, phase: str, step: int, detail: str = "") -> Iterator[None]:
        """Time the block as one span of ``phase`` in ``lane``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(lane, phase, step, start, time.perf_counter(), detail)

    def now(self) -> float:
        return time.perf_counter() - self.t0


def breakdown(events: Sequence[dict[str, Any]], windows: Sequence[tuple[float, float]],
              lanes: Sequence[str] = ("trainer", "engine")) -> list[dict[str, dict[str, float]]]:
    """Seconds per phase and lane inside each step window; ``idle`` is what no span of that lane
    covers."""
    rows = []
    for w0, w1 in windows:
        row: dict[str, dict[str, float]] = {}
        for lane in lanes:
            per = dict.fromkeys(PHASES, 0.0)
            for e in events:
                if e["lane"] == lane:
                    per[e["phase"]] += max(0.0, min(e["end"], w1) - max(e["start"], w0))
            per["idle"] = max(0.0, (w1 - w0) - sum(v for k, v in per.items() if k != "idle"))
            row[lane] = per
        rows.append(row)
    return rows


def step_phases(events: Sequence[dict[str, Any]], n_steps: int) -> list[dict[str, float]]:
    """Seconds of each step's own work, whatever window it fell in: the engine's generation of the
    rollout that step ``k`` learns from (``generate_s``), the trainer's scoring, training and weight
    sync of step ``k``. (An asynchronous step's window holds the generation of the next step's
    rollout: :func:`overlap` pairs them.)"""
    out = [dict.fromkeys(("generate_s", "score_s", "train_s", "sync_s"), 0.0)
           for _ in range(n_steps)]
    for e in events:
        key = {("engine", "generate"): "generate_s", ("trainer", "score"): "score_s",
               ("trainer", "train"): "train_s", ("trainer", "sync"): "sync_s"}.get((e["lane"],
                                                                                    e["phase"]))
        if key and 0 <= e["step"] < n_steps:
            out[e["step"]][key] += e["end"] - e["start"]
    return out


def overlap(steps: Sequence[dict[str, Any]]) -> list[float]:
    """For an asynchronous run: each step's wall time over the longer of the two things it overlaps,
    the next rollout's generation and this step's scoring and training (1.0: perfect overlap; the
    weight push, which pauses both sides, and the hand-offs make it larger). One value per step that
    has a next step."""
    return [s["wall_s"] / max(nxt["generate_s"], s["score_s"] + s["train_s"])
            for s, nxt in zip(steps, steps[1:]) if max(nxt["generate_s"],
                                                       s["score_s"] + s["train_s"]) > 0]


def staleness_histogram(steps: Sequence[dict[str, Any]], samples_per_step: int) -> dict[str, int]:
    """Samples per policy-version lag (trainer version at the update minus the version that
    generated them): every sample of a step's rollout shares that step's lag, since the weights
    change only between rollouts."""
    hist: dict[str, int] = {}
    for s in steps:
        key = str(s["staleness"])
        hist[key] = hist.get(key, 0) + samples_per_step
    return dict(sorted(hist.items(), key=lambda kv: int(kv[0])))
