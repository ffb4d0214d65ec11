"""labsupport.broadcast: bytes arrive intact, bad updates are refused before anything changes, dead peers time out.

Real processes over gloo (CPU); the gpu-marked tests run the same scenarios over NCCL, one process per GPU.
Receivers' bytes are compared with SHA-256 of the raw memory, independent of the module's own checksums.
"""

from __future__ import annotations

import hashlib
import math
import os
import time

import pytest
import torch

from labsupport import broadcast as B
from labsupport import checksums
from labsupport.bench import sync as bench_sync
from labsupport.core import buckets, sync
from labsupport.course.ranks import run_ranks
from labsupport.experiments import sync_timing
from labsupport.groups import create_group, free_port


def _device(kind: str, rank: int) -> str:
    return f"cuda:{rank}" if kind == "cuda" else "cpu"


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _model(seed: int, device: str) -> dict[str, torch.Tensor]:
    """Awkward tensors on purpose: several dtypes, odd byte counts, a 0-d scalar, a non-contiguous view,
    and one tensor (360 KB) larger than the 64 KiB bucket used below."""
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(300, 300, generator=g)
    t = {
        "embed.weight": torch.randn(50, 33, generator=g).to(torch.bfloat16),
        "layer.0.q.weight": torch.randn(64, 64, generator=g).to(torch.float16),
        "layer.0.q.bias": torch.randn(1001, generator=g).to(torch.bfloat16),  # 2002 bytes
        "layer.0.norm": torch.randn(3, 5, generator=g),
        "layer.0.mlp.weight": big,
        "layer.0.t_view": torch.randn(40, 24, generator=g).t(),  # non-contiguous
        "step": torch.tensor(seed, dtype=torch.int64),  # 0-d
        "mask": torch.rand(13, generator=g) > 0.5,  # bool, 13 bytes
        "codes": torch.randint(0, 255, (77,), generator=g, dtype=torch.uint8),
        "head.weight": torch.randn(17, 129, generator=g).to(torch.float64),
    }
    return {k: v.to(device) for k, v in t.items()}


# ---------------------------------------------------------------------------- pure units

def test_plan_buckets_covers_every_tensor_once():
    metas = buckets.metas(_model(0, "cpu"))
    for bucket in (256, 4096, 64 << 10, 1 << 20):
        plan = B.plan_buckets(metas, bucket)
        seen = [e.name for b in plan for e in b.entries]
        assert sorted(seen) == sorted(m.name for m in metas if buckets.nbytes(m)), bucket
        for b in plan:
            if b.nbytes > bucket:  # only a tensor larger than a bucket may exceed it, alone
                assert len(b.entries) == 1 and b.entries[0].nbytes > bucket
            for e, nxt in zip(b.entries, b.entries[1:] + [None]):
                assert e.offset % buckets.ALIGN == 0
                if nxt:
                    assert e.offset + e.nbytes <= nxt.offset
    per = B.plan_buckets(metas, 1 << 20, "per_tensor")
    assert len(per) == len(metas) and all(len(b.entries) == 1 for b in per)


def test_plans_for_a_large_model():
    metas = [buckets.Meta(n, "bfloat16", tuple(s)) for n, s in sync_timing.transformer_shapes(int(2.5e9))]
    assert len(metas) > 250
    bucket, total = 256 << 20, sum(buckets.nbytes(m) for m in metas)
    plan = B.plan_buckets(metas, bucket)  # bucketed: the large tensors grouped, first; the small ones packed
    kinds = [b.packed for b in plan]
    assert not kinds[0] and kinds == sorted(kinds) and kinds[-1]
    assert all(e.nbytes < B.SMALL for b in plan if b.packed for e in b.entries)
    assert all(e.nbytes >= B.SMALL for b in plan if not b.packed for e in b.entries)
    assert sum(len(b.entries) for b in plan if b.packed) > 100  # norms, biases, k/v: one launch between them
    assert all(b.nbytes <= bucket for b in plan)
    assert len(plan) <= math.ceil(total / bucket) + 4  # buckets are nearly full
    assert sorted(e.name for b in plan for e in b.entries) == sorted(m.name for m in metas)
    packed = B.plan_buckets(metas, 64 << 20, "packed")  # packed: the embeddings (238 MiB) alone, first
    alone = [not b.packed for b in packed]
    assert alone[:2] == [True, True] and not any(alone[2:])


