"""Pages without a console error on first load: two small fixes to what Jupyter Book 1's stack writes into every page.

A Sphinx extension (``sphinx.local_extensions`` in ``_config.yml``); ``tests/test_book_browser.py`` opens every
page in Chromium and fails on any console error, so each fix here is checked there.

- sphinx-thebe adds its inline ``const THEBE_JS_URL = ...`` script with the file name ``None``; Sphinx 7.4 adds
  the extensions' scripts again when it writes, as ``''``, which does not compare equal to ``None``, so every
  page declared the constant twice ("Identifier 'THEBE_JS_URL' has already been declared"). Identical scripts
  are written once.
- pydata-sphinx-theme's ``default_mode`` (an ``html_context`` value) is empty unless set, and its script logs
  "Got invalid theme mode" on a reader's first visit before falling back to ``auto``; it is set to ``auto``, the
  same behaviour without the error. A mode set in ``html_context`` is kept.
"""

from __future__ import annotations

from typing import Any


def _theme_mode(app, config) -> None:
    context = dict(config.html_context or {})
    if not context.get("default_mode"):
        context["default_mode"] = "auto"
        config.html_context = context


def _unique_scripts(app, pagename: str, templatename: str, context: dict[str, Any], doctree) -> None:
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, unique = set(), []
    for js in scripts:
        attributes = getattr(js, "attributes", {}) or {}
        key = (str(getattr(js, "filename", js) or ""), tuple(sorted((k, str(v)) for k, v in attributes.items())))
        if key not in seen:
            seen.add(key)
            unique.append(js)
    context["script_files"] = unique


def setup(app) -> dict:
    app.connect("config-inited", _theme_mode)
    app.connect("html-page-context", _unique_scripts)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
