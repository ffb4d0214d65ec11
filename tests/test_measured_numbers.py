"""No hand-typed measured number in the book's chapters and labs.

A number the text presents as measured on the course's machines is computed from its ``results/`` file when
the book is built (myst-nb's ``glue``: a hidden cell reads the JSON and the prose says ``{glue:text}`key```, or a
cell prints it), so it cannot go stale when a benchmark runs again. This test reads every chapter and lab as
MyST (markdown-it, as the book's parser does) and fails on a figure with a unit (ms, s, µs, GB, GiB, GB/s,
TB, TB/s, MB, % or nats) in prose that is none of:

- **glued**: a ``{glue:text}`` or ``{glue}`` role (its number is not in the source at all);
- **cited**: its sentence (a table: its row) carries a ``{cite}`` role, the number of another system;
- **arithmetic**: written as math (``$140/370 \\approx 0.38$ s``: the number is inside ``$...$``), or in a
  sentence marked ``*(arithmetic)*`` or introduced by "for example" or "say,": a computed or assumed value, not
  a measurement. A paragraph or list item that *starts* with ``*(arithmetic)*`` is marked as a whole. Exercises and their solutions are worked arithmetic on the exercise's own assumptions, so they
  count as marked, except a sentence that says a value was measured (``measured``, ``reference run``,
  ``results/``, ``in that run``, ``in one CPU run``...), which must be glued or cited like any other;
- **code**: code cells, code blocks and inline code (settings such as ``size_mib=256`` read as code).

``EXCEPTIONS`` lists the few figures that are none of these, each with its reason.

The same pages carry no provenance either: a run's machine details, date, versions, command and commit are shown
in one place, the Reference runs page (and the headers of the labs' GPU-run pages), both generated from
``results/``. A chapter or lab may name the machine a number came from by its tag (``1xH100``, read from the
file), nothing more: it calls no ``results.describe`` and reads no ``date``, ``commit``, ``command`` or package
version from a result, and its prose holds no ISO date or commit hash.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "book").glob("ch[0-9][0-9]_*.md")) + sorted((ROOT / "book").glob("appendix_*.md")) \
    + [ROOT / "book" / "intro.md", ROOT / "book" / "instructors.md", ROOT / "book" / "glossary.md"] \
    + sorted((ROOT / "labs").glob("lab_*.md"))

UNIT = r"(?:ms|µs|us|s|GB/s|TB/s|GB|GiB|TB|MB|%|nats?)"
FIGURE = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:\s*(?:-|–|to)\s*\d[\d,]*(?:\.\d+)?)?\s*" + UNIT + r"(?![\w/])")
ROLE = re.compile(r"\{[\w:-]+\}`[^`]*`")
GLUE = re.compile(r"\{glue(?::\w+)?\}`")
CITE = re.compile(r"\{cite(?::\w+)?\}`")
MATH = re.compile(r"\$\$.*?\$\$|\$[^$\n]+\$", re.S)
CODE = re.compile(r"``[^`]+``|`[^`]+`")
MARKED = re.compile(r"\(arithmetic\)|\bfor example\b|\bsay,", re.I)
MARKED_BLOCK = re.compile(r"^\W*\(arithmetic\)", re.I)
MEASURED_CUE = re.compile(r"\bmeasured\b|\breference run\b|results/|\bthe run\b|\brecorded\b|\bran on\b"
                          r"|\b(?:in|from) (?:that|this|these|one|each|our|its|the|a) (?:[\w-]+\s+){0,2}runs?\b", re.I)
SKIP_FENCES = ("{code-cell}", "{graphviz}", "python", "bash", "diff", "text", "")
PROSE_DIRECTIVES = ("{exercise}", "{solution}", "{admonition}", "{glossary}", "{note}", "{tip}", "{warning}",
                    "{important}", "{seealso}")
EXERCISE_DIRECTIVES = ("{exercise}", "{solution}")

# (page, figure as written, reason): figures that are none of the above, each for a stated reason.
EXCEPTIONS: list[tuple[str, str, str]] = []


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z(*\[`{$])", " ".join(text.split())) if s.strip()]


def _blocks(src: str, in_exercise: bool = False):
    """(text, in_exercise) for every prose unit of a MyST source: a paragraph, a list item's paragraph, or a
    table row; directive bodies are parsed again, code is skipped."""
    md = MarkdownIt("commonmark").enable("table")
    tokens = md.parse(src)
    row: list[str] | None = None
    for tok in tokens:
        if tok.type == "fence":
            info = tok.info.strip()
            name = info.split()[0] if info else ""
            if name in PROSE_DIRECTIVES or (name.startswith("{") and name not in SKIP_FENCES):
                body = "\n".join(ln for ln in tok.content.splitlines() if not re.match(r"^:\w[\w-]*:", ln))
                yield from _blocks(body, in_exercise or name in EXERCISE_DIRECTIVES)
        elif tok.type == "tr_open":
            row = []
        elif tok.type == "tr_close" and row is not None:
            yield "| " + " | ".join(row), in_exercise  # a table row is one unit: its citation covers it
            row = None
        elif tok.type == "inline":
            if row is not None:
                row.append(tok.content)
            else:
                yield tok.content, in_exercise


def unmarked_figures(path: Path) -> list[str]:
    """Figures with a unit in the page's prose that are neither glued, cited nor marked as arithmetic."""
    text = path.read_text()
    if text.startswith("---\n"):
        text = text.split("\n---\n", 1)[1]
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    found = []
    for block, in_exercise in _blocks(text):
        if MARKED_BLOCK.match(block):
            continue
        for sentence in [block] if block.startswith("| ") else _sentences(block):
            if CITE.search(sentence):
                continue
            if MARKED.search(sentence):
                continue
            if in_exercise and not MEASURED_CUE.search(sentence):
                continue
            plain = CODE.sub(" ", MATH.sub(" ", ROLE.sub(" ", sentence)))
            for m in FIGURE.finditer(plain):
                found.append(f"{path.relative_to(ROOT)}: {m.group(0)!r} in: {sentence[:160]}")
    allowed = {(page, fig) for page, fig, _ in EXCEPTIONS}
    return [f for f in found if (str(path.relative_to(ROOT)), f.split("'")[1]) not in allowed]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_hand_typed_measured_number(page: Path) -> None:
    bad = unmarked_figures(page)
    assert not bad, ("figures with a unit in prose that are not glued from results/, cited, or marked as "
                     "arithmetic (see this test's docstring):\n" + "\n".join(bad))


