"""Recorded GPU runs in the book, never passed off as current: a Sphinx extension (``sphinx.local_extensions``).

The GPU reference run records each lab it runs as an executed notebook, ``results/notebooks/<lab>.<machine>.ipynb``
(``conftest.py``, ``LABSUPPORT_RECORD_DIR``). ``_toc.yml`` lists each recording under its lab, and this extension
rewrites pages as Sphinx reads them (``source-read``), so that no source file is touched and nothing is generated:

- a recording's page keeps its code cells with the outputs the GPU gave (never executed here), the headings of its
  text (the lab page has the text, its exercises and their solutions) and, on top, what ran where and when and
  whether the lab's code cells are still those that ran; if not, it says *stale*, which cells changed and the diff;
- each lab page gets a box under its title: a link to each recording with the same label, or, where there is
  none, that none is recorded and which machine the GPU path needs (front matter ``lab: {min_gpus: N}``).
"""

from __future__ import annotations

import difflib
import io
import tokenize
from dataclasses import dataclass
from pathlib import Path

import jupytext
import nbformat

RECORDINGS = Path("results") / "notebooks"


@dataclass
class Freshness:
    """How a lab's code cells now differ from a recording's: nothing (current), or which cells and a diff."""

    changed: list[str]
    diff: str

    @property
    def stale(self) -> bool:
        return bool(self.changed)


GLUE_TAG = "glue"  # a hidden cell that only reads results/ for the prose (myst-nb glue): not the lab's experiment


def code_cells(nb: nbformat.NotebookNode) -> list[str]:
    """The code cells that make the lab: a glue cell (tagged ``glue``) does not change what a run shows."""
    return [cell.source.strip() for cell in nb.cells
            if cell.cell_type == "code" and GLUE_TAG not in cell.get("metadata", {}).get("tags", [])]


