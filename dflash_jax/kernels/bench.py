"""Block-attention benchmark: skipped score FLOPs from the anchors, kernel vs reference time.

    python -m dflash_jax.kernels.bench                       # skip table at S 1024/3072/4096, N 512; small timing
    python -m dflash_jax.kernels.bench --time-seq 3072 --time-blocks 512 --heads 32 --kv-heads 8 --head-dim 128
    python -m dflash_jax.kernels.bench --doc-len 700         # packed rows: documents of ~700 tokens (context starts)
    python -m dflash_jax.kernels.bench --json
    (from any folder, once installed)

The skip figure needs no device: from the anchors and the tiles it counts the score entries the
compiled kernel evaluates (whole context tiles in each query tile's [lo, hi) plus one own-block tile
per query tile) against the dense reference's [N*Bk, S+N*Bk]. ``visible`` is what the mask keeps.
Anchors are drawn uniformly from [0, S) without replacement; "sorted" orders them within each row
(the loss does not depend on block order, and sorted anchors give tighter [lo, hi) per query tile).
With ``--doc-len`` each row is packed with documents of exponentially distributed lengths and each
block's context starts at its document's start (``ctx_start``), as in packed training.

Timing runs the kernel and the reference on the default backend. On CPU the kernel runs in Pallas
interpret mode (an emulation, not a performance figure), so the CPU default times a small shape.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from .block_attention import (
    block_attention,
    block_attention_reference,
    context_tile_range,
    pick_tiles,
)
from .tiling import round_up


def skipped_fraction(anchors, ctx_len: int, *, block_size: int, sliding_window: int | None = None,
                     q_tile: int = 128, k_tile: int = 128, backend: str = "tpu", ctx_start=None,
                     block_causal: bool = False) -> dict:
    """Score entries the compiled kernel computes vs the dense [T, S+T] reference, from the anchors alone.

    ``computed``: whole tiles the kernel evaluates (context tiles in [lo, hi) + one own-block tile per
    query tile, padding included); ``visible``: entries the mask actually keeps (the lower bound).
    """
    anchors = np.asarray(anchors, np.int64)
    batch, n = anchors.shape
    start = np.zeros_like(anchors) if ctx_start is None else np.asarray(ctx_start, np.int64)
    bk, s, w = block_size, ctx_len, sliding_window
    tq, tk = pick_tiles(n, bk, s, q_tile, k_tile, backend, False)
    nbt = tq // bk
    pad = ((0, 0), (0, round_up(n, nbt) - n))
    anc = np.pad(anchors, pad, constant_values=-1).reshape(batch, -1, nbt)
    st = np.pad(start, pad).reshape(batch, -1, nbt)
    lo, hi = (np.asarray(x) for x in context_tile_range(jnp.asarray(anc, jnp.int32), jnp.asarray(st, jnp.int32),
                                                     s, tk, w, -1))
    computed = ((hi - lo) * tq * tk).sum() + anc.shape[1] * tq * tq * batch
    i = np.arange(bk)
    a = anchors[..., None]  # [B, N, 1] against row offsets i
    ctx_lo = np.maximum(start[..., None], 0 if w is None else a + i - w + 1)
    ctx = np.maximum(np.minimum(a, s) - ctx_lo, 0)
    own_hi = i + 1 if block_causal else (bk if w is None else np.minimum(bk, i + w))  # own keys j in [lo, hi)
    own = own_hi - (0 if w is None else np.maximum(0, i - w + 1))
    visible = np.where(a >= 0, np.broadcast_to(ctx + own, (batch, n, bk)), 0).sum()
    dense = batch * n * bk * (s + n * bk)
    return {"dense": int(dense), "computed": int(computed), "visible": int(visible),
            "skipped": 1.0 - computed / dense, "q_tile": tq, "k_tile": tk}


def draw_anchors(rng, batch, n, s):
    return np.stack([rng.choice(s, size=n, replace=n > s) for _ in range(batch)])


def doc_starts(rng, anchors, s, mean_len):
    """The start of each anchor's document in rows of S packed with documents of exponential lengths
    (mean ``mean_len``); None when ``mean_len`` is 0 (one document per row)."""
    if not mean_len:
        return None
    out = np.empty_like(anchors)
    for b in range(anchors.shape[0]):
        starts = np.concatenate([[0], np.cumsum(1 + rng.exponential(mean_len, size=s)).astype(np.int64)])
        out[b] = starts[np.searchsorted(starts, anchors[b], side="right") - 1]
    return out


def skip_rows(args):
    rng = np.random.default_rng(args.seed)
    rows = []
    for s in args.seq:
        drawn = draw_anchors(rng, args.batch, args.blocks, s)
        for order, a in (("sorted", np.sort(drawn, axis=1)), ("unsorted", drawn)):
            r = skipped_fraction(a, s, block_size=args.block_size, sliding_window=args.window,
                                 q_tile=args.q_tile, k_tile=args.k_tile, backend=args.backend,
                                 ctx_start=doc_starts(np.random.default_rng(args.seed), a, s, args.doc_len))
            rows.append({"S": s, "N": args.blocks, "Bk": args.block_size, "window": args.window, "anchors": order,
                         "doc_len": args.doc_len,
                         "skipped": r["skipped"], "computed_over_dense": r["computed"] / r["dense"],
                         "visible_over_dense": r["visible"] / r["dense"], "q_tile": r["q_tile"],
                         "k_tile": r["k_tile"]})
    return rows


def _time(fn, *xs, iters):
    jax.block_until_ready(fn(*xs))  # compile + warm up
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*xs))
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def timing_row(args):
    platform = jax.default_backend()
    on_cpu = platform == "cpu"
    s = args.time_seq or (256 if on_cpu else 3072)
    n = args.time_blocks or (16 if on_cpu else 512)
    hq, hkv, d = (args.heads or (4 if on_cpu else 32)), (args.kv_heads or (2 if on_cpu else 8)), \
        (args.head_dim or (64 if on_cpu else 128))
    dtype = jnp.dtype(args.dtype or ("float32" if on_cpu else "bfloat16"))
    bk, t = args.block_size, n * args.block_size
    rng = np.random.default_rng(args.seed)
    shapes = [(args.batch, t, hq, d), (args.batch, s, hkv, d), (args.batch, s, hkv, d), (args.batch, t, hkv, d),
              (args.batch, t, hkv, d)]
    xs = [jnp.asarray(rng.standard_normal(sh, np.float32), dtype) for sh in shapes]
    anchors = jnp.asarray(np.sort(draw_anchors(rng, args.batch, n, s), axis=1), jnp.int32)
    kw = dict(block_size=bk, sliding_window=args.window)
    impls = {"kernel": lambda *a: block_attention(*a, q_tile=args.q_tile, k_tile=args.k_tile, **kw),
             "reference": lambda *a: block_attention_reference(*a, **kw)}
    row = {"platform": platform, "kernel_mode": "interpret" if on_cpu else "compiled", "batch": args.batch, "S": s,
           "N": n, "Bk": bk, "Hq": hq, "Hkv": hkv, "D": d, "dtype": dtype.name, "window": args.window}
    outs = {}
    for name, f in impls.items():
        fwd = jax.jit(lambda *z, f=f: f(*z, anchors))
        loss = lambda *z, f=f: jnp.sum(f(*z, anchors).astype(jnp.float32) ** 2)
        bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
        try:
            outs[name] = fwd(*xs)
            row[f"{name}_fwd_ms"] = _time(fwd, *xs, iters=args.iters)
            row[f"{name}_fwd_bwd_ms"] = _time(bwd, *xs, iters=args.iters)
        except Exception as e:  # e.g. the dense reference running out of memory at the paper shape
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    if len(outs) == 2:
        ref = outs["reference"].astype(jnp.float32)
        row["max_abs_err_over_max_ref"] = float(jnp.abs(outs["kernel"].astype(jnp.float32) - ref).max()
                                                / jnp.abs(ref).max())
    return row


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda x: [int(v) for v in x.split(",")]
    p.add_argument("--seq", type=ints, default=[1024, 3072, 4096], help="context lengths S for the skip table")
    p.add_argument("--blocks", type=int, default=512, help="blocks per sequence N for the skip table")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--window", type=int, default=None, help="sliding window (default: none)")
    p.add_argument("--doc-len", type=int, default=0,
                   help="mean document length of packed rows for the skip table (default 0: one per row)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--q-tile", type=int, default=128)
    p.add_argument("--k-tile", type=int, default=128)
    p.add_argument("--backend", choices=["tpu", "gpu"], default="tpu", help="kernel formulation for the skip table")
    p.add_argument("--time-seq", type=int, default=None, help="S for timing (default 256 on CPU, 3072 otherwise)")
    p.add_argument("--time-blocks", type=int, default=None, help="N for timing (default 16 on CPU, 512 otherwise)")
    p.add_argument("--heads", type=int, default=None, help="Hq for timing (default 4 on CPU, 32 otherwise)")
    p.add_argument("--kv-heads", type=int, default=None, help="Hkv for timing (default 2 on CPU, 8 otherwise)")
    p.add_argument("--head-dim", type=int, default=None, help="D for timing (default 64 on CPU, 128 otherwise)")
    p.add_argument("--dtype", default=None, help="timing dtype (default float32 on CPU, bfloat16 otherwise)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--no-time", action="store_true", help="only the skip table")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)

    result = {"skip": skip_rows(args), "timing": None if args.no_time else timing_row(args)}
    if args.json:
        print(json.dumps(result))
        return result
    print(f"score entries computed by the kernel vs the dense [N*Bk, S+N*Bk] reference "
          f"(tiles {result['skip'][0]['q_tile']}x{result['skip'][0]['k_tile']}, {args.backend} formulation"
          + (f"; rows packed with documents of ~{args.doc_len} tokens, each block seeing its own"
             if args.doc_len else "")
          + ")")
    print(f"{'S':>6} {'N':>5} {'Bk':>3} {'window':>6} {'anchors':>9} {'skipped':>8} {'computed':>9} {'visible':>8}")
    for r in result["skip"]:
        print(f"{r['S']:>6} {r['N']:>5} {r['Bk']:>3} {str(r['window']):>6} {r['anchors']:>9} {r['skipped']:>8.1%} "
              f"{r['computed_over_dense']:>9.1%} {r['visible_over_dense']:>8.1%}")
    t = result["timing"]
    if t:
        print(f"\ntiming on {t['platform']} (kernel {t['kernel_mode']}"
              f"{': Pallas emulation on CPU, not a performance figure' if t['kernel_mode'] == 'interpret' else ''}),"
              f" batch {t['batch']} S {t['S']} N {t['N']} Bk {t['Bk']} Hq {t['Hq']} Hkv {t['Hkv']} D {t['D']}"
              f" {t['dtype']}, median of {args.iters}")
        print(f"{'impl':>10} {'fwd ms':>10} {'fwd+bwd ms':>11}")
        for name in ("kernel", "reference"):
            if f"{name}_error" in t:
                print(f"{name:>10} failed: {t[name + '_error']}")
            else:
                print(f"{name:>10} {t[name + '_fwd_ms']:>10.2f} {t[name + '_fwd_bwd_ms']:>11.2f}")
        if "max_abs_err_over_max_ref" in t:
            print(f"kernel vs reference: max abs err / max abs ref = {t['max_abs_err_over_max_ref']:.2e}")
    return result


if __name__ == "__main__":
    main()
