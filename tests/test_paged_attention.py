"""Paged decode attention: both Pallas formulations (interpret mode on CPU; the TPU one also under TPU interpret
mode with race detection and NaN-filled uninitialised memory) against the reference (the pages gathered, then the
dense decode reference), itself against the dense reference over the rows the pages hold; the dispatch and a
target verify forward over a ``PagedKV`` against the ``FullKV`` path."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jax.sharding import NamedSharding

from dflash_jax import attention, sharding as sh, target as target_lib
from dflash_jax.kernels import tiling
from dflash_jax.kernels.decode_attention import decode_attention_reference
from dflash_jax.kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
    paged_kernel_supported,
)
from dflash_jax.sharding.rules import logical_to_mesh
from dflash_jax.state import NO_PAGE, PAGE_AXES, FullKV, PagedKV
from pairs import random_pair
from test_decode_attention import BF16_TOL, _random_parents, _tree
from tolerances import assert_close, forward_depth, max_diff

_fast_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})
STALE = 1e4  # pool slots no query may see: stale pages, the rest of a last page (one seen slot too many shows)

# b, t, hq, hkv, d, page, table width n, pool pages, lengths (empty, partial last page, full table), window
CASES = [
    (3, 4, 4, 2, 16, 8, 4, 16, (0, 13, 32), None),  # GQA 2
    (3, 4, 8, 2, 16, 16, 3, 11, (5, 16, 47), 6),  # GQA 4, a window, lengths at and below page edges
]
BACKENDS = ["tpu", "gpu"]


def _paged(seed, b, t, hq, hkv, d, page, n, pool, lengths, dtype, dv=None):
    """Rows k, v [B, n*page, Hkv, D] held in scrambled pages of a pool (the rest of the pool and every slot past
    a row's length STALE; table entries past the row's pages NO_PAGE) -> (q, rows, pools, table, own keys, sinks)."""
    rng = np.random.default_rng(seed)
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    dv = dv or d
    k, v = f(b, n * page, hkv, d), f(b, n * page, hkv, dv)
    stale = np.arange(n * page)[None, :] >= np.asarray(lengths)[:, None]
    k[stale], v[stale] = STALE, -STALE
    k_pages, v_pages = np.full((pool, page, hkv, d), STALE, np.float32), np.full((pool, page, hkv, dv), -STALE,
                                                                                   np.float32)
    order, table = iter(rng.permutation(pool)), np.full((b, n), NO_PAGE, np.int64)
    for i, length in enumerate(lengths):
        for j in range(-(-length // page)):
            table[i, j] = p = next(order)
            k_pages[p], v_pages[p] = k[i, j * page:(j + 1) * page], v[i, j * page:(j + 1) * page]
    cast = lambda *xs: [jnp.asarray(x).astype(dtype) for x in xs]  # noqa: E731
    return (*cast(f(b, t, hq, d), k, v, k_pages, v_pages, f(b, t, hkv, d), f(b, t, hkv, dv)),
            jnp.asarray(table, jnp.int32), jnp.asarray(f(hq) * 2))


def _positions(lengths, t):
    """Verify-style queries: row b's T tokens at lengths[b] - T .. lengths[b] - 1 (< 0: padding)."""
    pos = np.asarray(lengths)[:, None] - t + np.arange(t)
    return jnp.asarray(np.where(pos >= 0, pos, -1), jnp.int32)


def _kernel(backend, **kw):
    return _fast_jit(functools.partial(paged_decode_attention, backend=backend, interpret=True, **kw))


def _close(out, ref, dtype, ctx, what):
    if dtype == jnp.float32:  # depth: a D-wide score, then the softmax and p @ v over the ctx cached + T own keys
        assert_close(out, ref, out.shape[-1] + ctx + out.shape[1], what=what)
    else:
        assert max_diff(out, ref) <= BF16_TOL, (what, max_diff(out, ref))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=["gqa2", "gqa4-window"])
