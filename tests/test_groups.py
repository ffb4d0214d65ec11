"""labsupport.groups: a stateless group forms, coexists with other groups, and fails clearly and in time.

Multi-process tests run real processes over gloo (CPU) or NCCL (gpu-marked); nothing is mocked.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from labsupport.course.ranks import run_ranks
from labsupport.groups import GroupError, GroupTimeout, create_group, free_port, host_store


def _device(kind: str, rank: int) -> str:
    return f"cuda:{rank}" if kind == "cuda" else "cpu"


# ---------------------------------------------------------------------------- single-process errors

def test_free_port_is_bindable():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # raises if it was not free


@pytest.mark.timeout(30)
def test_port_in_use_is_named():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(GroupError, match=rf"port {port} .*already in use.*free_port"):
            create_group("127.0.0.1", port, 0, 2, timeout_s=5)


@pytest.mark.timeout(90)
def test_host_store_keeps_the_port_that_free_port_can_lose():
    """On 4x H200, ``bench reshard``'s rank 0 lost a ``free_port`` port to a vLLM worker's connection before it
    listened (EADDRINUSE). A store hosted on the port the OS gives as it binds cannot lose it."""
    import threading

    port = free_port()
    with socket.socket() as other:  # another process takes the chosen port first
        other.bind(("127.0.0.1", port))
        other.listen()
        with pytest.raises(GroupError, match="already in use"):
            create_group("127.0.0.1", port, 0, 2, timeout_s=5)
    store = host_store(timeout_s=30)
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", store.port))  # already listening: nobody can take it
    joined: dict = {}
    peer = threading.Thread(target=lambda: joined.update(g=create_group("127.0.0.1", store.port, 1, 2, timeout_s=30)))
    peer.start()
    host = create_group("127.0.0.1", 0, 0, 2, timeout_s=30, store=store)  # (the store's port wins over 0)
    peer.join(40)
    try:
        assert host.world_size == 2 and joined["g"].rank == 1
    finally:
        for g in (host, joined.get("g")):
            if g is not None:
                g.destroy()
    with pytest.raises(GroupError, match="only rank 0 brings"):
        create_group("127.0.0.1", 0, 1, 2, store=host_store(timeout_s=5))


@pytest.mark.timeout(30)
def test_missing_peer_times_out_naming_it():
    t0 = time.monotonic()
    with pytest.raises(GroupTimeout, match=r"rank\(s\) \[1, 2\] never joined"):
        create_group("127.0.0.1", free_port(), 0, 3, timeout_s=2)
    assert time.monotonic() - t0 < 10


@pytest.mark.timeout(30)
def test_missing_master_times_out():
    t0 = time.monotonic()
    with pytest.raises(GroupTimeout, match=r"could not reach the group's master \(rank 0\)"):
        create_group("127.0.0.1", free_port(), 1, 2, timeout_s=1)
    assert time.monotonic() - t0 < 15


def test_rank_out_of_range():
    with pytest.raises(GroupError, match=r"rank must be in \[0, 2\)"):
        create_group("127.0.0.1", free_port(), 2, 2)


# ---------------------------------------------------------------------------- multi-process behaviour

def _objects_and_coexistence(rank: int, world_size: int, port_a: int, port_b: int, port_default: int,
                             kind: str) -> dict:
    import torch.distributed as dist

    dev = _device(kind, rank)
    # The trainer's own default group, as a real trainer would have; ours must not disturb it.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port_default}", rank=rank,
                            world_size=world_size)
    a = create_group("127.0.0.1", port_a, rank, world_size, device=dev, timeout_s=30)
    b = create_group("127.0.0.1", port_b, rank, world_size, device=dev, timeout_s=30)
    ta = torch.full((4,), 10.0 + rank, device=dev)
    tb = torch.full((4,), 20.0 + rank, device=dev)
    a.broadcast(ta, src=0)
    b.broadcast(tb, src=world_size - 1)
    a.synchronize()
    b.synchronize()
    d = torch.tensor([rank + 1.0])
    dist.all_reduce(d)  # the default group still works next to ours
    out = {
        "a": ta.cpu().tolist(), "b": tb.cpu().tolist(), "default_sum": d.item(),
        "obj": a.broadcast_object({"hello": rank} if rank == 1 else None, src=1),
        "gathered": b.all_gather_object(rank * rank),
        "default_world": dist.get_world_size(),
        "backend": a.backend,
    }
    a.barrier()
    a.destroy()
    b.destroy()
    dist.destroy_process_group()
    return out


def _check_objects(results: list, world_size: int, backend: str) -> None:
    for rank, (ok, out) in enumerate(results):
        assert ok, out
        assert out["a"] == [10.0] * 4  # from rank 0 over group a
        assert out["b"] == [20.0 + world_size - 1] * 4  # from the last rank over group b
        assert out["default_sum"] == sum(range(1, world_size + 1))
        assert out["obj"] == {"hello": 1}
        assert out["gathered"] == [r * r for r in range(world_size)]
        assert out["default_world"] == world_size
        assert out["backend"] == backend


@pytest.mark.timeout(90)
def test_two_groups_coexist_with_default_group():
    res = run_ranks(_objects_and_coexistence, 3, (free_port(), free_port(), free_port(), "cpu"), timeout_s=60)
    _check_objects(res, 3, "gloo")


def _wrong_world(rank: int, world_size: int, port: int) -> str:
    claimed = world_size + 1 if rank == 1 else world_size
    try:
        create_group("127.0.0.1", port, rank, claimed, timeout_s=10)
    except GroupError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.timeout(60)
def test_wrong_world_size_is_reported_on_both_sides():
    t0 = time.monotonic()
    res = run_ranks(_wrong_world, 2, (free_port(),), timeout_s=40)
    for ok, msg in res:
        assert ok, msg
        assert msg.startswith("GroupError") and "disagree on world_size" in msg, msg
    assert "rank 1 expects 3" in res[0][1] and "rank 0 expects 2" in res[1][1]
    assert time.monotonic() - t0 < 30  # found by exchanging world sizes, not by waiting for a timeout


def _duplicate(rank: int, world_size: int, port: int) -> str:
    my_rank = 1 if rank == 2 else rank  # two processes both claim rank 1; rank 2 never comes
    try:
        create_group("127.0.0.1", port, my_rank, world_size, timeout_s=3)
    except GroupError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.timeout(60)
def test_duplicate_rank_and_missing_rank():
    res = run_ranks(_duplicate, 3, (free_port(),), timeout_s=40)
    msgs = [m for _, m in res]
    # whichever of the two "rank 1" processes came second is told it joined twice
    assert sum("joined group" in m and "twice" in m for m in msgs[1:]) == 1, msgs
    assert msgs[0].startswith("GroupTimeout") and "rank(s) [2] never joined" in msgs[0], msgs


# ---------------------------------------------------------------------------- GPU (NCCL)

@pytest.mark.gpu(2)
@pytest.mark.timeout(180)
def test_nccl_groups_coexist_with_default_group():
    res = run_ranks(_objects_and_coexistence, 2, (free_port(), free_port(), free_port(), "cuda"), timeout_s=150)
    _check_objects(res, 2, "nccl")


@pytest.mark.gpu(2)
@pytest.mark.timeout(120)
def test_nccl_missing_peer_times_out():
    t0 = time.monotonic()
    with pytest.raises(GroupTimeout, match=r"rank\(s\) \[1\] never joined"):
        create_group("127.0.0.1", free_port(), 0, 2, device="cuda:0", timeout_s=3)
    assert time.monotonic() - t0 < 20


def _destroy_in_turn(rank: int, world_size: int, port: int, flag: str) -> float:
    """Rank 0 leaves first; rank 1 leaves only once rank 0's destroy has returned (as a trainer and an engine do)."""
    g = create_group("127.0.0.1", port, rank, world_size, device=f"cuda:{rank}", timeout_s=30)
    t = torch.ones(4, device=f"cuda:{rank}")
    g.all_reduce(t, "sum")
    torch.cuda.synchronize(rank)
    if rank == 1:
        while not os.path.exists(flag):
            time.sleep(0.05)
    t0 = time.monotonic()
    g.destroy()
    if rank == 0:
        Path(flag).touch()
    return time.monotonic() - t0


