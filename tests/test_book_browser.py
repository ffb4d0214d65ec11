"""The built book in a real browser, with the network closed: what a reader offline (or behind a firewall) sees.

The instructor edition that ``tests/conftest.py`` builds for ``tests/test_book.py`` (notebook execution off; no
second build) is served on localhost and every page of the table of contents is opened in Debian's headless
Chromium (``tests/browser.py``). Every request to another host is refused, as with no network. On each page:
no console error, no failed or refused request, every math element typeset by MathJax (an ``mjx-container``)
and no raw TeX left in the text, every image loaded, every figure's SVG (Graphviz, ``tests/test_figures.py``)
loaded and within the page column, every same-site link answering (anchors included), every solution
dropdown closed until its title is clicked, open after, and no Markdown table shown as text (a cell's output
parsed as CommonMark; the executed book has them: ``BOOK_HTML`` below). A control page (a chapter whose MathJax
comes from a CDN, as Sphinx's default does) must fail the same checks. About 30 s.

The screenshots it saves, ``results/book_chapter.png``, ``results/book_lab.png``, ``results/book_gpu_run.png``
(lab 6's recorded GPU run) and ``results/book_figure.png`` (Chapter 6's figure), are the README's.
To check another build instead, e.g. ``make book``'s executed site: ``BOOK_HTML=_build/html pytest tests/test_book_browser.py``.
"""

from __future__ import annotations

import functools
import os
import re
import threading
import urllib.request
from collections.abc import Iterator
from html.parser import HTMLParser
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urldefrag, urlparse

import pytest
import student_edition as se  # on sys.path through tests/conftest.py
from browser import browser, page, save_screenshot  # noqa: F401  (pytest fixtures and a helper)

ROOT = Path(__file__).resolve().parent.parent
PAGES = [p.relative_to(ROOT).with_suffix(".html").as_posix() for p in se.toc_sources()]
# page -> (screenshot, what to centre in it): a chapter at its first display equation, a lab and a recorded GPU
# run at their top, and a chapter at its first figure
SCREENSHOTS = {"book/ch02_memory.html": ("book_chapter.png", "div.math mjx-container"),
               "labs/lab_02_memory_timeline.html": ("book_lab.png", None),
               "results/notebooks/lab_06_colocated_vllm.1xH100.html": ("book_gpu_run.png", None),
               "book/ch06_weight_updates.html": ("book_figure.png", "figure:has(object.graphviz)")}
CDN_MATHJAX = "https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-mml-chtml.js"  # Sphinx 7's default mathjax_path
WAIT_MS = 30_000

