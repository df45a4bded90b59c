"""Routed experts shared by the mixture-of-experts families: tokens + their top-k (expert, weight) in,
the weighted sum of those experts' gated MLPs out.

Parameters are stacked over experts, ``[E, in, out]`` like every Linear kernel here: ``gate_up_proj``
[E, D, 2I] (gate and up fused: ``concat`` = [gate | up] as Qwen3-MoE, ``interleave`` = gate, up
alternating as gpt-oss), ``down_proj`` [E, I, D], optional biases ``gate_up_proj_bias`` [E, 2I] and
``down_proj_bias`` [E, D]. Logical axes ``expert`` / ``embed`` / ``mlp`` shard them over the mesh.

Dispatch, chosen statically from the shapes:
  * few tokens (decode: 4 T k <= E): a loop over the (token, choice) pairs, each running its expert on its
    token with that expert's weights read in place (a dynamic slice feeding the matmul): only the picked
    experts are read, and no expert runs for a token that did not pick it;
  * more tokens (a verify block, prefill, training): token copies are sorted by expert and multiplied group
    by group with ``jax.lax.ragged_dot`` (a grouped matmul), then scattered back with their routing weights.
A gather of the picked experts' weights is what XLA:TPU cannot do in place: it slices the whole stacked weight
into pieces first (2.2x every expert's bytes through HBM for one token's 8 of 128 experts, on paper); the loop
reads the 8. The grouped matmul reads every expert once, and a loop step costs a little time of its own, so
past a quarter of the experts picked the grouped matmul is the cheaper.
"""
from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from dflash_jax.layers import initializer

# The families with experts declare this rule: the experts' weights split over the mesh's ``expert`` axis.
LOGICAL_RULES = (("expert", "expert"),)


def clamped_swiglu(gate, up, alpha: float, limit: float):
    """gpt-oss: gate clamped above at ``limit``, up to [-limit, limit]; (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


class Experts(nn.Module):
    """``num_experts`` gated MLPs; ``__call__(x [T, D], index [T, k], weight [T, k]) -> [T, D]``."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    use_bias: bool = False
    gate_up_layout: str = "concat"  # "concat" | "interleave"
    swiglu_alpha: float | None = None  # set (with swiglu_limit): gpt-oss's clamped SwiGLU, else silu(gate) * up
    swiglu_limit: float | None = None
    activation: Callable = nn.silu  # act(gate) * up otherwise (Gemma 4: ``layers.gelu_tanh``)

    def setup(self):
        e, d, i = self.num_experts, self.hidden_size, self.intermediate_size
        box = nn.with_logical_partitioning
        self.gate_up_proj = self.param("gate_up_proj", box(initializer("gate_up_proj"), ("expert", "embed", "mlp")),
                                       (e, d, 2 * i))
        self.down_proj = self.param("down_proj", box(initializer("down_proj"), ("expert", "mlp", "embed")), (e, i, d))
        if self.use_bias:
            self.gate_up_proj_bias = self.param("gate_up_proj_bias", box(initializer("gate_up_proj_bias"),
                                                                         ("expert", "mlp")), (e, 2 * i))
            self.down_proj_bias = self.param("down_proj_bias", box(initializer("down_proj_bias"), ("expert", "embed")),
                                             (e, d))

    def _act(self, h):
        """[..., 2I] fused gate/up -> [..., I]."""
        if self.gate_up_layout == "interleave":
            gate, up = h[..., ::2], h[..., 1::2]
        else:
            gate, up = jnp.split(h, 2, axis=-1)
        if self.swiglu_alpha is not None:
            return clamped_swiglu(gate, up, self.swiglu_alpha, self.swiglu_limit)
        return self.activation(gate) * up

    def __call__(self, x, index, weight):
        t, k = index.shape
        if 4 * t * k <= self.num_experts:
            return self._per_pair(x, index, weight)
        return self._grouped(x, index, weight)

    def _per_pair(self, x, index, weight):
        """Each token runs its own k experts: a loop over the (token, choice) pairs, each pair's expert weights
        read in place."""
        dt = x.dtype
        t, k = index.shape
        w_in, w_out = jnp.asarray(self.gate_up_proj, dt), jnp.asarray(self.down_proj, dt)
        take = lambda w, e: jax.lax.dynamic_index_in_dim(w, e, 0, keepdims=False)  # noqa: E731

        def pair(args):
            e, row = args  # an expert, a token [D]
            h = jnp.einsum("D,DF->F", row, take(w_in, e))
            if self.use_bias:
                h = h + take(jnp.asarray(self.gate_up_proj_bias, dt), e)
            out = jnp.einsum("I,ID->D", self._act(h), take(w_out, e))
            return out + take(jnp.asarray(self.down_proj_bias, dt), e) if self.use_bias else out

        out = jax.lax.map(pair, (index.reshape(-1), jnp.repeat(x, k, axis=0)))  # [T*k, D]
        return jnp.einsum("TKD,TK->TD", out.reshape(t, k, -1), weight.astype(dt))

    def _grouped(self, x, index, weight):
        """Token copies sorted by expert, one grouped matmul per projection (``ragged_dot``)."""
        dt = x.dtype
        t, k = index.shape
        flat = index.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        expert = flat[order]
        rows = x[order // k]  # [T*k, D]
        sizes = jnp.bincount(flat, length=self.num_experts).astype(jnp.int32)
        h = jax.lax.ragged_dot(rows, jnp.asarray(self.gate_up_proj, dt), sizes)
        if self.use_bias:
            h = h + jnp.asarray(self.gate_up_proj_bias, dt)[expert]
        out = jax.lax.ragged_dot(self._act(h), jnp.asarray(self.down_proj, dt), sizes)
        if self.use_bias:
            out = out + jnp.asarray(self.down_proj_bias, dt)[expert]
        out = out * weight.reshape(-1)[order][:, None].astype(dt)
        return jnp.zeros_like(x).at[order // k].add(out)
