"""``make student-repo DEST=...``: a copy of the repository to hand out, without the reference bodies of what the
assignments ask.

Every file that git tracks (or would track) is copied, except the seeded bugs (``grading/bugs/``: each is a
reference with one mistake), the instructor's hidden tests (``grading/hidden/``; ``grading/hidden.py``) and the
tests that prove the grader and the copy (``tests/test_grading.py``, ``tests/test_student_repo.py``). Then each
function or class that an assignment asks for is found where ``grading/reference.py`` says its reference lives,
and its body is replaced by a call to the learner's ``assignments/`` (a class by an import of the learner's): the
package, the labs and ``IMPL=reference`` all run on the learner's code, and score 0 until it is written. So each
stub must take the parameters its reference takes (``check_signatures``). The assignment files are written as
stubs (every body ``raise NotImplementedError``, naming its assignment), whatever this checkout's hold.
``--solved`` pastes the reference into the copy's ``assignments/``, to check the copy (``tests/test_student_repo.py``).
"""

from __future__ import annotations

import argparse
import ast
import builtins
import importlib
import inspect
import shutil
import subprocess
import sys
from pathlib import Path

from grading import hidden
from grading import impl as impls
from grading.impl import body_start, first_line, stub_source

ROOT = impls.ROOT
LEFT_OUT = ("grading/bugs/", hidden.FOLDER, "tests/test_grading.py", "tests/test_student_repo.py")


def tracked_files(root: Path = ROOT) -> list[str]:
    """The repository's files as git sees them: tracked, plus untracked ones that are not ignored."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         check=True, capture_output=True).stdout.decode()
    return sorted({f for f in out.split("\0") if f and (root / f).is_file()})


def asked(module: str) -> list[str]:
    """The public functions and classes that ``assignments/<module>.py`` defines: what the learner writes."""
    tree = ast.parse((impls.ASSIGNMENTS / f"{module}.py").read_text())
    return [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and not n.name.startswith("_")]


def _call(node: ast.FunctionDef, target: str) -> str:
    """``target(a, b, *args, k=k, **kw)``: a call passing on ``node``'s parameters as they came."""
    a = node.args
    parts = [p.arg for p in a.posonlyargs + a.args]
    parts += [f"*{a.vararg.arg}"] if a.vararg else []
    parts += [f"{p.arg}={p.arg}" for p in a.kwonlyargs]
    parts += [f"**{a.kwarg.arg}"] if a.kwarg else []
    return f"{target}({', '.join(parts)})"


def replace(source: str, name: str, lines_for) -> str:
    """``source`` with the top-level function or class ``name`` rewritten: ``lines_for(node, indent)`` gives the
    lines that replace a function's body (after its docstring), or a whole class."""
    tree = ast.parse(source)
    node = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name), None)
    if node is None:
        raise SystemExit(f"no top-level {name} in this source: grading/reference.py points at the wrong place")
    lines = source.splitlines(keepends=True)
    if isinstance(node, ast.ClassDef):
        start = first_line(node)
        return "".join(lines[:start - 1] + lines_for(node, "") + lines[node.end_lineno:])
    indent = " " * node.body[0].col_offset
    start = body_start(node)
    return "".join(lines[:start - 1] + lines_for(node, indent) + lines[node.end_lineno:])


def delegate(module: str, key: str):
    """``lines_for`` for ``replace``: the learner's function (or class) of ``assignments/<module>.py``."""
    note = f"  # student copy: your Assignment {key[1:]} (assignments/{module}.py; make grade)"

    def lines_for(node, indent: str) -> list[str]:
        if isinstance(node, ast.ClassDef):
            return [f"from assignments.{module} import {node.name}{note}\n"]
        return [f"{indent}from assignments import {module}{note}\n",
                f"{indent}return {_call(node, f'{module}.{node.name}')}\n"]

    return lines_for


def check_signatures() -> None:
    """Refuse a copy whose wiring would break correct work: each function an assignment asks for (and each method
    of a class it asks for) must take the parameters its reference takes, since the copy's package calls the
    learner's function with whatever the course's code passed to the reference."""
    wrong = []
    for key, module in impls.files().items():
        ref, stub = impls.load("reference", key), impls.load("stubs", key)
        for name in asked(module):
            mine, theirs = getattr(stub, name), inspect.unwrap(getattr(ref, name))
            pairs = [(name, mine, theirs)] if not inspect.isclass(mine) else [
                (f"{name}.{m}", getattr(mine, m), getattr(theirs, m)) for m, f in vars(mine).items()
                if inspect.isfunction(f) and (m == "__init__" or not m.startswith("_"))]
            wrong += [f"  {where}: assignments/{module}.py has {inspect.signature(inspect.unwrap(a))}, the reference "
                      f"{inspect.signature(inspect.unwrap(b))}" for where, a, b in pairs
                      if str(inspect.signature(inspect.unwrap(a))) != str(inspect.signature(inspect.unwrap(b)))]
    if wrong:
        raise SystemExit("the stubs' signatures differ from their references' (grading/reference.py), so the copy's "
                         "package would call the learner's code with parameters it does not take:\n" + "\n".join(wrong)
                         + "\ndeclare the reference's parameters in the stub (with their defaults), or drop them from "
                         "the reference and its callers")