def test_matches_reference(backend, case):
    """Ragged rows (one empty) in scrambled pages, partly filled last pages; float32 with sinks (the target's
    verify), bfloat16 with the queries' own keys (the draft's block); padding queries output 0. The reference
    equals the dense one over the rows the pages hold."""
    b, t, hq, hkv, d, page, n, pool, lengths, window = case
    lengths_a, q_pos = jnp.asarray(lengths, jnp.int32), _positions(lengths, t)
    for dtype, sinks_on, new in ((jnp.float32, True, False), (jnp.bfloat16, False, True)):
        q, k, v, kp, vp, kn, vn, table, sinks = _paged(page + n, b, t, hq, hkv, d, page, n, pool, lengths, dtype)
        kw = dict(sliding_window=window, sinks=sinks if sinks_on else None)
        own = dict(k_new=kn, v_new=vn) if new else {}
        ref = paged_decode_attention_reference(q, kp, vp, table, q_pos, lengths_a, **own, **kw)
        np.testing.assert_array_equal(ref, decode_attention_reference(q, k, v, q_pos, lengths_a, **own, **kw))
        out = _kernel(backend, sliding_window=window)(q, kp, vp, table, q_pos, lengths_a, *own.values(),
                                                      sinks=kw["sinks"])
        assert out.shape == q.shape and out.dtype == dtype
        _close(out, ref, dtype, n * page, f"{backend} {dtype.__name__}")
        assert np.all(np.asarray(out, np.float32)[np.asarray(q_pos) < 0] == 0)


