"""Seconds to trace, lower and compile one decode step (draft + verify + commit, greedy, the closed batch's step
program) at a real model's shape, from abstract parameters: nothing is allocated, so an 8B or a 671B shape
compiles on a laptop. Issue #52's yardstick for scanned layers (compile time grows with depth when layers are
unrolled); docs/benchmarks.md records the table.

    python scripts/compile_time.py [--synthetic qwen3-8b] [--hf-config config.json] [--scan-layers] \
        [--batch-size 1] [--block-size 16] [--repeat 2] [--json]

``--synthetic NAME``: a preset of ``dflash_jax.synthetic``; ``--hf-config``: any target family's config.json (or
``deepseek-v3``: DeepSeek-V3's own, written out below) with a new 5-layer draft of its widths. Each repeat
clears JAX's caches first (a cold compile every time); the persistent compilation cache is off.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax

from dflash_jax import on_paper, synthetic
from dflash_jax.decode import batch as batch_lib
from dflash_jax.decode import steps
from dflash_jax.decode.options import DecodeOptions
from dflash_jax.drafts.config import DraftConfig, choose_target_layer_ids
from dflash_jax.config import read_config_json
from dflash_jax.families import config_from_hf
from infer.presets import DEEPSEEK_V3


def pair(synthetic_name: str | None, hf_config: str | None, layers: int | None = None, scan: bool = False):
    """(target, draft) with abstract parameters, and the shape's name; ``layers``: the target cut to its first
    ``layers`` layers (how an unrolled step's compile time grows with depth); ``scan``: its layers scanned
    (``TargetConfig.scan_layers``)."""
    if synthetic_name:
        p = synthetic.preset(synthetic_name)
        hf, name, draft_layers, mask = p.target.to_hf(), synthetic_name, p.draft_layers, p.mask_token_id
    else:
        hf = DEEPSEEK_V3 if hf_config == "deepseek-v3" else read_config_json(hf_config)
        name, draft_layers, mask = hf_config, 5, hf["vocab_size"] - 1
    if layers is not None:
        hf = {**hf, "num_hidden_layers": layers}
        if hf.get("layer_types"):
            hf["layer_types"] = hf["layer_types"][:layers]
        name = f"{name}, first {layers} layers"
    tcfg = dataclasses.replace(config_from_hf(hf), scan_layers=scan)
    if scan:
        name = f"{name}, scanned"
    n = tcfg.num_hidden_layers
    ids = synthetic.preset(synthetic_name).target_layer_ids if synthetic_name and layers is None else \
        choose_target_layer_ids(n, min(draft_layers, n))
    dcfg = DraftConfig.for_target(tcfg, draft_layers=draft_layers, block_size=16, mask_token_id=mask,
                                  target_layer_ids=ids)
    return (*on_paper.pair(tcfg, dcfg), name)


def compile_once(target, draft, batch: int, block: int) -> dict:
    """Cold trace / lower / compile seconds of one decode step for ``batch`` rows of an 8-token prompt."""
    jax.clear_caches()
    b = batch_lib.build(target, draft, [[3, 4, 5, 6, 7, 8, 9, 10]] * batch,
                        DecodeOptions(max_new_tokens=256, block_size=block))
    state = jax.eval_shape(lambda i, r: steps.prefill_jit(b.spec, i, r), b.inputs, b.rows)
    t0 = time.perf_counter()
    traced = steps.step_jit.trace(b.spec, b.inputs, state)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    lowered.compile()
    t3 = time.perf_counter()
    return {"trace_s": t1 - t0, "lower_s": t2 - t1, "compile_s": t3 - t2, "total_s": t3 - t0}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--synthetic", help="a preset of dflash_jax.synthetic (default qwen3-8b)")
    src.add_argument("--hf-config", help="a target's config.json, or deepseek-v3")
    p.add_argument("--layers", type=int, help="cut the target to its first N layers (default: all)")
    p.add_argument("--scan-layers", action="store_true", help="the target's layers scanned (runs of identical "
                   "layers compiled as one; see dflash_jax.layer_scan)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeat", type=int, default=2, help="cold compiles; the median is reported (default 2)")
    p.add_argument("--json", action="store_true", help="one JSON line instead of text")
    return p


def main() -> None:
    p = build_parser()
    a = p.parse_args()
    if a.repeat < 1 or a.batch_size < 1 or (a.layers is not None and a.layers < 1):
        p.error("--repeat, --batch-size and --layers must be >= 1")
    jax.config.update("jax_enable_compilation_cache", False)
    target, draft, name = pair(a.synthetic or (None if a.hf_config else "qwen3-8b"), a.hf_config, a.layers,
                               a.scan_layers)
    runs = [compile_once(target, draft, a.batch_size, a.block_size) for _ in range(a.repeat)]
    row = {"shape": name, "layers": target.config.num_hidden_layers, "batch": a.batch_size, "block": a.block_size,
           "backend": jax.default_backend(), "repeats": a.repeat,
           **{k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}}
    if a.json:
        print(json.dumps(row))
    else:
        print(f"{name} ({row['layers']} layers, batch {a.batch_size}, block {a.block_size}, {row['backend']}): "
              f"trace {row['trace_s']:.2f} s, lower {row['lower_s']:.2f} s, compile {row['compile_s']:.2f} s, "
              f"total {row['total_s']:.2f} s (median of {a.repeat} cold compiles)")


if __name__ == "__main__":
    main()