def unwrapping(names: dict[str, list[str]]) -> str:
    """The lines the copy's ``grading/reference.py`` ends with: each of the package's functions that calls the
    learner's unwraps to it (``inspect.unwrap``), so that a test which patches what an implementation's module
    reads (its ``__globals__``) patches the learner's module under ``IMPL=reference`` too."""
    listed = "".join(f"    {k!r}: {v!r},\n" for k, v in names.items())
    return f"""

# Student copy: the functions above call yours (assignments/); each unwraps to yours (inspect.unwrap), so that
# IMPL=reference grades your code through the package's wiring as IMPL=assignments grades it directly.
_ASKED = {{
{listed}}}


def _unwrap_to_yours() -> None:
    from grading.impl import load

    for key, asked in _ASKED.items():
        for name in asked:
            ours, yours = getattr(globals()[key], name), getattr(load("assignments", key), name)
            if ours is not yours:
                ours.__wrapped__ = yours


_unwrap_to_yours()
"""


def build(dest: Path) -> list[str]:
    """Write the student copy into ``dest`` (new or empty); returns the files whose reference bodies went."""
    dest = dest.resolve()
    if dest == ROOT or ROOT in dest.parents:
        raise SystemExit(f"DEST={dest} is inside the repository; choose a folder outside it")
    if dest.exists() and any(dest.iterdir()):
        raise SystemExit(f"DEST={dest} exists and is not empty")
    check_signatures()
    for f in tracked_files():
        if not f.startswith(LEFT_OUT):
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dest / f)
    changed = set()
    for key, module in impls.files().items():
        ref = impls.load("reference", key)
        for name in asked(module):
            src = Path(inspect.getsourcefile(inspect.unwrap(getattr(ref, name)))).resolve()
            target = dest / src.relative_to(ROOT)
            target.write_text(replace(target.read_text(), name, delegate(module, key)))
            changed.add(str(src.relative_to(ROOT)))
        path = dest / "assignments" / f"{module}.py"
        path.write_text(stub_source(path.read_text(), module))
    reference = dest / "grading" / "reference.py"
    reference.write_text(reference.read_text() + unwrapping({k: asked(m) for k, m in impls.files().items()}))
    for f in changed | {f"assignments/{m}.py" for m in impls.files().values()}:
        compile((dest / f).read_text(), f, "exec")  # every rewritten file still parses
    return sorted(changed)


def _free_names(nodes: list[ast.AST], module_source: str) -> list[str]:
    """The names ``nodes`` read that neither they nor ``module_source``'s top level define (nor builtins)."""
    defined = set(dir(builtins))
    for n in ast.parse(module_source).body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(n.name)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            defined |= {(a.asname or a.name).split(".")[0] for a in n.names}
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            defined |= {t.id for t in ast.walk(n) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)}
    read = []
    for node in (w for n in nodes for w in ast.walk(n)):
        if isinstance(node, ast.Name):
            (read.append(node.id) if isinstance(node.ctx, ast.Load) else defined.add(node.id))
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            defined.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
    return [n for n in dict.fromkeys(read) if n not in defined]


def solved_source(key: str, module: str) -> str:
    """``assignments/<module>.py`` as handed out, with the reference pasted in: each function's body (after the
    stub's docstring) and each class whole, plus imports of what they read from the reference's module (its
    private helpers, which stay in the student copy)."""
    source = stub_source((impls.ASSIGNMENTS / f"{module}.py").read_text(), module)
    ref, imports = impls.load("reference", key), []
    for name in asked(module):
        obj = inspect.unwrap(getattr(ref, name))
        home = inspect.getmodule(obj)
        lines = Path(inspect.getsourcefile(obj)).read_text().splitlines(keepends=True)
        node = next(n for n in ast.parse("".join(lines)).body
                    if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == obj.__name__)
        if isinstance(node, ast.ClassDef):
            pasted, read = lines[first_line(node) - 1:node.end_lineno], [node]
        else:
            params = [ast.arg(a.arg) for a in ast.walk(node.args) if isinstance(a, ast.arg)]  # (not annotations)
            pasted = lines[body_start(node) - 1:node.end_lineno]
            read = params + node.body[ast.get_docstring(node) is not None:]
        source = replace(source, name, lambda *_, pasted=pasted: pasted)
        for free in _free_names(read, source):
            value = vars(home)[free]
            alias = "" if not inspect.ismodule(value) or value.__name__ == free else f" as {free}"
            imports.append(f"import {value.__name__}{alias}\n" if inspect.ismodule(value)
                           else f"from {home.__name__} import {free}\n")
    tail = ["\n", "# the reference's helpers, which the student copy keeps\n", *dict.fromkeys(imports)]
    return source + "".join(tail if imports else [])


def solve(dest: Path) -> None:
    """Paste the reference into the student copy at ``dest`` (its ``assignments/``): what a learner who got every
    assignment right hands in. The copy must then grade full marks and run the labs (tests/test_student_repo.py);
    an instructor can check a copy so before handing it out. Never hand out a solved copy."""
    if hasattr(importlib.import_module("grading.reference"), "_ASKED"):
        raise SystemExit("this is a student copy: its reference is the learner's code; run --solved in the course's "
                         "repository")
    for key, module in impls.files().items():
        (dest / "assignments" / f"{module}.py").write_text(solved_source(key, module))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m grading.student_repo", description=__doc__.splitlines()[0])
    ap.add_argument("dest", type=Path, help="a new (or empty) folder outside this repository")
    ap.add_argument("--solved", action="store_true", help="also paste the reference into the copy's assignments/, "
                    "to check the copy (make grade there gives full marks); never hand a solved copy out")
    a = ap.parse_args(argv)
    changed = build(a.dest)
    if a.solved:
        solve(a.dest)
        print(f"SOLVED: {a.dest.resolve()}/assignments/ holds the reference; do not hand this copy out")
    print(f"student copy in {a.dest.resolve()}: the reference bodies of the assignments are gone from "
          f"{', '.join(changed)}; seeded bugs left out. Next: cd {a.dest} && git init && git add -A && git commit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
