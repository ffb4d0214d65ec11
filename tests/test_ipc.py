"""labsupport.ipc: zero-copy handoff semantics, over shared memory (CPU) and CUDA IPC (gpu-marked).

Every cross-process test talks to a real spawned process through labsupport.course.peer.Peer; nothing is mocked.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
import time

import pytest
import torch

from labsupport import ipc, shm
from labsupport.core import buckets, handoff
from labsupport.core.devices import gpu_uuid
from labsupport.course.peer import Peer
from labsupport.experiments.sharing import _probe_peer, probe_in_peer
from labsupport.experiments import ipc_timing
from labsupport.ipc import IpcError


def _gpus() -> int:
    try:
        from labsupport.course import hardware

        return hardware.gpu_count()
    except ImportError:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(n: int):
    """The project's gpu(n) marker, plus a local skip so this file is safe without the conftest."""
    def wrap(fn):
        fn = pytest.mark.skipif(_gpus() < n, reason=f"needs {n} CUDA GPU(s), found {_gpus()}")(fn)
        return pytest.mark.gpu(n)(fn)
    return wrap


def _digest(t: torch.Tensor) -> tuple[str, tuple[int, ...], str]:
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return str(t.dtype), tuple(t.shape), hashlib.sha256(raw).hexdigest()


def _mixed_named(device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        ("embed.weight", torch.randn(17, 8, generator=g)),
        ("layer.bias", torch.randn(5, generator=g).to(torch.bfloat16)),
        ("layer.scale", torch.randn(3, 3, generator=g).to(torch.float16)),
        ("step", torch.tensor(41, dtype=torch.int64)),  # 0-dim
        ("mask", torch.tensor([True, False, True])),
        ("empty", torch.empty(0, 4)),
        ("big", torch.randn(1000, generator=g, dtype=torch.float64)),
    ] if device == "cpu" else [(n, t.to(device)) for n, t in _mixed_named("cpu")]


# ---- children (module level so that spawn can import them) -------------------------------

def _child_bucket(inbox, outbox):
    """Rebuild a bucket, report digests, write into one view, report again."""
    handle = inbox.get()
    views = ipc.rebuild(handle)
    outbox.put([(name, *_digest(v)) for name, v in views])
    name, value = inbox.get()
    dict(views)[name].fill_(value)
    if torch.cuda.is_available() and views[0][1].is_cuda:
        torch.cuda.synchronize()
    outbox.put("written")
    inbox.get()


def _child_exporter(inbox, outbox):
    """Export a tensor, hand out the handle, then wait to be killed (a crashing trainer)."""
    ex = ipc.Exporter()
    t = torch.full((16,), 3.0)
    outbox.put(ex.export_tensor(t))
    time.sleep(600)


def _child_count_fds(inbox, outbox):
    """A receiver fed a new exporter per update: rebuild, read, let go; report this process's open fds."""
    while (handle := inbox.get()) is not None:
        (_, t), = ipc.rebuild(handle)
        total = float(t.sum())
        del t
        outbox.put((total, len(os.listdir("/proc/self/fd"))))


def _child_ack(inbox, outbox):
    """A receiver that acks each handle it is sent (having read nothing)."""
    while (handle := inbox.get()) is not None:
        outbox.put(ipc.ack(handle))


def _child_ack_later(inbox, outbox):
    """A receiver that acks a second after it got the handle."""
    handle = inbox.get()
    time.sleep(1.0)
    outbox.put(ipc.ack(handle))


def _child_sleep(inbox, outbox):
    time.sleep(600)


def _child_fail(inbox, outbox):
    raise ValueError("boom in child")


# ---- CPU semantics over shared memory ----------------------------------------------------

@pytest.fixture
def exporter():
    ex = ipc.Exporter()
    yield ex
    ex.close()
    assert not [f for f in os.listdir(handoff.SHM_DIR) if f.startswith(ex.prefix)], "exporter left files behind"


