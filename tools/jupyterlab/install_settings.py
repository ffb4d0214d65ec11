"""Link the course's JupyterLab settings (``overrides.json5`` beside this file) into JupyterLab's app settings.

jupyterlab_server reads default overrides from ``<app dir>/settings/overrides.d/*.json5``, where the app dir
belongs to the Python that runs JupyterLab (``<prefix>/share/jupyter/lab``, or ``$JUPYTERLAB_DIR``). JupyterLab
reads no settings from the folder it is started in, so the set-up puts a link there: the file in the repository
stays the one source, and both ``make lab`` and ``jupyter lab`` from the activated .venv read it. A learner's own
settings (Settings > Settings Editor) still win over these defaults. Run by the set-up and by ``make lab``.
"""

from __future__ import annotations

import sys
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "overrides.json5"
NAME = "rlhf-course.json5"


def install() -> Path:
    """Make ``<app dir>/settings/overrides.d/rlhf-course.json5`` a link to this folder's ``overrides.json5``."""
    try:
        from jupyterlab.commands import get_app_dir
    except ImportError:
        sys.exit(f"JupyterLab is not installed for {sys.executable}: `make setup` installs it (requirements.txt)")
    if not SOURCE.is_file():
        sys.exit(f"{SOURCE} is missing: it holds the settings that open a lab .md as a notebook (git checkout it)")
    link = Path(get_app_dir()) / "settings" / "overrides.d" / NAME
    if link.is_symlink() and link.resolve() == SOURCE:
        return link
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(SOURCE)
    return link


if __name__ == "__main__":
    try:
        made = install()
    except OSError as err:  # e.g. a system Python's prefix that this user cannot write: JupyterLab still starts
        print(f"== could not link the course's JupyterLab settings ({err}): a double-click opens a lab .md as text; "
              "right-click it > Open With > Jupytext Notebook instead")
    else:
        if "-v" in sys.argv:
            print(f"JupyterLab settings: {made} -> {SOURCE}")
