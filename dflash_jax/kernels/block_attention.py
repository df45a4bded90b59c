"""DFlash block attention: dense reference, Pallas kernel (TPU Mosaic / GPU Triton / CPU interpret), wrapper.

The draft's training attention. Per sequence the queries are N blocks of Bk tokens laid out
contiguously (block b = query rows b*Bk .. b*Bk+Bk-1); block b is anchored at the runtime position
``anchors[batch, b]`` and its token i sits at position a_b + i. Keys are [context 0..S-1 | all blocks].

  * block b sees context key p iff start_b <= p < a_b (offset-causal; ``ctx_start`` gives start_b,
    default 0: packed rows hold several documents and a block sees only its own one), and with a
    sliding window W also (a_b + i) - p < W;
  * block b sees its own Bk block keys (at a_b + j) bidirectionally (with a window also |i - j| < W),
    never another block's; with ``block_causal=True`` (the newest DFlash drafts' sliding-window
    layers) causally instead: key j iff j <= i (with a window also i - j < W);
  * a negative anchor marks a padding block: it sees nothing, outputs 0 and gets zero gradients;
    anchor 0 sees only its own block.

Shapes (T = N * Bk):
  q            [batch, T, Hq, D]        queries (Hq a multiple of Hkv: GQA, K/V never repeated)
  k_ctx, v_ctx [batch, S, Hkv, D]       context keys / values (positions 0..S-1)
  k_blk, v_blk [batch, T, Hkv, D]       block keys / values (same row layout as q)
  anchors      [batch, N] int32         runtime anchor of each block (< 0: padding block)
  ctx_start    [batch, N] int32         runtime lower bound of each block's context (optional)
  returns      [batch, T, Hq, D]        in q.dtype

Kernel layout: the wrapper moves heads in front ([batch, H, rows, D]) and pads the rows to whole
query tiles (padding blocks, anchor -1) and the context to whole key tiles (keys p >= S masked).
A query tile holds ``q_tile // Bk`` whole blocks; its own-block keys are exactly the same rows of
k_blk, so one diagonal (block-masked) key tile finishes it. For each (batch, query tile) the wrapper
computes from the anchors and context starts the range [lo, hi) of context key tiles any of its
rows can see; tiles outside it (past every anchor, before every start or window) are skipped:

  * TPU (Mosaic): grid (batch, Hq, q tiles, context tiles + 1), online softmax in VMEM scratch.
    lo/hi are scalar-prefetched (SMEM); a skipped step's index map re-points at a tile already in
    VMEM (no DMA) and its compute is guarded by ``pl.when``. The last step is the own-block tile.
  * GPU (Triton): grid (batch, Hq, q tiles); a ``fori_loop`` over [lo, hi) (computed in-kernel
    from the per-row anchors and starts, passed as ordinary inputs), then the own-block tile.
  * ``interpret=True`` runs either formulation on CPU (that is how the tests run it).

Backward (``jax.custom_vjp``): FlashAttention-2 style Pallas kernels recomputing the probabilities
from the saved logsumexp: one kernel per query tile for dq (plus the own-block dk/dv, per query
head, summed over the GQA group by the wrapper) and one per context key tile for the context dk/dv,
which visits only the query tiles that see that key tile (compacted list, scalar-prefetched on TPU).
Logits, softmax and all accumulators are float32; p and ds are cast to the input dtype for the
matmuls (as the reference casts p to v.dtype).

The online-softmax step, the lane layout of the per-row statistics and the platform probe are shared
with the decode kernel (tiling.py); the skip statistics live with the benchmark (bench.py).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .reference import attend, position_mask
from .tiling import (
    MASK,
    NT,
    TileConfig,
    cost_estimate,
    empty_carry,
    fwd_step,
    gpu_capable,
    next_pow2,
    platform,
    resolve_backend,
    round_up,
    row_stats,
)

_BIG = 1 << 30


# ----------------------------------------------------------------------------- reference


@functools.partial(jax.jit, static_argnames=("ctx_len", "block_size", "sliding_window", "block_causal"))
def block_mask(anchors, ctx_len: int, *, block_size: int, sliding_window: int | None = None, ctx_start=None,
               block_causal: bool = False):
    """Visibility [batch, N*Bk, S + N*Bk] of keys [context | blocks] for the block queries
    (``ctx_start`` [batch, N]: the first context position each block may see; None: 0;
    ``block_causal``: each block sees its own keys causally)."""
    batch, n = anchors.shape
    a = jnp.repeat(anchors.astype(jnp.int32), block_size, axis=1)  # [B, T] anchor of each row
    qpos = a + jnp.tile(jnp.arange(block_size, dtype=jnp.int32), n)  # [B, T] position of each row
    p = jnp.arange(ctx_len, dtype=jnp.int32)
    seen = p[None, None, :] < a[:, :, None]
    if ctx_start is not None:
        seen &= p[None, None, :] >= jnp.repeat(ctx_start.astype(jnp.int32), block_size, axis=1)[:, :, None]
    ctx = position_mask(qpos, p, causal=True, sliding_window=sliding_window, k_valid=seen)
    blk_id = jnp.arange(n * block_size) // block_size
    same = (blk_id[:, None] == blk_id[None, :])[None] & (a >= 0)[:, :, None]
    blk = position_mask(qpos, qpos, causal=block_causal, sliding_window=sliding_window, k_valid=same)
    return jnp.concatenate([ctx, blk], axis=-1)


def block_attention_reference(q, k_ctx, v_ctx, k_blk, v_blk, anchors, *, block_size: int,
                              sliding_window: int | None = None, scale: float | None = None, ctx_start=None,
                              block_causal: bool = False):
    """Dense [T, S+T] mask + the project's one attention reference (``reference.attend``)."""
    _check_shapes(q, k_ctx, v_ctx, k_blk, v_blk, anchors, block_size, ctx_start)
    mask = block_mask(anchors, k_ctx.shape[1], block_size=block_size, sliding_window=sliding_window,
                      ctx_start=ctx_start, block_causal=block_causal)
    k = jnp.concatenate([k_ctx, k_blk], axis=1)
    v = jnp.concatenate([v_ctx, v_blk], axis=1)
    return attend(q, k, v, mask, scale=scale)


