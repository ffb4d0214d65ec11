"""``make grade``: run the graded tests on one or more implementations and print the points.

``python -m grading [--impl IMPL[,IMPL...]] [--hidden DIR] [--json FILE] [--save NAME] [KEY ...]`` (KEY: ``a1``,
``a2``, ...; default all).
Per part: the tests passed, the points, and for each failing test what it expected; tests that need a GPU are
reported as skipped where there is none and count in neither number. The last line is ``score: X / Y``.

Any ``grading/test_<key>_<topic>.py`` whose tests carry ``@pytest.mark.points(n)`` is picked up (see
``grading/conftest.py``); nothing else needs registering.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from grading.hidden import is_hidden, staged

HERE = Path(__file__).resolve().parent


@dataclass
class Result:
    key: str  # "a1"
    module: str  # "test_a2_buckets.py"
    test: str  # the test function's name
    impl: str | None  # the effective implementation (None: not an implementation test)
    points: int
    outcome: str  # "passed", "failed", "skipped"
    message: str = ""
    hidden: bool = False  # one of the instructor's hidden tests (--hidden DIR; grading/hidden.py)


def test_files(keys: list[str]) -> list[Path]:
    """The graded test modules, in assignment order (``a1`` before ``a10``; other keys after)."""
    def order(p: Path) -> tuple:
        key = p.stem.removeprefix("test_").split("_")[0]
        return (0, int(key[1:]), p.name) if key[:1] == "a" and key[1:].isdigit() else (1, 0, p.name)

    found = sorted(HERE.glob("test_*.py"), key=order)
    return [p for p in found if not keys or p.stem.removeprefix("test_").split("_")[0] in keys]


def _function_at(path: str, line: int) -> str | None:
    """The name of the function in ``path`` whose body holds ``line`` (1-based), if any."""
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    inside = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
              and n.lineno <= line <= (n.end_lineno or n.lineno)]
    return inside[-1].name if inside else None


def _message(report) -> str:
    """What a failing test expected, in a line or two (its assertion's message, or the exception it met)."""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is None:
        return str(report.longrepr).strip().splitlines()[-1][:300]
    text = crash.message.split("\nassert ")[0].strip()
    if text.startswith("NotImplementedError"):
        where = text.partition(":")[2].strip() or _function_at(crash.path, crash.lineno) or "a function"
        return f"not implemented yet: {where} raises NotImplementedError"
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return " ".join(lines[:3])[:400]


class Collector:
    """A pytest plugin that keeps one Result per graded test (failing in setup, call or teardown counts)."""

    def __init__(self) -> None:
        self.results: dict[str, Result] = {}

    def pytest_runtest_logreport(self, report) -> None:
        item_path = Path(report.nodeid.split("::")[0])
        if HERE.name not in item_path.parts[:-1]:  # (grading/, or the hidden tests under it)
            return
        props = dict(report.user_properties)
        r = self.results.get(report.nodeid) or Result(
            item_path.stem.removeprefix("test_").split("_")[0], item_path.name, props.get("test", report.nodeid),
            props.get("impl"), props.get("points", 0), "passed", hidden=is_hidden(item_path))
        if report.skipped and r.outcome == "passed":
            r.outcome = "skipped"
            r.message = report.longrepr[2] if isinstance(report.longrepr, tuple) else "skipped"
        elif report.failed and r.outcome != "failed":
            r.outcome, r.message = "failed", _message(report)
        self.results[report.nodeid] = r

    def pytest_collection_modifyitems(self, items) -> None:
        for item in items:
            marker = item.get_closest_marker("points")
            params = dict(getattr(getattr(item, "callspec", None), "params", {}))
            impl = params.pop("impl", None)
            others = "-".join(str(v) for v in params.values())
            item.user_properties += [("points", int(marker.args[0]) if marker else 0), ("impl", impl),
                                     ("test", item.originalname + (f"[{others}]" if others else ""))]


def points(files: list[Path] | None = None) -> dict[str, dict[str, int]]:
    """Each part's points from its tests' markers, without running them: ``{"a1": {"cpu": 15, "gpu": 4}}``
    (``gpu``: the points of the tests that need GPUs)."""
    out: dict[str, dict[str, int]] = {}
    for p in files if files is not None else test_files([]):
        part = out.setdefault(p.stem.removeprefix("test_").split("_")[0], {"cpu": 0, "gpu": 0})
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef):
                marks = {d.func.attr: d.args[0].value for d in node.decorator_list
                         if isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.args
                         and isinstance(d.args[0], ast.Constant)}
                if "points" in marks:
                    part["gpu" if "gpu" in marks else "cpu"] += marks["points"]
    return out


def titles(files: list[Path]) -> dict[str, str]:
    """Each part's title: the first line of its test module's docstring."""
    out = {}
    for p in files:
        doc = ast.get_docstring(ast.parse(p.read_text())) or p.stem
        out.setdefault(p.stem.removeprefix("test_").split("_")[0], doc.splitlines()[0].rstrip("."))
    return out


