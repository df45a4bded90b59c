"""Correctness of the block-attention kernel on this machine's backend, against the reference.

    python -m dflash_jax.kernels.check            # compiled on TPU/GPU; Pallas interpret mode on CPU
    python -m dflash_jax.kernels.check --json
    (from any folder, once installed)

For each case (dtype, GQA, sliding window, anchor pattern, tiles) fresh random inputs go through the
kernel and through the dense reference run in float32 at HIGHEST matmul precision on upcast inputs;
the output and the gradients of all five inputs are compared by ||x - ref|| / ||ref||. Tolerances:
float32 1e-3 (GPU dots may run as tf32, ~3e-4; CPU/TPU float32 lands near 1e-6), bfloat16 3e-2
(8-bit significand; p and ds are rounded to bf16 before their matmuls). NaN fails. Exit status 1
when any case fails, so a device script can stop on it.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from .block_attention import block_attention, block_attention_reference

TOL = {"float32": 1e-3, "bfloat16": 3e-2}
CASES = [  # name, batch, N, Bk, S, Hq, Hkv, D, window, dtype, anchors, q_tile, k_tile
    ("fp32 gqa4 sorted", 2, 32, 16, 700, 8, 2, 64, None, "float32", "sorted", 64, 64),
    ("fp32 mha unsorted", 1, 24, 8, 333, 4, 4, 128, None, "float32", "unsorted", 64, 128),
    ("fp32 window edges", 2, 16, 16, 512, 4, 2, 64, 96, "float32", "edges", 64, 64),
    ("bf16 gqa4 sorted", 2, 64, 16, 1500, 16, 4, 128, None, "bfloat16", "sorted", 128, 128),
    ("bf16 gqa2 ragged", 2, 32, 16, 900, 8, 4, 64, None, "bfloat16", "ragged", 64, 64),
    ("bf16 block4 window", 1, 48, 4, 600, 8, 2, 64, 128, "bfloat16", "unsorted", 64, 64),
    ("bf16 one block/row", 4, 1, 16, 1000, 8, 2, 128, None, "bfloat16", "sorted", 128, 128),
]


def anchor_pattern(rng, kind, batch, n, s):
    """[batch, n] int32 anchors in [0, S): "sorted" / "unsorted" draws, "edges" (anchor 0, anchor S-1, a
    repeated anchor, a padding block -1) or "ragged" (a different number of real blocks per row, padding
    after them). Shared with tests/test_kernel.py."""
    a = rng.integers(0, max(s, 1), size=(batch, n))
    if kind == "sorted":
        a = np.sort(a, axis=1)
    elif kind == "edges":
        a[:, 0], a[:, 1], a[:, 2] = 0, s - 1, a[:, 3]
        a[:, -1] = -1
    elif kind == "ragged":
        for b in range(batch):
            a[b, rng.integers(1, n):] = -1
        a[0, 0] = 0
    return jnp.asarray(a, jnp.int32)


# positional: the attention operands (q, k, v, and their positions / lengths / masks), one order throughout
@functools.lru_cache(maxsize=None)
def value_and_grads(impl, block_size, window=None, q_tile=128, k_tile=128, backend=None, interpret=None,
                    jit=jax.jit, block_causal=False):
    """jit(xs, anchors, proj[, ctx_start]) -> (out, d<out, proj>/d(q, k_ctx, v_ctx, k_blk, v_blk)) of the kernel
    or the reference; anchors (and context starts) are runtime arguments, so one compile serves every
    anchor pattern of a shape."""
    kw = dict(block_size=block_size, sliding_window=window, block_causal=block_causal)
    if impl == "kernel":
        fn = functools.partial(block_attention, q_tile=q_tile, k_tile=k_tile, backend=backend, interpret=interpret,
                               **kw)
    else:
        fn = functools.partial(block_attention_reference, **kw)

    def run(xs, anchors, proj, ctx_start=None):
        out, vjp = jax.vjp(lambda *a: fn(*a, anchors, ctx_start=ctx_start), *xs)
        return out, vjp(proj.astype(out.dtype))

    return jit(run)


def _rel(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def run_case(case, seed):
    name, batch, n, bk, s, hq, hkv, d, window, dtype, kind, q_tile, k_tile = case
    rng = np.random.default_rng(seed)
    t = n * bk
    shapes = [(batch, t, hq, d), (batch, s, hkv, d), (batch, s, hkv, d), (batch, t, hkv, d), (batch, t, hkv, d)]
    xs = [jnp.asarray(rng.standard_normal(sh, np.float32)).astype(dtype) for sh in shapes]
    proj = jnp.asarray(rng.standard_normal(shapes[0], np.float32))
    anchors = anchor_pattern(rng, kind, batch, n, s)
    out, grads = value_and_grads("kernel", bk, window, q_tile, k_tile)(xs, anchors, proj)
    with jax.default_matmul_precision("highest"):
        ref, ref_grads = value_and_grads("reference", bk, window)(
            [x.astype(jnp.float32) for x in xs], anchors, proj)
    errs = {"out": _rel(out, ref)}
    errs.update({f"d{k}": _rel(g, r) for k, g, r in zip(("q", "k_ctx", "v_ctx", "k_blk", "v_blk"), grads, ref_grads)})
    tol = TOL[dtype]
    ok = all(np.isfinite(e) and e <= tol for e in errs.values())
    return {"case": name, "dtype": dtype, "tol": tol, "ok": ok, "max_err": max(errs.values()), **errs}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="one JSON object per case")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    backend = jax.default_backend()
    mode = "interpret (Pallas emulation)" if backend == "cpu" else "compiled"
    print(f"backend {backend} ({jax.devices()[0].device_kind}), kernel {mode}", file=sys.stderr)
    rows = []
    for i, case in enumerate(CASES):
        try:
            row = run_case(case, args.seed + i)
        except Exception as e:  # a lowering/compile failure is a failed case, reported with its reason
            row = {"case": case[0], "ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)
        elif "error" in row:
            print(f"FAIL {row['case']:<22} {row['error']}", flush=True)
        else:
            errs = " ".join(f"{k} {row[k]:.1e}" for k in ("out", "dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk"))
            print(f"{'ok  ' if row['ok'] else 'FAIL'} {row['case']:<22} tol {row['tol']:.0e}  {errs}", flush=True)
    failed = sum(not r["ok"] for r in rows)
    print(f"{len(rows) - failed}/{len(rows)} cases passed on {backend}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