# positional: the attention operands (q, k, v, and their positions / lengths / masks), one order throughout
def _check_shapes(q, k_ctx, v_ctx, k_blk, v_blk, anchors, bk, ctx_start=None):
    b, t, hq, d = q.shape
    s, hkv = k_ctx.shape[1], k_ctx.shape[2]
    n = anchors.shape[1]
    if ctx_start is not None and ctx_start.shape != anchors.shape:
        raise ValueError(f"ctx_start {ctx_start.shape} must have the shape of anchors {anchors.shape}")
    if (anchors.shape != (b, n) or t != n * bk or k_ctx.shape != (b, s, hkv, d)
            or v_ctx.shape != k_ctx.shape or k_blk.shape != (b, t, hkv, d) or v_blk.shape != k_blk.shape):
        raise ValueError(f"shapes q {q.shape} k_ctx {k_ctx.shape} v_ctx {v_ctx.shape} k_blk {k_blk.shape} "
                         f"v_blk {v_blk.shape} anchors {anchors.shape} block_size {bk} do not fit")
    if hq % hkv:
        raise ValueError(f"{hq} query heads is not a multiple of {hkv} key/value heads")


# ----------------------------------------------------------------------------- tiles and masks


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Cfg(TileConfig):
    bk: int            # block size
    window: int | None
    block_causal: bool  # own block keys j <= i only
    scale: float
    tq: int            # query rows per tile (a multiple of bk)
    tk: int            # context keys per tile
    ctx_len: int       # S (keys >= S are padding)


