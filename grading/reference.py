"""The reference implementation of each assignment: where the course's own code for it lives, one line each.

The grader's ``IMPL=reference`` grades these; ``make student-repo`` replaces their bodies (found from here, in
whatever module they live) with calls to the learner's ``assignments/``. When a reference function moves, adapt
its line here; the assignment's signature must stay the reference's, so that the same tests grade both.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable

import torch

from labsupport import vllm_ext
from labsupport.core import buckets, colocated, handoff, sync, timeline
from labsupport.rl import grpo


def colocated_step(llm: Any, model: torch.nn.Module, train: Callable[[torch.nn.Module], Any], *,
                   level: int = 1) -> None:
    """Assignment 5's reference: ``core.colocated``'s turn (sleep, train, wake the weights, update, wake the KV
    cache, reset the prefix cache), its update through ``vllm_ext.push_ipc`` (checked, whole layers, acked)."""
    colocated.colocated_step(llm, model, train, level=level, push=vllm_ext.push_ipc)


a1 = timeline
a2 = buckets
a3 = sync
a4 = handoff
a5 = SimpleNamespace(colocated_step=colocated_step)
a6 = SimpleNamespace(group_advantages=grpo.group_advantages, grpo_loss=grpo.grpo_loss,
                     tis_weights=grpo.tis_weights, mis_mask=grpo.mis_mask)
