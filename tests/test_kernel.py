"""Block-attention Pallas kernel (interpret mode on CPU) against the dense reference.

Both kernel formulations run here: "tpu" (scalar-prefetch grid with skipped tiles) and "gpu"
(Triton-style in-kernel loop). Forward and the gradients of all five float inputs are compared.
"""
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import Phase, given, settings, strategies as st

from dflash_jax import attention
from dflash_jax.kernels import block_attention, block_attention_reference, block_mask
from dflash_jax.kernels.bench import skipped_fraction
from dflash_jax.kernels.check import anchor_pattern, value_and_grads
from tolerances import assert_close, scale_of

# Interpret-mode kernels are large XLA programs; optimisation level 0 halves their compile time.
_fast_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def _inputs(seed, batch, n, bk, s, hq, hkv, d, dtype=jnp.float32):
    rng = np.random.default_rng(seed)  # numpy: jax.random would compile a sampler per shape
    t = n * bk
    shapes = [(batch, t, hq, d), (batch, s, hkv, d), (batch, s, hkv, d), (batch, t, hkv, d), (batch, t, hkv, d)]
    xs = [jnp.asarray(rng.standard_normal(sh, np.float32)).astype(dtype) for sh in shapes]
    return xs, jnp.asarray(rng.standard_normal(shapes[0], np.float32))


# The kernel (interpret mode) or the reference, jitted as (out, vjp); shared with `python -m dflash_jax.kernels.check`.
_compiled = functools.partial(value_and_grads, interpret=True, jit=_fast_jit)


