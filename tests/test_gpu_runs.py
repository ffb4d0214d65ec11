"""Recorded GPU runs (tools/gpu_runs.py): a recording is shown as current only while the lab's code cells are
those that ran; its page keeps the GPU's outputs and none of the lab's exercises or solutions.

The built pages are checked in tests/test_book.py, on the builds it makes anyway.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jupytext
import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import gpu_runs  # noqa: E402
import student_edition as se  # noqa: E402

from labsupport.course import results  # noqa: E402

RECORDING = ROOT / "results" / "notebooks" / "lab_06_colocated_vllm.1xH100.ipynb"


def test_unchanged_code_is_current() -> None:
    cells = ["import torch", "x = torch.ones(3)\nprint(x)", "print('done')"]
    fresh = gpu_runs.freshness(cells, list(cells))
    assert not fresh.stale and fresh.changed == [] and fresh.diff == ""


def test_comments_docstrings_and_wrapping_leave_a_recording_current() -> None:
    ran = ['def f(x):\n    """Twice x."""\n    return g(x, 2)  # doubled\n\ny = f(1)']
    same = ['def f(x):\n    """Twice x, as the text says."""\n    # doubled\n    return g(x,\n             2)\n\ny = f(1)']
    assert not gpu_runs.freshness(ran, same).stale
    assert gpu_runs.freshness(ran, [same[0].replace("2)", "3)")]).changed == ["code cell 1 changed"]
    assert gpu_runs.freshness(ran, [same[0].replace("y = f(1)", "y = 'f(1)'")]).stale  # a string that is a value


def test_changed_added_and_removed_cells_are_named_with_a_diff() -> None:
    recorded = ["import torch", "x = torch.ones(3)\nprint(x)", "print('done')"]
    fresh = gpu_runs.freshness(recorded, ["import torch", "x = torch.zeros(3)\nprint(x)", "print('done')"])
    assert fresh.stale and fresh.changed == ["code cell 2 changed"]
    assert "-x = torch.ones(3)" in fresh.diff and "+x = torch.zeros(3)" in fresh.diff and "print(x)" in fresh.diff
    assert gpu_runs.freshness(recorded, recorded + ["print(1)"]).changed == ["code cell 4 added"]
    assert gpu_runs.freshness(recorded, recorded[1:]).changed == ["recorded code cell 1 removed"]


def _lab_text(nb: nbformat.NotebookNode) -> str:
    """The recording written back as a lab source: the lab exactly as it was when it ran."""
    return jupytext.writes(nb, fmt="md:myst")


def test_a_recording_against_its_own_lab_and_an_edited_one() -> None:
    nb = nbformat.read(RECORDING, as_version=4)
    assert not gpu_runs.recording_freshness(nb, _lab_text(nb)).stale
    edited = nbformat.from_dict(nb)
    code = [c for c in edited.cells if c.cell_type == "code"]
    code[2].source += "\nprint('a line added since the GPU run')"
    fresh = gpu_runs.recording_freshness(nb, _lab_text(edited))
    assert fresh.changed == ["code cell 3 changed"] and "+print('a line added since the GPU run')" in fresh.diff


def test_a_glue_cell_added_to_the_lab_keeps_the_recording_current() -> None:
    """A hidden cell that only glues numbers from results/ into the prose (tag ``glue``) is not the experiment."""
    nb = nbformat.read(RECORDING, as_version=4)
    lab = nbformat.from_dict(nb)
    glue_cell = nbformat.v4.new_code_cell("glue('x', '1 ms', display=False)", metadata={"tags": ["remove-cell", "glue"]})
    lab.cells.insert(3, glue_cell)
    assert not gpu_runs.recording_freshness(nb, _lab_text(lab)).stale
    lab.cells[3].metadata["tags"] = ["remove-cell"]
    assert gpu_runs.recording_freshness(nb, _lab_text(lab)).stale


@pytest.mark.parametrize("edit", [False, True], ids=["current", "stale"])
def test_gpu_page_and_lab_note_carry_the_label(edit: bool) -> None:
    nb = nbformat.read(RECORDING, as_version=4)
    lab = nbformat.from_dict(nb)
    if edit:
        next(c for c in lab.cells if c.cell_type == "code").source += "\nx = 1"
    lab_text = _lab_text(lab)
    page = nbformat.reads(gpu_runs.gpu_page(nbformat.writes(nb), lab_text, "../../labs/lab_06_colocated_vllm"), 4)
    head = page.cells[0].source
    info = nb.metadata["labsupport_recording"]
    assert head.startswith("# Lab 6: the GPU run on 1xH100") and info["date"][:10] in head
    assert ("Recorded GPU run (stale)" in head and "code cell 1 changed" in head and "+x = 1" in head) if edit \
        else ("Recorded GPU run (current)" in head and "stale" not in head)
    note = gpu_runs.lab_note(lab_text, "lab_06_colocated_vllm", [RECORDING])
    assert f"Recorded GPU run ({'stale' if edit else 'current'})" in note
    assert "{doc}`GPU run on 1xH100 <../results/notebooks/lab_06_colocated_vllm.1xH100>`" in note


def test_gpu_page_keeps_outputs_and_no_exercises_or_solutions() -> None:
    text = RECORDING.read_text()
    assert se.directives(_lab_text(nbformat.reads(text, 4)), "solution"), "the recording has solutions to strip"
    page = nbformat.reads(gpu_runs.gpu_page(text, text, "../../labs/lab_06_colocated_vllm"), 4)
    markdown = "\n".join(c.source for c in page.cells if c.cell_type == "markdown")
    assert "{solution}" not in markdown and "{exercise}" not in markdown
    assert page.metadata["mystnb"] == {"execution_mode": "off"}
    code = [c for c in page.cells if c.cell_type == "code"]
    assert len(code) == page.metadata["labsupport_recording"]["code_cells"]
    assert any("image/png" in o.get("data", {}) for c in code for o in c.outputs)


def test_lab_without_recording_names_the_machine_it_needs() -> None:
    text = (ROOT / "labs" / "lab_03_nccl_weight_sync.md").read_text()
    note = gpu_runs.lab_note(text, "lab_03_nccl_weight_sync", [])
    assert "No recorded GPU run" in note and "needs 3 GPUs" in note
    title = next(line for line in text.splitlines() if line.startswith("# Lab 3"))
    assert note.index(title) < note.index("No recorded GPU run"), "the note goes under the title"


def test_every_recording_is_in_the_toc_and_small() -> None:
    toc = set(se.toc_sources())
    for path in (ROOT / "results" / "notebooks").glob("*.ipynb"):
        assert path in toc, f"{path.name} is not in _toc.yml (a section of its lab)"
        assert path.stat().st_size < 300_000, f"{path.name}: {path.stat().st_size} bytes, too big to commit"


def test_a_chapter_reads_what_a_recorded_lab_printed(tmp_path) -> None:
    """results.recorded_output: the newest recording's printed lines of the cell with the marker, minus vLLM's
    log lines, with the recording's machine tag (its date and commit stay on its page); None without a recording;
    a missing cell raises."""
    machine, text = results.recorded_output("lab_09_after_the_update", "in_flight_update(mode")
    assert machine == "1xH100"
    assert text.splitlines()[0].split()[:2] == ["mode", "lost"] and "WARNING" not in text
    with pytest.raises(KeyError, match="no code cell"):
        results.recorded_output("lab_09_after_the_update", "a marker no cell has")
    assert results.recorded_output("lab_09_after_the_update", "x", results_dir=tmp_path) is None
