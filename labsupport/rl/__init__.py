"""The capstone: a small, real GRPO loop, run in three orchestrations with the same learning code.

Task ("count backwards"): the prompt is two letters and a bar; the answer is the three letters
before the second one, nearest first ("qk|" -> "jih", wrapping "xb|" -> "azy"). The reward is a
rule: 1 if the first three generated characters are exactly right, else 0. 64 of the 676 prompts are
held out from RL and only used to evaluate (every letter still appears in RL prompts, beside other
first letters: the held-out set tests that the policy learned the rule rather than memorised
prompts, not that it generalises to new letters).

Warm start (honest note): in our trials, RL from a random model of the "tiny" size (0.3M parameters)
learned none of the toy tasks we tried (maximum of digits, one-digit addition, copying) in minutes:
the policy collapses onto one constant answer first. So the model is first *pre-trained* on alphabet
runs after a separator ("qk>lmno..." always forwards, "qk<jihg..." always backwards, "qk|..."
backwards only 10% of the time): plain next-token text, with no question, answer or reward. It has
seen backward runs after the bar, yet greedy decoding after the bar always goes forward: held-out
accuracy starts at 0. GRPO must turn the rare behaviour into the default. This mirrors a common view
of RLHF: it mostly changes which of a model's behaviours comes out, not what the model knows.

Orchestrations (:func:`~labsupport.rl.loop.run`): ``colocated`` (engine and trainer on one device;
the engine gets the trainer's weights through an IPC / shared-memory bucket, mapped once and copied
by plan each step or reloaded through the safe path, and may sleep while the trainer runs:
:mod:`~labsupport.rl.colocated`), ``disaggregated`` (engine on its own device and process; bucketed
broadcast after each step) and ``async`` (the engine generates the batch of step k+1 while the
trainer trains on step k; samples are one policy version stale and GRPO's ratio against the engine's
own log-probabilities corrects for it). ``python -m labsupport rl -h``.

Reading order, one job per module:

1. :mod:`~labsupport.rl.task`: the prompts, the rule (``answer_of``), the reward, the held-out
   prompts.
2. :mod:`~labsupport.rl.policy`: model sizes and the memory they need, the warm start, loading the
   policy.
3. :mod:`~labsupport.rl.rollout`: what an engine returns (``Rollout``) and the KV-cached sampler.
4. :mod:`~labsupport.rl.engines`: the two inference engines, transformers (``HFEngine``) and vLLM
   (``VllmEngine``).
5. :mod:`~labsupport.rl.grpo`: advantages, the loss (with TIS/MIS weights), ``token_logprobs``,
   ``GRPOTrainer``.
6. :mod:`~labsupport.rl.spans`: where the time goes: spans per lane and phase, and the per-step
   breakdown.
7. :mod:`~labsupport.rl.engine_process`: an engine driven by messages, in its own process or in the
   caller's.
8. :mod:`~labsupport.rl.colocated`: the co-located weight path and its switches (mapped or safe
   update, sleep level).
9. :mod:`~labsupport.rl.devices`: which devices trainer and engine use; why two NCCL ranks cannot
   share a GPU.
10. :mod:`~labsupport.rl.config`: ``RLConfig``, the checks and memory plan before a run, starting
    its engine.
11. :mod:`~labsupport.rl.loop`: ``run``, the loop in its three orchestrations.
12. :mod:`~labsupport.rl.report`: plots, summary, peak memory and the table.
13. :mod:`~labsupport.rl.cli`: ``python -m labsupport rl``.

This package exports what running and reading the loop takes (``run``, ``RLConfig``, ``ARCHS`` and
the report); everything else is used from its module (``from labsupport.rl import task, grpo``, then
``task.reward(...)``).
"""

from __future__ import annotations

from labsupport.rl.config import ARCHS, RLConfig
from labsupport.rl.loop import run
from labsupport.rl.report import (peak_memory, plot_breakdown, plot_curves, plot_timelines,
                                  runs_table, sleep_peaks, summary)

__all__ = ["ARCHS", "RLConfig", "run", "peak_memory", "plot_breakdown", "plot_curves",
           "plot_timelines", "runs_table", "sleep_peaks", "summary"]