@pytest.mark.gpu(2)
@pytest.mark.timeout(120)
def test_nccl_destroy_does_not_wait_for_the_peer(tmp_path):
    """NCCL's graceful shutdown waits for every rank; destroy must not (a sequential teardown hung in Lab 4)."""
    out = run_ranks(_destroy_in_turn, 2, (free_port(), str(tmp_path / "rank0_left")), timeout_s=90)
    assert [ok for ok, _ in out] == [True, True], out
    assert all(seconds < 30 for _, seconds in out), out


# ---------------------------------------------------------------------------- programming errors vs lost peers

def _programming_errors(rank: int, world_size: int, port: int) -> dict:
    g = create_group("127.0.0.1", port, rank, world_size, timeout_s=30)
    out = {}
    for what, fn in {"device": lambda: g.broadcast(torch.zeros(4, device="meta"), src=0),
                     "src": lambda: g.broadcast(torch.zeros(4), src=world_size),
                     "op": lambda: g.all_reduce(torch.zeros(4), "avg")}.items():
        t0 = time.monotonic()
        try:
            fn()
            out[what] = ("no error", 0.0)
        except Exception as exc:
            out[what] = (f"{type(exc).__name__}: {exc}", time.monotonic() - t0)
    t = torch.full((2,), float(rank + 1))
    g.all_reduce(t, "sum")  # the group was not aborted: it still works
    out["after"] = t.tolist()
    g.destroy()
    return out


