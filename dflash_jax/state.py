"""Per-layer decode state and the one rollback protocol, as static-shaped pytrees.

Every layer of a model carries one state object between forwards; ``LayerStates`` holds them plus each
row's committed length. A forward writes (a recurrent layer: stashes) ALL its new tokens in every layer's
state; the engine then calls ``LayerStates.commit(kept)`` with the number of those tokens each row keeps
(accepted drafts + bonus; 0 for a finished row), and every state rolls back in its own way:

* ``FullKV`` (full attention): slot == position. Nothing to undo: slots past the committed length are
  masked by position and overwritten before any query can see them.
* ``SlidingKV`` (sliding-window attention): a ring of ``window + max_block`` slots that remember their
  positions. Rejected slots hold positions >= the committed length, which the next forward ignores;
  the ring is large enough that they never overwrite a key still inside the window.
* ``Recurrent`` (linear attention, conv windows): a forward of at most ``max_block`` tokens stashes what each
  token would add (for Gated DeltaNet: its key, corrected value, log decay and conv input) instead of
  writing the state; ``commit`` folds the kept tokens into the committed state (no per-token state copies).
* ``SharedKV`` (a layer reading an earlier layer's keys / values): nothing to keep or undo.
* ``PagedKV`` (full attention, continuous batching): ``FullKV`` with an indirection. Keys / values live in pages
  of one pool shared by every row; a row's block table maps its slot s to page ``table[s // page]``, offset
  ``s % page``. Rollback is ``FullKV``'s (nothing to undo); a table entry >= the pool's page count is no page
  (a write there is dropped), so a row without room, or a padding row, never writes into another row's pages.
  Sliding-window layers keep a per-row ``SlidingKV`` ring beside it (window + block slots: small and fixed, so
  paging it would save little and complicate the rollback), and recurrent states stay per row.

* ``Stacked`` (a group of scanned layers, ``dflash_jax.layer_scan``): their states as one, a layer axis on every
  leaf; each layer rolls back its own way (vmapped), and inside the scan reads and writes the stack in place.

Tree verification (``speculative``, ``tree_budget``) writes its N + 1 tree tokens as positions n..n+N (slot
order, not their repeating tree positions: ``tree_write``), then ``LayerStates.compact`` moves the accepted
path to positions n..n+a before the commit (``Recurrent``: its stash slots), so the commit is the chain's.

A token at a position < 0 is padding: never written, never attended to, never advancing a recurrence.

Each state class declares the logical axes of its leaves (``LOGICAL_AXES``: field -> names of the leading
dims of every array in it, the rest unsplit); ``sharding.constrain_cache`` maps them through the same
rules as the parameters (``sharding.rules``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import flax.struct
import jax
import jax.numpy as jnp

_FAR = jnp.iinfo(jnp.int32).max
NO_PAGE = 2 ** 31 - 1  # a block table entry holding no page (any entry >= the pool's pages is none)
KV_AXES = ("cache_batch", "cache_len", "cache_kv_heads", "cache_head_dim")  # [B, S, K, H]
PAGE_AXES = ("cache_pages", "cache_len", "cache_kv_heads", "cache_head_dim")  # [P, page, K, H]


def put_rows(cache, slots, values):
    """``cache[b, slots[b, t]] = values[b, t]`` for every row b (slots out of range are dropped), as one scatter
    per row (vmapped): on a mesh it partitions over the rows without gathering the batch's updates."""
    return jax.vmap(lambda c, s, u: c.at[s].set(u.astype(c.dtype), mode="drop"))(cache, slots, values)


def take_rows(cache, slots):
    """``cache[b, slots[b, t]]`` for every row b (in range), per row like ``put_rows``."""
    return jax.vmap(lambda c, s: c[s])(cache, slots)


