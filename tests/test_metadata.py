"""labsupport.metadata: the one rule every receiver applies to an update's names, dtypes and shapes."""

import torch

from labsupport import metadata
from labsupport.core import buckets


def test_problems_names_each_mismatch_in_order():
    expected = {"a": ("float32", (2, 3)), "b": ("bfloat16", (4,)), "c": ("int64", ())}
    found = [("a", "float32", (3, 2)), ("b", "float16", (4,)), ("x", "float32", (1,)), ("a", "float32", [2, 3]),
             ("c", "int64", ())]
    assert metadata.problems(found, expected) == [
        ("a", "shape", (2, 3), (3, 2)),
        ("b", "dtype", "bfloat16", "float16"),  # a wrong dtype is reported alone (its shape is not compared)
        ("x", "unknown", None, None),
        ("a", "twice", None, None),  # sent again, this time right
    ]
    subset = [("a", "float32", [2, 3]), ("c", "int64", ())]
    assert metadata.problems(subset, expected, partial=True) == []  # a subset, said to be one, is fine


def test_a_missing_name_is_refused_unless_the_update_says_it_is_partial():
    """Review 2026-11-28 M4: a filtered state dict (a layer dropped) must not load as if whole."""
    expected = {"a": ("float32", (2,)), "b": ("float32", (2,)), "c": ("float32", (2,))}
    sent = [("a", "float32", (2,)), ("c", "float32", (2,))]
    assert metadata.problems(sent, expected) == [("b", "missing", None, None)]
    assert metadata.describe(sent, expected) == ["'b': missing (send it, or say partial=True)"]
    assert metadata.problems(sent, expected, partial=True) == []


def test_describe_names_the_bad_tensor_against_a_receivers_own_tensors():
    mine = {"layer.0.q.weight": torch.zeros(64, 64, dtype=torch.float16), "norm": torch.zeros(3)}
    exp = {m.name: m for m in buckets.metas(mine)}  # expected values may be Metas: their dtype and shape count
    bad = buckets.metas({**mine, "layer.0.q.weight": torch.zeros(64, 65, dtype=torch.float16)})
    assert metadata.describe(bad, exp) == ["'layer.0.q.weight': shape expected (64, 64), found (64, 65)"]
    renamed = [buckets.Meta("layer.0.q.wieght", "float16", (64, 64)), buckets.Meta("norm", "float32", (3,))] * 2
    assert metadata.describe(renamed, exp) == [
        "'layer.0.q.wieght': unknown name, expected one of this receiver's 2 tensors (did you mean 'layer.0.q.weight'?)",
        "'layer.0.q.wieght': sent twice", "'layer.0.q.wieght': unknown name, expected one of this receiver's 2 "
        "tensors (did you mean 'layer.0.q.weight'?)", "'norm': sent twice",
        "'layer.0.q.weight': missing (send it, or say partial=True)"]
