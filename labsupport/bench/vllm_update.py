"""``python -m labsupport bench vllm-update``: a full weight update into a real vLLM engine, end to
end, on GPUs.

A model of real size (a Qwen2.5-1.5B and a 7B shape, bfloat16, random weights built from a config:
nothing is downloaded) lives on the trainer's GPU 0. The engine loads the same config with dummy
weights. Each mode sends every weight and is timed from "the trainer starts sending" to "the engine
has generated with the new weights", so the load into vLLM counts:

* disaggregated (engine with TP=2 on GPUs 1-2, or TP=1 on GPU 1 with only two GPUs), over NCCL:
  ``per_tensor`` (vLLM's rlhf.py loop), ``bucketed`` (``vllm_ext.WorkerExtension``), ``native_nccl``
  (vLLM's own weight-transfer engine, packed); the raw broadcast of the same bytes over the same
  group is the yardstick. Each is a whole cycle: pause the engine's scheduling (``sleep(level=0)``),
  update, resume (``update_s``: RPCs, transfer and load). ``bucketed`` also reports its transfer
  phase (``transfer_s``: the workers' own account after the handshake, every bucket received and
  loaded, and the votes) and each worker's reply; ``transfer_fraction_of_raw`` and
  ``cycle_over_raw`` set them against the raw broadcast (``bar_nccl``);
* co-located (engine on GPU 0 beside the trainer), through CUDA IPC: ``ipc_extension``
  (``vllm_ext.ColocateWorkerExtension``), ``native_ipc`` (vLLM's IPC engine) and ``mapped``
  (``fast_update``: the trainer's parameters live in one buffer the engine keeps mapped, and a plan
  made once turns an update into device copies); plus sleep level 1 and 2 / wake-up times, the
  memory each frees, and a co-located step's phase switch both ways (level 1 + wake-up against level
  2 + refill through ``mapped``). The yardstick here is one device-to-device copy of the same bytes.
  With a single GPU only these modes run. Each co-located mode says where its time went (``parts``:
  packing, checks, handle opening, reload, copies). ``mapped`` also reports how many copies its plan
  makes, and its copies against one flat copy of the same bytes from the same mapped buffer, timed
  in the engine's worker in the same run (``against_floor``). ``mapped_inline`` is the same mapped
  sync into an engine whose core and worker run in this process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as TRL's colocate mode runs vLLM): no engine-core process,
  so no RPC hop between the trainer and the copies (largest shape only; ``bar_mapped_sync``).

Each version of the weights gets a new LM head, so a stale update cannot pass for a fresh one. After
every mode the engine's weights are checked byte for byte against the trainer's, in the engine's
layout (fused ``qkv_proj`` / ``gate_up_proj``, sharded by TP rank: ``checksums.check_engine`` with
``reshard.qwen2_layout``): ``exact`` per mode (and ``exact_by_rank``), and the differing parameters
if any. Greedy text is no check on random weights (bfloat16 near ties break either way, so two runs
of the same code disagreed); it is generated only to time the first generation. Sleep mode is
checked the same way: level 1 + wake-up must give back the bytes from before the sleep, and level 2
+ a new update the trainer's bytes. The bench also records what the sleep allocator holds by tag, a
second level-1 sleep, and the cost of fresh pinned host memory against the copy into it (the
explanation of level 1's speed in Chapter 5).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from labsupport import (checksums, fast_update, groups, ipc, reshard, vllm_ext, vllm_plugin,
                        vllm_weights)
from labsupport.core import devices
from labsupport.course import hardware, progress, results, vllm_engine

SHAPES = {  # Qwen2.5 shapes (untied LM head in both, so every version changes a separate tensor)
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064),
}
PROMPTS = [[11, 22, 33, 44, 55], [101, 7, 9000, 12]]
NEW_TOKENS = 4


def shape_config(shape: str | dict[str, Any], **extra: Any) -> Any:
    """The Qwen2 config of a shape: a name in ``SHAPES``, a dict of fields, or ``"tiny"`` (the
    course's model). The benches of vLLM updates, resharding and LoRA all build their models from
    it."""
    from transformers import Qwen2Config

    from labsupport.course import models

    if shape == "tiny":
        return models.build_config(**extra)
    fields = SHAPES[shape] if isinstance(shape, str) else dict(shape)
    return Qwen2Config(**fields, max_position_embeddings=2048, tie_word_embeddings=False,
                       rope_theta=1e6,
                       rms_norm_eps=1e-6, **extra)


def build(shape: str, folder: Path) -> tuple[Any, Path]:
    """The trainer's model on cuda:0 (bfloat16, random) and a folder with its config for vLLM."""
    from transformers import AutoModelForCausalLM

    cfg = shape_config(shape, dtype="bfloat16")
    folder.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(folder)
    torch.manual_seed(0)
    with torch.device("cuda:0"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    return model, folder


@torch.no_grad()
def new_version(model: Any, version: int) -> None:
    """Give the model a new LM head, so that an engine still holding the previous version fails the
    check."""
    g = torch.Generator(device=model.lm_head.weight.device).manual_seed(1000 + version)
    model.lm_head.weight.normal_(0.0, 1.0, generator=g)


def verdict(got: list[dict[str, int]], named: dict[str, torch.Tensor],
            layout: Any) -> dict[str, Any]:
    """``checksums.check_engine`` of the workers' checksums ``got`` against the trainer's full
    tensors ``named``, with each TP rank's own verdict (``exact_by_rank``)."""
    out = checksums.check_engine(got, named, layout)
    by_rank = [not checksums.differences(checksums.layout_checksums(named, layout, r), g)
               for r, g in enumerate(got)]
    return {**out, "exact_by_rank": by_rank}


def check(llm: Any, model: Any, tp: int, got: list[dict[str, int]] | None = None) -> dict[str, Any]:
    """The engine's bytes against the trainer's ``model``, in the engine's layout (``verdict``)."""
    t0 = time.perf_counter()
    got = vllm_ext.engine_sums(llm) if got is None else got
    out = verdict(got, dict(model.named_parameters()), reshard.qwen2_layout(model.config, tp))
    return {**out, "check_s": time.perf_counter() - t0}


def engine_gpus(*relative: int) -> str:
    """``CUDA_VISIBLE_DEVICES`` for an engine on this process's ``cuda:N`` devices ``relative``, in
    the numbering a spawned process reads: where this one runs with ``CUDA_VISIBLE_DEVICES=4,5,6``,
    its ``cuda:1`` is GPU 5."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    ids = [v.strip() for v in visible.split(",")] if visible else []
    if ids and max(relative) >= len(ids):
        raise RuntimeError(f"the engine needs this process's cuda:{max(relative)}, but "
                           f"CUDA_VISIBLE_DEVICES={visible} shows only {len(ids)} GPUs; run with "
                           "more GPUs visible")
    return ",".join(ids[i] if ids else str(i) for i in relative)


class Teardown:
    """Steps that undo a set-up, registered as it goes (``add``) and run last first on leaving the
    block, every one even if another failed. A failed step raises after the rest ran; when the block
    itself failed, its error stays the one raised, the failed steps added to it as notes."""

    def __init__(self) -> None:
        self.steps: list[tuple[Any, str]] = []

    def add(self, fn: Any, what: str) -> None:
        self.steps.append((fn, what))

    def __enter__(self) -> "Teardown":
        return self

    def __exit__(self, typ: Any, exc: BaseException | None, tb: Any) -> bool:
        errors = []
        for fn, what in reversed(self.steps):
            try:
                fn()
            except Exception as err:  # noqa: BLE001 (each step runs; the errors are reported together)
                errors.append(f"{what}: {type(err).__name__}: {err}")
        if exc is not None:
            for e in errors:
                exc.add_note(f"teardown failed too: {e}")
        elif errors:
            raise RuntimeError("teardown failed: " + "; ".join(errors))
        return False


def engine_tokens(llm: Any) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def start_llm(folder: Path, gpus: str, tp: int, inline: bool = False, **kwargs: Any) -> Any:
    """An in-process ``LLM`` whose workers see only ``gpus`` (its engine-core process is spawned
    now). ``inline``: its engine core and worker run in this process instead
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), on this process's current GPU, which must be ``gpus``;
    ``tp`` must then be 1."""
    # this process keeps every GPU; only the spawned engine sees CUDA_VISIBLE_DEVICES
    torch.cuda.init()
    if inline and (tp != 1 or gpus != engine_gpus(torch.cuda.current_device())):
        raise ValueError("an inline engine runs TP=1 on this process's GPU "
                         f"{engine_gpus(torch.cuda.current_device())}; asked for TP={tp} on GPUs "
                         f"{gpus}")
    kw = vllm_engine.engine_args(folder, gpu=True, load_format="dummy", skip_tokenizer_init=True,
                                 tensor_parallel_size=tp, max_model_len=256, max_num_seqs=4,
                                 worker_extension_cls="labsupport.fast_update.FastColocateExtension",
                                 **kwargs)
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if inline else {"CUDA_VISIBLE_DEVICES": gpus}
    return vllm_engine.start_llm(kw, gpu=True, env=env)


def _raw_receive(worker: Any, nbytes: int, iters: int) -> bool:
    """Runs in each vLLM worker: receive ``iters + 1`` raw broadcasts of ``nbytes`` over the
    extension's group."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device=worker.device)
    for _ in range(iters + 1):
        vllm_weights.worker_state(worker).group.broadcast(buf, src=0)
    torch.cuda.synchronize()
    return bool(buf[-1].item() == 7)


def raw_broadcast(llm: Any, group: Any, nbytes: int, iters: int = 3) -> float:
    """Seconds per broadcast of one flat ``nbytes`` buffer from the trainer to the engine's
    workers."""
    flat = torch.full((nbytes,), 7, dtype=torch.uint8, device="cuda:0")
    def send() -> float:
        group.broadcast(flat, src=0)  # warm-up, and every receiver has posted its first receive
        group.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            group.broadcast(flat, src=0)
        group.synchronize()
        return (time.perf_counter() - t0) / iters

    dt, ok = vllm_ext.alongside(lambda: vllm_ext.call(llm, _raw_receive, nbytes, iters), send)
    if not all(ok):
        raise RuntimeError("raw broadcast: a worker received the wrong bytes")
    return dt


def device_copy(nbytes: int, iters: int = 3) -> float:
    """Seconds per device-to-device copy of ``nbytes`` on GPU 0: the yardstick when trainer and
    engine share it."""
    src = torch.full((nbytes,), 7, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def copy_floor(worker: Any, iters: int = 5) -> float:
    """Runs in the worker that holds the mapping: seconds (median of ``iters``) for one flat copy of
    as many bytes as the mapped update copies, from the trainer's mapped buffer into new memory: the
    floor of the update's copies, measured where they run, from the memory they read."""
    _, plan = vllm_weights.worker_state(worker).mapped
    src = plan.copies[0][1]
    flat = torch.empty(0, dtype=torch.uint8,
                       device=src.device).set_(src.untyped_storage())[:plan.copied_bytes]
    dst, times = torch.empty_like(flat), []
    for _ in range(iters + 1):  # (the first one warms up)
        t0 = time.perf_counter()
        dst.copy_(flat)
        devices.synchronize(src.device)
        times.append(time.perf_counter() - t0)
    del dst
    if src.is_cuda:
        # the destination's memory back to the device, before the sleep measurements
        torch.cuda.empty_cache()
    return statistics.median(times[1:])


def against_floor(llm: Any, shared: fast_update.SharedWeights, mapping: dict[str, Any],
                  repeats: int = 5) -> dict[str, Any]:
    """The mapped update against one flat copy of the same bytes (``copy_floor``), in the same
    worker and run: ``copy_fraction_of_floor`` for the update's copies (``copy_s`` of
    ``sync_mapped_weights``), and ``sync_fraction_of_floor`` for the whole ``fast_update.sync`` as
    the trainer sees it (check, RPC, copies); medians of ``repeats`` updates. Where the rest goes,
    by the worker's clock stamps: ``there_s`` (the trainer's check, then the RPC on its way),
    ``in_worker_s`` (checks and copies), ``back_s`` (the reply), ``refresh_s`` alone, and what a
    call that does nothing costs (``rpc_floor``)."""
    copy_s, sync_s, ways, refresh_s = [], [], [], []
    for _ in range(repeats):
        t0 = time.monotonic()
        (got,) = fast_update.sync(llm, shared)
        t1 = time.monotonic()
        sync_s.append(t1 - t0)
        copy_s.append(got["copy_s"])
        ways.append((got["entered"] - t0, got["left"] - got["entered"], t1 - got["left"]))
        t0 = time.monotonic()
        shared.refresh()  # (again, alone: what the trainer's side costs before the call)
        refresh_s.append(time.monotonic() - t0)
    if torch.cuda.is_available():
        # the trainer's cached blocks back to the device, for the floor's destination
        torch.cuda.empty_cache()
    (floor,) = vllm_ext.call(llm, copy_floor)
    copy, whole = statistics.median(copy_s), statistics.median(sync_s)
    there, inside, back = (statistics.median(w) for w in zip(*ways))
    return {"copies": mapping["copies"], "planned_params": mapping["planned_params"],
            "copy_floor_s": floor,
            "copy_median_s": copy, "sync_median_s": whole, "copy_fraction_of_floor": floor / copy,
            "sync_fraction_of_floor": floor / whole, "there_s": there, "in_worker_s": inside,
            "back_s": back, "refresh_s": statistics.median(refresh_s), **rpc_floor(llm)}


def _noop(worker: Any) -> int:
    return 0


def rpc_floor(llm: Any, repeats: int = 20) -> dict[str, float]:
    """Medians of ``repeats`` calls that do (almost) nothing, through ``vllm_ext.call`` (its
    deadline thread and checks) and through vLLM's ``collective_rpc`` alone: a function sent to the
    workers (pickled by value each call: ``rpc_noop``) and a method they have by name, as the mapped
    sync is called (``report_device_id``: ``rpc_named``)."""
    out = {}
    for key, fn in (("rpc_noop_s", lambda: vllm_ext.call(llm, _noop)),
                    ("rpc_noop_vllm_s", lambda: llm.collective_rpc(_noop)),
                    ("rpc_named_s", lambda: vllm_ext.call(llm, "report_device_id")),
                    ("rpc_named_vllm_s", lambda: llm.collective_rpc("report_device_id"))):
        times = []
        for _ in range(repeats + 1):  # (the first one warms up)
            t0 = time.monotonic()
            fn()
            times.append(time.monotonic() - t0)
        out[key] = statistics.median(times[1:])
    return out


def timed(fn: Any, llm: Any) -> dict[str, Any]:
    """Run one update ``fn()``, then one greedy generation; seconds for both and for the update
    alone. Of what ``fn`` returns (a dict, or None), the seconds by part (keys ending in ``_s``)
    become ``parts``, the rest ``stats`` (e.g. ``push_weights``' counts and its workers'
    replies)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    got = fn() or {}
    t1 = time.perf_counter()
    toks = engine_tokens(llm)
    t2 = time.perf_counter()
    got = got if isinstance(got, dict) else {"returned": got}
    parts = {k: v for k, v in got.items() if k.endswith("_s") and isinstance(v, (int, float))}
    stats = {k: v for k, v in got.items() if k not in parts}
    return {"seconds": t2 - t0, "update_s": t1 - t0, "generate_s": t2 - t1, "tokens": toks,
            "parts": parts,
            **({"stats": stats} if stats else {})}


def run_modes(modes: dict[str, Any], model: Any, llm: Any, version: int, tp: int,
              details: dict[str, Any] | None = None) -> tuple[dict[str, Any], int]:
    """Time each update mode on a new version of the weights, then check the engine's bytes (not
    timed). ``details[name]()``, called after the timing, adds the engine's own account of where the
    time went."""
    out = {}
    for name, fn in modes.items():
        # the second round is the one reported (the first warms up buffers and kernels)
        for _ in range(2):
            version += 1
            new_version(model, version)
            row = timed(fn, llm)
        row.pop("tokens")  # (random weights: the text proves nothing, see the module docstring)
        if details and name in details:
            row["parts"].update(details[name]())
        if row["parts"]:  # the rest: RPC hops, (un)pickling, acks, waits
            row["parts"]["other_s"] = max(row["update_s"] - sum(row["parts"].values()), 0.0)
        row.update(check(llm, model, tp))
        out[name] = row
        progress.write(f"  {name:<12} {row['seconds'] * 1e3:8.1f} ms  engine's bytes == trainer's: "
                       f"{row['exact']}"
                       + "".join(f"\n      {d}" for d in row["differences"]))
    return out, version


def cycle(llm: Any, update: Any) -> dict[str, Any]:
    """One update as a trainer's step makes it: pause the engine's scheduling (``sleep(level=0)``:
    requests queue, no memory moves), ``update()``, resume (``wake_up(tags=["scheduling"])``).
    ``update()``'s dict (or None), with ``pause_s`` and ``resume_s`` added."""
    t0 = time.perf_counter()
    llm.sleep(level=0)
    t1 = time.perf_counter()
    got = update() or {}
    t2 = time.perf_counter()
    llm.wake_up(tags=["scheduling"])
    return {**got, "pause_s": t1 - t0, "resume_s": time.perf_counter() - t2}


def bucketed_update(group: Any, named: list[tuple[str, torch.Tensor]], llm: Any,
                    bucket_bytes: int) -> dict[str, Any]:
    """``vllm_ext.push_weights`` (bucketed), with its transfer phase: ``transfer_s``, the slowest
    worker's own time from the end of the handshake to the end of the last vote (every bucket
    received and loaded, loads overlapping the next bucket's arrival; both votes), read from the
    workers' replies (``workers``, each with its seconds per phase), and per worker whether it
    copied as planned (``planned``, ``planned_params``, ``copies``, ``fallback``: module -> why it
    kept the safe path). (The trainer's side, ``broadcast.send``'s stats, is not returned by
    ``push_weights``: only its collective count.)"""
    got = vllm_ext.push_weights(group, named, llm, mode="bucketed", bucket_bytes=bucket_bytes)
    workers = [dict(w) for w in got.pop("workers")]
    transfer = max(w["seconds"] - w["handshake_s"] for w in workers)
    plan = {k: [w.get(k) for w in workers] for k in ("planned", "planned_params", "copies",
                                                     "fallback")}
    return {**got, "transfer_s": transfer, **plan, "workers": workers}


def disaggregated(model: Any, folder: Path, tp: int,
                  version: int) -> tuple[dict[str, Any], float, int]:
    """Modes over NCCL to an engine on GPUs 1..tp, each a whole cycle (``cycle``); returns the
    modes, the raw broadcast's seconds for the model's bytes, and the next version. Everything set
    up is torn down, also on error."""
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.base import ModuleSource

    named = [(n, p.detach()) for n, p in model.named_parameters()]
    nbytes = sum(p.numel() * p.element_size() for _, p in named)
    with Teardown() as undo:
        llm = start_llm(folder, engine_gpus(*range(1, tp + 1)), tp, gpu_memory_utilization=0.5,
                        weight_transfer_config=WeightTransferConfig(backend="nccl"))
        undo.add(lambda: vllm_engine.stop_llm(llm), "stop the engine")
        # (a free_port port can be taken beside an engine before rank 0 listens)
        store = groups.host_store()
        group, _ = vllm_ext.alongside(
            lambda: vllm_ext.call(llm, "init_weight_update_group", "127.0.0.1", store.port, 1,
                                  tp + 1),
            lambda: vllm_ext.stateless_init_process_group("127.0.0.1", store.port, 0, tp + 1,
                                                          "cuda:0", store))
        undo.add(group.destroy, "destroy the trainer's group")
        undo.add(lambda: vllm_ext.call(llm, "destroy_weight_update_group"),
                 "the workers leave the group")
        raw_s = min(raw_broadcast(llm, group, nbytes) for _ in range(2))
        from labsupport.experiments import cluster_labs

        native = vllm_plugin.native_trainer("cuda:0", "127.0.0.1", groups.free_port(), tp + 1,
                                            client=cluster_labs.LLMWeightSyncClient(llm),
                                            source=ModuleSource(model))
        undo.add(native.shutdown, "shut the native trainer down")
        modes = {
            "per_tensor": lambda: cycle(llm, lambda: vllm_ext.push_weights(group, named, llm,
                                                                           mode="per_tensor")),
            "bucketed": lambda: cycle(llm, lambda: bucketed_update(group, named, llm, 1 << 30)),
            "native_nccl": lambda: cycle(llm, native.send_weights),
        }
        out, version = run_modes(modes, model, llm, version, tp)
    return out, raw_s, version


def nccl_fractions(row: dict[str, Any], raw_s: float) -> dict[str, Any]:
    """A disaggregated mode against the raw broadcast of the same bytes in the same run:
    ``cycle_over_raw`` (the whole cycle, pause to resume, over raw: the bar is <= 2) and, where the
    mode reports its transfer phase, ``transfer_fraction_of_raw`` (raw over the transfer phase: the
    bar is >= 0.85)."""
    out = {"cycle_over_raw": row["update_s"] / raw_s}
    if "transfer_s" in row["parts"]:
        out["transfer_fraction_of_raw"] = raw_s / row["parts"]["transfer_s"]
    return out


def bar_nccl(shape: dict[str, Any]) -> dict[str, Any] | None:
    """Issue 47's bar on one shape's disaggregated results (None without them): the bucketed
    update's transfer phase >= 85 % of the raw broadcast, its whole cycle <= 2x raw, byte-exact on
    every rank; beside it vLLM's native packed NCCL path, and which of the two cycles is faster."""
    modes = shape["modes"]
    if "bucketed" not in modes or not shape.get("raw_broadcast_s"):
        return None
    b, n = modes["bucketed"], modes.get("native_nccl")
    bar = {"raw_broadcast_s": shape["raw_broadcast_s"], "transfer_s": b["parts"]["transfer_s"],
           "transfer_fraction_of_raw": b["transfer_fraction_of_raw"], "cycle_s": b["update_s"],
           "cycle_over_raw": b["cycle_over_raw"], "exact_by_rank": b["exact_by_rank"],
           "native_nccl_cycle_s": n["update_s"] if n else None,
           "native_nccl_cycle_over_raw": n["cycle_over_raw"] if n else None,
           "native_nccl_exact_by_rank": n["exact_by_rank"] if n else None,
           "faster_cycle": None if n is None else "bucketed" if b["update_s"] <= n["update_s"]
           else "native_nccl"}
    return {**bar, "met": bar["transfer_fraction_of_raw"] >= 0.85 and bar["cycle_over_raw"] <= 2.0
            and all(bar["exact_by_rank"])}


def _device_used() -> int:
    free, total = torch.cuda.mem_get_info(0)
    return total - free


def _pool_bytes(worker: Any) -> dict[str, int]:
    """Runs in the worker: bytes that vLLM's sleep allocator (``CuMemAllocator``) holds, by tag, and
    what this process's PyTorch allocator has reserved in all (the pool's allocations included)."""
    from vllm.device_allocator.cumem import CuMemAllocator

    out: dict[str, int] = {}
    for data in CuMemAllocator.get_instance().pointer_to_data.values():
        out[data.tag] = out.get(data.tag, 0) + int(data.handle[1])
    out["allocations"] = len(CuMemAllocator.get_instance().pointer_to_data)
    out["torch_reserved"] = int(torch.cuda.memory_reserved())
    return out


def host_copy(model: Any) -> dict[str, Any]:
    """What level 1's backup costs, piece by piece, in this process: fresh pinned host buffers, one
    per weight (as the sleep allocator makes one per allocation), then the copies into them, then
    the same copies again into buffers that are already pinned."""
    params = [p.detach().reshape(-1).view(torch.uint8) for p in model.parameters()]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    bufs = [torch.empty(p.numel(), dtype=torch.uint8, pin_memory=True) for p in params]
    t1 = time.perf_counter()
    for b, p in zip(bufs, params):
        b.copy_(p)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    for b, p in zip(bufs, params):
        b.copy_(p)
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    nbytes = sum(p.numel() for p in params)
    del bufs
    # give the pinned memory back (torch keeps it cached)
    getattr(torch._C, "_host_emptyCache", lambda: None)()
    return {"bytes": nbytes, "buffers": len(params), "pin_alloc_s": t1 - t0,
            "first_copy_s": t2 - t1,
            "copy_s": t3 - t2, "pin_alloc_gbps": nbytes / (t1 - t0) / 1e9,
            "copy_gbps": nbytes / (t3 - t2) / 1e9}


def colocated(model: Any, folder: Path, version: int) -> tuple[dict[str, Any], dict[str, Any], int]:
    """IPC modes into an engine on GPU 0 (the trainer's), the mapped fast path, and sleep / wake-up
    costs."""
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

    # read each time: the fast mode moves the parameters
    def named() -> list[tuple[str, torch.Tensor]]:
        return [(n, p.detach()) for n, p in model.named_parameters()]

    llm = start_llm(folder, engine_gpus(0), 1, gpu_memory_utilization=0.35, enable_sleep_mode=True,
                    weight_transfer_config={"backend": "ipc"})
    uuid = vllm_ext.call(llm, "report_device_id")[0]
    llm.init_weight_transfer_engine({"init_info": {}})

    def via_extension() -> dict[str, float]:
        with ipc.Exporter() as ex:
            t0 = time.perf_counter()
            bucket = ex.export_bucket(named())
            torch.cuda.synchronize()
            pack = time.perf_counter() - t0
            vllm_ext.call(llm, "update_weights_from_ipc", vllm_ext.pack_ipc_handles({uuid: bucket}))
            ex.release(bucket, force=True)
        return {"pack_s": pack}

    def via_native() -> None:
        llm.start_weight_update()
        send = lambda info: llm.update_weights({"update_info": asdict(info)})  # noqa: E731
        IPCWeightTransferEngine.trainer_send_weights(iter(named()),
                                                     {"send_mode": send, "packed": False})
        llm.finish_weight_update()

    def via_mapped() -> dict[str, float]:
        (got,) = fast_update.sync(llm, shared)
        return {"copy_s": got["copy_s"], "fallback_load_s": got["fallback_s"]}

    modes, version = run_modes({"ipc_extension": via_extension, "native_ipc": via_native}, model,
                               llm, version, 1,
                               details={"ipc_extension": lambda: vllm_ext.call(llm,
                                                                               "last_update_timing")[0]})
    # from here on the trainer's parameters live in the exported buffer
    shared = fast_update.SharedWeights(model)
    (mapping,) = fast_update.map_engine(llm, shared)
    progress.write(f"  mapped once: open {mapping['open_s'] * 1e3:.1f} ms, first load "
                   f"{mapping['first_load_s'] * 1e3:.1f} ms, plan {mapping['plan_s'] * 1e3:.1f} "
                   f"ms; {mapping['copies']} copies, fallback: {mapping['fallback'] or 'none'}")
    fast, version = run_modes({"mapped": via_mapped}, model, llm, version, 1)
    fast["mapped"]["once"] = mapping
    fast["mapped"].update(against_floor(llm, shared, mapping))
    modes.update(fast)
    sleep: dict[str, Any] = {"pool_bytes": vllm_ext.call(llm, _pool_bytes)[0]}

    def sleep_once(level: int) -> dict[str, Any]:
        torch.cuda.synchronize()
        used = _device_used()
        t0 = time.perf_counter()
        llm.sleep(level=level)
        t1 = time.perf_counter()
        freed = used - _device_used()
        llm.wake_up()
        t2 = time.perf_counter()
        return {"sleep_s": t1 - t0, "wake_s": t2 - t1, "freed_bytes": freed, "used_before": used,
                "used_asleep": used - freed}  # (device-wide: every process on GPU 0)

    before = vllm_ext.engine_sums(llm)
    sleep["level1"] = sleep_once(1)
    # level 1 + wake-up: the bytes from before the sleep, every one
    after = vllm_ext.engine_sums(llm)
    diffs = [f"rank {r}: {d}" for r, (b, a) in enumerate(zip(before, after))
             for d in checksums.differences(b, a)]
    sleep["level1"].update(restored_exact=not diffs, restored_differences=diffs[:8])
    # again: torch keeps the pinned host buffers of the first backup cached, so this one pays only
    # for copies
    sleep["level1"]["sleep_again_s"] = sleep_once(1)["sleep_s"]
    sleep["switch"], version = phase_switch(llm, model, shared, version)
    sleep["level2"] = sleep_once(2)
    # level 2 kept nothing: what the weights' memory holds after wake-up
    woke = vllm_ext.engine_sums(llm)
    sleep["level2"]["weights_kept"] = woke == before
    # so the engine has to be refilled: a new version from the trainer, then the byte check
    version += 1
    new_version(model, version)
    row = timed(via_extension, llm)
    reload = check(llm, model, 1)
    sleep["level2"].update(reload_s=row["update_s"], reloaded_exact=reload["exact"],
                           reload_differences=reload["differences"])
    for level in ("level1", "level2"):
        d = sleep[level]
        print(f"  sleep {level}: {d['sleep_s']:.2f} s, freed {d['freed_bytes'] / 2**30:.1f} GiB; "
              f"wake_up {d['wake_s']:.2f} s")
    print(f"  level 1 again {sleep['level1']['sleep_again_s']:.2f} s; bytes restored after level "
          f"1: {sleep['level1']['restored_exact']}; trainer's bytes after level 2 + reload: "
          f"{reload['exact']}")
    for name, d in sleep["switch"].items():
        print(f"  phase switch {name}: {d['seconds']:.3f} s to a generation with the trainer's "
              f"weights, exact: {d['exact']}")
    vllm_engine.stop_llm(llm)
    shared.close()
    # (after the engine has stopped: its pinned memory is gone)
    sleep["host_copy"] = host_copy(model)
    hc = sleep["host_copy"]
    print(f"  fresh pinned host memory {hc['pin_alloc_gbps']:.1f} GB/s, copy into pinned "
          f"{hc['copy_gbps']:.1f} GB/s")
    return modes, sleep, version


def colocated_inline(model: Any, folder: Path, version: int) -> tuple[dict[str, Any], int]:
    """``mapped_inline``: the mapped sync into an engine on GPU 0 whose engine core and worker run
    in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), timed and checked as ``mapped``, with
    ``against_floor``'s copies and whole sync (no RPC hop: the call reaches the worker in this
    process) against one flat copy in the same worker."""
    with Teardown() as undo:
        llm = start_llm(folder, engine_gpus(0), 1, inline=True, gpu_memory_utilization=0.35)
        undo.add(lambda: vllm_engine.stop_llm(llm), "stop the inline engine")
        # (a new buffer: the co-located engine's export is closed)
        shared = fast_update.SharedWeights(model)
        undo.add(shared.close, "close the export")
        (mapping,) = fast_update.map_engine(llm, shared)
        undo.add(lambda: fast_update.unmap_engine(llm), "unmap the trainer's weights")

        def via_mapped() -> dict[str, float]:
            (got,) = fast_update.sync(llm, shared)
            return {"copy_s": got["copy_s"], "fallback_load_s": got["fallback_s"]}

        fast, version = run_modes({"mapped_inline": via_mapped}, model, llm, version, 1)
        fast["mapped_inline"]["once"] = mapping
        fast["mapped_inline"].update(against_floor(llm, shared, mapping))
    return fast, version


def bar_mapped_sync(shape: dict[str, Any]) -> dict[str, Any]:
    """Issue 46's bar on one shape's results: the whole mapped sync as the trainer sees it (check,
    RPC, copies) >= 85 % of one flat copy of the same bytes in the same worker, exact; for the
    engine core in its own process (``mapped``) and in this one (``mapped_inline``, when
    measured)."""
    out: dict[str, Any] = {}
    for name in ("mapped", "mapped_inline"):
        if name in shape["modes"]:
            m = shape["modes"][name]
            out[name] = {k: m[k] for k in ("copy_floor_s", "sync_median_s",
                                           "sync_fraction_of_floor", "exact")}
    met_by = [n for n, m in out.items() if m["sync_fraction_of_floor"] >= 0.85 and m["exact"]]
    return {**out, "met_by": met_by, "met": bool(met_by)}


def phase_switch(llm: Any, model: Any, shared: fast_update.SharedWeights,
                 version: int) -> tuple[dict[str, Any], int]:
    """A co-located step's switch from training back to generation, two ways, each timed from "the
    engine goes to sleep" to "it has generated with the trainer's weights" (the training in between
    is not timed): ``level1_wake``: sleep level 1 (weights backed up to host), wake up; the
    trainer's changes never arrive, so it only fits a trainer that did not change the weights: the
    yardstick vLLM's docs suggest. ``level2_refill``: sleep level 2 (weights discarded), wake the
    weights' memory, refill from the trainer through the mapped path, wake the KV cache: what verl
    and slime do, with a new version of the weights checked byte for byte."""
    out = {}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.sleep(level=1)
    t1 = time.perf_counter()
    llm.wake_up()
    t2 = time.perf_counter()
    engine_tokens(llm)
    t3 = time.perf_counter()
    out["level1_wake"] = {"seconds": t3 - t0, "sleep_s": t1 - t0, "wake_s": t2 - t1,
                          "generate_s": t3 - t2,
                          # (the weights from before the sleep)
                          "exact": check(llm, model, 1)["exact"]}
    version += 1
    # "the trainer's step": a new version, written into the exported buffer
    new_version(model, version)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.sleep(level=2)
    t1 = time.perf_counter()
    llm.wake_up(tags=["weights"])
    t2 = time.perf_counter()
    fast_update.sync(llm, shared)
    t3 = time.perf_counter()
    llm.wake_up(tags=["kv_cache"])
    t4 = time.perf_counter()
    engine_tokens(llm)
    t5 = time.perf_counter()
    got = check(llm, model, 1)
    out["level2_refill"] = {"seconds": t5 - t0, "sleep_s": t1 - t0, "wake_weights_s": t2 - t1,
                            "refill_s": t3 - t2,
                            "wake_kv_s": t4 - t3, "generate_s": t5 - t4, "exact": got["exact"],
                            "differences": got["differences"]}
    return out, version


PART_LABELS = {"pack_s": "trainer packs a bucket", "check_s": "engine checks names",
               "open_s": "open IPC handles",
               "load_s": "layerwise reload", "copy_s": "device copies",
               "fallback_load_s": "safe path (fallback)",
               "other_s": "RPC hops, waits"}


def plot(data: dict[str, Any]):
    """Left: GB/s per mode and shape. Right: where the largest shape's update time goes, per
    co-located mode."""
    import matplotlib.pyplot as plt

    shapes = list(data["shapes"])
    # (mapped_inline: largest)
    names = list(dict.fromkeys(n for d in data["shapes"].values() for n in d["modes"]))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / len(shapes)
    for i, shape in enumerate(shapes):
        d = data["shapes"][shape]
        gbps = [d["modes"][n]["gbps"] if n in d["modes"] else 0.0 for n in names]
        ax.bar([k + i * width for k in range(len(names))], gbps, width,
               label=f"{shape} ({d['model_bytes'] / 1e9:.1f} GB); raw broadcast "
                     f"{d['raw_broadcast_gbps'] or 0:.0f}, device copy {d['device_copy_gbps']:.0f} "
                     "GB/s (bytes copied)")
    ax.set_xticks([k + width * (len(shapes) - 1) / 2 for k in range(len(names))], names)
    ax.set_ylabel("GB/s, send to first generation")
    where = f"TP={data['tp']}" if data["tp"] else "co-located only, one GPU"
    ax.set_title(f"Weight update into vLLM {data['vllm_version']} ({where})")
    ax.legend(fontsize=8)
    last = data["shapes"][shapes[-1]]
    co = [n for n in ("ipc_extension", "native_ipc", "mapped", "mapped_inline")
          if n in last["modes"]]
    bottom = [0.0] * len(co)
    for part, label in PART_LABELS.items():
        ms = [last["modes"][n]["parts"].get(part, 0.0) * 1e3 for n in co]
        if any(ms):
            bx.bar(co, ms, bottom=bottom, label=label)
            bottom = [b + m for b, m in zip(bottom, ms)]
    # modes not broken down
    rest = [last["modes"][n]["update_s"] * 1e3 - b for n, b in zip(co, bottom)]
    bx.bar(co, [max(r, 0.0) for r in rest], bottom=bottom, label="not broken down (vLLM's engine)",
           color="0.75")
    floor = last["model_bytes"] / (last["device_copy_gbps"] * 1e9) * 1e3
    bx.axhline(floor, color="k", ls="--", lw=1, label=f"one device copy: {floor:.1f} ms")
    bx.set_ylabel(f"ms per update, {shapes[-1]}")
    bx.set_title("Where a co-located update's time goes")
    bx.legend(fontsize=7)
    fig.tight_layout()
    return fig


def bar_mapped(shape: dict[str, Any]) -> dict[str, Any]:
    """Issue 22's bar on one shape's results: the mapped update takes at most 0.2x ``native_ipc``'s
    update time, at least 25 % of the device copy's speed (one copy of the bytes / ``update_s`` >=
    0.25), and is byte-exact."""
    mapped, native = shape["modes"]["mapped"], shape["modes"]["native_ipc"]
    bar = {"update_s": mapped["update_s"], "native_ipc_update_s": native["update_s"],
           "of_native": mapped["update_s"] / native["update_s"],
           "update_fraction_of_copy": mapped["update_fraction_of_copy"], "exact": mapped["exact"]}
    return {**bar, "met": bar["of_native"] <= 0.2 and bar["update_fraction_of_copy"] >= 0.25
            and bar["exact"]}


def bar_floor(shape: dict[str, Any]) -> dict[str, Any]:
    """Issue 37's bar on one shape's results: the mapped update's copies reach at least 85 % of one
    flat device copy of the same bytes, measured in the same worker (``against_floor``), and the
    update is byte-exact."""
    m = shape["modes"]["mapped"]
    bar = {k: m[k] for k in ("copies", "planned_params", "copy_floor_s", "copy_median_s",
                             "copy_fraction_of_floor",
                             "sync_median_s", "sync_fraction_of_floor", "exact")}
    return {**bar, "met": bar["copy_fraction_of_floor"] >= 0.85 and bar["exact"]}


def measure_shape(shape: str, folder: Path, n_gpus: int, tp: int, version: int, inline: bool
                  ) -> tuple[dict[str, Any], int]:
    """Every mode at one shape: disaggregated (two or more GPUs), co-located, and ``mapped_inline``
    if ``inline``."""
    progress.write(f"{shape}: building the trainer's model")
    model, folder = build(shape, folder / shape)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    modes, raw_s = {}, None
    if n_gpus >= 2:  # with one GPU only the co-located modes run
        modes, raw_s, version = disaggregated(model, folder, tp, version)
    co_modes, sleep, version = colocated(model, folder, version)
    if inline:
        more, version = colocated_inline(model, folder, version)
        co_modes.update(more)
    # device copy: bytes copied per second (the glossary's unit)
    copy_gbps = nbytes / device_copy(nbytes) / 1e9
    raw_gbps = nbytes / raw_s / 1e9 if raw_s else None
    modes.update(co_modes)
    for name, row in modes.items():
        row["gbps"] = nbytes / row["seconds"] / 1e9
        row["fraction_of_raw"] = row["gbps"] / raw_gbps if raw_gbps else None
        if name in co_modes:
            row["fraction_of_copy"] = row["gbps"] / copy_gbps
            # the update alone
            row["update_fraction_of_copy"] = nbytes / (copy_gbps * 1e9) / row["update_s"]
        elif raw_s:
            row.update(nccl_fractions(row, raw_s))
    del model
    torch.cuda.empty_cache()
    return {"model_bytes": nbytes, "raw_broadcast_s": raw_s, "raw_broadcast_gbps": raw_gbps,
            "device_copy_gbps": copy_gbps, "modes": modes, "sleep": sleep}, version


def report(data: dict[str, Any]) -> None:
    """The table of every shape, then the bars."""
    for shape, d in data["shapes"].items():
        raw = (f"{d['raw_broadcast_gbps']:.0f} GB/s (TP={data['tp']})" if d["raw_broadcast_gbps"]
               else "not measured (one GPU)")
        print(f"\n{shape}: {d['model_bytes'] / 1e9:.2f} GB, raw broadcast {raw}, "
              f"device copy {d['device_copy_gbps']:.0f} GB/s")
        print(f"{'mode':<14}{'to generate':>12}{'update':>10}{'GB/s':>8}{'of raw':>8}{'of copy':>8}"
              "  bytes exact")
        for n, r in d["modes"].items():
            print(f"{n:<14}{r['seconds'] * 1e3:>10.1f}ms{r['update_s'] * 1e3:>8.1f}ms"
                  f"{r['gbps']:>8.1f}"
                  f"{(r['fraction_of_raw'] or 0) * 100:>7.1f}%"
                  f"{(r.get('update_fraction_of_copy') or 0) * 100:>7.1f}%"
                  f"  {r['exact']} {r['exact_by_rank']}")
        for name in ("mapped", "mapped_inline"):
            if name not in d["modes"]:
                continue
            m = d["modes"][name]
            print(f"{name}: {m['copies']} copies for {m['planned_params']} engine parameters; in "
                  f"the worker, the copies {m['copy_median_s'] * 1e3:.2f} ms against one flat copy "
                  f"of the same bytes {m['copy_floor_s'] * 1e3:.2f} ms "
                  f"({m['copy_fraction_of_floor'] * 100:.1f} % of it); the whole sync, RPC "
                  f"included, {m['sync_median_s'] * 1e3:.2f} ms "
                  f"({m['sync_fraction_of_floor'] * 100:.1f} %)")
            if "there_s" in m:
                print(f"  where the sync's time goes: to the worker {m['there_s'] * 1e3:.2f} ms "
                      f"(the trainer's refresh alone {m['refresh_s'] * 1e3:.2f} ms), in it "
                      f"{m['in_worker_s'] * 1e3:.2f} ms, back {m['back_s'] * 1e3:.2f} ms")
            if "rpc_noop_s" in m:
                print(f"  a call that does nothing: {m['rpc_noop_s'] * 1e3:.2f} ms (vLLM's "
                      f"collective_rpc alone {m['rpc_noop_vllm_s'] * 1e3:.2f} ms); a method by "
                      f"name: {m['rpc_named_s'] * 1e3:.2f} ms ({m['rpc_named_vllm_s'] * 1e3:.2f})")
    print(f"\nbar (bucketed >= 80 % of raw, largest shape): {data['bar']}")
    print("bar (bucketed transfer >= 85 % of raw, cycle <= 2x raw, exact on every rank; native "
          f"NCCL beside it): {data['bar_nccl']}")
    print("bar (mapped <= 0.2x native_ipc and >= 25 % of one device copy, exact; largest shape): "
          f"{data['bar_mapped']}")
    print(f"bar (mapped copies >= 85 % of one flat copy in the worker, exact; largest shape): "
          f"{data['bar_mapped_floor']}")
    print("bar (the whole mapped sync >= 85 % of one flat copy in the worker, exact): "
          f"{data['bar_mapped_sync']}")


def main(argv: list[str] | None = None) -> int:
    """Time every way of getting a trainer's weights into vLLM; print a table, write JSON and a
    plot."""
    p = argparse.ArgumentParser(prog="python -m labsupport bench vllm-update",
                                description=main.__doc__)
    p.add_argument("--shapes", default="1.5b,7b", help=f"comma-separated, from {', '.join(SHAPES)}")
    p.add_argument("--dir", default="/tmp/labsupport_vllm_update",
                   help="where the model configs are written")
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--inline", default="largest",
                   help="shapes that also run mapped_inline (the engine core in this process): "
                   "'largest' (default), 'none', or comma-separated shapes")
    a = p.parse_args(argv)
    hardware.require_gpus(1, "bench vllm-update (co-located on GPU 0; disaggregated needs a second "
                             "GPU)")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # IPC handles travel pickled
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # this process has touched CUDA
    import vllm

    n_gpus = hardware.gpu_count()
    tp = 2 if n_gpus >= 3 else 1
    shapes = a.shapes.split(",")
    inline = {"largest": shapes[-1:], "none": []}.get(a.inline, a.inline.split(","))
    data: dict[str, Any] = {"vllm_version": vllm.__version__, "tp": tp if n_gpus >= 2 else None,
                            "shapes": {}}
    version = 0
    for shape in progress.bar(shapes, desc="bench vllm-update", unit="shape"):
        data["shapes"][shape], version = measure_shape(shape, Path(a.dir), n_gpus, tp, version,
                                                       shape in inline)
    last = data["shapes"][shapes[-1]]
    data.update(model_bytes=last["model_bytes"], raw_broadcast_gbps=last["raw_broadcast_gbps"],
                modes=last["modes"])
    bucketed = last["modes"].get("bucketed", {}).get("fraction_of_raw")
    exact = all(r["exact"] for d in data["shapes"].values() for r in d["modes"].values())
    exact_sleep = all(d["sleep"]["level1"]["restored_exact"]
                      and d["sleep"]["level2"]["reloaded_exact"]
                      and all(v["exact"] for v in d["sleep"]["switch"].values())
                      for d in data["shapes"].values())
    data["bar"] = {"bucketed_fraction_of_raw": bucketed, "met": bucketed is not None and bucketed
                   >= 0.8,
                   "all_exact": exact, "sleep_exact": exact_sleep}
    data["bar_nccl"] = bar_nccl(last)
    data["bar_mapped"] = bar_mapped(last)
    data["bar_mapped_floor"] = bar_floor(last)
    data["bar_mapped_sync"] = bar_mapped_sync(last)
    report(data)
    if not a.no_save:
        import matplotlib

        matplotlib.use("Agg")
        path = results.save_result("bench_vllm_update", data, figure=plot(data),
                                   command="python -m labsupport bench vllm-update "
                                   + " ".join(argv or []))
        print(f"wrote {path}")
    return 0 if data["bar"]["all_exact"] and data["bar"]["sleep_exact"] else 1
