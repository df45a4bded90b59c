"""Attention for target and draft: the dense reference and position mask, the draft's block attention and
the length-bounded decode attention.

``attend`` and ``position_mask`` (the one reference, shared by target and draft) live with the Pallas
kernels in ``dflash_jax/kernels/`` and are re-exported here;
``block_attention`` below dispatches the draft's training attention to the kernel on TPU/GPU and to
the dense reference on CPU; ``decode_attention`` dispatches decode / verify / draft-decode attention to
the Pallas decode kernel on TPU/GPU and to the tiled jnp loop elsewhere (both read only the key tiles
below each row's length); ``paged_decode_attention`` does the same over a paged cache (the paged kernel reads
the rows' pages in place; the loop and reference gather them first); ``stacked_decode_attention`` the same over
a scanned group's stacked caches (``state.Stacked``). On a mesh (the trace's abstract mesh) the
kernels run per shard under ``shard_map`` (``sharding.per_shard``): rows over data*fsdp, heads over tensor.
"""
from __future__ import annotations

import jax.numpy as jnp

from dflash_jax.kernels.block_attention import block_attention as block_attention_kernel
from dflash_jax.kernels.block_attention import block_attention_reference, kernel_supported
from dflash_jax.kernels.decode_attention import MAX_QUERIES, decode_attention_loop, decode_attention_reference
from dflash_jax.kernels.decode_attention import decode_attention as decode_attention_kernel
from dflash_jax.kernels.decode_attention import decode_kernel_supported, stacked_attention_loop
from dflash_jax.kernels.paged_attention import gather_pages, paged_decode_attention_loop, paged_kernel_supported
from dflash_jax.kernels.paged_attention import paged_decode_attention as paged_decode_attention_kernel
from dflash_jax.kernels.reference import attend, position_mask
from dflash_jax.sharding.per_shard import attention_per_shard
from dflash_jax.state import PAGE_AXES, FullKV, PagedKV, view_page

__all__ = ["DECODE_IMPLS", "MAX_QUERIES", "attend", "block_attention", "decode_attention", "paged_decode_attention",
           "position_mask", "stacked_decode_attention"]

DECODE_IMPLS = ("auto", "kernel", "interpret", "loop", "reference")
_ROWS = ("batch", "length", "heads", "head_dim")  # block attention's q / k / v: [B, T, H(kv), D]
_KV_ROWS = ("batch", "length", "kv_heads", "head_dim")
_CACHE = ("cache_batch", "cache_len", "cache_kv_heads", "cache_head_dim")  # decode attention's k, v, k_new, v_new
_QUERIES = ("cache_batch", "cache_len", "cache_heads", "cache_head_dim")
_STACK = ("cache_batch", "layers", "cache_len", "cache_kv_heads", "cache_head_dim")  # a scanned group's k, v


def block_attention(q, k_ctx, v_ctx, k_blk, v_blk, anchors, *, block_size: int,
                    sliding_window: int | None = None, scale: float | None = None, impl: str = "auto",
                    ctx_start=None, block_causal: bool = False):
    """The draft's training attention: N blocks of ``block_size`` queries, block b anchored at ``anchors[:, b]``.

    q [B, N*Bk, Hq, D]; k_ctx, v_ctx [B, S, Hkv, D]; k_blk, v_blk [B, N*Bk, Hkv, D]; anchors [B, N] int32
    (negative = padding block); ``ctx_start`` [B, N] int32 or None (0). Block b sees context positions in
    [ctx_start, anchor) (within the window) and its own block bidirectionally, or causally with
    ``block_causal`` (token i sees block tokens j <= i; within the window i - j < W). ``impl``: "auto" (Pallas
    kernel on TPU / GPU with compute capability >= 8.0, the dense reference elsewhere), "kernel",
    "reference" or "interpret" (kernel on CPU). See ``dflash_jax/kernels/block_attention.py``.
    """
    if impl == "auto":
        impl = "kernel" if kernel_supported(block_size=block_size, head_dim=q.shape[-1]) else "reference"
    if impl == "reference":
        return block_attention_reference(q, k_ctx, v_ctx, k_blk, v_blk, anchors, block_size=block_size,
                                         sliding_window=sliding_window, scale=scale, ctx_start=ctx_start,
                                         block_causal=block_causal)
    if impl not in ("kernel", "interpret"):
        raise ValueError(f"impl must be auto, kernel, reference or interpret, not {impl!r}")
    # positional: one shard's operands, in the order attention_per_shard passes them
    def kernel(q, k_ctx, v_ctx, k_blk, v_blk, anchors, ctx_start):
        return block_attention_kernel(q, k_ctx, v_ctx, k_blk, v_blk, anchors, block_size=block_size,
                                      sliding_window=sliding_window, scale=scale, interpret=impl == "interpret",
                                      ctx_start=ctx_start, block_causal=block_causal)

    return attention_per_shard(kernel, (q, k_ctx, v_ctx, k_blk, v_blk, anchors, ctx_start),
                               (_ROWS, _KV_ROWS, _KV_ROWS, _KV_ROWS, _KV_ROWS, ("batch",), ("batch",)),
                               what="block attention")