# positional: the shapes a tiling depends on, in the operands' order
def pick_tiles(n_blocks, bk, ctx_len, q_tile, k_tile, backend, interpret):
    """(tq, tk). GPU (Triton) needs powers of two >= 16; compiled TPU needs bf16-sublane multiples."""
    nbt = max(1, q_tile // bk)
    if backend == "gpu":
        nbt = max(min(next_pow2(nbt), next_pow2(n_blocks)), -(-16 // bk))
        tk = max(min(next_pow2(k_tile), next_pow2(max(ctx_len, 1))), 16)
    else:
        if not interpret:
            nbt = round_up(nbt, 16 // math.gcd(bk, 16))
        nbt = min(nbt, n_blocks)  # one tile covering every row is always a legal block
        tk = min(k_tile, round_up(max(ctx_len, 1), 8))
    return nbt * bk, tk


def context_tile_range(a, start, ctx_len, tk, window, axis=None):
    """[lo, hi) of context key tiles visible to the rows with anchors ``a`` and context starts ``start``
    (reduced over ``axis``).

    Rows see context p in [max(0, start, a - W + 1), min(a, S)); padding rows (a < 0) see none. An
    empty range is returned as (0, 0) so the skipped index map points at tile 0.
    """
    valid = a >= 0
    hi_pos = jnp.minimum(jnp.max(jnp.where(valid, a, 0), axis=axis), ctx_len)
    hi = lax.div(hi_pos + (tk - 1), tk)
    row_lo = start if window is None else jnp.maximum(start, a - (window - 1))
    lo_pos = jnp.maximum(jnp.min(jnp.where(valid, row_lo, _BIG), axis=axis), 0)
    lo = lax.div(lo_pos, tk)
    nonempty = lo < hi
    return jnp.where(nonempty, lo, 0), jnp.where(nonempty, hi, 0)


def _divmod(x, d):
    """x // d, x % d for non-negative int32 vectors without a vector integer divide."""
    if d & (d - 1) == 0:
        sh = d.bit_length() - 1
        return lax.shift_right_logical(x, jnp.int32(sh)), x & (d - 1)
    qt = jnp.floor((x.astype(jnp.float32) + 0.5) * (1.0 / d)).astype(jnp.int32)  # exact for x < 2**20
    return qt, x - qt * d


def _ctx_vis(a, st, j, c: _Cfg, shape):
    """Rows (anchors a, context starts st [tq, 1]) x context key tile j -> bool [tq, tk]."""
    r = lax.broadcasted_iota(jnp.int32, shape, 0)
    p = j * c.tk + lax.broadcasted_iota(jnp.int32, shape, 1)
    vis = (p < a) & (p >= st) & (p < c.ctx_len)
    if c.window is not None:
        vis &= (a + _divmod(r, c.bk)[1] - p) < c.window
    return vis


def _blk_vis(a, c: _Cfg):
    """Rows x their own tile of block keys (block-diagonal; bidirectional, or causal) -> bool [tq, tq].
    Within one block the row / key offsets differ as i - j, so r - k stands for it."""
    r = lax.broadcasted_iota(jnp.int32, (c.tq, c.tq), 0)
    k = lax.broadcasted_iota(jnp.int32, (c.tq, c.tq), 1)
    vis = (_divmod(r, c.bk)[0] == _divmod(k, c.bk)[0]) & (a >= 0)
    if c.block_causal:
        vis &= k <= r
    if c.window is not None:
        vis &= r - k < c.window
        if not c.block_causal:
            vis &= k - r < c.window
    return vis


# ----------------------------------------------------------------------------- tile math


def _fwd_finish(carry):
    m, l, acc = carry
    seen = l > 0.0  # False only for padding rows
    safe_l = jnp.where(seen, l, 1.0)
    return acc / safe_l, jnp.where(seen, m + jnp.log(safe_l), 0.0)


# positional: one online-softmax tile step's operands, called from lax loops
def _bwd_step(q, k, v, do, lse, delta, vis, scale):
    """p [tq, tk] and ds = dL/d(q.k) [tq, tk] (the softmax scale folded in), both float32."""
    s = lax.dot_general(q, k, NT, preferred_element_type=jnp.float32) * scale
    p = jnp.exp(jnp.where(vis, s - lse, MASK))
    dp = lax.dot_general(do, v, NT, preferred_element_type=jnp.float32)
    return p, p * (dp - delta) * scale


def _acc_dq(dq, ds, k):
    return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)


def _acc_dkv(dk, dv, p, ds, q, do):
    dk = dk + jnp.dot(ds.T.astype(q.dtype), q, preferred_element_type=jnp.float32)
    dv = dv + jnp.dot(p.T.astype(do.dtype), do, preferred_element_type=jnp.float32)
    return dk, dv


# ----------------------------------------------------------------------------- TPU kernels


# positional: Pallas passes a kernel its refs in order (scalar prefetch, inputs, outputs, scratch)
def _tpu_fwd_kernel(lo_ref, hi_ref, q_ref, kc_ref, vc_ref, kb_ref, vb_ref, ra_ref, rs_ref, o_ref, lse_ref,
                    m_sc, l_sc, acc_sc, *, c: _Cfg, nq, nk):
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    t = b * nq + i

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, MASK, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    def step(k_ref, v_ref, vis):
        carry = fwd_step(q_ref[...], k_ref[...], v_ref[...], vis,
                          (m_sc[...][:, :1], l_sc[...][:, :1], acc_sc[...]), c.scale)
        m_sc[...] = jnp.broadcast_to(carry[0], m_sc.shape)
        l_sc[...] = jnp.broadcast_to(carry[1], l_sc.shape)
        acc_sc[...] = carry[2]
        return carry

    @pl.when((j >= lo_ref[t]) & (j < hi_ref[t]))
    def _ctx():
        step(kc_ref, vc_ref, _ctx_vis(row_stats(ra_ref), row_stats(rs_ref), j, c, (c.tq, c.tk)))

    @pl.when(j == nk)
    def _own_block():
        out, lse = _fwd_finish(step(kb_ref, vb_ref, _blk_vis(row_stats(ra_ref), c)))
        o_ref[...] = out.astype(o_ref.dtype)
        lse_ref[...] = jnp.broadcast_to(lse, lse_ref.shape)


# positional: Pallas passes a kernel its refs in order (scalar prefetch, inputs, outputs, scratch)
def _tpu_dq_kernel(lo_ref, hi_ref, q_ref, kc_ref, vc_ref, kb_ref, vb_ref, ra_ref, rs_ref, do_ref, lse_ref,
                   dl_ref, dq_ref, dkb_ref, dvb_ref, dq_sc, *, c: _Cfg, nq, nk):
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    t = b * nq + i

    @pl.when(j == 0)
    def _init():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    def grads(k_ref, v_ref, vis):
        return _bwd_step(q_ref[...], k_ref[...], v_ref[...], do_ref[...], row_stats(lse_ref),
                         row_stats(dl_ref), vis, c.scale)

    @pl.when((j >= lo_ref[t]) & (j < hi_ref[t]))
    def _ctx():
        _, ds = grads(kc_ref, vc_ref, _ctx_vis(row_stats(ra_ref), row_stats(rs_ref), j, c, (c.tq, c.tk)))
        dq_sc[...] = _acc_dq(dq_sc[...], ds, kc_ref[...])

    @pl.when(j == nk)
    def _own_block():
        p, ds = grads(kb_ref, vb_ref, _blk_vis(row_stats(ra_ref), c))
        dq_ref[...] = _acc_dq(dq_sc[...], ds, kb_ref[...]).astype(dq_ref.dtype)
        zero = jnp.zeros(dkb_ref.shape, jnp.float32)
        dk, dv = _acc_dkv(zero, zero, p, ds, q_ref[...], do_ref[...])
        dkb_ref[...] = dk
        dvb_ref[...] = dv


# positional: Pallas passes a kernel its refs in order (scalar prefetch, inputs, outputs, scratch)
def _tpu_dkv_kernel(ql_ref, qn_ref, q_ref, kc_ref, vc_ref, ra_ref, rs_ref, do_ref, lse_ref, dl_ref,
                    dk_ref, dv_ref, dk_sc, dv_sc, *, c: _Cfg, nq, nk):
    b, kj, s = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(s == 0)
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    @pl.when(lax.rem(s, nq) < qn_ref[b * nk + kj])
    def _acc():
        vis = _ctx_vis(row_stats(ra_ref), row_stats(rs_ref), kj, c, (c.tq, c.tk))
        q, do = q_ref[...], do_ref[...]
        p, ds = _bwd_step(q, kc_ref[...], vc_ref[...], do, row_stats(lse_ref), row_stats(dl_ref), vis, c.scale)
        dk_sc[...], dv_sc[...] = _acc_dkv(dk_sc[...], dv_sc[...], p, ds, q, do)

    @pl.when(s == pl.num_programs(3) - 1)
    def _write():
        dk_ref[...] = dk_sc[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


# ----------------------------------------------------------------------------- GPU kernels


# positional: Pallas passes a kernel its refs in order (scalar prefetch, inputs, outputs, scratch)
def _gpu_fwd_kernel(q_ref, kc_ref, vc_ref, kb_ref, vb_ref, ra_ref, rs_ref, o_ref, lse_ref, *, c: _Cfg):
    q, a, st = q_ref[...], row_stats(ra_ref), row_stats(rs_ref)
    lo, hi = context_tile_range(a, st, c.ctx_len, c.tk, c.window)

    def body(j, carry):
        kv = pl.ds(pl.multiple_of(j * c.tk, c.tk), c.tk)
        return fwd_step(q, kc_ref[kv, :], vc_ref[kv, :], _ctx_vis(a, st, j, c, (c.tq, c.tk)), carry, c.scale)

    carry = lax.fori_loop(lo, hi, body, empty_carry(*q.shape))
    out, lse = _fwd_finish(fwd_step(q, kb_ref[...], vb_ref[...], _blk_vis(a, c), carry, c.scale))
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse


# positional: Pallas passes a kernel its refs in order (scalar prefetch, inputs, outputs, scratch)
def _gpu_dq_kernel(q_ref, kc_ref, vc_ref, kb_ref, vb_ref, ra_ref, rs_ref, do_ref, lse_ref, dl_ref,
                   dq_ref, dkb_ref, dvb_ref, *, c: _Cfg):
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], dl_ref[...]
    a, st = row_stats(ra_ref), row_stats(rs_ref)
    lo, hi = context_tile_range(a, st, c.ctx_len, c.tk, c.window)

    def body(j, dq):
        kv = pl.ds(pl.multiple_of(j * c.tk, c.tk), c.tk)
        k = kc_ref[kv, :]
        _, ds = _bwd_step(q, k, vc_ref[kv, :], do, lse, delta, _ctx_vis(a, st, j, c, (c.tq, c.tk)), c.scale)
        return _acc_dq(dq, ds, k)

    dq = lax.fori_loop(lo, hi, body, jnp.zeros(q.shape, jnp.float32))
    kb = kb_ref[...]
    p, ds = _bwd_step(q, kb, vb_ref[...], do, lse, delta, _blk_vis(a, c), c.scale)
    dq_ref[...] = _acc_dq(dq, ds, kb).astype(dq_ref.dtype)
    zero = jnp.zeros(kb.shape, jnp.float32)
    dkb_ref[...], dvb_ref[...] = _acc_dkv(zero, zero, p, ds, q, do)


# positional: Pallas passes a kernel its refs in order (scalar prefetch, inputs, outputs, scratch)
def _gpu_dkv_kernel(q_ref, kc_ref, vc_ref, ra_ref, rs_ref, do_ref, lse_ref, dl_ref, dk_ref, dv_ref, *,
                    c: _Cfg, nq, groups):
    kj = pl.program_id(2)
    k, v = kc_ref[...], vc_ref[...]

    def visit(qi, carry):
        rows = pl.ds(pl.multiple_of(qi * c.tq, c.tq), c.tq)
        vis = _ctx_vis(ra_ref[rows][:, None], rs_ref[rows][:, None], kj, c, (c.tq, c.tk))
        for g in range(groups):  # the query heads sharing this K/V head
            q, do = q_ref[g, rows, :], do_ref[g, rows, :]
            p, ds = _bwd_step(q, k, v, do, lse_ref[g, rows, :], dl_ref[g, rows, :], vis, c.scale)
            carry = _acc_dkv(*carry, p, ds, q, do)
        return carry

    def body(qi, carry):
        rows = pl.ds(pl.multiple_of(qi * c.tq, c.tq), c.tq)
        lo, hi = context_tile_range(ra_ref[rows], rs_ref[rows], c.ctx_len, c.tk, c.window)
        return lax.cond((kj >= lo) & (kj < hi), visit, lambda _, cr: cr, qi, carry)

    zero = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, nq, body, (zero, zero))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------- wrapper


# positional: the attention operands (q, k, v, and their positions / lengths / masks), one order throughout
def _prepare(q, k_ctx, v_ctx, k_blk, v_blk, anchors, ctx_start, c: _Cfg):
    """Head-major, padded operands, the per-row anchors / context starts and the per-tile context ranges."""
    batch, t = q.shape[:2]
    nbt = c.tq // c.bk
    n_pad = round_up(anchors.shape[1], nbt)
    t_pad, s_pad = n_pad * c.bk, round_up(max(c.ctx_len, 1), c.tk)

    def heads(x, rows):
        return jnp.pad(jnp.swapaxes(x, 1, 2), ((0, 0), (0, 0), (0, rows - x.shape[1]), (0, 0)))

    pad = ((0, 0), (0, n_pad - anchors.shape[1]))
    anc = jnp.pad(anchors.astype(jnp.int32), pad, constant_values=-1)
    st = jnp.pad(ctx_start.astype(jnp.int32), pad)
    tiles = (batch, n_pad // nbt, nbt)
    lo, hi = context_tile_range(anc.reshape(tiles), st.reshape(tiles), c.ctx_len, c.tk, c.window, axis=-1)

    def per_row(x):  # [B, n_pad] -> [B, t_pad] (x lanes on TPU)
        x = jnp.repeat(x, c.bk, axis=1)
        return jnp.broadcast_to(x[:, :, None], (*x.shape, c.lanes)) if c.backend == "tpu" else x

    return dict(q=heads(q, t_pad), kc=heads(k_ctx, s_pad), vc=heads(v_ctx, s_pad), kb=heads(k_blk, t_pad),
                vb=heads(v_blk, t_pad), ra=per_row(anc), rs=per_row(st), lo=lo, hi=hi, t=t)


def _lanes(x, c):  # [B, H, rows] float32 -> the kernels' per-row layout
    return jnp.broadcast_to(x[..., None], (*x.shape, c.lanes))


def _cost(x, c: _Cfg, ctx_macs: int, own_macs: int, operands, outputs):
    """The cost estimate of one kernel at its dense upper bound (skipped tiles counted: they depend on the
    runtime anchors): ``ctx_macs`` / ``own_macs`` D-long multiply-adds per context / own-block score entry
    (0: the kernel does not visit them), one exp per visited entry."""
    batch, hq, t_pad, d = x["q"].shape
    ctx, own = batch * hq * t_pad * x["kc"].shape[2], batch * hq * t_pad * c.tq
    return cost_estimate(flops=2 * d * (ctx_macs * ctx + own_macs * own),
                         transcendentals=ctx * (ctx_macs > 0) + own * (own_macs > 0), operands=operands,
                         outputs=outputs)


# positional: the attention operands (q, k, v, and their positions / lengths / masks), one order throughout
def _call(c: _Cfg, kernel, grid, in_specs, out_specs, out_shape, prefetch=(), scratch=(), *, cost=None):
    # 8 parameters: the pallas_call pieces both formulations take, named at every call site.
    if c.backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        return functools.partial(pl.pallas_call(
            kernel, out_shape=out_shape, interpret=c.interpret, cost_estimate=cost,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=len(prefetch), grid=grid, in_specs=in_specs, out_specs=out_specs,
                scratch_shapes=[pltpu.VMEM(shape, jnp.float32) for shape in scratch]),
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))), *prefetch)
    from jax.experimental.pallas import triton as pltr

    return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                          interpret=c.interpret, cost_estimate=cost,
                          compiler_params=pltr.CompilerParams(num_warps=4, num_stages=2))


