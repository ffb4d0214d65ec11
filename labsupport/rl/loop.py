"""The loop: :func:`run`, GRPO in one of three orchestrations (``ARCHS``: co-located, disaggregated,
asynchronous) with the same learning code; its settings: :class:`~labsupport.rl.config.RLConfig`.

``run`` sets up a :class:`_Run` (trainer, engine, span log and memory timeline, and the weight path:
the co-located bucket of :mod:`~labsupport.rl.colocated` or a group), runs one step function per
orchestration (``STEPS``) and tears everything down however it ends.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import random
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from labsupport import broadcast, groups, vllm_ext
from labsupport.core import devices
from labsupport.course import models, progress
from labsupport.memory import MemoryTimeline, move_optimizer_state
from labsupport.rl.colocated import ColocatedWeights, trainer_graphs
from labsupport.rl.config import RLConfig, check_run, start_engine
from labsupport.rl.engine_process import EngineProcess, LocalEngine
from labsupport.rl.engines import weights_match
from labsupport.rl.grpo import GRPOTrainer
from labsupport.rl.policy import load_policy, warmstart_dir
from labsupport.rl.report import draw_live
from labsupport.rl.rollout import Rollout, held_out_accuracy
from labsupport.rl.spans import (PHASES, SpanLog, breakdown, overlap, staleness_histogram,
                                 step_phases)
from labsupport.rl.task import ANSWER_LEN, eval_prompts, prompt_stream, reward


@dataclass
class _Run:
    """What one run holds between steps: its parts, the weight path, and what it records."""

    arch: str
    cfg: RLConfig
    tdev: str
    trainer: GRPOTrainer
    spans: SpanLog
    wdtype: torch.dtype  # the engine's: bfloat16 for vLLM on a GPU (the trainer's float32 cast)
    offload: bool  # Adam's moments leave the GPU while the engine works (policy.plan_offload)
    mem: MemoryTimeline | None = None
    engine: EngineProcess | LocalEngine | None = None
    path: ColocatedWeights | None = None  # co-located: the trainer's weights in one exported bucket
    mapping: dict[str, Any] | None = None  # co-located, mapped: the engine's report of its plan
    group: groups.StatelessGroup | None = None  # disaggregated, async: trainer 0, engine 1
    prompts: Iterator[str] = field(default_factory=lambda: prompt_stream(random.Random()))
    tok: Any = field(default_factory=models.build_tokenizer)
    steps: list[dict[str, Any]] = field(default_factory=list)
    curve: list[dict[str, float]] = field(default_factory=list)
    windows: list[tuple[float, float]] = field(default_factory=list)
    sync_errors: list[dict[str, Any]] = field(default_factory=list)  # resent updates: ideally none

    def weights(self) -> list[tuple[str, torch.Tensor]]:
        """The trainer's weights in the engine's dtype (float32: the tensors themselves)."""
        return [(n, t.to(self.wdtype)) for n, t in self.trainer.named_weights()]


@contextlib.contextmanager
def _phase(r: _Run, name: str, step: int, detail: str = "") -> Iterator[None]:
    """A trainer-lane span, ended once the device has finished its work; in the first
    ``memory_steps`` steps also a phase of the trainer's memory timeline, and the GPU's bytes in use
    after it."""
    recorded = r.mem is not None and step < r.cfg.memory_steps
    with r.mem.phase(detail or name) if recorded else contextlib.nullcontext():
        with r.spans.span("trainer", name, step, detail):
            yield
            devices.synchronize(r.tdev)
        if recorded and r.tdev.startswith("cuda"):
            free, total = torch.cuda.mem_get_info(torch.device(r.tdev))
            r.spans.device_used.append({"lane": "trainer", "after": detail or name, "step": step,
                                        "bytes": total - free})


def _gen_op(r: _Run, step: int) -> dict[str, Any]:
    return {"op": "generate", "prompts": list(itertools.islice(r.prompts, r.cfg.prompts_per_step)),
            "n": r.cfg.group_size, "max_new_tokens": ANSWER_LEN, "temperature": r.cfg.temperature,
            "version": r.trainer.version, "step": step}


def _learn(r: _Run, step: int, rollout: Rollout) -> dict[str, Any]:
    """Score the rollout and take a GRPO step on it: the learning code all orchestrations share."""
    with _phase(r, "score", step):
        rewards = torch.tensor([reward(t, rollout.prompts[i // rollout.n])
                                for i, t in enumerate(rollout.texts)])
    with _phase(r, "train", step):
        stats = r.trainer.step(rollout, rewards)
    return {"step": step, "reward": rewards.mean().item(), **stats,
            "behaviour_version": rollout.version}


def _evaluate(r: _Run, step: int) -> None:
    """The trainer's greedy accuracy on the held-out prompts (every ``eval_every`` steps, and at the
    end), in the trainer's precision."""
    if r.cfg.eval_every and (step % r.cfg.eval_every == 0 or step == r.cfg.steps):
        with _phase(r, "eval", step), r.trainer.autocast():
            acc = held_out_accuracy(r.trainer.model, r.tok)
        r.curve.append({"step": step, "t": r.spans.now(), "eval_acc": acc})