def two_at_least(index, dropped, *values):
    """A write of one token (``index`` [1, 1], each of ``values`` [1, 1, ...]) as two, the second at the out-of-range
    index ``dropped`` -> (index, *values): XLA makes a one-update scatter a dynamic-update-slice, and in a scan whose
    layers read the stacked cache through a reshape (``pages``) it then copies the whole stack at every layer (plain
    decoding of one row 5x slower on CPU)."""
    if index.size != 1:
        return (index, *values)
    return (jnp.concatenate([index, jnp.full_like(index, dropped)], axis=1),
            *(jnp.concatenate([a, jnp.zeros_like(a)], axis=1) for a in values))


def ring_slots(positions, keep, r: int):
    """The slot of each position one write stores in a ring of R = ``r`` slots: ``position % r`` for the kept
    (``keep`` [B, T]) positions among the newest R of their row (last - R < position <= last), ``r`` (out of
    range: dropped by the scatter's ``mode="drop"``) for the rest. Positions within a row of one write are
    distinct, so no two kept ones share a slot: a write longer than the ring keeps its newest R positions,
    each once (duplicate scatter indices have no guaranteed order on TPU / GPU)."""
    last = jnp.max(jnp.where(keep, positions, -1), axis=1, keepdims=True)
    return jnp.where(keep & (positions > last - r), positions % r, r)


@flax.struct.dataclass
class FullKV:
    """Keys [B, S, K, H] / values [B, S, K, Hv] of every position so far; slot s holds position s.

    ``layer`` (a traced index; None: an ordinary cache): layer ``layer`` of a scanned group's stack (``Stacked``),
    k / v then every layer's, [B, n, S, K, H]: written in place at that layer, read as pages (``pages``)."""

    LOGICAL_AXES: ClassVar[dict] = {"k": KV_AXES, "v": KV_AXES}
    k: jax.Array
    v: jax.Array
    layer: Any = None

    @property
    def max_len(self) -> int:
        return self.k.shape[-3]

    def _put(self, cache, slots, values):
        """``put_rows`` into this layer's slots."""
        if self.layer is None:
            return put_rows(cache, slots, values)
        slots, values = two_at_least(slots, self.max_len, values)
        return jax.vmap(lambda c, s, u: c.at[self.layer, s].set(u.astype(c.dtype), mode="drop"))(cache, slots, values)

    def _take(self, cache, slots):
        """``take_rows`` of this layer's slots."""
        if self.layer is None:
            return take_rows(cache, slots)
        return jax.vmap(lambda c, s: c[self.layer, s])(cache, slots)

    def write(self, k_new, v_new, positions) -> "FullKV":
        """Store k_new / v_new [B, T, K, H] at ``positions`` [B, T] (padding and out-of-range are dropped)."""
        slots = jnp.where(positions >= 0, positions, self.max_len)
        return self.replace(k=self._put(self.k, slots, k_new), v=self._put(self.v, slots, v_new))

    def view(self):
        """Keys [B, S, K, H] and values [B, S, K, Hv] by position (slot s = position s)."""
        if self.layer is None:
            return self.k, self.v
        return tuple(jax.lax.dynamic_index_in_dim(a, self.layer, 1, keepdims=False) for a in (self.k, self.v))

    def pages(self):
        """A layer of a stack as a paged cache, read in place: (key pool, value pool, block table) of the whole
        stack's rows as pages of ``view_page`` slots, the table this layer's (``paged_decode_attention``)."""
        b, n, slots = self.k.shape[:3]
        page = view_page(slots)
        cols = slots // page
        flat = lambda a: a.reshape((b * n * cols, page) + a.shape[3:])  # noqa: E731 (free: rows, layers, slots)
        first = (jnp.arange(b, dtype=jnp.int32) * n + self.layer)[:, None] * cols
        return flat(self.k), flat(self.v), first + jnp.arange(cols, dtype=jnp.int32)[None]

    def update(self, k_new, v_new, positions):
        """-> (new state, keys, values [B, S', K, H], key positions [B, S'], key exists [B, S'])."""
        new = self.write(k_new, v_new, positions)
        slot_pos = jnp.broadcast_to(jnp.arange(self.max_len, dtype=jnp.int32), positions.shape[:1] + (self.max_len,))
        return new, *new.view(), slot_pos, jnp.ones(slot_pos.shape, bool)

    def commit(self, kept) -> "FullKV":
        return self

    def tree_write(self, k_new, v_new, start) -> "FullKV":
        """A tree verify's T tokens at slots start..start+T-1 (slot order: tree positions repeat)."""
        return self.write(k_new, v_new, start[:, None] + jnp.arange(k_new.shape[1], dtype=jnp.int32))

    def compact(self, src, dst) -> "FullKV":
        """Copy positions ``src`` [B, L] to positions ``dst`` [B, L] (src < 0: nothing copied), all read before
        any write (tree verification: the accepted path's K/V to contiguous positions)."""
        keep = src >= 0
        dst = jnp.where(keep, dst, self.max_len)
        k, v = self._take(self.k, jnp.maximum(src, 0)), self._take(self.v, jnp.maximum(src, 0))
        return self.replace(k=self._put(self.k, dst, k), v=self._put(self.v, dst, v))


