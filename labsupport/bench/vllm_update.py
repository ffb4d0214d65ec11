"""``python -m labsupport bench vllm-update``: a full weight update into a real vLLM engine, end to end, on GPUs.

A model of real size (a Qwen2.5-1.5B and a 7B shape, bfloat16, random weights built from a config: nothing
is downloaded) lives on the trainer's GPU 0. The engine loads the same config with dummy weights. Each mode
sends every weight and is timed from "the trainer starts sending" to "the engine has generated with the new
weights", so the load into vLLM counts:

* disaggregated (engine with TP=2 on GPUs 1-2, or TP=1 on GPU 1 with only two GPUs), over NCCL:
  ``per_tensor`` (vLLM's rlhf.py loop), ``bucketed`` (``vllm_ext.WorkerExtension``), ``native_nccl``
  (vLLM's own weight-transfer engine); the raw broadcast of the same bytes over the same group is the yardstick;
* co-located (engine on GPU 0 beside the trainer), through CUDA IPC: ``ipc_extension``
  (``vllm_ext.ColocateWorkerExtension``) and ``native_ipc`` (vLLM's IPC engine); plus sleep level 1 and 2 /
  wake-up times and the memory each frees. The yardstick here is one device-to-device copy of the same bytes.
  With a single GPU only these co-located modes run.

Each version of the weights gets a new, large-valued LM head, so greedy output changes from version to version.
After every mode the engine's greedy tokens must be the trainer's: the trainer scores the engine's text with its
own forward pass and every token must be its argmax up to a bfloat16 near tie (``agrees``; ``exact`` records
whether the tokens were also identical to the trainer's own generation).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from labsupport import groups, hardware, ipc, results, vllm_ext

SHAPES = {  # Qwen2.5 shapes (untied LM head in both, so every version changes a separate tensor)
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064),
}
PROMPTS = [[11, 22, 33, 44, 55], [101, 7, 9000, 12]]
NEW_TOKENS = 4


def shape_config(shape: str | dict[str, Any], **extra: Any) -> Any:
    """The Qwen2 config of a shape: a name in ``SHAPES``, a dict of fields, or ``"tiny"`` (the course's model).
    The benches of vLLM updates, resharding and LoRA all build their models from it."""
    from transformers import Qwen2Config

    from labsupport import models

    if shape == "tiny":
        return models.build_config(**extra)
    fields = SHAPES[shape] if isinstance(shape, str) else dict(shape)
    return Qwen2Config(**fields, max_position_embeddings=2048, tie_word_embeddings=False, rope_theta=1e6,
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
def new_version(model: Any, version: int) -> list[list[int]]:
    """Give the model a new LM head (std 1: peaked logits) and return its greedy continuations."""
    g = torch.Generator(device="cuda:0").manual_seed(1000 + version)
    model.lm_head.weight.normal_(0.0, 1.0, generator=g)
    out = []
    for p in PROMPTS:
        ids = torch.tensor([p], device="cuda:0")
        gen = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        out.append(gen[0, len(p):].tolist())
    return out


@torch.no_grad()
def agrees(model: Any, got: list[list[int]], rel_tol: float = 0.02) -> bool:
    """Whether the engine's tokens are the trainer's greedy choices, checked with the trainer's own forward pass
    over the engine's text: at every position the engine's token must be the trainer's argmax, or within
    ``rel_tol`` (of the logits' spread) of it, since bfloat16 kernels may break a near tie the other way.
    Stale or wrong weights miss by far more than that, so they fail."""
    for prompt, toks in zip(PROMPTS, got):
        ids = torch.tensor([prompt + toks], device="cuda:0")
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
        chosen = logits.gather(1, torch.tensor(toks, device="cuda:0")[:, None])[:, 0]
        if ((logits.max(dim=1).values - chosen) > rel_tol * logits.std(dim=1)).any():
            return False
    return True


def engine_tokens(llm: Any) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def start_llm(folder: Path, gpus: str, tp: int, **kwargs: Any) -> Any:
    """An in-process ``LLM`` whose workers see only ``gpus`` (its engine-core process is spawned now)."""
    from vllm import LLM

    torch.cuda.init()  # this process keeps every GPU; only the spawned engine sees CUDA_VISIBLE_DEVICES
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = gpus
    try:
        return LLM(model=str(folder), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                   tensor_parallel_size=tp, enforce_eager=True, max_model_len=256, max_num_seqs=4,
                   worker_extension_cls="labsupport.vllm_ext.RLHFWorkerExtension", **kwargs)
    finally:
        if old is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES")
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old


def _raw_receive(worker: Any, nbytes: int, iters: int) -> bool:
    """Runs in each vLLM worker: receive ``iters + 1`` raw broadcasts of ``nbytes`` over the extension's group."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device=worker.device)
    for _ in range(iters + 1):
        worker._lsx_group.broadcast(buf, src=0, stream=torch.cuda.current_stream())
    torch.cuda.synchronize()
    return bool(buf[-1].item() == 7)


def raw_broadcast(llm: Any, group: Any, nbytes: int, iters: int = 3) -> float:
    """Seconds per broadcast of one flat ``nbytes`` buffer from the trainer to the engine's workers."""
    flat = torch.full((nbytes,), 7, dtype=torch.uint8, device="cuda:0")
    wait = vllm_ext.rpc_in_thread(llm)(_raw_receive, (nbytes, iters))
    group.broadcast(flat, src=0)  # warm-up, and every receiver has posted its first receive
    group.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        group.broadcast(flat, src=0)
    group.synchronize()
    dt = (time.perf_counter() - t0) / iters
    if not all(wait()):
        raise RuntimeError("raw broadcast: a worker received the wrong bytes")
    return dt


def device_copy(nbytes: int, iters: int = 3) -> float:
    """Seconds per device-to-device copy of ``nbytes`` on GPU 0: the yardstick when trainer and engine share it."""
    src = torch.full((nbytes,), 7, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def timed(fn: Any, llm: Any) -> dict[str, Any]:
    """Run one update ``fn()``, then one greedy generation; seconds for both and for the update alone."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    toks = engine_tokens(llm)
    t2 = time.perf_counter()
    return {"seconds": t2 - t0, "update_s": t1 - t0, "generate_s": t2 - t1, "tokens": toks}


def run_modes(modes: dict[str, Any], model: Any, llm: Any, version: int) -> tuple[dict[str, Any], int]:
    """Time each update mode on a new version of the weights and check the engine's greedy tokens."""
    out = {}
    for name, fn in modes.items():
        for _ in range(2):  # the second round is the one reported (the first warms up buffers and kernels)
            version += 1
            want = new_version(model, version)
            row = timed(fn, llm)
        tokens = row.pop("tokens")
        row["exact"] = tokens == want  # token for token; "ok" allows bfloat16 near ties (see agrees)
        row["ok"] = agrees(model, tokens)
        out[name] = row
        print(f"  {name:<12} {row['seconds'] * 1e3:8.1f} ms  trainer's tokens: {row['ok']} (identical: {row['exact']})", flush=True)
    return out, version


def disaggregated(model: Any, folder: Path, tp: int, version: int) -> tuple[dict[str, Any], float, int]:
    """Modes over NCCL to an engine on GPUs 1..tp; returns the modes, raw GB/s and the next version."""
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.base import ModuleSource

    named = list(model.named_parameters())
    nbytes = sum(p.numel() * p.element_size() for _, p in named)
    llm = start_llm(folder, ",".join(str(i) for i in range(1, tp + 1)), tp, gpu_memory_utilization=0.5,
                    weight_transfer_config=WeightTransferConfig(backend="nccl"))
    port = groups.free_port()
    joining = vllm_ext.rpc_in_thread(llm)("init_weight_update_group", ("127.0.0.1", port, 1, tp + 1))
    group = vllm_ext.stateless_init_process_group("127.0.0.1", port, 0, tp + 1, "cuda:0")
    joining()
    raw_s = min(raw_broadcast(llm, group, nbytes) for _ in range(2))
    native = vllm_ext.native_trainer("cuda:0", "127.0.0.1", groups.free_port(), tp + 1,
                                     client=vllm_ext.LLMWeightSyncClient(llm), source=ModuleSource(model))
    call = vllm_ext.rpc_in_thread(llm)
    modes = {
        "per_tensor": lambda: vllm_ext.push_weights(group, named, call, mode="per_tensor"),
        "bucketed": lambda: vllm_ext.push_weights(group, named, call, mode="bucketed", bucket_bytes=1 << 30),
        "native_nccl": native.send_weights,
    }
    out, version = run_modes(modes, model, llm, version)
    native.shutdown()
    llm.collective_rpc("destroy_weight_update_group")
    group.destroy()
    vllm_ext.stop_engine(llm)
    return out, nbytes / raw_s / 1e9, version


def _device_used() -> int:
    free, total = torch.cuda.mem_get_info(0)
    return total - free


def colocated(model: Any, folder: Path, version: int) -> tuple[dict[str, Any], dict[str, Any], int]:
    """IPC modes into an engine on GPU 0 (the trainer's), and sleep / wake-up costs."""
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

    named = [(n, p.detach()) for n, p in model.named_parameters()]
    llm = start_llm(folder, os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0], 1,
                    gpu_memory_utilization=0.35, enable_sleep_mode=True,
                    weight_transfer_config={"backend": "ipc"})
    uuid = llm.collective_rpc("report_device_id")[0]
    llm.init_weight_transfer_engine({"init_info": {}})

    def via_extension() -> None:
        with ipc.Exporter() as ex:
            bucket = ex.export_bucket(named)
            llm.collective_rpc("update_weights_from_ipc", args=(vllm_ext.pack_ipc_handles({uuid: bucket}),))
            ex.release(bucket, force=True)

    def via_native() -> None:
        llm.start_weight_update()
        send = lambda info: llm.update_weights({"update_info": asdict(info)})  # noqa: E731
        IPCWeightTransferEngine.trainer_send_weights(iter(named), {"send_mode": send, "packed": False})
        llm.finish_weight_update()

    modes, version = run_modes({"ipc_extension": via_extension, "native_ipc": via_native}, model, llm, version)
    sleep = {}
    for level in (1, 2):
        torch.cuda.synchronize()
        used = _device_used()
        t0 = time.perf_counter()
        llm.sleep(level=level)
        t1 = time.perf_counter()
        freed = used - _device_used()
        llm.wake_up()
        t2 = time.perf_counter()
        sleep[f"level{level}"] = {"sleep_s": t1 - t0, "wake_s": t2 - t1, "freed_bytes": freed}
        print(f"  sleep level {level}: {t1 - t0:.2f} s, freed {freed / 2**30:.1f} GiB; wake_up {t2 - t1:.2f} s")
    version += 1  # level 2 threw the weights away: load them again and check
    want = new_version(model, version)
    row = timed(via_extension, llm)
    sleep["level2"]["reloaded_ok"] = agrees(model, row["tokens"])
    sleep["level2"]["reloaded_exact"] = row["tokens"] == want
    vllm_ext.stop_engine(llm)
    return modes, sleep, version


def plot(data: dict[str, Any]):
    import matplotlib.pyplot as plt

    shapes = list(data["shapes"])
    names = list(next(iter(data["shapes"].values()))["modes"])
    fig, ax = plt.subplots(figsize=(9, 3.6))
    width = 0.8 / len(shapes)
    for i, shape in enumerate(shapes):
        d = data["shapes"][shape]
        ax.bar([k + i * width for k in range(len(names))], [d["modes"][n]["gbps"] for n in names], width,
               label=f"{shape} ({d['model_bytes'] / 1e9:.1f} GB); raw broadcast {d['raw_broadcast_gbps'] or 0:.0f}, "
                     f"device copy {d['device_copy_gbps']:.0f} GB/s")
    ax.set_xticks([k + width * (len(shapes) - 1) / 2 for k in range(len(names))], names)
    ax.set_ylabel("GB/s, send to first generation")
    where = f"TP={data['tp']}" if data["tp"] else "co-located only, one GPU"
    ax.set_title(f"Weight update into vLLM {data['vllm_version']} ({where})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    """Time every way of getting a trainer's weights into vLLM; print a table, write JSON and a plot."""
    p = argparse.ArgumentParser(prog="python -m labsupport bench vllm-update", description=main.__doc__)
    p.add_argument("--shapes", default="1.5b,7b", help=f"comma-separated, from {', '.join(SHAPES)}")
    p.add_argument("--dir", default="/tmp/labsupport_vllm_update", help="where the model configs are written")
    p.add_argument("--no-save", action="store_true")
    a = p.parse_args(argv)
    hardware.require_gpus(1, "bench vllm-update (co-located on GPU 0; disaggregated needs a second GPU)")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # IPC handles travel pickled
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # this process has touched CUDA
    import vllm

    n_gpus = hardware.gpu_count()
    tp = 2 if n_gpus >= 3 else 1
    data: dict[str, Any] = {"vllm_version": vllm.__version__, "tp": tp if n_gpus >= 2 else None, "shapes": {}}
    version = 0
    for shape in a.shapes.split(","):
        print(f"{shape}: building the trainer's model", flush=True)
        model, folder = build(shape, Path(a.dir) / shape)
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        modes, raw_gbps = {}, None
        if n_gpus >= 2:  # with one GPU only the co-located modes run
            modes, raw_gbps, version = disaggregated(model, folder, tp, version)
        co_modes, sleep, version = colocated(model, folder, version)
        copy_gbps = 2 * nbytes / device_copy(nbytes) / 1e9  # read + write, as the copy bandwidth is quoted
        modes.update(co_modes)
        for name, row in modes.items():
            row["gbps"] = nbytes / row["seconds"] / 1e9
            row["fraction_of_raw"] = row["gbps"] / raw_gbps if raw_gbps else None
            if name in co_modes:
                row["fraction_of_copy"] = 2 * row["gbps"] / copy_gbps  # the update reads and writes each byte once
        data["shapes"][shape] = {"model_bytes": nbytes, "raw_broadcast_gbps": raw_gbps, "device_copy_gbps": copy_gbps,
                                 "modes": modes, "sleep": sleep}
        del model
        torch.cuda.empty_cache()
    last = data["shapes"][list(data["shapes"])[-1]]
    data.update(model_bytes=last["model_bytes"], raw_broadcast_gbps=last["raw_broadcast_gbps"], modes=last["modes"])
    bucketed = last["modes"].get("bucketed", {}).get("fraction_of_raw")
    data["bar"] = {"bucketed_fraction_of_raw": bucketed, "met": bucketed is not None and bucketed >= 0.8,
                   "all_outputs_equal": all(r["ok"] for d in data["shapes"].values() for r in d["modes"].values())}
    for shape, d in data["shapes"].items():
        raw = f"{d['raw_broadcast_gbps']:.0f} GB/s (TP={tp})" if d["raw_broadcast_gbps"] else "not measured (one GPU)"
        print(f"\n{shape}: {d['model_bytes'] / 1e9:.2f} GB, raw broadcast {raw}, "
              f"device copy {d['device_copy_gbps']:.0f} GB/s")
        print(f"{'mode':<14}{'to generate':>12}{'update':>10}{'GB/s':>8}{'of raw':>8}  output ok")
        for n, r in d["modes"].items():
            print(f"{n:<14}{r['seconds'] * 1e3:>10.1f}ms{r['update_s'] * 1e3:>8.1f}ms{r['gbps']:>8.1f}"
                  f"{(r['fraction_of_raw'] or 0) * 100:>7.1f}%  {r['ok']}")
    print(f"\nbar (bucketed >= 80 % of raw, largest shape): {data['bar']}")
    if not a.no_save:
        import matplotlib

        matplotlib.use("Agg")
        path = results.save_result("bench_vllm_update", data, figure=plot(data),
                                   command="python -m labsupport bench vllm-update " + " ".join(argv or []))
        print(f"wrote {path}")
    return 0 if data["bar"]["all_outputs_equal"] else 1