def test_checksum_sees_one_byte_and_a_swap():
    x = torch.randn(10_000).to(torch.bfloat16)
    base = checksums.tensor_checksums({"x": x})["x"]
    y = x.clone()
    y.view(torch.uint8)[12345] ^= 1
    z = x.clone()
    z[[10, 9000]] = x[[9000, 10]]  # same values, other places
    assert checksums.tensor_checksums({"x": x.clone()})["x"] == base
    odd = x[1:]  # a view at an address no int64 word starts at: same bytes, same checksum as a fresh copy
    assert checksums.tensor_checksums({"o": odd})["o"] == checksums.tensor_checksums({"o": odd.clone()})["o"]
    assert checksums.tensor_checksums({"y": y})["y"] != base
    if x[10] != x[9000]:
        assert checksums.tensor_checksums({"z": z})["z"] != base


def test_bench_summary_reports_the_bar_against_raw_of_the_same_run():
    def row(size, mode, bucket, gbps):
        return {"size_bytes": size, "n_tensors": 300, "mode": mode, "bucket_bytes": bucket, "gb_per_s": gbps}

    rows = [row(int(2.5e9), "raw", 0, 360.0), row(int(2.5e9), "per_tensor", 0, 30.0),
            row(int(2.5e9), "bucketed", 64 << 20, 300.0), row(int(2.5e9), "bucketed", 512 << 20, 330.0),
            row(int(2.5e9), "bucketed_noverify", 512 << 20, 340.0),
            row(int(5e8), "raw", 0, 300.0), row(int(5e8), "bucketed", 512 << 20, 30.0)]  # too small for the bar
    bar = bench_sync.check_bar(bench_sync.summarize(rows))
    assert bar["sizes_gb"] == [2.5] and bar["met_bucketed_verified"] and bar["met_bucketed_without_checksums"]
    assert bar["met_by"]["2.50 GB"] == ["bucketed_noverify 512 MiB (94.4%)", "bucketed 512 MiB (91.7%)"]
    rows[3]["gb_per_s"] = 320.0  # 88.9 %: verified misses the bar
    assert not bench_sync.check_bar(bench_sync.summarize(rows))["met_bucketed_verified"]


# ---------------------------------------------------------------------------- identical bytes

# (mode, bucket bytes, receivers land in their own tensors as buckets arrive: staged=False)
CASES = [("per_tensor", 1 << 20, False), ("bucketed", 64 << 10, False), ("bucketed", 4096, False),
         ("bucketed", 1 << 20, True), ("packed", 64 << 10, True), ("packed", 4096, False), ("packed", 1 << 20, False)]


def _sync_identical(rank: int, world_size: int, port: int, kind: str) -> list:
    dev = _device(kind, rank)
    g = create_group("127.0.0.1", port, rank, world_size, device=dev, timeout_s=60)
    out = []
    for version, (mode, bucket, in_place) in enumerate(CASES, start=1):
        if rank == 0:
            model = _model(version, dev)
            stats = B.send(g, model, mode=mode, bucket_bytes=bucket, version=version)
            calls = []
        else:
            model = {k: torch.zeros_like(v) for k, v in _model(0, dev).items()}
            calls = []

            def load(batch, model=model, calls=calls):
                for name, t in batch:
                    assert t.dtype == model[name].dtype and t.shape == model[name].shape, name
                calls.append([n for n, _ in batch])
                sync.copy_into(model)(batch)

            stats = B.Receiver(g, expected=B.expected_from(model), load=load, into=model if in_place else None,
                               staged=not in_place).receive()
            loaded = sorted(n for c in calls for n in c)
            if in_place:  # all but the non-contiguous one landed in (or were unpacked into) their tensors
                assert loaded == ["layer.0.t_view"], loaded
            else:  # staged: load() once, with the whole update, after it verified
                assert loaded == sorted(model) and len(calls) == 1, calls
        out.append({"sha": {k: _sha(v) for k, v in model.items()}, "mode": stats.mode, "loads": len(calls),
                    "n": stats.n_collectives, "bytes": stats.bytes, "version": stats.version,
                    "verified": stats.verified, "backend": g.backend})
    # A Sender and a Receiver keep their staging buffers from one update to the next, until released.
    side = (B.Sender(g, mode="packed", bucket_bytes=64 << 10) if rank == 0
            else B.Receiver(g, expected=None, load=sync.copy_into(model), staged=False))
    side.send(_model(1, dev)) if rank == 0 else side.receive()
    staged = sum(b.numel() for b in side.buffers)
    side.release()
    out.append({"staged": staged, "released": sum(b.numel() for b in side.buffers)})
    g.destroy()
    return out


