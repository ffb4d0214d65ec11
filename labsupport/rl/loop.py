"""The loop: :class:`RLConfig` and :func:`run`, the GRPO loop in one of three orchestrations (``ARCHS``):
co-located, disaggregated and asynchronous, with the same learning code in each."""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from labsupport.course import hardware, models, progress
from labsupport.rl.devices import pick_devices
from labsupport.rl.engine_process import EngineProcess, LocalEngine
from labsupport.rl.engines import VllmEngine
from labsupport.rl.grpo import GRPOTrainer
from labsupport.rl.policy import SIZES, _check_size, check_fits, load_policy, warmstart_dir
from labsupport.rl.report import draw_live
from labsupport.rl.rollout import Rollout, sample
from labsupport.rl.task import ANSWER_LEN, eval_prompts, reward, train_prompts
from labsupport.rl.timeline import PHASES, PhaseLog, breakdown

ARCHS = ("colocated", "disaggregated", "async")


@dataclass
class RLConfig:
    """Hyper-parameters; the defaults take held-out accuracy from 0 to about 0.95 in 30 steps."""

    steps: int = 30
    prompts_per_step: int = 16
    group_size: int = 8
    lr: float = 1e-3
    beta: float = 0.02
    clip_eps: float = 0.2
    correction: str | None = None  # None, "tis" or "mis" (GRPOTrainer)
    is_cap: float = 2.0
    temperature: float = 1.0
    eval_every: int = 1
    seed: int = 0
    warmstart_steps: int = 150
    bucket_bytes: int = 4 << 20  # the tiny model (1.4 MB) fits one bucket; a real model fills many
    threads: int = 1  # CPU threads per process (trainer and engine each)
    memory_steps: int = 4  # steps recorded in the trainer's memory timeline (enough to see the pattern)


