"""Assignment 4 (assignments/a4_handoff.py): an IPC handoff: export, rebuild by GPU UUID, load, release.

The owner is this process; the receiver is a second process (spawned) that rebuilds the handle, loads it into
tensors of its own and writes through a view. On the CPU the handle is a shared-memory file, and a remapped
``CUDA_VISIBLE_DEVICES`` is simulated (this process "sees" three GPUs in another order than the owner); on a
GPU it is real CUDA IPC, and on two GPUs the receiver sees them in the reverse order.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import traceback
import types

import pytest
import torch

from grading.support import child_failure, mixed_state, sha


def _receiver(inbox, outbox) -> None:
    """The receiving process: rebuild, load into its own tensors, write through a view, drop, on request."""
    from grading.impl import load

    views, streams = None, {}
    while (msg := inbox.get()) is not None:
        op, name, key, arg = msg
        try:
            impl = load(name, key)
            if op == "warm":  # CUDA started here (a context and a stream on each GPU): later reads are immediate
                for i in range(torch.cuda.device_count()):
                    streams[i] = torch.cuda.Stream(i)
                    torch.zeros(1, device=f"cuda:{i}").add_(1).cpu()
                outbox.put("warm")
            elif op == "take":  # rebuild and load into tensors of its own
                views = impl.rebuild(arg)
                own = {n: torch.zeros_like(v) for n, v in views}
                nbytes = impl.load(own, views)
                outbox.put({"own": {n: sha(t) for n, t in own.items()}, "bytes": nbytes})
            elif op == "peek":  # rebuild and read at once, on a stream of its own, as an engine that loads would
                views = impl.rebuild(arg)
                dev = views[0][1].device
                if dev.type == "cuda" and dev.index not in streams:
                    streams[dev.index] = torch.cuda.Stream(dev)
                stream = streams.get(dev.index) if dev.type == "cuda" else None
                with torch.cuda.stream(stream) if stream else contextlib.nullcontext():
                    outbox.put({n: sha(v) for n, v in views})
            elif op == "write":
                dict(views)[arg[0]].fill_(arg[1])
                if views[0][1].is_cuda:
                    torch.cuda.synchronize()
                outbox.put("written")
            elif op == "drop":
                views = None
                outbox.put("dropped")
        except BaseException as exc:  # reported to the test, which raises it there
            views = None
            outbox.put(("failed", (type(exc).__name__, str(exc), traceback.format_exc())))


def ask(peer, msg, timeout_s: float = 60.0):
    out = peer.call(msg, timeout_s)
    if isinstance(out, tuple) and out[:1] == ("failed",):
        raise child_failure("the receiving process", out[1])
    return out


def owner_view(buf: torch.Tensor, handle, name: str) -> torch.Tensor:
    """The owner's own view of tensor ``name`` in its exported buffer (read from the handle's entries)."""
    _, dtype, shape, off, n = next(e for e in handle.entries if e[0] == name)
    return buf[off:off + n].view(getattr(torch, dtype)).view(shape)


@functools.lru_cache(maxsize=None)
def handoff(name: str, key: str) -> dict:
    """One CPU handoff, observed: what the receiver loaded, what the owner saw of its write, and the file."""
    from grading.impl import load
    from labsupport.course.peer import Peer

    impl = load(name, key)
    state = mixed_state(3)
    out: dict = {}
    buf, handle = impl.export(list(state.items()))  # (a stub fails here, before a process is started)
    path = handle.where[0] if handle.gpu is None else None
    try:
        with Peer(_receiver) as peer:
            out["take"] = ask(peer, ("take", name, key, handle))
            ask(peer, ("write", name, key, ("big", 7.0)))
            out["owner_sees"] = bool((owner_view(buf, handle, "big") == 7.0).all())
            ask(peer, ("drop", name, key, None))
        del buf
        impl.release(handle)
        out["file_left"] = path is not None and os.path.exists(path)
    except Exception as exc:  # kept: each test reports it
        out["error"] = exc
    finally:
        if path and os.path.exists(path):
            os.unlink(path)
    out["state"] = {n: sha(t) for n, t in state.items()}
    out["bytes"] = sum(t.numel() * t.element_size() for t in state.values())
    return out


def observed(impl, what: str):
    out = handoff(impl.name, impl.key)
    if what not in out and "error" in out:
        raise out["error"]
    return out[what]


@pytest.mark.points(4)
def test_receiver_loads_every_byte(impl):
    got, want = observed(impl, "take"), handoff(impl.name, impl.key)
    wrong = sorted(n for n in want["state"] if got["own"].get(n) != want["state"][n])
    assert not wrong, f"expected the receiver's own tensors to hold the owner's bytes; these differ: {wrong}"
    assert got["bytes"] == want["bytes"], f"expected load to return {want['bytes']} bytes, got {got['bytes']}"


@pytest.mark.points(3)
def test_rebuild_maps_the_owners_memory(impl):
    assert observed(impl, "owner_sees"), \
        "expected the receiver's write through a view to land in the owner's buffer (mapped, not copied)"


@pytest.mark.points(2)
def test_release_frees_the_memory(impl):
    assert not observed(impl, "file_left"), "expected release to remove the shared-memory file"


@pytest.mark.points(3)
def test_two_live_exports_are_independent(impl):
    """Two buckets exported at once (a trainer exports the next while the engine loads the last): each handle
    maps its own memory, holds its own bytes, is small enough to send (no tensor in it), and releasing one
    leaves the other readable."""
    import pickle

    a, b = mixed_state(11), mixed_state(12)
    buf_a, handle_a = impl.export(list(a.items()))
    paths = [handle_a.where[0]]
    try:
        buf_b, handle_b = impl.export(list(b.items()))
        paths.append(handle_b.where[0])
        assert handle_a.where != handle_b.where, f"expected two exports in two places, got {handle_a.where} twice"
        for handle in (handle_a, handle_b):
            size = len(pickle.dumps(handle))
            assert size < 4096 + 200 * len(handle.entries), \
                f"expected a handle of a few hundred bytes plus its entries, got {size} bytes (a tensor inside?)"
        del buf_a
        impl.release(handle_a)
        views = impl.rebuild(handle_b)
        wrong = sorted(n for n, v in views if sha(v) != sha(b[n]))
        assert not wrong, f"expected the second export to keep its own bytes after the first's release; not: {wrong}"
        del views, buf_b
        impl.release(handle_b)
    finally:
        for path in paths:
            if os.path.exists(path):
                os.unlink(path)


@pytest.mark.points(2)
def test_load_copies_into_the_receivers_tensors_in_place(impl):
    """The receiver's parameters are the tensors its model computes with: load writes into them (same objects,
    same memory), whatever their layout, and returns the bytes it copied."""
    incoming = mixed_state(13)
    params = {n: torch.zeros_like(t) for n, t in incoming.items()}
    params["w_t"] = torch.zeros(30, 20).t()  # a transposed parameter: written through its own strides
    before = {n: (t, t.data_ptr()) for n, t in params.items()}
    got = impl.load(params, list(incoming.items()))
    for n, (t, ptr) in before.items():
        assert params[n] is t and t.data_ptr() == ptr, f"{n}: expected the receiver's own tensor written in place"
        assert sha(t) == sha(incoming[n]), f"{n}: expected the owner's bytes in the receiver's tensor"
    want = sum(t.numel() * t.element_size() for t in incoming.values())
    assert got == want, f"expected load to return {want} bytes, got {got}"


def fake_gpus(monkeypatch, uuids: list[str]) -> None:
    """Make this process "see" GPUs with these UUIDs, in this order (only what the UUID lookup asks)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(uuids))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid=uuids[i]))