@pytest.mark.parametrize("case", CASES, ids=["gqa2", "gqa4-window"])
def test_the_loop_reads_tiles_of_pages(case):
    """The CPU path (``paged_decode_attention_loop``): tiles of two pages (the last overlapping the one before),
    read through the table up to the longest row, equal the reference; with own keys under a tree mask too."""
    from dflash_jax.kernels.paged_attention import paged_decode_attention_loop

    b, t, hq, hkv, d, page, n, pool, lengths, window = case
    lengths_a, q_pos = jnp.asarray(lengths, jnp.int32), _positions(lengths, t)
    q, k, v, kp, vp, kn, vn, table, sinks = _paged(page + n + 1, b, t, hq, hkv, d, page, n, pool, lengths,
                                                   jnp.float32)
    mask = jnp.asarray(np.tril(np.ones((b, t, t), bool)))
    for own in ({}, dict(k_new=kn, v_new=vn), dict(k_new=kn, v_new=vn, new_mask=mask)):
        kw = dict(sliding_window=None if "new_mask" in own else window, sinks=sinks)
        ref = paged_decode_attention_reference(q, kp, vp, table, q_pos, lengths_a, **own, **kw)
        out = paged_decode_attention_loop(q, kp, vp, table, q_pos, lengths_a, **own, k_tile=2 * page, **kw)
        _close(out, ref, jnp.float32, n * page, f"loop {sorted(own)}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_mask_and_causal_own_keys(backend):
    """The own keys as a random tree's ancestor-or-self ``new_mask`` (positions length + depth, ragged node counts;
    with sinks) and causally (``new_causal``), values narrower than keys (Dv = D / 2)."""
    b, t, hq, hkv, d, page, n, pool, lengths, window = CASES[1]
    q, k, v, kp, vp, kn, vn, table, sinks = _paged(1, b, t, hq, hkv, d, page, n, pool, lengths, jnp.float32, d // 2)
    lengths_a = jnp.asarray(lengths, jnp.int32)
    tree_pos, tree_mask = _tree(_random_parents(np.random.default_rng(2), b, t), lengths)
    for q_pos, kw in ((tree_pos, dict(new_mask=tree_mask, sinks=sinks)), (_positions(lengths, t), dict(sinks=None))):
        causal = "new_mask" not in kw
        ref = paged_decode_attention_reference(q, kp, vp, table, q_pos, lengths_a, k_new=kn, v_new=vn,
                                               sliding_window=window, new_causal=causal, **kw)
        out = _kernel(backend, sliding_window=window, new_causal=causal)(q, kp, vp, table, q_pos, lengths_a, kn, vn,
                                                                         **kw)
        assert out.shape == (b, t, hq, d // 2)
        _close(out, ref, jnp.float32, n * page, f"{backend} causal={causal}")


def test_tpu_interpret_mode_finds_no_race_and_reads_no_uninitialised_memory():
    """The TPU formulation under TPU interpret mode (Mosaic's memory simulated: DMAs, VMEM scratch, semaphores)
    with the race detector on and uninitialised memory NaN: a kernel reading scratch or output before writing
    it, or a block before its copy lands, would give NaN; the detector reports any racing access."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as mosaic_interpret

    b, t, hq, hkv, d, page, n, pool, lengths, window = CASES[0]
    q, k, v, kp, vp, kn, vn, table, sinks = _paged(3, b, t, hq, hkv, d, page, n, pool, lengths, jnp.float32)
    lengths_a = jnp.asarray(lengths, jnp.int32)
    tree_pos, tree_mask = _tree(_random_parents(np.random.default_rng(4), b, t), lengths)
    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
    for q_pos, own in ((_positions(lengths, t), {}), (tree_pos, dict(k_new=kn, v_new=vn, new_mask=tree_mask))):
        with pltpu.force_tpu_interpret_mode(params):  # traced under it: interpret=False is overridden
            out = jax.jit(functools.partial(paged_decode_attention, backend="tpu", interpret=False, sinks=sinks,
                                            **own))(q, kp, vp, table, q_pos, lengths_a)
        assert not mosaic_interpret.races.races_found
        ref = paged_decode_attention_reference(q, kp, vp, table, q_pos, lengths_a, sinks=sinks, **own)
        assert np.all(np.isfinite(np.asarray(out)))
        _close(out, ref, jnp.float32, n * page, f"tpu interpret {sorted(own)}")


def test_dispatch():
    """``attention.paged_decode_attention``: every impl equals ``decode_attention`` over the pages gathered
    (``PagedKV.view``) after a ``PagedKV.write``; an unknown impl and a ``new_mask`` without own keys fail."""
    b, t, hq, hkv, d, page, n, pool, lengths, window = CASES[1]
    q, _, _, kp, vp, kn, vn, table, sinks = _paged(5, b, t, hq, hkv, d, page, n, pool, lengths, jnp.float32)
    q_pos = _positions(lengths, t)
    state = PagedKV(kp, vp, table, page).write(kn, vn, q_pos)
    lengths_a = jnp.max(q_pos, axis=1) + 1
    want = attention.decode_attention(q, *state.view(), q_pos, lengths_a, sliding_window=window, sinks=sinks,
                                      impl="reference")
    for impl in ("auto", "loop", "reference", "interpret"):
        out = attention.paged_decode_attention(q, state.k, state.v, state.table, q_pos, lengths_a,
                                               sliding_window=window, sinks=sinks, impl=impl)
        _close(out, want, jnp.float32, n * page, impl)
    with pytest.raises(ValueError, match="impl"):
        attention.paged_decode_attention(q, kp, vp, table, q_pos, lengths_a, impl="dense")
    for impl in ("reference", "interpret"):
        with pytest.raises(ValueError, match="new_mask"):
            attention.paged_decode_attention(q, kp, vp, table, q_pos, lengths_a, new_mask=jnp.ones((b, t, t), bool),
                                             impl=impl)


def test_per_shard_equals_single_device():
    """On a data=2 x tensor=4 mesh (rows and their table rows over data, heads over tensor, the pools whole on every
    row shard) the kernel runs per shard, each on its rows' pages, and equals the single-device result."""
    b, t, hq, hkv, d, page, n, pool, lengths = 4, 4, 8, 4, 16, 8, 4, 20, (3, 0, 29, 17)
    q, _, _, kp, vp, kn, vn, table, sinks = _paged(8, b, t, hq, hkv, d, page, n, pool, lengths, jnp.float32)
    x = dict(q=q, kp=kp, vp=vp, table=table, q_pos=_positions(lengths, t), lengths=jnp.asarray(lengths, jnp.int32),
             kn=kn, vn=vn, sinks=sinks)
    names = dict(q=("cache_batch", "cache_len", "cache_heads", "cache_head_dim"), kp=PAGE_AXES, vp=PAGE_AXES,
                 table=("cache_batch", "cache_len"), q_pos=("cache_batch",), lengths=("cache_batch",),
                 kn=("cache_batch", "cache_len", "cache_kv_heads", "cache_head_dim"),
                 vn=("cache_batch", "cache_len", "cache_kv_heads", "cache_head_dim"), sinks=("cache_heads",))
    run = jax.jit(lambda x: attention.paged_decode_attention(x["q"], x["kp"], x["vp"], x["table"], x["q_pos"],
                                                             x["lengths"], x["kn"], x["vn"], sinks=x["sinks"],
                                                             sliding_window=9, impl="interpret"))
    want = run(x)
    mesh = sh.make_mesh("data=2,tensor=4")
    placed = {k: jax.device_put(a, NamedSharding(mesh, logical_to_mesh(names[k], a.shape, mesh))) for k, a in x.items()}
    with jax.set_mesh(mesh):
        got = run(placed)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert got.sharding.shard_shape(got.shape) == (b // 2, t, hq // 4, d)


def test_verify_forward_over_pages_equals_full_cache():
    """A target verify forward (ragged rows, one empty) over a paged cache, with the paged kernel (interpret) and
    the loop, equals the same forward over a ``FullKV`` cache holding the same prompts."""
    target, _ = random_pair(vocab=96, block_size=8)
    cfg, b, s, t, page = target.config, 3, 64, 8, 16
    rng = np.random.default_rng(6)
    lens = np.array([0, 5, 40])
    prompt = jnp.asarray(rng.integers(0, 96, (b, 48)), jnp.int32)
    pos = jnp.asarray(np.where(np.arange(48) < lens[:, None], np.arange(48), -1), jnp.int32)
    ids = jnp.asarray(rng.integers(0, 96, (b, t)), jnp.int32)
    verify_pos = jnp.asarray(lens[:, None] + np.arange(t), jnp.int32)
    full = target.new_cache(b, s)
    paged = target_lib.new_cache(cfg, b, s, jnp.float32, page=page)
    pools = [(jnp.full((13, page) + x.k.shape[2:], STALE), jnp.full((13, page) + x.v.shape[2:], -STALE))
             for x in full.layers if isinstance(x, FullKV)]
    table = jnp.asarray(np.random.default_rng(7).permutation(13)[:b * (s // page)].reshape(b, -1), jnp.int32)
    paged = paged.join_pages(pools, table)
    outs = {}
    for name, cache, impls in (("full", full, ("reference",)), ("paged", paged, ("loop", "interpret"))):
        _, _, cache = target_lib.forward(cfg, target.params, prompt, pos, cache, attention_impl="reference")
        cache = cache.commit(jnp.asarray(lens, jnp.int32))
        for impl in impls:
            outs[name, impl] = target_lib.forward(cfg, target.params, ids, verify_pos, cache, (1,),
                                                  attention_impl=impl)[:2]
    depth = forward_depth(cfg, 48 + t)  # a forward over the 48 + 8 positions the rows attend at most
    for key in (("paged", "loop"), ("paged", "interpret")):
        for a, r in zip(jax.tree_util.tree_leaves(outs[key]), jax.tree_util.tree_leaves(outs["full", "reference"])):
            assert_close(a, r, depth, what=str(key))


def test_kernel_support_needs_a_page_the_backend_tiles(monkeypatch):
    """The page is the key tile: TPU a multiple of 8, GPU a power of two >= 16; head widths as the decode kernel's."""
    monkeypatch.setattr(tiling, "gpu_capable", lambda: True)
    for platform, fits, misfits in (("gpu", (16, 64), (8, 24, 48)), ("tpu", (8, 16, 24), (4, 12))):
        monkeypatch.setattr(tiling, "platform", lambda p=platform: p)
        for page in fits:
            assert paged_kernel_supported(head_dim=128, kv_heads=8, page=page), (platform, page)
        for page in misfits:
            assert not paged_kernel_supported(head_dim=128, kv_heads=8, page=page), (platform, page)
        # GPU: one head's lanes a power of two; TPU: a page is the pools' own [page, Hkv, D] block, any width
        assert paged_kernel_supported(head_dim=192, v_head_dim=128, kv_heads=8, page=16) == (platform == "tpu")


@pytest.mark.parametrize("platform,backend", [("tpu", "tpu"), ("cuda", "gpu")])
def test_lowers_for_accelerators(platform, backend):
    """Smoke check without hardware: the paged kernel lowers to Mosaic (TPU) / Triton (GPU) IR at production
    shapes (verify of 16 tokens, 32 query / 8 KV heads of 128, bf16, pages of 16, a 4096-slot table over a pool
    of 600 pages), plain and with the window, sinks and a tree's own keys."""
    b, t, hq, hkv, d, page, n, pool = 2, 16, 32, 8, 128, 16, 256, 600
    q, kn, vn = (jnp.zeros(sh, jnp.bfloat16) for sh in [(b, t, hq, d), (b, t, hkv, d), (b, t, hkv, d)])
    kp = vp = jnp.zeros((pool, page, hkv, d), jnp.bfloat16)
    table, q_pos, lengths = jnp.zeros((b, n), jnp.int32), jnp.zeros((b, t), jnp.int32), jnp.zeros((b,), jnp.int32)
    sinks = jnp.zeros((hq,), jnp.float32)
    tree = _tree(_random_parents(np.random.default_rng(0), b, t), np.zeros(b, np.int32))[1]

    def run(q, kp, vp, kn, vn):
        kw = dict(interpret=False, backend=backend)
        return (paged_decode_attention(q, kp, vp, table, q_pos, lengths, **kw),
                paged_decode_attention(q, kp, vp, table, q_pos, lengths, kn, vn, sliding_window=128, sinks=sinks,
                                       new_mask=tree, **kw))

    text = jax.jit(run).trace(q, kp, vp, kn, vn).lower(lowering_platforms=(platform,)).as_text()
    assert text.count("tpu_custom_call" if platform == "tpu" else "triton") >= 2