def test_the_check_catches_a_typed_number(tmp_path: Path) -> None:
    """Positive and negative controls on a made-up page."""
    page = ROOT / "book" / "_probe_measured.md"
    cases = {
        "A 7B update took 186 ms on one H100.": True,
        "A 7B update took {glue:text}`upd_7b` on one H100.": False,
        "slime went from 60 s to 7 s {cite}`he2025slimesync`.": False,
        "The model is $2 \\times 70 = 140$ GB in bf16.": False,
        "(arithmetic) 140 GB at 47 GB/s is 3.0 s.": False,
        "*(arithmetic)* A 70B model is 140 GB. At 47 GB/s that is 3.0 s.": False,
        "A 70B model is 140 GB. At 47 GB/s that is 3.0 s *(arithmetic)*.": True,
        "Copies a buffer of `size_mib=256` MiB.": False,
        "```{solution} x\n:class: dropdown\n\n$26/370 \\approx 0.07$ s, and 26 GB at 64 GB/s is 0.41 s.\n```": False,
        "```{solution} x\n:class: dropdown\n\nThe reference run measured 0.31 s.\n```": True,
        "```{solution} x\n:class: dropdown\n\nIn that run 2.6 % of the tokens were masked.\n```": True,
        "```{solution} x\n:class: dropdown\n\nIn one CPU run of each, TIS touched 0.5 % of them.\n```": True,
        "```{solution} x\n:class: dropdown\n\nAt the same share a copy would run at 4 TB/s.\n```": False,
        "With stale scales the gap grew to 1.9 nats.": True,
        "| a | b |\n|---|---|\n| H100 | 80 GB {cite}`nvidiah100` |\n| ours | 1868 GB/s |": True,
    }
    try:
        for src, flagged in cases.items():
            page.write_text(src + "\n")
            assert bool(unmarked_figures(page)) == flagged, src
    finally:
        page.unlink(missing_ok=True)


# Chapters, appendices and labs: the pages that may name a run's machine tag but not its provenance.
LEARNER_PAGES = sorted((ROOT / "book").glob("ch[0-9][0-9]_*.md")) + sorted((ROOT / "book").glob("appendix_*.md")) \
    + sorted((ROOT / "labs").glob("lab_*.md"))
PROVENANCE = re.compile(
    r"\bresults\.describe\(|(?<![\w.])describe\(|\bimport\b[^\n]*\bdescribe\b"  # machine, date, torch, NCCL
    r"|\[\s*['\"](?:date|commit|command)['\"]\s*\]|\.get\(\s*['\"](?:date|commit|command)['\"]"
    r"|\[\s*['\"]versions['\"]\s*\]\s*(?:\[|\.get\()\s*['\"]"
    r"(?:python|torch|cuda|nccl|transformers|vllm|ray|labsupport)['\"]"
    r"|\.get\(\s*['\"]versions['\"]|labsupport_recording"
    r"|\b20\d\d-[01]\d-[0-3]\d\b|\bcommit [0-9a-f]{7,40}\b")


def provenance(path: Path) -> list[str]:
    """Lines of a page that print or state where and when a run was made (see this module's docstring)."""
    return [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for n, line in enumerate(path.read_text().splitlines(), 1)
            if PROVENANCE.search(line)]


@pytest.mark.parametrize("page", LEARNER_PAGES, ids=lambda p: p.name)
def test_no_provenance_on_learner_pages(page: Path) -> None:
    bad = provenance(page)
    assert not bad, ("provenance (machine details, date, versions, command, commit) belongs on the Reference "
                     "runs page; a chapter or lab names at most the run's machine tag:\n" + "\n".join(bad))