def _push(r: _Run, step: int) -> None:
    """Broadcast the trainer's weights to the engine; an update either side rejected (a checksum or
    load failure) is sent again, twice at most; a timeout aborted the group: it raises at once."""
    with _phase(r, "sync", step, "broadcast"):
        weights = r.weights()
        announced = vllm_ext.announced(weights)  # vLLM's workers check it before any bucket
        for attempt in range(3):
            r.engine.send({"op": "receive", "step": step, "announced": announced})
            try:
                broadcast.send(r.group, weights, src=0, mode="bucketed",
                               bucket_bytes=r.cfg.bucket_bytes, version=r.trainer.version)
                err = None
            except broadcast.SyncTimeout:  # the engine is closed with the run
                raise
            except broadcast.WeightSyncError as exc:
                err = exc
            said = r.engine.recv().get("sync_error")  # (its load, after the vote, can fail alone)
            err = err or (broadcast.WeightSyncError(f"the engine: {said}") if said else None)
            if err is None:
                return
            r.sync_errors.append({"step": step, "attempt": attempt, "error": str(err)})
        raise err


def _colocated_step(r: _Run, k: int) -> dict[str, Any]:
    """Engine: (wake,) take the bucket, generate (, sleep); trainer: learn, refresh the bucket.
    Adam's moments wait on the host meanwhile where the memory plan says the phase needs it."""
    if r.offload:
        with _phase(r, "offload", k, "optimizer to host"):
            move_optimizer_state(r.trainer.opt, "cpu")
            torch.cuda.empty_cache()  # the freed blocks back to the device, for the engine's wake
    with _phase(r, "idle", k, "engine working"):
        reply = r.engine.call(*r.path.before_generate(k), _gen_op(r, k), *r.path.after_generate(k))
    if r.offload:
        with _phase(r, "offload", k, "optimizer to the GPU"):
            move_optimizer_state(r.trainer.opt, r.tdev)
    rec = _learn(r, k, reply["rollout"])
    if "update" in reply:  # the mapped update's own report: bytes copied, seconds of copies
        rec["engine_update"] = reply["update"]
    with _phase(r, "sync", k, f"{r.path.update} bucket"):
        r.path.refresh(r.trainer.model)
    return rec


def _disaggregated_step(r: _Run, k: int) -> dict[str, Any]:
    """The engine generates while the trainer waits, then the other way round; then a broadcast."""
    with _phase(r, "idle", k, "engine generating"):
        reply = r.engine.call(_gen_op(r, k))
    rec = _learn(r, k, reply["rollout"])
    _push(r, k)
    return rec


def _async_step(r: _Run, k: int) -> dict[str, Any]:
    """Rollout k came while step k-1 trained: push v_k, start rollout k+1 with it, learn on k."""
    with _phase(r, "idle", k, "waiting for rollout"):
        reply = r.engine.recv()
    if k > 0:
        _push(r, k)  # weights v_k, between generation batches
    if k + 1 < r.cfg.steps:
        r.engine.send(_gen_op(r, k + 1))  # generates with v_k while we train on rollout k
    return _learn(r, k, reply["rollout"])


STEPS: dict[str, Callable[[_Run, int], dict[str, Any]]] = {
    "colocated": _colocated_step, "disaggregated": _disaggregated_step, "async": _async_step}


def _connect(r: _Run) -> None:
    """The weight path: co-located, one exported bucket (mapped by the engine, or not; the engine
    asleep, or not); else a group the engine joins."""
    if r.arch == "colocated":
        r.path = ColocatedWeights(r.trainer.model, r.wdtype, r.cfg.update, r.cfg.sleep_level)
        r.mapping = r.engine.call(*r.path.connect_ops()).get("map")
        return
    # (listening before the port is sent: nobody can take it)
    store = groups.host_store(timeout_s=60.0)
    r.engine.send({"op": "join", "address": "127.0.0.1", "port": store.port, "timeout_s": 60.0})
    r.group = groups.create_group("127.0.0.1", store.port, 0, 2, device=r.tdev, timeout_s=60.0,
                                  store=store)
    r.engine.recv()


