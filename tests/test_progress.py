"""Progress on long work (labsupport.course.progress) and one line for a missing package (hardware.require), as a user
sees them: the capstone's command line, a notebook kernel's recorded outputs, and a lab opened without a package."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from labsupport.course import hardware, progress

ROOT = Path(__file__).resolve().parent.parent
MISSING = "labsupport_test_no_such_package"  # a module that does not exist


def _run(code: str, *args: str, env: dict[str, str] | None = None, stdin: str | None = None,
         timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *(["-c", code] if code else []), *args], cwd=ROOT, input=stdin,
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


def test_capstone_command_line_prints_a_live_reward_line():
    """`python -m labsupport rl` shows a bar with the batch reward and held-out accuracy (stderr); the table on
    stdout is as before, with no carriage returns in it."""
    done = _run("", "-m", "labsupport", "rl", "--arch", "colocated", "--steps", "2", "--prompts", "4", "--group", "4",
                "--no-save", env={"LABSUPPORT_DEVICE": "cpu", progress.ENV: "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stderr.replace("\r", "\n").splitlines()
    line = next(x for x in reversed(last) if "colocated GRPO" in x)
    assert "2/2" in line and "reward=" in line and "acc=" in line, line
    assert "\r" not in done.stdout and done.stdout.splitlines()[-1].startswith("colocated"), done.stdout


def test_progress_off_silences_bars_waits_and_notes(monkeypatch, capfd):
    def work() -> None:
        for _ in progress.bar(range(3), desc="loop"):
            pass
        with progress.waiting("starting", tick_s=0.05):
            time.sleep(0.2)
        progress.note("ready")

    monkeypatch.setenv(progress.ENV, "1")
    work()
    out, err = capfd.readouterr()
    assert "loop: 100%" in err and "starting" in err and "ready" in err and out == ""
    monkeypatch.setenv(progress.ENV, "0")
    work()
    assert capfd.readouterr() == ("", "")


def test_in_a_notebook_a_bar_leaves_one_line_and_a_live_plot_one_figure(monkeypatch):
    """Executed by a kernel (as the book's build does): no carriage-return stream, one final line per bar, and
    the live plot's last drawing once; the clock's line is gone when the wait ends."""
    import nbclient
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell(
        "import time\n"
        "from labsupport.course import progress\n"
        "xs = []\n"
        "live = progress.LivePlot(lambda ax: ax.plot(xs), every_s=0.0)\n"
        "bar = progress.bar(range(5), desc='loop', unit='step', mininterval=0.0)\n"
        "for i in bar:\n"
        "    xs.append(i); live.update(); time.sleep(0.1)\n"
        "    bar.set_postfix(reward=i, refresh=False)\n"
        "live.close()\n"
        "with progress.waiting('engine starting', tick_s=0.1):\n"
        "    time.sleep(0.5)\n"
        "print('done')\n"))
    monkeypatch.setenv(progress.ENV, "1")  # (the kernel inherits this environment)
    nbclient.NotebookClient(nb, kernel_name="python3", timeout=120,
                            resources={"metadata": {"path": str(ROOT)}}).execute()
    outs = nb.cells[0].outputs
    text = "".join(o.get("text", "") for o in outs if o["output_type"] == "stream")
    assert "\r" not in text and text.count("loop: 100%") == 1 and "5/5" in text and "reward=4" in text, text
    assert "engine starting" not in text and text.endswith("done\n"), text
    shown = [o["data"] for o in outs if o["output_type"] == "display_data"]
    assert sum("image/png" in d for d in shown) == 1, shown
    assert all(d == {"text/html": ""} for d in shown if "image/png" not in d), shown  # emptied live displays


def test_a_missing_package_is_one_line_naming_what_to_install():
    with pytest.raises(hardware.MissingDependency) as err:
        hardware.require("torch", MISSING, what="Lab 99")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"Lab 99 needs {MISSING},") and err.value.name == MISSING
    assert f"{sys.executable} -m pip install {MISSING}" in msg and "make setup" in msg
    assert hardware.install_hint("ray") == "ray==2.60.0"  # the pin in requirements.txt


def test_command_line_without_a_package_prints_one_line():
    """`python -m labsupport bench cluster` without Ray: exit code 2 and one line, not a traceback."""
    code = ("import sys; sys.modules['ray'] = None\n"  # as if ray were not installed
            "from labsupport.__main__ import main\n"
            "sys.exit(main(['bench', 'cluster']))\n")
    done = _run(code, timeout=120)
    lines = [x for x in (done.stdout + done.stderr).splitlines() if x.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stdout + done.stderr
    assert "labsupport.experiments.cluster needs ray" in lines[0] and "pip install ray==2.60.0" in lines[0], lines[0]


def test_a_lab_that_imports_a_missing_package_stops_at_lab_setup_with_one_line(tmp_path):
    """In a notebook kernel, lab_setup reads the lab's code cells and stops with one line (IPython's
    UsageError) before anything runs; indented (optional) imports do not count."""
    (tmp_path / "lab_99_demo.md").write_text(
        "# Lab 99\n\n```{code-cell} ipython3\nimport os\n"
        f"import {MISSING}.sub as x\nif False:\n    import another_missing_one\n```\n")
    assert hardware.lab_imports(tmp_path / "lab_99_demo.md") == [MISSING]
    cell = ("from pathlib import Path\nfrom labsupport.course import hardware\n"
            f"hardware.LABS_DIR = Path({str(tmp_path)!r})\n"
            "env = hardware.lab_setup(min_gpus=0, title='Lab 99')\n")
    run = ("import sys\nfrom IPython.core.interactiveshell import InteractiveShell\n"
           "result = InteractiveShell.instance().run_cell(sys.stdin.read())\n"
           "sys.exit(0 if result.error_in_exec is not None else 3)\n")
    done = _run(run, stdin=cell, timeout=120)
    lines = [x for x in (done.stdout + done.stderr).splitlines() if x.strip()]
    assert done.returncode == 0 and len(lines) == 1, done.stdout + done.stderr
    assert lines[0].startswith(f"UsageError: Lab 99 needs {MISSING},") and "pip install" in lines[0], lines[0]
