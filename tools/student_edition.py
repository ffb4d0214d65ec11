"""Build the student edition of the book: same sources, solutions removed (not collapsed), no package source.

`make student` runs ``python tools/student_edition.py --out _student``. The repository's _config.yml is
merged with book/_config_student.yml (sphinx-exercise's ``hide_solutions`` plus no copied sources), the
book is built into ``<out>/_build`` and copied to ``<out>/html``, and the output is then scanned: the
build fails if any text of any solution reached it.
"""

from __future__ import annotations

import argparse
import html
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
STUDENT_OVERRIDES = ROOT / "book" / "_config_student.yml"

# A {solution} directive: an opening fence of 3+ backticks (or colons), the body, the same fence closing it.
_DIRECTIVE = re.compile(r"^(?P<fence>`{3,}|:{3,})\{(?P<name>[\w-]+)\}(?P<arg>[^\n]*)\n(?P<body>.*?)^(?P=fence)[ \t]*$",
                        re.M | re.S)
_GATED = re.compile(r"^(`{3,}|:{3,})\{(solution|exercise)-(start|end)\}", re.M)


def _merge(base: dict, over: dict) -> dict:
    """Recursive dict update (lists and scalars in `over` replace those in `base`)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def edition_config(student: bool = True, execute: bool = True, cache_dir: Path | None = None) -> dict:
    """The repository's configuration, with the student overrides merged in when ``student``."""
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    if student:
        config = _merge(config, yaml.safe_load(STUDENT_OVERRIDES.read_text()))
        # no highlighted source pages (_modules/): labsupport's code holds the assignments' reference solutions
        config["sphinx"]["extra_extensions"] = [e for e in config["sphinx"].get("extra_extensions", [])
                                                if e != "sphinx.ext.viewcode"]
    config.setdefault("execute", {})
    # jupyter-book finds local extensions relative to the config file, which the builds write elsewhere
    local = config.get("sphinx", {}).get("local_extensions") or {}
    config["sphinx"]["local_extensions"] = {name: str(ROOT / path) for name, path in local.items()}
    if not execute:
        config["execute"]["execute_notebooks"] = "off"
    elif cache_dir is not None:
        # reuse the instructor build's execution cache: code cells are identical in both editions
        config["execute"]["cache"] = str(cache_dir)
    return config