def _what_runs(source: str) -> tuple:
    """A cell's code as Python runs it: its tokens without comments, line wrapping or docstrings, so that rewording
    a comment or a docstring, or wrapping a long line, does not make a recording stale. (A cell Python cannot
    tokenize: its text.)"""
    try:
        toks = [(t.type, t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
                if t.type not in (tokenize.COMMENT, tokenize.NL)]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return (source,)
    starts = (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    return tuple(t for i, t in enumerate(toks) if not (  # a statement that is only a string: a docstring
        t[0] == tokenize.STRING and (i == 0 or toks[i - 1][0] in starts)
        and i + 1 < len(toks) and toks[i + 1][0] == tokenize.NEWLINE))


def _cells(lo: int, hi: int) -> str:
    return f"code cell {lo + 1}" if hi - lo == 1 else f"code cells {lo + 1}-{hi}"


def freshness(recorded: list[str], current: list[str], max_lines: int = 40) -> Freshness:
    """Compare the code cells that ran with the lab's code cells now (numbered as in the lab now)."""
    changed, diff = [], []
    ran, now = [_what_runs(c) for c in recorded], [_what_runs(c) for c in current]
    for op, a0, a1, b0, b1 in difflib.SequenceMatcher(a=ran, b=now, autojunk=False).get_opcodes():
        if op == "equal":
            continue
        what = {"replace": f"{_cells(b0, b1)} changed", "insert": f"{_cells(b0, b1)} added",
                "delete": f"{_cells(a0, a1).replace('code cell', 'recorded code cell')} removed"}[op]
        changed.append(what)
        diff += difflib.unified_diff("\n\n".join(recorded[a0:a1]).splitlines(), "\n\n".join(current[b0:b1]).splitlines(),
                                     "recorded", f"now ({what})", n=1, lineterm="")
    if len(diff) > max_lines:
        diff = diff[:max_lines] + [f"... ({len(diff) - max_lines} more lines)"]
    return Freshness(changed, "\n".join(diff))


def recording_freshness(recording: nbformat.NotebookNode, lab_text: str) -> Freshness:
    return freshness(code_cells(recording), code_cells(jupytext.reads(lab_text, fmt="md:myst")))


def status(info: dict, fresh: Freshness) -> str:
    """Whether a recording shows this code (and which cells failed): the lab page says this much."""
    failed = f"; failed cells {info['failed_cells']}" if info.get("failed_cells") else ""
    return ("**stale**: " + ", ".join(fresh.changed) + " since, so the recording shows what ran then, not this "
            "code" if fresh.stale else "**current**: the lab's code cells are those that ran") + failed


def label(info: dict, fresh: Freshness) -> str:
    """A recording's provenance (machine, date, commit, cells run) and status: the recording's own page only."""
    gpus = info["machine"].get("gpus") or [{"name": "no GPU"}]
    return (f"{info['machine']['gpu_count']}x {gpus[0]['name']}, {info['date'][:10]} (commit {info['commit']}, "
            f"{info['path']} path, {info['cells_run']} of {info['code_cells']} code cells ran); "
            f"{status(info, fresh)}")


def _box(title: str, klass: str, body: str) -> str:
    return f"\n::::{{admonition}} {title}\n:class: {klass}\n{body}\n::::\n"


def gpu_page(text: str, lab_text: str, lab_doc: str) -> str:
    """The recording's page: its title and status box, its code cells with their outputs, its headings."""
    nb = nbformat.reads(text, as_version=4)
    info = nb.metadata["labsupport_recording"]
    fresh = recording_freshness(nb, lab_text)
    title = nb.cells[0].source.splitlines()[0].lstrip("# ").split(":")[0]
    versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items())
    body = (f"{label(info, fresh)}.\n\nThese are the outputs of {{doc}}`the lab <{lab_doc}>` on that machine "
            f"(the lab's page shows this build's CPU run). Versions: {versions}.")
    if fresh.stale:
        body += f"\n\nWhat changed in the lab's code since:\n\n```diff\n{fresh.diff}\n```"
    head = f"# {title}: the GPU run on {info['machine_tag']}\n" + _box(
        f"Recorded GPU run ({'stale' if fresh.stale else 'current'})", "warning" if fresh.stale else "tip", body)
    cells = [nbformat.v4.new_markdown_cell(head)]
    for cell in nb.cells:
        if cell.cell_type == "code":
            cells.append(cell)
        elif headings := [line for line in cell.source.splitlines() if line.startswith("## ")]:
            cells.append(nbformat.v4.new_markdown_cell("\n\n".join(headings)))
    # a heading stays where code follows it (not the exercises' heading: exercises live on the lab page)
    nb.cells = [c for i, c in enumerate(cells) if c.cell_type == "code" or i == 0
                or i + 1 < len(cells) and cells[i + 1].cell_type == "code"]
    nb.metadata["mystnb"] = {"execution_mode": "off"}  # show what the GPU gave; this machine has no GPU
    return nbformat.writes(nb)


def lab_note(text: str, lab: str, recordings: list[Path]) -> str:
    """The box under a lab page's title: its recorded GPU runs, or that there is none and what it needs."""
    if recordings:
        lines, stale = [], False
        for path in recordings:
            nb = nbformat.read(path, as_version=4)
            fresh = recording_freshness(nb, text)
            stale |= fresh.stale
            info = nb.metadata["labsupport_recording"]
            lines.append(f"- {{doc}}`GPU run on {info['machine_tag']} <../{RECORDINGS.as_posix()}/{path.stem}>`: "
                         f"{status(info, fresh)}.")
        box = _box(f"Recorded GPU run{'s' if len(lines) > 1 else ''} ({'stale' if stale else 'current'})",
                   "warning" if stale else "tip",
                   "The outputs on this page come from the CPU path of this build. What this lab printed and drew "
                   "on a GPU:\n\n" + "\n".join(lines))
    else:
        need = int(jupytext.reads(text, fmt="md:myst").metadata.get("lab", {}).get("min_gpus", 0))
        box = _box("No recorded GPU run", "note",
                   f"No GPU run of this lab is recorded yet; the outputs on this page come from its CPU path. Its GPU "
                   f"path needs {need} GPU{'s' if need > 1 else ''} (`min_gpus: {need}` in its front matter): "
                   f"`tools/gpu_reference_run.sh` on such a machine records it (see {{doc}}`../book/instructors`).")
    head, sep, rest = text.partition("\n# ")
    title, _, rest = rest.partition("\n")
    return f"{head}{sep}{title}\n{box}{rest}"


def _source_read(app, docname: str, source: list[str]) -> None:
    src = Path(app.srcdir)
    path = Path(app.env.doc2path(docname))
    if path.parent == src / RECORDINGS and path.suffix == ".ipynb":
        lab = path.name.split(".")[0]
        source[0] = gpu_page(source[0], (src / "labs" / f"{lab}.md").read_text(), f"../../labs/{lab}")
    elif path.parent == src / "labs" and path.name.startswith("lab_") and path.suffix == ".md":
        source[0] = lab_note(source[0], path.stem, sorted((src / RECORDINGS).glob(f"{path.stem}.*.ipynb")))


def _check_toc(app, env, docnames) -> None:
    """A recording that is not in the toc would be linked from its lab but never built: say what to do."""
    for path in sorted((Path(app.srcdir) / RECORDINGS).glob("*.ipynb")):
        docname = (RECORDINGS / path.stem).as_posix()
        if docname not in env.found_docs:
            from sphinx.util import logging

            logging.getLogger(__name__).warning(f"{docname}.ipynb is not in _toc.yml: add it under its lab "
                                                f"(sections: [{{file: {docname}}}])")


def setup(app) -> dict:
    app.connect("source-read", _source_read)
    app.connect("env-before-read-docs", _check_toc)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