def test_the_provenance_check_catches_a_describe_call() -> None:
    """Positive and negative controls."""
    cases = {
        'print("Reference run:", results.describe(ref))': True,
        "from labsupport.course.results import describe": True,
        'print(f"measured {ref[\'date\'][:10]}")': True,
        'print(rec.get("commit"))': True,
        'print(run["versions"]["vllm"])': True,
        "The run of 2026-11-27 at commit 1a2b3c4d.": True,
        'print("Reference run on", ref["machine_tag"])': False,
        "print(placement.describe())": False,
        'old, new = rep["versions"]': False,
        "summary = frame.describe()": False,
    }
    for src, flagged in cases.items():
        assert bool(PROVENANCE.search(src)) == flagged, src


# A comparison of measured numbers is a measured claim too: next to a glued number it is computed from the same
# result (labsupport.course.compare) and glued, never typed. The scan is a heuristic: a comparison word within
# NEAR characters of a glue role, in the same sentence. COMPARISON_ALLOWED lists true statements that are not
# measured comparisons (a definition, a design fact, a comparison the glued phrase itself computes), each with
# its reason.
NEAR = 100
COMPARISON = re.compile(r"\b(?:the same(?! (?:\w+ )?(?:prompts|order|seed|share|task|model|policy|code|warm|GPU|"
                        r"device|process|bytes|weights|steps?|loop|interface|group|batch|run|worker|way|sizes))|same amount|tens of|"
                        r"hundreds of|a few times|several times|many times|most of|mostly|nearly all|almost all|"
                        r"faster|slower|largest|smallest|twice|half of|barely|far (?:more|less|above|below)|"
                        r"then (?:the|generation|training))\b", re.I)
COMPARISON_ALLOWED: list[tuple[str, str, str]] = [
    ("book/ch04_disaggregated.md", "two largest models", "which models: the benchmark's list, not a measurement"),
    ("labs/lab_03_nccl_weight_sync.md", "two largest models", "which models: the benchmark's list"),
    ("book/ch05_hybrid_engine.md", "copy moves twice its rate", "a copy reads and writes each byte: a definition"),
    ("book/ch05_hybrid_engine.md", "predicts a first level-1 sleep far below",
     "a prediction from vLLM's source, stated as one; the glued values after it are the measurement"),
    ("book/ch11_capstone.md", "from the largest: {glue:text}`c11_phases`", "the glued ranking is computed"),
    ("labs/lab_08_lora_updates.md", "slower rollout of many seconds",
     "LoRA's per-token cost, a design fact (cited), not the glued update time"),
]


def hand_comparisons(path: Path) -> list[str]:
    """Comparison words typed within NEAR characters of a glue role in the same sentence."""
    text = path.read_text()
    if text.startswith("---\n"):
        text = text.split("\n---\n", 1)[1]
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    found = []
    allowed = [(page, phrase) for page, phrase, _ in COMPARISON_ALLOWED]
    for block, _ in _blocks(text):
        for sentence in [block] if block.startswith("| ") else _sentences(block):
            glued = [m.span() for m in re.finditer(r"\{glue(?::\w+)?\}`[^`]*`", sentence)]
            if not glued:
                continue
            for m in COMPARISON.finditer(sentence):
                near = any(m.start() - e <= NEAR and s - m.end() <= NEAR for s, e in glued)
                if near and not any(page == str(path.relative_to(ROOT)) and phrase in sentence
                                    for page, phrase in allowed):
                    found.append(f"{path.relative_to(ROOT)}: {m.group(0)!r} in: {sentence[:200]}")
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_hand_typed_comparison_next_to_a_glued_number(page: Path) -> None:
    bad = hand_comparisons(page)
    assert not bad, ("a comparison typed next to a glued number (compute it from the result with "
                     "labsupport.course.compare and glue it, or add a non-measured statement to "
                     "COMPARISON_ALLOWED with its reason):\n" + "\n".join(bad))


def test_the_comparison_check_catches_a_typed_comparison() -> None:
    """Positive and negative controls on a made-up page."""
    page = ROOT / "book" / "_probe_comparison.md"
    cases = {
        "A reset took {glue:text}`x_ms`, tens of milliseconds.": True,
        "Asleep, the GPU held {glue:text}`a` and {glue:text}`b`: the same amount.": True,
        "Training was the largest phase ({glue:text}`t`).": True,
        "Its phases, from the largest: {glue:text}`ranked`.": True,  # allowed only where COMPARISON_ALLOWED says
        "The same prompts ran in both, and the step took {glue:text}`t`.": False,
        "Tens of milliseconds is typical for a reset. " + "x" * 120 + " It took {glue:text}`t`.": False,
        "Training was the largest phase, as Chapter 2 predicts.": False,
    }
    try:
        for src, flagged in cases.items():
            page.write_text(src + "\n")
            assert bool(hand_comparisons(page)) == flagged, src
    finally:
        page.unlink(missing_ok=True)