# Runs in the page once it has loaded: waits for MathJax's first typesetting, then reports what a reader sees.
_INSPECT = r"""async () => {
  const out = {mathjax: null, math: 0, untypeset: [], raw: [], badImages: [], images: 0, figures: 0, badFigures: [],
               links: [], ids: []};
  out.math = document.querySelectorAll(".math").length;
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    try { await MathJax.startup.promise; out.mathjax = MathJax.version; } catch (e) { out.mathjax = "failed: " + e; }
  }
  for (const el of document.querySelectorAll(".math")) {
    if (!el.querySelector("mjx-container")) out.untypeset.push(el.textContent.trim().slice(0, 60));
  }
  // typeset, but with a TeX command shown as text (e.g. \_ in \text{} without MathJax's textmacros)
  for (const el of document.querySelectorAll("mjx-assistive-mml mtext")) {
    if (el.textContent.includes("\\")) out.raw.push("in typeset math: " + el.textContent.trim().slice(0, 60));
  }
  // raw TeX in the text a reader sees (code, and MathJax's own output, are not prose)
  const skip = "pre, code, script, style, textarea, mjx-container, .highlight, .MathJax";
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  const tex = /\\\(|\\\[|\$\$|\\begin\{|\$[^$\s][^$\n]*?\\[A-Za-z]+[^$\n]*?\$/;
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    if (!n.parentElement || n.parentElement.closest(skip)) continue;
    const m = n.textContent.match(tex);
    if (m) out.raw.push(n.textContent.slice(Math.max(0, m.index - 20), m.index + 40).trim());
  }
  for (const img of document.images) {
    out.images += 1;
    img.loading = "eager";
    try { await img.decode(); } catch (e) { out.badImages.push(img.getAttribute("src")); continue; }
    if (!img.naturalWidth) out.badImages.push(img.getAttribute("src"));
  }
  // Graphviz figures (sphinx.ext.graphviz): an <object> per SVG file, scaled down to the column by max-width
  for (const obj of document.querySelectorAll("object.graphviz")) {
    out.figures += 1;
    const svg = () => obj.contentDocument && obj.contentDocument.querySelector("svg");
    if (!svg()) {
      await new Promise(done => { obj.addEventListener("load", done, {once: true}); setTimeout(done, 5000); });
    }
    const box = obj.getBoundingClientRect(), column = (obj.closest("article") || document.body).getBoundingClientRect();
    if (!svg() || !box.width || !box.height) out.badFigures.push(obj.getAttribute("data") + " (its SVG did not load)");
    else if (box.right > column.right + 1) out.badFigures.push(obj.getAttribute("data") + " (wider than the column)");
  }
  // a Markdown table that was not parsed as one (a cell's output read as CommonMark): its pipes shown as text
  out.rawTables = Array.from(document.querySelectorAll("article p"), p => p.textContent)
    .filter(t => /\|\s*[-\u2013\u2014]+\s*\|\s*[-\u2013\u2014]+\s*\|/.test(t))  // (Sphinx makes --- a dash)
    .map(t => t.trim().slice(0, 60));
  out.links = Array.from(document.querySelectorAll("a[href]"), a => a.href).filter(h => h.startsWith(location.origin));
  out.ids = Array.from(document.querySelectorAll("[id]"), e => e.id);
  return out;
}"""


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002  (the base class's name)
        pass


@pytest.fixture(scope="module")
def site_dir(request: pytest.FixtureRequest) -> Path:
    """The HTML checked: ``$BOOK_HTML`` if set, else the instructor edition that tests/conftest.py builds."""
    if os.environ.get("BOOK_HTML"):
        return Path(os.environ["BOOK_HTML"]).resolve()
    return request.getfixturevalue("editions")["instructor"]


@pytest.fixture(scope="module")
def site(site_dir: Path) -> Iterator[str]:
    """That HTML served over HTTP on localhost (a free port); yields its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(site_dir)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def _close_network(tab, origin: str) -> list[str]:
    """Refuse every request that leaves ``origin`` (as with the network off); returns the list of refused URLs."""
    refused: list[str] = []

    def handle(route) -> None:
        url = route.request.url
        if url.startswith(origin + "/") or url == origin:
            route.fallback()
        else:
            refused.append(url)
            route.abort("internetdisconnected")

    tab.context.route("**/*", handle)
    return refused


def _ids_of(html: str) -> set[str]:
    class Ids(HTMLParser):
        ids: set[str] = set()

        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            self.ids.update(v for k, v in attrs if k == "id" and v)

    parser = Ids()
    parser.ids = set()
    parser.feed(html)
    return parser.ids


_targets: dict[str, set[str] | None] = {}  # same-site URL -> its ids (None: it does not answer), for all pages


def _broken_links(links: list[str], here: str, here_ids: set[str]) -> list[str]:
    broken = []
    for link in sorted(set(links)):
        url, fragment = urldefrag(link)
        if url == here:
            ids = here_ids
        else:
            if url not in _targets:
                try:
                    with urllib.request.urlopen(url, timeout=10) as resp:
                        body = resp.read().decode(errors="replace")
                    _targets[url] = _ids_of(body) if urlparse(url).path.endswith((".html", "/")) else set()
                except OSError:
                    _targets[url] = None
            ids = _targets[url]
            if ids is None:
                broken.append(f"{link} (does not answer)")
                continue
        if fragment and urlparse(url).path.endswith((".html", "/")) and unquote(fragment) not in ids:
            broken.append(f"{link} (no such anchor)")
    return broken


def _open(tab, url: str) -> tuple[dict, list[str], list[str]]:
    """Open ``url`` with the network closed; returns what the page shows, refused requests, failed ones."""
    origin = "{0.scheme}://{0.netloc}".format(urlparse(url))
    refused = _close_network(tab, origin)
    failed: list[str] = []
    tab.on("requestfailed", lambda r: failed.append(f"{r.url} ({r.failure})") if r.url not in refused else None)
    tab.on("response", lambda r: failed.append(f"{r.url} (HTTP {r.status})") if r.status >= 400 else None)
    tab.goto(url, wait_until="load", timeout=WAIT_MS)
    shown = tab.evaluate(_INSPECT)
    return shown, refused, failed


def _problems(shown: dict, refused: list[str], failed: list[str], errors: list[str]) -> list[str]:
    problems = [f"refused (the page needs the network): {u}" for u in refused]
    problems += [f"failed request: {f}" for f in failed]
    problems += errors
    if shown["math"] and not (shown["mathjax"] or "").startswith("3"):
        problems.append(f"MathJax did not run ({shown['mathjax'] or 'not loaded'}) on a page with {shown['math']} "
                        "math elements")
    problems += [f"math not typeset: {m!r}" for m in shown["untypeset"][:5]]
    problems += [f"raw TeX in the text: {r!r}" for r in shown["raw"][:5]]
    problems += [f"image not loaded: {src}" for src in shown["badImages"]]
    problems += [f"figure not shown: {f}" for f in shown["badFigures"]]
    problems += [f"a table shown as text: {t!r}" for t in shown["rawTables"]]
    return problems


def _solution_toggles(tab) -> list[str]:
    """Every solution dropdown is closed, and opens when its title is clicked (sphinx-togglebutton's script)."""
    problems = []
    solutions = tab.locator("div.solution.dropdown")
    for i in range(solutions.count()):
        solution = solutions.nth(i)
        body = solution.locator(":scope > :not(.admonition-title)").first
        name = solution.get_attribute("id")
        if solution.locator("button.toggle-button").count() != 1:
            problems.append(f"solution {name}: no toggle button (togglebutton.js did not run)")
            continue
        if body.is_visible():
            problems.append(f"solution {name}: shown before its title is clicked")
        solution.locator(":scope > .admonition-title").click()
        try:
            body.wait_for(state="visible", timeout=5_000)
        except Exception:  # noqa: BLE001  (Playwright's TimeoutError; the message says what failed)
            problems.append(f"solution {name}: still hidden after a click on its title")
    return problems


@pytest.mark.parametrize("path", PAGES)
def test_page_renders_offline(site: str, page, path: str) -> None:  # noqa: F811  (page is a fixture)
    """One page of the book, network closed: no errors, math typeset, images loaded, links answer, toggles work."""
    url = f"{site}/{path}"
    shown, refused, failed = _open(page, url)
    problems = _problems(shown, refused, failed, page.errors)
    problems += [f"broken link: {b}" for b in _broken_links(shown["links"], url, set(shown["ids"]))]
    if path in SCREENSHOTS and not os.environ.get("BOOK_HTML"):  # the README's come from the test's own build
        name, centre = SCREENSHOTS[path]
        if centre and page.locator(centre).count():
            page.locator(centre).first.evaluate("e => e.scrollIntoView({block: 'center'})")
        save_screenshot(page, name)
    problems += _solution_toggles(page)
    if path.startswith("book/ch"):
        assert shown["math"] > 0, f"{path}: no math on a chapter page: did the math extension change?"
    assert not problems, f"{path} with the network closed:\n  " + "\n  ".join(problems)


def test_check_fails_with_mathjax_from_a_cdn(site: str, page) -> None:  # noqa: F811
    """Control: the same chapter, its MathJax script pointed at a CDN (Sphinx's default), fails the check."""
    path = "book/ch02_memory.html"
    url = f"{site}/{path}"

    def from_cdn(route) -> None:
        html = route.fetch().text()
        local = re.search(r'src="[./]*_static/mathjax/[^"]+"', html)
        assert local, "the page does not load MathJax from _static/mathjax"
        route.fulfill(status=200, content_type="text/html", body=html.replace(local.group(0), f'src="{CDN_MATHJAX}"'))

    page.route(url, from_cdn)  # a page route comes before the context-wide one that closes the network
    shown, refused, failed = _open(page, url)
    problems = _problems(shown, refused, failed, page.errors)
    assert CDN_MATHJAX in refused, "the CDN request was not refused: is the network really closed in the test?"
    assert any(p.startswith("MathJax did not run") for p in problems), problems
    assert any(p.startswith("raw TeX in the text") for p in problems), problems
    assert any(p.startswith("math not typeset") for p in problems), problems


def test_built_pages_load_nothing_from_other_hosts(site_dir: Path) -> None:
    """No script, stylesheet, image or frame of any built page comes from another host (links may point out)."""
    tag = re.compile(r'<(script|img|iframe|source|link)\b[^>]*?\b(src|href)="(https?:)?//[^"]+"[^>]*>', re.I)
    found = []
    for html in site_dir.rglob("*.html"):
        for m in tag.finditer(html.read_text(errors="ignore")):
            if m.group(1).lower() == "link" and not re.search(r'rel="(stylesheet|preload|modulepreload|icon)"', m.group(0)):
                continue  # <link rel="canonical"> and the like are not loaded
            found.append(f"{html.relative_to(site_dir)}: {m.group(0)[:120]}")
    assert not found, "loaded from another host:\n  " + "\n  ".join(found[:10])


# Each code cell's widest line, measured with wrapping switched off: how far it overflows its box (pixels)
_CODE_OVERFLOW = """() => [...document.querySelectorAll('article div.cell_input div.highlight pre')].map(pre => {
    const wrap = pre.style.whiteSpace; pre.style.whiteSpace = 'pre';
    const over = pre.scrollWidth - pre.clientWidth; pre.style.whiteSpace = wrap;
    const widest = pre.textContent.split('\\n').reduce((a, l) => l.length > a.length ? l : a, '');
    return {over, widest, scrolls: pre.scrollWidth - pre.clientWidth};
})"""
LAB_PAGES = [p for p in PAGES if p.startswith("labs/")]


@pytest.mark.parametrize("path", LAB_PAGES)
def test_lab_code_fits_the_column(site: str, page, path: str) -> None:  # noqa: F811
    """In the test's 1400-pixel window every code line (at most 100 characters: test_book checks the sources)
    fits its cell unwrapped, at the code size _static/course.css sets; in a 900-pixel window the cells wrap
    their lines instead of hiding their ends behind a scroll bar."""
    page.goto(f"{site}/{path}", wait_until="load", timeout=WAIT_MS)
    cells = page.evaluate(_CODE_OVERFLOW)
    assert cells, f"{path}: no code cells found (did the theme's markup change?)"
    wide = [f"{c['over']} px over: {c['widest'][:80]}..." for c in cells if c["over"] > 1]
    assert not wide, f"{path}: lines wider than the column at 1400 px:\n  " + "\n  ".join(wide)
    page.set_viewport_size({"width": 900, "height": 900})
    scrolling = [c["widest"][:80] for c in page.evaluate(_CODE_OVERFLOW) if c["scrolls"] > 1]
    assert not scrolling, f"{path}: code cells with a scroll bar at 900 px: {scrolling}"