def _check_identical(res: list) -> None:
    for ok, out in res:
        assert ok, out
    for rank, (_, out) in enumerate(res):
        buffers = out.pop()
        assert buffers["released"] == 0, rank
        assert buffers["staged"] > 0, rank  # every rank packed (or unpacked) small tensors in them
    sender = res[0][1]
    for rank, (_, got) in enumerate(res[1:], start=1):
        for case, (s, r) in enumerate(zip(sender, got)):
            assert r["sha"] == s["sha"], f"rank {rank}, case {CASES[case]}"
            assert r["version"] == s["version"] == case + 1 and r["verified"]
            assert r["mode"] == s["mode"] and r["n"] == s["n"] and r["bytes"] == s["bytes"]
    n = {CASES[i][:2]: c["n"] for i, c in enumerate(sender)}  # launches on the wire
    assert n["per_tensor", 1 << 20] == 10  # one broadcast per tensor
    assert n["packed", 1 << 20] == 1  # everything fits one 1 MiB bucket
    assert 2 <= n["packed", 64 << 10] < n["packed", 4096]  # the 360 KB tensor travels alone
    metas = buckets.metas(_model(0, "cpu"))
    for bucket in (64 << 10, 4096, 1 << 20):  # small tensors packed, the rest grouped: both kinds in play
        plan = B.plan_buckets(metas, bucket)
        assert any(b.packed for b in plan)
        assert any(not b.packed and len(b.entries) > 1 for b in plan) or bucket == 1 << 20  # (2 large ones)
        if sender[0]["backend"] == "nccl":  # one launch per bucket, grouped or packed
            assert n["bucketed", bucket] == len(plan)
        else:  # gloo cannot group: one broadcast per unpacked tensor
            assert n["bucketed", bucket] == sum(1 if b.packed else len(b.entries) for b in plan)
    # versions differ, so the data really changed between cases
    assert len({c["sha"]["layer.0.mlp.weight"] for c in sender}) == len(CASES)


@pytest.mark.timeout(120)
def test_sync_gives_identical_bytes_gloo():
    _check_identical(run_ranks(_sync_identical, 3, (free_port(), "cpu"), timeout_s=90))


def _in_place(rank: int, world_size: int, port: int, kind: str) -> dict:
    dev = _device(kind, rank)
    g = create_group("127.0.0.1", port, rank, world_size, device=dev, timeout_s=60)
    model = {k: v.contiguous() for k, v in _model(5 if rank == 0 else 0, dev).items()}
    ptrs = {k: v.data_ptr() for k, v in model.items()}
    loads, stats, announced = [], [], []
    real = g.broadcast_object
    g.broadcast_object = lambda *a, **k: (announced.append(1), real(*a, **k))[1]  # counts metadata round trips
    side = B.Sender(g) if rank == 0 else B.Receiver(g, expected=B.expected_from(model), load=loads.append, into=model)
    for version in (1, 2):  # the second time every rank holds the layout: no metadata, no vote
        if rank == 0:
            with torch.no_grad():
                model["layer.0.norm"].add_(version)  # training changes a tensor between updates
            stats.append(side.send(model, version=version))
        else:
            stats.append(side.receive())
    g.destroy()
    return {"sha": {k: _sha(v) for k, v in model.items()}, "n": [s.n_collectives for s in stats],
            "loads": len(loads), "same_memory": all(v.data_ptr() == ptrs[k] for k, v in model.items()),
            "announced": len(announced)}


@pytest.mark.timeout(120)
def test_bucketed_lands_in_place_without_load_gloo():
    _check_in_place(run_ranks(_in_place, 3, (free_port(), "cpu"), timeout_s=90))


