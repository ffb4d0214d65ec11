"""The course's apparatus: what makes the labs run, not a mechanism a chapter teaches.

- ``results``: reference results under results/, each with its machine, versions, command and date
- ``compare``: comparisons of measured values as phrases for the book's prose
- ``hardware``: what this machine has, and the one place that picks the GPU path or the CPU stand-in
- ``progress``: progress on long work, the same in a terminal and in a notebook
- ``models``: the tiny language model and tokenizer, built and trained offline
- ``versions``: every difference between the vLLM and torch versions the course runs
- ``ranks``: run a function on N ranks in fresh processes with a deadline (tests and benchmarks)
- ``peer``: a second process to talk to, with deadlines (Lab 5's probes, the capstone's engine
  process)
- ``planner``: memory and transfer-time arithmetic for designs at scale
- ``vllm_engine``: starting and stopping the labs' engines: arguments and environment in one place

It stands on ``core`` alone; what drives the labs' experiments (timers, probes, stand-ins) is
``experiments``. and ``implementation(name)``: a core module, or with
``LABSUPPORT_IMPL=assignments`` the learner's assignment that replaces it (the labs' one switch to
run on a learner's code); ``student_copy_note()``: in a student copy, whose cores call the learner's
code, which assignments are not written yet.
"""

import ast
import importlib
import os
from pathlib import Path
from types import ModuleType


def implementation(name: str) -> ModuleType:
    """``labsupport.core.<name>``, or with ``LABSUPPORT_IMPL=assignments`` your assignment's module
    of that name (``assignments/a*_<name>.py``, graded by ``make grade``): the one switch that runs
    a lab on your code."""
    if os.environ.get("LABSUPPORT_IMPL", "reference") != "assignments":
        return importlib.import_module(f"labsupport.core.{name}")
    found = sorted((Path(__file__).resolve().parents[2] / "assignments").glob(f"a[0-9]*_{name}.py"))
    if not found:
        raise ModuleNotFoundError("LABSUPPORT_IMPL=assignments, but there is no "
                                  f"assignments/a*_{name}.py")
    try:
        module = importlib.import_module(f"assignments.{found[0].stem}")
    except ModuleNotFoundError as exc:
        if exc.name != "assignments":
            raise
        raise ModuleNotFoundError("this environment does not have the course's assignments/ "
                                  "installed: run `make setup` (it reinstalls the course, "
                                  "assignments/ included)") from None
    print(f"LABSUPPORT_IMPL=assignments: core.{name} is your assignments/{found[0].name}")
    return module


def _stub(node: ast.FunctionDef) -> bool:
    """Whether a function's body (after its docstring) is only ``raise NotImplementedError``."""
    body = node.body[1:] if ast.get_docstring(node) is not None else node.body
    if len(body) != 1 or not isinstance(body[0], ast.Raise):
        return False
    exc = body[0].exc.func if isinstance(body[0].exc, ast.Call) else body[0].exc
    return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"


def student_copy_note() -> str | None:
    """In a student copy (``make student-repo``: the cores call the learner's ``assignments/``), a
    line saying so and which assignments still hold stubs, for a lab's banner; None in the course's
    repository."""
    root = Path(__file__).resolve().parents[2]
    if not any("# student copy: your Assignment" in p.read_text()
               for p in (root / "labsupport" / "core").glob("*.py")):
        return None
    todo = [p.name for p in sorted((root / "assignments").glob("a[0-9]*_*.py"))
            if any(isinstance(n, ast.FunctionDef) and _stub(n)
                   for n in ast.walk(ast.parse(p.read_text())))]
    state = (
        (
            "not written yet: " + ", ".join(todo) + "; a cell that reaches one stops with "
            "NotImplementedError naming it"
        )
        if todo
        else "all written"
    )
    return (f"Student copy: labsupport's cores run your assignments/ ({state}). make grade checks "
            "them.")
