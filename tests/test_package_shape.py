"""The package's shape against its budgets (shared/DESIGN.md): small, no circle, each idea once, read in order.

A budget may be wrong: if a change must exceed one, change the number here and say why in the commit.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import labsupport

PKG = Path(labsupport.__file__).parent
# core/ and the hardened mechanisms together (not course/, rl/, experiments/, bench/): the reading the design promises
# in 4,000 lines. The redesign took them from 5,435 to 4,788 while adding the deadlines and fault checks; passes on
# duplicates, docstrings and fast_update, and the fault table's fixes, left 4,808. Then the lab experiments
# (strategies, after_update, cluster) moved into experiments/, which the labs drive and no mechanism imports, and
# core/ gained devices.py and colocated.py (the co-located turn, whose trainer bucket fast_update now keeps for the
# capstone too): 4,110. The target stays 4,000: broadcast built on core.sync's phases, and one home for a worker's
# update group and for loading received views, are the rest. Lower this as modules shrink; raise it only with a
# reason here.
# Then core.sync's four phases with broadcast built on them, one in-place load, one worker update group
# (UpdateGroup), the bucketed update's old layers kept aside on the device or pinned host (all or nothing at line
# rate), and the IPC handles' lookup in vllm_handles: 4,164. Still to go: lora's lab helpers (train, generate,
# send_*) into experiments/, and the hardened modules' longest docstrings. Then lora's lab helpers moved out
# (experiments.lora_demo) and vllm_plan came in: the planned bucketed NCCL receive (issue 47's update at line
# rate: per-bucket copy plans checked against vLLM's loader once, old bytes aside, phase timers): 4,273, at
# up to 120 columns. Then every line of labsupport/ within 100 columns (ruff, below): wrapped as they were, the
# mechanisms would have held about 4,860 lines; a first pass (docstrings said once, duplicated code inside files
# made one, two trainer-side helpers into vllm_handles) left 4,406, a second (one split function for row and
# column parallelism in reshard, helpers used once inlined, one guard read per receiver in shm, the receiver's
# double buffering without its slot table, weak values for saved activations) 4,033. The target stays 4,000
# (issue 50): what is left is code, the error messages' advice and the docstrings' lists of what guards against
# what, so the last lines ask for a smaller mechanism, not fewer words. Then two fixes the GPU asked for: the
# trainer's check before a mapped sync compares objects and addresses instead of walking names (the sync at 85 %
# of the copy floor, issue 46), and a timed-out IPC bucket freed once its engine answers again (the fault table's
# hung_rpc_ipc left it for the process's life): 4,081. Then issue 50's last cut: one home for running a call on a
# thread (groups.in_thread) and for an update's announcement (vllm_ext.announced), helpers used once inlined, and
# apparatus moved into experiments/ (Lab 7's gather modes a and b, the in-process weight-sync client, Lab 8's
# adapter byte count): 3,990; the boot id read where the host has one: 3,991; a kept export's fields named
# (ipc.Kept): 3,992; push_ipc checks the whole update before its first bucket (a missing layer is refused
# before any bucket lands: no mix of old and new layers): 3,998; a timed-out engine refused through every
# wrapper of its core (a late push stops at its next bucket): 4,000, the target. Raised for a reason: push_ipc all
# or nothing across its buckets and the engine's TP ranks (a bucket failing on one worker after others loaded left
# the engine serving a mix): each worker keeps what it replaced until every bucket landed everywhere (begin/end,
# the worker's begin_update/end_update), and an engine whose undo fails is refused: 4,048. Then the same for vLLM's
# native API over gloo (a load failing in finish_weight_update on one TP rank left the others loaded): the workers
# and the trainer vote after the loads (vllm_plugin.load_vote), every rank puts its layers back on a failure, and
# the trainer raises it (a worker raising there would put vLLM 0.32's later replies out of order): 4,075. Then the
# same for an update in one call (the capstone's safe path: a load failing after some layers left those loaded):
# push_ipc's begin and end as a context manager that any update enters (vllm_ext.whole_update): 4,079. Then vLLM
# 0.32's own NCCL trainer given the deadlines 0.26's has from us (its set-up and send waited on NCCL and on its
# client with none; after a timeout the engine is refused, so no send starts beside the stuck one): 4,092. And the
# native round's update_weights or failed-update finish past its deadline refuses the engine too (a late one kept
# running beside the next round's start): 4,095; that refusal moved into alongside itself (its engine's side past
# the deadline refuses the engine it is given), and native_trainer's backends each in one branch: 4,091.
MECHANISM_LINES = 4091
FILE_LINES = 350  # any .py outside bench/
FUNCTION_LINES = 60  # any function outside bench/
# Lines <= 100 columns in labsupport/: ruff's E501 with pyproject.toml's line-length (editors read the same).


def _name(path: Path) -> str:
    """``labsupport/core/sync.py`` -> ``core.sync``; a package's ``__init__`` -> the package."""
    parts = path.relative_to(PKG).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


