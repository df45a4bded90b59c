"""The one dense attention reference (masked, GQA) and the position mask, shared by target, draft and kernel.

They live with the kernel so that the kernel package depends on nothing in the library; the library
imports them from here (``dflash_jax.attention`` re-exports them).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_MASKED = -1e30  # finite, so a row with no visible key gives a uniform softmax that we then zero


def position_mask(q_pos, k_pos, *, causal: bool, sliding_window: int | None = None, k_valid=None):
    """Visibility [B, T, S] from absolute positions.

    q_pos [B, T], k_pos [B, S] (or [S]); ``k_valid`` [B, S] or [B, T, S] marks keys that exist.
    Causal: key pos <= query pos. Sliding window W: |query pos - key pos| < W (one-sided when causal).
    """
    q = q_pos[:, :, None]
    k = k_pos[None, None, :] if k_pos.ndim == 1 else k_pos[:, None, :]
    visible = jnp.ones(jnp.broadcast_shapes(q.shape, k.shape), dtype=bool)
    if causal:
        visible &= k <= q
    if sliding_window is not None:
        visible &= jnp.abs(q - k) < sliding_window
    if k_valid is not None:
        visible &= k_valid if k_valid.ndim == 3 else k_valid[:, None, :]
    return visible


def attend(q, k, v, mask, *, scale: float | None = None, sinks=None):
    """softmax(q k^T * scale, masked) v with grouped K/V heads.

    q [B, T, N, H]; k [B, S, K, H]; v [B, S, K, Hv] (Hv may differ from H: MiMo-V2-Flash, MLA) with N a
    multiple of K; returns [B, T, N, Hv]; mask [B, T, S] bool; ``sinks`` [N] (gpt-oss): one learned logit per
    query head that joins the softmax denominator and carries no value.
    Logits and softmax in float32; a query with no visible key returns zeros.
    """
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    if n % kv_heads:
        raise ValueError(f"{n} query heads is not a multiple of {kv_heads} key/value heads")
    scale = h ** -0.5 if scale is None else scale
    qg = q.reshape(b, t, kv_heads, n // kv_heads, h)
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32) * scale
    m = mask[:, None, None, :, :]
    logits = jnp.where(m, logits, _MASKED)
    if sinks is None:
        probs = jax.nn.softmax(logits, axis=-1)
    else:
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, kv_heads, n // kv_heads, 1, 1),
                                logits.shape[:-1] + (1,))
        probs = jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1]
    probs = jnp.where(m, probs, 0.0).astype(v.dtype)
    out = jnp.einsum("BKGTS,BSKV->BTKGV", probs, v)
    return out.reshape(b, t, n, v.shape[-1])
