"""Static-shaped KV caches as pytrees: one [B, S, K, H] array per layer, slot index == absolute position.

``lengths`` [B] counts each row's committed tokens. New K/V are scattered at their own positions
(out-of-range writes are dropped, never clamped onto live slots); rollback only lowers ``lengths``:
stale slots stay behind but are masked by position and overwritten before they become visible.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class KVCache:
    k: tuple  # per layer [B, S, K, H]
    v: tuple
    lengths: jax.Array  # [B] int32

    @classmethod
    def create(cls, num_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int, dtype) -> "KVCache":
        shape = (batch, max_len, kv_heads, head_dim)
        zeros = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
        return cls(k=zeros, v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                   lengths=jnp.zeros((batch,), jnp.int32))

    @classmethod
    def for_model(cls, cfg, batch: int, max_len: int, dtype) -> "KVCache":
        """An empty cache for every layer of ``cfg`` (a TargetConfig: a target's, or a draft's layer stack)."""
        return cls.create(cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim, dtype)

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    def write(self, layer: int, k_new, v_new, positions) -> "KVCache":
        """Store k_new/v_new [B, T, K, H] at ``positions`` [B, T] of ``layer``; lengths unchanged."""
        rows = jnp.arange(positions.shape[0])[:, None]
        k = self.k[layer].at[rows, positions].set(k_new.astype(self.k[layer].dtype), mode="drop")
        v = self.v[layer].at[rows, positions].set(v_new.astype(self.v[layer].dtype), mode="drop")
        replace = lambda t, x: t[:layer] + (x,) + t[layer + 1:]  # noqa: E731
        return self.replace(k=replace(self.k, k), v=replace(self.v, v))

    def slot_positions(self):
        """Absolute position of every slot, [S]."""
        return jnp.arange(self.max_len, dtype=jnp.int32)