@pytest.mark.timeout(120)
def test_zero_copy_both_ways_across_processes(exporter):
    owner = torch.nn.Parameter(torch.arange(1024, dtype=torch.float32))
    handle = exporter.export_tensor(owner)
    assert isinstance(owner, torch.nn.Parameter) and owner.requires_grad  # still the model's parameter
    with Peer(_probe_peer) as peer:
        first = peer.call(("read", handle))
        assert first["sum"] == float(torch.arange(1024).sum())
        with torch.no_grad():
            owner.mul_(2)  # owner writes after the receiver mapped it: no re-send
        assert peer.call(("read", handle))["sum"] == 2 * first["sum"]
        wrote = peer.call(("fill", handle, 7.0))  # receiver writes
        assert wrote["head"] == [7.0] * 4
        assert torch.equal(owner.detach(), torch.full((1024,), 7.0))
        peer.call(("drop", handle))


@pytest.mark.timeout(120)
def test_bucket_round_trip_exact_and_receiver_writes_land_in_owner_buffer(exporter):
    named = _mixed_named()
    handle = exporter.export_bucket(named)
    assert handle.names == [n for n, _ in named]
    assert handle.metas["layer.bias"] == ("bfloat16", (5,))
    with Peer(_child_bucket) as peer:
        got = peer.call(handle)
        assert got == [(n, *_digest(t)) for n, t in named]
        assert peer.call(("embed.weight", -1.5)) == "written"
        mine = dict(ipc.rebuild(handle))  # the owner's own view of the bucket
        assert torch.equal(mine["embed.weight"], torch.full((17, 8), -1.5))
        assert torch.equal(mine["big"], dict(named)["big"])  # neighbours untouched
        peer.send("bye")


def test_handles_pickle_and_in_process_views_share_memory(exporter):
    t = torch.zeros(8)
    h = exporter.export_tensor(t)
    b = exporter.export_bucket([("w", torch.ones(2, 3))])
    h2, b2 = pickle.loads(pickle.dumps(h)), pickle.loads(pickle.dumps(b))
    assert h2 == h and b2 == b
    ipc.rebuild(h2)[0][1][3] = 5.0
    assert t[3] == 5.0
    (name, w), = ipc.rebuild(b2)
    assert name == "w" and torch.equal(w, torch.ones(2, 3))


@pytest.mark.timeout(120)
def test_use_after_release_raises_ipc_error_and_frees(exporter):
    handle = exporter.export_bucket([("w", torch.ones(4096))])
    seg = handle.where[0]
    assert os.path.exists(seg) and exporter.live_bytes >= 4096 * 4
    with pytest.raises(IpcError, match="0 of 1 receiver process"):
        exporter.release(handle)  # no receiver has acked yet
    assert probe_in_peer(handle)["sum"] == 4096.0  # live: another process maps it, reads, drops and acks
    freed = exporter.release(handle)
    assert freed >= 4096 * 4 and exporter.live_bytes == 0
    assert not os.path.exists(seg)  # the shared segment's name is gone; pages go with the last mapping
    with pytest.raises(IpcError, match="released"):
        ipc.rebuild(handle)
    assert "released" in probe_in_peer(handle)["error"]  # same in another process
    with pytest.raises(IpcError, match="not live"):
        exporter.release(handle)


@pytest.mark.timeout(120)
def test_release_waits_for_an_ack_from_each_receiver_process(exporter):
    """The ack comes from the receiver's process, after its reads; the exporter only counts them."""
    handle = exporter.export_bucket([("w", torch.ones(1024))], receivers=2)
    with Peer(_child_ack) as first:
        assert first.call(handle) is True and first.call(handle) is True  # twice from one process: one ack
    assert exporter.acks(handle) == 1
    with pytest.raises(IpcError, match="1 of 2 receiver process"):
        exporter.release(handle)
    assert probe_in_peer(handle)["sum"] == 1024.0  # a second receiver reads, drops its views, acks
    assert exporter.acks(handle) == 2 and exporter.release(handle) >= 4096
    assert shm.acks(handle.guard) == []  # release removed the ack files
    with Peer(_child_ack) as late:
        assert late.call(handle) is False  # released: nothing to acknowledge, no file left behind
    assert shm.acks(handle.guard) == []