@pytest.mark.timeout(60)
def test_programming_error_raises_at_once_and_keeps_the_group():
    """A tensor on another device, a rank outside the group, an unknown op: ValueError naming it, at once, not
    a GroupTimeout after a liveness check; the group stays usable."""
    res = run_ranks(_programming_errors, 2, (free_port(),), timeout_s=40)
    for ok, out in res:
        assert ok, out
        assert out["device"][0].startswith("ValueError: broadcast: expected a tensor on this group's device cpu, "
                                           "found one on meta"), out
        assert out["src"][0].startswith("ValueError: broadcast: rank 2 is not in this group of 2 ranks"), out
        assert out["op"][0].startswith("ValueError: all_reduce op must be one of ['sum', 'max', 'min']"), out
        assert all(seconds < 1.0 for _, seconds in (out["device"], out["src"], out["op"])), out
        assert out["after"] == [3.0, 3.0]


def test_group_device_is_not_the_current_device():
    """create_group leaves the caller's current device alone (no torch.cuda.set_device) and synchronize waits on
    the group's device. On CPU only the API can be checked: gloo has no device work to wait for."""
    g = create_group("127.0.0.1", free_port(), 0, 1, timeout_s=10)
    assert g.device == torch.device("cpu") and not g.closed
    g.synchronize("nothing queued")  # returns at once on gloo
    g.destroy()
    assert g.closed


def _other_current_device(rank: int, world_size: int, port: int) -> dict:
    torch.cuda.set_device(0)  # every rank's current device is GPU 0; rank r's group lives on GPU r
    g = create_group("127.0.0.1", port, rank, world_size, device=f"cuda:{rank}", timeout_s=30)
    current_after_create = torch.cuda.current_device()
    t = torch.full((1 << 20,), float(rank == 0), device=f"cuda:{rank}")
    g.broadcast(t, src=0)
    g.synchronize("broadcast")  # the event is recorded on GPU r's stream: the broadcast has finished
    done = bool(t.eq(1).all())  # (a plain read would wait anyway; the check is that synchronize did)
    g.destroy()
    return {"current": current_after_create, "done": done}


@pytest.mark.gpu(2)
@pytest.mark.timeout(120)
def test_nccl_group_on_another_device_than_the_current_one():
    res = run_ranks(_other_current_device, 2, (free_port(),), timeout_s=100)
    assert res == [(True, {"current": 0, "done": True})] * 2


# ---------------------------------------------------------------------------- what the group leaves behind

def test_destroy_releases_the_port():
    """destroy() lets go of rank 0's store too: the port can host a new group at once."""
    port = free_port()
    g = create_group("127.0.0.1", port, 0, 1, timeout_s=10)
    g.destroy()
    again = create_group("127.0.0.1", port, 0, 1, timeout_s=10)  # GroupError "already in use" if the store lived on
    again.destroy()


def _store_keys(rank: int, world_size: int, port: int) -> list[int]:
    g = create_group("127.0.0.1", port, rank, world_size, timeout_s=30)
    counts = []
    for i in range(20):  # as core.sync does once per update: one object from the trainer, then tensors
        g.broadcast_object({"step": i} if rank == 0 else None, src=0)
        g.all_reduce(torch.ones(1))
        counts.append(g.store.num_keys())
    g.all_gather_object(rank)
    g.barrier()
    g.destroy()
    return counts


