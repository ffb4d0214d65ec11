"""The engine process and its protocol: a message is a list of ops (generate, eval, map, update,
load_ipc, wake, sleep, join, receive, checksums) carried out by :func:`_apply_ops`;
:class:`EngineProcess` runs an engine in its own (spawned) process, :class:`LocalEngine` in the
caller's, both with send/recv/call and the engine's spans filed in a
:class:`~labsupport.rl.spans.SpanLog`, one per op, under the phase the op serves (``PHASE_OF``)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from labsupport import broadcast, vllm_ext
from labsupport.course import progress, vllm_engine
from labsupport.course.peer import Peer
from labsupport.rl.engines import HFEngine, VllmEngine
from labsupport.rl.spans import SpanLog


# A reply's wait wraps the engine's own deadlines (vllm_ext's RPCs): longer, so that their named
# error arrives.
REPLY_S = vllm_ext.TIMEOUT_S + 60.0
# The phase each op's span is filed under; every other op moves weights ("sync").
PHASE_OF = {"generate": "generate", "eval": "eval", "wake": "wake", "sleep": "sleep"}


def _run_op(eng, op: dict[str, Any], reply: dict[str, Any]) -> None:
    """One op on an engine; what it returns goes into ``reply``."""
    kind = op["op"]
    if kind == "generate":
        r = eng.generate(op["prompts"], op["n"], op["max_new_tokens"], op["temperature"])
        r.version = op["version"]
        reply["rollout"] = r
    elif kind == "eval":
        reply["texts"] = eng.generate(op["prompts"], 1, op["max_new_tokens"], 0.0).texts
    # co-located: map the trainer's bucket once (checked, loaded, copies planned)
    elif kind == "map":
        reply["map"] = eng.map_weights(op["handle"])
    elif kind == "update":  # co-located, mapped: copy the mapped bucket in
        reply["update"] = eng.sync_mapped()
    # co-located, the safe path: open the handle, check, load (waking first if asleep)
    elif kind == "load_ipc":
        eng.load_ipc(op["handle"])
    elif kind == "wake":
        eng.wake(tags=op.get("tags"))
    elif kind == "sleep":
        eng.sleep(op.get("level", 2))
    elif kind == "join":  # disaggregated/async: join the trainer's weight-sync group as rank 1
        eng.join(op["address"], op["port"], op["timeout_s"])
    elif kind == "receive":
        try:
            reply["sync"] = eng.receive(op.get("announced"))
        # both sides raise; the trainer decides whether to resend
        except broadcast.WeightSyncError as err:
            reply["sync_error"] = str(err)
    elif kind == "checksums":
        reply["checksums"] = eng.checksums()
    else:
        raise ValueError(f"unknown engine op {kind!r}")


def _apply_ops(eng, ops: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Carry out one message's ops on an engine; the reply holds results and the spans they took."""
    reply: dict[str, Any] = {"events": []}
    for op in ops:
        t0 = time.perf_counter()
        _run_op(eng, op, reply)
        if eng.device.type == "cuda":
            torch.cuda.synchronize(eng.device)
            free, total = torch.cuda.mem_get_info(eng.device)  # the whole GPU: every process on it
            reply.setdefault("device_used", []).append({"after": op["op"], "step": op.get("step",
                                                                                          -1),
                                                        "bytes": total - free})
        reply["events"].append((PHASE_OF.get(op["op"], "sync"), op.get("step", -1), t0,
                                time.perf_counter(), op["op"]))
    return reply


def _engine_worker(inbox, outbox, model_dir: str, device: str, seed: int, threads: int, engine: str,
                   opts: dict[str, Any] | None = None) -> None:
    """Runs in its own process: an engine that carries out the ops of each message (see
    :class:`EngineProcess`); ``opts``: VllmEngine's keyword arguments (batch limit, memory share,
    CUDA graphs)."""
    torch.set_num_threads(threads)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    eng = (HFEngine(model_dir, device, seed) if engine == "transformers"
           else VllmEngine(model_dir, device, seed, **(opts or {})))
    outbox.put({"ready": os.getpid()})
    try:
        while True:
            msg = inbox.get()
            if msg is None:
                break
            outbox.put(_apply_ops(eng, msg["ops"]))
    finally:
        eng.close()


