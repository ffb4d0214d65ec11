"""Fixtures shared by the test files of ``tests/``: the two HTML editions of the book, built once per run.

``tests/test_book.py`` (content, links, student edition) and ``tests/test_book_browser.py`` (the pages in
headless Chromium) check the same build: a build takes about a minute, so it is session-scoped.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import student_edition as se  # noqa: E402


@pytest.fixture(scope="session")
def editions(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Instructor and student HTML, built from the same sources with notebook execution off.

    The sources are snapshotted first, so that checks compare against what was built even if someone
    edits a page meanwhile (the working tree is shared while the course is being written).
    """
    out = tmp_path_factory.mktemp("editions")
    snapshot = {p: p.read_text() for p in se.toc_sources()}
    sites = {name: se.build_site(out / name, student=(name == "student"), execute=False, warnings_as_errors=False)
             for name in ("instructor", "student")}
    return {**sites, "texts": snapshot}
