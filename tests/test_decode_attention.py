"""Length-bounded decode attention: the tiled loop and both Pallas formulations (interpret mode on CPU)
against the dense masked reference, and the target / draft forwards against the masked path they replace."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import attention, decode as S, target as target_lib
from dflash_jax.drafts import model as draft_lib
from dflash_jax.kernels.decode_attention import (
    decode_attention,
    decode_attention_loop,
    decode_attention_reference,
    decode_kernel_supported,
)
from dflash_jax.state import FullKV
from pairs import random_pair
from tolerances import assert_close, forward_depth, max_diff

_fast_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def _inputs(seed, b, t, hq, hkv, d, s, dtype):
    rng = np.random.default_rng(seed)
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)  # noqa: E731
    return f(b, t, hq, d), f(b, s, hkv, d), f(b, s, hkv, d), f(b, t, hkv, d), f(b, t, hkv, d), \
        jnp.asarray(rng.standard_normal(hq, np.float32) * 2)


def _positions(lengths, t, s):
    """Verify-style queries: row b's T tokens at lengths[b] - T .. lengths[b] - 1 (< 0: padding)."""
    pos = np.asarray(lengths)[:, None] - t + np.arange(t)
    return jnp.asarray(np.where(pos >= 0, pos, -1), jnp.int32)


def _tree(parents, lengths):
    """Tree verification from parent arrays [B, T] (parent[u] < u; node 0 the root, -1; -2 a padding node):
    nodes at positions lengths[b] + depth (-1: padding) and the ancestor-or-self mask [B, T, T]."""
    parents = np.asarray(parents)
    b, t = parents.shape
    mask, depth = np.zeros((b, t, t), bool), np.zeros((b, t), np.int32)
    for i in range(b):
        for u in range(t):
            p = parents[i, u]
            mask[i, u, u] = True
            if p >= 0:
                mask[i, u] |= mask[i, p]
                depth[i, u] = depth[i, p] + 1
    pos = np.where(parents >= -1, np.asarray(lengths)[:, None] + depth, -1)
    return jnp.asarray(pos, jnp.int32), jnp.asarray(mask)


def _random_parents(rng, b, t):
    """A random tree per row with a random number of real nodes (the first row all T), padding after them."""
    parents = np.array([[-1] + [rng.integers(0, u) for u in range(1, t)] for _ in range(b)])
    nodes = np.concatenate([[t], rng.integers(1, t + 1, b - 1)])
    return np.where(np.arange(t) < nodes[:, None], parents, -2)


# b, t, hq, hkv, d, s, k_tile, lengths (tile boundaries, 0 / 1, full cache, ragged), window
CASES = [
    (4, 1, 4, 2, 16, 64, 16, (0, 1, 16, 64), None),  # decode, GQA 2, lengths at tile edges
    (4, 16, 8, 2, 16, 72, 16, (0, 17, 32, 72), None),  # verify T=16, GQA 4, S not a multiple of the tile
    (3, 16, 4, 4, 16, 48, 8, (5, 16, 48), 7),  # verify with a sliding window, no GQA
    (3, 4, 4, 1, 16, 40, 16, (1, 24, 40), 3),  # window smaller than T, GQA 4 over one K/V head
]
IMPLS = ["loop", "tpu", "gpu"]
# bfloat16 (8 significant bits, 2^-9 relative rounding): p and the outputs rounded to bf16 at other points by the
# tiled online softmax than by the dense one, a few such roundings of O(1) outputs: ~1e-2, hence 3e-2.
BF16_TOL = 3e-2


def _depth(q, k):
    """float32 roundings on the longest path of one attention: a D-wide score reduction, then the softmax and
    p @ v over the S cached and T own keys (the tiled loop / kernels sum them in another order)."""
    return q.shape[-1] + k.shape[1] + q.shape[1]


def _close(out, ref, q, k, what=""):
    assert_close(np.asarray(out, np.float32), np.asarray(ref, np.float32), _depth(q, k), what=what)


