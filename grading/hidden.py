"""Tests an instructor keeps back: ``make grade HIDDEN=dir`` (``python -m grading --hidden dir``).

The folder holds graded test modules written as the public ones are (``test_<key>_<topic>.py``, each test with
``@pytest.mark.points(n)``, the ``impl`` and ``verdict`` fixtures of ``grading/conftest.py``, helpers from
``grading.support``), plus any files they import. Their tests count in their part's points and are listed in the
same report, marked ``hidden``. A folder under ``grading/`` (the course keeps them in ``grading/hidden/``, which
``make student-repo`` leaves out) runs where it is; any other folder (the instructor's private repository, next
to a learner's submission) is copied under ``grading/`` for the run, since pytest gives a conftest's fixtures only
to the tests below it, and removed after.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

HERE = Path(__file__).resolve().parent
FOLDER = "grading/hidden/"  # the instructor's hidden tests in the course's repository; the student copy has none
STAGING = "_hidden-"  # the prefix of the folder a run copies an outside folder to (.gitignore'd)


def is_hidden(path: Path) -> bool:
    """Whether the graded test module at ``path`` (absolute, or relative to the repository) is a hidden one."""
    parts = path.parts[path.parts.index(HERE.name) + 1:-1] if HERE.name in path.parts else ()
    return bool(parts) and (parts[0] == "hidden" or parts[0].startswith(STAGING))


@contextlib.contextmanager
def staged(folder: Path | None) -> Iterator[list[Path]]:
    """The hidden test modules of ``folder`` (none if None), under ``grading/`` while the block runs."""
    if folder is None:
        yield []
        return
    folder = folder.resolve()
    found = sorted(folder.glob("test_*.py")) if folder.is_dir() else []
    if not found:
        raise SystemExit(f"HIDDEN={folder}: expected a folder of graded test modules (test_<key>_<topic>.py, "
                         f"as in grading/), found {'none' if folder.is_dir() else 'no folder'}")
    if HERE in folder.parents:
        yield found
        return
    stage = Path(tempfile.mkdtemp(prefix=STAGING, dir=HERE))
    try:
        shutil.copytree(folder, stage, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        yield [stage / p.name for p in found]
    finally:
        shutil.rmtree(stage, ignore_errors=True)
