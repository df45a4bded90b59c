"""Length-bounded decode attention: dense reference, tiled jnp loop (CPU), Pallas kernel (TPU / GPU), wrapper.

The T (<= ``MAX_QUERIES``) new queries of each row against its cache, reading only the key tiles
the row can see, so a step costs what the row's real length costs, not its bucket:

  * query t of row b sits at position ``q_pos[b, t]`` (< 0: padding, it sees nothing and outputs 0);
  * cache slot s holds position s; query t sees s iff s <= q_pos, s < ``lengths[b]`` and, with a
    sliding window W, q_pos - s < W;
  * optional ``k_new`` / ``v_new``: the queries' own keys at ``q_pos``, seen by every non-padding query
    of the row bidirectionally within the window (the draft's block: |q_pos - kp| < W); with
    ``new_causal=True`` causally instead: own key at kp iff kp <= q_pos (window one-sided: q_pos - kp < W);
  * optional ``new_mask`` [B, T, T] bool (tree verification: query t sees own key u iff
    ``new_mask[b, t, u]``, e.g. its ancestors and itself; tree positions need not be unique) replaces
    that positional rule for the own keys, ANDed with both being non-padding; neither the window nor
    ``new_causal`` applies to it. The cache part keeps its rule (slots < lengths, <= q_pos, window);
  * ``sinks`` [Hq] (gpt-oss): one logit per query head in the softmax denominator, no value.

Shapes: q [B, T, Hq, D]; k [B, S, Hkv, D], v [B, S, Hkv, Dv] (Hq a multiple of Hkv: GQA, K/V never
repeated; Dv may differ from D: MiMo-V2-Flash's 192 / 128); q_pos [B, T] int32; lengths [B] int32; k_new
[B, T, Hkv, D], v_new [B, T, Hkv, Dv]; new_mask [B, T, T] bool; returns [B, T, Hq, Dv] in q.dtype.

Every query row r has a visible key range [lo_r, hi_r) (``_row_bounds``); a row of the batch reads
key tiles [min lo_r // tk, ceil(max hi_r / tk)) only:

  * ``decode_attention_loop`` (CPU, and the library's fallback): an online softmax over key tiles in
    a ``fori_loop`` whose bounds are the batch's min / max tile, read by ``dynamic_slice``.
  * Pallas, one program per (row, K/V head), its queries the T new tokens x the GQA group:
    TPU (Mosaic): grid (B, key tiles + 1), every K/V head of the row in one program: a key tile is the
    cache's own [tk, Hkv, D] block (its last two axes whole: read in place; a [B, S, Hkv*D] view would be a
    copy of the whole cache on TPU, whose tiles are (8, 128) of the last two axes), each head a strided load
    of it; the per-row tile range is scalar-prefetched, a step outside it re-points its index map at a tile
    already in VMEM (no DMA) and skips its compute (``pl.when``); the last step takes the new keys
    (``new_mask`` as one [rows, T] block per row, repeated over the GQA group like the query rows) and writes
    the output. GPU (Triton): grid (B, Hkv), a ``fori_loop`` over the row's tiles loading from the whole cache
    row through free [B, S, Hkv*D] / [B, S, Hkv*Dv] views (block = one head's lanes).
    Both calls also read a paged cache through its block table, a key tile a page (``paged_attention.py``).

Logits, softmax and accumulators are float32; probabilities are cast to v.dtype for the PV matmul.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import tiling
from .reference import attend, position_mask

# New tokens per row the decode path takes: a verify block (the released drafts' 16). More is a prefill
# (prompt buckets are 32+), which takes the dense path; a kernel program holds T x GQA-group query rows,
# and 16 keeps that within one tile at 8B shapes (64 x 4 rows was never compiled on a GPU). A tree verify
# (``new_mask``) takes this path too, so its nodes (the root included) must number at most this as well.
MAX_QUERIES = 16
# TPU: the bytes of one key tile's K and V blocks (every K/V head of a row; double-buffered in VMEM, so twice this)
TILE_BYTES = 4 * 2 ** 20


# ----------------------------------------------------------------------------- reference


def decode_attention_reference(q, k, v, q_pos, lengths, *, k_new=None, v_new=None, sliding_window=None,
                               sinks=None, scale=None, new_causal=False, new_mask=None):
    """The dense masked form over the whole cache (the project's ``attend``): what the others must equal."""
    _check_new(k_new, new_mask)
    s = jnp.arange(k.shape[1], dtype=jnp.int32)
    mask = position_mask(q_pos, s, causal=True, sliding_window=sliding_window,
                         k_valid=s[None, None, :] < lengths[:, None, None])
    if k_new is not None:
        valid = q_pos >= 0
        valid = valid[:, :, None] & valid[:, None, :]
        own = valid & new_mask.astype(bool) if new_mask is not None else position_mask(
            q_pos, q_pos, causal=new_causal, sliding_window=sliding_window, k_valid=valid)
        k, v, mask = (jnp.concatenate(x, axis=1 if x[0].ndim == 4 else -1)
                      for x in ((k, k_new), (v, v_new), (mask, own)))
    return attend(q, k, v, mask, scale=scale, sinks=sinks)


# ----------------------------------------------------------------------------- bounds and tile math


def _row_bounds(q_pos, lengths, ctx_len: int, window):
    """[lo, hi) of the cache slots each query sees: [B, T] each (empty: lo >= hi)."""
    hi = jnp.where(q_pos >= 0, jnp.minimum(jnp.minimum(q_pos + 1, lengths[:, None]), ctx_len), 0)
    lo = jnp.zeros_like(hi) if window is None else jnp.maximum(q_pos - (window - 1), 0)
    return lo.astype(jnp.int32), hi.astype(jnp.int32)


def _tile_range(lo, hi, tk: int, axis=-1):
    """[first, end) key tiles covering the non-empty rows' ranges (reduced over ``axis``); (0, 0) if none."""
    nonempty = lo < hi
    end = lax.div(jnp.max(jnp.where(nonempty, hi, 0), axis=axis) + (tk - 1), tk)
    first = lax.div(jnp.min(jnp.where(nonempty, lo, jnp.iinfo(jnp.int32).max), axis=axis), tk)
    return jnp.where(end > 0, first, 0), end


def _finish(carry, sink=None):
    """acc / l, the sink logit joining the denominator; rows that saw no key give 0."""
    m, l, acc = carry
    seen = l > 0.0
    if sink is not None:
        m_new = jnp.maximum(m, sink)
        alpha = jnp.exp(m - m_new)
        l, acc = alpha * l + jnp.exp(sink - m_new), alpha * acc
    return jnp.where(seen, acc / jnp.where(seen, l, 1.0), 0.0)


def _new_vis(qp, kp, window, causal, mask=None):
    """Queries at qp [.., R, 1] x their own new keys at kp [.., 1, T]: bidirectional within the window, or
    causal (kp <= qp, one-sided window); ``mask`` [.., R, T] (bool) replaces that rule."""
    vis = (qp >= 0) & (kp >= 0)
    if mask is not None:
        return vis & mask
    if causal:
        vis &= kp <= qp
    if window is not None:
        vis &= qp - kp < window
        if not causal:
            vis &= kp - qp < window
    return vis


def _check_new(k_new, new_mask):
    if new_mask is not None and k_new is None:
        raise ValueError("new_mask needs the own keys k_new / v_new")


# ----------------------------------------------------------------------------- tiled jnp loop (CPU)


# positional: the attention operands (q, k, v, and their positions / lengths / masks), one order throughout
@functools.partial(jax.jit, static_argnames=("sliding_window", "scale", "k_tile", "new_causal"))
def decode_attention_loop(q, k, v, q_pos, lengths, k_new=None, v_new=None, *, sliding_window=None, sinks=None,
                          scale=None, k_tile: int = 512, new_causal: bool = False, new_mask=None):
    """Online softmax over the key tiles of ``[min lo, max hi)`` of the batch (a dynamic trip count)."""
    tk = min(k_tile, k.shape[1])
    tile = lambda start: (lax.dynamic_slice_in_dim(k, start, tk, axis=1),  # noqa: E731
                          lax.dynamic_slice_in_dim(v, start, tk, axis=1))
    return online_loop(q, tile, tk, k.shape[1], k.shape[2], v.shape[-1], q_pos, lengths, k_new, v_new,
                       sliding_window=sliding_window, sinks=sinks, scale=scale, new_causal=new_causal,
                       new_mask=new_mask)


# positional: the attention operands (q, the stacked caches, the layer, positions / lengths, own keys)
def stacked_attention_loop(q, k, v, layer, q_pos, lengths, k_new=None, v_new=None, *, sliding_window=None, sinks=None,
                           scale=None, k_tile: int = 512, new_causal: bool = False, new_mask=None):
    """``decode_attention_loop`` over layer ``layer`` (a traced index) of a scanned group's stacked caches
    k [B, n, S, Hkv, D], v [B, n, S, Hkv, Dv]: each key tile read from the stack in place."""
    tk = min(k_tile, k.shape[2])
    tile = lambda start: tuple(lax.dynamic_slice(a, (0, layer, start, 0, 0), (a.shape[0], 1, tk) + a.shape[3:])[:, 0]  # noqa: E731
                               for a in (k, v))
    return online_loop(q, tile, tk, k.shape[2], k.shape[3], v.shape[-1], q_pos, lengths, k_new, v_new,
                       sliding_window=sliding_window, sinks=sinks, scale=scale, new_causal=new_causal,
                       new_mask=new_mask)


# positional: the attention operands, the cache read through ``tile``
def online_loop(q, tile, tk: int, s_len: int, hkv: int, dv: int, q_pos, lengths, k_new=None, v_new=None, *,
                sliding_window=None, sinks=None, scale=None, new_causal=False, new_mask=None):
    """The tiled loop of ``decode_attention_loop`` over a cache of ``s_len`` slots that ``tile(start)`` reads
    ``tk`` at a time (keys [B, tk, Hkv, D], values [B, tk, Hkv, Dv]; a row's cache, or its pages)."""
    _check_new(k_new, new_mask)
    b, t, hq, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    lo, hi = _row_bounds(q_pos, lengths.astype(jnp.int32), s_len, sliding_window)
    first, end = _tile_range(lo.reshape(-1), hi.reshape(-1), tk)
    lo, hi = lo[:, None, None, :, None], hi[:, None, None, :, None]  # [B, 1, 1, T, 1] against [B, K, G, T, tk]

    def body(j, carry):
        start = jnp.minimum(j * tk, s_len - tk)  # the last tile may overlap the one before: mask the overlap
        kt, vt = tile(start)
        p = start + jnp.arange(tk, dtype=jnp.int32)
        vis = (p >= jnp.maximum(lo, j * tk)) & (p < hi)
        logits = jnp.einsum("BTKGD,BSKD->BKGTS", qg, kt, preferred_element_type=jnp.float32) * scale
        return tiling.online_step(logits, jnp.swapaxes(vt, 1, 2)[:, :, None], vis, carry)

    shape = (b, hkv, hq // hkv, t)
    carry = (jnp.full(shape + (1,), tiling.MASK, jnp.float32), jnp.zeros(shape + (1,), jnp.float32),
             jnp.zeros(shape + (dv,), jnp.float32))
    carry = lax.fori_loop(first, end, body, carry)
    if k_new is not None:
        logits = jnp.einsum("BTKGD,BSKD->BKGTS", qg, k_new, preferred_element_type=jnp.float32) * scale
        mask = None if new_mask is None else new_mask.astype(bool)[:, None, None]  # [B, 1, 1, T, T]
        vis = _new_vis(q_pos[:, None, None, :, None], q_pos[:, None, None, None, :], sliding_window, new_causal,
                       mask)
        carry = tiling.online_step(logits, jnp.swapaxes(v_new, 1, 2)[:, :, None], vis, carry)
    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(1, hkv, hq // hkv, 1, 1)
    out = _finish(carry, sink)  # [B, K, G, T, Dv]
    return jnp.einsum("BKGTV->BTKGV", out).reshape(b, t, hq, dv).astype(q.dtype)


# ----------------------------------------------------------------------------- Pallas kernels


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Cfg(tiling.TileConfig):
    window: int | None
    scale: float
    tk: int            # keys per tile
    ctx_len: int       # S
    has_new: bool
    new_causal: bool
    has_mask: bool     # new_mask given (an int32 [rows, T] block per row)
    has_sinks: bool


# positional: one online-softmax tile step's operands, called from lax loops
def _tile_step(q, k, v, lo, hi, j, c: _Cfg, carry):
    """Queries q [R, D] x key tile j (k [tk, D], v [tk, Dv]; the tile starts at min(j*tk, S - tk))."""
    start = jnp.minimum(j * c.tk, c.ctx_len - c.tk)
    p = start + lax.broadcasted_iota(jnp.int32, (q.shape[0], c.tk), 1)
    vis = (p >= jnp.maximum(lo, j * c.tk)) & (p < hi)
    return tiling.fwd_step(q, k, v, vis, carry, c.scale)


# positional: one online-softmax tile step's operands, called from lax loops
def _new_step(q, kn_ref, vn_ref, qp, kp_ref, nm_ref, c: _Cfg, carry, head=None):
    """The queries' own keys (``head``: of the row's [tn, Hkv, D] block, TPU; None: the head's [tn, D] block)."""
    if not c.has_new:
        return carry
    vis = _new_vis(qp, kp_ref[...].reshape(1, -1), c.window, c.new_causal, nm_ref[...] != 0 if c.has_mask else None)
    kn, vn = (kn_ref[...], vn_ref[...]) if head is None else (_head(kn_ref, head), _head(vn_ref, head))
    return tiling.fwd_step(q, kn, vn, vis, carry, c.scale)


def _head(ref, h: int):
    """K/V head ``h`` of a [tk, Hkv, D] block (a strided load), or the [tk, D] block of a single head."""
    return ref[...] if len(ref.shape) == 2 else ref[:, h, :]


# positional: Pallas passes a kernel its refs in order (scalar prefetch, inputs, outputs, scratch)
def _tpu_kernel(first_ref, end_ref, q_ref, k_ref, v_ref, kn_ref, vn_ref, lo_ref, hi_ref, qp_ref, kp_ref, nm_ref,
                sink_ref, o_ref, m_sc, l_sc, acc_sc, *, c: _Cfg, nk):
    """Key tile j of row b for every K/V head h (a static loop: the cache's [tk, Hkv, D] block is read as the
    cache holds it, each head a strided load of it), each head's online softmax in its own scratch."""
    b, j = pl.program_id(0), pl.program_id(1)
    heads = q_ref.shape[0]

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, tiling.MASK, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    def carry(h):
        return m_sc[h][:, :1], l_sc[h][:, :1], acc_sc[h]

    def store(h, cr):
        m_sc[h] = jnp.broadcast_to(cr[0], m_sc.shape[1:])
        l_sc[h] = jnp.broadcast_to(cr[1], l_sc.shape[1:])
        acc_sc[h] = cr[2]

    @pl.when((j >= first_ref[b]) & (j < end_ref[b]))
    def _tile():
        lo, hi = tiling.row_stats(lo_ref), tiling.row_stats(hi_ref)
        for h in range(heads):
            store(h, _tile_step(q_ref[h], _head(k_ref, h), _head(v_ref, h), lo, hi, j, c, carry(h)))

    @pl.when(j == nk)
    def _last():
        for h in range(heads):
            cr = _new_step(q_ref[h], kn_ref, vn_ref, tiling.row_stats(qp_ref), kp_ref, nm_ref, c, carry(h), head=h)
            o_ref[h] = _finish(cr, sink_ref[h][:, :1] if c.has_sinks else None).astype(o_ref.dtype)


# positional: Pallas passes a kernel its refs in order (scalar prefetch, inputs, outputs, scratch)
def _gpu_kernel(q_ref, k_ref, v_ref, kn_ref, vn_ref, lo_ref, hi_ref, qp_ref, kp_ref, nm_ref, sink_ref, *refs,
                c: _Cfg):
    """``refs``: (o_ref,), or for a paged cache (table_ref [n], o_ref): k_ref, v_ref are then the pools
    [P*page, D] and key tile j, a page, starts at row table[j] * page."""
    *table_ref, o_ref = refs
    q, lo, hi = q_ref[...], tiling.row_stats(lo_ref), tiling.row_stats(hi_ref)
    first, end = _tile_range(lo, hi, c.tk, axis=None)

    def body(j, cr):
        kv = pl.ds(table_ref[0][j] * c.tk if table_ref else jnp.minimum(j * c.tk, c.ctx_len - c.tk), c.tk)
        return _tile_step(q, k_ref[kv, :], v_ref[kv, :], lo, hi, j, c, cr)

    cr = lax.fori_loop(first, end, body, tiling.empty_carry(q.shape[0], o_ref.shape[-1]))
    cr = _new_step(q, kn_ref, vn_ref, tiling.row_stats(qp_ref), kp_ref, nm_ref, c, cr)
    o_ref[...] = _finish(cr, tiling.row_stats(sink_ref) if c.has_sinks else None).astype(o_ref.dtype)


def _pick_tile(ctx_len: int, k_tile: int, backend: str) -> int:
    """TPU: the largest multiple of 8 <= k_tile dividing S (whole tiles, no padded reads); GPU: a power
    of two <= S (the last tile is shifted back to end at S)."""
    if backend == "tpu":
        return next((t for t in range(min(k_tile, ctx_len) // 8 * 8, 7, -8) if ctx_len % t == 0), ctx_len)
    return 1 << (min(k_tile, ctx_len).bit_length() - 1)


def _rows_pad(r: int, backend: str, interpret: bool) -> int:
    if backend == "gpu":
        return max(16, tiling.next_pow2(r))
    return r if interpret else tiling.round_up(r, 16)


# positional: the attention operands (q, k, v, and their positions / lengths / masks), one order throughout
def _pallas(q, k, v, q_pos, lengths, k_new, v_new, new_mask, sinks, c: _Cfg, launch):
    """The kernel's operands laid out per (row, K/V head), ``launch(c, args, out_shape, cost, first, end)``
    (``_launch``, or the paged one), its output back to [B, T, Hq, Dv]. k, v: the cache [B, S, Hkv, D] or
    the pools [P, page, Hkv, D], as they are (the GPU call flattens their last two axes: ``flat``)."""
    # 11 parameters: decode_attention's operands, passed through once from the jitted wrapper, and the call.
    b, t, hq, d = q.shape
    hkv, dv = k.shape[2], v.shape[-1]
    g = hq // hkv
    r = _rows_pad(t * g, c.backend, c.interpret)
    # Queries per (row, K/V head): rows = token-major x GQA group, padded with position -1.
    qh = jnp.einsum("BTKGD->BKTGD", q.reshape(b, t, hkv, g, d)).reshape(b, hkv, t * g, d)
    qh = jnp.pad(qh, ((0, 0), (0, 0), (0, r - t * g), (0, 0)))
    lo, hi = _row_bounds(q_pos, lengths, c.ctx_len, c.window)

    def rows(x, fill):  # [B, T] -> [B, R(, lanes)]
        x = jnp.pad(jnp.repeat(x, g, axis=1), ((0, 0), (0, r - t * g)), constant_values=fill)
        return jnp.broadcast_to(x[..., None], (*x.shape, c.lanes)) if c.lanes > 1 else x

    qp = jnp.where(q_pos >= 0, q_pos, -1).astype(jnp.int32)
    lo_r, hi_r, qp_r = rows(lo, 0), rows(hi, 0), rows(qp, -1)
    sink = jnp.zeros((hq,), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    sink_r = jnp.pad(jnp.tile(sink.reshape(hkv, 1, g), (1, t, 1)).reshape(hkv, t * g), ((0, 0), (0, r - t * g)))
    if c.lanes > 1:
        sink_r = jnp.broadcast_to(sink_r[..., None], (*sink_r.shape, c.lanes))
    if k_new is None:  # a placeholder the kernel never reads
        k_new, v_new = jnp.zeros((b, 1, hkv, d), k.dtype), jnp.zeros((b, 1, hkv, dv), v.dtype)
    tn = k_new.shape[1] if c.backend == "tpu" else max(16, tiling.next_pow2(k_new.shape[1]))
    pad_new = lambda x: jnp.pad(x, ((0, 0), (0, tn - x.shape[1]), (0, 0), (0, 0)))
    k_new, v_new = pad_new(k_new), pad_new(v_new)
    kp = jnp.pad(qp, ((0, 0), (0, max(tn - t, 0))), constant_values=-1)[:, None, :tn]
    if new_mask is None:  # a placeholder the kernel never reads
        nm = jnp.zeros((b, 1, tn), jnp.int32)
    else:  # [B, T, T] -> [B, R, tn] int32, query rows as above
        nm = jnp.repeat(new_mask.astype(jnp.int32), g, axis=1)
        nm = jnp.pad(nm, ((0, 0), (0, r - t * g), (0, tn - t)))
    args = (qh, k, v, k_new, v_new, lo_r, hi_r, qp_r, kp, nm, sink_r)
    out_shape = jax.ShapeDtypeStruct((b, hkv, r, dv), q.dtype)
    entries = b * hkv * r * (c.ctx_len + (tn if c.has_new else 0))  # dense bound: every cache slot visited
    # bytes: each row's cache read once up to its whole span (a paged cache: its table's pages, not the pools)
    seen = tuple(jax.ShapeDtypeStruct((b, c.ctx_len, hkv, x.shape[-1]), x.dtype) for x in (k, v))
    cost = tiling.cost_estimate(flops=2 * (d + dv) * entries, transcendentals=entries,
                                operands=(args[0], *seen, *args[3:]), outputs=(out_shape,))
    o = launch(c, args, out_shape, cost, *_tile_range(lo, hi, c.tk))
    o = o[:, :, :t * g].reshape(b, hkv, t, g, dv)
    return jnp.einsum("BKTGV->BTKGV", o).reshape(b, t, hq, dv)


def _launch(c: _Cfg, args, out_shape, cost, first, end):
    """The kernel over the rows' own caches; ``first`` / ``end`` [B]: each row's key tile range."""
    if c.backend == "tpu":
        return _tpu_call(c, args, out_shape, cost)(first, end, *args)
    args = flat(args)
    return _gpu_call(c, args, out_shape, cost)(*args)


def flat(args):
    """The kernel's operands with the caches' (or pools') and the new keys' last two axes flattened, [.., Hkv, D] ->
    [.., Hkv*D] (free on GPU: a row-major reshape), for the GPU call's blocks of one head's lanes. On TPU the same
    reshape of a [.., 8, 128]-tiled cache is a copy of it, so the TPU call reads the caches as they are."""
    f = lambda x: x.reshape(*x.shape[:2], -1)  # noqa: E731
    return (args[0], *(f(x) for x in args[1:5]), *args[5:])


def _tpu_call(c: _Cfg, args, out_shape, cost, paged: bool = False):
    """The Mosaic pallas_call over (B, key tiles + 1), every K/V head of a row in one program (a key tile is the
    cache's [tk, Hkv, D] block: its last two axes whole, so the cache is read in place, never relaid); it takes
    (first, end, *args), or with ``paged`` (k, v pools [P, page, Hkv, D], a key tile a page) (first, end, table [B*n]
    of in-range pages, *args)."""
    from jax.experimental.pallas import tpu as pltpu

    qh, nm = args[0], args[9]
    b, hkv, r, d = qh.shape
    dv = out_shape.shape[-1]
    tn, nk = args[8].shape[-1], c.ctx_len // c.tk
    row = (None, r, c.lanes)

    # one K/V head (a shard's of a tensor-split cache, a latent cache): [.., S, D] blocks of the squeezed arrays,
    # whose layout XLA may then keep as the caches' own (a [.., S, 1, D] array tiled over (S, D) would be relaid)
    one = hkv == 1
    kv_block = lambda width: (None, c.tk, width) if one else (None, c.tk, hkv, width)  # noqa: E731
    new_block = lambda width: (None, tn, width) if one else (None, tn, hkv, width)  # noqa: E731

    def kv_map(i, j, first, end, *table):  # steps outside [first, end) stay on a tile already in VMEM
        tile = jnp.minimum(jnp.maximum(j, first[i]), jnp.maximum(end[i] - 1, first[i]))
        at = (table[0][i * nk + tile], 0) if paged else (i, tile)
        return at + (0,) * (1 if one else 2)

    def kernel(first_ref, end_ref, *refs):  # the table is the index map's alone
        _tpu_kernel(first_ref, end_ref, *(refs[1:] if paged else refs), c=c, nk=nk)

    heads = lambda i, j, *_: (i, 0, 0, 0)
    per_row = lambda i, j, *_: (i, 0, 0)
    new_map = per_row if one else heads
    in_specs = [pl.BlockSpec((None, hkv, r, d), heads), pl.BlockSpec(kv_block(d), kv_map),
                pl.BlockSpec(kv_block(dv), kv_map), pl.BlockSpec(new_block(d), new_map),
                pl.BlockSpec(new_block(dv), new_map)] + [pl.BlockSpec(row, per_row)] * 3 + [
                pl.BlockSpec((None, 1, tn), per_row), pl.BlockSpec((None, *nm.shape[1:]), per_row),
                pl.BlockSpec((hkv, r, c.lanes), lambda i, j, *_: (0, 0, 0))]
    call = pl.pallas_call(
        kernel, out_shape=out_shape, interpret=c.interpret,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2 + paged, grid=(b, nk + 1), in_specs=in_specs,
            out_specs=pl.BlockSpec((None, hkv, r, dv), heads),
            scratch_shapes=[pltpu.VMEM((hkv, r, c.lanes), jnp.float32), pltpu.VMEM((hkv, r, c.lanes), jnp.float32),
                            pltpu.VMEM((hkv, r, dv), jnp.float32)]),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        cost_estimate=cost)
    if not one:
        return call

    def squeezed(*xs):  # (first, end[, table], q, k, v, k_new, v_new, ...): the K/V axis of k .. v_new dropped
        at = 3 + paged
        return call(*xs[:at], *(x[:, :, 0] for x in xs[at:at + 4]), *xs[at + 4:])

    return squeezed


def _gpu_call(c: _Cfg, args, out_shape, cost, paged: bool = False):
    """The Triton pallas_call over (B, Hkv); each program loads from its whole cache row, or with ``paged``
    (k, v pools [P*page, Hkv*D], a key tile a page) from the whole pools, taking (*args, table [B, n])."""
    from jax.experimental.pallas import triton as pltr

    qh, nm = args[0], args[9]
    b, hkv, r, d = qh.shape
    dv, tn = out_shape.shape[-1], args[8].shape[-1]
    head = lambda i, h: (i, h, 0, 0)
    per_row, per_row_2d = (lambda i, h: (i, 0)), (lambda i, h: (i, 0, 0))
    whole = lambda i, h: (i, 0, h)
    if paged:
        cache = [pl.BlockSpec((args[1].shape[0], d), lambda i, h: (0, h)),
                 pl.BlockSpec((args[2].shape[0], dv), lambda i, h: (0, h))]
    else:
        cache = [pl.BlockSpec((None, c.ctx_len, d), whole), pl.BlockSpec((None, c.ctx_len, dv), whole)]
    in_specs = [pl.BlockSpec((None, None, r, d), head), *cache, pl.BlockSpec((None, tn, d), whole),
                pl.BlockSpec((None, tn, dv), whole)] + [pl.BlockSpec((None, r), per_row)] * 3 + [
                pl.BlockSpec((None, 1, tn), per_row_2d), pl.BlockSpec((None, *nm.shape[1:]), per_row_2d),
                pl.BlockSpec((None, r), lambda i, h: (h, 0))]
    if paged:
        in_specs.append(pl.BlockSpec((None, c.ctx_len // c.tk), per_row))
    return pl.pallas_call(functools.partial(_gpu_kernel, c=c), grid=(b, hkv), in_specs=in_specs,
                          out_specs=pl.BlockSpec((None, None, r, dv), head), out_shape=out_shape,
                          interpret=c.interpret, cost_estimate=cost,
                          compiler_params=pltr.CompilerParams(num_warps=4, num_stages=2))


# positional: the attention operands (q, k, v, and their positions / lengths / masks), one order throughout
@functools.partial(jax.jit, static_argnames=("sliding_window", "scale", "interpret", "k_tile", "backend",
                                             "new_causal"))
def decode_attention(q, k, v, q_pos, lengths, k_new=None, v_new=None, *, sliding_window=None, sinks=None,
                     scale=None, interpret: bool | None = None, k_tile: int = 512, backend: str | None = None,
                     new_causal: bool = False, new_mask=None):
    """The Pallas decode attention (semantics and shapes in the module docstring).

    ``backend``: "tpu" (Mosaic) or "gpu" (Triton); default: the default backend's, the TPU formulation on
    CPU. ``interpret``: default True on CPU. ``k_tile``: keys per tile (adjusted to what the backend needs).
    """
    _check_new(k_new, new_mask)
    backend, interpret = tiling.resolve_backend(backend, interpret)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if backend == "tpu":  # a key tile holds every K/V head of the row: keep its K + V block within TILE_BYTES
        k_tile = min(k_tile, max(8, TILE_BYTES // (k.shape[2] * (k.shape[3] + v.shape[3]) * k.dtype.itemsize)))
    c = _Cfg(window=sliding_window, scale=scale, tk=_pick_tile(k.shape[1], k_tile, backend), ctx_len=k.shape[1],
             has_new=k_new is not None, new_causal=bool(new_causal), has_mask=new_mask is not None,
             has_sinks=sinks is not None, backend=backend, interpret=interpret)
    return _pallas(q, k, v, q_pos.astype(jnp.int32), lengths.astype(jnp.int32), k_new, v_new, new_mask, sinks, c,
                   _launch)


def decode_kernel_supported(*, head_dim: int, kv_heads: int, ctx_len: int, v_head_dim: int | None = None) -> bool:
    """Whether the compiled decode kernel is expected to run on the platform the program is built for
    (``tiling.platform``; on a mesh ``attention.decode_attention`` calls it per shard). TPU: a cache of whole tiles
    of 8 slots, any head width (a key tile is the cache's own [tk, Hkv, D] block); GPU (Triton): keys' ``head_dim``
    and values' ``v_head_dim`` (default: the same) each a power of two >= 16 (one head's lanes of the [B, S, Hkv*D]
    view), so MiMo-V2-Flash's 192 / 128 takes the loop there."""
    p = tiling.platform()
    dims = (head_dim, head_dim if v_head_dim is None else v_head_dim)
    if p == "tpu":  # a key tile is the cache's [tk, K, D] block: any head width, whole tiles of 8 slots
        return ctx_len % 8 == 0
    pow2 = all(d & (d - 1) == 0 and d >= 16 for d in dims)
    return p == "gpu" and tiling.gpu_capable() and pow2 and ctx_len >= 16
