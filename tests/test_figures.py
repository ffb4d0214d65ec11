"""The book's figures are drawings, not ASCII art: Graphviz sources in the pages, rendered to SVG at build time.

A figure is a ``{graphviz}`` directive (``sphinx.ext.graphviz``, see ``_config.yml``) whose DOT source sits in the
page, so it is reviewed and diffed as text; the build runs Graphviz's ``dot`` on it and the page shows the SVG, with
no JavaScript and nothing from a CDN (the HTML works offline). Checked here:

1. no box-and-arrow drawing is left in the markdown of a book page or a lab (code cells are code, not figures);
2. every figure has alt text that describes it;
3. every DOT source renders with ``dot -Tsvg``, without a warning, on a white background (dark text stays readable
   in the theme's dark mode), at a width the page column shows without shrinking the text much, and with no line
   of text that mixes styles (dot measures it with its own font, the browser draws it with another);
4. in both built editions (``tests/conftest.py``), every figure of a page is an SVG file of the build, not empty.

``make test`` installs Graphviz as root (``make graphviz``); elsewhere the tests that need ``dot`` skip and say what
to install, except under CI, where they fail. ``tests/test_book_browser.py`` checks in Chromium that each figure's
SVG loads and fits the column.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import student_edition as se  # on sys.path through tests/conftest.py

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "book").glob("*.md")) + sorted((ROOT / "labs").glob("*.md"))
# The pages that drew their processes, GPUs and data flows in ASCII, the weight-transfer paths of Chapters 4 and 6:
# at least this many figures each (a positive control for the checks below)
EXPECTED = {"ch01_rlhf_systems.md": 2, "ch03_colocated.md": 1, "ch04_disaggregated.md": 2,
            "ch05_hybrid_engine.md": 1, "ch06_weight_updates.md": 1, "ch08_async.md": 1, "ch11_capstone.md": 1}
MAX_WIDTH_PT = 600  # 800 px, about the page column on a desktop screen: a wider SVG is scaled down, its text too
INSTALL = "`make test` as root installs it (make graphviz), or run `sudo apt-get install graphviz`"

# What ASCII diagrams are drawn with: box-drawing characters, box corners (+--, --+), long arrows (-->, <--, ==>,
# <==), and connector lines that hold nothing but |, ^ and v.
_ASCII_ART = re.compile(r"[\u2500-\u257f]|\+--|--\+|-->|<--|==>|<==|^\s*(?:[|^v]\s*)+$")
_FENCED = re.compile(r"^(?P<fence>`{3,}|:{3,})\{(?P<name>code-cell|graphviz)\}.*?^(?P=fence)[ \t]*$", re.M | re.S)


def markdown_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of a MyST page without its code cells, figure sources and HTML comments."""
    def blank(m: re.Match) -> str:  # as many lines as it replaces: the line numbers stay
        return "\n" * m.group(0).count("\n")

    text = re.sub(r"<!--.*?-->", blank, text, flags=re.S)
    text = _FENCED.sub(blank, text)
    return list(enumerate(text.splitlines(), start=1))


def ascii_art(text: str) -> list[tuple[int, str]]:
    """Lines of a page's markdown that look like part of an ASCII drawing."""
    return [(n, line) for n, line in markdown_lines(text) if line.strip() and _ASCII_ART.search(line)]


def figures(text: str) -> list[tuple[dict[str, str], str]]:
    """(options, DOT source) of every ``{graphviz}`` directive of a page, nested ones included."""
    out = []
    for _, body in se.directives(text, "graphviz"):
        lines = body.splitlines()
        n = next((i for i, line in enumerate(lines) if not line.startswith(":")), len(lines))
        options = dict(re.match(r"^:([\w-]+):\s*(.*)$", line).groups() for line in lines[:n])
        out.append((options, "\n".join(lines[n:]).strip() + "\n"))
    return out


ALL_FIGURES = [(p.name, i, opts, dot) for p in PAGES for i, (opts, dot) in enumerate(figures(p.read_text()))]


def _need_dot() -> str:
    dot = shutil.which("dot")
    if dot is None:
        reason = f"Graphviz's dot is not on PATH: {INSTALL}"
        if os.environ.get("CI"):
            pytest.fail(f"{reason} (CI is set: the figures must be checked here)", pytrace=False)
        pytest.skip(reason)
    return dot


# ------------------------------------------------------------------------------------------ the sources

@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_ascii_diagrams(page: Path) -> None:
    """A drawing of processes, GPUs or data flows is a {graphviz} figure, not text in a code block."""
    found = ascii_art(page.read_text())
    assert not found, (f"{page.name}: ASCII drawing (make it a {{graphviz}} figure with :alt: and :caption:):\n"
                       + "\n".join(f"  {n}: {line}" for n, line in found[:12]))


def test_the_ascii_check_finds_drawings() -> None:
    """Control: the check finds a box, a connector, an arrow, box-drawing characters, but not tables or code cells."""
    drawing = "```text\n +------+\n | GPU0 |\n +------+\n     |\n     v\n a --> b\n ┌──┐\n```\n"
    assert [n for n, _ in ascii_art(drawing)] == [2, 4, 5, 6, 7, 8]
    fine = ("| a | b |\n|---|---|\n| x | y |\n\n<!-- a comment -->\n\n```{code-cell} ipython3\n# a --> b\n```\n"
            "Here the trainer -> engine arrow is prose.\n")
    assert ascii_art(fine) == []


