"""Test configuration: the ``gpu(n)`` marker, and nbval over the labs' MyST sources.

Labs are written as jupytext MyST notebooks (``labs/lab_NN_*.md``). nbval only collects ``.ipynb``, so
each lab is converted to ``labs/.nbval/<lab>.ipynb`` and collected from there. A lab's front matter
``lab: {min_gpus: N}`` decides its path: the GPU path when this machine has N GPUs, otherwise the CPU
path; the collected notebook's items are labelled with the path so the summary says which ran.
It lives at the repository root because pytest applies a conftest only to the folder below it,
and the labs sit beside ``tests/``. Run labs with ``pytest labs/`` (``make test`` does).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
LABS = ROOT / "labs"
NBVAL_DIR = LABS / ".nbval"

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


def _gpu_count() -> int:
    from labsupport.hardware import gpu_count

    return gpu_count()


def pytest_configure(config: pytest.Config) -> None:
    # nbval: run in this interpreter's environment, fail only on errors (labs assert what matters)
    if hasattr(config.option, "nbval_lax"):
        config.option.nbval_lax = True
        config.option.nbval_current_env = True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    have = _gpu_count()
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        need = int(marker.args[0]) if marker.args else 1
        if have < need:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} GPU(s), this machine has {have}"))


def _lab_min_gpus(md_path: Path) -> int:
    import jupytext

    nb = jupytext.read(md_path)
    return int(nb.metadata.get("lab", {}).get("min_gpus", 0))


def pytest_collect_file(file_path: Path, parent: pytest.Collector):
    if file_path.suffix != ".md" or file_path.parent != LABS or not file_path.name.startswith("lab_"):
        return None
    import jupytext
    from nbval.plugin import IPyNbFile

    NBVAL_DIR.mkdir(exist_ok=True)
    nb = jupytext.read(file_path)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    out = NBVAL_DIR / (file_path.stem + ".ipynb")
    jupytext.write(nb, out)
    need = _lab_min_gpus(file_path)
    have = _gpu_count()
    collector = IPyNbFile.from_parent(parent, path=out)
    collector.lab_path = "GPU" if need and have >= need else "CPU"
    collector.lab_min_gpus = need
    return collector


def pytest_itemcollected(item: pytest.Item) -> None:
    parent = item.parent
    if hasattr(parent, "lab_path"):
        item.user_properties.append(("lab_path", parent.lab_path))
        item._nodeid = f"{item.nodeid} [{parent.lab_path} path]"


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    labs = {}
    for rep in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", []):
        for key, val in getattr(rep, "user_properties", []):
            if key == "lab_path":
                labs[rep.nodeid.split("::")[0]] = val
    if labs:
        terminalreporter.write_sep("-", "labs and the path they took on this machine")
        for lab, path in sorted(labs.items()):
            terminalreporter.write_line(f"{lab}: {path} path")
