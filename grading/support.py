"""What several graded test modules share: a mixed state, byte digests, and failures from child processes."""

from __future__ import annotations

import hashlib
import re

import torch

ALIGN = 256  # the alignment the contract of Assignment 2 states


def sha(t: torch.Tensor) -> str:
    """A digest of a tensor's bytes (row-major), wherever it lives."""
    return hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def mixed_state(seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Mixed dtypes, odd byte counts, a 0-d and an empty tensor, a bool mask, and two non-contiguous views."""
    g = torch.Generator().manual_seed(seed)
    fused = torch.randn(96, 40, generator=g)
    state = {"embed": torch.randn(50, 33, generator=g).to(torch.bfloat16),
             "q": torch.randn(64, 64, generator=g).to(torch.float16),
             "bias": torch.randn(1001, generator=g).to(torch.bfloat16),
             "step": torch.tensor(seed, dtype=torch.int64),
             "empty": torch.zeros(0, 7),
             "mask": torch.rand(13, generator=g) > 0.5,
             "head": torch.randn(17, 129, generator=g).to(torch.float64),
             "big": torch.randn(150, 150, generator=g),  # 90 KB: more than a 64 KiB bucket
             "w_t": torch.randn(30, 20, generator=g).t(),  # a transposed weight
             "k_slice": fused[32:64, 3:37]}  # a slice of a fused weight
    return {n: t.to(device) for n, t in state.items()}  # (on a GPU the slice becomes contiguous)


def child_failure(rank: int | str, failure: tuple) -> AssertionError | NotImplementedError:
    """The exception to raise for a child process's ``(type name, message, traceback)``: NotImplementedError
    naming the function that raised it, or an AssertionError with the child's error."""
    kind, message, tb = failure
    frames = re.findall(r'File "[^"]+", line \d+, in (\w+)', tb or "")
    where = frames[-1] if frames else "?"
    if kind == "NotImplementedError":
        return NotImplementedError(f"{where} (in {rank})")
    return AssertionError(f"{rank} failed in {where}: {kind}: {message}".strip()[:400])
