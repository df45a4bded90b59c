"""Biased sigmoid routing with group-limited top-k: the router (``mlp.gate``) of DeepSeek-V3 / Kimi-K2 and
MiMo-V2-Flash (transformers' ``DeepseekV3TopkRouter`` / ``MiMoV2FlashTopkRouter``).

scores = sigmoid(x @ W^T) in float32; the correction bias ``e_score_correction_bias`` is added for the
SELECTION only: the experts split into ``n_group`` groups, a group scores the sum of its two best biased
scores, the best ``topk_group`` groups stay and the top ``k`` biased scores among their experts are chosen.
Their weights are the UNBIASED scores, normalised to sum 1 (``norm_topk_prob``), times
``routed_scaling_factor``. ``SigmoidMoE``: that router and its routed ``dflash_jax.moe.Experts``.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dflash_jax.layers import initializer
from dflash_jax.moe import Experts

# (flax leaf, checkpoint leaf, transposed) of the router's correction bias, for a family's NameTable.leaves
ROUTER_LEAVES = (("e_score_correction_bias", "e_score_correction_bias", False),)


def check_grouped_routing(num_experts: int, k: int, n_group: int, topk_group: int) -> None:
    """A ValueError unless the experts split into ``n_group`` equal groups of at least 2 (a group scores its top
    2) when grouped, 1 <= topk_group <= n_group, and the chosen groups hold at least ``k`` experts."""
    if n_group < 1 or num_experts % n_group:
        raise ValueError(f"n_group={n_group} must divide the {num_experts} routed experts")
    if n_group > 1 and num_experts // n_group < 2:
        raise ValueError(f"each of the n_group={n_group} groups needs >= 2 experts (a group scores its top 2); "
                         f"there are {num_experts} experts")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group={topk_group} must be in 1..n_group={n_group}")
    if not 1 <= k <= topk_group * (num_experts // n_group):
        raise ValueError(f"num_experts_per_tok={k} must be in 1..{topk_group * (num_experts // n_group)} (the "
                         f"experts of topk_group={topk_group} groups of {num_experts // n_group})")


def sigmoid_topk(logits, bias, *, k: int, n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
                 routed_scaling_factor: float = 1.0):
    """Router logits [T, E] and correction bias [E] -> (expert index [T, k], weight [T, k] float32), as the
    module docstring says (transformers' ``DeepseekV3TopkRouter.forward``)."""
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = scores + bias.astype(jnp.float32)
    t, e = choice.shape
    if n_group > 1:  # with one group every expert stays
        per_group = e // n_group
        group_scores = jnp.sum(jax.lax.top_k(choice.reshape(t, n_group, per_group), 2)[0], axis=-1)  # [T, G]
        kept = jnp.any(jax.lax.top_k(group_scores, topk_group)[1][..., None] == jnp.arange(n_group), axis=1)
        choice = jnp.where(jnp.repeat(kept, per_group, axis=1), choice, -jnp.inf)
    index = jax.lax.top_k(choice, k)[1]
    weight = jnp.take_along_axis(scores, index, axis=1)
    if norm_topk_prob:
        weight = weight / (jnp.sum(weight, axis=-1, keepdims=True) + 1e-20)
    return index, weight * routed_scaling_factor


class SigmoidRouter(nn.Module):
    """The router module (named ``gate`` by its MoE block: ``mlp.gate.weight`` [E, D] and
    ``mlp.gate.e_score_correction_bias`` [E]); x [T, D] -> (index [T, k], weight [T, k] float32). The logits
    are computed in float32 at full precision, as transformers does."""

    num_experts: int
    k: int
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0

    @nn.compact
    def __call__(self, x):
        box = nn.with_logical_partitioning
        kernel = self.param("kernel", box(initializer("kernel"), ("embed", None)), (x.shape[-1], self.num_experts))
        bias = self.param("e_score_correction_bias", box(initializer("e_score_correction_bias"), (None,)),
                          (self.num_experts,))
        logits = jnp.einsum("TD,DE->TE", x.astype(jnp.float32), jnp.asarray(kernel, jnp.float32),
                            precision=jax.lax.Precision.HIGHEST)
        return sigmoid_topk(logits, bias, k=self.k, n_group=self.n_group, topk_group=self.topk_group,
                            norm_topk_prob=self.norm_topk_prob, routed_scaling_factor=self.routed_scaling_factor)


class SigmoidMoE(nn.Module):
    """The routed experts behind the sigmoid router (``mlp.gate``, ``mlp.experts``): MiMo-V2-Flash's MoE block,
    DeepSeek-V3's without its shared experts. ``cfg``: num_experts, num_experts_per_tok, n_group, topk_group,
    norm_topk_prob, routed_scaling_factor, hidden_size, moe_intermediate_size."""

    cfg: Any

    def setup(self):
        c = self.cfg
        self.gate = SigmoidRouter(c.num_experts, c.num_experts_per_tok, c.n_group, c.topk_group, c.norm_topk_prob,
                                  c.routed_scaling_factor)
        self.experts = Experts(c.num_experts, c.hidden_size, c.moe_intermediate_size, gate_up_layout="concat")

    def __call__(self, x):
        """[B, T, D] -> [B, T, D]."""
        flat = x.reshape(-1, x.shape[-1])
        index, weight = self.gate(flat)
        return self.experts(flat, index, weight.astype(x.dtype)).reshape(x.shape)
