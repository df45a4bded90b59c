"""Attention for target and draft: the dense reference and position mask, and the draft's block attention.

``attend`` and ``position_mask`` (the one reference, shared by target and draft) live with the Pallas
kernel in ``kernels/`` (installed as ``dflash_jax.kernels``) and are re-exported here;
``block_attention`` below dispatches the draft's training attention to the kernel on TPU/GPU and to
the dense reference on CPU.
"""
from __future__ import annotations

from dflash_jax.kernels.block_attention import block_attention as block_attention_kernel
from dflash_jax.kernels.block_attention import block_attention_reference, kernel_supported
from dflash_jax.kernels.reference import attend, position_mask

__all__ = ["attend", "block_attention", "position_mask"]


def block_attention(q, k_ctx, v_ctx, k_blk, v_blk, anchors, *, block_size: int,
                    sliding_window: int | None = None, scale: float | None = None, impl: str = "auto", ctx_start=None):
    """The draft's training attention: N blocks of ``block_size`` queries, block b anchored at ``anchors[:, b]``.

    q [B, N*Bk, Hq, D]; k_ctx, v_ctx [B, S, Hkv, D]; k_blk, v_blk [B, N*Bk, Hkv, D]; anchors [B, N] int32
    (negative = padding block); ``ctx_start`` [B, N] int32 or None (0). Block b sees context positions in
    [ctx_start, anchor) (within the window) and its own block bidirectionally. ``impl``: "auto" (Pallas kernel on TPU / GPU with compute capability >= 8.0,
    the dense reference elsewhere), "kernel", "reference" or "interpret" (kernel on CPU).
    See ``kernels/block_attention.py``.
    """
    if impl == "auto":
        impl = "kernel" if kernel_supported(block_size=block_size, head_dim=q.shape[-1]) else "reference"
    if impl == "reference":
        return block_attention_reference(q, k_ctx, v_ctx, k_blk, v_blk, anchors, block_size=block_size,
                                         sliding_window=sliding_window, scale=scale, ctx_start=ctx_start)
    if impl not in ("kernel", "interpret"):
        raise ValueError(f"impl must be auto, kernel, reference or interpret, not {impl!r}")
    return block_attention_kernel(q, k_ctx, v_ctx, k_blk, v_blk, anchors, block_size=block_size,
                                  sliding_window=sliding_window, scale=scale, interpret=impl == "interpret",
                                  ctx_start=ctx_start)
