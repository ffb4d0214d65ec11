"""What the browser tests share: Debian's Chromium driven by Playwright, and JupyterLab started as `make lab` does.

Chromium is Debian's package (``/usr/bin/chromium``, or ``$CHROMIUM``): ``make test`` installs it when it is
missing and runs as root. Playwright's Python package (requirements.txt) drives that binary; it downloads no
browser. Without either, a browser test skips and says what to install; under CI (``CI`` set) it fails
instead, so that a green CI run cannot hide a browser test that never ran.

In a test module::

    from browser import browser, page, save_screenshot  # noqa: F401  (pytest fixtures and a helper)

``page`` is a fresh 1400x900 page; ``page.errors`` collects its console errors and uncaught page errors.
``start_lab`` / ``LabServer`` run ``make lab`` on a free localhost port with a token, as a learner's would run.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
CHROMIUM = Path(os.environ.get("CHROMIUM", "/usr/bin/chromium"))
# As root in a container, with the network closed: no sandbox (root), no GPU, and none of the background
# fetches (QUIC, component updates, sync) that would wait on a network that is not there. Playwright adds
# --headless and a fresh --user-data-dir itself.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"]
VIEWPORT = {"width": 1400, "height": 900}


def cannot_run(reason: str) -> None:
    """Skip with what to install; under CI, fail: CI installs everything, so a missing piece is a bug there."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set: the browser tests must run here)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser():
    """Debian's headless Chromium under Playwright, one per test module (Playwright gives it a fresh profile)."""
    if not CHROMIUM.exists():
        cannot_run(f"no Chromium at {CHROMIUM}: `make test` as root installs it, or run `sudo apt-get install "
                   "chromium` (Debian/Ubuntu), or point $CHROMIUM at a Chromium binary")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        cannot_run(f"Playwright is not installed for {sys.executable}: `make setup` installs it (requirements.txt)")
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, chromium_sandbox=False)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser):
    """A fresh page in its own context; ``page.errors`` lists console errors and uncaught exceptions."""
    context = browser.new_context(viewport=VIEWPORT)
    tab = context.new_page()
    tab.errors = []
    tab.on("console", lambda msg: tab.errors.append(f"console: {msg.text}") if msg.type == "error" else None)
    tab.on("pageerror", lambda exc: tab.errors.append(f"page error: {exc}"))
    try:
        yield tab
    finally:
        context.close()


def save_screenshot(tab, name: str) -> Path:
    """Save what the page shows as ``<name>`` in a temporary folder, or, with ``LABSUPPORT_SCREENSHOTS=results``,
    as ``results/<name>``, the copy the README shows (so that a test run leaves a checkout unchanged)."""
    keep = os.environ.get("LABSUPPORT_SCREENSHOTS") == "results"
    path = (RESULTS if keep else Path(tempfile.gettempdir()) / "labsupport_screenshots") / name
    path.parent.mkdir(parents=True, exist_ok=True)
    tab.screenshot(path=str(path))
    return path


# ------------------------------------------------------------------------------------------ JupyterLab
@dataclass
class LabServer:
    """A running ``make lab``: its base URL, token, the folder it serves, its process and its log."""

    url: str
    token: str
    root: Path
    proc: subprocess.Popen
    log: Path

    def lab_url(self, path: str = "") -> str:
        """The JupyterLab page (``path`` under ``/lab``, e.g. ``/tree/x.md``), logged in through the token."""
        return f"{self.url}/lab{path}?token={self.token}"

    def api(self, path: str) -> bytes:
        """GET a Jupyter server REST path (``/api/...``) with the token."""
        req = urllib.request.Request(self.url + path, headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.read()

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def start_lab(root: Path, home: Path, timeout: float = 120) -> Iterator[LabServer]:
    """Run ``make lab`` on ``root`` (localhost, a free port, a token, no browser), as a new user would.

    ``home`` holds the server's own config, user settings and workspaces, so that nothing of this machine's
    user (``~/.jupyter``) changes what the test sees: only the settings the repository ships apply.
    The server and its kernels are stopped on exit.
    """
    if shutil.which("make") is None:
        cannot_run("`make` is not installed: the JupyterLab test starts JupyterLab with `make lab`")
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTERLAB_SETTINGS_DIR=str(home / "user-settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"), JUPYTER_RUNTIME_DIR=str(home / "runtime"))
    opts = f"--no-browser --ip=localhost --port={port} --ServerApp.port_retries=0 --IdentityProvider.token={token}"
    cmd = ["make", "--no-print-directory", "-C", str(ROOT), "lab", f"PY={sys.executable}", "SETUP=",
           f"LAB_DIR={root}", f"LAB_OPTS={opts}"]
    log = home / "make-lab.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)  # its own process group: stopped whole, kernels included
    server = LabServer(url=f"http://localhost:{port}", token=token, root=root, proc=proc, log=log)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"`make lab` exited with {proc.returncode} before serving:\n{server.log_tail()}")
            with contextlib.suppress(urllib.error.URLError, OSError):
                server.api("/api/status")
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"`make lab` did not answer on {server.url} in {timeout:.0f} s:\n{server.log_tail()}")
            time.sleep(0.5)
        yield server
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group (JupyterLab then shuts its kernels down); SIGKILL what is left after 20 s."""
    for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            proc.poll()  # reap make, so that only the server and its kernels keep the group alive
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
