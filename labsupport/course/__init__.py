"""The course's apparatus: what makes the labs run, not a mechanism a chapter teaches.

- ``results``: reference results under results/, each with its machine, versions, command and date
- ``compare``: comparisons of measured values as phrases for the book's prose
- ``hardware``: what this machine has, and the one place that picks the GPU path or the CPU stand-in
- ``progress``: progress on long work, the same in a terminal and in a notebook
- ``models``: the tiny language model and tokenizer, built and trained offline
- ``versions``: every difference between the vLLM and torch versions the course runs
- ``ranks``: run a function on N ranks in fresh processes with a deadline (tests and benchmarks)
- ``peer``: a helper process that rebuilds handles, for the labs' two-process experiments
- ``planner``: memory and transfer-time arithmetic for designs at scale
- ``sync_timing``, ``ipc_timing``: a sync or an IPC update timed here and now, as Labs 3 and 5 do

and ``implementation(name)``: a core module, or with ``LABSUPPORT_IMPL=assignments`` the learner's assignment
that replaces it (the labs' one switch to run on a learner's code).
"""

import importlib
import os
from pathlib import Path
from types import ModuleType


def implementation(name: str) -> ModuleType:
    """``labsupport.core.<name>``, or with ``LABSUPPORT_IMPL=assignments`` your assignment's module of that name
    (``assignments/a*_<name>.py``, graded by ``make grade``): the one switch that runs a lab on your code."""
    if os.environ.get("LABSUPPORT_IMPL", "reference") != "assignments":
        return importlib.import_module(f"labsupport.core.{name}")
    found = sorted((Path(__file__).resolve().parents[2] / "assignments").glob(f"a[0-9]*_{name}.py"))
    if not found:
        raise ModuleNotFoundError(f"LABSUPPORT_IMPL=assignments, but there is no assignments/a*_{name}.py")
    try:
        module = importlib.import_module(f"assignments.{found[0].stem}")
    except ModuleNotFoundError as exc:
        if exc.name != "assignments":
            raise
        raise ModuleNotFoundError("this environment does not have the course's assignments/ installed: run "
                                  "`make setup` (it reinstalls the course, assignments/ included)") from None
    print(f"LABSUPPORT_IMPL=assignments: core.{name} is your assignments/{found[0].name}")
    return module