def _rel_err(x, ref):
    """Max abs error over the max abs reference entry (floored at 1e-2: inputs are O(1), and an exactly
    zero reference gradient, e.g. a softmax over a single key, is matched only to rounding)."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return np.abs(x - ref).max() / max(np.abs(ref).max(), 1e-2)


def _f32_depth(xs, bk):
    """Roundings on the longest path, kernel (tile-wise online softmax) against the dense reference: a D-wide
    score reduction, then the softmax and p @ v over S + Bk keys; the gradients run that path back once more."""
    return 2 * (xs[1].shape[1] + bk + xs[0].shape[-1])


def _close(x, ref, depth, what=""):
    """float32 rounding of ``depth`` steps, relative to the largest reference entry (floored as in _rel_err)."""
    assert_close(x, ref, depth, scale=max(scale_of(ref), 1e-2), what=what)


def _causal(block_causal):
    """value_and_grads' keyword for block_causal, given only when set: the default calls keep sharing their
    compiles (lru_cache keys on the arguments as passed)."""
    return {"block_causal": True} if block_causal else {}


def _check(cfg, xs, anchors, proj, tol=None, ref_xs=None, ctx_start=None, block_causal=False):
    """Kernel against reference: output and gradients within ``tol`` relative (None: float32, _f32_depth)."""
    backend, bk, window, q_tile, k_tile = cfg
    starts = () if ctx_start is None else (ctx_start,)
    out, grads = _compiled("kernel", bk, window, q_tile, k_tile, backend, **_causal(block_causal))(
        xs, anchors, proj, *starts)
    out_r, grads_r = _compiled("reference", bk, window, **_causal(block_causal))(ref_xs or xs, anchors, proj, *starts)
    assert out.dtype == xs[0].dtype and all(g.dtype == x.dtype for g, x in zip(grads, xs))
    for name, got, want in zip(["out", "q", "k_ctx", "v_ctx", "k_blk", "v_blk"], [out, *grads], [out_r, *grads_r]):
        assert np.all(np.isfinite(np.asarray(got, np.float32))), name
        if tol is None:
            _close(got, want, _f32_depth(xs, bk), name)
        else:
            assert _rel_err(got, want) <= tol, name
    # Padding blocks: output 0 and exactly zero gradients on their rows.
    pad = np.repeat(np.asarray(anchors) < 0, bk, axis=1)  # [B, T]
    assert np.all(np.asarray(out)[pad] == 0)
    for g in (grads[0], grads[3], grads[4]):
        assert np.all(np.asarray(g)[pad] == 0)


CASES = [  # backend, batch, N, Bk, S, Hq, Hkv, D, window, q_tile, k_tile
    ("tpu", 2, 6, 4, 37, 4, 4, 16, None, 8, 16),  # GQA 1, S not a multiple of the key tile
    ("gpu", 2, 6, 4, 37, 4, 2, 16, None, 8, 16),  # GQA 2
    ("tpu", 2, 5, 2, 20, 8, 2, 16, 5, 4, 8),  # GQA 4, window
    ("gpu", 2, 5, 4, 24, 4, 1, 16, 3, 8, 8),  # GQA 4, window
    ("tpu", 2, 7, 3, 30, 4, 2, 8, 6, 6, 8),  # Bk not a power of two, window
    ("gpu", 2, 4, 4, 5, 2, 2, 16, 40, 128, 128),  # one tile holds everything, tiny context, wide window
]


@pytest.mark.parametrize("backend,batch,n,bk,s,hq,hkv,d,window,q_tile,k_tile", CASES)
def test_kernel_matches_reference_fp32(backend, batch, n, bk, s, hq, hkv, d, window, q_tile, k_tile):
    xs, proj = _inputs(n * s + hq, batch, n, bk, s, hq, hkv, d)
    rng = np.random.default_rng(s)
    for kind in ["sorted", "unsorted", "edges", "ragged"]:
        _check((backend, bk, window, q_tile, k_tile), xs, anchor_pattern(rng, kind, batch, n, s), proj)


@pytest.mark.parametrize("case", [CASES[2], CASES[3]], ids=["tpu", "gpu"])
def test_kernel_random_anchors(case):
    """Hypothesis over the runtime anchors (any mix of padding, 0, repeats, S-1, S); the shapes are
    those of a case above, so no new compile."""
    backend, batch, n, bk, s, hq, hkv, d, window, q_tile, k_tile = case
    xs, proj = _inputs(n * s + hq, batch, n, bk, s, hq, hkv, d)

    @settings(max_examples=8, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate])
    @given(st.lists(st.integers(-1, s), min_size=batch * n, max_size=batch * n))
    def check(values):
        _check((backend, bk, window, q_tile, k_tile), xs, jnp.asarray(values, jnp.int32).reshape(batch, n), proj)

    check()


def _doc_starts(rng, anchors):
    """A random context start in [0, anchor] per real block (0 for padding blocks): packed documents."""
    a = np.asarray(anchors)
    return jnp.asarray(np.where(a >= 0, rng.integers(0, np.maximum(a, 0) + 1), 0), jnp.int32)


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=["tpu", "gpu-window"])
def test_kernel_ctx_start(case):
    """Per-block context lower bounds (packed documents), forward and gradients against the reference,
    with and without a window."""
    backend, batch, n, bk, s, hq, hkv, d, window, q_tile, k_tile = case
    xs, proj = _inputs(n * s + hq, batch, n, bk, s, hq, hkv, d)
    rng = np.random.default_rng(3)
    for kind in ["sorted", "unsorted", "edges", "ragged"]:
        anchors = anchor_pattern(rng, kind, batch, n, s)
        _check((backend, bk, window, q_tile, k_tile), xs, anchors, proj, ctx_start=_doc_starts(rng, anchors))


CAUSAL_CASES = [CASES[0], CASES[1], CASES[4], CASES[3], ("tpu", *CASES[3][1:])]


@pytest.mark.parametrize("case", CAUSAL_CASES,
                         ids=["tpu", "gpu", "tpu-window", "gpu-window-lt-block", "tpu-window-lt-block"])
def test_kernel_block_causal(case):
    """block_causal=True (own block keys j <= i, window one-sided): forward and gradients against the
    reference, with per-block context starts 0 (one document) and random ones (packed), with no window,
    a window wider than the block and one narrower than it. (Starts 0 are what the kernel builds for
    ctx_start=None, so one compile serves both.)"""
    backend, batch, n, bk, s, hq, hkv, d, window, q_tile, k_tile = case
    xs, proj = _inputs(n * s + hq, batch, n, bk, s, hq, hkv, d)
    rng = np.random.default_rng(4)
    for kind in ["sorted", "unsorted", "edges", "ragged"]:
        anchors = anchor_pattern(rng, kind, batch, n, s)
        for starts in (jnp.zeros_like(anchors), _doc_starts(rng, anchors)):
            _check((backend, bk, window, q_tile, k_tile), xs, anchors, proj, ctx_start=starts, block_causal=True)


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=["tpu", "gpu-window-lt-block"])
def test_block_causal_later_block_keys_never_reach_earlier_queries(case):
    """Changing block key / value j of one block: with block_causal its rows i < j (and every other block)
    keep their output bit for bit, the rows that see j (j <= i, i - j < W) change; bidirectional, the
    block's rows within the window of j change too. Kernel and reference, with the compiles of
    test_kernel_block_causal (context starts 0) and test_kernel_matches_reference_fp32."""
    backend, batch, n, bk, s, hq, hkv, d, window, q_tile, k_tile = case
    xs, proj = _inputs(n * s + hq, batch, n, bk, s, hq, hkv, d)
    anchors = anchor_pattern(np.random.default_rng(0), "sorted", batch, n, s)
    blk, j = 2, 1
    key = blk * bk + j  # the block key row changed, in every batch row
    bumped = [x.at[:, key].add(3.0 * (-1) ** i) if i in (3, 4) else x for i, x in enumerate(xs)]
    rows = np.arange(n * bk)
    for block_causal, starts in ((True, (jnp.zeros_like(anchors),)), (False, ())):
        sees = np.asarray(block_mask(anchors, s, block_size=bk, sliding_window=window,
                                     block_causal=block_causal))[:, :, s + key]  # [B, T]: rows that see it
        earlier = (rows >= blk * bk) & (rows < key)
        assert np.all(sees[:, earlier] != block_causal)  # what the rule says, before testing the kernel
        for run in (_compiled("kernel", bk, window, q_tile, k_tile, backend, **_causal(block_causal)),
                    _compiled("reference", bk, window, **_causal(block_causal))):
            out, out2 = (np.asarray(run(x, anchors, proj, *starts)[0]) for x in (xs, bumped))
            changed = np.any(out != out2, axis=(2, 3))
            np.testing.assert_array_equal(changed, sees)


def test_tiles_before_ctx_start_are_not_read():
    """NaN in the context tile before every block's start: skipped, as the tiles past the anchors are."""
    backend, batch, n, bk, s, hq, hkv, d, window, q_tile, k_tile = CASES[0]  # reuses test_kernel_ctx_start's compile
    xs, proj = _inputs(n * s + hq, batch, n, bk, s, hq, hkv, d)
    bad = [x.at[:, :16].set(jnp.nan) if i in (1, 2) else x for i, x in enumerate(xs)]
    anchors = jnp.asarray([[20, 30, 17, 36, 25, -1], [16, 16, 33, -1, 21, 19]], jnp.int32)
    starts = jnp.asarray([[16, 18, 16, 20, 16, 0], [16, 16, 30, 0, 17, 16]], jnp.int32)
    out, grads = _compiled("kernel", bk, window, q_tile, k_tile, backend)(bad, anchors, proj, starts)
    out_r, grads_r = _compiled("reference", bk, window)(xs, anchors, proj, starts)
    _close(out, out_r, _f32_depth(xs, bk), "out")
    for g, g_r in zip(grads, grads_r):
        _close(g, g_r, _f32_depth(xs, bk), "grad")
    assert np.all(np.asarray(grads[1])[:, :16] == 0) and np.all(np.asarray(grads[2])[:, :16] == 0)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_kernel_bf16(backend):
    batch, n, bk, s, hq, hkv, d, window = 2, 6, 4, 40, 4, 2, 32, 9
    xs, proj = _inputs(7, batch, n, bk, s, hq, hkv, d, jnp.bfloat16)
    anchors = anchor_pattern(np.random.default_rng(1), "edges", batch, n, s)
    # Against the fp32 reference on the same (bf16-rounded) inputs. bf16 keeps 8 significant bits
    # (relative rounding 2**-9 ~ 2e-3). The kernel rounds p to bf16 before p @ v, rounds p and ds to
    # bf16 for the gradient matmuls and returns bf16 results, and its tile-wise online softmax rounds
    # at different points than a dense softmax; a few such roundings summed over tens of keys give
    # ~1e-2 of the largest entry, hence 3e-2.
    _check((backend, bk, window, 8, 16), xs, anchors, proj, tol=3e-2, ref_xs=[x.astype(jnp.float32) for x in xs])


