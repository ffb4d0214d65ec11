"""The diagnosis labs can be solved and graded: every variant of every lab's system, run for real, shows its fault
in the instrument the lab points to (read here by a rule a learner could follow), the lab's printout never
names the fault, every variant is drawn by some seed, and the grader accepts the right answer and refuses the
others with a hint that names an instrument, not the fault.

The systems run on the CPU path everywhere, and on their GPU path where there is a GPU (``-m gpu``: one is enough).
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

import diagnosis
from diagnosis import engine, handoff, instruments, sync

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------ reading the instruments as a learner would
def read_sync(seen: sync.Seen) -> tuple[str, str]:
    """Lab D1: the last sync's labels; a receiver all at v0 while it reports the newest version; a whole bucket one
    version behind; or one tensor off: by a rounding error (relative < 1%) or by a wrong value."""
    last, newest = seen.syncs[-1], f"v{len(seen.syncs)}"
    labels = {r: {n: instruments.label(seen.trainer, n, d["sums"][n]) for n in seen.trainer[0]} for r, d in last.items()}
    for r, lab in labels.items():
        if set(lab.values()) == {"v0"} and last[r]["version"] == len(seen.syncs):
            return "receiver_not_updated", str(r)
    off = {n for lab in labels.values() for n, v in lab.items() if v != newest}
    for k, names in enumerate(seen.buckets):
        if off == set(names) and all(lab[n] == f"v{len(seen.syncs) - 1}" for lab in labels.values() for n in names):
            return "bucket_loaded_early", str(k)
    if len(off) == 1:
        (name,) = off
        got = next(iter(last.values()))["differing"][name]
        rel = instruments.difference(__import__("torch").from_numpy(got), seen.weights[-1][name])[1]
        return ("lossy_cast" if rel < 0.01 else "wrong_offset"), name
    return "?", "?"


def read_handoff(seen: handoff.Seen) -> tuple[str, str]:
    """Lab D2: the receiver's labels round by round, then the owner's handoff bytes after each release."""
    rounds = [{n: instruments.label(seen.trainer, n, d["sums"][n]) for n in seen.trainer[0]} for d in seen.rounds]
    if all(set(r.values()) == {"v0"} for r in rounds):
        return "lost_update", "-"
    if all(set(r.values()) == {"v1"} for r in rounds) and len(rounds) > 1:
        return "stale_handle", "-"
    last = rounds[-1]
    off = sorted(n for n, v in last.items() if v != f"v{len(rounds)}")
    if len(off) == 1 and all(r[off[0]] == "v0" for r in rounds):
        return "dropped_tensor", off[0]
    if len(off) == 2 and all("@" in last[n] for n in off):
        return "crossed_names", off[0]
    released = [s["roles"]["handoff buffers"] for s in seen.samples if s["event"] == "end" and
                s["phase"].startswith("release")]
    if not off and released[-1] > released[0] > 0:
        return "leaked_buffer", "-"
    return "?", "?"


def read_engine(seen: engine.Seen) -> tuple[str, str]:
    """Lab D3: which parameters hold the new weights, the old, or neither; then the gap on cached prompts."""
    state = {n: "new" if seen.engine[n] == t else "old" if seen.engine[n] == seen.before[n] else "neither"
             for n, t in seen.trainer.items()}
    if set(state.values()) == {"old"}:
        return "update_not_applied", "-"
    off = [n for n, s in state.items() if s != "new"]
    if len(off) == 1:
        return ("dropped_tensor" if state[off[0]] == "old" else "swapped_slices"), off[0]
    if not off and seen.gap_cached > 20 * max(seen.gap_fresh, 1e-3):
        return "stale_prefix_cache", "-"
    return "?", "?"


def _printed(show, seen) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        show(seen)
    return out.getvalue()


def _check(key: str, seen: list, read) -> None:
    module = diagnosis.lab(key)
    for variant, s in zip(module.VARIANTS, seen):
        fault, where = read(s)
        assert fault == variant[0] and where in diagnosis.places(key, *variant), \
            f"{key} {variant}: the instruments read as {(fault, where)}"
        printed = _printed(module.show, s)
        named = [f for f in module.FAULTS if f in printed]
        assert not named, f"{key} {variant}: the printout names {named}"


# ------------------------------------------------------------------ every variant, run for real
READ = {"d1": read_sync, "d2": read_handoff, "d3": read_engine}


def _engine_seen(tmp_path: Path, gpu: bool) -> list:
    """Every engine variant, in a process of its own: the engine runs in its process (and sets
    VLLM_ENABLE_V1_MULTIPROCESSING=0 from then on)."""
    out = tmp_path / "seen.pkl"
    code = ("import pickle, sys; from diagnosis import engine; "
            f"pickle.dump(engine.run_all(engine.VARIANTS, gpu={gpu}), open({str(out)!r}, 'wb'))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert done.returncode == 0, done.stderr[-3000:]
    return pickle.loads(out.read_bytes())


def _seen(key: str, gpu: bool, tmp_path: Path) -> list:
    module = diagnosis.lab(key)
    return _engine_seen(tmp_path, gpu) if key == "d3" else module.run_all(module.VARIANTS, gpu=gpu)


@pytest.mark.parametrize("key", list(diagnosis.LABS))
def test_every_variant_shows_in_its_instrument_on_the_cpu_path(key, tmp_path):
    _check(key, _seen(key, False, tmp_path), READ[key])


@pytest.mark.gpu(1)
@pytest.mark.parametrize("key", list(diagnosis.LABS))
def test_every_variant_shows_in_its_instrument_on_one_gpu(key, tmp_path):
    """The GPU path of each lab (on one GPU: the sync's weights on it, its buckets over gloo; NCCL with three),
    and the engine in bfloat16 beside the float32 trainer."""
    seen = _seen(key, True, tmp_path)
    assert all(getattr(s, "device", "cuda") == "cuda" for s in seen), f"{key} did not run on the GPU"
    _check(key, seen, READ[key])


# ------------------------------------------------------------------ seeds and the grader
def _seeds(key: str) -> dict[tuple[str, str], int]:
    """The first seed that draws each variant."""
    found: dict[tuple[str, str], int] = {}
    for s in range(5000):
        found.setdefault(diagnosis.drawn(key, s), s)
    return found


@pytest.mark.parametrize("key", list(diagnosis.LABS))
def test_every_variant_is_drawn_by_some_seed_and_faults_are_even(key):
    module = diagnosis.lab(key)
    seeds = _seeds(key)
    assert set(seeds) == set(module.VARIANTS), f"never drawn: {set(module.VARIANTS) - set(seeds)}"
    counts = {f: 0 for f in module.FAULTS}
    for s in range(2000):
        counts[diagnosis.drawn(key, s)[0]] += 1
    assert min(counts.values()) > 2000 / len(counts) * 0.8, counts
    assert set(module.FAULTS) == {f for f, _ in module.VARIANTS}
    assert all((w == "-") == (module.FAULTS[f].where == "") for f, w in module.VARIANTS)


@pytest.mark.parametrize("key", list(diagnosis.LABS))
def test_grader_accepts_the_right_answer_and_refuses_the_others(key):
    module = diagnosis.lab(key)
    for (fault, where), s in _seeds(key).items():
        for place in diagnosis.places(key, fault, where):
            for written in (place, place.upper(), place.removeprefix("model."), f"'{place}'"):
                v = diagnosis.verdict(key, (fault, written if where != "-" else ""), s)
                assert v.fault_ok and v.where_ok, (fault, written, v)
        for other in module.FAULTS:
            if other == fault:
                continue
            v = diagnosis.verdict(key, (other, where), s)
            assert not v.fault_ok and not v.where_ok
            assert module.FAULTS[fault].look in v.fault_message and fault not in v.fault_message, v.fault_message
        if where != "-":
            wrong = next(w for f, w in module.VARIANTS if f == fault and w not in diagnosis.places(key, fault, where)) \
                if sum(f == fault for f, _ in module.VARIANTS) > 1 else "nowhere"
            v = diagnosis.verdict(key, (fault, wrong), s)
            assert v.fault_ok and not v.where_ok and module.FAULTS[fault].look in v.where_message
    assert "one of" in diagnosis.verdict(key, ("", ""), 0).fault_message
    assert "one of the fault names" in diagnosis.verdict(key, ("no_such_fault", ""), 0).fault_message


def _grade(answers: str, tmp_path: Path, impl: str = "assignments") -> tuple[str, dict]:
    path = tmp_path / "diagnosis.toml"
    path.write_text(answers)
    out = tmp_path / "grades.json"
    env = {**os.environ, "DIAGNOSIS_ANSWERS": str(path)}
    done = subprocess.run([sys.executable, "-m", "grading", "--impl", impl, "--json", str(out), *diagnosis.LABS],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout, __import__("json").loads(out.read_text())


def test_make_grade_scores_the_answer_file(tmp_path):
    s = 11
    right = f"seed = {s}\n" + "".join(f"[{k}]\nfault = {diagnosis.drawn(k, s)[0]!r}\nwhere = "
                                      f"{diagnosis.drawn(k, s)[1].replace('-', '')!r}\n" for k in diagnosis.LABS)
    text, data = _grade(right, tmp_path)
    assert re.search(r"^score: 30 / 30$", text, re.M), text
    fault = diagnosis.drawn("d1", s)[0]
    other = next(f for f in sync.FAULTS if f != fault)
    text, data = _grade(right.replace(f"fault = {fault!r}", f"fault = {other!r}", 1), tmp_path)
    assert re.search(r"^score: 20 / 30$", text, re.M) and "look again at" in text, text
    assert f"look again at {sync.FAULTS[fault].look}" in text and fault not in text, text
    text, data = _grade("", tmp_path)
    assert re.search(r"^score: 0 / 30$", text, re.M) and "got nothing" in text, text
    text, data = _grade(right, tmp_path, impl="reference")  # the answers are the learner's: not graded there
    assert re.search(r"^score: 0 / 0$", text, re.M) and "graded with IMPL=assignments" in text, text


def test_answer_file_as_handed_out_is_blank_and_valid():
    text = (ROOT / "assignments" / "diagnosis.toml").read_text()
    import tomllib

    data = tomllib.loads(text)
    assert "seed" not in data, "the handed-out file sets no seed: each learner writes theirs"
    assert data == {k: {"fault": "", "where": "", "why": ""} for k in diagnosis.LABS}


def test_instructors_page_states_each_labs_faults_and_points():
    from grading.grade import points

    page = (ROOT / "book" / "instructors.md").read_text()
    rows = re.findall(r"^\| \d\. `(lab_d\d_\w+)` \|[^|]+\|[^|]+\| (\d+) \((\d+)\) \|[^|]+\| `(d\d)` \| (\d+) \|$", page, re.M)
    stated = {key: (lab, int(f), int(v), int(p)) for lab, f, v, key, p in rows}
    assert set(stated) == set(diagnosis.LABS), stated
    for key, (lab, n_faults, n_variants, pts) in stated.items():
        module = diagnosis.lab(key)
        assert (ROOT / "labs" / f"{lab}.md").exists()
        assert (n_faults, n_variants) == (len(module.FAULTS), len(module.VARIANTS)), key
        assert pts == points()[key]["cpu"] and points()[key]["gpu"] == 0, key
