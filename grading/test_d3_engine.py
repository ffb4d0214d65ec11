"""Diagnosis lab 3: the fault in a co-located vLLM engine after an update (labs/lab_d3_diagnose_engine.md)

Graded from ``[d3]`` of ``assignments/diagnosis.toml``, under the seed written there: the fault's name (from the
list the lab prints), then where it shows. A wrong answer is told which instrument to look at again.
"""

import pytest


@pytest.mark.points(6)
def test_fault_named(verdict):
    assert verdict.fault_ok, verdict.fault_message


@pytest.mark.points(4)
def test_place_named(verdict):
    assert verdict.where_ok, verdict.where_message