def _check_in_place(res: list) -> None:
    for ok, out in res:
        assert ok, out
    ref = {k: v.contiguous() for k, v in _model(5, "cpu").items()}
    ref["layer.0.norm"] += 1
    ref["layer.0.norm"] += 2  # (as the trainer did: float rounding)
    want = {k: _sha(v) for k, v in ref.items()}
    for rank, (_, out) in enumerate(res):
        assert out["sha"] == want, rank  # every receiver holds the trainer's tensors, in its own memory
        assert out["loads"] == 0 and out["same_memory"]
        assert out["announced"] == 1, out  # the metadata went with the first update only
    assert res[0][1]["n"] == res[1][1]["n"]


def _caller_changes(rank: int, world_size: int, port: int, kind: str) -> dict:
    """A receiver that changes its own tensors or its expected metadata in place, between two updates of the same
    layout: what it holds now counts (no verdict or landing is remembered for a mapping it still owns)."""
    dev = _device(kind, rank)
    g = create_group("127.0.0.1", port, rank, world_size, device=dev, timeout_s=60)
    model = {k: v.contiguous() for k, v in _model(0, dev).items()}
    exp, out = B.expected_from(model), {}

    def update(seed: int) -> None:
        B.send(g, _model(seed, dev)) if rank == 0 else B.receive(g, expected=exp, load=sync.copy_into(model), into=model)

    update(7)
    model["layer.0.norm"] = torch.zeros_like(model["layer.0.norm"])  # a new tensor under the same name
    update(8)
    out["norm"] = _sha(model["layer.0.norm"])
    exp["head.weight"] = buckets.Meta("head.weight", "float64", (17, 128))  # same mapping, same length
    try:
        update(9)
        out["error"] = None
    except B.WeightSyncError as exc:
        out["error"] = str(exc)
    g.destroy()
    return out


@pytest.mark.timeout(120)
def test_a_receiver_changing_its_mappings_in_place_is_seen_gloo():
    res = run_ranks(_caller_changes, 2, (free_port(), "cpu"), timeout_s=90)
    assert all(ok for ok, _ in res), res
    out = res[1][1]
    assert out["norm"] == _sha(_model(8, "cpu")["layer.0.norm"])  # landed in the tensor it holds now
    assert out["error"] is not None and "'head.weight': shape expected (17, 128)" in out["error"], out


# ---------------------------------------------------------------------------- rejection

def _bad_updates():
    good = _model(7, "cpu")
    renamed = {("layer.0.q.wieght" if k == "layer.0.q.weight" else k): v for k, v in good.items()}
    wrong_dtype = {**good, "layer.0.norm": good["layer.0.norm"].to(torch.bfloat16)}
    wrong_shape = {**good, "embed.weight": good["embed.weight"].reshape(33, 50)}
    return [
        (renamed, "'layer.0.q.wieght': unknown name", "did you mean 'layer.0.q.weight'"),
        (wrong_dtype, "'layer.0.norm': dtype expected float32, found bfloat16", None),
        (wrong_shape, "'embed.weight': shape expected (50, 33), found (33, 50)", None),
    ]