# positional: the attention operands (q, k, v, and their positions / lengths / masks), one order throughout
def _query_tile_call(c: _Cfg, x, kernel, n_tiles, n_stats, out_shape, out_specs_kinds, scratch=(), *, cost=None):
    """pallas_call over (batch, Hq, query tiles[, context tiles + 1]) with inputs
    [q, k_ctx, v_ctx, k_blk, v_blk, row anchors, row context starts] + ``n_tiles`` q-shaped + ``n_stats``
    per-row inputs. (8 parameters: the shape of one call, each named where it is passed.)"""
    batch, hq, t_pad, d = x["q"].shape
    hkv, s_pad = x["kc"].shape[1:3]
    groups, nq, nk = hq // hkv, t_pad // c.tq, s_pad // c.tk
    tile_q = (None, None, c.tq, d)
    if c.backend == "tpu":
        def ctx_map(b, h, i, j, lo, hi):  # skipped steps re-point at a tile that is already in VMEM
            first, last = lo[b * nq + i], hi[b * nq + i] - 1
            return b, lax.div(h, groups), jnp.minimum(jnp.maximum(j, first), jnp.maximum(last, first)), 0

        q_map = lambda b, h, i, j, lo, hi: (b, h, i, 0)
        blk_map = lambda b, h, i, j, lo, hi: (b, lax.div(h, groups), i, 0)
        ctx_spec = pl.BlockSpec((None, None, c.tk, d), ctx_map)
        ra_spec = pl.BlockSpec((None, c.tq, c.lanes), lambda b, h, i, j, lo, hi: (b, i, 0))
        grid, prefetch = (batch, hq, nq, nk + 1), (x["lo"].reshape(-1), x["hi"].reshape(-1))
        kernel = functools.partial(kernel, nq=nq, nk=nk)
    else:  # whole context rows; the kernel loads the tiles it needs
        q_map = lambda b, h, i: (b, h, i, 0)
        blk_map = lambda b, h, i: (b, lax.div(h, groups), i, 0)
        ctx_spec = pl.BlockSpec((None, None, s_pad, d), lambda b, h, i: (b, lax.div(h, groups), 0, 0))
        ra_spec = pl.BlockSpec((None, c.tq), lambda b, h, i: (b, i))
        grid, prefetch = (batch, hq, nq), ()
    row = (None, None, c.tq, c.lanes)
    in_specs = ([pl.BlockSpec(tile_q, q_map), ctx_spec, ctx_spec, pl.BlockSpec(tile_q, blk_map),
                 pl.BlockSpec(tile_q, blk_map), ra_spec, ra_spec]
                + [pl.BlockSpec(tile_q, q_map)] * n_tiles + [pl.BlockSpec(row, q_map)] * n_stats)
    out_specs = [pl.BlockSpec(tile_q if kind == "tile" else row, q_map) for kind in out_specs_kinds]
    return _call(c, functools.partial(kernel, c=c), grid, in_specs, out_specs, out_shape, prefetch, scratch,
                 cost=cost)


