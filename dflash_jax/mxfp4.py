"""MXFP4 tensors of released gpt-oss checkpoints -> dense tensors, on load (a ``NameTable.rewrite``).

A quantized W [..., rows, cols] is stored as ``<name>_blocks`` uint8 [..., rows, cols/32, 16] (two FP4 e2m1
codes per byte, the low nibble first) and ``<name>_scales`` uint8 [..., rows, cols/32] (E8M0: the group of
32 values is scaled by 2 ** (s - 127)), as transformers' ``integrations/mxfp4.py`` reads them. gpt-oss
stores its experts [E, out, in]; the dense tensor is the transpose [E, in, out] (``gate_up_proj``,
``down_proj``). An FP4 code times a power of two has at most 2 significant bits, so bfloat16 holds every
value exactly: one bf16 tensor at a time, cast to the requested dtype by ``load_params``.
"""
from __future__ import annotations

from typing import Iterator

import ml_dtypes
import numpy as np

FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      ml_dtypes.bfloat16)
# E8M0 code s -> 2 ** (s - 127); 255 is NaN
_POW2 = np.append(np.ldexp(1.0, np.arange(255) - 127), np.nan).astype(ml_dtypes.bfloat16)
_SUFFIXES = ("_blocks", "_scales")


def dequantize(name: str, blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """``name``'s blocks [..., R, G, 16] and scales [..., R, G] -> [..., G * 32, R] bfloat16 (last two axes
    swapped, one leading index at a time); a ValueError naming the tensor when they do not fit."""
    if blocks.dtype != np.uint8 or blocks.ndim < 3 or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 tensor {name}_blocks must be uint8 [..., rows, groups, 16], got "
                         f"{blocks.dtype} {list(blocks.shape)}")
    if scales.dtype != np.uint8 or scales.shape != blocks.shape[:-1]:
        raise ValueError(f"MXFP4 tensor {name}_scales has {scales.dtype} {list(scales.shape)} but "
                         f"{name}_blocks {list(blocks.shape)} needs uint8 {list(blocks.shape[:-1])}")
    *lead, rows, groups, _ = blocks.shape
    out = np.empty((*lead, groups * 32, rows), ml_dtypes.bfloat16)
    for i in np.ndindex(*lead):
        b = np.asarray(blocks[i])
        values = np.empty((rows, groups, 32), ml_dtypes.bfloat16)
        values[..., 0::2] = FP4_VALUES[b & 0x0F]
        values[..., 1::2] = FP4_VALUES[b >> 4]
        values *= _POW2[np.asarray(scales[i])][..., None]
        out[i] = values.reshape(rows, groups * 32).T
    return out


def dequantize_stream(stream: Iterator[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
    """Pass tensors through, except that each ``X_blocks`` + ``X_scales`` pair (any order, any shard)
    becomes one dense ``X``; a half pair left at the end is a ValueError naming it."""
    pending: dict[str, dict[str, np.ndarray]] = {}
    for name, array in stream:
        suffix = name[-len(_SUFFIXES[0]):]
        if suffix not in _SUFFIXES:
            yield name, array
            continue
        base = name[:-len(suffix)]
        parts = pending.setdefault(base, {})
        parts[suffix] = array
        if len(parts) == 2:
            del pending[base]
            yield base, dequantize(base, parts["_blocks"], parts["_scales"])
    for base, parts in sorted(pending.items()):
        have = next(iter(parts))
        lacks = _SUFFIXES[1] if have == _SUFFIXES[0] else _SUFFIXES[0]
        raise ValueError(f"MXFP4 tensor {base}{have} has no {base}{lacks} in the checkpoint")
