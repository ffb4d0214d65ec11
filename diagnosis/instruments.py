"""The instruments the diagnosis labs read: which trainer tensor and version a checksum matches, the size of a
difference, and plain tables. Reading this module is fine; it knows nothing of the faults."""

from __future__ import annotations

import torch


def label(versions: list[dict[str, int]], name: str, value: int) -> str:
    """What the checksum ``value`` of tensor ``name`` equals among the trainer's ``versions`` (a list of
    ``{name: checksum}``, version 0 first): ``"v2"`` (this tensor at version 2), ``"other@v2"`` (another tensor,
    named ``other``, at version 2), or ``"none"``. The newest version is named first."""
    for k in reversed(range(len(versions))):
        if versions[k].get(name) == value:
            return f"v{k}"
    for k in reversed(range(len(versions))):
        for other, v in versions[k].items():
            if v == value and other != name:
                return f"{short(other)}@v{k}"
    return "none"


def short(name: str) -> str:
    """``model.layers.0.self_attn.q_proj.weight`` -> ``layers.0.self_attn.q_proj.weight``."""
    return name.removeprefix("model.")


def difference(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """The largest ``|got - want|``, and that divided by the largest ``|want|``: a rounding error is about
    0.4% relative in bfloat16 (8 bits of mantissa), a wrong value about 100%."""
    d = (got.detach().float().cpu() - want.detach().float().cpu()).abs().max().item()
    scale = want.detach().float().abs().max().item() or 1.0
    return d, d / scale


def table(header: list[str], rows: list[list[object]]) -> str:
    """Rows under a header, columns padded to their widest cell."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])
