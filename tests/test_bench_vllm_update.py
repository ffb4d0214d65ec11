"""``bench vllm-update``'s bookkeeping, on CPU: what its JSON says about an update (the transfer phase, the
fractions of the raw broadcast, the bars), the engine's GPUs in a lane's numbering, and the teardown that runs
every step even after an error. The GPU run itself is ``tools/gpu_session.sh``'s."""

from __future__ import annotations

import pytest

from labsupport.bench import vllm_update as vu


def test_engine_gpus_follow_the_lanes_numbering(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert vu.engine_gpus(1, 2) == "1,2"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    assert vu.engine_gpus(1, 2) == "5,6" and vu.engine_gpus(0) == "4"
    with pytest.raises(RuntimeError, match="shows only 3 GPUs"):
        vu.engine_gpus(3)


def test_teardown_runs_every_step_last_first_and_keeps_the_first_error():
    ran = []

    def fail():
        ran.append("fail")
        raise OSError("worker gone")

    with pytest.raises(ValueError) as info:
        with vu.Teardown() as undo:
            undo.add(lambda: ran.append("engine"), "stop the engine")
            undo.add(fail, "leave the group")
            undo.add(lambda: ran.append("trainer"), "shut the trainer down")
            raise ValueError("the update failed")
    assert ran == ["trainer", "fail", "engine"]
    assert any("leave the group: OSError: worker gone" in n for n in info.value.__notes__)

    with pytest.raises(RuntimeError, match="teardown failed: leave the group"):
        with vu.Teardown() as undo:
            undo.add(fail, "leave the group")


class _Llm:
    def __init__(self):
        self.calls = []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake_up", tags))


def test_cycle_pauses_updates_and_resumes():
    llm = _Llm()
    got = vu.cycle(llm, lambda: (llm.calls.append(("update",)), {"transfer_s": 0.1})[1])
    assert llm.calls == [("sleep", 0), ("update",), ("wake_up", ["scheduling"])]
    assert got["transfer_s"] == 0.1 and got["pause_s"] >= 0 and got["resume_s"] >= 0
    assert set(vu.cycle(_Llm(), lambda: None)) == {"pause_s", "resume_s"}


def test_bucketed_update_reads_the_transfer_phase_from_the_slowest_worker(monkeypatch):
    replies = [{"seconds": 0.50, "handshake_s": 0.05, "loaded": 3}, {"seconds": 0.60, "handshake_s": 0.20, "loaded": 3}]
    monkeypatch.setattr(vu.vllm_ext, "push_weights",
                        lambda group, named, llm, mode, bucket_bytes: {"mode": mode, "n_collectives": 2,
                                                                       "seconds": 0.7, "workers": replies})
    got = vu.bucketed_update(None, [], None, 1 << 30)
    assert got["transfer_s"] == pytest.approx(0.45) and got["workers"] == replies and got["mode"] == "bucketed"


def _shape(transfer_s=0.105, cycle_s=0.18, native_s=0.3, exact=(True, True)):
    raw_s = 0.1
    bucketed = {"update_s": cycle_s, "parts": {"transfer_s": transfer_s}, "exact_by_rank": list(exact)}
    native = {"update_s": native_s, "parts": {}, "exact_by_rank": [True, True]}
    for row in (bucketed, native):
        row.update(vu.nccl_fractions(row, raw_s))
    return {"raw_broadcast_s": raw_s, "modes": {"bucketed": bucketed, "native_nccl": native}}


def test_bar_nccl_holds_the_transfer_phase_and_the_cycle_against_raw():
    bar = vu.bar_nccl(_shape())
    assert bar["transfer_fraction_of_raw"] == pytest.approx(0.1 / 0.105) and bar["cycle_over_raw"] == pytest.approx(1.8)
    assert bar["met"] and bar["faster_cycle"] == "bucketed" and bar["native_nccl_cycle_over_raw"] == pytest.approx(3)
    assert "transfer_fraction_of_raw" not in _shape()["modes"]["native_nccl"]  # (it reports no transfer phase)
    assert not vu.bar_nccl(_shape(transfer_s=0.2))["met"]  # transfer at 50 % of raw
    assert not vu.bar_nccl(_shape(cycle_s=0.25))["met"]  # a cycle of 2.5x raw
    assert not vu.bar_nccl(_shape(exact=(True, False)))["met"]  # one rank's bytes differ
    assert vu.bar_nccl(_shape(native_s=0.1))["faster_cycle"] == "native_nccl"
    assert vu.bar_nccl({"raw_broadcast_s": None, "modes": {"mapped": {}}}) is None  # one GPU: nothing to judge


def test_bar_mapped_sync_names_which_engine_placement_meets_it():
    def row(fraction, exact=True):
        return {"copy_floor_s": 0.007, "sync_median_s": 0.007 / fraction, "sync_fraction_of_floor": fraction,
                "exact": exact}
    bar = vu.bar_mapped_sync({"modes": {"mapped": row(0.59), "mapped_inline": row(0.9)}})
    assert bar["met"] and bar["met_by"] == ["mapped_inline"]
    assert not vu.bar_mapped_sync({"modes": {"mapped": row(0.59), "mapped_inline": row(0.9, exact=False)}})["met"]
    assert vu.bar_mapped_sync({"modes": {"mapped": row(0.86)}})["met_by"] == ["mapped"]


def test_reshard_bars_count_every_gpu_and_the_speedup():
    from labsupport.bench import reshard as rb

    def row(seconds, trainer, engine, exact=True):
        return {"seconds": seconds, "peak_extra_bytes_per_rank": trainer, "engine_peak_extra_bytes_per_rank": engine,
                "exact": exact, "ok": True}
    shape = {"largest_tensor_bytes": 100, "modes": {"a_gather_all": row(3.0, [900, 0], [50, 50]),
                                                    "b_bucket_overlap": row(2.5, [80, 0], [120, 10]),
                                                    "c_shard_to_shard": row(1.5, [20, 20], [None, None])}}
    bar = rb.bar(shape, bucket=100)
    assert bar["peak_any_gpu"] == {"a_gather_all": 900, "b_bucket_overlap": 120, "c_shard_to_shard": 20}
    assert bar["b_and_c_peak_any_gpu_within_bucket_plus_largest"] and bar["b_and_c_peak_under_one_bucket"]
    assert bar["c_speedup_over_a"] == 2.0 and bar["c_at_least_1.5x_a"] and bar["all_exact"]
    shape["modes"]["b_bucket_overlap"]["engine_peak_extra_bytes_per_rank"] = [250, 0]  # an engine GPU over the limit
    shape["modes"]["c_shard_to_shard"]["exact"] = False
    bar = rb.bar(shape, bucket=100)
    assert not bar["b_and_c_peak_any_gpu_within_bucket_plus_largest"] and not bar["all_exact"]