@flax.struct.dataclass
class SlidingKV:
    """A ring of R slots [B, R, K, H] (values [B, R, K, Hv]) holding the latest keys / values and their positions
    [B, R] (-1: empty).

    A forward attends to [ring before it | its own new tokens]; then the newest R new tokens of each row
    are written at slot position % R. Fully committed forwards may be any length; a forward that may be
    rolled back must have at most R - window tokens.
    """

    LOGICAL_AXES: ClassVar[dict] = {"k": KV_AXES, "v": KV_AXES, "pos": ("cache_batch", "cache_len")}
    k: jax.Array
    v: jax.Array
    pos: jax.Array
    window: int = flax.struct.field(pytree_node=False, default=0)  # the layer's sliding window (R - window: the
    # longest forward that may be rolled back)

    def update(self, k_new, v_new, positions):
        """-> (new state, keys, values, key positions, key exists), as ``FullKV.update``. A forward of at most
        R - window tokens (decode, verify) writes first and attends to the ring it wrote: no key its queries
        need is evicted, and the ring is updated in place (reading the old ring beside the write made XLA copy
        it every step). A longer forward (a prefill) attends to [ring before it | its own new tokens]."""
        valid = positions >= 0
        if k_new.shape[1] <= self.k.shape[1] - self.window:
            new = self._put(k_new, v_new, positions, valid)
            last = jnp.max(jnp.where(valid, positions, -1), axis=1, keepdims=True)
            # slots past this write's last position hold rolled-back tokens of an earlier forward
            return new, new.k, new.v, new.pos, (new.pos >= 0) & (new.pos <= last)
        start = jnp.min(jnp.where(valid, positions, _FAR), axis=1, keepdims=True)
        old = (self.pos >= 0) & (self.pos < start)  # rolled-back slots hold positions >= start
        keys = jnp.concatenate([self.k, k_new.astype(self.k.dtype)], axis=1)
        values = jnp.concatenate([self.v, v_new.astype(self.v.dtype)], axis=1)
        key_pos = jnp.concatenate([self.pos, positions], axis=1)
        exists = jnp.concatenate([old, valid], axis=1)
        return self._put(k_new, v_new, positions, valid), keys, values, key_pos, exists

    def commit(self, kept) -> "SlidingKV":
        return self

    def tree_write(self, k_new, v_new, start) -> "SlidingKV":
        """A tree verify's T tokens as positions start..start+T-1 (slot order: tree positions repeat), at slots
        position % R; positions past the accepted path stay invisible (>= the next start) until overwritten
        by the next tree verify. Needs R >= window + T - 1 (``max_block`` >= T)."""
        at = start[:, None] + jnp.arange(k_new.shape[1], dtype=jnp.int32)
        return self._put(k_new, v_new, at, jnp.ones(at.shape, bool))

    def compact(self, src, dst) -> "SlidingKV":
        """``FullKV.compact`` on the ring (positions -> slots position % R)."""
        r, keep = self.k.shape[1], src >= 0
        s = jnp.maximum(src, 0) % r
        return self._put(take_rows(self.k, s), take_rows(self.v, s), dst, keep)

    def _put(self, k, v, positions, keep) -> "SlidingKV":
        """Every write into the ring: the kept positions' K/V at ``ring_slots`` (the newest R of the write)."""
        slots = ring_slots(positions, keep, self.k.shape[1])
        return self.replace(k=put_rows(self.k, slots, k), v=put_rows(self.v, slots, v),
                            pos=put_rows(self.pos, slots, positions))


