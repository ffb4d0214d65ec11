"""Comparisons of measured values, as phrases for the book's prose.

A page glues a measured number from ``results/`` (``{glue:text}``); a word that compares numbers
("the same", "then", "faster") is a measured claim too, so it is computed here from the same values
and glued with them (tests/test_measured_numbers.py fails on a comparison typed next to a glued
number).
"""

from __future__ import annotations

from typing import Callable


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms"


def ranking(values: dict[str, float], fmt: Callable[[float], str] = ms) -> str:
    """``"a (9 ms), then b (5 ms), c (2 ms) and d (1 ms)"``: the names from the largest value to the
    smallest."""
    if not values:
        raise ValueError("ranking() needs at least one value")
    parts = [f"{name} ({fmt(v)})" for name, v in sorted(values.items(), key=lambda kv: -kv[1])]
    if len(parts) == 1:
        return parts[0]
    rest = parts[1:]
    return parts[0] + ", then " + (rest[0] if len(rest) == 1 else ", ".join(rest[:-1]) + " and "
                                   + rest[-1])


def closeness(a: float, b: float, tol: float = 0.01) -> str:
    """How close two values are, relative to the larger: ``"the same to within 1 %"`` when they
    differ by at most ``tol`` of it, else ``"12 % apart"``."""
    top = max(abs(a), abs(b))
    rel = abs(a - b) / top if top else 0.0
    return (
        f"the same to within {tol:.0%}".replace("%", " %")
        if rel <= tol
        else f"{rel:.0%} apart".replace("%", " %")
    )


def share(part: float, whole: float) -> str:
    """``"85 %"``: ``part`` as a share of ``whole``."""
    if whole <= 0:
        raise ValueError(f"share() needs a positive whole, got {whole}")
    return f"{part / whole:.0%}".replace("%", " %")


def times(a: float, b: float) -> str:
    """``"3.2 times"`` (a over b) where a is the larger, else ``"0.31 times"``."""
    if b <= 0:
        raise ValueError(f"times() needs a positive divisor, got {b}")
    r = a / b
    return f"{r:.1f} times" if r >= 1 else f"{r:.2f} times"