UUIDS = ["GPU-0a0a0a0a-0000-0000-0000-000000000000", "GPU-1b1b1b1b-1111-1111-1111-111111111111",
         "GPU-2c2c2c2c-2222-2222-2222-222222222222"]


@pytest.mark.points(3)
def test_local_index_looks_the_gpu_up_by_uuid(impl, monkeypatch):
    fake_gpus(monkeypatch, [UUIDS[2], UUIDS[0], UUIDS[1]])  # CUDA_VISIBLE_DEVICES=2,0,1
    got = [impl.local_index(u) for u in UUIDS]
    assert got == [1, 2, 0], f"expected GPUs {UUIDS} at indices [1, 2, 0] here, got {got}"
    with pytest.raises(RuntimeError) as err:
        impl.local_index("GPU-ffffffff-ffff-ffff-ffff-ffffffffffff")
    assert all(u in str(err.value) for u in UUIDS), \
        f"expected the error to name the GPUs this process sees ({UUIDS}), got: {err.value}"


@pytest.mark.points(3)
def test_rebuild_opens_the_handle_on_this_process_index(impl, monkeypatch):
    """The owner exported from its cuda:0, which this process sees as cuda:2: rebuild must pass 2."""
    from torch.multiprocessing import reductions

    from labsupport.core.handoff import Handle

    real = reductions.rebuild_cuda_tensor
    names = list(inspect.signature(real).parameters)
    weights = torch.arange(16, dtype=torch.float32).view(4, 4)
    seen = []

    @functools.wraps(real)
    def fake(*args, **kwargs):  # stands in for the CUDA driver: records the device, returns the "mapped" bytes
        bound = dict(zip(names, args), **kwargs)
        seen.append(bound["storage_device"])
        buf = torch.zeros(256, dtype=torch.uint8)
        buf[:64].copy_(weights.view(-1).view(torch.uint8))
        return buf

    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", fake)
    for fn in (impl.rebuild, getattr(impl, "local_index", None)):
        glob = getattr(inspect.unwrap(fn), "__globals__", {}) if fn else {}
        if "rebuild_cuda_tensor" in glob:
            monkeypatch.setitem(glob, "rebuild_cuda_tensor", fake)
    fake_gpus(monkeypatch, [UUIDS[1], UUIDS[2], UUIDS[0]])
    where = [None] * len(names)
    where[names.index("storage_device")] = 0  # the owner's index
    where[names.index("tensor_size")], where[names.index("dtype")] = (256,), torch.uint8
    views = impl.rebuild(Handle(UUIDS[0], tuple(where), [("w", "float32", (4, 4), 0, 64)]))
    assert seen == [2], f"expected the handle opened on this process's cuda:2 (the GPU's UUID), got devices {seen}"
    assert torch.equal(dict(views)["w"], weights), "expected the view 'w' to show the mapped bytes"