@pytest.mark.timeout(120)
def test_release_waits_for_late_acks_until_its_deadline(exporter):
    handle = exporter.export_bucket([("w", torch.ones(16))])
    t0 = time.monotonic()
    with pytest.raises(IpcError, match="0 of 1 receiver process\\(es\\) acked within 0.5 s"):
        exporter.release(handle, timeout_s=0.5)  # nobody acks: refused at the deadline, not before, not never
    assert 0.5 <= time.monotonic() - t0 < 5
    with Peer(_child_ack_later) as peer:
        peer.send(handle)
        assert exporter.release(handle, timeout_s=60) >= 64  # waited for the late ack
        assert peer.recv() is True


def test_the_hardened_handle_is_the_cores_handle_extended(exporter):
    named = _mixed_named()
    handle = exporter.export_bucket(named)
    assert isinstance(handle, handoff.Handle)  # one handle type: the core reads it as it is
    assert [(n, *_digest(v)) for n, v in handoff.rebuild(handle)] == [(n, *_digest(t)) for n, t in named]


def test_a_guard_that_fails_to_start_leaves_no_fd_and_no_file(monkeypatch, tmp_path):
    def fail(*args, **kwargs):
        raise OSError("mmap failed")

    monkeypatch.setattr(shm.mmap, "mmap", fail)
    path = str(tmp_path / "x.guard")
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match="mmap failed"):
        shm.GuardFile(path)
    assert len(os.listdir("/proc/self/fd")) == fds and not os.path.exists(path)


@pytest.mark.timeout(120)
def test_kept_memory_goes_once_its_engine_answers_a_later_call(exporter):
    """push_ipc keeps a bucket whose RPC timed out (the late call may still read it) under its engine; the
    engine's next answered call proves the late one ended (calls are served in order) and frees it; a call
    sent before the bucket was kept (a call in flight) frees nothing."""
    from types import SimpleNamespace

    from labsupport import vllm_ext

    core = object()  # (vllm_ext.owner: an engine's core client, however the engine is wrapped)
    in_flight = []

    def rpc(method, **kw):
        if in_flight:  # a call already sent when the bucket is kept: its answer proves nothing
            in_flight.pop()
            exporter.release(h2, force=True, keep=core)
        return [0]

    llm = SimpleNamespace(collective_rpc=rpc, engine_core=core)
    handle = exporter.export_bucket([("w", torch.ones(1 << 20))])
    h2 = exporter.export_bucket([("w", torch.ones(1 << 20))])
    exporter.release(handle, force=True, keep=vllm_ext.owner(SimpleNamespace(llm_engine=llm)))
    assert "released" in probe_in_peer(handle)["error"] and len(ipc.kept_by(core)) == 1
    in_flight.append(1)
    vllm_ext.call(llm, "anything")  # sent after the first was kept: frees it; the second is kept meanwhile
    assert [k.handle for k in ipc.kept_by(core)] == [h2]
    vllm_ext.call(llm, "anything")
    assert not ipc.kept_by(core)


def test_receiver_maps_instead_of_copying_cpu():
    n = 16 << 20  # 16 Mi float32 = 64 MiB
    with ipc.Exporter() as ex:
        handle = ex.export_bucket([("w", torch.ones(n))])
        seen = probe_in_peer(handle)
    assert seen["sum"] == n
    grew_private = seen["after"]["rss_anon"] - seen["before"]["rss_anon"]
    grew_shared = seen["after"]["rss_shmem"] - seen["before"]["rss_shmem"]
    assert grew_private < n * 4 // 4, f"receiver copied? private memory grew by {grew_private} B"
    assert grew_shared > n * 4 // 2, f"receiver should map the shared pages, RssShmem grew {grew_shared} B"


