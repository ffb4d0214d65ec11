"""labsupport.course.ranks: the launcher reports every rank's failure by name, never as a silent death."""

from __future__ import annotations

import pytest

from labsupport.course.ranks import run_ranks


def _refuse() -> None:
    raise ValueError("this object cannot be rebuilt here")


class _Unloadable:
    """Pickles fine, but unpickling it raises (as a result that needs a module the parent lacks would)."""

    def __reduce__(self):
        return _refuse, ()


def _results(rank: int, world_size: int) -> object:
    return [_Unloadable(), lambda: None, "fine"][rank]


@pytest.mark.timeout(120)
def test_a_result_that_cannot_be_sent_back_is_that_ranks_named_failure():
    (ok0, out0), (ok1, out1), (ok2, out2) = run_ranks(_results, 3, timeout_s=90)
    assert not ok0 and "rank 0's result could not be unpickled" in out0[1], out0
    assert "this object cannot be rebuilt here" in out0[1]  # (not "Died": the rank did return)
    assert not ok1 and out1[0] != "Died" and "lambda" in out1[1], out1  # the rank's own pickling error
    assert ok2 and out2 == "fine"