def _reject(rank: int, world_size: int, port: int, kind: str) -> dict:
    dev = _device(kind, rank)
    g = create_group("127.0.0.1", port, rank, world_size, device=dev, timeout_s=60)
    errors, loads = [], []
    model = _model(0, dev)  # receivers start from seed 0; the sender's good update is seed 7
    before = {k: _sha(v) for k, v in model.items()}
    unchanged = []
    for update, _, _ in _bad_updates():
        try:
            if rank == 0:
                B.send(g, {k: v.to(dev) for k, v in update.items()}, bucket_bytes=64 << 10)
            else:
                B.receive(g, expected=B.expected_from(model), load=lambda b: loads.append(b))
            errors.append(None)
        except B.WeightSyncError as exc:
            errors.append(str(exc))
        unchanged.append({k: _sha(v) for k, v in model.items()} == before)
    # Only the last receiver objects (it expects an extra tensor's shape to differ); everyone must refuse.
    other = {**model, "head.weight": torch.zeros(17, 128, dtype=torch.float64, device=dev)}
    try:
        if rank == 0:
            B.send(g, _model(7, dev))
        else:
            exp = B.expected_from(other if rank == world_size - 1 else model)
            B.receive(g, expected=exp, load=sync.copy_into(model))
        errors.append(None)
    except B.WeightSyncError as exc:
        errors.append(str(exc))
    unchanged.append({k: _sha(v) for k, v in model.items()} == before)
    # A receiver whose load() raises: every rank hears about it at the end.
    try:
        if rank == 0:
            B.send(g, _model(7, dev), bucket_bytes=4096)
        else:
            def bad_load(batch):
                if rank == 1:
                    raise ValueError("disk full")
                sync.copy_into(model)(batch)
            B.receive(g, expected=B.expected_from(model), load=bad_load)
        errors.append(None)
    except B.WeightSyncError as exc:
        errors.append(str(exc))
    # The group is still usable: a good update goes through.
    if rank == 0:
        B.send(g, _model(7, dev), version=9)
    else:
        B.receive(g, expected=B.expected_from(model), load=sync.copy_into(model))
    final = {k: _sha(v) for k, v in model.items()}
    # Same layout again, which the receivers accepted before, but the last receiver's model changed
    # meanwhile (a new expected): it asks for the vote again in the header, and everyone must refuse.
    try:
        if rank == 0:
            B.send(g, _model(8, dev), version=10)
        else:
            B.receive(g, expected=B.expected_from(other if rank == world_size - 1 else model),
                      load=sync.copy_into(model))
        errors.append(None)
    except B.WeightSyncError as exc:
        errors.append(str(exc))
    unchanged.append({k: _sha(v) for k, v in model.items()} == final)
    g.destroy()
    return {"errors": errors, "loads": len(loads), "unchanged": unchanged, "final": final}


def _check_reject(res: list) -> None:
    for ok, out in res:
        assert ok, out
    world = len(res)
    want = {k: _sha(v) for k, v in _model(7, "cpu").items()}
    for rank, (_, out) in enumerate(res):
        errs = out["errors"]
        for (_, needle, hint), err in zip(_bad_updates(), errs[:3]):
            assert err is not None and needle in err, (rank, err)
            assert "rejected before any weight changed" in err
            if hint:
                assert hint in err
        assert errs[3] is not None and f"rank {world - 1}: 'head.weight': shape expected (17, 128)" in errs[3]
        assert errs[4] is not None and "rank 1: load() failed" in errs[4] and "disk full" in errs[4]
        assert errs[5] is not None and "rejected before any weight changed" in errs[5], errs[5]
        assert f"rank {world - 1}: 'head.weight': shape expected (17, 128)" in errs[5]
        if rank > 0:
            assert out["final"] == want, rank  # the good update after all the bad ones landed
            assert out["loads"] == 0  # load() never ran for a rejected update
            assert out["unchanged"] == [True] * 5, out["unchanged"]


@pytest.mark.timeout(120)
def test_bad_metadata_rejected_everywhere_and_nothing_changes_gloo():
    _check_reject(run_ranks(_reject, 3, (free_port(), "cpu"), timeout_s=90))


# ---------------------------------------------------------------------------- verification

def _corrupt(rank: int, world_size: int, port: int, kind: str) -> dict:
    """Receiver 1's link flips one bit of the second bucket it receives (fault injection around the real
    broadcast); the checksums must catch it on every rank, and the group must stay usable."""
    dev = _device(kind, rank)
    g = create_group("127.0.0.1", port, rank, world_size, device=dev, timeout_s=60)
    model = {k: v.contiguous() for k, v in _model(0, dev).items()}
    calls, out = [0], {}
    if rank == 1:
        real = g.broadcast_many

        def flaky(tensors, src=0):
            work = real(tensors, src)
            calls[0] += 1
            if calls[0] == 2:
                g.wait_work(work)
                tensors[-1].reshape(-1).view(torch.uint8)[7] ^= 4
                if kind == "cuda":
                    torch.cuda.synchronize(dev)
            return work

        g.broadcast_many = flaky

    def update(**send_kw) -> None:  # one update to _model(7), landed in place on the receivers
        if rank == 0:
            B.send(g, _model(7, dev), **send_kw)
        else:
            B.receive(g, expected=B.expected_from(model), load=sync.copy_into(model), into=model)

    for name, verify in (("unverified", False), ("verified", True)):
        try:
            update(bucket_bytes=64 << 10, verify=verify)
            out[name] = None
        except B.WeightSyncError as exc:
            out[name] = str(exc)
        calls[0] = 0
    if rank == 1:
        del g.broadcast_many  # the link is repaired (the class's method again)
    update(version=3)
    out["final"] = {k: _sha(v) for k, v in model.items()}
    g.destroy()
    return out