def test_update_bucket_and_copy_into_check_before_writing(exporter):
    named = [("a", torch.zeros(3)), ("b", torch.zeros(2, 2))]
    handle = exporter.export_bucket(named)
    receiver = ipc.Receiver()
    views = dict(receiver.bucket(handle))
    with pytest.raises(IpcError, match="b expected float32\\[2, 2\\]"):
        exporter.update_bucket(handle, [("a", torch.ones(3)), ("b", torch.ones(4))])
    assert torch.equal(views["a"], torch.zeros(3))  # nothing written
    exporter.update_bucket(handle, [("a", torch.ones(3)), ("b", torch.full((2, 2), 2.0))])
    assert torch.equal(views["a"], torch.ones(3))  # the mapped view sees the repack
    dest = {"a": torch.zeros(3), "b": torch.zeros(2, 3)}
    with pytest.raises(IpcError, match="destination has float32\\[2, 3\\]"):
        receiver.copy_into(handle, dest)
    assert torch.equal(dest["a"], torch.zeros(3))  # rejected before any write
    dest["b"] = torch.zeros(2, 2)
    assert receiver.copy_into(handle, dest) == handle.nbytes
    assert torch.equal(dest["b"], torch.full((2, 2), 2.0))
    dest["a"].fill_(9)
    assert torch.equal(views["a"], torch.ones(3))  # the inference copy is separate memory
    assert exporter.acks(handle) == 0
    receiver.drop()  # forgets the views and acks
    assert exporter.acks(handle) == 1
    exporter.release(handle)
    with pytest.raises(IpcError, match="released"):
        receiver.bucket(handle)


def test_bad_inputs_give_ipc_errors(exporter):
    with pytest.raises(IpcError, match="twice"):
        exporter.export_bucket([("x", torch.zeros(1)), ("x", torch.zeros(1))])
    with pytest.raises(IpcError, match="at least one"):
        exporter.export_bucket([])
    with pytest.raises(IpcError, match="receivers must be >= 1"):
        exporter.export_bucket([("x", torch.zeros(1))], receivers=0)
    with pytest.raises(IpcError, match="contiguous"):
        exporter.export_tensor(torch.zeros(4, 4).t())
    h = exporter.export_tensor(torch.zeros(4))
    buf, core = handoff.export([("x", torch.zeros(1))])  # the core's handle has no guard: not accepted here
    with pytest.raises(IpcError, match="ipc.Handle"):
        ipc.rebuild(core)
    del buf
    handoff.release(core)
    with pytest.raises(IpcError, match="another machine"):
        ipc.rebuild(dataclasses.replace(h, host="0000-other-host"))
    fake = "GPU-00000000-dead-beef-0000-000000000000"
    with pytest.raises(RuntimeError, match="cannot see"):
        handoff.local_index(fake)  # the one lookup of a GPU's local index
    with pytest.raises(IpcError, match="cannot see"):
        ipc.device_of(dataclasses.replace(h, gpu=fake))


@pytest.mark.timeout(120)
def test_unknown_gpu_uuid_in_another_process_is_an_error(exporter):
    h = exporter.export_tensor(torch.zeros(4))
    fake = dataclasses.replace(h, gpu="GPU-00000000-dead-beef-0000-000000000000")
    out = probe_in_peer(fake)
    assert "cannot see" in out["error"] and "00000000-dead-beef" in out["error"]


@pytest.mark.timeout(120)
def test_crashed_exporter_is_detected_not_a_crash():
    with Peer(_child_exporter) as peer:
        handle = peer.recv()
        assert ipc.rebuild(handle)[0][1].sum() == 48.0  # alive: maps fine
        # what torch and the CUDA driver leave for a process that shared CUDA memory (made here by hand)
        theirs = [os.path.join(handoff.SHM_DIR, f) for f in (f"torch_{handle.pid}_77_0", f"cuda.shm.0.{handle.pid:x}.1")]
        for f in theirs:
            open(f, "w").close()
        assert shm.sweep_stale(min_age_s=0, only=handle.guard) == []  # alive: never swept
        peer.proc.kill()
        peer.proc.join(10)
    try:
        with pytest.raises(IpcError, match="exited"):
            ipc.rebuild(handle)
    finally:  # a killed exporter cannot clean up: the receiver that finds its lock free removes its files
        removed = shm.sweep_stale(min_age_s=0, only=handle.guard)
        left = [f for f in [handle.guard, handle.where[0], *theirs] if os.path.exists(f)]
        for f in theirs:
            shm.unlink(f)
    assert removed == [] and left == []
    with pytest.raises(IpcError, match="closed or exited"):
        ipc.rebuild(handle)