@pytest.mark.parametrize("case,anchors,poisoned", [
    (CASES[0], [[3, 10, 0, 7, 9, 1], [16, 2, -1, -1, 5, 0]], slice(16, None)),  # tiles past every anchor
    (CASES[1], [[3, 10, 0, 7, 9, 1], [16, 2, -1, -1, 5, 0]], slice(16, None)),
    (CASES[2], [[12, 20, 15, 13, -1], [19, 12, -1, 14, 16]], slice(0, 8)),  # tiles before every window
    # The GPU formulation rounds tiles up to 16 (Triton's minimum dot size): positions 0..15 lie before
    # every window when every anchor - (W - 1) >= 16.
    (CASES[3], [[18, 24, 20, 19, -1], [18, 23, 21, -1, -1]], slice(0, 16)),
], ids=["tpu-past-anchors", "gpu-past-anchors", "tpu-before-window", "gpu-before-window"])
def test_skipped_tiles_are_not_read(case, anchors, poisoned):
    """NaN in context tiles no query tile may see: a computed (even fully masked) tile would spread
    NaN through 0 * NaN in p @ v, so a finite, correct result shows those tiles were skipped."""
    backend, batch, n, bk, s, hq, hkv, d, window, q_tile, k_tile = case  # reuses that compile
    xs, proj = _inputs(n * s + hq, batch, n, bk, s, hq, hkv, d)
    bad = [x.at[:, poisoned].set(jnp.nan) if i in (1, 2) else x for i, x in enumerate(xs)]
    anchors = jnp.asarray(anchors, jnp.int32)
    out, grads = _compiled("kernel", bk, window, q_tile, k_tile, backend)(bad, anchors, proj)
    out_r, grads_r = _compiled("reference", bk, window)(xs, anchors, proj)
    _close(out, out_r, _f32_depth(xs, bk), "out")
    for g, g_r in zip(grads, grads_r):
        _close(g, g_r, _f32_depth(xs, bk), "grad")
    assert np.all(np.asarray(grads[1])[:, poisoned] == 0) and np.all(np.asarray(grads[2])[:, poisoned] == 0)