# positional: jax.custom_vjp passes its (non-differentiable, primal) arguments by position
def _forward(q, k_ctx, v_ctx, k_blk, v_blk, anchors, ctx_start, c: _Cfg):
    x = _prepare(q, k_ctx, v_ctx, k_blk, v_blk, anchors, ctx_start, c)
    out_shape = (jax.ShapeDtypeStruct(x["q"].shape, q.dtype),
                 jax.ShapeDtypeStruct((*x["q"].shape[:3], c.lanes), jnp.float32))
    tq, d = c.tq, x["q"].shape[3]
    kernel, scratch = (_tpu_fwd_kernel, [(tq, c.lanes), (tq, c.lanes), (tq, d)]) if c.backend == "tpu" \
        else (_gpu_fwd_kernel, [])
    args = (x["q"], x["kc"], x["vc"], x["kb"], x["vb"], x["ra"], x["rs"])
    cost = _cost(x, c, 2, 2, args, out_shape)  # q.k and p.v per entry
    o, lse = _query_tile_call(c, x, kernel, 0, 0, out_shape, ["tile", "row"], scratch, cost=cost)(*args)
    return o, lse[..., 0]


# positional: jax.custom_vjp passes its (non-differentiable, primal) arguments by position
def _backward(q, k_ctx, v_ctx, k_blk, v_blk, anchors, ctx_start, out, lse, do, c: _Cfg):
    x = _prepare(q, k_ctx, v_ctx, k_blk, v_blk, anchors, ctx_start, c)
    batch, hq, t_pad, d = x["q"].shape
    hkv, s_pad = x["kc"].shape[1:3]
    groups, nq, nk = hq // hkv, t_pad // c.tq, s_pad // c.tk
    pad_rows = ((0, 0), (0, 0), (0, t_pad - do.shape[1]))
    do_h = jnp.pad(jnp.swapaxes(do, 1, 2), (*pad_rows, (0, 0)))
    delta = jnp.pad(jnp.einsum("bthd,bthd->bht", do.astype(jnp.float32), out.astype(jnp.float32)), pad_rows)
    lse_l, dl_l = _lanes(lse, c), _lanes(delta, c)

    # dq, and the own-block dk / dv per query head (summed over the GQA group below).
    f32 = jax.ShapeDtypeStruct(x["q"].shape, jnp.float32)
    kernel = _tpu_dq_kernel if c.backend == "tpu" else _gpu_dq_kernel
    args = (x["q"], x["kc"], x["vc"], x["kb"], x["vb"], x["ra"], x["rs"], do_h, lse_l, dl_l)
    dq_shape = (jax.ShapeDtypeStruct(x["q"].shape, q.dtype), f32, f32)
    cost = _cost(x, c, 3, 5, args, dq_shape)  # q.k, do.v, ds.k per entry; own block also ds.q, p.do
    dq, dkb, dvb = _query_tile_call(c, x, kernel, 1, 2, dq_shape, ["tile"] * 3,
                                    [(c.tq, d)] if c.backend == "tpu" else [], cost=cost)(*args)

    # Context dk / dv: per (batch, Hkv, context tile), over the GQA group's heads and the query tiles
    # that see the tile.
    dkv_shape = (jax.ShapeDtypeStruct(x["kc"].shape, k_ctx.dtype), jax.ShapeDtypeStruct(x["vc"].shape, v_ctx.dtype))
    tile_q, tile_k, row = (None, None, c.tq, d), (None, None, c.tk, d), (None, None, c.tq, c.lanes)
    if c.backend == "tpu":
        # Query tiles that see each context tile, compacted per (batch, context tile); the tail repeats
        # the last entry so the index maps stay on tiles already in VMEM.
        kj = jnp.arange(nk)[None, :, None]
        needed = (x["lo"][:, None, :] <= kj) & (kj < x["hi"][:, None, :])  # [B, nk, nq]
        qcount = needed.sum(-1).astype(jnp.int32)
        qlist = jnp.argsort(~needed, axis=-1, stable=True).astype(jnp.int32)
        last = jnp.take_along_axis(qlist, jnp.maximum(qcount - 1, 0)[..., None], axis=-1)
        qlist = jnp.where(jnp.arange(nq) < qcount[..., None], qlist, last)

        def qsel(b, kj_, s, ql, qn):
            return ql[(b * nk + kj_) * nq + jnp.minimum(lax.rem(s, nq), jnp.maximum(qn[b * nk + kj_] - 1, 0))]

        q_map = lambda b, h, kj_, s, ql, qn: (b, h * groups + lax.div(s, nq), qsel(b, kj_, s, ql, qn), 0)
        k_map = lambda b, h, kj_, s, ql, qn: (b, h, kj_, 0)
        ra_spec = pl.BlockSpec((None, c.tq, c.lanes), lambda b, h, kj_, s, ql, qn: (b, qsel(b, kj_, s, ql, qn), 0))
        q_spec, stat_spec = pl.BlockSpec(tile_q, q_map), pl.BlockSpec(row, q_map)
        grid, scratch = (batch, hkv, nk, groups * nq), [(c.tk, d)] * 2
        prefetch = (qlist.reshape(-1), qcount.reshape(-1))
        kernel = functools.partial(_tpu_dkv_kernel, c=c, nq=nq, nk=nk)
    else:
        group_map = lambda b, h, kj_: (b, h, 0, 0)
        k_map = lambda b, h, kj_: (b, h, kj_, 0)
        ra_spec = pl.BlockSpec((None, t_pad), lambda b, h, kj_: (b, 0))
        q_spec = pl.BlockSpec((None, groups, t_pad, d), group_map)
        stat_spec = pl.BlockSpec((None, groups, t_pad, 1), group_map)
        grid, prefetch, scratch = (batch, hkv, nk), (), ()
        kernel = functools.partial(_gpu_dkv_kernel, c=c, nq=nq, groups=groups)
    k_spec = pl.BlockSpec(tile_k, k_map)
    args = (x["q"], x["kc"], x["vc"], x["ra"], x["rs"], do_h, lse_l, dl_l)
    cost = _cost(x, c, 4, 0, args, dkv_shape)  # q.k, do.v, ds.q, p.do per context entry
    dkc, dvc = _call(c, kernel, grid, [q_spec, k_spec, k_spec, ra_spec, ra_spec, q_spec, stat_spec, stat_spec],
                     [k_spec, k_spec], dkv_shape, prefetch, scratch, cost=cost)(*args)

    t, s = x["t"], c.ctx_len
    rows = lambda g, n: jnp.swapaxes(g[:, :, :n], 1, 2)  # [B, H, rows, D] -> [B, n, H, D]
    per_kv = lambda g: g.reshape(batch, hkv, groups, t_pad, d).sum(2)  # sum the GQA group
    return (rows(dq, t), rows(dkc, s), rows(dvc, s),
            rows(per_kv(dkb), t).astype(k_blk.dtype), rows(per_kv(dvb), t).astype(v_blk.dtype))