@pytest.mark.timeout(120)
def test_a_mapping_whose_exporter_died_is_refused():
    receiver, dest = ipc.Receiver(), {"tensor": torch.zeros(16)}
    with Peer(_child_exporter) as peer:
        handle = peer.recv()
        assert receiver.copy_into(handle, dest) == 64 and torch.equal(dest["tensor"], torch.full((16,), 3.0))
        peer.proc.kill()
        peer.proc.join(10)
    try:
        with pytest.raises(IpcError, match="exited"):
            receiver.copy_into(handle, dest)  # the mapping is kept, but its exporter is gone
        receiver.drop()  # nothing to ack any more, and no error for it
    finally:
        shm.sweep_stale(min_age_s=0, only=handle.guard)


@pytest.mark.timeout(120)
def test_receiver_fds_do_not_grow_with_the_number_of_exporters():
    """A guard cached per exporter must not outlive its exporter in the receiver (one fd leaked per update)."""
    fds = []
    with Peer(_child_count_fds) as peer:
        for i in range(12):
            with ipc.Exporter() as ex:
                total, n = peer.call(ex.export_tensor(torch.full((256,), float(i))))
            assert total == 256.0 * i
            fds.append(n)
    assert fds[2:] == [fds[2]] * 10, f"open fds in the receiver after each update: {fds}"


@pytest.mark.timeout(120)
def test_probe_peer_tells_apart_exporters_whose_serials_match():
    """Serials restart in each Exporter: a receiver keyed by serial alone would hand back the first one's views."""
    with ipc.Exporter() as ex1, ipc.Exporter() as ex2, Peer(_probe_peer) as peer:
        h1, h2 = ex1.export_tensor(torch.full((64,), 1.0)), ex2.export_tensor(torch.full((64,), 2.0))
        assert h1.serial == h2.serial
        assert peer.call(("read", h1))["sum"] == 64.0
        assert peer.call(("read", h2))["sum"] == 128.0
        assert peer.call(("fill", h2, 3.0))["sum"] == 192.0
        assert peer.call(("read", h1))["sum"] == 64.0  # h1's view is untouched, and still its own
        peer.call(("drop", h1)), peer.call(("drop", h2))


@pytest.mark.timeout(60)
def test_peer_never_hangs():
    peer = Peer(_child_sleep)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        peer.recv(timeout_s=1.0)
    assert time.monotonic() - t0 < 10
    peer.close(timeout_s=0.5)  # a stuck peer is killed
    assert not peer.proc.is_alive()
    with Peer(_child_fail) as peer:
        with pytest.raises(RuntimeError, match="boom in child"):
            peer.recv(timeout_s=60)


def test_one_process_is_its_own_receiver(exporter):
    t = torch.arange(6.0)
    h = exporter.export_tensor(t)
    assert torch.equal(ipc.rebuild(h)[0][1], t)
    b = exporter.export_bucket([("t", t)])
    assert ipc.ack(b) is True and exporter.release(b) > 0  # this process is the receiver here
    assert ipc.ack(h) is True and exporter.release(h) == t.nbytes
    with pytest.raises(IpcError):
        ipc.rebuild(h)


def test_model_state_is_realistic_and_sized():
    state = ipc_timing.model_state(20_000_000, "cpu")
    total = sum(t.nbytes for _, t in state)
    assert 20e6 <= total < 26e6
    names = [n for n, _ in state]
    assert names[0] == "model.embed_tokens.weight" and names[-1] == "lm_head.weight"
    assert all(t.dtype == torch.bfloat16 for _, t in state)
    split = buckets.split([buckets.meta(n, t) for n, t in state], 4 << 20)
    assert [m[0] for g in split for m in g] == names


# ---- GPU: the real mechanism (run on a GPU machine: pytest -m gpu tests/test_ipc.py) -----------

@needs_gpus(1)
@pytest.mark.timeout(180)
def test_cuda_zero_copy_both_ways():
    with ipc.Exporter() as ex:
        owner = torch.full((1 << 20,), 2.0, device="cuda:0")  # sums stay exact in float32
        handle = ex.export_tensor(owner)
        assert handle.gpu == gpu_uuid(0)
        with Peer(_probe_peer) as peer:
            first = peer.call(("read", handle))
            assert first["uuid"] == gpu_uuid(0)
            assert first["sum"] == 2.0 * (1 << 20)
            owner.mul_(2)
            torch.cuda.synchronize()
            assert peer.call(("read", handle))["sum"] == 2 * first["sum"]
            peer.call(("fill", handle, 7.0))
            torch.cuda.synchronize()
            assert bool((owner == 7).all())
            peer.call(("drop", handle))
        assert ex.acks(handle) == 1  # the peer acked after its last read