def _check_corrupt(res: list) -> None:
    for ok, out in res:
        assert ok, out
    want = {k: _sha(v) for k, v in _model(7, "cpu").items()}
    for rank, (_, out) in enumerate(res):
        assert out["unverified"] is None, out  # without checksums nobody notices the flipped bit ...
        err = out["verified"]  # ... with them, every rank hears which receiver and which bucket
        assert err is not None and "failed on a receiver" in err and "rank 1: checksum mismatch in bucket" in err, err
        assert "rank 2" not in err, err
        if rank:
            assert out["final"] == want, rank  # the next update repaired it


@pytest.mark.timeout(120)
def test_checksum_mismatch_reported_on_every_rank_gloo():
    _check_corrupt(run_ranks(_corrupt, 3, (free_port(), "cpu"), timeout_s=90))


# ---------------------------------------------------------------------------- dead peers

def _die(rank: int, world_size: int, port: int, kind: str, victim: int, hang: bool = False) -> dict:
    dev = _device(kind, rank)
    g = create_group("127.0.0.1", port, rank, world_size, device=dev, timeout_s=5)
    model = _model(3, dev)
    B.send(g, model) if rank == 0 else B.receive(g, expected=None, load=sync.copy_into(model))  # one good sync
    old = {k: _sha(v) for k, v in model.items()}
    if rank == victim == 0:
        real = g.broadcast_many
        count = [0]

        def dying_broadcast(*a, **k):  # the trainer dies after the handshake, in the middle of the buckets
            count[0] += 1
            if count[0] == 3:
                os._exit(3)
            return real(*a, **k)

        g.broadcast_many = dying_broadcast
    t0 = time.monotonic()
    try:
        if rank == 0:
            B.send(g, _model(4, dev), bucket_bytes=4096)
        else:
            if rank == victim:
                real_wait = g.wait_work

                def dying_wait(work, what="collective"):
                    real_wait(work, what)
                    if what == "bucket broadcast":  # a receiver dies (or stalls) once its first bucket is in
                        if hang:  # stalls without closing its sockets: only a timeout can notice
                            time.sleep(15)
                        os._exit(3)

                g.wait_work = dying_wait
            B.receive(g, expected=None, load=sync.copy_into(model))
        return {"error": None, "seconds": time.monotonic() - t0}
    except B.WeightSyncError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - t0,
                "old": {k: _sha(v) for k, v in model.items()} == old}


def _check_die(res: list, victim: int) -> None:
    for rank, (ok, out) in enumerate(res):
        if rank == victim:
            assert not ok and out[0] == "Died", out
            continue
        assert ok, out
        assert out["error"] is not None and out["error"].startswith("SyncTimeout"), out
        # the message names the peer that vanished (found through the store after the failure)
        assert ("rank 0 vanished" if victim == 0 else f"rank(s) [{victim}] did not answer") in out["error"], out
        assert out["seconds"] < 30, out  # a bounded wait (group timeout 5 s, liveness check 6 s), never a hang
        assert rank == 0 or out["old"], out  # staged: a survivor holds the whole old weights, not part of the new


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim,hang", [(0, False), (2, False), (2, True)],
                         ids=["trainer-dies", "receiver-dies", "receiver-hangs"])
def test_dead_peer_gives_timeout_error_gloo(victim, hang):
    res = run_ranks(_die, 3, (free_port(), "cpu", victim, hang), timeout_s=60)
    _check_die(res, victim)


# ---------------------------------------------------------------------------- GPU (NCCL)

def _gpu_world() -> int:
    """A trainer and two receivers where there are 3 GPUs; a trainer and one receiver on a 2-GPU machine."""
    return min(3, torch.cuda.device_count())


@pytest.mark.gpu(2)
@pytest.mark.timeout(300)
def test_sync_gives_identical_bytes_nccl():
    _check_identical(run_ranks(_sync_identical, _gpu_world(), (free_port(), "cuda"), timeout_s=240))


