"""``state.PagedKV`` is ``FullKV`` through a block table: every protocol step (write, update, tree_write, compact)
leaves each row's view equal to a ``FullKV``'s, whatever pages (scrambled, shared pool) the rows own; writes past a
row's pages or for a row of no pages change nothing."""
import jax.numpy as jnp
import numpy as np

from dflash_jax.state import LayerStates, FullKV, KVSpec, PagedKV, new_pools, page_bytes

B, PAGE, COLS, K, H = 3, 4, 5, 2, 8
MAX_LEN = PAGE * COLS


def _pair(seed=0, pages=20):
    """A FullKV and a PagedKV of the same rows (rows own scrambled pages of one pool of ``pages``)."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(pages)[:B * COLS].reshape(B, COLS)
    full = FullKV(jnp.zeros((B, MAX_LEN, K, H)), jnp.zeros((B, MAX_LEN, K, H)))
    paged = PagedKV(jnp.zeros((pages, PAGE, K, H)), jnp.zeros((pages, PAGE, K, H)), jnp.asarray(order, jnp.int32),
                    PAGE)
    return full, paged, rng


def _same(full, paged, upto=MAX_LEN):
    for a, b in zip(full.view(), paged.view()):
        np.testing.assert_array_equal(np.asarray(a)[:, :upto], np.asarray(b)[:, :upto])


def _kv(rng, t):
    return (jnp.asarray(rng.normal(size=(B, t, K, H)), jnp.float32),
            jnp.asarray(rng.normal(size=(B, t, K, H)), jnp.float32))


def test_write_update_and_tree_protocol_match_full_kv():
    full, paged, rng = _pair()
    k, v = _kv(rng, 7)
    pos = jnp.asarray([[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, -1, -1, -1, -1], [0, 1, 2, 3, 4, -1, -1]], jnp.int32)
    full, paged = full.write(k, v, pos), paged.write(k, v, pos)
    _same(full, paged)
    k, v = _kv(rng, 4)
    pos = jnp.asarray([7, 3, 5], jnp.int32)[:, None] + jnp.arange(4)
    full, *fo = full.update(k, v, pos)
    paged, *po = paged.update(k, v, pos)
    for a, b in zip(fo, po):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    k, v = _kv(rng, 6)
    start = jnp.asarray([11, 7, 9], jnp.int32)
    full, paged = full.tree_write(k, v, start), paged.tree_write(k, v, start)
    _same(full, paged)
    src = start[:, None] + jnp.asarray([[0, 2, 5, -99], [0, 1, -99, -99], [0, 3, 4, 5]], jnp.int32)
    src = jnp.where(src >= start[:, None], src, -1)
    dst = start[:, None] + jnp.arange(4)
    full, paged = full.compact(src, dst), paged.compact(src, dst)
    _same(full, paged)
    assert paged.commit(jnp.ones((B,), jnp.int32)) is paged


def test_writes_without_a_page_are_dropped():
    """A row whose table ends (sentinel entries >= the pool's pages) or a padding row never writes another's pages."""
    full, paged, rng = _pair(1, pages=16)
    table = np.array(paged.table)
    table[1, 2:] = 16  # row 1 owns two pages only
    table[2, :] = 99  # row 2 owns none (a padding row)
    paged = paged.replace(table=jnp.asarray(table))
    before = np.asarray(paged.k).copy()
    k, v = _kv(rng, MAX_LEN)
    pos = jnp.broadcast_to(jnp.arange(MAX_LEN, dtype=jnp.int32), (B, MAX_LEN))
    paged = paged.write(k, v, pos)
    after = np.asarray(paged.k)
    owned = {int(p): b for b in range(B) for p in table[b] if p < 16}
    for p in range(16):
        if p not in owned:
            np.testing.assert_array_equal(after[p], before[p])  # nobody's page: untouched
        else:
            b, col = owned[p], list(table[owned[p]]).index(p)
            np.testing.assert_array_equal(after[p], np.asarray(k)[b, col * PAGE:(col + 1) * PAGE])


def test_split_and_join_round_trip_and_pool_sizes():
    specs = (KVSpec(2, 8), KVSpec(2, 8, window=4), KVSpec(1, 12, v_head_dim=8))
    cache = LayerStates.create(specs, B, MAX_LEN, jnp.float32, max_block=4, page=PAGE)
    assert [type(s).__name__ for s in cache.layers] == ["PagedKV", "SlidingKV", "PagedKV"]
    pools = new_pools(specs, 10, PAGE, jnp.float32, MAX_LEN, 4)
    assert [p[1].shape for p in pools] == [(10, PAGE, 2, 8), (10, PAGE, 1, 8)]
    assert page_bytes(specs, PAGE, jnp.bfloat16, MAX_LEN, 4) == PAGE * 2 * (2 * 16 + 12 + 8)
    table = jnp.zeros((B, COLS), jnp.int32)
    joined = cache.join_pages(pools, table)
    rows, back = joined.split_pages()
    assert all(a[0] is b[0] for a, b in zip(back, pools))
    assert all(getattr(s, "k", 0) is None for s in rows.layers if isinstance(s, PagedKV))
