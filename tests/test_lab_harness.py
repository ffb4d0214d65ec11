"""The harness that runs the labs (the repository's conftest.py): a lab whose kernel dies fails in seconds."""
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DYING_LAB = """---
jupytext:
  text_representation: {extension: .md, format_name: myst}
kernelspec: {display_name: Python 3, language: python, name: python3}
---
# A lab whose kernel crashes

```{code-cell} ipython3
print("first cell ran")
```

```{code-cell} ipython3
import os, signal
os.kill(os.getpid(), signal.SIGSEGV)  # what a crash in native code does to the kernel
```
"""


def test_a_dead_kernel_fails_the_cell_in_seconds_not_at_the_timeout(tmp_path):
    """nbval alone waits the whole cell timeout (30 min in `make test`) for a kernel that has died."""
    shutil.copy(ROOT / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "labs").mkdir()
    (tmp_path / "labs" / "lab_99_dies.md").write_text(DYING_LAB)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout=600",
                        "labs/lab_99_dies.md"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    took = time.monotonic() - t0
    assert r.returncode == 1, r.stdout[-3000:]
    assert "1 failed, 1 passed" in r.stdout and "kernel died while this cell ran (exit code -11" in r.stdout
    assert took < 120, f"took {took:.0f} s to notice the dead kernel"