@pytest.mark.timeout(90)
def test_object_collectives_do_not_grow_the_store():
    """Each object collective's keys are deleted by the last rank that reads them (a sync a step for days must not
    grow rank 0's store by a key a step)."""
    res = run_ranks(_store_keys, 3, (free_port(),), timeout_s=60)
    assert all(ok for ok, _ in res), res
    counts = res[0][1]
    assert counts[-1] <= counts[1] + 4, counts  # bounded (a few keys may await their last reader), not 1 per call


def test_nccl_error_mode_is_set_for_the_constructor_only_even_from_threads(monkeypatch):
    """The NCCL error mode can only be set through the environment: threads building groups at once must each see
    it, and must not leave it changed (a fake constructor stands in for NCCL's, which needs GPUs)."""
    import threading

    import torch.distributed as dist

    from labsupport import groups

    seen = []

    class FakeNCCL:
        class Options:
            pass

        def __init__(self, store, rank, world_size, opts):
            time.sleep(0.05)
            seen.append(os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"))
            time.sleep(0.05)

    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    threads = [threading.Thread(target=groups._make_backend, args=(None, 0, 1, "nccl", 1.0)) for _ in range(4)]
    for t in threads:
        t.start()
        time.sleep(0.03)
    for t in threads:
        t.join()
    assert seen == ["2"] * 4
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ


# ---------------------------------------------------------------------------- review 2026-11-28: H1, H2, L4

class _RecordingBackend:
    """Stands in for ProcessGroupNCCL (which needs GPUs): records what a launch calls, in order."""

    def __init__(self) -> None:
        self.calls: list = []

    def _start_coalescing(self) -> None:
        self.calls.append("start")

    def _end_coalescing(self) -> str | None:  # as torch's: no work when nothing was grouped
        self.calls.append("end")
        return "grouped work" if self.calls[-2] != "start" else None

    def send(self, tensors, peer, tag):
        self.calls.append(("send", peer, tag))
        return "work"

    def recv(self, tensors, peer, tag):
        self.calls.append(("recv", peer, tag))
        return "work"

    def broadcast(self, tensors, opts):
        self.calls.append(("broadcast", opts.rootRank))
        return "work"


def _nccl_path(world_size: int = 3):
    from labsupport import groups

    g = groups.StatelessGroup(torch.distributed.HashStore(), 0, world_size, torch.device("cpu"), 1.0, "local")
    g.backend, g.pg = "nccl", _RecordingBackend()  # the NCCL code path, on CPU tensors
    return g


def test_nccl_groups_even_a_single_send_or_recv():
    """H1: a lone send/recv must be grouped too. Torch gives an ungrouped point-to-point op a 2-rank communicator of
    its own while its peer's grouped ops use the group's: all ranks waited for ever (4xH200, 3 ranks)."""
    g = _nccl_path()
    assert g.exchange([("send", torch.zeros(2), 1, 0)]) == "grouped work"
    assert g.pg.calls == ["start", ("send", 1, 0), "end"]
    g.pg.calls.clear()
    assert g.exchange([("recv", torch.zeros(2), 1, 0), ("recv", torch.zeros(2), 2, 0)]) == "grouped work"
    assert g.pg.calls == ["start", ("recv", 1, 0), ("recv", 2, 0), "end"]
    g.pg.calls.clear()
    assert g.broadcast_many([torch.zeros(2)], src=0) == ["work"]  # a lone collective uses the group's communicator
    assert g.pg.calls == [("broadcast", 0)]
    g.pg.calls.clear()
    # a rank with nothing to send or receive in a batch (reshard at some bucket sizes) launches
    # nothing, and waiting for that is no error
    g.wait_work(g.exchange([]), "send/recv")
    assert g.pg.calls == []


def test_an_abort_stuck_behind_a_hung_init_returns_within_its_bound():
    """H2 on NCCL: the group's abort after a rank died before NCCL started can wait on the mutex of
    the communicator init that hangs in another thread; the abort is bounded (the group's deadline,
    at most 5 s), and the group counts as closed (a second teardown would wait as well)."""
    g, stuck = _nccl_path(), threading.Event()
    g.pg.abort = g.pg.shutdown = lambda: stuck.wait(60)
    t = threading.Thread(target=g.abort, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(10)
    assert not t.is_alive() and time.monotonic() - t0 < g.timeout_s + 1 and g.closed
    stuck.set()
    g.pg.abort = lambda: (_ for _ in ()).throw(RuntimeError("broken by a dead peer"))
    g.closed, g.pg.shutdown = False, lambda: g.pg.calls.append("shutdown")
    g.abort()  # a teardown that raises: the next one is tried
    assert g.closed and g.pg.calls[-1] == "shutdown"


def _asymmetric_p2p(rank: int, world_size: int, port: int, kind: str) -> list:
    """Rank 0 receives from ranks 1 and 2 (two ops in its launch); ranks 1 and 2 send one tensor each (one op)."""
    dev = _device(kind, rank)
    if kind == "cuda":
        torch.cuda.set_device(rank)
    g = create_group("127.0.0.1", port, rank, world_size, device=dev, timeout_s=20)
    if rank == 0:
        got = [torch.zeros(1 << 16, device=dev) for _ in range(2)]
        g.wait_work(g.exchange([("recv", got[0], 1, 0), ("recv", got[1], 2, 0)]), "recv")
    else:
        got = [torch.full((1 << 16,), float(rank), device=dev)]
        g.wait_work(g.exchange([("send", got[0], 0, 0)]), "send")
    g.synchronize("p2p")
    out = [float(t.sum()) for t in got]
    g.destroy()
    return out


@pytest.mark.timeout(90)
def test_asymmetric_p2p_batch_on_gloo():
    res = run_ranks(_asymmetric_p2p, 3, (free_port(), "cpu"), timeout_s=60)
    assert res == [(True, [float(1 << 16), float(2 << 16)]), (True, [float(1 << 16)]), (True, [float(2 << 16)])]


@pytest.mark.gpu(3)
@pytest.mark.timeout(120)
def test_nccl_asymmetric_p2p_batch_finishes():
    """H1 on NCCL: one rank's launch holds two receives, its peers' one send each; it hung before (alive at 75 s)."""
    t0 = time.monotonic()
    res = run_ranks(_asymmetric_p2p, 3, (free_port(), "cuda"), timeout_s=60)
    assert res == [(True, [float(1 << 16), float(2 << 16)]), (True, [float(1 << 16)]), (True, [float(2 << 16)])]
    assert time.monotonic() - t0 < 60


def _dies_before_backend(rank: int, world_size: int, port: int, kind: str) -> dict:
    """The last rank arrives at the store, then dies before its backend starts (a bad device, an OOM, ...)."""
    from labsupport import groups

    if rank == world_size - 1:
        groups._make_backend = lambda *a: os._exit(3)
    t0 = time.monotonic()
    try:
        create_group("127.0.0.1", port, rank, world_size, device=_device(kind, rank), timeout_s=3).destroy()
        return {"error": None, "s": time.monotonic() - t0}
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc), "s": time.monotonic() - t0}


