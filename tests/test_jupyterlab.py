"""JupyterLab as a learner meets it: `make lab`, a double-click on lab 1, a notebook that runs.

A contents-API check passes even when JupyterLab opens the lab in its text editor; only a browser sees what a
learner sees. The settings that make a double-click open a lab ``.md`` as a notebook (and keep the news pop-up
away) are the repository's ``tools/jupyterlab/overrides.json5``; without them this test fails. It takes about
15 s. The screenshot it saves, ``results/jupyterlab_lab01.png``, is the one in the README.

Also here: a lab opened in a kernel that cannot import labsupport says what to do in one line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jupytext
import pytest
from browser import browser, page, save_screenshot, start_lab  # noqa: F401  (pytest fixtures and helpers)

ROOT = Path(__file__).resolve().parent.parent
LABS = ROOT / "labs"
LAB1 = "lab_01_environment.md"
SETTINGS = ROOT / "tools" / "jupyterlab" / "overrides.json5"
WAIT_MS = 90_000  # first load and first kernel start on a busy 2-core machine


@pytest.fixture(scope="module")
def lab_server(tmp_path_factory):
    """`make lab` on a copy of the labs: the browser cannot save (autosave included) into the repository."""
    tmp = tmp_path_factory.mktemp("jupyterlab")
    labs = tmp / "labs"
    shutil.copytree(LABS, labs, ignore=shutil.ignore_patterns(".*", "*.ipynb"))
    with start_lab(labs, home=tmp) as server:
        yield server


def test_make_lab_says_why_it_allows_root(lab_server) -> None:
    """As root (containers, cloud images), `make lab` passes --allow-root and says so in one line."""
    lines = lab_server.log.read_text().splitlines()
    said = [line for line in lines if "--allow-root" in line and line.startswith("==")]
    if os.geteuid() == 0:
        assert len(said) == 1, f"`make lab` as root should say once that it passes --allow-root; its log:\n{lines[:5]}"
        assert not any("Running as root is not recommended" in line for line in lines)
    else:
        assert not said


def test_double_click_opens_lab_as_notebook_and_runs(lab_server, page, tmp_path) -> None:
    """File browser -> double-click lab 1 -> a notebook with its cells (not the text editor) -> run cell 1."""
    lab = jupytext.read(LABS / LAB1)
    n_cells, n_code = len(lab.cells), sum(c.cell_type == "code" for c in lab.cells)

    page.goto(lab_server.lab_url())
    item = page.locator(".jp-DirListing-item", has_text=LAB1)
    item.wait_for(timeout=WAIT_MS)
    item.dblclick()

    main = page.locator("#jp-main-dock-panel")
    main.locator(".jp-NotebookPanel, .jp-FileEditor").first.wait_for(timeout=WAIT_MS)
    assert main.locator(".jp-FileEditor").count() == 0, (
        f"{LAB1} opened in the text editor, not as a notebook: JupyterLab did not take `defaultViewers` "
        f"from {SETTINGS.relative_to(ROOT)} (is it linked into JupyterLab's settings/overrides.d?)")
    notebook = main.locator(".jp-NotebookPanel")
    from playwright.sync_api import expect

    expect(notebook.locator(".jp-Cell")).to_have_count(n_cells, timeout=WAIT_MS)
    expect(notebook.locator(".jp-CodeCell")).to_have_count(n_code)
    # the kernel is connected and idle (the status bar says so only then): a run before that is dropped
    expect(page.locator("#jp-main-statusbar")).to_contain_text(re.compile(r"Python 3 \(ipykernel\) \| Idle"),
                                                                timeout=WAIT_MS)

    first = notebook.locator(".jp-CodeCell").first
    assert "lab_setup(min_gpus=1" in first.locator(".jp-InputArea").inner_text()
    first.locator(".jp-InputPrompt").click()  # select the first code cell, then the toolbar's run button
    expect(first).to_have_class(re.compile(r"\bjp-mod-active\b"))
    notebook.locator(".jp-Toolbar [data-command='notebook:run-cell-and-select-next']").click()
    output = first.locator(".jp-OutputArea-output").first
    try:
        expect(first.locator(".jp-InputPrompt")).to_contain_text("[1]", timeout=WAIT_MS)
        expect(output).to_contain_text(re.compile(r"Lab 1: (GPU|CPU) path"), timeout=WAIT_MS)
    except AssertionError as err:
        shot = tmp_path / "failed.png"
        page.screenshot(path=str(shot))
        raise AssertionError(f"lab 1's first cell did not print its banner (screen: {shot}); "
                             f"server log:\n{lab_server.log_tail()}") from err
    assert "Error" not in output.inner_text(), output.inner_text()

    # nothing covers the cells: no "official Jupyter news?" question (fetchNews is off in the settings)
    assert not page.locator(".Toastify__toast", has_text="news").count(), \
        f"the Jupyter news pop-up is showing: `fetchNews` from {SETTINGS.relative_to(ROOT)} did not apply"
    sessions = json.loads(lab_server.api("/api/sessions"))
    assert [s["kernel"]["name"] for s in sessions if s["path"].endswith(LAB1)] == ["python3"]

    page.mouse.move(0, 0)
    shot = save_screenshot(page, "jupyterlab_lab01.png")
    assert shot.stat().st_size > 20_000, "the screenshot is nearly empty"
    assert not page.errors, f"the browser console reported errors: {page.errors}"


# ------------------------------------------------------------------ a kernel from another environment
GUARD = 'if importlib.util.find_spec("labsupport") is None:'


def _first_code_cell(path: Path) -> str:
    return next(c.source for c in jupytext.read(path).cells if c.cell_type == "code")


@pytest.mark.parametrize("lab", sorted(LABS.glob("lab_*.md")), ids=lambda p: p.stem)
def test_first_cell_in_a_kernel_without_labsupport_prints_one_line(lab: Path) -> None:
    """The first cell, in an IPython without labsupport, stops with one line that names `make lab`."""
    source = _first_code_cell(lab)
    assert GUARD in source, f"{lab.name}: the first code cell should start with the labsupport check"
    first_import = re.search(r"from labsupport[\w.]* import", source)
    assert first_import and source.index(GUARD) < first_import.start(), f"{lab.name}: check before the import"
    # labsupport made unimportable (sys.modules[name] = None), as in a kernel from another environment
    run = ("import sys; sys.modules['labsupport'] = None\n"
           "from IPython.core.interactiveshell import InteractiveShell\n"
           "result = InteractiveShell.instance().run_cell(sys.stdin.read())\n"
           "sys.exit(0 if result.error_in_exec is not None else 3)\n")
    done = subprocess.run([sys.executable, "-c", run], input=source, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"the cell did not stop: rc {done.returncode}\n{done.stdout}\n{done.stderr}"
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line, got:\n{done.stdout}{done.stderr}"
    assert "has no labsupport" in lines[0] and "`make lab`" in lines[0] and sys.executable in lines[0], lines[0]
