"""Assignment 3 (assignments/a3_sync.py): a weight sync over a stateless group: metadata, a broadcast per bucket, load.

A trainer and two receivers run in three processes over gloo (a trainer and a receiver over NCCL on two GPUs): each
rank's ``send`` or ``receive`` runs on a group that records its calls, and each receiver's ``load`` records the
bytes of every bucket it is handed.
"""

from __future__ import annotations

import functools

import pytest
import torch

from grading.support import ALIGN, child_failure, mixed_state, sha

BUCKET = 64 << 10


class RecordingGroup:
    """A ``StatelessGroup`` that records each collective's kind and, for a broadcast, its bytes."""

    def __init__(self, group) -> None:
        self.group, self.calls = group, []

    def broadcast(self, tensor, src=0, **kw):
        self.calls.append(("broadcast", tensor.numel() * tensor.element_size()))
        return self.group.broadcast(tensor, src, **kw)

    def broadcast_object(self, obj, src=0, **kw):
        self.calls.append(("broadcast_object", 0))
        return self.group.broadcast_object(obj, src, **kw)

    def all_reduce(self, tensor, *args, **kw):
        self.calls.append(("all_reduce", tensor.numel() * tensor.element_size()))
        return self.group.all_reduce(tensor, *args, **kw)

    def synchronize(self, *args, **kw):
        self.calls.append(("synchronize", 0))
        return self.group.synchronize(*args, **kw)

    def __getattr__(self, name):
        return getattr(self.group, name)


SLOW_S = 0.5  # receiver 2 takes this long to load the second-to-last bucket of the first sync
SECOND_SRC = 2  # the second sync's trainer: rank 2, with the default bucket size


def _rank(rank: int, world_size: int, port: int, name: str, key: str, kind: str) -> dict:
    """One rank, two syncs. First rank 0 sends its state (seed 0) in 64 KiB buckets; each receiver receives into
    its own (another seed), and receiver 2 is slow to load the second-to-last bucket. Then (on gloo) rank 2
    sends a state of seed 7 with the default bucket size, and ranks 0 and 1 receive it."""
    import time

    from grading.impl import load
    from labsupport.groups import create_group

    impl = load(name, key)
    device = f"cuda:{rank}" if kind == "cuda" else "cpu"
    group = RecordingGroup(create_group("127.0.0.1", port, rank, world_size, device=device, timeout_s=20))
    state = mixed_state(rank, device)
    own = dict(state)  # the tensor objects this rank holds (a model's parameters)
    loads: list[dict[str, str]] = []
    out: dict = {"slow_until": None}
    try:
        if rank == 0:
            out["bytes"] = impl.send(group, state, bucket_bytes=BUCKET)
        else:
            copy = impl.copy_into(state)
            slow_at = len(expected_buckets()) - 2 if rank == 2 else -1

            def load(batch):
                loads.append({n: sha(t) for n, t in batch})  # what this bucket holds when it is loaded
                copy(batch)
                if len(loads) - 1 == slow_at:
                    time.sleep(SLOW_S)
                    out["slow_until"] = time.time()

            out["bytes"] = impl.receive(group, load)
        out["returned"] = time.time()
        out["calls"], group.calls = group.calls, []
        out["own"] = {n: sha(t) for n, t in own.items()}
        if kind == "cpu":
            out["second"] = second_sync(impl, group, rank, state)
    finally:
        group.group.destroy()
    return {**out, "loads": loads}


def second_sync(impl, group, rank: int, state: dict) -> dict:
    """Rank ``SECOND_SRC`` sends a new state (seed 7, default bucket size); the others load it into theirs."""
    if rank == SECOND_SRC:
        moved = impl.send(group, mixed_state(7), src=SECOND_SRC)
    else:
        moved = impl.receive(group, impl.copy_into(state), src=SECOND_SRC)
    return {"bytes": moved, "own": {n: sha(t) for n, t in state.items()}, "calls": group.calls}


@functools.lru_cache(maxsize=None)
def run(name: str, key: str, kind: str = "cpu") -> tuple:
    """The three ranks' results for one implementation (run once, read by every test)."""
    from labsupport.course.ranks import run_ranks
    from labsupport.groups import free_port

    world = 3 if kind == "cpu" else 2  # a trainer and two receivers; on GPUs, one receiver (two GPUs)
    return tuple(run_ranks(_rank, world, (free_port(), name, key, kind), timeout_s=90,
                           cpu_threads=1 if kind == "cpu" else None))


def results(impl, kind: str = "cpu") -> list[dict]:
    out = run(impl.name, impl.key, kind)
    for rank, (ok, res) in enumerate(out):
        if not ok:
            raise child_failure(f"rank {rank}", res)
    return [res for _, res in out]


def expected_buckets() -> list[tuple[list[str], int]]:
    """The buckets the contract gives for the trainer's state: (names, buffer bytes), greedy and in order."""
    out, used = [], 0
    for name, t in mixed_state(0).items():
        n = -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        if not out or used + n > BUCKET:
            out.append(([], 0))
            used = 0
        out[-1][0].append(name)
        used += n
        out[-1] = (out[-1][0], max(used, ALIGN))
    return out