@pytest.mark.gpu(2)
@pytest.mark.timeout(300)
def test_bad_metadata_rejected_everywhere_and_nothing_changes_nccl():
    _check_reject(run_ranks(_reject, _gpu_world(), (free_port(), "cuda"), timeout_s=240))


@pytest.mark.gpu(2)
@pytest.mark.timeout(300)
def test_checksum_mismatch_reported_on_every_rank_nccl():
    _check_corrupt(run_ranks(_corrupt, _gpu_world(), (free_port(), "cuda"), timeout_s=240))


@pytest.mark.gpu(2)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("victim,hang", [(0, False), (-1, False), (-1, True)],
                         ids=["trainer-dies", "receiver-dies", "receiver-hangs"])
def test_dead_peer_gives_timeout_error_nccl(victim, hang):
    world = _gpu_world()
    victim %= world  # -1: the last receiver
    res = run_ranks(_die, world, (free_port(), "cuda", victim, hang), timeout_s=240)
    _check_die(res, victim)


@pytest.mark.gpu(2)
@pytest.mark.timeout(300)
def test_bucketed_lands_in_place_without_load_nccl():
    _check_in_place(run_ranks(_in_place, _gpu_world(), (free_port(), "cuda"), timeout_s=240))


@pytest.mark.gpu(2)
@pytest.mark.timeout(300)
def test_bucketed_large_bf16_state_nccl():
    """A 1B-transformer-like bf16 state (about 0.5 GB, hundreds of tensors) arrives bit-identical."""
    res = run_ranks(_large_state, 2, (free_port(),), timeout_s=240)
    for ok, out in res:
        assert ok, out
    assert res[0][1]["sums"] == res[1][1]["sums"]
    assert res[0][1]["n_tensors"] >= 100


def _large_state(rank: int, world_size: int, port: int) -> dict:
    dev = f"cuda:{rank}"
    g = create_group("127.0.0.1", port, rank, world_size, device=dev, timeout_s=60)
    shapes = sync_timing.transformer_shapes(int(0.5e9))
    gen = torch.Generator(device=dev).manual_seed(1)
    model = {n: (torch.randn(s, device=dev, generator=gen).to(torch.bfloat16) if rank == 0 else
                 torch.zeros(s, dtype=torch.bfloat16, device=dev)) for n, s in shapes}
    if rank == 0:
        st = B.send(g, model, bucket_bytes=64 << 20)
    else:
        st = B.receive(g, expected=B.expected_from(model), load=sync.copy_into(model))
    torch.cuda.synchronize()
    return {"sums": checksums.tensor_checksums(model), "n_tensors": st.n_tensors}


def _partial(rank: int, world_size: int, port: int) -> dict:
    g = create_group("127.0.0.1", port, rank, world_size, timeout_s=30)
    model, new = _model(0, "cpu"), _model(7, "cpu")
    subset = {k: v for k, v in new.items() if k != "head.weight"}  # a filtered state dict: one tensor dropped
    before, out = {k: _sha(v) for k, v in model.items()}, {}
    for partial in (False, True):
        try:
            if rank == 0:
                B.send(g, subset, partial=partial)
            else:
                B.receive(g, expected=B.expected_from(model), load=sync.copy_into(model))
            out[partial] = None
        except B.WeightSyncError as exc:
            out[partial] = str(exc)
        out[f"sums {partial}"] = {k: _sha(v) for k, v in model.items()}
    g.destroy()
    return {**out, "before": before, "new": {k: _sha(v) for k, v in new.items()}}


@pytest.mark.timeout(90)
def test_a_missing_tensor_is_refused_unless_the_sender_says_partial():
    """Review 2026-11-28 M4: a filtered state dict is refused on every rank before a byte moves (the receivers
    keep their old weights whole); said to be partial, it lands, and the dropped tensor keeps its old value."""
    res = run_ranks(_partial, 2, (free_port(),), timeout_s=60)
    for ok, out in res:
        assert ok, out
        assert "'head.weight': missing (send it" in out[False] and "rejected before" in out[False], out
        assert out[True] is None, out
    recv = res[1][1]
    assert recv["sums False"] == recv["before"]
    assert recv["sums True"] == {**recv["new"], "head.weight": recv["before"]["head.weight"]}
