"""Block-wise FP8 checkpoints (``quantization_config.quant_method: fp8``, transformers' ``FineGrainedFP8Config``:
MiMo-V2-Flash's and DeepSeek-V3's releases) dequantised on load.

A quantised Linear stores ``weight`` [.., R, C] as float8_e4m3fn and ``weight_scale_inv`` [.., ceil(R / br),
ceil(C / bc)] (``weight_block_size`` [br, bc]; without one a single scale): the real weight is weight x the scale
of its block (transformers' ``finegrained_fp8._dequantize_fp8_weight``). Unquantised tensors pass through.
"""
from __future__ import annotations

from collections.abc import Mapping

import ml_dtypes
import numpy as np

_SCALE = "_scale_inv"  # "<name>.weight" + this = its scales


def describe(q: Mapping) -> str:
    """A ``quantization_config`` in words (its method, format, bits, block), for errors."""
    method, fmt = q.get("quant_method"), q.get("format")
    groups = [g.get("weights") or {} for g in (q.get("config_groups") or {}).values()]
    bits = sorted({f"{w.get('num_bits')}-bit {w.get('type')}" for w in groups if w})
    return ", ".join(str(s) for s in (f"quant_method {method!r}", fmt and f"format {fmt!r}", *bits,
                                      q.get("fmt") and f"fmt {q['fmt']!r}",
                                      q.get("weight_block_size") and f"weight_block_size {q['weight_block_size']}")
                     if s)


def from_config(d: Mapping) -> tuple[bool, tuple[int, int] | None]:
    """(FP8 checkpoint, its ``weight_block_size``: None = one scale per tensor) from a config.json's
    ``quantization_config`` (top level or its text_config): none -> (False, None); block-wise FP8 e4m3 -> True
    and its block; any other quantisation (Kimi-K2's INT4 compressed tensors) a ValueError naming its format."""
    q = d.get("quantization_config") or (d.get("text_config") or {}).get("quantization_config")
    if not q:
        return False, None
    if q.get("quant_method") != "fp8" or q.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"this {d.get('model_type')} checkpoint is quantised ({describe(q)}); only unquantised "
                         "(bf16 / fp16 / fp32) and block-wise FP8 e4m3 (quant_method 'fp8') weights are "
                         "supported: dequantise it first")
    block = q.get("weight_block_size")
    if block is not None and (len(block) != 2 or min(int(b) for b in block) < 1):
        raise ValueError(f"quantization_config weight_block_size must be two positive sizes, got {block}")
    return True, None if block is None else (int(block[0]), int(block[1]))


def rewrite_for(cfg):
    """The checkpoint-stream rewrite of a config with ``fp8_checkpoint`` / ``fp8_block_size``: FP8 weights
    dequantised (``dequantize_stream``), or the stream as it is."""
    return dequantize_stream(cfg.fp8_block_size) if cfg.fp8_checkpoint else (lambda stream: stream)


def dequantize(weight, scale, block: tuple[int, int] | None, name: str) -> np.ndarray:
    """FP8 ``weight`` [.., R, C] times its per-block ``scale`` -> float32; a ValueError naming ``name`` when the
    scale's shape does not fit."""
    w = np.asarray(weight).astype(np.float32)
    s = np.asarray(scale).astype(np.float32)
    if block is None:
        if s.size != 1:
            raise ValueError(f"tensor {name}{_SCALE} has shape {list(s.shape)}; without weight_block_size it must "
                             "be one scale")
        return w * s.reshape(())
    (r, c), (br, bc) = w.shape[-2:], block
    want = w.shape[:-2] + (-(-r // br), -(-c // bc))
    if s.shape != want:
        raise ValueError(f"tensor {name}{_SCALE} has shape {list(s.shape)} but {name} {list(w.shape)} in blocks of "
                         f"{list(block)} implies {list(want)}")
    return w * np.repeat(np.repeat(s, br, axis=-2)[..., :r, :], bc, axis=-1)[..., :c]


def dequantize_stream(block: tuple[int, int] | None):
    """A ``NameTable.rewrite``: each FP8 ``<name>`` with its ``<name>_scale_inv`` (in either order, any shard)
    -> ``<name>`` in float32; a ValueError naming an FP8 tensor without scales or scales without their tensor."""
    def rewrite(stream):
        pending: dict[str, dict] = {}  # weight name -> {"weight": fp8 array, "scale": array}
        for name, array in stream:
            if name.endswith(_SCALE):
                base, part = name[:-len(_SCALE)], "scale"
            elif array.dtype == ml_dtypes.float8_e4m3fn:
                base, part = name, "weight"
            else:
                yield name, array
                continue
            entry = pending.setdefault(base, {})
            entry[part] = array
            if len(entry) == 2:
                del pending[base]
                yield base, dequantize(entry["weight"], entry["scale"], block, base)
        for base, entry in pending.items():
            what = f"FP8 tensor {base} has no {base}{_SCALE}" if "weight" in entry else \
                f"tensor {base}{_SCALE} has no FP8 weight {base}"
            raise ValueError(f"checkpoint {what} ({len(pending)} unpaired)")

    return rewrite
