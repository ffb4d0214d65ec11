"""Diagnosis lab 2: the fault in an IPC weight handoff (labs/lab_d2_diagnose_handoff.md)

Graded from ``[d2]`` of ``assignments/diagnosis.toml``, under the seed written there: the fault's name (from the
list the lab prints), then where it shows. A wrong answer is told which instrument to look at again.
"""

import pytest


@pytest.mark.points(6)
def test_fault_named(verdict):
    assert verdict.fault_ok, verdict.fault_message


@pytest.mark.points(4)
def test_place_named(verdict):
    assert verdict.where_ok, verdict.where_message
