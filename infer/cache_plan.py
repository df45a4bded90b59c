"""How many rows fit: ``python -m infer.cache_plan [--preset qwen3-8b] [--memory 16,32,80,141] [--context 8192]``.

From the shapes alone (no device, no weights): the memory a target + draft pair's weights take, the K/V bytes a
token costs in every cache layer (the target's and the draft's context), and at each memory size the rows in
flight that fit: with slots (every row reserves a cache of the max context, the engine with ``--page-size 0``)
and paged (a row holds the pages of its own tokens, ``decode.Engine``'s default) at each mean row length.
Per-row state that is not paged (sliding rings, recurrent states) is counted per row in both.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from dflash_jax.launch import launch
from dflash_jax.decode.memory import row_cache_bytes
from infer.flags import die, parse_ints

DEFAULT_MEMORY = "16,32,80,141"
DEFAULT_MEAN = "1024,2048,4096"
GB = 10 ** 9


def shapes(preset: str, dtype: str, context: int, page: int, block: int) -> dict:
    """The pair's bytes: weights, K/V per token (paged layers), per-row state that is not paged, and a slot row."""
    from dflash_jax.drafts import model as draft_lib
    from dflash_jax import state
    from dflash_jax import target as target_lib
    from dflash_jax.checkpoints import DTYPES
    from dflash_jax.decode.prepare import cache_length
    from dflash_jax.families import family_of
    from dflash_jax.synthetic import num_params, preset as get

    p = get(preset)
    dt = DTYPES[dtype]
    size = np.dtype(dt).itemsize
    cache_len = cache_length([1], [context - 1], block)
    specs = (family_of(p.target).state_specs(p.target), draft_lib.state_specs(p.draft))
    token = sum(state.page_bytes(s, 1, dt, cache_len, block) for s in specs)

    weights = (num_params(target_lib.param_shapes(p.target)) + num_params(draft_lib.draft_param_shapes(p.draft))) * size
    return {"preset": preset, "source": p.source, "dtype": dtype, "weights_bytes": weights, "token_bytes": token,
            "slot_row_bytes": row_cache_bytes(p.target, p.draft, cache_len, dt, block),
            "paged_row_bytes": row_cache_bytes(p.target, p.draft, cache_len, dt, block, page), "cache_len": cache_len}


def plan(s: dict, memory_gb: float, context: int, mean: int, page: int, block: int) -> dict:
    """Rows in flight at ``memory_gb`` GB: slots (max-context caches) and paged (rows of ``mean`` tokens)."""
    free = memory_gb * GB - s["weights_bytes"]
    pages = -(-(mean + block) // page)  # a row's tokens and the block its next verify writes
    per_paged = pages * page * s["token_bytes"] + s["paged_row_bytes"]
    return {"memory_gb": memory_gb, "free_bytes": max(free, 0), "mean_length": mean,
            "slots_rows": max(int(free // s["slot_row_bytes"]), 0), "paged_rows": max(int(free // per_paged), 0)}


def parse_args(argv=None):
    from dflash_jax.synthetic import PRESETS

    p = argparse.ArgumentParser(prog="python -m infer.cache_plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-8b", choices=sorted(PRESETS),
                   help="a target + draft shape (dflash_jax.synthetic.PRESETS; default qwen3-8b)")
    p.add_argument("--memory", default=DEFAULT_MEMORY, help=f"device memory sizes in GB (default {DEFAULT_MEMORY})")
    p.add_argument("--context", type=int, default=8192, help="the max context of a row (default 8192)")
    p.add_argument("--mean-lengths", default=DEFAULT_MEAN,
                   help=f"mean row lengths (prompt + generated) for the paged rows (default {DEFAULT_MEAN})")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    p.add_argument("--block-size", type=int, default=16, help="the verify block (default 16)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--json", action="store_true", help="one JSON object per row of the table")
    return p.parse_args(argv)


def main(argv=None) -> int:
    launch()
    args = parse_args(argv)
    memory = [float(x) for x in args.memory.split(",") if x.strip()]
    means = parse_ints(args.mean_lengths, "--mean-lengths")
    if not memory or min(memory) <= 0:
        die(f"--memory takes positive sizes in GB, got {args.memory!r}")
    if args.context < 2 or args.page_size < 1 or args.block_size < 1:
        die("--context must be >= 2, --page-size and --block-size >= 1")
    if max(means) > args.context:
        die(f"a mean length ({max(means)}) past --context {args.context}")
    s = shapes(args.preset, args.dtype, args.context, args.page_size, args.block_size)
    rows = [plan(s, m, args.context, n, args.page_size, args.block_size) for m in memory for n in means]
    if args.json:
        for r in rows:
            print(json.dumps(dict(s, **r)))
        return 0
    print(f"{args.preset} ({s['source']}), {args.dtype}: weights {s['weights_bytes'] / GB:.1f} GB, K/V "
          f"{s['token_bytes'] / 1e3:.1f} KB a token (target + draft context), context {args.context}")
    print("| memory (GB) | left for caches (GB) | rows with slots | mean length | paged rows |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['memory_gb']:g} | {r['free_bytes'] / GB:.1f} | {r['slots_rows']} | {r['mean_length']} | "
              f"{r['paged_rows']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