def test_anchor_zero_block_sees_only_itself():
    backend, batch, n, bk, s, hq, hkv, d, window, q_tile, k_tile = CASES[0]  # reuses that compile
    xs, proj = _inputs(n * s + hq, batch, n, bk, s, hq, hkv, d)
    q, k_ctx, v_ctx, k_blk, v_blk = xs
    anchors = jnp.array([[5, 0, 36, 0, -1, 3], [0, 0, 0, 0, 0, 0]], jnp.int32)
    out, grads = _compiled("kernel", bk, window, q_tile, k_tile, backend)(xs, anchors, proj)
    out_r = block_attention_reference(*xs, anchors, block_size=bk)
    assert np.all(np.isfinite(out)) and all(np.all(np.isfinite(g)) for g in grads)
    # Independent: each anchor-0 block's queries against its own Bk keys only, plain softmax.
    g = hq // hkv
    for b, blk in [(0, 1), (0, 3), (1, 0), (1, 5)]:
        rows = slice(blk * bk, (blk + 1) * bk)
        k, v = jnp.repeat(k_blk[b, rows], g, axis=1), jnp.repeat(v_blk[b, rows], g, axis=1)  # [Bk, Hq, D]
        probs = jax.nn.softmax(jnp.einsum("thd,shd->hts", q[b, rows], k) * d ** -0.5, axis=-1)
        expect = jnp.einsum("hts,shd->thd", probs, v)
        _close(out[b, rows], expect, _f32_depth(xs, bk), f"kernel {b} {blk}")
        _close(out_r[b, rows], expect, _f32_depth(xs, bk), f"reference {b} {blk}")
    # Row 1 sees no context at all: the context gets exactly zero gradient there.
    assert np.all(np.asarray(grads[1])[1] == 0) and np.all(np.asarray(grads[2])[1] == 0)


