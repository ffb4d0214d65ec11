"""Diagnosis labs: a small real system runs with one fault, drawn from the learner's seed; the learner finds it.

Learners: do not read this package's modules. The fault your system has is chosen in them; the labs
(``labs/lab_d1_diagnose_sync.md``, ``lab_d2_diagnose_handoff.md``, ``lab_d3_diagnose_engine.md``) show you
the course's instruments, and finding the fault with those is the exercise.

Each lab's module (``sync``, ``handoff``, ``engine``) holds ``FAULTS`` (the names a learner may answer, each
with what it is, what ``where`` means for it, and the instrument a wrong answer is pointed to) and
``VARIANTS`` (every ``(fault, where)`` it can run with), and ``run(variant)``, which runs the system with that
fault and returns what the instruments saw. ``tests/test_diagnosis.py`` runs every variant and checks that
its instrument shows it; ``grading/test_d<N>_*.py`` grade the answers in ``assignments/diagnosis.toml``.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ANSWERS = ROOT / "assignments" / "diagnosis.toml"
LABS = {"d1": "sync", "d2": "handoff", "d3": "engine"}  # grading key -> module of this package
NOWHERE = "-"  # the ``where`` of a fault that has no place to name


@dataclass(frozen=True)
class Fault:
    """One answer a learner may give: ``what`` it is (shown in the lab), what ``where`` names for it ("" for
    nothing), and ``look``: the instrument a wrong answer is pointed to (never the fault)."""
    what: str
    where: str
    look: str


def answers_path() -> Path:
    """The answer file: ``assignments/diagnosis.toml``, or the file ``DIAGNOSIS_ANSWERS`` names."""
    return Path(os.environ.get("DIAGNOSIS_ANSWERS") or ANSWERS)


def _read(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path} is not valid TOML ({exc}); compare it with the file as handed out") from None


def seed(path: Path | None = None) -> tuple[int, str]:
    """The learner's seed and where it came from: ``seed = N`` in the answer file, else ``LABSUPPORT_SEED``,
    else 0 (everyone who sets none gets the same faults)."""
    path = path or answers_path()
    value = _read(path).get("seed")
    if value is not None:
        if not isinstance(value, int):
            raise ValueError(f"seed in {path} must be a whole number, got {value!r}")
        return value, f"seed = {value} in {path.name}"
    env = os.environ.get("LABSUPPORT_SEED", "").strip()
    if env:
        return int(env), f"LABSUPPORT_SEED={env}"
    return 0, "no seed set (write `seed = <yours>` in assignments/diagnosis.toml): seed 0"


def lab(key: str):
    """The module of diagnosis lab ``key`` (``"d1"`` -> ``diagnosis.sync``)."""
    return importlib.import_module(f"diagnosis.{LABS[key]}")


def _draw(key: str, seed: int, salt: str, n: int) -> int:
    digest = hashlib.sha256(f"rlhf-course/diagnosis/{key}/{salt}/{seed}".encode()).hexdigest()
    return int(digest, 16) % n


def drawn(key: str, seed: int) -> tuple[str, str]:
    """The variant ``(fault, where)`` of lab ``key`` for ``seed``: each fault equally likely, then its place."""
    variants = lab(key).VARIANTS
    faults = sorted({f for f, _ in variants})
    fault = faults[_draw(key, seed, "fault", len(faults))]
    places = [w for f, w in variants if f == fault]
    return fault, places[_draw(key, seed, "where", len(places))]


def answer(key: str, path: Path | None = None) -> tuple[str, str]:
    """The learner's ``(fault, where)`` for lab ``key`` from the answer file (``""`` where nothing is written)."""
    section = _read(path or answers_path()).get(key, {})
    fault = str(section.get("fault", "")).strip().lower().replace("-", "_").replace(" ", "_")
    return fault, str(section.get("where", "")).strip()


def _same_place(a: str, b: str) -> bool:
    """Places compare without case, quotes or a trailing ``.weight``; a rank or bucket may be written as a number."""
    def norm(s: str) -> str:
        s = s.strip().strip("'\"`").lower().removesuffix(".weight").removeprefix("model.")
        return s.removeprefix("rank ").removeprefix("bucket ").strip()

    return norm(a) == norm(b)


@dataclass(frozen=True)
class Verdict:
    """What the grader says about one lab's answer: is the fault right, is the place right, and why not."""
    fault_ok: bool
    where_ok: bool
    fault_message: str
    where_message: str


def verdict(key: str, given: tuple[str, str], seed: int, source: str = "") -> Verdict:
    """Grade ``given = (fault, where)`` for lab ``key`` under ``seed``. A wrong answer's message names the
    instrument that shows the true fault, never the fault."""
    module = lab(key)
    fault, where = drawn(key, seed)
    got_fault, got_where = given
    look = module.FAULTS[fault].look
    names = ", ".join(module.FAULTS)
    if not got_fault:
        msg = f"expected a fault name in [{key}] fault of {answers_path().name} (one of: {names}), got nothing"
    elif got_fault not in module.FAULTS:
        msg = f"expected one of the fault names the lab lists ({names}), got {got_fault!r}"
    elif got_fault != fault:
        msg = f"expected the fault your system has ({source or f'seed {seed}'}), got {got_fault!r}; look again at {look}"
    else:
        msg = ""
    fault_ok = not msg
    if not fault_ok:
        where_msg = "expected the right fault first: the place counts once the fault is right"
    elif module.FAULTS[fault].where == "" or any(_same_place(got_where, w) for w in places(key, fault, where)):
        where_msg = ""
    else:
        where_msg = (f"expected {module.FAULTS[fault].where} where the fault shows, got {got_where or 'nothing'!r}; "
                     f"look again at {look}")
    return Verdict(fault_ok, not where_msg, msg, where_msg)


def places(key: str, fault: str, where: str) -> list[str]:
    """The answers that name the place of ``(fault, where)`` (a lab's ``places`` may accept more than one)."""
    module = lab(key)
    return module.places(fault, where) if hasattr(module, "places") else [where]


def grade(key: str) -> Verdict:
    """The verdict on the answer file's answer for lab ``key``, under the learner's seed."""
    value, source = seed()
    return verdict(key, answer(key), value, source)


def introduce(key: str) -> int:
    """Print the learner's seed and the faults the lab may have (names, what each is, what ``where`` names);
    returns the seed. Never says which fault this seed drew."""
    module = lab(key)
    value, source = seed()
    print(f"Your seed: {value} ({source}).")
    print(f"The fault is one of these; write its name as [{key}] fault in assignments/diagnosis.toml:")
    for name, f in module.FAULTS.items():
        print(f"  {name:<20} {f.what}\n  {'':<20} where = {f.where or 'nothing (leave it empty)'}")
    return value