def check_bytes(res: list[dict]) -> None:
    trainer = {n: sha(t) for n, t in mixed_state(0).items()}
    total = sum(t.numel() * t.element_size() for t in mixed_state(0).values())
    assert res[0]["own"] == trainer, "expected the trainer's own tensors unchanged by send"
    for r, out in enumerate(res[1:], 1):
        wrong = sorted(n for n in trainer if out["own"][n] != trainer[n])
        assert not wrong, f"receiver {r}: expected its own tensors to hold the trainer's bytes; these differ: {wrong}"
        assert out["bytes"] == res[0]["bytes"] == total, \
            f"expected send and receive to return {total} bytes, got {res[0]['bytes']} and {out['bytes']}"


@pytest.mark.points(6)
def test_receivers_hold_the_trainers_bytes(impl):
    check_bytes(results(impl))


@pytest.mark.points(3)
def test_each_bucket_is_loaded_after_it_arrived(impl):
    trainer = {n: sha(t) for n, t in mixed_state(0).items()}
    want = [names for names, _ in expected_buckets()]
    for r, out in enumerate(results(impl)[1:], 1):
        got = [list(b) for b in out["loads"]]
        assert got == want, f"receiver {r}: expected load to be called once per bucket with {want}, got {got}"
        stale = sorted(n for b in out["loads"] for n, h in b.items() if h != trainer[n])
        assert not stale, f"receiver {r}: expected each bucket to hold the trainer's bytes when loaded; not: {stale}"


@pytest.mark.points(3)
def test_one_object_then_one_broadcast_per_bucket(impl):
    calls = [c for c in results(impl)[0]["calls"] if c[0].startswith("broadcast")]
    want = [("broadcast_object", 0)] + [("broadcast", size) for _, size in expected_buckets()]
    assert calls == want, f"expected the trainer's collectives {want}, got {calls}"


@pytest.mark.points(2)
def test_copy_into_writes_in_place(impl):
    state = mixed_state(1)
    before = {n: (t, t.data_ptr()) for n, t in state.items()}
    incoming = mixed_state(0)
    impl.copy_into(state)(list(incoming.items()))
    for n, (t, ptr) in before.items():
        assert state[n] is t and t.data_ptr() == ptr, f"{n}: expected the receiver's own tensor to be written in place"
        assert sha(t) == sha(incoming[n]), f"{n}: expected the received bytes in the receiver's tensor"


@pytest.mark.gpu(2)
@pytest.mark.points(4)
def test_nccl_sync_on_two_gpus(impl):
    check_bytes(results(impl, "cuda"))


@pytest.mark.points(3)
def test_no_rank_returns_before_every_rank_has_every_bucket(impl):
    """Receiver 2 is slow: it loads the second-to-last bucket for half a second before it takes the last one.
    No rank may return before then (over gloo a broadcast's sender may return once its bytes are on their way;
    over NCCL once the broadcast is queued), and each rank's last word is a wait on the host with the group's
    deadline (``group.synchronize``: on NCCL the collectives only queue work, and a dead peer would hang)."""
    res = results(impl)
    slow = res[2]["slow_until"]
    assert slow is not None, "expected receiver 2 to load the second-to-last bucket (it never did)"
    for r in (0, 1):
        early = slow - res[r]["returned"]
        assert early <= 0, (f"expected rank {r} to return only once every receiver had every bucket; it returned "
                            f"{early:.2f} s before receiver 2 had taken the last one (end with a collective every "
                            "rank reaches after the last bucket)")
    for r, out in enumerate(res):
        kinds = [c[0] for c in out["calls"]]
        assert kinds[-1:] == ["synchronize"] and len(kinds) > 1, \
            f"rank {r}: expected its last group call to be the host's wait with the deadline (synchronize), got {kinds}"


@pytest.mark.points(3)
def test_any_rank_can_be_the_source(impl):
    """A second sync in the same group: rank 2 is the trainer, with the default bucket size."""
    res = results(impl)
    new = {n: sha(t) for n, t in mixed_state(7).items()}
    total = sum(t.numel() * t.element_size() for t in mixed_state(7).values())
    for r in (0, 1):
        second = res[r]["second"]
        wrong = sorted(n for n in new if second["own"][n] != new[n])
        assert not wrong, \
            f"rank {r}: expected the bytes that rank {SECOND_SRC} sent (src={SECOND_SRC}); these differ: {wrong}"
        assert second["bytes"] == total, f"rank {r}: expected {total} bytes received, got {second['bytes']}"
    calls = [c for c in res[SECOND_SRC]["second"]["calls"] if c[0] == "broadcast"]
    assert len(calls) == 1, \
        f"expected one broadcast for the whole state under the default 64 MiB bucket, got {len(calls)}"
