"""The co-located weight path: the trainer's weights in one exported bucket, in the engine's dtype,
and the engine ops that bring them into an engine on the same device every step (Chapters 3 and 5),
with each mechanism a switch.

- ``update="mapped"`` (default): the engine maps the bucket once (``fast_update``'s
  ``map_trainer_weights``: checked, loaded once, the copy plan made and verified); then every step
  the trainer refreshes the bucket in place (one grouped cast-copy of its float32 weights, nothing
  allocated) and the engine runs one RPC of device copies (``sync_mapped_weights``).
  ``update="ipc"``: every step the trainer repacks the bucket (names, dtypes and shapes checked) and
  the engine opens the handle, checks it and loads it through vLLM's layerwise reload
  (``update_weights_from_ipc``): the safe path, as TRL loads its weights (``load_weights`` per
  parameter).
- ``sleep_level`` (vLLM's): 0 keeps the engine awake between generations (its weights and KV cache
  stay resident: the fastest, where both fit); 1 copies the weights to host memory and discards the
  KV cache; 2 discards both, so the update after the wake refills the weights. Asleep, a step's
  engine ops are: wake the weights, update them, wake the KV cache, generate, sleep.

``CONFIGS`` names the switch settings that the capstone's command line and ``bench peer`` compare
(``"fast"``: the defaults; ``"fastest"``: the defaults with the trainer's scoring passes compiled
and replayed as CUDA graphs; ``"safe"``: the capstone set up as TRL sets itself up, the safe reload
path and sleep level 2). With the engine core inline (``"inline"``) the trainer compiles without
CUDA graphs: see :func:`trainer_graphs`.
"""

from __future__ import annotations

from typing import Any

import torch

from labsupport.core.colocated import in_dtype
from labsupport.fast_update import SharedWeights

UPDATES = ("mapped", "ipc")
SLEEP_LEVELS = (0, 1, 2)

# One name per switch setting (RLConfig fields); a configuration joins names with "+", e.g.
# "sleep2+no-graphs".
CONFIGS: dict[str, dict[str, Any]] = {
    # the defaults: mapped update, engine awake, CUDA graphs, offload only where memory needs it
    "fast": {},
    # as TRL's colocate mode with sleep: reload path, level 2
    "safe": {"update": "ipc", "sleep_level": 2},
    "mapped": {"update": "mapped"}, "ipc": {"update": "ipc"},
    "sleep0": {"sleep_level": 0}, "sleep1": {"sleep_level": 1}, "sleep2": {"sleep_level": 2},
    "graphs": {"cuda_graphs": True}, "no-graphs": {"cuda_graphs": False},
    "offload": {"offload": "on"}, "no-offload": {"offload": "off"},
    # vLLM's engine core in the trainer's process, as TRL's colocate mode runs it
    "inline": {"inline_engine": True},
    "compile": {"compile": True}, "no-compile": {"compile": False},
    # the fastest on one GPU (results/bench_soak.*.json): the defaults with the trainer's passes
    # compiled, and the engine core in its own process, so that the trainer's CUDA graphs may replay
    # too (trainer_graphs)
    "fastest": {"compile": True},
    "fp32": {"precision": "fp32"}, "bf16": {"precision": "bf16"},
}


def config_overrides(name: str) -> dict[str, Any]:
    """The RLConfig fields of configuration ``name`` ("fast", or ``CONFIGS`` names joined by +)."""
    out: dict[str, Any] = {}
    for part in name.split("+"):
        if part not in CONFIGS:
            raise ValueError(f"unknown capstone configuration {part!r} in {name!r}; known: "
                             f"{', '.join(CONFIGS)}")
        out.update(CONFIGS[part])
    return out


def trainer_graphs(arch: str, engine: str, cfg: Any) -> bool:
    """Whether the trainer's compiled passes may also replay as CUDA graphs (``cfg.compile`` on a
    GPU): not beside an engine whose own CUDA graphs live in this process (co-located vLLM with
    ``inline_engine`` and ``cuda_graphs``). Torch's CUDA-graph trees free the process's cuBLAS
    workspaces around every recording (``torch._inductor.cudagraph_trees.clear_cublass_cache``) and
    each recording empties the allocator's cache (``torch.cuda.graph``); a vLLM graph captured over
    the old workspace then replays into freed memory: an illegal memory access once the memory has
    gone back to the driver, another tensor's bytes overwritten before. (This was the ``fastest``
    configuration's crash on fresh machines; ``tools/repro_cublas_workspace.py``.)"""
    in_process = arch == "colocated" and engine == "vllm" and cfg.inline_engine and cfg.cuda_graphs
    return not in_process


class ColocatedWeights:
    """The trainer's end of the co-located weight path (module docstring) and a step's engine ops.

    ``model``: the trainer's model (its float32 weights); ``dtype``: the engine's (bfloat16 for vLLM
    on a GPU). The bucket is exported once, here; :meth:`close` releases it (after the engine has
    unmapped it)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, update: str = "mapped",
                 sleep_level: int = 0) -> None:
        if update not in UPDATES:
            raise ValueError(f"update must be one of {UPDATES}, got {update!r}")
        if sleep_level not in SLEEP_LEVELS:
            raise ValueError(f"sleep_level must be one of {SLEEP_LEVELS}, got {sleep_level!r}")
        self.update, self.sleep_level, self.dtype = update, sleep_level, dtype
        self.bucket = SharedWeights(model, dtype=dtype)  # bucket, views and checks: one home

    def connect_ops(self) -> list[dict[str, Any]]:
        """Before the first step: the engine maps the bucket (mapped), then sleeps (if it does)."""
        ops = ([{"op": "map", "handle": self.bucket.handle, "step": -1}]
               if self.update == "mapped" else [])
        return ops + self.after_generate(-1)

    def before_generate(self, step: int) -> list[dict[str, Any]]:
        """The engine's ops before it generates: the update (asleep: between waking weights and KV
        cache)."""
        update = ({"op": "update", "step": step} if self.update == "mapped"
                  else {"op": "load_ipc", "handle": self.bucket.handle, "step": step})
        if not self.sleep_level:
            return [update]
        return [{"op": "wake", "tags": ["weights"], "step": step}, update,
                {"op": "wake", "tags": ["kv_cache"], "step": step}]

    def after_generate(self, step: int) -> list[dict[str, Any]]:
        return ([{"op": "sleep", "level": self.sleep_level, "step": step}] if self.sleep_level
                else [])

    @torch.no_grad()
    def refresh(self, model: torch.nn.Module) -> None:
        """Trainer side, after its optimizer step: the new weights into the exported bucket, then
        wait for the copies (the engine reads the bucket next). Mapped: ``SharedWeights.refresh``
        (one grouped cast-copy into the bucket's views, after checking that the model still has the
        parameters it was exported with). IPC: ``Exporter.update_bucket`` (checked, packed)."""
        if self.update == "ipc":
            self.bucket.exporter.update_bucket(self.bucket.handle, in_dtype(model, self.dtype))
            return
        self.bucket.refresh(model)

    def close(self) -> None:
        """Release the bucket (the engine unmapped it on closing; any other mapping is forced)."""
        self.bucket.close()
