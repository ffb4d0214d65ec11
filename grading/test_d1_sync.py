"""Diagnosis lab 1: the fault in a weight sync over a process group (labs/lab_d1_diagnose_sync.md)

Graded from ``[d1]`` of ``assignments/diagnosis.toml``, under the seed written there: the fault's name (from the
list the lab prints), then where it shows. A wrong answer is told which instrument to look at again.
"""

import pytest


@pytest.mark.points(6)
def test_fault_named(verdict):
    assert verdict.fault_ok, verdict.fault_message


@pytest.mark.points(4)
def test_place_named(verdict):
    assert verdict.where_ok, verdict.where_message
