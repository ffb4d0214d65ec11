"""labsupport.metadata: the one rule every receiver applies to an update's names, dtypes and shapes."""

from labsupport import metadata


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
    assert metadata.problems([("a", "float32", [2, 3]), ("c", "int64", ())], expected) == []  # a subset is fine
