"""The grader's pytest plumbing: the ``points`` marker, ``--impl``, and the ``impl`` fixture.

A graded test module is ``grading/test_<key>_<topic>.py`` (``key``: ``a1`` ... for an assignment, any other
short key for another graded part); its docstring's first line names the part in the report. Each test
carries ``@pytest.mark.points(n)``. A test that takes the ``impl`` fixture is an *implementation test*: it
runs once per implementation being graded (``--impl``, or the ``IMPL`` environment variable; see
``grading/impl.py``) and gets that implementation's functions for its assignment as ``impl.<name>``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from grading import impl as impls
from labsupport.course.hardware import skip_gpu_tests


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--impl", default=None,
                     help="implementation(s) to grade, comma-separated (default: $IMPL or 'assignments')")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "points(n): the points a graded test is worth")
    config.addinivalue_line("markers", "gpu(n): needs n CUDA GPUs; skipped with a reason on smaller machines")


def requested(config: pytest.Config) -> list[str]:
    """The implementations this run grades, in the order asked."""
    names = impls.expand(config.getoption("--impl", default=None) or os.environ.get("IMPL") or "assignments")
    for name in names:
        impls.check(name)
    return names


def key_of(path: str | Path) -> str:
    """``grading/test_a2_buckets.py`` -> ``"a2"``."""
    return Path(path).stem.removeprefix("test_").split("_")[0]


class Impl:
    """One implementation of one assignment: ``name`` (effective: "reference", "bugs.a2_misaligned", ...),
    ``key``, and its functions as attributes. Pass ``(impl.name, impl.key)`` to a child process and
    ``grading.impl.load`` them there."""

    def __init__(self, name: str, key: str) -> None:
        self.name, self.key = name, key
        self.module = impls.load(name, key)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.module, attr)

    def __repr__(self) -> str:
        return f"Impl({self.name!r}, {self.key!r})"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "impl" in metafunc.fixturenames:
        key = key_of(metafunc.definition.path)
        names = list(dict.fromkeys(impls.effective(i, key) for i in requested(metafunc.config)))
        metafunc.parametrize("impl", names, indirect=True, ids=names)


@pytest.fixture
def impl(request: pytest.FixtureRequest) -> Impl:
    return Impl(request.param, key_of(request.node.path))


@pytest.fixture
def verdict(request: pytest.FixtureRequest):
    """The grader's verdict on a diagnosis lab's answer in ``assignments/diagnosis.toml`` (``diagnosis.grade``).
    The answers are the learner's own work, so they are graded with ``IMPL=assignments`` (``make grade``) and
    skipped under any other ``IMPL``: ``IMPL=reference`` has no answers to give."""
    if "assignments" not in requested(request.config):
        pytest.skip("a diagnosis answer is the learner's: graded with IMPL=assignments (make grade)")
    import diagnosis

    return diagnosis.grade(key_of(request.node.path))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    graded = [i for i in items if here in Path(i.path).parents]
    missing = [i.nodeid for i in graded if i.get_closest_marker("points") is None]
    if missing:
        raise pytest.UsageError("graded tests without @pytest.mark.points(n): " + ", ".join(missing))
    skip_gpu_tests(graded)  # here too: the grader may run without the repository's conftest
