"""Paged decode attention: ``decode_attention`` over a cache held in pages of one pool shared by every row.

Row b's slot s lives in page ``table[b, s // page]`` at offset ``s % page`` of the pools k_pages
[P, page, Hkv, D] / v_pages [P, page, Hkv, Dv]; a table entry >= P is no page (it must lie past the row's
length: never read). Everything else (q, q_pos, lengths, the own keys k_new / v_new, ``new_mask``, window,
sinks, scale; shapes and semantics) is ``decode_attention``'s over the row's pages in table order, which is
what the reference computes: gather the pages (``PagedKV.view``), then ``decode_attention_reference``.

The kernels are the decode kernels with a key tile of one page, read in place through the block table:
TPU (Mosaic): the table is scalar-prefetched beside each row's page range, and the K/V index map of grid step
j names page table[b, j] (steps outside the range stay on a page already in VMEM: no DMA, no compute);
GPU (Triton): each (row, K/V head) program's ``fori_loop`` over its page range loads page table[b, j] from
the whole pools. A step costs what the row's pages cost; the pools are never gathered.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import tiling
from .decode_attention import _Cfg, _check_new, _gpu_call, _pallas, _tpu_call, decode_attention_reference, flat
from .decode_attention import decode_kernel_supported, online_loop


def gather_pages(pool, table):
    """Every row's pages in table order: pool [P, page, ...] x table [B, n] -> [B, n*page, ...]; entries
    >= P read the last page (past the row's length: masked). ``PagedKV.view`` of one pool."""
    at = jnp.clip(table, 0, pool.shape[0] - 1)
    return pool[at].reshape(at.shape[:1] + (-1,) + pool.shape[2:])


# keys per tile of the CPU paged loop: a tile is gathered and computed whole, so a short row pays for the tile, not
# its length (a row is shorter than a slots cache's whole length, which the dense loop's 512 tile follows); 128
# against 512 (a 1-row paged engine of the demo target, 128 new tokens, same run): 72 vs 97 ms a request, the
# closed batch 63 ms; at 700 new tokens within noise
PAGED_LOOP_TILE = 128


# positional: the attention operands (q, the pools and table, positions / lengths, own keys), one order throughout
@functools.partial(jax.jit, static_argnames=("sliding_window", "scale", "k_tile", "new_causal"))
def paged_decode_attention_loop(q, k_pages, v_pages, table, q_pos, lengths, k_new=None, v_new=None, *,
                                sliding_window=None, sinks=None, scale=None, k_tile: int = PAGED_LOOP_TILE,
                                new_causal=False, new_mask=None):
    """``decode_attention_loop`` reading each key tile's pages through the table (tiles of whole pages): only the
    pages below the batch's longest row are gathered, a tile at a time (the CPU path)."""
    page, cols = k_pages.shape[1], table.shape[1]
    per_tile = max(min(k_tile, cols * page) // page, 1)
    at = jnp.clip(table, 0, k_pages.shape[0] - 1)

    def tile(start):
        pages = jax.lax.dynamic_slice_in_dim(at, start // page, per_tile, axis=1)  # [B, per_tile]
        read = lambda pool: pool[pages].reshape(pages.shape[:1] + (-1,) + pool.shape[2:])  # noqa: E731
        return read(k_pages), read(v_pages)

    return online_loop(q, tile, per_tile * page, cols * page, k_pages.shape[2], v_pages.shape[-1], q_pos, lengths,
                       k_new, v_new, sliding_window=sliding_window, sinks=sinks, scale=scale, new_causal=new_causal,
                       new_mask=new_mask)


def paged_decode_attention_reference(q, k_pages, v_pages, table, q_pos, lengths, *, k_new=None, v_new=None,
                                     sliding_window=None, sinks=None, scale=None, new_causal=False, new_mask=None):
    """The pages gathered into rows, then the dense decode reference: what the kernel must equal."""
    return decode_attention_reference(q, gather_pages(k_pages, table), gather_pages(v_pages, table), q_pos,
                                      lengths, k_new=k_new, v_new=v_new, sliding_window=sliding_window,
                                      sinks=sinks, scale=scale, new_causal=new_causal, new_mask=new_mask)


def _launch(table, c: _Cfg, args, out_shape, cost, first, end):
    """The kernel over the pools through ``table`` [B, n] (in-range pages); ``first`` / ``end`` [B]: each
    row's page range."""
    if c.backend == "tpu":
        return _tpu_call(c, args, out_shape, cost, paged=True)(first, end, table.reshape(-1), *args)
    args = flat(args)
    pools = tuple(x.reshape(-1, x.shape[-1]) for x in args[1:3])  # [P, page, K*D] -> [P*page, K*D]: free
    args = (args[0], *pools, *args[3:])
    return _gpu_call(c, args, out_shape, cost, paged=True)(*args, table)


# positional: the attention operands (q, k, v, and their positions / lengths / masks), one order throughout
@functools.partial(jax.jit, static_argnames=("sliding_window", "scale", "interpret", "backend", "new_causal"))
def paged_decode_attention(q, k_pages, v_pages, table, q_pos, lengths, k_new=None, v_new=None, *,
                           sliding_window=None, sinks=None, scale=None, interpret: bool | None = None,
                           backend: str | None = None, new_causal: bool = False, new_mask=None):
    """The Pallas paged decode attention (module docstring); ``backend`` / ``interpret`` as
    ``decode_attention``'s. The page is the key tile: TPU a multiple of 8, GPU a power of two >= 16."""
    _check_new(k_new, new_mask)
    backend, interpret = tiling.resolve_backend(backend, interpret)
    page = k_pages.shape[1]
    c = _Cfg(window=sliding_window, scale=q.shape[-1] ** -0.5 if scale is None else float(scale), tk=page,
             ctx_len=table.shape[1] * page, has_new=k_new is not None, new_causal=bool(new_causal),
             has_mask=new_mask is not None, has_sinks=sinks is not None, backend=backend, interpret=interpret)
    table = jnp.clip(table, 0, k_pages.shape[0] - 1).astype(jnp.int32)  # no page: a real one, never read
    return _pallas(q, k_pages, v_pages, q_pos.astype(jnp.int32), lengths.astype(jnp.int32), k_new, v_new, new_mask,
                   sinks, c, functools.partial(_launch, table))


def paged_kernel_supported(*, head_dim: int, kv_heads: int, page: int, v_head_dim: int | None = None) -> bool:
    """``decode_kernel_supported`` with a page as the key tile (TPU: whole tiles of 8 sublanes; GPU: Triton
    loads a power-of-two page of >= 16 rows)."""
    pow2 = page & (page - 1) == 0
    return decode_kernel_supported(head_dim=head_dim, kv_heads=kv_heads, ctx_len=page, v_head_dim=v_head_dim) and (
        pow2 or tiling.platform() != "gpu")