def _check_dies_before_backend(res: list, world_size: int, limit_s: float) -> None:
    for ok, out in res[:-1]:
        assert ok and out["error"] == "GroupTimeout", out
        assert f"rank(s) [{world_size - 1}] did not answer" in out["message"], out
        assert out["s"] < limit_s, out
    assert res[-1] == (False, ("Died", f"rank {world_size - 1} exited with code 3", ""))


@pytest.mark.timeout(90)
def test_rank_dying_between_store_and_backend_is_named_in_time():
    """H2: a rank that arrived and died before the backend started: the others raise GroupTimeout naming it within
    the deadline + 10 s (gloo's connect raised a bare DistStoreError; NCCL's lazy init waited for ever)."""
    _check_dies_before_backend(run_ranks(_dies_before_backend, 3, (free_port(), "cpu"), timeout_s=60), 3, 13)


@pytest.mark.gpu(2)
@pytest.mark.timeout(120)
def test_nccl_rank_dying_between_store_and_backend_is_named_in_time():
    _check_dies_before_backend(run_ranks(_dies_before_backend, 2, (free_port(), "cuda"), timeout_s=90), 2, 13)


def test_only_a_lost_peer_aborts_the_group_not_a_programming_error_that_says_timeout():
    """L4: the text of an error decides only for the backend's own (plain RuntimeError, DistError) errors."""
    def raised(exc: Exception) -> Exception:
        g = _nccl_path()
        try:
            with g._step("a step"):
                raise exc
        except Exception as got:
            return got, g.closed

    for programming in (ValueError("timeout must be positive"), TypeError("abort() takes no arguments"),
                        NotImplementedError("timed out waiting: not implemented")):
        assert raised(programming) == (programming, False)
    for lost in (RuntimeError("Connection closed by peer [127.0.0.1]:1234"),
                 torch.distributed.DistStoreError("wait timeout after 3000ms")):
        got, closed = raised(lost)
        assert isinstance(got, GroupTimeout) and closed and "a step" in str(got), got