def _run(impl, k_tile, window, sinks_on, new, dtype, new_causal=False):
    kw = dict(sliding_window=window, new_causal=new_causal)
    if impl == "loop":
        fn = functools.partial(decode_attention_loop, k_tile=k_tile, **kw)
    else:
        fn = functools.partial(decode_attention, k_tile=k_tile, backend=impl, interpret=True, **kw)

    def call(q, k, v, q_pos, lengths, k_new, v_new, sinks, new_mask=None):
        return fn(q, k, v, q_pos, lengths, *((k_new, v_new) if new else ()), sinks=sinks if sinks_on else None,
                  new_mask=new_mask)

    return _fast_jit(call)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"t{c[1]}-g{c[2] // c[3]}-s{c[5]}-w{c[8]}")
def test_matches_dense_reference(impl, case):
    b, t, hq, hkv, d, s, k_tile, lengths, window = case
    # float32 with sinks (the target's verify), bfloat16 with the queries' own keys (the draft's block)
    for dtype, sinks_on, new in ((jnp.float32, True, False), (jnp.bfloat16, False, True)):
        q, k, v, kn, vn, sinks = _inputs(s + t, b, t, hq, hkv, d, s, dtype)
        lengths_a = jnp.asarray(lengths, jnp.int32)
        q_pos = _positions(lengths, t, s)
        ref = decode_attention_reference(q, k, v, q_pos, lengths_a, k_new=kn if new else None,
                                         v_new=vn if new else None, sliding_window=window,
                                         sinks=sinks if sinks_on else None)
        out = _run(impl, k_tile, window, sinks_on, new, dtype)(q, k, v, q_pos, lengths_a, kn, vn, sinks)
        assert out.shape == q.shape and out.dtype == dtype
        if dtype == jnp.float32:
            _close(out, ref, q, k, what=f"{impl} sinks={sinks_on} new={new}")
        else:
            assert max_diff(out, ref) <= BF16_TOL, (dtype, sinks_on, new, max_diff(out, ref))
        pad = np.asarray(q_pos) < 0
        assert np.all(np.asarray(out, np.float32)[pad] == 0)  # padding queries output 0


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES[1:], ids=lambda c: f"t{c[1]}-g{c[2] // c[3]}-s{c[5]}-w{c[8]}")
def test_own_key_rules_match_dense_reference(impl, case):
    """The own keys seen as a random tree's ancestor-or-self ``new_mask`` (positions length + depth, ragged
    node counts and lengths; float32 with sinks) and causally (``new_causal``, verify positions; bfloat16),
    with GQA."""
    b, t, hq, hkv, d, s, k_tile, lengths, window = case
    lengths_a = jnp.asarray(lengths, jnp.int32)
    tree_pos, tree_mask = _tree(_random_parents(np.random.default_rng(t + s), b, t), lengths)
    for dtype, sinks_on, causal in ((jnp.float32, True, False), (jnp.bfloat16, False, True)):
        q, k, v, kn, vn, sinks = _inputs(s + t, b, t, hq, hkv, d, s, dtype)
        q_pos, new_mask = (_positions(lengths, t, s), None) if causal else (tree_pos, tree_mask)
        ref = decode_attention_reference(q, k, v, q_pos, lengths_a, k_new=kn, v_new=vn, sliding_window=window,
                                         sinks=sinks if sinks_on else None, new_causal=causal, new_mask=new_mask)
        out = _run(impl, k_tile, window, sinks_on, True, dtype, causal)(q, k, v, q_pos, lengths_a, kn, vn, sinks,
                                                                        new_mask)
        if dtype == jnp.float32:
            _close(out, ref, q, k, what=f"{impl} tree")
        else:
            assert max_diff(out, ref) <= BF16_TOL, (dtype, causal, max_diff(out, ref))
        assert np.all(np.asarray(out, np.float32)[np.asarray(q_pos) < 0] == 0)  # padding queries output 0


