"""Rollouts: what an engine returns (:class:`Rollout`: completions with the engine's log-probability
per token), and the KV-cached sampler that the transformers engine and the held-out evaluation
use."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from labsupport.course import models
from labsupport.rl import task


@dataclass
class Rollout:
    """Samples from the engine: ``n`` completions per prompt, with the engine's log-probability per
    token.

    ``completion_ids``/``logprobs``/``mask`` are [N, T] with N = len(prompts) * n (group members
    adjacent). ``version`` is the policy version that generated them (staleness = trainer version -
    version).
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


def left_pad(seqs: Sequence[Sequence[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids padded on the left to one width, and the attention mask (1 on real tokens): [N, W]
    each. Built as lists, then one tensor each: a copy per row costs a trainer's step milliseconds
    at 512 rows."""
    width = max(len(s) for s in seqs)
    ids = torch.tensor([[models.PAD_ID] * (width - len(s)) + list(s) for s in seqs],
                       dtype=torch.long)
    att = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], dtype=torch.long)
    return ids.to(device), att.to(device)


@torch.no_grad()
# compiled layers (grpo.compile_layers) would recompile at every length
@torch.compiler.set_stance("force_eager")
def sample(model, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int,
           temperature: float = 1.0, generator: torch.Generator
           | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode with a KV cache; returns (tokens, logprobs of the chosen tokens, mask) as [N, T].

    ``temperature=0`` is greedy. Log-probabilities are of the distribution actually sampled from.
    """
    device = next(model.parameters()).device
    ids, att = left_pad(prompt_ids, device)
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


def held_out_accuracy(model: torch.nn.Module, tok: Any = None) -> float:
    """The policy's greedy accuracy on the task's held-out prompts, scored by the task's reward: the
    one measure of learning that the capstone's loop and ``bench peer`` share."""
    tok, prompts = tok or models.build_tokenizer(), task.eval_prompts()
    toks, _, mask = sample(model, [tok(p)["input_ids"] for p in prompts], task.ANSWER_LEN, 0.0)
    texts = [tok.decode(t[m].tolist(), skip_special_tokens=True) for t, m in zip(toks, mask)]
    return sum(task.reward(t, p) for t, p in zip(texts, prompts)) / len(prompts)