@pytest.mark.gpu(1)
@pytest.mark.points(4)
def test_cuda_ipc_round_trip(impl):
    """Real CUDA IPC; with two GPUs the receiver sees them in the reverse order (CUDA_VISIBLE_DEVICES=1,0)."""
    from labsupport.course.peer import Peer

    n = torch.cuda.device_count()
    dev = n - 1  # the owner's last GPU: the receiver's first when the order is reversed
    env = {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in reversed(range(n)))} if n > 1 else {}
    state = mixed_state(5, f"cuda:{dev}")
    with Peer(_receiver, env=env) as peer:
        buf, handle = impl.export(list(state.items()))
        got = ask(peer, ("take", impl.name, impl.key, handle))
        ask(peer, ("write", impl.name, impl.key, ("big", 7.0)))
        sees = bool((owner_view(buf, handle, "big") == 7.0).all())
        ask(peer, ("drop", impl.name, impl.key, None))
    del buf
    impl.release(handle)
    wrong = sorted(k for k, t in state.items() if got["own"].get(k) != sha(t))
    assert not wrong, f"expected the receiver (GPUs in another order) to load the owner's bytes; these differ: {wrong}"
    assert sees, "expected the receiver's write to land in the owner's GPU memory"


BUSY_CYCLES = int(2e9)  # torch.cuda._sleep: about a second of GPU time (an H100 clocks about 2 GHz)


@pytest.mark.gpu(1)
@pytest.mark.points(4)
def test_cuda_handle_is_safe_to_send_at_once(impl):
    """The owner's GPU is busy (a queued one-second kernel) when the optimizer step writes new weights and export
    is called, so both are queued behind it. A warm receiver reads the buffer the moment it gets the handle, on
    a stream of its own, and must find the new weights; and when export returns, its copies must have finished.
    The new weights are random bytes drawn for this run: no earlier buffer in GPU memory can hold them."""
    from labsupport.course.peer import Peer

    new = mixed_state(int.from_bytes(os.urandom(6), "little"), "cuda:0")
    state = {n: torch.zeros_like(t) for n, t in new.items()}  # the weights before the step
    written = torch.cuda.Event()
    with Peer(_receiver) as peer:
        ask(peer, ("warm", impl.name, impl.key, None))  # the receiver has CUDA up: it reads within milliseconds
        torch.cuda.synchronize()
        try:
            torch.cuda._sleep(BUSY_CYCLES)  # the GPU is busy ...
            for n, t in state.items():  # ... when the step's writes are queued (behind it) ...
                t.copy_(new[n])
            written.record()
            buf, handle = impl.export(list(state.items()))  # ... and export's copies (behind the writes)
            landed = written.query()  # export's copies cannot have finished unless the writes had
            seen = ask(peer, ("peek", impl.name, impl.key, handle))
            ask(peer, ("drop", impl.name, impl.key, None))
        finally:
            torch.cuda.synchronize()
    del buf
    impl.release(handle)
    wrong = sorted(k for k, t in new.items() if seen.get(k) != sha(t))
    assert not wrong, ("expected the new weights in the buffer when the handle arrives (export's copies finished "
                       f"before it was sent); the receiver found other bytes in: {wrong}")
    assert landed, ("expected export to return only once its copies into the buffer had finished on the GPU "
                    "(the handle is sent at once); it returned while the GPU had not even reached them")