def test_chain_mask_equals_new_causal():
    """``new_mask`` of a chain (parent t - 1: its ancestor-or-self mask is lower triangular, positions
    length + t) gives exactly what ``new_causal=True`` gives, in every implementation (through
    ``attention.decode_attention``, and the GPU formulation); and the rules differ."""
    b, t, hq, hkv, d, s, k_tile, lengths, window = CASES[1]  # no window: new_mask ignores it
    q, k, v, kn, vn, sinks = _inputs(5, b, t, hq, hkv, d, s, jnp.float32)
    lengths_a = jnp.asarray(lengths, jnp.int32)
    q_pos, chain = _tree(np.broadcast_to(np.arange(t) - 1, (b, t)), lengths)
    np.testing.assert_array_equal(chain, np.broadcast_to(np.tril(np.ones((t, t), bool)), (b, t, t)))
    ref = decode_attention_reference(q, k, v, q_pos, lengths_a, k_new=kn, v_new=vn, sinks=sinks, new_mask=chain)
    causal = decode_attention_reference(q, k, v, q_pos, lengths_a, k_new=kn, v_new=vn, sinks=sinks, new_causal=True)
    bidir = decode_attention_reference(q, k, v, q_pos, lengths_a, k_new=kn, v_new=vn, sinks=sinks)
    np.testing.assert_array_equal(ref, causal)
    assert np.abs(np.asarray(ref) - np.asarray(bidir)).max() > 1e-2
    for impl in ("loop", "interpret", "gpu"):
        fn = functools.partial(decode_attention, backend="gpu", interpret=True) if impl == "gpu" else \
            functools.partial(attention.decode_attention, impl=impl)
        by_mask, by_rule = (_fast_jit(functools.partial(fn, sinks=sinks, **kw))(q, k, v, q_pos, lengths_a, kn, vn)
                            for kw in (dict(new_mask=chain), dict(new_causal=True)))
        np.testing.assert_array_equal(by_mask, by_rule, err_msg=impl)
        _close(by_mask, ref, q, k, what=impl)


def test_new_mask_needs_own_keys():
    b, t, hq, hkv, d, s, k_tile, lengths, window = CASES[3]
    q, k, v, _, _, _ = _inputs(0, b, t, hq, hkv, d, s, jnp.float32)
    mask = jnp.ones((b, t, t), bool)
    for impl in ("reference", "loop", "interpret"):
        with pytest.raises(ValueError, match="new_mask"):
            attention.decode_attention(q, k, v, _positions(lengths, t, s), jnp.asarray(lengths), new_mask=mask,
                                       impl=impl)


def test_stale_slots_past_the_length_are_never_seen():
    """Stale slots past each row's length (here huge keys and values) do not change its result: it depends
    only on its first ``length`` slots."""
    b, t, hq, hkv, d, s, k_tile, lengths, window = CASES[1]
    q, k, v, kn, vn, sinks = _inputs(0, b, t, hq, hkv, d, s, jnp.float32)
    lengths_a = jnp.asarray(lengths, jnp.int32)
    q_pos = _positions(lengths, t, s)
    stale = jnp.arange(s)[None, :, None, None] >= lengths_a[:, None, None, None]
    ref = decode_attention_reference(q, k, v, q_pos, lengths_a)
    k2, v2 = jnp.where(stale, 1e4, k), jnp.where(stale, -1e4, v)
    for impl in IMPLS:
        out = _run(impl, k_tile, window, False, False, jnp.float32)(q, k2, v2, q_pos, lengths_a, kn, vn, sinks)
        _close(out, ref, q, k, what=impl)


# row b: (length, first query position); T = 4 queries each at first .. first + 3. Rows 0 / 4: queries far below
# the length (stale slots above them: the causal bound binds); rows 1-3: queries above it (the length binds, row 1
# at a tile edge, row 3 sees nothing); row 5: mixed (its first query's causal bound, then the length).
BOUND_ROWS = [(40, 3), (16, 30), (5, 20), (0, 8), (33, 12), (18, 16)]


