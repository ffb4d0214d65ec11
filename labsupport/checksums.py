"""Checksums of tensor bytes that every device agrees on: how ``broadcast`` verifies a weight update.

The bytes are read as the widest integer words their length allows; rows of 1024 words are summed (one
bandwidth-bound reduction on the device), then weighted by an odd pseudo-random number per row, so moving data
between rows changes the result. Integer sums wrap the same way in any order: a trainer and its receivers get
the same number from the same bytes, on any device, without waiting for the host. A single changed word always
changes the checksum: it moves its row's sum by a nonzero amount, which an odd multiplier cannot turn into a
multiple of 2**64. (``labsupport.vllm_weights`` checks a vLLM engine against its trainer with them.)
"""

from __future__ import annotations

from typing import Iterable, Mapping

import torch

ROW = 1024  # words per checksum row
_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def tensor_checksums(named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """``{name: checksum}`` of each tensor's bytes (computed on its device; equal bytes give equal numbers)."""
    items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
    if not items:
        return {}
    sums = [of_bytes(cat_bytes([t.detach().contiguous()])) for _, t in items]
    values = torch.stack([x.to(sums[0].device) for x in sums]).tolist()  # one host sync
    return {n: int(v) for (n, _), v in zip(items, values)}


def of_bytes(u8: torch.Tensor) -> torch.Tensor:
    """The checksum of a flat uint8 tensor, as a 0-d int64 tensor on its device (no host sync)."""
    n = u8.numel()
    dtype = next(d for d in (torch.int64, torch.int32, torch.int16, torch.uint8) if n % d.itemsize == 0)
    if u8.storage_offset() % dtype.itemsize:
        u8 = u8.clone()  # (a view at an odd address: align it)
    words = u8.view(dtype)
    rows = words.numel() // ROW
    w = _row_weights(u8.device, rows)
    total = words[rows * ROW:].sum() * w[rows] + n
    if rows:
        total += (words[: rows * ROW].view(rows, ROW).sum(dim=1) * w[:rows]).sum()
    return total


def cat_bytes(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The bytes of contiguous tensors, one after the other (a view of a single tensor, else a copy)."""
    u8 = [t.reshape(-1).view(torch.uint8) for t in tensors]
    return u8[0] if len(u8) == 1 else torch.cat(u8)


def _row_weights(device: torch.device, rows: int) -> torch.Tensor:
    """Odd pseudo-random 32-bit multipliers, one per row; made once per device (grown when a larger one comes)."""
    w = _WEIGHTS.get(device)
    if w is None or w.numel() <= rows:
        w = _WEIGHTS[device] = torch.arange(1, max(2 * rows + 2, 1 << 16) + 1, dtype=torch.int64, device=device) \
            .mul_(2654435761).remainder_(1 << 32).bitwise_or_(1)
    return w


_LOADED: set[tuple[torch.device, str]] = set()


def load_kernels(device: torch.device, dtypes: Iterable[str] = ()) -> None:
    """Launch once per device the kernels of checksums and of a vote on them (stack, cat, negate), and a multi-tensor
    copy of each of ``dtypes``. CUDA loads a kernel at its first launch (PyTorch sets ``CUDA_MODULE_LOADING=LAZY``),
    and loading waits for the device: behind a collective that spins on a dead peer, it would block the host in the
    driver, where no deadline reaches it (``broadcast``)."""
    todo = [d for d in ("checksums", *dtypes) if (device, d) not in _LOADED] if device.type == "cuda" else []
    for d in todo:
        if d == "checksums":  # every word width of_bytes reads, an odd address (cloned), two tensors (joined)
            u8 = [torch.zeros(w * (2 * ROW + 1), dtype=torch.uint8, device=device) for w in (8, 4, 2, 1)]
            sums = torch.stack([of_bytes(t) for t in u8 + [u8[0][1:17], cat_bytes(u8[-2:])]])
            torch.cat([torch.full((1,), 0, dtype=torch.int64, device=device), sums, -sums]).tolist()
        else:
            x = torch.zeros(2, dtype=getattr(torch, d), device=device)
            torch._foreach_copy_([x[:1]], [x[1:]])
        _LOADED.add((device, d))
