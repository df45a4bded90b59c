"""The per-layer decode-state protocol (dflash_jax/state.py): a forward writes every new token, and
``LayerStates.commit(kept)`` keeps exactly each row's first ``kept`` of them, whatever the layer kind."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.state import LayerStates, KVSpec, Recurrent, RecurrentSpec, SlidingKV, ring_slots
from tolerances import assert_close

D = 3  # width of the toy recurrent state
MAX_BLOCK = 4


def add_kept(value, stash, kept):
    """The toy layer's fold: value + the first ``kept`` stashed inputs."""
    first = jnp.arange(stash["x"].shape[1])[None, :, None] < kept[:, None, None]
    return {"s": value["s"] + jnp.sum(jnp.where(first, stash["x"], 0.0), axis=1)}


SPEC = RecurrentSpec((("s", (D,), jnp.float32),), (("x", (D,), jnp.float32),), add_kept)


def running_sum(state: Recurrent, x, positions) -> Recurrent:
    """A toy recurrent layer: value["s"] += x_t for every real token (padding leaves it unchanged); a forward
    of at most max_block tokens stashes its real inputs (in order) for the commit to fold in."""
    valid = positions >= 0
    if x.shape[1] > state.max_block:
        return state.set_value({"s": state.value["s"] + jnp.sum(jnp.where(valid[..., None], x, 0.0), axis=1)})
    order = jnp.argsort(~valid, axis=1, stable=True)
    return state.pend({"x": jnp.take_along_axis(x, order[..., None], axis=1)}, valid, positions)


def test_recurrent_commit_keeps_exactly_the_accepted_prefix():
    rng = np.random.RandomState(0)
    b = 4
    cache = LayerStates.create([SPEC], b, 64, jnp.float32, MAX_BLOCK)
    # a prefill longer than max_block with ragged lengths (padding at position -1), committed whole
    lens = np.array([5, 2, 7, 1])
    prompt = rng.randn(b, 7, D).astype(np.float32)
    pos = np.where(np.arange(7) < lens[:, None], np.arange(7), -1)
    cache = cache.replace(layers=(running_sum(cache.layers[0], prompt, pos),)).commit(jnp.asarray(lens))
    prompt64 = prompt.astype(np.float64)
    want = np.stack([prompt64[r, :lens[r]].sum(0) for r in range(b)])  # exact sums
    # a float32 running sum of n tokens against the exact one: n roundings of the sum's scale
    assert_close(cache.layers[0].value["s"], want, int(lens.max()), what="prefill")
    np.testing.assert_array_equal(cache.lengths, lens)

    # verify-style forwards of MAX_BLOCK tokens, each row keeping a different prefix (0 = a finished row)
    for kept in ([1, 4, 0, 2], [3, 0, 4, 1], [2, 2, 1, 4]):
        block = rng.randn(b, MAX_BLOCK, D).astype(np.float32)
        pos = np.asarray(cache.lengths)[:, None] + np.arange(MAX_BLOCK)
        state = running_sum(cache.layers[0], block, pos)
        block64 = block.astype(np.float64)
        # before commit: nothing of it
        np.testing.assert_array_equal(state.value["s"], cache.layers[0].value["s"])
        cache = cache.replace(layers=(state,)).commit(jnp.asarray(kept))
        want = want + np.stack([block64[r, :k].sum(0) for r, k in enumerate(kept)])
        assert_close(cache.layers[0].value["s"], want, lens.max() + MAX_BLOCK, what=f"{kept} committed")
        lens = lens + np.asarray(kept)
        np.testing.assert_array_equal(cache.lengths, lens)