@needs_gpus(1)
@pytest.mark.timeout(180)
def test_cuda_bucket_exact_and_receiver_memory_does_not_grow():
    size = 1 << 30  # 1 GiB bucket
    with ipc.Exporter() as ex:
        named = _mixed_named("cuda:0") + [("weights", torch.ones(size // 2, dtype=torch.bfloat16, device="cuda:0"))]
        handle = ex.export_bucket(named)
        with Peer(_child_bucket) as peer:
            assert peer.call(handle) == [(n, *_digest(t)) for n, t in named]
            peer.call(("layer.bias", 3.0))
            torch.cuda.synchronize()
            assert bool((dict(ipc.rebuild(handle))["layer.bias"] == 3).all())
            peer.send("bye")
        seen = probe_in_peer(handle)
        assert seen["after"]["allocated"] == seen["before"]["allocated"]  # no allocation in the receiver
        drop = seen["before"]["device_free"] - seen["after"]["device_free"]
        assert drop < size // 8, f"device free memory dropped {drop >> 20} MiB while mapping a 1 GiB bucket"


@needs_gpus(1)
@pytest.mark.timeout(180)
def test_cuda_release_frees_memory_and_kills_the_handle():
    torch.cuda.synchronize()
    with ipc.Exporter() as ex:
        a0 = torch.cuda.memory_allocated(0)
        handle = ex.export_bucket([("w", torch.zeros(256 << 20, dtype=torch.uint8, device="cuda:0"))])
        a1 = torch.cuda.memory_allocated(0)
        assert a1 - a0 >= 256 << 20  # the packed bucket
        assert probe_in_peer(handle)["sum"] == 0.0  # receiver maps, reads, drops its views, acks
        freed = ex.release(handle)
        torch.cuda.synchronize()
        a2 = torch.cuda.memory_allocated(0)
        assert freed >= 256 << 20 and a2 <= a0, f"allocated {a0} -> {a1} -> {a2} bytes"
        out = probe_in_peer(handle)
        assert "released" in out["error"]


@needs_gpus(1)
@pytest.mark.timeout(180)
def test_cuda_forced_release_of_a_handle_nobody_opened_frees_it_and_torchs_count_file():
    """Torch's CUDA IPC count expects one receiver's release per share: unreturned, the block and its
    ``/dev/shm/torch_<pid>_*`` file would stay until this process exits (the fault table's stale_handle)."""
    mine = lambda: {f for f in os.listdir(handoff.SHM_DIR) if f.startswith(f"torch_{os.getpid()}_")}
    torch.cuda.synchronize()
    torch.cuda.ipc_collect()
    before, a0 = mine(), torch.cuda.memory_allocated(0)
    with ipc.Exporter() as ex:
        handle = ex.export_bucket([("w", torch.ones(8 << 20, dtype=torch.uint8, device="cuda:0"))])
        ex.release(handle, force=True)
        assert torch.cuda.memory_allocated(0) <= a0, "the released bucket is still allocated (torch's IPC limbo)"
    assert mine() <= before, f"torch's ref-count file(s) {sorted(mine() - before)} outlive the release"


@needs_gpus(1)
@pytest.mark.timeout(180)
def test_cuda_release_keep_kills_the_handle_but_keeps_its_memory_until_its_owner_answers():
    """After a receiver's call timed out it may have opened the handle and still read, without having acked:
    release(force=True, keep=owner) refuses any later open, but keeps the block allocated (a forced release gives
    torch's IPC count back, and the reader's drop would give it back again: the block freed under the reader),
    until free_kept: then the block and torch's count file go (the fault table's hung_rpc_ipc left both)."""
    mine = lambda: {f for f in os.listdir(handoff.SHM_DIR) if f.startswith(f"torch_{os.getpid()}_")}
    torch.cuda.synchronize()
    torch.cuda.ipc_collect()
    before, owner = mine(), object()
    with ipc.Exporter() as ex:
        a0 = torch.cuda.memory_allocated(0)
        handle = ex.export_bucket([("w", torch.ones(64 << 20, dtype=torch.uint8, device="cuda:0"))])
        ex.release(handle, force=True, keep=owner)
        assert "released" in probe_in_peer(handle)["error"]
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated(0) >= a0 + (64 << 20) and len(ipc.kept_by(owner)) == 1
    assert ipc.free_kept(ipc.kept_by(owner)) >= 64 << 20 and not ipc.kept_by(owner)
    assert torch.cuda.memory_allocated(0) <= a0 and mine() <= before


@needs_gpus(1)
@pytest.mark.timeout(180)
def test_cuda_receiver_drop_waits_on_the_handles_gpu(monkeypatch):
    """drop() waits for the copies on the GPU of each handle it mapped, not on whichever device is current."""
    synced = []
    real = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: (synced.append(device), real(device))[1])
    last = torch.cuda.device_count() - 1
    with ipc.Exporter() as ex:
        handle = ex.export_bucket([("w", torch.ones(1024, device=f"cuda:{last}"))])
        receiver, dest = ipc.Receiver(), {"w": torch.zeros(1024, device=f"cuda:{last}")}
        receiver.copy_into(handle, dest)
        synced.clear()
        with torch.cuda.device(0):
            receiver.drop()
        assert synced and all(d is not None and torch.device(d) == torch.device("cuda", last) for d in synced)
        assert bool((dest["w"] == 1).all()) and ex.acks(handle) == 1


@needs_gpus(2)
@pytest.mark.timeout(180)
def test_cuda_remap_reordered_visible_devices():
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = vis.split(",") if vis else [str(i) for i in range(torch.cuda.device_count())]
    with ipc.Exporter() as ex:
        t = torch.arange(4096, dtype=torch.float32, device="cuda:1") * 3
        handle = ex.export_tensor(t, receivers=2)
        assert handle.gpu == gpu_uuid(1)
        swapped = probe_in_peer(handle, env={"CUDA_VISIBLE_DEVICES": f"{ids[1]},{ids[0]}"}, fill=5.0)
        assert swapped["visible"] == f"{ids[1]},{ids[0]}"
        assert swapped["device"] == "cuda:0"  # physical GPU 1 is local index 0 over there
        assert swapped["uuid"] == gpu_uuid(1)
        torch.cuda.synchronize()
        assert bool((t == 5).all())  # and it wrote our memory, not a copy
        hidden = probe_in_peer(handle, env={"CUDA_VISIBLE_DEVICES": ids[0]})
        assert "cannot see" in hidden["error"]
        assert ex.acks(handle) == 1  # only the receiver that could map it acked; close() forces the release


def test_time_update_vs_copy_leaves_the_exported_bytes(exporter):
    state = ipc_timing.model_state(2_000_000, "cpu")
    handles = exporter.export_buckets(state, 512 << 10)
    assert len(handles) > 1 and sum(len(h.entries) for h in handles) == len(state)
    dest = {n: torch.zeros_like(t) for n, t in state}
    out = ipc_timing.time_update_vs_copy(handles, dest, rounds=2)
    assert out["bytes"] == sum(t.nbytes for _, t in state)
    assert all(len(out[k]) == 2 and min(out[k]) > 0 for k in ("ipc_s", "d2d_s", "flat_s"))
    assert all(torch.equal(dest[n], t) for n, t in state)


@pytest.mark.timeout(180)
def test_bench_runs_end_to_end_on_the_stand_in(capsys):
    """The benchmark's two-process protocol (the GPU run uses the same code) at a tiny size."""
    from labsupport.bench import ipc as ipc_bench  # (this test is of the benchmark itself)

    assert ipc_bench.main(["--device", "cpu", "--gb", "0.01", "--bucket-mb", "4", "--rounds", "1", "--no-save"]) == 0
    out = capsys.readouterr().out
    assert "bytes equal after update: True" in out
    assert "rebuild after release: IpcError" in out
