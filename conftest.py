"""Test configuration: the ``gpu(n)`` marker, and nbval over the labs' MyST sources.

Labs are written as jupytext MyST notebooks (``labs/lab_NN_*.md``). nbval only collects ``.ipynb``, so
each lab is read through jupytext by a small subclass of nbval's collector. A lab's front matter
``lab: {min_gpus: N}`` decides its path: the GPU path when this machine has N GPUs, otherwise the CPU
path; the collected notebook's items are labelled with the path so the summary says which ran.
It lives at the repository root because pytest applies a conftest only to the folder below it,
and the labs sit beside ``tests/``. Run labs with ``pytest labs/`` (``make test`` does).

With ``LABSUPPORT_RECORD_DIR`` set (the GPU reference run sets it), each lab that ran is also written there,
executed, as ``<lab>.<machine tag>.ipynb``: its cells with the outputs this run produced, and in its metadata
(``labsupport_recording``) the commit, date, machine, versions and which cells failed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from queue import Empty

import jupytext
import nbval.plugin
import pytest
from nbval.plugin import IPyNbFile

ROOT = Path(__file__).resolve().parent
LABS = ROOT / "labs"

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


def _gpu_count() -> int:
    from labsupport.course.hardware import gpu_count

    return gpu_count()


def pytest_configure(config: pytest.Config) -> None:
    # nbval: run in this interpreter's environment, fail only on errors (labs assert what matters)
    if hasattr(config.option, "nbval_lax"):
        config.option.nbval_lax = True
        config.option.nbval_current_env = True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from labsupport.course.hardware import skip_gpu_tests

    skip_gpu_tests(items)


def _lab_min_gpus(md_path: Path) -> int:
    from labsupport.course.hardware import lab_min_gpus  # one reader of the front matter (labsupport.course.hardware's)

    return lab_min_gpus(md_path)


def pytest_collect_file(file_path: Path, parent: pytest.Collector):
    if file_path.suffix == ".md" and file_path.parent == LABS and file_path.name.startswith("lab_"):
        need = _lab_min_gpus(file_path)
        lab = LabNotebook.from_parent(parent, path=file_path)
        lab.lab_path = "GPU" if need and _gpu_count() >= need else "CPU"
        return lab
    return None


class LabNotebook(IPyNbFile):
    """nbval's notebook collector, reading the lab's MyST source through jupytext."""

    def collect(self):
        read = nbval.plugin.nbformat.read

        def read_md(path, as_version=4):
            nb = jupytext.read(path)
            nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
            return nb

        nbval.plugin.nbformat.read = read_md  # nbval reads with nbformat.read(path); only .md reach here
        try:
            yield from super().collect()
        finally:
            nbval.plugin.nbformat.read = read

    def setup(self):
        super().setup()
        kernel, get = self.kernel, self.kernel.get_message

        def get_message(stream, timeout=None):
            """nbval waits the whole cell timeout (30 min) for a kernel that has died: look every 5 s instead."""
            end = None if timeout is None else time.monotonic() + timeout
            while True:
                try:
                    return get(stream, timeout=5.0 if end is None else max(0.0, min(5.0, end - time.monotonic())))
                except Empty:
                    if not kernel.is_alive():
                        proc = getattr(getattr(kernel.km, "provisioner", None), "process", None)
                        code = proc.poll() if proc is not None else None
                        raise RuntimeError(f"the lab's kernel died while this cell ran (exit code {code}; "
                                           "-11 is a segmentation fault): its stderr is printed above") from None
                    if end is not None and time.monotonic() >= end:
                        raise

        kernel.get_message = get_message


def pytest_runtest_teardown(item: pytest.Item) -> None:
    # nbval keeps what a cell printed in item.test_outputs; item.cell is the cell of the collected notebook
    if os.environ.get("LABSUPPORT_RECORD_DIR") and getattr(item, "test_outputs", None) is not None:
        item.cell.outputs = [_trim(out) for out in item.test_outputs]


def _trim(out, limit: int = 20_000):
    """Keep a recorded notebook small: a long stream keeps its first and last lines, figures get 256 colours."""
    if out.get("output_type") == "stream" and len(out.get("text", "")) > limit:
        text = out["text"]
        out["text"] = text[: limit // 2] + "\n[... output trimmed in the recording ...]\n" + text[-limit // 2:]
    if "image/png" in out.get("data", {}):
        out["data"]["image/png"] = small_png(out["data"]["image/png"])
    return out


def small_png(data: str) -> str:
    """A base64 PNG re-encoded with a 256-colour palette: a plot looks the same at about a third of the size."""
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.open(io.BytesIO(base64.b64decode(data))).quantize(256, method=Image.Quantize.FASTOCTREE).save(
        buf, "PNG", optimize=True)
    small = base64.b64encode(buf.getvalue()).decode()
    return small if len(small) < len(data) else data


def _commit() -> str | None:
    if os.environ.get("LABSUPPORT_COMMIT"):
        return os.environ["LABSUPPORT_COMMIT"]
    if (ROOT / "COMMIT").exists():  # a snapshot (git archive) made for a GPU machine carries its commit
        return (ROOT / "COMMIT").read_text().strip()
    import subprocess

    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or None


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    out_dir = os.environ.get("LABSUPPORT_RECORD_DIR")
    if not out_dir:
        return
    import datetime

    import nbformat

    from labsupport.course import results

    info = results.machine_info()
    labs = {item.parent for item in session.items if isinstance(item.parent, LabNotebook)}
    for lab in labs:
        cells = [item for item in session.items if item.parent is lab]
        ran = [item for item in cells if item.test_outputs is not None]
        if not ran:
            continue
        failed = [item.cell_num for item in cells if getattr(item, "lab_failed", False)]
        lab.nb.metadata["labsupport_recording"] = {
            "lab": Path(str(lab.path)).name, "path": lab.lab_path, "commit": _commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": info, "machine_tag": results.machine_tag(info), "versions": results.versions(),
            "code_cells": len(cells), "cells_run": len(ran), "failed_cells": failed,
        }
        path = Path(out_dir) / f"{Path(str(lab.path)).stem}.{results.machine_tag(info)}.ipynb"
        path.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(lab.nb, path)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if call.when == "call" and report.failed:
        item.lab_failed = True
    return report


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