def _numpy_decode_attention(q, k, v, q_pos, lengths, window):
    """The oracle: per query, a float64 softmax over exactly the slots s < length, s <= q_pos (q_pos - s < window)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    out = np.zeros(q.shape[:3] + v.shape[-1:])
    for b, t in np.ndindex(*q_pos.shape):
        p = int(q_pos[b, t])
        s = np.arange(k.shape[1])
        seen = (s < lengths[b]) & (s <= p) & ((p - s < window) if window else True)
        if p < 0 or not seen.any():
            continue
        for h in range(q.shape[2]):
            logits = k[b, seen, h // g] @ q[b, t, h] / np.sqrt(q.shape[-1])
            w = np.exp(logits - logits.max())
            out[b, t, h] = w @ v[b, seen, h // g] / w.sum()
    return out


@pytest.mark.parametrize("window", [None, 20])
def test_length_bound_when_it_is_not_the_causal_one(window):
    """Queries far below the row length (stale slots above them) and above it (``lengths`` smaller than the
    causal bound), against a numpy oracle, for the loop, both Pallas formulations (interpret) and the dense
    reference. Slots some query must not see hold large values, so one slot too many or too few shows.
    Catches ``lengths + 1`` (or ``q_pos + 2``) in ``_row_bounds``, the loop, the kernel or the reference."""
    b, t, hq, hkv, d, s, k_tile = len(BOUND_ROWS), 4, 4, 2, 16, 48, 16
    q, k, v, _, _, _ = _inputs(7, b, t, hq, hkv, d, s, jnp.float32)
    lengths = np.array([n for n, _ in BOUND_ROWS], np.int32)
    q_pos = np.array([first + np.arange(t) for _, first in BOUND_ROWS], np.int32)
    assert (lengths > q_pos[:, -1] + 1).sum() == 2 and (lengths < q_pos[:, 0] + 1).sum() == 3
    slot = np.arange(s)[None, :]
    unseen = (slot >= lengths[:, None]) | (slot > q_pos[:, :1])  # invisible to at least the row's first query
    v = v + 20.0 * jnp.asarray(unseen, jnp.float32)[:, :, None, None]
    want = _numpy_decode_attention(q, k, v, q_pos, lengths, window)
    assert np.abs(want).max() > 1.0 and np.all(want[3] == 0)
    args = (q, k, v, jnp.asarray(q_pos), jnp.asarray(lengths))
    outs = {impl: _run(impl, k_tile, window, False, False, jnp.float32)(*args, None, None, None) for impl in IMPLS}
    outs["reference"] = decode_attention_reference(*args, sliding_window=window)
    for impl, out in outs.items():
        assert_close(out, want, _depth(q, k), what=impl)  # float32 against the float64 oracle


@pytest.mark.parametrize("case", CASES[1:3], ids=["gqa4", "window"])
def test_value_head_dim_differs_from_the_key_head_dim(case):
    """Values narrower than keys (Dv 8, D 16: MiMo-V2-Flash's 128 / 192): the dense reference equals the numpy
    oracle, and the loop and both Pallas formulations (interpret) equal the reference, with sinks, the window
    and the queries' own keys (bidirectional, causal, a tree's ``new_mask``); outputs are [.., Dv]."""
    b, t, hq, hkv, d, s, k_tile, lengths, window = case
    dv = d // 2
    q, k, v, kn, vn, sinks = _inputs(11, b, t, hq, hkv, d, s, jnp.float32)
    v, vn = v[..., :dv] * 3.0, vn[..., :dv] * 3.0
    lengths_a, q_pos = jnp.asarray(lengths, jnp.int32), _positions(lengths, t, s)
    ref = decode_attention_reference(q, k, v, q_pos, lengths_a, sliding_window=window)
    assert ref.shape == (b, t, hq, dv)
    assert_close(ref, _numpy_decode_attention(q, k, v, q_pos, lengths, window), _depth(q, k), what="oracle")
    tree_pos, tree_mask = _tree(_random_parents(np.random.default_rng(3), b, t), lengths)
    for new, causal, mask in ((False, False, None), (True, False, None), (True, True, None), (True, False, tree_mask)):
        pos = tree_pos if mask is not None else q_pos
        ref = decode_attention_reference(q, k, v, pos, lengths_a, k_new=kn if new else None, v_new=vn if new else None,
                                         sliding_window=window, sinks=sinks, new_causal=causal, new_mask=mask)
        for impl in IMPLS:
            out = _run(impl, k_tile, window, True, new, jnp.float32, causal)(q, k, v, pos, lengths_a, kn, vn, sinks,
                                                                             mask)
            assert out.shape == (b, t, hq, dv)
            _close(out, ref, q, k, what=f"{impl} {new} {causal}")


def test_kernel_support_needs_both_head_dims_to_fit(monkeypatch):
    """``decode_kernel_supported`` checks the value head dim too: on GPU both powers of two >= 16 (MiMo-V2-Flash's
    192 / 128 fits not, so "auto" takes the loop); on TPU any widths (a key tile is the cache's own [tk, Hkv, D]
    block), the cache whole tiles of 8 slots."""
    from dflash_jax.kernels import tiling

    monkeypatch.setattr(tiling, "gpu_capable", lambda: True)
    for platform, fits, misfits in (("gpu", [(128, 128), (64, 16)], [(192, 128), (128, 96), (128, 8)]),
                                    ("tpu", [(256, 128), (128, 128), (192, 128), (128, 64), (64, 64)], [])):
        monkeypatch.setattr(tiling, "platform", lambda p=platform: p)
        for d, dv in fits:
            assert decode_kernel_supported(head_dim=d, v_head_dim=dv, kv_heads=4, ctx_len=64), (platform, d)
        for d, dv in misfits:
            assert not decode_kernel_supported(head_dim=d, v_head_dim=dv, kv_heads=4, ctx_len=64), \
                (platform, d, dv)
        assert decode_kernel_supported(head_dim=128, kv_heads=4, ctx_len=64)  # v_head_dim None: = D
    assert not decode_kernel_supported(head_dim=128, kv_heads=4, ctx_len=60)  # TPU: 60 slots are no whole tiles


def test_dispatch_equals_the_masked_full_cache_path():
    """``attention.decode_attention`` on a FullKV after a write == the path it replaces (state.update +
    position_mask + attend over the whole cache), with a window and sinks."""
    b, t, hq, hkv, d, s = 3, 16, 4, 2, 16, 80
    q, k, v, _, _, sinks = _inputs(1, b, t, hq, hkv, d, s, jnp.float32)
    state = FullKV(k, v)
    n = jnp.asarray([0, 9, 64], jnp.int32)
    positions = n[:, None] + jnp.arange(t, dtype=jnp.int32)
    k_new, v_new = q[:, :, :hkv], q[:, :, hkv:]
    for window in (None, 6):
        new, keys, values, k_pos, exists = state.update(k_new, v_new, positions)
        mask = attention.position_mask(positions, k_pos, causal=True, sliding_window=window, k_valid=exists)
        old = attention.attend(q, keys, values, mask, sinks=sinks)
        for impl in ("loop", "interpret", "reference"):
            out = attention.decode_attention(q, new.k, new.v, positions, jnp.max(positions, axis=1) + 1,
                                             sliding_window=window, sinks=sinks, impl=impl)
            _close(out, old, q, k, what=f"{impl} {window}")


@pytest.fixture(scope="module")
def pair():
    return random_pair(vocab=96, block_size=8)


def test_verify_forward_equals_masked(pair):
    """A target verify forward (ragged rows, one padded) on a bucket much larger than the rows."""
    target, _ = pair
    b, s, t = 3, 256, 8
    rng = np.random.default_rng(0)
    lens = np.array([0, 5, 40])
    cache = target.new_cache(b, s)
    prompt = jnp.asarray(rng.integers(0, 96, (b, 48)), jnp.int32)
    pos = jnp.asarray(np.where(np.arange(48) < lens[:, None], np.arange(48), -1), jnp.int32)
    _, _, cache = target_lib.forward(target.config, target.params, prompt, pos, cache, attention_impl="reference")
    cache = cache.commit(jnp.asarray(lens, jnp.int32))
    ids = jnp.asarray(rng.integers(0, 96, (b, t)), jnp.int32)
    pos = jnp.asarray(lens[:, None] + np.arange(t), jnp.int32)
    outs = {impl: target_lib.forward(target.config, target.params, ids, pos, cache, (1,), attention_impl=impl)
            for impl in ("reference", "loop", "interpret")}
    depth = forward_depth(target.config, 48 + t)  # a forward over the 48 + 8 positions the rows attend at most
    for impl in ("loop", "interpret"):
        for a, r in zip(jax.tree_util.tree_leaves(outs[impl]), jax.tree_util.tree_leaves(outs["reference"])):
            assert_close(a, r, depth, what=impl)


def test_draft_decode_equals_block_attention(pair):
    """The draft's decode attention (context < anchor, block bidirectional) == its block attention."""
    target, draft = pair
    b, s, bk = 3, 128, 8
    rng = np.random.default_rng(1)
    dcfg = draft.config
    feats = jnp.asarray(rng.standard_normal((b, s, dcfg.num_features * target.config.hidden_size)), jnp.float32)
    k, v = draft_lib.context_kv(dcfg, draft.params, feats, jnp.broadcast_to(jnp.arange(s), (b, s)))
    ids = jnp.asarray(rng.integers(0, 96, (b, bk)), jnp.int32)
    anchors = jnp.asarray([[0], [1], [100]], jnp.int32)
    args = (target.config, target.params, dcfg, draft.params, ids, anchors, k, v)
    ref = draft_lib.draft_hidden(*args, impl="reference")
    depth = forward_depth(dcfg.layers, s + bk)  # the draft's layers over context and block keys
    for impl in ("loop", "interpret"):
        out = draft_lib.draft_hidden(*args, decode_impl=impl)
        assert_close(out, ref, depth, what=impl)


