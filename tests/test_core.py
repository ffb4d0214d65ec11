"""labsupport.core, the short path of each mechanism: real processes, real bytes, no mocks.

sync: two processes over gloo, bytes equal after a broadcast. handoff: a spawned process rebuilds a shared-memory
handle, loads it, and writes through it; the owner sees the write. timeline: phases and bytes by role recorded.
The gpu-marked tests run the same over NCCL and CUDA IPC.
"""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

from labsupport.course.ranks import run_ranks
from labsupport.core import buckets, handoff, sync, timeline
from labsupport.groups import create_group, free_port
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