# positional: jax.custom_vjp passes its (non-differentiable, primal) arguments by position
@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _block_attention(q, k_ctx, v_ctx, k_blk, v_blk, anchors, ctx_start, c):
    return _block_attention_fwd(q, k_ctx, v_ctx, k_blk, v_blk, anchors, ctx_start, c)[0]


# positional: jax.custom_vjp passes its (non-differentiable, primal) arguments by position
def _block_attention_fwd(q, k_ctx, v_ctx, k_blk, v_blk, anchors, ctx_start, c):
    o, lse = _forward(q, k_ctx, v_ctx, k_blk, v_blk, anchors, ctx_start, c)
    out = jnp.swapaxes(o[:, :, :q.shape[1]], 1, 2)
    return out, (q, k_ctx, v_ctx, k_blk, v_blk, anchors, ctx_start, out, lse)  # out: shared with the caller's graph


def _block_attention_bwd(c, res, do):
    return (*_backward(*res, do, c), None, None)  # no cotangent for the integer anchors / context starts


_block_attention.defvjp(_block_attention_fwd, _block_attention_bwd)


@functools.partial(jax.jit, static_argnames=("block_size", "sliding_window", "scale", "interpret", "q_tile",
                                             "k_tile", "backend", "block_causal"))
def block_attention(q, k_ctx, v_ctx, k_blk, v_blk, anchors, *, block_size: int, sliding_window: int | None = None,
                    scale: float | None = None, interpret: bool | None = None, q_tile: int = 128,
                    k_tile: int = 128, backend: str | None = None, ctx_start=None, block_causal: bool = False):
    """Pallas block attention (shapes in the module docstring); differentiable in q, k_*, v_*.

    ``block_causal``: each block sees its own keys causally (j <= i) instead of bidirectionally.

    ``backend``: "tpu" (Mosaic formulation) or "gpu" (Triton); default: the platform of the default
    backend, and the TPU formulation on CPU. ``interpret``: default True on CPU. ``q_tile`` is rounded
    to whole blocks (and to what the backend needs); ``k_tile`` context keys per tile.

    Skipping works per query tile (``q_tile // Bk`` consecutive blocks): a tile computes the context
    tiles from its smallest context start (or window start) up to its largest anchor. Blocks are
    independent, so callers should order each row's blocks by anchor (sorted anchors): at S=3072, N=512,
    Bk=16 the kernel then evaluates ~16% of the dense score entries instead of ~26% for random order
    (``python -m dflash_jax.kernels.bench``).
    """
    _check_shapes(q, k_ctx, v_ctx, k_blk, v_blk, anchors, block_size, ctx_start)
    backend, interpret = resolve_backend(backend, interpret)
    tq, tk = pick_tiles(anchors.shape[1], block_size, k_ctx.shape[1], q_tile, k_tile, backend, interpret)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    c = _Cfg(bk=block_size, window=sliding_window, block_causal=bool(block_causal), scale=scale, tq=tq, tk=tk,
             ctx_len=k_ctx.shape[1], backend=backend, interpret=interpret)
    ctx_start = jnp.zeros_like(anchors, jnp.int32) if ctx_start is None else ctx_start.astype(jnp.int32)
    return _block_attention(q, k_ctx, v_ctx, k_blk, v_blk, anchors.astype(jnp.int32), ctx_start, c)


def kernel_supported(*, block_size: int, head_dim: int) -> bool:
    """Whether the compiled kernel is expected to run on the default backend."""
    p = platform()
    if p == "tpu":
        return True
    pow2 = lambda x: x & (x - 1) == 0
    return p == "gpu" and gpu_capable() and pow2(block_size) and pow2(head_dim) and head_dim >= 16