def test_mask_hand_worked():
    # S=6, Bk=2, anchors [0, 3, 5, -1]: keys are context 0..5 then block keys 6..13.
    m = np.asarray(block_mask(jnp.array([[0, 3, 5, -1]]), 6, block_size=2))[0].astype(int)
    expect = np.array([
        # ctx 0 1 2 3 4 5 | blocks 0 . 1 . 2 . pad
        [0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0],  # block 0 (anchor 0): only its own block
        [0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0],  # block 1 (anchor 3): context 0..2
        [1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 0, 0],  # block 2 (anchor 5): context 0..4
        [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # padding block: nothing
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    ])
    np.testing.assert_array_equal(m, expect)
    # Window 2: token i of block b (position a+i) sees context p < a with a+i-p < 2, block keys |i-j| < 2.
    m = np.asarray(block_mask(jnp.array([[0, 3, 5]]), 6, block_size=2, sliding_window=2))[0].astype(int)
    expect = np.array([
        [0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0, 0, 0, 1, 1, 0, 0],  # position 3 sees p = 2
        [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0],  # position 4 would need p = 3, not < anchor 3
        [0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 1, 1],  # position 5 sees p = 4
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1],
    ])
    np.testing.assert_array_equal(m, expect)
    # block_causal, Bk=4, S=3, anchor 2: own block keys j <= i (window 2: also i - j < 2), context unchanged.
    m = np.asarray(block_mask(jnp.array([[2]]), 3, block_size=4, block_causal=True))[0].astype(int)
    np.testing.assert_array_equal(m, np.concatenate([np.array([[1, 1, 0]] * 4), np.tril(np.ones((4, 4), int))], 1))
    m = np.asarray(block_mask(jnp.array([[2]]), 3, block_size=4, sliding_window=2, block_causal=True))[0]
    expect = np.array([
        # ctx 0 1 2 | block 0 1 2 3
        [0, 1, 0, 1, 0, 0, 0],  # position 2 sees p = 1 (p < anchor 2, 2 - p < 2) and itself
        [0, 0, 0, 1, 1, 0, 0],  # position 3 would need p = 2, not < anchor 2
        [0, 0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1, 1],
    ])
    np.testing.assert_array_equal(m.astype(int), expect)


def test_dispatch():
    batch, n, bk, s, hq, hkv, d = 1, 3, 4, 10, 2, 1, 16
    xs, _ = _inputs(5, batch, n, bk, s, hq, hkv, d)
    anchors = jnp.array([[2, 9, -1]], jnp.int32)
    call = functools.partial(attention.block_attention, *xs, anchors, block_size=bk, sliding_window=4)
    ref = call(impl="reference")
    _close(call(impl="interpret"), ref, _f32_depth(xs, bk), "bidirectional")
    causal = call(impl="reference", block_causal=True)
    _close(call(impl="interpret", block_causal=True), causal, _f32_depth(xs, bk), "block causal")
    assert _rel_err(causal, ref) > 1e-2  # the option reaches both paths
    np.testing.assert_array_equal(call(impl="auto"), ref)  # CPU: auto is the reference
    with pytest.raises(ValueError):
        call(impl="fast")