def test_engine_output_is_the_same_with_every_attention(pair):
    """Speculative decoding, ragged rows in a bucket much longer than them: the bounded default ("auto":
    the tiled loop on CPU), the kernel in interpret mode and the dense path all give the same tokens."""
    target, draft = pair
    rng = np.random.default_rng(2)
    prompts = [rng.integers(2, 90, n).tolist() for n in (3, 20, 1)]
    outs = {impl: [r.output_ids for r in S.speculative_generate(target, draft, prompts, max_new_tokens=12,
                                                                 attention_impl=impl, cache_len=512)]
            for impl in ("reference", "auto", "interpret")}
    assert outs["auto"] == outs["reference"] == outs["interpret"]
    with pytest.raises(ValueError, match="attention_impl"):
        S.speculative_generate(target, draft, prompts, max_new_tokens=2, attention_impl="dense")


@pytest.mark.parametrize("platform,backend", [("tpu", "tpu"), ("cuda", "gpu")])
def test_lowers_for_accelerators(platform, backend):
    """Smoke check without hardware: the kernel lowers through Pallas to Mosaic (TPU) / Triton (GPU) IR at
    production shapes (verify of 16 tokens, 32 query / 8 KV heads of 128, bf16), with and without the
    window, sinks and own keys (bidirectional, causal, and a tree's ``new_mask``). The Mosaic and Triton
    compilers themselves only run on the devices."""
    b, t, hq, hkv, d, s = 2, 16, 32, 8, 128, 4096
    q, k, v, kn, vn = (jnp.zeros(sh, jnp.bfloat16) for sh in
                       [(b, t, hq, d), (b, s, hkv, d), (b, s, hkv, d), (b, t, hkv, d), (b, t, hkv, d)])
    q_pos, lengths, sinks = jnp.zeros((b, t), jnp.int32), jnp.zeros((b,), jnp.int32), jnp.zeros((hq,), jnp.float32)
    tree = _tree(_random_parents(np.random.default_rng(0), b, t), np.zeros(b, np.int32))[1]

    def run(q, k, v, kn, vn):
        plain = decode_attention(q, k, v, q_pos, lengths, interpret=False, backend=backend)
        full = decode_attention(q, k, v, q_pos, lengths, kn, vn, sliding_window=128, sinks=sinks, interpret=False,
                                backend=backend)
        causal = decode_attention(q, k, v, q_pos, lengths, kn, vn, sliding_window=128, new_causal=True,
                                  interpret=False, backend=backend)
        masked = decode_attention(q, k, v, q_pos, lengths, kn, vn, sinks=sinks, new_mask=tree, interpret=False,
                                  backend=backend)
        return plain, full, causal, masked

    text = jax.jit(run).trace(q, k, v, kn, vn).lower(lowering_platforms=(platform,)).as_text()
    assert text.count("tpu_custom_call" if platform == "tpu" else "triton") >= 4