def toc_sources(root: Path = ROOT) -> list[Path]:
    """Every source file the table of contents builds (book chapters and labs)."""
    toc = yaml.safe_load((root / "_toc.yml").read_text())
    files = [toc["root"]]

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if "file" in node:
                files.append(node["file"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(toc.get("parts", toc.get("chapters", [])))
    out = []
    for f in files:
        for suffix in ("", ".md", ".ipynb"):
            p = root / f"{f}{suffix}"
            if p.is_file():
                out.append(p)
                break
    return out


def directives(text: str, name: str) -> list[tuple[str, str]]:
    """(argument, body) of every ``{name}`` directive in a MyST source, nested fences included."""
    found = []
    for m in _DIRECTIVE.finditer(text):
        if m.group("name") == name:
            found.append((m.group("arg").strip(), m.group("body")))
        found.extend(directives(m.group("body"), name) if m.group("name") != name else [])
    return found


def check_sources(sources: list[Path]) -> None:
    """Refuse gated solutions: sphinx-exercise's hide_solutions crashes on them (sphinx-exercise #89)."""
    bad = [str(p.relative_to(ROOT)) for p in sources if _GATED.search(p.read_text())]
    if bad:
        raise SystemExit("gated {solution-start}/{exercise-start} forms cannot be stripped from the student "
                         f"edition; use plain {{exercise}}/{{solution}} directives in: {', '.join(bad)}")


_BREAK = "\x00"


def _prose_runs(body: str) -> list[list[str]]:
    """Runs of consecutive plain words in a directive body, as they will read in the rendered page.

    Code blocks, math, roles ({cite}, {doc}, ...), tables and directive options end a run; inline code,
    emphasis and link text are kept as their visible text.
    """
    stream, in_code = [], False
    for line in body.splitlines():
        stripped = line.strip()
        if stripped.startswith(("```", "~~~")):
            in_code = not in_code
            stream.append(_BREAK)
            continue
        if in_code or not stripped or stripped.startswith((":", "|", "#", ">")):
            stream.append(_BREAK)
            continue
        stripped = re.sub(r"^([-*+]|\d+\.)\s+", _BREAK + " ", stripped)        # list markers
        stripped = re.sub(r"\{[\w:-]+\}`[^`]*`", f" {_BREAK} ", stripped)      # roles
        stripped = re.sub(r"\$\$.*?\$\$|\$[^$]*\$", f" {_BREAK} ", stripped)   # math
        stripped = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", stripped)          # links -> their text
        stripped = stripped.replace("`", "").replace("**", "").replace("*", "")
        if "$" in stripped or "\\" in stripped:                               # math spanning lines
            stream.append(_BREAK)
            continue
        stream.extend(stripped.split())
    runs, run = [], []
    for word in stream + [_BREAK]:
        if _BREAK in word:
            if run:
                runs.append(run)
            run = []
        else:
            run.append(word)
    return runs


def fingerprints(body: str, n_words: int = 7, limit: int = 3) -> list[str]:
    """A few runs of ``n_words`` consecutive plain words from a directive body, to look for in HTML."""
    runs = sorted((r for r in _prose_runs(body) if len(r) >= n_words), key=len, reverse=True)
    return [" ".join(r[len(r) // 2 - n_words // 2:][:n_words]) for r in runs[:limit]]


def _normalise(text: str) -> str:
    text = html.unescape(re.sub(r"<[^>]+>", " ", text))
    text = text.replace("\u2019", "'").replace("\u2018", "'").replace("\u201c", '"').replace("\u201d", '"')
    text = text.replace("\u2014", "---").replace("\u2013", "--").replace("\u2026", "...").replace("\u00a0", " ")
    text = " ".join(text.split())
    return re.sub(r"\( ", "(", re.sub(r" ([,.;:!?)'])", r"\1", text))


def output_text(out_dir: Path) -> dict[Path, str]:
    """Normalised text of every text file in a built site (HTML, JS search index, sources if any)."""
    texts = {}
    for p in out_dir.rglob("*"):
        if p.is_file() and p.suffix in {".html", ".js", ".txt", ".md", ".ipynb", ".json"} and "_static" not in p.parts:
            texts[p] = _normalise(p.read_text(errors="ignore"))
    return texts


def _read(src: Path, texts: dict[Path, str] | None) -> str:
    return texts[src] if texts is not None and src in texts else src.read_text()


def public_text(sources: list[Path], texts: dict[Path, str] | None = None) -> str:
    """Normalised plain text of all sources with every solution body removed (what students may see)."""
    parts = []
    for src in sources:
        text = _read(src, texts)
        for _, body in directives(text, "solution"):
            text = text.replace(body, "")
        parts.extend(" ".join(run) for run in _prose_runs(text))
    return _normalise(" | ".join(parts))


def solution_fingerprints(sources: list[Path], texts: dict[Path, str] | None = None) -> list[tuple[str, str, str]]:
    """(file, label, fingerprint) for every solution; phrases that also occur outside solutions are skipped.

    ``texts`` (path -> source text) lets a caller check against the sources as they were when it built.
    """
    public = public_text(sources, texts)
    out = []
    for src in sources:
        for label, body in directives(_read(src, texts), "solution"):
            out.extend((src.name, label, fp) for fp in fingerprints(body) if _normalise(fp) not in public)
    return out


def leaked_solutions(out_dir: Path, sources: list[Path], texts: dict[Path, str] | None = None) -> list[str]:
    """Solutions whose text appears anywhere in the built site (should be empty for the student edition)."""
    texts = output_text(out_dir)
    leaks = [f"{p.relative_to(out_dir)}: a rendered solution block" for p in out_dir.rglob("*.html")
             if 'class="solution' in p.read_text(errors="ignore")]
    if (out_dir / "_modules").exists():
        leaks.append("_modules/: labsupport's source, the assignments' reference solutions")
    for name, label, fp in solution_fingerprints(sources, texts):
        hits = [p for p, t in texts.items() if _normalise(fp) in t]
        if hits:
            leaks.append(f"{name}:{label}: '{fp}' found in {hits[0].relative_to(out_dir)}")
    return leaks


def build_site(out: Path, *, student: bool = True, execute: bool = True, warnings_as_errors: bool = True) -> Path:
    """Build one edition of the book under ``out`` with jupyter-book; return its HTML folder."""
    out = out.resolve()
    cache = ROOT / "_build" / ".jupyter_cache"
    config = edition_config(student=student, execute=execute, cache_dir=cache if cache.exists() else None)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "_config_edition.yml"
        cfg.write_text(yaml.safe_dump(config, sort_keys=False))
        cmd = [str(Path(sys.executable).with_name("jupyter-book")), "build", str(ROOT), "--config", str(cfg),
               "--path-output", str(out), "--keep-going"] + (["-n", "-W"] if warnings_as_errors else [])
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    return out / "_build" / "html"


def build(out: Path, execute: bool = True, warnings_as_errors: bool = True) -> Path:
    """Build the student edition into ``out/html``, then fail if any solution text reached it."""
    sources = toc_sources()
    check_sources(sources)
    built = build_site(out, student=True, execute=execute, warnings_as_errors=warnings_as_errors)
    html_dir = out.resolve() / "html"
    if html_dir.exists():
        shutil.rmtree(html_dir)
    shutil.copytree(built, html_dir)
    leaks = leaked_solutions(html_dir, sources)
    if leaks:
        raise SystemExit("solution text reached the student edition:\n  " + "\n  ".join(leaks))
    n = sum(len(directives(p.read_text(), "solution")) for p in sources)
    print(f"student edition: {html_dir / 'index.html'} ({n} solutions removed, none found in the output)")
    return html_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="_student", help="output folder (HTML goes to <out>/html)")
    ap.add_argument("--no-execute", action="store_true", help="do not execute notebooks (pages without outputs)")
    ap.add_argument("--allow-warnings", action="store_true", help="do not pass -n -W to jupyter-book")
    a = ap.parse_args(argv)
    build(Path(a.out), execute=not a.no_execute, warnings_as_errors=not a.allow_warnings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