# positional: the attention operands (q, k, v, and their positions / lengths / masks), one order throughout
def decode_attention(q, k, v, q_pos, lengths, k_new=None, v_new=None, *, sliding_window: int | None = None,
                     sinks=None, impl: str = "auto", new_causal: bool = False, new_mask=None,
                     scale: float | None = None):
    """New queries q [B, T, Hq, D] at ``q_pos`` [B, T] against a cache k [B, S, Hkv, D], v [B, S, Hkv, Dv] (slot =
    position; Dv may differ from D, the output is [B, T, Hq, Dv]) of which row b may see slots < ``lengths[b]``
    (and <= the query's position, within the window), plus optionally the queries' own keys ``k_new`` / ``v_new``
    [B, T, Hkv, D / Dv]: bidirectionally within the window,
    causally with ``new_causal`` (own keys at positions <= the query's), or as ``new_mask`` [B, T, T] bool says
    (tree verification: query t sees own key u iff new_mask[b, t, u]; no window); see
    ``dflash_jax/kernels/decode_attention.py``. ``impl``: "auto" (the Pallas kernel on one TPU / GPU where supported,
    the tiled jnp loop elsewhere), "kernel", "interpret" (kernel on CPU), "loop" or "reference" (dense and
    masked over the whole cache: the unbounded path, for comparison). ``scale``: of q . k (None: D ** -0.5)."""
    if impl == "auto":
        supported = decode_kernel_supported(head_dim=q.shape[-1], kv_heads=k.shape[2], ctx_len=k.shape[1],
                                            v_head_dim=v.shape[-1])
        impl = "kernel" if supported else "loop"
    kw = dict(sliding_window=sliding_window, sinks=sinks, new_causal=new_causal, new_mask=new_mask, scale=scale)
    if impl == "reference":
        return decode_attention_reference(q, k, v, q_pos, lengths, k_new=k_new, v_new=v_new, **kw)
    if impl == "loop":
        return decode_attention_loop(q, k, v, q_pos, lengths, k_new, v_new, **kw)
    if impl not in ("kernel", "interpret"):
        raise ValueError(f"impl must be one of {', '.join(DECODE_IMPLS)}, not {impl!r}")
    # positional: one shard's operands, in the order attention_per_shard passes them
    def kernel(q, k, v, q_pos, lengths, k_new, v_new, sinks, new_mask):
        return decode_attention_kernel(q, k, v, q_pos, lengths, k_new, v_new, interpret=impl == "interpret",
                                       **{**kw, "sinks": sinks, "new_mask": new_mask})

    return attention_per_shard(kernel, (q, k, v, q_pos, lengths, k_new, v_new, sinks, new_mask),
                               (_QUERIES, _CACHE, _CACHE, ("cache_batch",), ("cache_batch",), _CACHE, _CACHE,
                                ("cache_heads",), ("cache_batch",)), what="decode attention")


# positional: the attention operands (q, k, v, and their positions / lengths / masks), one order throughout
def paged_decode_attention(q, k_pages, v_pages, table, q_pos, lengths, k_new=None, v_new=None, *,
                           sliding_window: int | None = None, sinks=None, impl: str = "auto", new_causal: bool = False,
                           new_mask=None, scale: float | None = None):
    """``decode_attention`` over a paged cache (``state.PagedKV``): pools k_pages [P, page, Hkv, D], v_pages
    [P, page, Hkv, Dv] and the rows' block table [B, n] (row b's slot s in page table[b, s // page] at offset
    s % page; entries >= P: no page, past the row's length); see ``dflash_jax/kernels/paged_attention.py``.
    ``impl``: "auto" (the paged Pallas kernel on one TPU / GPU where supported, else the loop), "kernel",
    "interpret" (kernel on CPU), "loop" (the tiled jnp loop, gathering a tile of pages at a time up to the longest
    row) or "reference" (dense over the gathered pages)."""
    if impl == "auto":
        supported = paged_kernel_supported(head_dim=q.shape[-1], kv_heads=k_pages.shape[2], page=k_pages.shape[1],
                                           v_head_dim=v_pages.shape[-1])
        impl = "kernel" if supported else "loop"
    kw = dict(sliding_window=sliding_window, sinks=sinks, new_causal=new_causal, new_mask=new_mask, scale=scale)
    if impl == "loop":  # a tile of pages at a time, up to the longest row
        return paged_decode_attention_loop(q, k_pages, v_pages, table, q_pos, lengths, k_new, v_new, **kw)
    if impl == "reference":  # the pages gathered into rows (``PagedKV.view``)
        return decode_attention(q, gather_pages(k_pages, table), gather_pages(v_pages, table), q_pos, lengths, k_new,
                                v_new, impl=impl, **kw)
    if impl not in ("kernel", "interpret"):
        raise ValueError(f"impl must be one of {', '.join(DECODE_IMPLS)}, not {impl!r}")
    # positional: one shard's operands, in the order attention_per_shard passes them
    def kernel(q, k_pages, v_pages, table, q_pos, lengths, k_new, v_new, sinks, new_mask):
        return paged_decode_attention_kernel(q, k_pages, v_pages, table, q_pos, lengths, k_new, v_new,
                                             interpret=impl == "interpret", **{**kw, "sinks": sinks,
                                                                               "new_mask": new_mask})

    return attention_per_shard(kernel, (q, k_pages, v_pages, table, q_pos, lengths, k_new, v_new, sinks, new_mask),
                               (_QUERIES, PAGE_AXES, PAGE_AXES, ("cache_batch", "cache_len"), ("cache_batch",),
                                ("cache_batch",), _CACHE, _CACHE, ("cache_heads",), ("cache_batch",)),
                               what="paged decode attention")


