"""What a run is set to, and what that decides before anything starts: :class:`RLConfig`
(hyper-parameters and the co-located mechanisms' switches), the checks of the arguments and of the
GPU's free memory with the memory plan they give (:func:`check_run`: whether Adam's moments must
leave the GPU while the engine works), and the engine, started with those switches
(:func:`start_engine`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from labsupport.course import hardware
from labsupport.rl.devices import pick_devices
from labsupport.rl.engine_process import EngineProcess, LocalEngine
from labsupport.rl.engines import VllmEngine
from labsupport.rl.policy import SIZES, check_size, plan_offload
from labsupport.rl.spans import SpanLog

ARCHS = ("colocated", "disaggregated", "async")


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
    # steps recorded in the trainer's memory timeline (enough to see the pattern)
    memory_steps: int = 4
    # the trainer's: "fp32", or "bf16" (autocast over float32 master weights; grpo)
    precision: str = "fp32"
    # Co-located: the mechanisms, each a switch (rl.colocated; its CONFIGS names settings of them).
    # The defaults are the fastest correct ones on one GPU where trainer and engine fit side by
    # side. "mapped": bucket mapped once, one RPC of copies a step; "ipc": checked reload each step
    update: str = "mapped"
    # the engine between generations: 0 awake, 1 weights to host, 2 weights discarded
    sleep_level: int = 0
    # Adam's moments to host while the engine works: "auto" (only if memory needs it), on, off
    offload: str = "auto"
    # vLLM on a GPU: compile and capture CUDA graphs (False: enforce_eager)
    cuda_graphs: bool = True
    # vLLM's engine core in the trainer's process (as TRL's colocate mode runs it)
    inline_engine: bool = False
    # the trainer's scoring forward passes through torch.compile (grpo.GRPOTrainer)
    compile: bool = False
    # vLLM's share of the GPU's memory (None: the size's budget, rl.SIZES)
    engine_share: float | None = None


def engine_bytes(cfg: RLConfig, size: str, edev: str) -> float | None:
    """The engine's budget on a GPU: ``cfg.engine_share`` of it, else the size's (None: VllmEngine's
    default)."""
    if cfg.engine_share is not None and edev.startswith("cuda"):
        return cfg.engine_share * torch.cuda.get_device_properties(torch.device(edev)).total_memory
    return None if size == "tiny" else SIZES[size]["engine_bytes"]


def check_run(arch: str, engine: str, size: str, cfg: RLConfig,
              devices: tuple[str, str] | None) -> tuple[str, str, bool]:
    """Check the arguments (and on a GPU the free memory) before anything is built; the two devices,
    and whether the co-located trainer offloads Adam's moments while the engine works
    (``policy.plan_offload``)."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if engine not in ("transformers", "vllm"):
        raise ValueError(f"engine must be 'transformers' or 'vllm', got {engine!r}")
    if engine == "vllm":
        hardware.require("vllm", what='rl.run(engine="vllm")')
    tdev, edev = devices or pick_devices(arch)
    if not tdev.startswith("cuda"):
        check_size(size)
        return tdev, edev, False
    # a clear error now, not an out-of-memory traceback halfway through a phase
    free = torch.cuda.mem_get_info(torch.device(tdev))[0]
    offload = plan_offload(size, free, cfg.prompts_per_step * cfg.group_size, cfg.sleep_level,
                           cfg.offload, engine_bytes(cfg, size, edev))
    return tdev, edev, offload and arch == "colocated"


def start_engine(arch: str, engine: str, cfg: RLConfig, model_dir: Any, edev: str, size: str,
                 spans: SpanLog) -> EngineProcess | LocalEngine:
    """Co-located vLLM: in this process (weights through IPC handles), with the configured
    mechanisms; otherwise an engine process of its own: vLLM there takes a step's samples in one
    batch, the same memory budget and CUDA graphs (``cuda_graphs``) as co-located, and never sleeps
    (it has its GPU to itself)."""
    opts = {"max_num_seqs": cfg.prompts_per_step * cfg.group_size, "gpu_bytes": engine_bytes(cfg,
                                                                                             size,
                                                                                             edev),
            "cuda_graphs": cfg.cuda_graphs}
    if engine == "vllm" and arch == "colocated":
        eng = VllmEngine(model_dir, edev, seed=cfg.seed, sleep_mode=cfg.sleep_level > 0,
                         inline=cfg.inline_engine, **opts)
        return LocalEngine(eng, spans)
    return EngineProcess(model_dir, edev, spans, seed=cfg.seed, threads=cfg.threads, engine=engine,
                         opts={**opts, "sleep_mode": False} if engine == "vllm" else None)