def test_recurrent_commit_is_traceable_in_a_while_loop():
    """Static shapes: the commit runs inside lax.while_loop with runtime kept counts."""
    cache = LayerStates.create([SPEC], 2, 64, jnp.float32, MAX_BLOCK)
    x = jnp.ones((2, MAX_BLOCK, D))

    def body(carry):
        i, c = carry
        pos = c.lengths[:, None] + jnp.arange(MAX_BLOCK)
        c = c.replace(layers=(running_sum(c.layers[0], x, pos),))
        return i + 1, c.commit(jnp.array([1, 3]))

    _, out = jax.jit(lambda c: jax.lax.while_loop(lambda s: s[0] < 5, body, (0, c)))(cache)
    np.testing.assert_allclose(out.layers[0].value["s"], [[5.0] * D, [15.0] * D])
    np.testing.assert_array_equal(out.lengths, [5, 15])


@pytest.mark.parametrize("window,max_block", [(4, 3), (2, 1)])
def test_sliding_ring_rollback_keeps_the_window(window, max_block):
    """Rejected tokens written into the ring never replace a key the next forward needs: after any
    sequence of forwards (<= max_block tokens) and commits, the visible keys are exactly the committed
    positions inside the window, with their values."""
    rng = np.random.RandomState(1)
    spec = KVSpec(kv_heads=1, head_dim=1, window=window)
    cache = LayerStates.create([spec], 1, 64, jnp.float32, max_block)
    assert isinstance(cache.layers[0], SlidingKV) and cache.layers[0].k.shape[1] == window + max_block
    committed = {}  # position -> value of the token kept there
    for _ in range(12):
        t = rng.randint(1, max_block + 1)
        n = int(cache.lengths[0])
        pos = jnp.asarray(n + np.arange(t))[None]
        vals = rng.randn(1, t, 1, 1).astype(np.float32)
        state, keys, _, key_pos, exists = cache.layers[0].update(vals, vals, pos)
        seen = {int(p): float(k) for p, k, e in zip(key_pos[0], keys[0, :, 0, 0], exists[0]) if e}
        for p in range(max(0, n - window + 1), n):  # what the first new query's window needs
            assert seen[p] == committed[p]  # a copy of the value written: exact
        assert all(p < n + t for p in seen) and all(p in committed or p >= n for p in seen)
        kept = rng.randint(1, t + 1)
        committed.update({n + i: float(vals[0, i, 0, 0]) for i in range(kept)})
        cache = cache.replace(layers=(state,)).commit(jnp.asarray([kept]))


def _assert_distinct_slots(slots, r):
    """No row of one write targets a ring slot twice (``r``: dropped)."""
    for row in np.asarray(slots):
        kept = row[row < r]
        assert len(set(kept.tolist())) == len(kept), row


def test_ring_slots_keep_the_newest_r_positions_each_once():
    """Random writes (shuffled positions, gaps, rows longer and shorter than the ring): the kept slots are
    distinct and are exactly the row's kept positions within the newest R (last - R < p <= last), at p % R."""
    rng = np.random.RandomState(2)
    r, t = 5, 13
    for _ in range(20):
        pos = np.stack([rng.permutation(t) + rng.randint(0, 30) for _ in range(4)]).astype(np.int32)
        keep = rng.rand(4, t) < rng.choice([0.3, 1.0], (4, 1))
        slots = np.asarray(ring_slots(jnp.asarray(pos), jnp.asarray(keep), r))
        _assert_distinct_slots(slots, r)
        for p, k, sl in zip(pos, keep, slots):
            last = p[k].max(initial=-1)
            assert sorted(p[sl < r].tolist()) == sorted(p[k & (p > last - r)].tolist())
            np.testing.assert_array_equal(sl[sl < r], p[sl < r] % r)