@flax.struct.dataclass
class PagedKV:
    """Keys [P, page, K, H] / values [P, page, K, Hv]: a pool of P pages shared by every row, and ``table`` [B, n]
    (rows first): the page holding row b's slots j*page..(j+1)*page-1 (>= P: none). Slot s holds position s.

    The engine stores the pools apart from the rows (``split_pages`` / ``join_pages``): a state's rows can then be
    gathered, scattered and padded like any rows-first state while the pools stay in place. ``layer`` (a traced
    index; None: an ordinary pool): layer ``layer`` of a scanned group's stacked pools [n, P, page, ...]
    (``Stacked``), written in place there and read through a layer-offset table (``pages``)."""

    LOGICAL_AXES: ClassVar[dict] = {"k": PAGE_AXES, "v": PAGE_AXES, "table": ("cache_batch", "cache_len")}
    k: Any
    v: Any
    table: Any
    page: int = flax.struct.field(pytree_node=False, default=16)
    layer: Any = None

    @property
    def max_len(self) -> int:
        return self.table.shape[1] * self.page

    @property
    def dtype(self):
        return self.k.dtype

    def _where(self, positions):
        """(page, offset) [B, T] of ``positions`` [B, T]; page P (a write there is dropped) for padding, positions
        past the table and slots of no page."""
        pages, size = self.k.shape[-4], self.page
        col = jnp.clip(positions // size, 0, self.table.shape[1] - 1)
        page = jnp.take_along_axis(self.table, col, axis=1)
        ok = (positions >= 0) & (positions < self.max_len) & (page >= 0) & (page < pages)
        return jnp.where(ok, page, pages), positions % size

    def _at(self, page, offset) -> tuple:
        """The pool index of (page, offset) (a layer of a stack: in that layer's pool)."""
        return (page, offset) if self.layer is None else (self.layer, page, offset)

    def write(self, k_new, v_new, positions) -> "PagedKV":
        """Store k_new / v_new [B, T, K, H] at ``positions`` [B, T] in the rows' pages (padding, positions past
        the table and slots of no page are dropped). Rows own distinct pages, so no two writes collide. Indexed
        in the pool's own layout (a flattened pool made XLA copy it on every step)."""
        if self.layer is not None:
            positions, k_new, v_new = two_at_least(positions, -1, k_new, v_new)
        at = self._at(*self._where(positions))
        put = lambda pool, new: pool.at[at].set(new.astype(pool.dtype), mode="drop")  # noqa: E731
        return self.replace(k=put(self.k, k_new), v=put(self.v, v_new))

    def pages(self):
        """(key pool, value pool, block table) as the paged attention reads them in place: a layer of a stack as
        one pool of every layer's pages (a free reshape) and its table offset to that layer's."""
        if self.layer is None:
            return self.k, self.v, self.table
        n, pages = self.k.shape[:2]
        flat = lambda a: a.reshape((n * pages,) + a.shape[2:])  # noqa: E731
        return flat(self.k), flat(self.v), _layer_table(self.table, pages, self.layer)

    def view(self):
        """``FullKV.view``: every row's pages in table order -> keys [B, n*page, K, H], values [B, n*page, K, Hv]
        (slots of no page read page 0: past the row's length, masked). The reference path's gather."""
        k, v, table = self.pages()
        at = jnp.clip(table, 0, k.shape[0] - 1)
        view = lambda pool: pool[at].reshape(at.shape[:1] + (-1,) + pool.shape[2:])  # noqa: E731
        return view(k), view(v)

    # FullKV's protocol through ``write`` / ``view``: nothing to undo, a tree's tokens in slot order
    update, commit, tree_write = FullKV.update, FullKV.commit, FullKV.tree_write

    def compact(self, src, dst) -> "PagedKV":
        """``FullKV.compact`` in pages: positions ``src`` [B, L] copied to ``dst`` (src < 0: nothing), all read
        before any write."""
        keep = src >= 0
        page, offset = self._where(jnp.maximum(src, 0))
        at = self._at(jnp.minimum(page, self.k.shape[-4] - 1), offset)  # a source of no page is never kept
        return self.write(self.k[at], self.v[at], jnp.where(keep, dst, -1))


@flax.struct.dataclass
class Recurrent:
    """A recurrent layer's committed state ``value`` (a pytree of [B, ...] arrays) and what its last forward of at
    most ``max_block`` tokens stashed per token (``stash``: leaves [B, max_block, ...], the forward's real tokens in
    order, or a tree's slots in slot order) instead of writing ``value``: ``fold(value, stash, kept)`` (the layer's,
    static) is the state after the first ``kept`` stashed tokens. ``count`` [B]: tokens stashed (0: none pending; a
    longer forward, a prefill, writes ``value`` itself and is committed whole); ``start`` [B]: the stashed
    forward's first position (``compact`` maps positions to stash slots)."""

    LOGICAL_AXES: ClassVar[dict] = {"value": ("cache_batch", "cache_state"),
                                    "stash": ("cache_batch", "cache_snapshot", "cache_state"),
                                    "count": ("cache_batch",), "start": ("cache_batch",)}
    value: Any
    stash: Any
    count: jax.Array
    start: jax.Array
    fold: Any = flax.struct.field(pytree_node=False)

    @property
    def max_block(self) -> int:
        return jax.tree_util.tree_leaves(self.stash)[0].shape[1]

    def pend(self, stash, valid, positions) -> "Recurrent":
        """Record a forward of T <= max_block tokens (``stash``: leaves [B, T, ...], the real tokens first, in order;
        ``valid`` [B, T]; ``positions`` [B, T]) without changing ``value``; ``commit`` folds the kept ones in."""
        t = valid.shape[1]
        stash = jax.tree_util.tree_map(lambda s, a: s.at[:, :t].set(a.astype(s.dtype)), self.stash, stash)
        start = jnp.min(jnp.where(valid, positions, _FAR), axis=1).astype(jnp.int32)
        return self.replace(stash=stash, count=jnp.sum(valid, axis=1).astype(jnp.int32), start=start)

    def set_value(self, value) -> "Recurrent":
        """Record a forward that wrote ``value`` itself (longer than max_block: committed whole)."""
        return self.replace(value=value, count=jnp.zeros_like(self.count))

    def commit(self, kept) -> "Recurrent":
        kept = jnp.minimum(kept, self.count)
        folded = self.fold(self.value, self.stash, kept)
        fold = kept > 0

        def pick(new, old):
            return jnp.where(fold.reshape((-1,) + (1,) * (old.ndim - 1)), new.astype(old.dtype), old)

        return self.replace(value=jax.tree_util.tree_map(pick, folded, self.value), count=jnp.zeros_like(self.count))

    def compact(self, src, dst) -> "Recurrent":
        """``FullKV.compact`` on the stash (position p -> stash slot p - start): the accepted path of a tree
        verify becomes the stash's first tokens, in order, so ``commit`` folds in exactly that path."""
        keep = src >= 0
        m = self.max_block
        src_slot = jnp.clip(src - self.start[:, None], 0, m - 1)
        dst_slot = jnp.where(keep, dst - self.start[:, None], m)
        return self.replace(stash=jax.tree_util.tree_map(
            lambda s: put_rows(s, dst_slot, take_rows(s, src_slot)), self.stash))


@flax.struct.dataclass
class SharedKV:
    """A layer that attends to an earlier layer's keys / values (Gemma 4's kv-shared layers): no state of its
    own; every protocol step leaves it as it is."""

    LOGICAL_AXES: ClassVar[dict] = {}

    def commit(self, kept) -> SharedKV:
        return self

    def tree_write(self, k_new, v_new, start) -> SharedKV:
        return self

    def compact(self, src, dst) -> SharedKV:
        return self


def _layer_table(table, pages: int, layer):
    """A block table of pool pages ``pages`` for layer ``layer`` of a stacked pool flattened to [n * pages, ...]:
    every page offset by layer * pages, no-page entries (out of range) kept out of range."""
    return jnp.where((table >= 0) & (table < pages), table + layer * pages, NO_PAGE).astype(jnp.int32)


def view_page(slots: int) -> int:
    """The page a stacked ``FullKV``'s rows are read as (``FullKV.pages``): the largest power of two <= 128 dividing
    its slots."""
    return max(p for p in (128, 64, 32, 16, 8, 4, 2, 1) if slots % p == 0)


@flax.struct.dataclass
class Stacked:
    """The states of n layers of one kind run as one scan (``dflash_jax.layer_scan``): ``inner`` is one layer's
    state class with a layer axis on every leaf, second (rows stay first: the engine gathers and scatters rows of
    every leaf), except a paged group's pools, layer-first [n, P, ...] (kept apart from the rows), and its
    ``table``, one for every layer. ``layer(j)`` is layer j's state as its layer reads it, ``put(j, state)`` writes
    it back; full-attention keys / values are never sliced (a slice of a cache in a scan is a copy of it): written
    in place at their layer, read as pages through a layer-offset table."""

    inner: Any

    def layer(self, j):
        """Layer j's state (j: a traced index): full attention's the stack itself with ``layer`` j (written there
        in place, read as pages), a slice of the stack otherwise (a ring, a recurrent state: small)."""
        s = self.inner
        if isinstance(s, (FullKV, PagedKV)):
            return s.replace(layer=j)
        return jax.tree_util.tree_map(lambda a: jax.lax.dynamic_index_in_dim(a, j, 1, keepdims=False), s)

    def put(self, j, state) -> "Stacked":
        """``state`` (what layer j's forward returned for ``layer(j)``) written back as layer j's."""
        if isinstance(self.inner, (FullKV, PagedKV)):
            return self.replace(inner=state.replace(layer=None))
        return self.replace(inner=jax.tree_util.tree_map(
            lambda a, x: jax.lax.dynamic_update_index_in_dim(a, x.astype(a.dtype), j, 1), self.inner, state))

    def _map(self, fn) -> "Stacked":
        """``fn`` (one layer's state -> its new state) applied to every layer of the stack (vmapped)."""
        if not jax.tree_util.tree_leaves(self.inner):  # a paged group's rows alone (``split_pages``): nothing to do
            return self
        if isinstance(self.inner, PagedKV):
            axes = PagedKV(0, 0, None, self.inner.page)  # pools layer-first, one table for every layer
        else:
            axes = jax.tree_util.tree_map(lambda _: 1, self.inner)
        return self.replace(inner=jax.vmap(fn, in_axes=(axes,), out_axes=axes)(self.inner))

    def commit(self, kept) -> "Stacked":
        return self._map(lambda s: s.commit(kept))

    def compact(self, src, dst) -> "Stacked":
        return self._map(lambda s: s.compact(src, dst))


@dataclasses.dataclass(frozen=True)
class StackedSpec:
    """``count`` layers of one state ``spec`` (a position of a scanned group's period): their state is a ``Stacked``."""

    spec: Any
    count: int

    def init(self, batch: int, max_len: int, dtype, max_block: int, page: int = 0):
        one = self.spec.init(batch, max_len, dtype, max_block, page)
        return Stacked(jax.tree_util.tree_map(
            lambda a: jnp.broadcast_to(a[:, None], (a.shape[0], self.count) + a.shape[1:]), one))

    def paged(self, max_len: int, max_block: int, page: int) -> bool:
        return isinstance(self.spec, KVSpec) and self.spec.paged(max_len, max_block, page)

    def pool(self, pages: int, page: int, dtype):
        """Empty key / value pools [count, pages, ...]: every layer's pool, stacked."""
        return tuple(jnp.broadcast_to(a, (self.count,) + a.shape) for a in self.spec.pool(pages, page, dtype))

    def page_bytes(self, page: int, itemsize: int) -> int:
        return self.count * self.spec.page_bytes(page, itemsize)


@dataclasses.dataclass(frozen=True)
class SharedKVSpec:
    """A kv-shared layer's state: none (``SharedKV``)."""

    def init(self, batch: int, max_len: int, dtype, max_block: int, page: int = 0):
        return SharedKV()


@dataclasses.dataclass(frozen=True)
class KVSpec:
    """An attention layer's state: full, or sliding ``window`` (a ring when it saves memory); keys of
    ``head_dim``, values of ``v_head_dim`` (None: the same; MiMo-V2-Flash's differ)."""

    kv_heads: int
    head_dim: int
    window: int | None = None
    v_head_dim: int | None = None

    def init(self, batch: int, max_len: int, dtype, max_block: int, page: int = 0):
        """The empty state; ``page`` > 0: a full-attention layer is a ``PagedKV`` whose pools and table the
        engine joins in (``LayerStates.join_pages``)."""
        if self.paged(max_len, max_block, page):
            return PagedKV(None, None, None, page)
        slots = self._slots(max_len, max_block)
        k = jnp.zeros((batch, slots, self.kv_heads, self.head_dim), dtype)
        v = jnp.zeros((batch, slots, self.kv_heads, self.v_head_dim or self.head_dim), dtype)
        if slots == max_len:
            return FullKV(k, v)
        return SlidingKV(k, v, jnp.full((batch, slots), -1, jnp.int32), self.window)

    def _slots(self, max_len: int, max_block: int) -> int:
        """Slots per row: the max length, or a sliding window's ring (window + block) where that is shorter."""
        return max_len if self.window is None else min(self.window + max_block, max_len)

    def paged(self, max_len: int, max_block: int, page: int) -> bool:
        """Whether a paged cache pages this layer: every full-attention layer (a ring holds the sliding ones)."""
        return page > 0 and self._slots(max_len, max_block) == max_len

    def pool(self, pages: int, page: int, dtype):
        """Empty key / value pools of ``pages`` pages."""
        return (jnp.zeros((pages, page, self.kv_heads, self.head_dim), dtype),
                jnp.zeros((pages, page, self.kv_heads, self.v_head_dim or self.head_dim), dtype))

    def page_bytes(self, page: int, itemsize: int) -> int:
        """Bytes one page of this layer holds (keys and values)."""
        return page * self.kv_heads * (self.head_dim + (self.v_head_dim or self.head_dim)) * itemsize


@dataclasses.dataclass(frozen=True)
class RecurrentSpec:
    """A recurrent layer's state: ``shapes`` maps each leaf name of its value to its per-row shape (and dtype, or
    None for the cache dtype); ``stash`` the same for what a forward keeps per token; ``fold`` (value, stash, kept)
    -> the value after the first ``kept`` stashed tokens (``Recurrent``)."""

    shapes: tuple[tuple[str, tuple[int, ...], Any], ...]
    stash: tuple[tuple[str, tuple[int, ...], Any], ...]
    fold: Any

    def init(self, batch: int, max_len: int, dtype, max_block: int, page: int = 0):
        value = {n: jnp.zeros((batch,) + s, d or dtype) for n, s, d in self.shapes}
        stash = {n: jnp.zeros((batch, max_block) + s, d or dtype) for n, s, d in self.stash}
        zeros = jnp.zeros((batch,), jnp.int32)
        return Recurrent(value, stash, zeros, zeros, self.fold)


@flax.struct.dataclass
class LayerStates:
    """One state per layer plus ``lengths`` [B], each row's committed tokens."""

    LOGICAL_AXES: ClassVar[dict] = {"lengths": ("cache_batch",)}  # ``layers``: each state's own
    layers: tuple
    lengths: jax.Array
    max_len: int = flax.struct.field(pytree_node=False, default=0)  # positions 0..max_len-1 fit

    @classmethod
    def create(cls, specs, batch: int, max_len: int, dtype, max_block: int = 16, page: int = 0) -> "LayerStates":
        """Empty states for layers described by ``specs`` (``KVSpec`` / ``RecurrentSpec``, one per layer);
        ``max_block``: the most tokens of a forward that may be rolled back (the block size); ``page`` > 0: full
        attention paged (``PagedKV``, its pools and table joined in by ``join_pages``)."""
        return cls(tuple(s.init(batch, max_len, dtype, max_block, page) for s in specs),
                   jnp.zeros((batch,), jnp.int32), max_len)

    def split_pages(self) -> tuple["LayerStates", tuple]:
        """-> (this cache with its paged layers' pools and tables taken out: rows first, every leaf; the pools, a
        (k, v) pair per paged layer (a stacked group's: stacked) in layer order)."""
        rows, pools = [], []
        for s in self.layers:
            p = _paged(s)
            if p is not None:
                pools.append((p.k, p.v))
                p = p.replace(k=None, v=None, table=None)
                s = s.replace(inner=p) if isinstance(s, Stacked) else p
            rows.append(s)
        return self.replace(layers=tuple(rows)), tuple(pools)

    def join_pages(self, pools, table) -> "LayerStates":
        """``split_pages`` undone: the paged layers given ``pools`` (in layer order) and the rows' ``table``."""
        pools, layers = iter(pools), []
        for s in self.layers:
            p = _paged(s)
            if p is not None:
                k, v = next(pools)
                p = p.replace(k=k, v=v, table=table)
                s = s.replace(inner=p) if isinstance(s, Stacked) else p
            layers.append(s)
        return self.replace(layers=tuple(layers))

    def commit(self, kept) -> "LayerStates":
        """Keep the first ``kept`` [B] tokens of the last forward of every row; the rest is rolled back."""
        kept = kept.astype(jnp.int32)
        return self.replace(layers=tuple(s.commit(kept) for s in self.layers), lengths=self.lengths + kept)

    def compact(self, src, dst) -> "LayerStates":
        """``compact`` in every layer."""
        return self.replace(layers=tuple(s.compact(src, dst) for s in self.layers))


def _paged(s) -> PagedKV | None:
    """The ``PagedKV`` of a layer state (a stacked group's inner one), or None."""
    s = s.inner if isinstance(s, Stacked) else s
    return s if isinstance(s, PagedKV) else None


def _pages(s) -> bool:
    """Whether a state spec's layer(s) may be paged (a ``KVSpec``, or a stack of them)."""
    return isinstance(s, KVSpec) or isinstance(s, StackedSpec) and isinstance(s.spec, KVSpec)


def new_pools(specs, pages: int, page: int, dtype, max_len: int, max_block: int) -> tuple:
    """Empty (k, v) pools of ``pages`` pages for every layer of ``specs`` that a paged cache pages
    (``KVSpec.paged``), in layer order: what ``LayerStates.join_pages`` takes."""
    return tuple(s.pool(pages, page, dtype) for s in specs if _pages(s) and s.paged(max_len, max_block, page))


def page_bytes(specs, page: int, dtype, max_len: int, max_block: int) -> int:
    """Bytes one page costs across every paged layer of ``specs``."""
    size = jnp.dtype(dtype).itemsize
    return sum(s.page_bytes(page, size) for s in specs if _pages(s) and s.paged(max_len, max_block, page))
