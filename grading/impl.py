"""Which implementation the grader grades: ``IMPL`` names it.

- ``assignments`` (the default): your files in ``assignments/``;
- ``reference``: the course's own code (``grading/reference.py`` says where each assignment's lives);
- ``stubs``: ``assignments/`` as handed out: every function body replaced by ``raise NotImplementedError``;
- a seeded bug, e.g. ``a2_misaligned`` (a module of ``grading/bugs/``, defining only the function it breaks):
  its assignment with one realistic bug, every other assignment the reference. They prove that the tests
  can fail (``tests/test_grading.py``).

Several, comma-separated (``IMPL=reference,stubs``), are graded in one run; a test runs once per distinct
implementation of its assignment. ``bugs`` stands for every seeded bug (``IMPL=reference,stubs,bugs``).
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import sys
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ASSIGNMENTS = ROOT / "assignments"
BASES = ("assignments", "reference", "stubs")


def files() -> dict[str, str]:
    """Assignment key -> its module in ``assignments/``: ``{"a1": "a1_timeline", ...}``, in order."""
    names = sorted((p.stem for p in ASSIGNMENTS.glob("a[0-9]*_*.py")), key=lambda n: int(n.split("_")[0][1:]))
    return {n.split("_")[0]: n for n in names}


def bugs() -> list[str]:
    """The seeded bugs in ``grading/bugs/`` (none in a student copy)."""
    folder = Path(__file__).parent / "bugs"
    return sorted(m.name for m in pkgutil.iter_modules([str(folder)])) if folder.is_dir() else []


def expand(value: str) -> list[str]:
    """The implementations a comma-separated ``IMPL`` names, in order (``bugs``: every seeded bug)."""
    names = [v.strip() for v in value.split(",") if v.strip()]
    return list(dict.fromkeys(b for n in names for b in (bugs() if n == "bugs" else [n])))


def check(impl: str) -> None:
    """Refuse an unknown ``IMPL`` with the names that exist."""
    if impl not in BASES and impl not in bugs():
        raise SystemExit(f"IMPL={impl!r} is not an implementation here; use one of {', '.join(BASES)}"
                         + (f", or a seeded bug: {', '.join(bugs())}" if bugs() else ""))


def effective(impl: str, key: str) -> str:
    """What grades assignment ``key`` under ``impl``: the implementation itself, or for a bug of another
    assignment the reference."""
    if impl in BASES:
        return impl
    return f"bugs.{impl}" if impl.split("_")[0] == key else "reference"


def load(name: str, key: str) -> Any:
    """The object whose attributes are assignment ``key``'s functions under the effective implementation
    ``name`` (a module, or the reference's namespace)."""
    if name == "assignments":
        return importlib.import_module(f"assignments.{files()[key]}")
    if name == "reference":
        return getattr(importlib.import_module("grading.reference"), key)
    if name == "stubs":
        return _stubs(files()[key])
    if name.startswith("bugs."):  # the bug's functions over the reference's
        bug, ref = importlib.import_module(f"grading.{name}"), load("reference", key)
        own = {n: f for n, f in vars(bug).items() if getattr(f, "__module__", None) == bug.__name__}
        return types.SimpleNamespace(**{**{n: getattr(ref, n) for n in dir(ref) if not n.startswith("_")}, **own})
    raise ValueError(f"unknown implementation {name!r}")


def _stubs(module: str) -> types.ModuleType:
    """``assignments/<module>.py`` with every function body replaced by ``raise NotImplementedError``."""
    full = f"grading.stubs.{module}"
    if full not in sys.modules:
        path = ASSIGNMENTS / f"{module}.py"
        source = stub_source(path.read_text(), module)
        mod = types.ModuleType(full, ast.get_docstring(ast.parse(source)))
        mod.__file__ = str(path)
        sys.modules[full] = mod
        exec(compile(source, str(path), "exec"), mod.__dict__)
    return sys.modules[full]


def first_line(node: ast.stmt) -> int:
    """A statement's first line, its decorators included."""
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])


def body_start(node: ast.FunctionDef) -> int:
    """The first line (1-based) after the function's docstring, or of its first statement."""
    if ast.get_docstring(node) is None:
        return first_line(node.body[0])
    return first_line(node.body[1]) if len(node.body) > 1 else node.body[0].end_lineno + 1


def stub_source(source: str, module: str | None = None) -> str:
    """An assignment file with every function's and method's body ``raise NotImplementedError``; given its
    ``module`` (``a4_handoff``), the error names the file, the function and the assignment, so that a lab that
    reaches a function not written yet says which."""
    tree = ast.parse(source)
    funcs = sorted((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))),
                   key=lambda n: -n.lineno)  # bottom up: line numbers above stay valid
    lines = source.splitlines(keepends=True)
    classes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    for n in funcs:
        if any(n is not m and m.lineno <= n.lineno <= m.end_lineno for m in funcs if m.lineno < n.lineno):
            continue  # nested in a function that is stubbed whole
        indent = " " * n.body[0].col_offset
        owner = [c.name for c in classes if c.lineno <= n.lineno <= c.end_lineno]
        name = ".".join(owner[-1:] + [n.name])
        why = f'("Assignment {module.split("_")[0][1:]} (assignments/{module}.py): {name}")' if module else ""
        lines[body_start(n) - 1:n.end_lineno] = [f"{indent}raise NotImplementedError{why}\n"]
    return "".join(lines)