def run(arch: str, cfg: RLConfig | None = None, *, engine: str = "transformers",
        devices: tuple[str, str] | None = None, verbose: bool = True, memory: bool = True,
        size: str = "tiny", sleep: bool = True) -> dict[str, Any]:
    """Run the GRPO loop in one orchestration; returns curves, per-step timings and the timeline (JSON-able).

    ``engine="transformers"`` runs :class:`~labsupport.rl.engines.HFEngine`, ``engine="vllm"`` runs
    :class:`~labsupport.rl.engines.VllmEngine`: in this process when co-located (weights through IPC handles),
    in its own process otherwise (weights over the group). A bfloat16 engine (vLLM on GPU) gets the trainer's
    float32 weights cast as they are sent.
    ``size`` picks the model (``SIZES``; on a GPU, checked against free memory before anything is built);
    ``sleep=False`` keeps the co-located engine awake between generations (to compare memory with and without).
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if engine not in ("transformers", "vllm"):
        raise ValueError(f"engine must be 'transformers' or 'vllm', got {engine!r}")
    if engine == "vllm":
        hardware.require("vllm", what='rl.run(engine="vllm")')
    cfg = cfg or RLConfig()
    tdev, edev = devices or pick_devices(arch)
    if tdev.startswith("cuda"):  # a clear error now, not an out-of-memory traceback halfway through a phase
        check_fits(size, torch.cuda.mem_get_info(torch.device(tdev))[0], cfg.prompts_per_step * cfg.group_size)
    else:
        _check_size(size)
    model_dir = warmstart_dir(cfg.seed, cfg.warmstart_steps, size)  # built once, with all cores, then cached
    old_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    if tdev.startswith("cuda"):
        torch.cuda.set_device(torch.device(tdev))
    tl = PhaseLog()
    t_setup = time.perf_counter()
    trainer = GRPOTrainer(load_policy(model_dir, tdev), lr=cfg.lr, beta=cfg.beta, clip_eps=cfg.clip_eps,
                          correction=cfg.correction, is_cap=cfg.is_cap)
    engine_name = engine
    wdtype = torch.bfloat16 if engine == "vllm" and edev.startswith("cuda") else torch.float32

    def weights() -> list[tuple[str, torch.Tensor]]:
        return [(n, t.to(wdtype)) for n, t in trainer.named_weights()]  # float32: the tensors themselves

    if engine == "vllm" and arch == "colocated":
        engine = LocalEngine(VllmEngine(model_dir, edev, seed=cfg.seed, max_num_seqs=cfg.prompts_per_step * cfg.group_size,
                                        gpu_bytes=None if size == "tiny" else SIZES[size]["engine_bytes"]), tl)
    else:
        engine = EngineProcess(model_dir, edev, tl, seed=cfg.seed, threads=cfg.threads, engine=engine)
    mem = None
    if memory:
        from labsupport.memory import MemoryTimeline

        mem = MemoryTimeline(tdev, name=f"trainer ({arch})")
        mem.register("weights", trainer.model)
        mem.register("gradients", trainer.model)
        mem.register("optimizer", trainer.opt)
    evals = eval_prompts()
    exporter = handle = group = bar = live = None
    sync_errors: list[dict[str, Any]] = []  # resent updates (should stay empty; reported if not)
    steps: list[dict[str, Any]] = []
    windows: list[tuple[float, float]] = []
    curve: list[dict[str, float]] = []

    def phase(name: str, step: int, detail: str = ""):
        """A trainer-lane span (ended after the device finished its work), mirrored as a memory-timeline
        phase for the first few steps."""
        span = tl.span("trainer", name, step, detail)
        m = mem.phase(detail or name) if mem is not None and step < cfg.memory_steps else None

        class _Phase:
            def __enter__(self):
                if m is not None:
                    m.__enter__()
                return span.__enter__()

            def __exit__(self, *exc):
                hardware.synchronize(tdev)
                span.__exit__(*exc)
                if m is not None and tdev.startswith("cuda"):
                    free, total = torch.cuda.mem_get_info(torch.device(tdev))
                    tl.device_used.append({"lane": "trainer", "after": detail or name, "step": step,
                                           "bytes": total - free})
                return m.__exit__(*exc) if m is not None else None

        return _Phase()

    def evaluate(step: int) -> None:
        if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
            with phase("eval", step):
                toks, _, mask = sample(trainer.model, [engine_tok(p) for p in evals], ANSWER_LEN, 0.0)
                texts = [tok.decode(t[m].tolist(), skip_special_tokens=True) for t, m in zip(toks, mask)]
                acc = sum(reward(t, p) for t, p in zip(texts, evals)) / len(evals)
            curve.append({"step": step, "t": tl.now(), "eval_acc": acc})

    tok = models.build_tokenizer()

    def engine_tok(p: str) -> list[int]:
        return tok(p)["input_ids"]

    def gen_op(step: int) -> dict[str, Any]:
        return {"op": "generate", "prompts": train_prompts(cfg.prompts_per_step, rng), "n": cfg.group_size,
                "max_new_tokens": ANSWER_LEN, "temperature": cfg.temperature, "version": trainer.version,
                "step": step}

    def learn(step: int, rollout: Rollout) -> dict[str, Any]:
        with phase("score", step):
            rewards = torch.tensor([reward(t, rollout.prompts[i // rollout.n]) for i, t in enumerate(rollout.texts)])
        with phase("train", step):
            stats = trainer.step(rollout, rewards)
        return {"step": step, "reward": rewards.mean().item(), **stats}

    def push(step: int) -> None:
        """Send the trainer's current weights to the engine (broadcast over the group)."""
        from labsupport import broadcast

        with phase("sync", step, "broadcast"):
            for attempt in range(3):
                engine.send({"op": "receive", "step": step})
                try:
                    broadcast.send(group, weights(), src=0, mode="bucketed",
                                   bucket_bytes=cfg.bucket_bytes, version=trainer.version)
                    err = None
                except broadcast.WeightSyncError as exc:  # e.g. a checksum mismatch: the API says send again
                    err = exc
                engine.recv()
                if err is None:
                    return
                sync_errors.append({"step": step, "attempt": attempt, "error": str(err)})
            raise err

    try:
        offload = arch == "colocated" and tdev.startswith("cuda")
        if arch == "colocated":
            from labsupport import ipc
            from labsupport.memory import move_optimizer_state

            exporter = ipc.Exporter()
            handle = exporter.export_bucket(weights())
            if sleep:
                engine.call({"op": "sleep", "step": -1})
        else:
            from labsupport import groups

            port = groups.free_port()
            engine.send({"op": "join", "address": "127.0.0.1", "port": port, "timeout_s": 60.0})
            group = groups.create_group("127.0.0.1", port, 0, 2, device=tdev, timeout_s=60.0)
            engine.recv()
        setup_s = time.perf_counter() - t_setup
        evaluate(0)
        if mem is not None:
            mem.sample("start")
        t_loop = tl.now()
        bar = progress.bar(total=cfg.steps, desc=f"{arch} GRPO", unit="step", disable=not verbose)
        live = None if not verbose else progress.LivePlot(  # a notebook only: drawn in place after each step
            lambda ax: draw_live(ax, arch, engine_name, steps, curve, cfg.steps))
        w0 = tl.now()
        if arch == "async":
            engine.send(gen_op(0))
        for k in range(cfg.steps):
            if arch == "colocated":
                # engine: wake (weights from the trainer's bucket), generate, sleep (free its weights)
                if offload:  # the trainer frees its optimizer state for the engine's turn
                    with phase("sync", k, "offload optimizer"):
                        move_optimizer_state(trainer.opt, "cpu")
                with phase("idle", k, "engine generating"):
                    ops = [{"op": "wake_ipc", "handle": handle, "step": k}, gen_op(k)]
                    reply = engine.call(*ops, *([{"op": "sleep", "step": k}] if sleep else []))
                if offload:
                    with phase("sync", k, "reload optimizer"):
                        move_optimizer_state(trainer.opt, tdev)
                rec = learn(k, reply["rollout"])
                with phase("sync", k, "ipc bucket"):
                    exporter.update_bucket(handle, weights())
            elif arch == "disaggregated":
                with phase("idle", k, "engine generating"):
                    reply = engine.call(gen_op(k))
                rec = learn(k, reply["rollout"])
                push(k)
            else:  # async: rollout k was generated while step k-1 trained
                with phase("idle", k, "waiting for rollout"):
                    reply = engine.recv()
                if k > 0:
                    push(k)  # weights v_k, between generation batches
                if k + 1 < cfg.steps:
                    engine.send(gen_op(k + 1))  # generates with v_k while we train on rollout k
                rec = learn(k, reply["rollout"])
            rec["behaviour_version"] = reply["rollout"].version
            w1 = tl.now()
            windows.append((w0, w1))
            rec["wall_s"] = w1 - w0
            w0 = w1
            steps.append(rec)
            evaluate(k + 1)
            acc = f"{curve[-1]['eval_acc']:.2f}" if curve else "-"
            bar.set_postfix({"reward": f"{rec['reward']:.2f}", "acc": acc}, refresh=False)
            bar.update()  # the live reward line: batch reward and held-out accuracy of the last step
            if live is not None:
                live.update()  # in a notebook: reward and held-out accuracy so far, redrawn in place
            if verbose and (k % 10 == 0 or k == cfg.steps - 1):
                progress.write(f"  [{arch}] step {k:3d}  reward {rec['reward']:.2f}  held-out acc "
                               f"{curve[-1]['eval_acc']:.2f}  staleness {rec['staleness']}  "
                               f"{rec['wall_s'] * 1e3:.0f} ms/step")
            w0 = tl.now()  # evaluation and progress output are not part of any step's time
        if arch == "async":
            push(cfg.steps)  # the engine ends with the final weights too
        loop_s = tl.now() - t_loop
        # the engine's own greedy answers on the held-out prompts: proves the last update arrived
        ops = [{"op": "wake_ipc", "handle": handle, "step": cfg.steps}] if arch == "colocated" else []
        reply = engine.call(*ops, {"op": "eval", "prompts": evals, "max_new_tokens": ANSWER_LEN, "step": cfg.steps},
                            {"op": "checksums", "step": cfg.steps})
        engine_acc = sum(reward(t, p) for t, p in zip(reply["texts"], evals)) / len(evals)
        from labsupport.checksums import tensor_checksums

        weights_match = None if reply["checksums"] is None else reply["checksums"] == tensor_checksums(weights())
    finally:
        for shown in (bar, live):  # the bar's last line, and in a notebook the final plot
            if shown is not None:
                shown.close()
        engine.close()
        if group is not None:
            group.destroy()
        if exporter is not None:
            exporter.close()
        torch.set_num_threads(old_threads)

    rows = breakdown(tl.events, windows)
    for rec, row in zip(steps, rows):
        rec["time"] = row
    walls = [s["wall_s"] for s in steps]
    steady = walls[1:] or walls
    data = {
        "arch": arch, "engine": engine_name, "devices": {"trainer": tdev, "engine": edev},
        "size": size, "model_params": sum(p.numel() for p in trainer.model.parameters()), "engine_sleeps": sleep,
        "config": asdict(cfg), "setup_s": setup_s, "loop_s": loop_s,
        "s_per_step": sum(steady) / len(steady), "steps_done": len(steps),
        "initial_acc": curve[0]["eval_acc"], "final_acc": curve[-1]["eval_acc"], "engine_final_acc": engine_acc,
        "weights_match": weights_match, "sync_errors": sync_errors,
        "mean_staleness": sum(s["staleness"] for s in steps) / len(steps),
        "mean_breakdown": {lane: {p: sum(r[lane][p] for r in rows[1:] or rows) / len(rows[1:] or rows)
                                  for p in PHASES} for lane in ("trainer", "engine")},
        "curve": curve, "steps": steps, "events": tl.events,
        "memory": mem.to_dict() if mem is not None else None,
        "device_memory": [u for u in tl.device_used if u["step"] < cfg.memory_steps],
    }
    return data