FILES = {_name(p): p for p in sorted(PKG.rglob("*.py"))}
NOT_BENCH = {n: p for n, p in FILES.items() if n != "bench" and not n.startswith("bench.")}
MECHANISMS = {n: p for n, p in NOT_BENCH.items()
              if n and n != "__main__" and not n.startswith(("course", "rl", "experiments"))}


def _type_only(tree: ast.Module) -> set[ast.AST]:
    """The nodes under ``if TYPE_CHECKING:``: imports that name a type for the reader and never run."""
    return {sub for node in ast.walk(tree) if isinstance(node, ast.If) and ast.unparse(node.test).endswith(
        "TYPE_CHECKING") for stmt in node.body for sub in ast.walk(stmt)}


def _imports(path: Path) -> dict[str, set[str]]:
    """The labsupport modules ``path`` imports (at any depth, but not for type checking only), with the names it
    takes from each."""
    out: dict[str, set[str]] = {}
    tree = ast.parse(path.read_text())
    skip = _type_only(tree)
    for node in ast.walk(tree):
        if node in skip:
            continue
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "labsupport":
            base = node.module.removeprefix("labsupport").lstrip(".")
            for a in node.names:
                full = f"{base}.{a.name}".lstrip(".")
                if full in FILES:  # ``from labsupport.core import sync``: the module core.sync
                    out.setdefault(full, set())
                else:  # ``from labsupport.core.sync import send``: the name send of core.sync
                    out.setdefault(base, set()).add(a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "labsupport":
                    out.setdefault(a.name.removeprefix("labsupport").lstrip("."), set())
    out.pop("", None)
    return out


IMPORTS = {n: _imports(p) for n, p in FILES.items()}


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_mechanisms_fit_their_budget():
    sizes = {n: _lines(p) for n, p in MECHANISMS.items()}
    total = sum(sizes.values())
    biggest = ", ".join(f"{n} {k}" for n, k in sorted(sizes.items(), key=lambda x: -x[1])[:6])
    assert total <= MECHANISM_LINES, f"mechanisms hold {total} lines (> {MECHANISM_LINES}); largest: {biggest}"


@pytest.mark.parametrize("name", sorted(NOT_BENCH))
def test_no_file_over_its_budget(name):
    assert _lines(NOT_BENCH[name]) <= FILE_LINES, f"{NOT_BENCH[name]}: {_lines(NOT_BENCH[name])} lines"


def test_no_line_over_100_columns():
    assert importlib.util.find_spec("ruff"), "ruff is missing: run `make setup` (it is in requirements.txt)"
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "json", str(PKG)],
                            capture_output=True, text=True, timeout=120, cwd=PKG.parent)
    assert result.returncode in (0, 1), result.stderr  # 1: it found something; 2: it could not run
    found = json.loads(result.stdout)
    wide = [f"{Path(f['filename']).relative_to(PKG)}:{f['location']['row']}" for f in found]
    assert not wide, (f"{len(wide)} lines over 100 columns (pyproject.toml's line-length): "
                      f"{', '.join(wide[:20])}; wrap them (`ruff format FILE` helps with code)")


def test_the_column_check_catches_a_wide_line(tmp_path):
    """Positive and negative controls: the project's ruff settings flag 101 columns, not 100."""
    for cols, flagged in ((100, False), (101, True)):
        f = tmp_path / f"w{cols}.py"
        f.write_text("x = " + repr("a" * (cols - 6)) + "\n")
        assert len(f.read_text().rstrip("\n")) == cols
        got = subprocess.run([sys.executable, "-m", "ruff", "check", "--config",
                              str(PKG.parent / "pyproject.toml"), "--output-format", "json", str(f)],
                             capture_output=True, text=True, timeout=120)
        assert bool(json.loads(got.stdout)) == flagged, (cols, got.stdout, got.stderr)