class _EngineClient:
    """What both engine front-ends share: ``call`` = send + recv, and filing the engine's spans."""

    spans: SpanLog

    def _filed(self, reply: dict[str, Any]) -> dict[str, Any]:
        for phase, step, t0, t1, detail in reply["events"]:
            self.spans.add("engine", phase, step, t0, t1, detail)
        self.spans.device_used += [{"lane": "engine", **u} for u in reply.get("device_used", [])]
        return reply

    def call(self, *ops: dict[str, Any]) -> dict[str, Any]:
        self.send(*ops)
        return self.recv()


class EngineProcess(_EngineClient):
    """The inference engine in a separate process (spawned), driven by messages: a list of ops each.

    ``send(ops)`` returns at once (the engine works while the caller trains); ``recv()`` waits for
    the reply and files the engine's spans. ``opts``: :class:`~labsupport.rl.engines.VllmEngine`'s
    keyword arguments (``max_num_seqs``, ``gpu_bytes``, ``cuda_graphs``, ``sleep_mode``), for
    ``engine="vllm"``.
    """

    def __init__(self, model_dir: str | os.PathLike, device: str, spans: SpanLog, seed: int = 0,
                 threads: int = 1, timeout_s: float = REPLY_S, engine: str = "transformers",
                 opts: dict[str, Any] | None = None) -> None:
        self.spans, self.timeout_s, self.device = spans, timeout_s, device
        env, stages = {}, ""
        # vLLM in this (daemon) process, which may not start children: no engine-core process
        if engine == "vllm":
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            env[progress.ENV] = "0"  # this process says what the engine's start waits for
            stages = vllm_engine.start_stages(device.startswith("cuda"),
                                              VllmEngine.llm_kwargs(model_dir, device, seed,
                                                                    **(opts or {})))
            # vLLM's worker uses cuda:0, so show it only the engine's GPU
            if device.startswith("cuda"):
                visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
                index = torch.device(device).index or 0
                env["CUDA_VISIBLE_DEVICES"] = visible[index] if visible != [""] else str(index)
                device = "cuda:0"
        self.peer = Peer(_engine_worker, str(model_dir), device, seed, threads, engine, opts,
                         env=env)
        try:
            self._ready(engine, stages, timeout_s)
        except BaseException:  # a start that failed or timed out leaves no process behind
            self.peer.close()
            raise

    def _ready(self, engine: str, stages: str, timeout_s: float) -> None:
        if engine == "transformers":
            self.peer.recv(timeout_s)  # "ready"
            return
        progress.note(f"vLLM engine process ({self.device}) starting: {stages}")
        t0 = time.perf_counter()
        with progress.waiting("vLLM engine process starting"):
            self.peer.recv(max(timeout_s, 600))  # "ready" after vLLM's start-up
        progress.note(f"vLLM engine process ready in {time.perf_counter() - t0:.0f} s")

    def send(self, *ops: dict[str, Any]) -> None:
        self.peer.send({"ops": list(ops)})

    def recv(self) -> dict[str, Any]:
        return self._filed(self.peer.recv(self.timeout_s))

    def close(self) -> None:
        self.peer.close()


class LocalEngine(_EngineClient):
    """An engine in the caller's process (vLLM, which runs its own engine-core process), with
    EngineProcess's send/recv/call; ``send`` works right away, so nothing overlaps with training."""

    def __init__(self, engine, spans: SpanLog) -> None:
        self.engine, self.spans, self.reply = engine, spans, None

    def send(self, *ops: dict[str, Any]) -> None:
        self.reply = _apply_ops(self.engine, ops)

    def recv(self) -> dict[str, Any]:
        reply, self.reply = self.reply, None
        return self._filed(reply)

    def close(self) -> None:
        self.engine.close()