def report(impl: str, results: list[Result], names: dict[str, str], effective) -> tuple[int, int, list[str]]:
    """The lines for one implementation, and its score: (points earned, points possible here)."""
    lines, total, possible = [], 0, 0
    for key, title in names.items():
        mine = [r for r in results if r.key == key and r.impl in (None, effective(impl, key))]
        ran = [r for r in mine if r.outcome != "skipped"]
        got = sum(r.points for r in ran if r.outcome == "passed")
        worth = sum(r.points for r in ran)
        total, possible = total + got, possible + worth
        passed = sum(r.outcome == "passed" for r in ran)
        lines.append(f"{title}")
        lines.append(f"  {passed}/{len(ran)} tests passed, {got}/{worth} points")
        for r in ran:
            if r.outcome == "failed":
                lines.append(f"    FAILED {'hidden ' * r.hidden}{r.test} ({r.points} points): {r.message}")
        for r in mine:
            if r.outcome == "skipped":
                lines.append(f"    skipped {r.test} ({r.points} points): {r.message}")
    return total, possible, lines


def grade(impls: list[str], keys: list[str] | None = None, pytest_args: list[str] | None = None,
          out=sys.stdout, hidden: Path | None = None) -> dict:
    """Run the graded tests of ``keys`` (all by default) on ``impls``, and those of the folder ``hidden``; print
    the report; return it as a dict."""
    import pytest

    from grading import impl as impl_mod

    for name in impls:
        impl_mod.check(name)
    collector = Collector()
    with staged(hidden) as extra:
        files = test_files(keys or []) + [p for p in extra if not keys or p.stem.split("_")[1] in keys]
        if not files:
            raise SystemExit(f"no graded tests for {keys} in {HERE}")
        args = [str(p) for p in files] + [f"--impl={','.join(impls)}", "-q", "--tb=no", "-rN", "-p",
                                          "no:cacheprovider", "--disable-warnings", *(pytest_args or [])]
        code = pytest.main(args, plugins=[collector])
        names = titles(files)  # (while the hidden files are there)
    results = list(collector.results.values())
    if code not in (0, 1) or not results:  # 1: some tests failed, which is a grade; anything else is not
        raise SystemExit(f"the graded tests could not run (pytest exit code {int(code)}); "
                         f"see the output above, or: python -m pytest {' '.join(str(p) for p in files)}")
    scores = {}
    for name in impls:
        total, possible, lines = report(name, results, names, impl_mod.effective)
        scores[name] = (total, possible)
        if len(impls) > 1:
            print(f"\n== IMPL={name}", file=out)
        print("\n".join(lines), file=out)
        print(f"score: {total} / {possible}" + (f"   (IMPL={name})" if len(impls) > 1 else ""), file=out)
    if len(impls) > 1:
        print("\n" + "\n".join(f"{n:>24}: {t} / {p}" for n, (t, p) in scores.items()), file=out)
    return {"scores": {n: {"points": t, "possible": p} for n, (t, p) in scores.items()},
            "results": [asdict(r) for r in results]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m grading", description=__doc__.splitlines()[0])
    ap.add_argument("keys", nargs="*", help="parts to grade (a1 a2 ...; default: all)")
    ap.add_argument("--impl", default=None, help="assignments (default), reference, stubs, or a seeded bug; "
                    "several comma-separated ('bugs': every seeded bug)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--save", metavar="NAME", help="also record them as results/NAME.<machine>.json, with the "
                    "machine, versions, command and date (LABSUPPORT_RESULTS_DIR: elsewhere)")
    ap.add_argument("--hidden", type=Path, metavar="DIR", help="also run the graded tests in DIR, the instructor's "
                    "hidden tests (grading/hidden.py)")
    ap.add_argument("--tb", action="store_true", help="show pytest's tracebacks of failing tests")
    ap.add_argument("--record", type=Path, default=Path("grade_record.json"), metavar="FILE",
                    help="grading one implementation: measure the GPU performance targets this machine can and "
                    "write the leaderboard record here (default: grade_record.json)")
    ap.add_argument("--no-targets", action="store_true", help="neither measure the targets nor write the record")
    a = ap.parse_args(argv)
    import os

    from grading import impl as impl_mod

    impls = impl_mod.expand(a.impl or os.environ.get("IMPL") or "assignments")
    data = grade(impls, a.keys, ["--tb=short"] if a.tb else [], hidden=a.hidden)
    if a.json:
        a.json.write_text(json.dumps(data, indent=1))
    command = "python -m grading " + " ".join(sys.argv[1:] if argv is None else argv)
    if len(impls) == 1 and not a.no_targets:
        leaderboard(impls[0], data, a.keys, a.record, command)
    if a.save:
        from labsupport.course.results import save_result

        print(f"recorded in {save_result(a.save, data, command=command)}", file=sys.stderr)  # (last line: the score)
    return 0


def leaderboard(impl: str, data: dict, keys: list[str], path: Path, command: str) -> None:
    """Measure the performance targets (``grading/targets.py``) this machine has the GPUs for, print them, and
    write the record of ``impl``'s score and targets that a class puts on a leaderboard."""
    from grading import targets

    rows = targets.measure(impl, keys)
    print("\n".join(targets.report(rows)), file=sys.stderr)  # (stdout's last line stays the score)
    rec = targets.record(impl, data, rows, command)
    out = targets.write(path, rec)
    print(f"leaderboard record: {out}", file=sys.stderr)
    if impl == "reference" and any(r["status"] == "measured" for r in rows):  # the staff's bar for this GPU model
        from labsupport.course.results import RESULTS_DIR

        staff = targets.write(RESULTS_DIR / f"grade_record.reference.{rec['machine_tag']}.json", rec)
        print(f"the staff reference's ratios on this GPU model (the targets' bar): {staff}", file=sys.stderr)
