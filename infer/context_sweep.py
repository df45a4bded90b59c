"""Step time against context length at ONE fixed cache bucket: ``python -m infer.context_sweep --synthetic tiny``.

For each ``--context`` and each ``--attention`` (``attention.decode_attention``'s impl: "auto" reads only the
slots below each row's length, "reference" attends densely over the whole bucket, the path it replaced), times
one draft forward and one target verify forward of ``--block-size`` tokens, and a one-token target forward (a
plain decoding step), with the caches ``--bucket`` slots long (``infer.timing.time_forwards``: jitted loops
of forwards, best of several). Random weights (a synthetic preset); no prefill, so long contexts fit a CPU.
"""
from __future__ import annotations

import argparse
import json
import sys

from dflash_jax.launch import launch
from infer.flags import die, parse_ints


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m infer.context_sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--synthetic", default="tiny", help="preset (dflash_jax.synthetic.PRESETS; default tiny)")
    p.add_argument("--context", default="1024,4096,16384,32768", help="committed tokens per row, comma-separated "
                                                                      "(default 1024,4096,16384,32768)")
    p.add_argument("--bucket", type=int, default=None,
                   help="cache slots per row, the same for every context (default: largest context + 256)")
    p.add_argument("--attention", default="auto,reference",
                   help="decode attention impls to compare, comma-separated (default auto,reference)")
    p.add_argument("--batch-size", type=int, default=1, help="rows (default 1)")
    p.add_argument("--block-size", type=int, default=None, help="verify / draft block (default: the preset's)")
    p.add_argument("--dtype", default="auto", help="float32 | bfloat16 (default: float32 on CPU, else bfloat16)")
    p.add_argument("--iters", type=int, default=10, help="forwards per timed loop (default 10)")
    p.add_argument("--repeats", type=int, default=3, help="timed loops, the fastest counts (default 3)")
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    return p.parse_args(argv)


def main(argv=None) -> int:
    launch()
    args = parse_args(argv)
    import jax

    from dflash_jax import synthetic as syn
    from dflash_jax.attention import DECODE_IMPLS
    from dflash_jax.machine import machine, warn_if_busy
    from infer.timing import time_forwards

    contexts = parse_ints(args.context, "--context")
    impls = [x.strip() for x in args.attention.split(",") if x.strip()]
    if not impls or any(i not in DECODE_IMPLS for i in impls):
        die(f"--attention takes impls from {', '.join(DECODE_IMPLS)}, got {args.attention!r}")
    try:
        preset = syn.preset(args.synthetic)
    except ValueError as e:
        die(str(e))
    block = args.block_size or preset.block_size
    if not 2 <= block <= preset.block_size:
        die(f"--block-size must be in [2, {preset.block_size}] (the preset's draft block), got {block}")
    bucket = args.bucket or max(contexts) + 256
    if max(contexts) + block > bucket:
        die(f"--bucket {bucket} is too small for context {max(contexts)} + a block of {block}")
    dtype = args.dtype if args.dtype != "auto" else ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    target, draft = syn.synthetic_pair(args.synthetic, dtype, seed=0)
    where = machine()
    warn_if_busy(where)
    rows = []
    for context in contexts:
        for impl in impls:
            t = time_forwards(target, draft, block_sizes=(block,), context=context, iters=args.iters,
                              repeats=args.repeats, batch=args.batch_size, cache_len=bucket, attention_impl=impl)
            row = {"synthetic": args.synthetic, "context": context, "bucket": bucket, "attention": impl,
                   "batch_size": args.batch_size, "block_size": block, "dtype": dtype,
                   "plain_step_s": t["verify_forward_s_block1"], "draft_s": t[f"draft_forward_s_block{block}"],
                   "verify_s": t[f"verify_forward_s_block{block}"], "load_average": list(__import__("os").getloadavg())}
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(f"context {context:>6} {impl:>9}: plain step {row['plain_step_s'] * 1e3:8.2f} ms  draft "
                      f"{row['draft_s'] * 1e3:8.2f} ms  verify {row['verify_s'] * 1e3:8.2f} ms", file=sys.stderr)
    if not args.json:
        ms = lambda s: f"{s * 1e3:.2f}"  # noqa: E731
        print(f"{'context':>7} {'attention':>9} {'plain step':>10} {'draft':>8} {'verify':>8} {'draft+verify':>12}")
        for r in rows:
            print(f"{r['context']:>7} {r['attention']:>9} {ms(r['plain_step_s']):>10} {ms(r['draft_s']):>8} "
                  f"{ms(r['verify_s']):>8} {ms(r['draft_s'] + r['verify_s']):>12}")
        print(f"ms per forward; preset {args.synthetic} ({dtype}), bucket {bucket} slots, batch {args.batch_size}, "
              f"block {block}; {where['device']} ({where['backend']}), {where['cpu_count']} CPUs, load average "
              f"{where['load_average'][0]} at start")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
