"""Progress on long work, shown the same way everywhere: a tqdm bar, a ticking wait, a live plot.

Where it goes depends on where the code runs:

- in a terminal, bars and notes go to stderr, so what a command prints on stdout (tables, JSON)
  stays as it was;
- in a Jupyter kernel, a bar is one line that is redrawn in place (an IPython display, not a stream
  of carriage returns), and once done it is printed once: the saved notebook and the built book keep
  one line per bar, not one per refresh. A live plot works the same way: redrawn in place, then
  shown once at the end.

``LABSUPPORT_PROGRESS=0`` turns all of it off (bars, waits, notes, live plots), for tests that
compare output.
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from tqdm.std import tqdm

ENV = "LABSUPPORT_PROGRESS"


def enabled() -> bool:
    """False when ``LABSUPPORT_PROGRESS`` is 0 (or false, no, off)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def in_notebook() -> bool:
    """True inside a Jupyter kernel (an IPython shell with a kernel), False in a terminal or a plain
    script."""
    ipython = sys.modules.get("IPython")  # not imported: certainly not a kernel
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and hasattr(shell, "kernel")


def _live() -> bool:
    """Redraw often: a notebook or a terminal. Output to a log file or a pipe is refreshed
    rarely."""
    return in_notebook() or sys.stderr.isatty()


def note(msg: str) -> None:
    """One line about long work (what a start-up waits for, how long it took): stdout in a notebook,
    stderr in a terminal."""
    if enabled():
        print(msg, file=sys.stdout if in_notebook() else sys.stderr, flush=True)


def write(msg: str) -> None:
    """``print`` for lines printed while a bar runs: in a terminal the bar steps aside and comes
    back below."""
    tqdm.write(msg, file=sys.stdout)
    sys.stdout.flush()


class _NotebookLine:
    """What a bar writes to in a notebook: each refresh replaces one display (``display_id``)
    instead of adding a carriage return to the cell's stream. At the end the display is emptied and
    the last line is printed once, so every recording of the cell (JupyterLab, nbclient for the
    book, nbval) keeps that one line."""

    encoding = "utf-8"  # (tqdm draws its unicode bar when the file says it can take it)
    EMPTY = {"text/html": ""}  # renders as nothing, in JupyterLab and in the book

    def __init__(self) -> None:
        self.handle, self.text = None, ""

    def write(self, s: str) -> None:
        parts = [p for p in s.replace("\n", "\r").split("\r") if p.strip()]
        if parts and parts[-1] != self.text:
            self.text = parts[-1]
            self._show({"text/plain": self.text})

    def flush(self) -> None:
        pass

    def _show(self, data: dict[str, str]) -> None:
        from IPython.display import display

        if self.handle is None:
            self.handle = display(self.EMPTY, raw=True, display_id=True)
        self.handle.update(data, raw=True)

    def finish(self, keep: bool) -> None:
        if self.handle is not None:
            self.handle.update(self.EMPTY, raw=True)
            self.handle = None
            if keep and self.text:
                print(self.text, flush=True)


class Bar(tqdm):
    """A tqdm bar configured for the course (see the module docstring); ``bar(...)`` makes one."""

    # no tqdm monitor thread: only the caller (and wait()'s clock thread) redraw a bar
    monitor_interval = 0

    def __init__(self, iterable: Any = None, desc: str | None = None, total: float | None = None, *,
                 unit: str = "it", leave: bool = True, disable: bool = False,
                 **kwargs: Any) -> None:
        self._line = _NotebookLine() if in_notebook() else None
        kwargs.setdefault("mininterval", 1.0 if _live() else 30.0)
        super().__init__(iterable, desc=desc, total=total, unit=unit, leave=leave,
                         disable=disable or not enabled(), file=self._line or sys.stderr,
                         dynamic_ncols=self._line is None and sys.stderr.isatty(), **kwargs)

    def close(self) -> None:
        shown = not self.disable
        super().close()
        if shown and self._line is not None:
            self._line.finish(bool(self.leave))


def bar(iterable: Any = None, desc: str | None = None, total: float | None = None,
        **kwargs: Any) -> Bar:
    """``tqdm(iterable, desc, total, unit=..., leave=..., disable=...)`` for long loops: stderr in a
    terminal, one line redrawn in place in a notebook, nothing with ``LABSUPPORT_PROGRESS=0``."""
    return Bar(iterable, desc, total, **kwargs)


@contextlib.contextmanager
def waiting(what: str, tick_s: float | None = None) -> Iterator[Bar]:
    """While one blocking call runs (a vLLM engine's start), show ``what`` and the seconds elapsed.

    A small thread redraws the line every ``tick_s``: it reads only the clock (never a tensor or the
    engine), and takes no tqdm lock (the call may fork processes meanwhile: a child must not inherit
    a held lock).
    """
    b = Bar(desc=what, bar_format="{desc}: {elapsed} elapsed", leave=False)
    stop = threading.Event()
    tick = tick_s or (1.0 if _live() else 30.0)

    def clock() -> None:
        while not stop.wait(tick):
            b.refresh(nolock=True)

    thread = threading.Thread(target=clock, name="labsupport-progress", daemon=True)
    if not b.disable:
        thread.start()
    try:
        yield b
    finally:
        stop.set()
        if thread.is_alive():
            thread.join()
        b.close()


class LivePlot:
    """A small matplotlib figure redrawn in place in a notebook while a loop runs; ``close()``
    leaves the last drawing as an ordinary output of the cell. Outside a notebook, or with
    ``LABSUPPORT_PROGRESS=0``, it does nothing. ``draw(ax)`` draws the current state on a cleared
    axis."""

    def __init__(self, draw: Callable[[Any], None], *, figsize: tuple[float, float] = (6.0, 2.4),
                 every_s: float = 2.0, dpi: int = 80) -> None:
        self.draw, self.every_s, self.dpi = draw, every_s, dpi
        self.on = enabled() and in_notebook()
        self.fig = self.line = None
        self.last = 0.0
        if self.on:
            # not pyplot: the inline backend never shows it a second time
            from matplotlib.figure import Figure

            self.fig = Figure(figsize=figsize)
            self.ax = self.fig.add_subplot()
            self.line = _NotebookLine()

    def _png(self) -> dict[str, str]:
        self.ax.clear()
        self.draw(self.ax)
        self.fig.tight_layout()
        buf = io.BytesIO()
        self.fig.savefig(buf, format="png", dpi=self.dpi)
        return {"image/png": base64.b64encode(buf.getvalue()).decode(), "text/plain": "<live plot>"}

    def update(self) -> None:
        """Redraw, at most every ``every_s`` seconds (a drawing costs tens of milliseconds)."""
        if self.on and time.monotonic() - self.last >= self.every_s:
            self.line._show(self._png())
            self.last = time.monotonic()

    def close(self) -> None:
        """Replace the live drawing by the final one, shown once."""
        if self.on:
            from IPython.display import display

            self.on = False
            self.line.finish(keep=False)
            display(self._png(), raw=True)
