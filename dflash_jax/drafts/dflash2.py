"""DFlash2's own layers: the grouped dynamic causal convolution around each draft sublayer and the candidate
selector's codebooks (the walk over them is ``dflash_jax.drafts.model.select``)."""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from dflash_jax.layers import Linear, initializer


class DynamicConv(nn.Module):
    """DFlash2's grouped dynamic causal convolution over each block's positions (never the context):
    conv(x, d, b)[t, c] = sum_{o<K} (b[o, c] + d[t, o, c // gs]) * x[t-o, c], x before the block's start = 0.
    ``prepare`` convolves the sublayer input with the first kernel and returns the second, projected from
    the same input, for ``finish`` to convolve the sublayer output with."""

    hidden: int
    kernel_size: int
    group_size: int

    def setup(self):
        self.base_kernel = self.param("base_kernel", nn.with_logical_partitioning(initializer("base_kernel"),
                                                                                  (None, None, "embed")),
                                      (2, self.kernel_size, self.hidden))
        self.kernel_projection = Linear(2 * self.kernel_size * (self.hidden // self.group_size), False,
                                        ("embed", None))

    def _conv(self, x, dyn, base, block: int):
        """x [B, L, H] (L = N blocks of ``block``), dyn [B, L, K, G], base [K, H] -> [B, L, H]."""
        b, length, h = x.shape
        xb = x.reshape(b, length // block, block, h)
        dyn = jnp.repeat(dyn.reshape(b, length // block, block, self.kernel_size, -1), self.group_size, axis=-1)
        out = jnp.zeros_like(xb)
        for o in range(min(self.kernel_size, block)):
            shifted = jnp.pad(xb[:, :, :block - o], ((0, 0), (0, 0), (o, 0), (0, 0)))
            out = out + (jnp.asarray(base[o], x.dtype) + dyn[:, :, :, o]) * shifted
        return out.reshape(x.shape)

    def prepare(self, x, block: int):
        dyn = self.kernel_projection(x).reshape(*x.shape[:2], 2, self.kernel_size, -1)
        return self._conv(x, dyn[:, :, 0], self.base_kernel[0], block), dyn[:, :, 1]

    def finish(self, x, dyn, block: int):
        return self._conv(x, dyn, self.base_kernel[1], block)


class CandidateSelector(nn.Module):
    """DFlash2's selector parameters: ``hidden_projection`` [H -> r] and the [V, r] predecessor / successor
    codebooks (``select`` walks them)."""

    vocab: int
    rank: int

    def setup(self):
        self.hidden_projection = Linear(self.rank, False, ("embed", None))
        init = lambda name: nn.with_logical_partitioning(initializer(name), ("vocab", None))  # noqa: E731
        self.predecessor_codebook = self.param("predecessor_codebook", init("predecessor_codebook"),
                                               (self.vocab, self.rank))
        self.successor_codebook = self.param("successor_codebook", init("successor_codebook"), (self.vocab, self.rank))

    def __call__(self, h):
        """Final-normed hidden [B, T, H] -> (u [B, T, r], predecessor [V, r], successor [V, r])."""
        return self.hidden_projection(h), self.predecessor_codebook, self.successor_codebook