def test_pages_have_their_figures() -> None:
    counts = {p.name: len(figures(p.read_text())) for p in PAGES}
    missing = {name: f"{counts.get(name, 0)} of {n}" for name, n in EXPECTED.items() if counts.get(name, 0) < n}
    assert not missing, f"figures missing: {missing}"


@pytest.mark.parametrize("page,index,options,dot", ALL_FIGURES, ids=[f"{p}:{i}" for p, i, _, _ in ALL_FIGURES])
def test_figure_has_alt_text(page: str, index: int, options: dict, dot: str) -> None:
    """Screen readers, and readers whose SVG did not load, get a description: what the figure shows, in words."""
    alt = options.get("alt", "").strip()
    assert alt, f"{page}: figure {index} has no :alt:"
    assert len(alt.split()) >= 12, f"{page}: figure {index}'s :alt: is too short to describe it: {alt!r}"
    assert set(options) <= {"alt", "caption", "align", "name", "class", "layout"}, f"{page}: unknown option"


@pytest.mark.parametrize("page,index,options,dot", ALL_FIGURES, ids=[f"{p}:{i}" for p, i, _, _ in ALL_FIGURES])
def test_figure_source_renders(page: str, index: int, options: dict, dot: str) -> None:
    """``dot -Tsvg`` draws it without a warning; white background; not wider than the column can show."""
    exe = _need_dot()
    assert re.search(r'\bbgcolor="(white|#ffffff)"', dot, re.I), \
        f"{page}: figure {index} needs graph [bgcolor=\"white\"]: its dark text must stay readable in dark mode"
    result = subprocess.run([exe, "-Tsvg"], input=dot, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0 and not result.stderr.strip(), f"{page}: figure {index}: dot says\n{result.stderr}"
    width = re.search(r'<svg width="([\d.]+)pt"', result.stdout)
    assert width, f"{page}: figure {index}: no width in dot's SVG"
    assert float(width.group(1)) <= MAX_WIDTH_PT, \
        f"{page}: figure {index} is {width.group(1)} pt wide (at most {MAX_WIDTH_PT}): lay it out narrower"
    mixed = _mixed_lines(result.stdout)
    assert not mixed, (f"{page}: figure {index} mixes styles within a line ({mixed[:3]}): dot places each part "
                       "with its own font's widths and the browser's font differs, so the parts drift apart or "
                       "overlap. Give the bold (or italic, smaller, subscript) part a line of its own.")


def test_the_mixed_style_check_finds_a_mixed_line() -> None:
    """Control: a bold word and plain text on one line are two pieces; on two lines, they are not."""
    exe = _need_dot()

    def svg(label: str) -> str:
        return subprocess.run([exe, "-Tsvg"], input=f"digraph {{ a [label=<{label}>] }}", capture_output=True,
                              text=True, check=True).stdout

    assert _mixed_lines(svg("<b>trainer</b> (GPU 0)")) == ["trainer +  (GPU 0)"]
    assert _mixed_lines(svg("<b>trainer</b><br/>(GPU 0)")) == []


def _mixed_lines(svg: str) -> list[str]:
    """Lines of text that dot wrote as several pieces: two <text> at the same height in one node, edge or cluster."""
    ns = "{http://www.w3.org/2000/svg}"
    out = []
    for group in ET.fromstring(svg).iter(f"{ns}g"):
        lines: dict[str, list[str]] = {}
        for text in group.findall(f"{ns}text"):
            lines.setdefault(text.get("y"), []).append(text.text or "")
        out += [" + ".join(parts) for parts in lines.values() if len(parts) > 1]
    return out


# ------------------------------------------------------------------------------------------ the built HTML

_OBJECT = re.compile(r'<object data="(?P<src>[^"]+\.svg)" type="image/svg\+xml" class="[^"]*\bgraphviz\b[^"]*">')


@pytest.mark.parametrize("edition", ["instructor", "student"])
def test_built_pages_show_every_figure_as_svg(editions: dict, edition: str) -> None:
    """Every figure of every page is an SVG file of the build (Sphinx writes the DOT source as text without dot)."""
    _need_dot()
    site, problems, seen = editions[edition], [], 0
    for src, text in editions["texts"].items():
        expected = len(figures(text))
        if not expected:
            continue
        page = site / src.relative_to(ROOT).with_suffix(".html")
        svgs = [m.group("src") for m in _OBJECT.finditer(page.read_text())]
        if len(svgs) != expected:
            problems.append(f"{page.relative_to(site)}: {len(svgs)} SVG figures, {expected} in the source")
        for svg in svgs:
            path = (page.parent / svg).resolve()
            if not path.is_file() or b"<svg" not in path.read_bytes()[:2000]:
                problems.append(f"{page.relative_to(site)}: {svg} is missing, empty or not an SVG")
        seen += len(svgs)
    assert seen >= sum(EXPECTED.values()), f"only {seen} figures in the {edition} edition"
    assert not problems, "\n".join(problems)
