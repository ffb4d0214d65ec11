"""The one check of an update's metadata (names, dtypes, shapes) against what a receiver holds.

Every receiver of weights (``broadcast``, ``vllm_weights``, ``ipc``) refuses an update whose
metadata does not match before it writes anything. What counts as a mismatch is decided here, once
(``problems``); ``describe`` words it for a reader who holds the tensors."""

from __future__ import annotations

import difflib
from typing import Any, Iterable, Mapping

Found = tuple[str, str, tuple[int, ...]]  # (name, dtype name, shape): a ``Meta`` or a plain tuple
_SAYS = {"twice": "sent twice", "missing": "missing (send it, or say partial=True)",
        "unknown": "unknown name, expected one of this receiver's {n} tensors{hint}",
        "dtype": "dtype expected {want}, found {got}",
        "shape": "shape expected {want}, found {got}"}


def problems(found: Iterable[Found], expected: Mapping[str, tuple], *,
             partial: bool = False) -> list[tuple[str, str, Any, Any]]:
    """``(name, what, expected, found)`` for each mismatch, in the update's order; empty: accept.
    ``what``: ``"twice"``, ``"unknown"`` (not in ``expected``: name -> ``(dtype name, shape)`` or
    ``Meta``), ``"dtype"``, ``"shape"``, ``"missing"`` (not sent; accepted if ``partial``)."""
    out, seen = [], set()
    for name, dtype, shape in found:
        if name in seen:
            out.append((name, "twice", None, None))
        seen.add(name)
        if name not in expected:
            out.append((name, "unknown", None, None))
            continue
        e_dtype, e_shape = expected[name][-2:]
        if dtype != e_dtype:
            out.append((name, "dtype", e_dtype, dtype))
        elif tuple(shape) != tuple(e_shape):
            out.append((name, "shape", tuple(e_shape), tuple(shape)))
    return out + [(n, "missing", None, None) for n in expected if not partial and n not in seen]


def describe(found: Iterable[Found], expected: Mapping[str, tuple], *, partial: bool = False,
             says: Mapping[str, str] = _SAYS) -> list[str]:
    """``problems`` as one line each, for a reader who holds the ``expected`` tensors (``says``:
    the wording of each ``what``, with ``{want}``, ``{got}``, ``{hint}`` and ``{n}`` filled in)."""
    out = []
    for name, what, want, got in problems(found, expected, partial=partial):
        close = what == "unknown" and difflib.get_close_matches(name, [*expected], n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        out.append(f"'{name}': " + says[what].format(want=want, got=got, hint=hint,
                                                       n=len(expected)))
    return out
