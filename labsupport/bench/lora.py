"""``python -m labsupport bench lora``: a LoRA-only update against a full update of the merged
weights.

For a model shape (the course's tiny model, or the 1.5B / 7B Qwen2.5 shapes of
``bench.vllm_update``, random weights from a config: nothing is downloaded) the trainer wraps its
model with a rank-``r`` adapter on every decoder linear layer and gives ``B`` random values, so that
the adapter changes the output. One vLLM engine on the trainer's device
(``vllm_engine.colocated_args`` with LoRA enabled: both kinds of update) first receives the base
weights (not timed). Then, each timed from the trainer's first byte to the engine having it loaded:

* ``lora``: save the adapter and ``add_lora`` it under a new id (``lora_demo.send_adapter``);
* ``full_merged``: merge into a copy, send every weight through IPC, load
  (``lora_demo.send_merged``).

Each runs twice (the second is reported) and is followed by a first greedy generation (timed). The
verdict is checked byte for byte, never from text (on random weights bfloat16 near ties break either
way): ``full_merged.exact``: every engine parameter holds the trainer's merged bytes, in the
engine's layout (``checksums.check_engine``); ``lora.base_exact``: the adapter path left the
engine's base weights as they were. ``ok`` is that verdict. ``tokens_match`` (the engine's greedy
tokens equal the trainer's) is kept as a sanity line only. ``measure`` is what other benches import
(the resharding bench runs it on GPUs).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from labsupport import checksums, lora, reshard, vllm_ext
from labsupport.experiments import lora_demo
from labsupport.course import hardware, progress, results, vllm_engine
from labsupport.bench.vllm_update import shape_config
from labsupport.core.buckets import dtype_name

PROMPTS = [[11, 22, 33, 44, 5], [40, 7, 9, 12]]
NEW_TOKENS = 4


def _greedy(model, device: str) -> list[list[int]]:
    out = []
    for p in PROMPTS:
        ids = torch.tensor([p], device=device)
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             do_sample=False,
                             pad_token_id=0)
        out.append(gen[0, len(p):].tolist())
    return out


def _engine_tokens(llm, request=None) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0.0,
                        max_tokens=NEW_TOKENS), lora_request=request, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@torch.no_grad()
def _randomize_adapter(pm, version: int) -> None:
    g = torch.Generator().manual_seed(100 + version)
    for n, p in pm.named_parameters():
        if "lora_B" in n:
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def measure(shape: str | dict[str, Any] = "tiny", rank: int = 8, *, gpu: bool | None = None,
            folder: str | os.PathLike | None = None) -> dict[str, Any]:
    """Bytes and seconds of one LoRA-only update and one full update of the merged weights.

    ``shape``: ``"tiny"``, ``"1.5b"``, ``"7b"`` or a dict of Qwen2Config fields. GPU (default when
    there is one): trainer and engine share cuda:0, bfloat16. Returns ``{"lora": {"bytes",
    "seconds", "ok", ...}, "full_merged": {...}, "rank", "model_bytes", "device"}``.
    """
    from transformers import AutoModelForCausalLM

    gpu = hardware.gpu_count() > 0 if gpu is None else gpu
    device, dtype = ("cuda:0", torch.bfloat16) if gpu else ("cpu", torch.float32)
    tmp = Path(folder or tempfile.mkdtemp(prefix="labsupport_lora_"))
    cfg = shape_config(shape)
    cfg.save_pretrained(tmp / "model")
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 1.0)
    # the byte check runs a function in the workers
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    llm = vllm_engine.start_llm(vllm_engine.colocated_args(tmp / "model", gpu=gpu, enable_lora=True,
                                                           max_lora_rank=rank,
                                                           max_loras=1, load_format="dummy",
                                                           skip_tokenizer_init=True,
                                                           max_model_len=256), gpu=gpu)
    try:
        layout = reshard.qwen2_layout(cfg, 1)
        # the base, once
        vllm_ext.push_ipc(llm, [(n, p.detach()) for n, p in model.named_parameters()])
        # the base arrived byte for byte
        base = checksums.check_engine(vllm_ext.engine_sums(llm), model.named_parameters(), layout)
        base_sums = checksums.layout_checksums(model.named_parameters(), layout, 0)
        pm = lora.add_adapter(model, rank)
        out: dict[str, Any] = {"rank": rank, "device": device, "dtype": dtype_name(dtype),
                               "model_bytes": sum(p.numel() * p.element_size()
                                                  for p in model.parameters()),
                               "base_exact": base["exact"], "base_differences": base["differences"]}
        for version in (1, 2):  # adapters first: a merged update changes the engine's base for good
            _randomize_adapter(pm, version)
            row = lora_demo.send_adapter(llm, pm, tmp / f"adapter{version}", version, dtype=dtype)
            t0 = time.perf_counter()
            tokens = _engine_tokens(llm, row.pop("request"))
            row["first_generate_s"] = time.perf_counter() - t0
            row["tokens_match"] = tokens == _greedy(pm, device)  # sanity only
            diffs = checksums.differences(base_sums, vllm_ext.engine_sums(llm)[0])
            # (adapter bytes: not checked)
            row.update(base_exact=not diffs, differences=diffs[:8], exact=None)
            row["ok"] = row["base_exact"]
            if version == 2:
                llm.llm_engine.remove_lora(1)
        out["lora"] = row
        for _ in range(2):
            row = lora_demo.send_merged(llm, pm, dtype=dtype)
            t0 = time.perf_counter()
            tokens = _engine_tokens(llm)
            row["first_generate_s"] = time.perf_counter() - t0
        row["tokens_match"] = tokens == _greedy(pm, device)  # sanity only
        row.update(checksums.check_engine(vllm_ext.engine_sums(llm), lora.merged_weights(pm, dtype),
                                          layout))
        row["ok"] = row["exact"]
        out["full_merged"] = row
        out["bytes_ratio"] = out["lora"]["bytes"] / row["bytes"]
        return out
    finally:
        vllm_engine.stop_llm(llm)


def main(argv: list[str] | None = None) -> int:
    """Time a LoRA-only update against a full merged update per shape; print a table, write JSON."""
    p = argparse.ArgumentParser(prog="python -m labsupport bench lora", description=main.__doc__)
    p.add_argument("--shapes", default=None,
                   help="comma-separated from tiny, 1.5b, 7b (default: tiny on CPU, 1.5b,7b on "
                                                  "GPU)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--no-save", action="store_true")
    a = p.parse_args(argv)
    gpu = hardware.gpu_count() > 0
    shapes = (a.shapes or ("1.5b,7b" if gpu else "tiny")).split(",")
    data = {"rank": a.rank, "shapes": {s: measure(s, a.rank, gpu=gpu)
                                       for s in progress.bar(shapes, desc="bench lora",
                                                             unit="shape")}}
    print(f"\n{'shape':<7}{'update':<13}{'bytes':>14}{'seconds':>10}  bytes ok  (same tokens: "
          "sanity only)")
    for s, d in data["shapes"].items():
        for kind in ("lora", "full_merged"):
            r = d[kind]
            print(f"{s:<7}{kind:<13}{r['bytes']:>14,}{r['seconds']:>10.3f}  {str(r['ok']):<9} "
                  f"({r['tokens_match']})"
                  + "".join(f"\n      {d}" for d in r["differences"]))
    if not a.no_save:
        path = results.save_result("bench_lora", data, command="python -m labsupport bench lora "
                                   + " ".join(argv or []))
        print(f"wrote {path}")
    return 0 if all(d["base_exact"] and d[k]["ok"] for d in data["shapes"].values()
                    for k in ("lora", "full_merged")) else 1