@pytest.mark.parametrize("how", ["update", "tree_write", "compact"])
def test_ring_write_longer_than_the_ring_holds_the_newest_positions_once(how, monkeypatch):
    """A write of more positions than the ring (``update``, its positions shuffled; ``tree_write``; ``compact``,
    reading a full ring) goes through ``ring_slots`` once, targets no slot twice, and leaves the ring holding
    exactly the write's newest R positions once each, with their values."""
    import dflash_jax.state as state_lib

    calls = []
    real = state_lib.ring_slots
    monkeypatch.setattr(state_lib, "ring_slots", lambda *a: calls.append(real(*a)) or calls[-1])
    ring = KVSpec(kv_heads=1, head_dim=1, window=3).init(2, 64, jnp.float32, max_block=2)
    r, t, n = ring.k.shape[1], 12, np.array([0, 7], np.int32)
    assert t > r
    value = lambda p: jnp.asarray(p, jnp.float32)[..., None, None] * 10.0 + 1.0  # noqa: E731
    pos = n[:, None] + np.arange(t, dtype=np.int32)
    src = np.broadcast_to(20 + np.arange(t, dtype=np.int32) % r, (2, t))  # compact: reads of a full ring
    if how == "update":
        pos = np.stack([np.random.RandomState(3).permutation(row) for row in pos])
        ring = ring.update(value(pos), value(pos), jnp.asarray(pos))[0]
    elif how == "tree_write":
        ring = ring.tree_write(value(pos), value(pos), jnp.asarray(n))
    else:
        held = np.broadcast_to(20 + np.arange(r, dtype=np.int32), (2, r))
        ring = ring.tree_write(value(held), value(held), jnp.full(2, 20, jnp.int32))
        calls.clear()
        ring = ring.compact(jnp.asarray(src), jnp.asarray(pos))
    assert len(calls) == 1
    _assert_distinct_slots(calls[0], r)
    for b in range(2):
        held, keys = np.asarray(ring.pos[b]), np.asarray(ring.k[b, :, 0, 0])
        assert sorted(held.tolist()) == sorted(pos[b].tolist())[-r:]
        want = dict(zip(pos[b].tolist(), np.asarray(value(src if how == "compact" else pos))[b, :, 0, 0]))
        for slot, p in enumerate(held.tolist()):
            assert p % r == slot and keys[slot] == want[p]


def test_value_head_dim_of_its_own_in_full_and_sliding_states():
    """``KVSpec.v_head_dim``: FullKV and the SlidingKV ring hold values of their own width; a ragged verify-style
    write then dense attention over the ring's [ring | new] keys equals decode attention over the full cache
    (window and rollback as in the engine), both [.., Dv]."""
    from dflash_jax.attention import attend, decode_attention, position_mask

    b, hkv, d, dv, window, max_block, t = 2, 2, 8, 4, 5, 4, 4
    full, ring = (LayerStates.create([KVSpec(hkv, d, w, v_head_dim=dv)], b, 32, jnp.float32, max_block).layers[0]
                  for w in (None, window))
    assert isinstance(ring, SlidingKV) and ring.k.shape[-1] == d and ring.v.shape == (b, window + max_block, hkv, dv)
    assert full.k.shape == (b, 32, hkv, d) and full.v.shape == (b, 32, hkv, dv)
    assert KVSpec(hkv, d).init(b, 32, jnp.float32, max_block).v.shape[-1] == d  # default: the key width
    rng = np.random.RandomState(4)
    n = np.array([0, 0])  # rows then ragged by their kept counts
    for step, kept in enumerate(([4, 2], [1, 4], [3, 3], [2, 1])):
        pos = jnp.asarray(n[:, None] + np.arange(t), jnp.int32)
        q, k = (jnp.asarray(rng.randn(b, t, 2 * hkv if i == 0 else hkv, d), jnp.float32) for i in range(2))
        v = jnp.asarray(rng.randn(b, t, hkv, dv), jnp.float32)
        ring, keys, values, key_pos, exists = ring.update(k, v, pos)
        mask = position_mask(pos, key_pos, causal=True, sliding_window=window, k_valid=exists)
        full = full.write(k, v, pos)
        want = decode_attention(q, full.k, full.v, pos, jnp.max(pos, axis=1) + 1, sliding_window=window,
                                impl="reference")
        got = attend(q, keys, values, mask)
        assert got.shape == (b, t, 2 * hkv, dv)
        # dense attention over the ring against decode attention over the full cache: a D-wide score reduction,
        # the softmax and p @ v over its 32 slots, in another order
        assert_close(got, want, d + full.k.shape[1], what=str(step))
        n = n + np.asarray(kept)