def _close(r: _Run) -> None:
    """Leave the group first (an engine stuck in a broadcast then fails at once), stop the engine
    (which unmaps the trainer's bucket), free the bucket."""
    # (frozen objects are never collected: an engine deleted in this process would keep its memory)
    gc.unfreeze()
    try:
        if r.group is not None:
            r.group.destroy()
    finally:
        try:
            if r.engine is not None:
                r.engine.close()
        finally:
            if r.path is not None:
                r.path.close()


def _show(r: _Run, rec: dict[str, Any], bar: Any, live: Any, verbose: bool) -> None:
    """The live reward line (in a notebook the plot, redrawn in place); each tenth step in words."""
    acc = f"{r.curve[-1]['eval_acc']:.2f}" if r.curve else "-"
    bar.set_postfix({"reward": f"{rec['reward']:.2f}", "acc": acc}, refresh=False)
    bar.update()
    if live is not None:
        live.update()
    k = rec["step"]
    if verbose and (k % 10 == 0 or k == r.cfg.steps - 1):
        progress.write(f"  [{r.arch}] step {k:3d}  reward {rec['reward']:.2f}  held-out acc {acc}  "
                       f"staleness {rec['staleness']}  {rec['wall_s'] * 1e3:.0f} ms/step")


def _train(r: _Run, engine_name: str, verbose: bool) -> None:
    """The steps, each a window of the span log (evaluation and output fall between windows)."""
    bar = progress.bar(total=r.cfg.steps, desc=f"{r.arch} GRPO", unit="step", disable=not verbose)
    live = None if not verbose else progress.LivePlot(
        lambda ax: draw_live(ax, r.arch, engine_name, r.steps, r.curve, r.cfg.steps))
    with contextlib.ExitStack() as shown:  # the bar's last line, and in a notebook the final plot
        for x in (bar, live):
            if x is not None:
                shown.callback(x.close)
        w0 = r.spans.now()
        if r.arch == "async":
            r.engine.send(_gen_op(r, 0))
        for k in range(r.cfg.steps):
            rec = STEPS[r.arch](r, k)
            w1 = r.spans.now()
            r.windows.append((w0, w1))
            rec["wall_s"] = w1 - w0
            r.steps.append(rec)
            # the first step compiled and warmed caches: freeze what exists, as vLLM freezes its
            # start-up heap, so that no later step stalls on a full collection (_close unfreezes)
            if k == 0:
                gc.collect()
                gc.freeze()
            _evaluate(r, k + 1)
            _show(r, rec, bar, live, verbose)
            w0 = r.spans.now()
        if r.arch == "async":
            _push(r, r.cfg.steps)  # the engine ends with the final weights too


def _engine_check(r: _Run) -> tuple[float, bool]:
    """The engine's greedy held-out accuracy (proof that the last update arrived), and whether its
    checksums equal the trainer's (vLLM in its own layout: ``engines.weights_match``)."""
    evals = eval_prompts()
    ops = r.path.before_generate(r.cfg.steps) if r.arch == "colocated" else []
    reply = r.engine.call(*ops, {"op": "eval", "prompts": evals, "max_new_tokens": ANSWER_LEN,
                                 "step": r.cfg.steps},
                          {"op": "checksums", "step": r.cfg.steps})
    acc = sum(reward(t, p) for t, p in zip(reply["texts"], evals)) / len(evals)
    return acc, weights_match(reply["checksums"], r.weights(), r.trainer.model.config)


def _result(r: _Run, info: dict[str, Any]) -> dict[str, Any]:
    """The run as JSON-able data: curves, per-step records with time breakdowns, spans, memory."""
    rows = breakdown(r.spans.events, r.windows)
    for rec, row, phases in zip(r.steps, rows, step_phases(r.spans.events, len(r.steps))):
        rec["time"], rec["phases"] = row, phases
    own = [{**s["phases"], "wall_s": s["wall_s"]} for s in r.steps]
    walls = [s["wall_s"] for s in r.steps]
    steady, later = walls[1:] or walls, rows[1:] or rows  # the first step warms caches up
    return {**info, "config": asdict(r.cfg),
            "model_params": sum(p.numel() for p in r.trainer.model.parameters()),
            "s_per_step": sum(steady) / len(steady), "steps_done": len(r.steps),
            "initial_acc": r.curve[0]["eval_acc"], "final_acc": r.curve[-1]["eval_acc"],
            "sync_errors": r.sync_errors,
            "mean_staleness": sum(s["staleness"] for s in r.steps) / len(r.steps),
            "staleness_histogram": staleness_histogram(
                r.steps, r.cfg.prompts_per_step * r.cfg.group_size),
            "overlap": overlap(own) if r.arch == "async" else None,
            "mean_breakdown": {lane: {p: sum(row[lane][p] for row in later) / len(later)
                                      for p in PHASES}
                               for lane in ("trainer", "engine")},
            "curve": r.curve, "steps": r.steps, "events": r.spans.events,
            "memory": r.mem.to_dict() if r.mem is not None else None,
            "device_memory": [u for u in r.spans.device_used if u["step"] < r.cfg.memory_steps]}