def test_no_function_over_its_budget():
    long = [f"{p.relative_to(PKG)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for p in NOT_BENCH.values() for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > FUNCTION_LINES]
    assert not long, "functions over budget: " + "; ".join(long)


def _cycle() -> list[str] | None:
    """One import circle between modules (a package counts as its ``__init__``), or None."""
    graph = {n: {m for m in IMPORTS[n] if m in FILES and m != n} for n in FILES}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        state[n] = 2
        stack.pop()
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_import_circle():
    cycle = _cycle()
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_no_module_takes_another_modules_private_name():
    bad = []
    for n, path in FILES.items():
        tree = ast.parse(path.read_text())
        aliases = {}  # local name -> labsupport module, for ``from labsupport import x`` / ``import labsupport.x as y``
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "labsupport":
                base = node.module.removeprefix("labsupport").lstrip(".")
                for a in node.names:
                    full = f"{base}.{a.name}".lstrip(".")
                    if full in FILES:
                        aliases[a.asname or a.name] = full
                    elif a.name.startswith("_") and base != n:
                        bad.append(f"{n} imports {base}.{a.name}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and aliases[node.value.id] != n
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                bad.append(f"{n} uses {aliases[node.value.id]}.{node.attr}")
    assert not bad, "; ".join(sorted(set(bad)))


def _reading_order() -> list[str]:
    """The modules in the order the package docstring lists them (each bullet's first ``name``)."""
    return re.findall(r"^- ``([\w.]+)``", labsupport.__doc__ or "", re.M)


def test_reading_order_lists_every_module_once():
    order = _reading_order()
    modules = {n for n in NOT_BENCH if n and n not in ("__main__", "course", "core", "experiments")
               and not (n.startswith("rl.") and n not in order)}  # rl's modules may be listed one by one
    assert len(order) == len(set(order)), "a module is listed twice"
    assert set(order) == modules, (f"not listed: {sorted(modules - set(order))}; "
                                   f"listed but no module: {sorted(set(order) - modules)}")


def test_reading_order_is_a_dependency_order():
    """Every module comes after each module it imports, so a reader never meets a name before its home."""
    order = _reading_order()
    where = {n: i for i, n in enumerate(order)}

    def listed(m: str) -> str | None:  # an rl module not listed on its own is read as part of rl
        return m if m in where else ("rl" if m.startswith("rl.") else None)

    late = []
    for n in order:
        members = [n] if n != "rl" else [m for m in FILES if listed(m) == "rl"]
        for member in members:
            for m in IMPORTS[member]:
                target = listed(m)
                if target and target != n and where[target] > where[n]:
                    late.append(f"{member} imports {m}, listed later")
    assert not late, "; ".join(late)


def _layer(module: str) -> str:
    """Which layer a module belongs to: its folder (``core``, ``course``, ``rl``, ``experiments``), or the hardened
    mechanisms at the top level."""
    top = module.split(".")[0]
    return top if top in ("core", "course", "rl", "experiments") else "mechanisms"


def _layers() -> list[str]:
    """The layers in the order the package docstring's reading order first lists a module of each."""
    return list(dict.fromkeys(_layer(n) for n in _reading_order()))


def test_the_reading_order_reads_one_layer_at_a_time_from_the_core():
    """The docstring lists the core first, then the apparatus, the mechanisms, the capstone and the experiments,
    each layer's modules together (its chapters' headings may split them)."""
    order = _reading_order()
    runs = [_layer(n) for i, n in enumerate(order) if i == 0 or _layer(n) != _layer(order[i - 1])]
    assert runs == _layers(), f"a layer is listed in two places: {runs}"
    assert _layers() == ["core", "course", "mechanisms", "rl", "experiments"], _layers()


def test_no_import_runs_back_up_the_layers():
    """Each module imports only its own layer and the layers listed before it; nothing but the command line
    imports a benchmark; and the core stands on nothing outside core/ (torch and the standard library aside)."""
    rank = {layer: i for i, layer in enumerate(_layers())}
    up = [f"{n} ({_layer(n)}) imports {m} ({_layer(m)})" for n in NOT_BENCH if n and n != "__main__"
          for m in IMPORTS[n] if m and m != "bench" and not m.startswith("bench.")
          and rank[_layer(m)] > rank[_layer(n)]]
    bench = [f"{n} imports {m}" for n in NOT_BENCH if n != "__main__" for m in IMPORTS[n]
             if m == "bench" or m.startswith("bench.")]
    outside_core = [f"{n} imports {m}" for n in FILES if _layer(n) == "core" and n != "" for m in IMPORTS[n]
                    if _layer(m) != "core"]
    assert not up + bench + outside_core, "; ".join(up + bench + outside_core)