def test_skipped_fraction():
    rng = np.random.default_rng(0)
    anchors = rng.integers(0, 300, size=(1, 64))
    sorted_, unsorted = (skipped_fraction(a, 300, block_size=16, q_tile=128, k_tile=32)
                         for a in (np.sort(anchors, axis=1), anchors))
    starts = _doc_starts(rng, anchors)
    for w, lo, causal in [(None, None, False), (7, None, False), (None, starts, False), (40, starts, False),
                          (None, None, True), (7, starts, True), (40, None, True)]:  # "visible" against the dense mask
        mask = block_mask(jnp.asarray(anchors), 300, block_size=16, sliding_window=w, ctx_start=lo, block_causal=causal)
        r = skipped_fraction(anchors, 300, block_size=16, sliding_window=w, ctx_start=lo, block_causal=causal)
        assert r["visible"] == int(mask.sum()) and r["computed"] >= r["visible"]
    packed = skipped_fraction(np.sort(anchors, axis=1), 300, block_size=16, q_tile=128, k_tile=32,
                              ctx_start=np.minimum(np.sort(anchors, axis=1), 150))
    assert packed["skipped"] > sorted_["skipped"]  # a start skips the tiles before it
    for r in (sorted_, unsorted):
        assert 0 < r["skipped"] < 1 and r["computed"] >= r["visible"]
    assert sorted_["skipped"] > unsorted["skipped"]  # sorted anchors make tighter context ranges


@pytest.mark.parametrize("platform,backend", [("tpu", "tpu"), ("cuda", "gpu")])
@pytest.mark.parametrize("window,block_causal", [(None, False), (256, False), (256, True)])
def test_lowers_for_accelerators(platform, backend, window, block_causal):
    """Smoke check without hardware: fwd + bwd lower through Pallas to Mosaic (TPU) / Triton (GPU) IR
    at production tiles, also with a causal own block. The Mosaic and Triton compilers themselves only
    run on the devices."""
    batch, n, bk, s, hq, hkv, d = 1, 20, 16, 300, 4, 2, 128
    xs = [jnp.zeros(sh, jnp.bfloat16) for sh in
          [(batch, n * bk, hq, d), (batch, s, hkv, d), (batch, s, hkv, d), (batch, n * bk, hkv, d),
           (batch, n * bk, hkv, d)]]
    anchors = jnp.zeros((batch, n), jnp.int32)

    def run(*xs):
        out, vjp = jax.vjp(lambda *a: block_attention(*a, anchors, block_size=bk, sliding_window=window,
                                                      interpret=False, backend=backend,
                                                      block_causal=block_causal), *xs)
        return out, vjp(out)

    text = jax.jit(run).trace(*xs).lower(lowering_platforms=(platform,)).as_text()
    target = "tpu_custom_call" if platform == "tpu" else "triton"
    assert text.count(target) >= 3  # forward, dq, dk/dv


def test_check_cli_reports_and_exits_nonzero_on_failure(monkeypatch, capsys):
    """`python -m dflash_jax.kernels.check`: one line per case, exit status 0 when all pass, 1 when any fails (here a
    case whose shapes the kernel rejects: Hq not a multiple of Hkv)."""
    from dflash_jax.kernels import check

    small = ("fp32 tiny", 1, 3, 4, 20, 2, 1, 16, None, "float32", "ragged", 8, 16)
    monkeypatch.setattr(check, "CASES", [small])
    assert check.main([]) == 0
    assert capsys.readouterr().out.startswith("ok   fp32 tiny")
    monkeypatch.setattr(check, "CASES", [small, ("bad heads", 1, 3, 4, 20, 3, 2, 16, None, "float32", "sorted", 8, 16)])
    assert check.main(["--json"]) == 1
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["ok"] for r in rows] == [True, False] and "error" in rows[1]