def _mechanisms(r: _Run, engine: str) -> dict[str, Any]:
    """What the co-located path did (a switch without effect on this engine or device says so)."""
    gpu_vllm = engine == "vllm" and r.tdev.startswith("cuda")
    return {"update": r.cfg.update,
            "sleep_level": r.cfg.sleep_level if gpu_vllm or engine == "transformers" else 0,
            "optimizer_offload": r.offload, "cuda_graphs": gpu_vllm and r.cfg.cuda_graphs,
            "inline_engine": engine == "vllm" and r.cfg.inline_engine, "precision": r.cfg.precision,
            "compile": r.cfg.compile, "trainer_cuda_graphs": r.trainer.graphs,
            "mapping": r.mapping} if r.arch == "colocated" else {"precision": r.cfg.precision}


def run(arch: str, cfg: RLConfig | None = None, *, engine: str = "transformers",
        devices: tuple[str, str] | None = None, verbose: bool = True, memory: bool = True,
        size: str = "tiny") -> dict[str, Any]:
    """Run the GRPO loop in one orchestration: curves, per-step timings and timeline (JSON-able).

    ``engine="transformers"`` runs :class:`~labsupport.rl.engines.HFEngine`, ``engine="vllm"`` runs
    :class:`~labsupport.rl.engines.VllmEngine`: in this process when co-located (weights through IPC
    handles, with the mechanisms ``cfg`` switches: :mod:`~labsupport.rl.colocated`), in its own
    process otherwise (weights over the group). A bfloat16 engine (vLLM on GPU) gets the trainer's
    float32 weights cast as sent. ``size`` picks the model (``SIZES``; on a GPU, checked against
    free memory first). Threads, the current GPU, engine, group and bucket are restored or released.
    """
    cfg = cfg or RLConfig()
    tdev, edev, offload = check_run(arch, engine, size, cfg, devices)
    model_dir = warmstart_dir(cfg.seed, cfg.warmstart_steps, size)  # built once (all cores), cached
    with contextlib.ExitStack() as stack:
        stack.callback(torch.set_num_threads, torch.get_num_threads())
        torch.set_num_threads(cfg.threads)
        if tdev.startswith("cuda"):  # current while it runs, then the old one
            stack.enter_context(torch.cuda.device(torch.device(tdev)))
        torch.manual_seed(cfg.seed)
        spans = SpanLog()
        trainer = GRPOTrainer(load_policy(model_dir, tdev), lr=cfg.lr, beta=cfg.beta,
                              clip_eps=cfg.clip_eps, correction=cfg.correction, is_cap=cfg.is_cap,
                              precision=cfg.precision, compile=cfg.compile,
                              graphs=trainer_graphs(arch, engine, cfg))
        wdtype = torch.bfloat16 if engine == "vllm" and edev.startswith("cuda") else torch.float32
        r = _Run(arch, cfg, tdev, trainer, spans, wdtype, offload,
                 prompts=prompt_stream(random.Random(cfg.seed)))
        stack.callback(_close, r)
        r.engine = start_engine(arch, engine, cfg, model_dir, edev, size, spans)
        if memory:
            r.mem = MemoryTimeline(tdev, name=f"trainer ({arch})")
            for role in ("weights", "gradients"):
                r.mem.register(role, trainer.model)
            r.mem.register("optimizer", trainer.opt)
        _connect(r)
        setup_s = spans.now()
        _evaluate(r, 0)
        if r.mem is not None:
            r.mem.sample("start")
        t_loop = spans.now()
        _train(r, engine, verbose)
        loop_s = spans.now() - t_loop
        engine_acc, match = _engine_check(r)
    mech = _mechanisms(r, engine)
    return _result(r, {"arch": arch, "engine": engine, "devices": {"trainer": tdev, "engine": edev},
                       "size": size, "engine_sleeps": mech.get("sleep_level", 0) > 0,
                       "mechanisms": mech, "setup_s": setup_s, "loop_s": loop_s,
                       "engine_final_acc": engine_acc, "weights_match": match})
