"""``make student-repo DEST=...``: a copy of the repository to hand out, without the reference bodies of what the
assignments ask.

Every file that git tracks (or would track) is copied, except the seeded bugs (``grading/bugs/``: each is a
reference with one mistake) and their proof (``tests/test_grading.py``). Then each function or class that an
assignment asks for is found where ``grading/reference.py`` says its reference lives, and its body is replaced
by a call to the learner's ``assignments/`` (a class by an import of the learner's): the package, the labs and
``IMPL=reference`` all run on the learner's code, and score 0 until it is written. The assignment files are
written as stubs (every body ``raise NotImplementedError``), whatever this checkout's hold.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import shutil
import subprocess
import sys
from pathlib import Path

from grading import impl as impls
from grading.impl import body_start, first_line, stub_source

ROOT = impls.ROOT
LEFT_OUT = ("grading/bugs/", "tests/test_grading.py")


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


def build(dest: Path) -> list[str]:
    """Write the student copy into ``dest`` (new or empty); returns the files whose reference bodies went."""
    dest = dest.resolve()
    if dest == ROOT or ROOT in dest.parents:
        raise SystemExit(f"DEST={dest} is inside the repository; choose a folder outside it")
    if dest.exists() and any(dest.iterdir()):
        raise SystemExit(f"DEST={dest} exists and is not empty")
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
        path.write_text(stub_source(path.read_text()))
    for f in changed | {f"assignments/{m}.py" for m in impls.files().values()}:
        compile((dest / f).read_text(), f, "exec")  # every rewritten file still parses
    return sorted(changed)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m grading.student_repo", description=__doc__.splitlines()[0])
    ap.add_argument("dest", type=Path, help="a new (or empty) folder outside this repository")
    a = ap.parse_args(argv)
    changed = build(a.dest)
    print(f"student copy in {a.dest.resolve()}: the reference bodies of the assignments are gone from "
          f"{', '.join(changed)}; seeded bugs left out. Next: cd {a.dest} && git init && git add -A && git commit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