# positional: the attention operands (q, k, v, the layer, and their positions / lengths / masks), one order throughout
def stacked_decode_attention(q, k, v, layer, q_pos, lengths, k_new=None, v_new=None, *,
                             sliding_window: int | None = None, sinks=None, impl: str = "auto",
                             new_causal: bool = False, new_mask=None, scale: float | None = None):
    """``decode_attention`` over layer ``layer`` (a traced index) of a scanned group's full caches k [B, n, S, Hkv, D],
    v [B, n, S, Hkv, Dv] (``state.Stacked``), never a slice of the layer (a copy of it, inside a scan): "loop" reads
    its key tiles from the stack (``stacked_attention_loop``), the kernels each shard's rows as pages
    (``state.FullKV.pages``, a reshape) through the paged kernel; "reference" is dense over the layer's slice."""
    if impl == "auto":
        supported = paged_kernel_supported(head_dim=q.shape[-1], kv_heads=k.shape[3], page=view_page(k.shape[2]),
                                           v_head_dim=v.shape[-1])
        impl = "kernel" if supported else "loop"
    kw = dict(sliding_window=sliding_window, sinks=sinks, new_causal=new_causal, new_mask=new_mask, scale=scale)
    if impl == "loop":
        return stacked_attention_loop(q, k, v, layer, q_pos, lengths, k_new, v_new, **kw)
    if impl == "reference":
        return decode_attention(q, *FullKV(k, v, layer).view(), q_pos, lengths, k_new, v_new, impl=impl, **kw)
    if impl not in ("kernel", "interpret"):
        raise ValueError(f"impl must be one of {', '.join(DECODE_IMPLS)}, not {impl!r}")

    # positional: one shard's operands, in the order attention_per_shard passes them
    def local(q, k, v, layer, q_pos, lengths, k_new, v_new, sinks, new_mask):
        return paged_decode_attention(q, *FullKV(k, v, layer).pages(), q_pos, lengths, k_new, v_new, impl=impl,
                                      **{**kw, "sinks": sinks, "new_mask": new_mask})

    return attention_per_shard(local, (q, k, v, layer, q_pos, lengths, k_new, v_new, sinks, new_mask),
                               (_QUERIES, _STACK, _STACK, (), ("cache_batch",), ("cache_batch",), _CACHE, _CACHE,
                                ("cache_heads",), ("cache_batch",)), what="stacked decode attention")


def injected_attention(layer, h, positions, anchors, k_ctx, v_ctx, *, impl: str, decode: bool, ctx_start=None,
                       block_len=None):
    """A draft layer's attention on its normed input h [B, N*Bk, D]: the block's queries against the injected
    context K/V plus the block's own keys, through ``layer.self_attn`` (its projections, norms, rope and scale) ->
    the output projection [B, N*Bk, D]. ``decode`` False (training, N blocks per row): ``block_attention`` with
    ``impl`` (and ``ctx_start``); True (one block per row): ``decode_attention`` with ``impl`` (and
    ``block_len``)."""
    block = h.shape[1] // anchors.shape[1]
    q = layer.self_attn.queries(h, positions)
    k, v = layer.self_attn.keys_values(h, positions)
    window = layer.cfg.layer_window(layer.index)
    causal = layer.draft is not None and layer.draft.layer_causal(layer.index)
    scale = layer.self_attn.attention_scale()
    if not decode:
        o = block_attention(q, k_ctx, v_ctx, k, v, anchors, block_size=block, sliding_window=window, impl=impl,
                            ctx_start=ctx_start, block_causal=causal, scale=scale)
    else:  # one block per row: context slots < its anchor, its own block (positions < block_len, if given)
        live = anchors >= 0
        if block_len is not None:
            live = live & (jnp.arange(block)[None] < block_len[:, None])
        q_pos = jnp.where(live, positions, -1)
        kw = dict(sliding_window=window, impl=impl, new_causal=causal, scale=scale)
        if isinstance(k_ctx, PagedKV):  # the engine's paged context, read in place (``cache_kv``)
            o = paged_decode_attention(q, k_ctx.k, k_ctx.v, k_ctx.table, q_pos, jnp.maximum(anchors[:, 0], 0), k, v,
                                       **kw)
        else:
            o = decode_attention(q, k_ctx, v_ctx, q_pos, jnp.maximum(anchors[:, 0], 0), k, v, **kw)
    return layer.self_attn.output(o)
