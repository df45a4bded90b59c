"""Token choice from target logits (greedy, or temperature with top-k / top-p) and the acceptance rule.

The draft always proposes greedily; a proposal is accepted while it equals the token the target
chooses at that position. Every committed token is therefore the target's own choice given the
committed prefix, so the output distribution is exactly the target's (greedy: identical tokens).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def choose(logits, key, temperature, top_k, top_p, *, greedy: bool):
    """logits [..., V] -> token ids [...]. temperature/top_k/top_p are runtime scalars."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scores = logits.astype(jnp.float32) / temperature
    vocab = scores.shape[-1]
    ordered = jnp.sort(scores, axis=-1)[..., ::-1]
    kth = jnp.take(ordered, jnp.clip(top_k - 1, 0, vocab - 1), axis=-1)[..., None]
    scores = jnp.where((top_k > 0) & (scores < kth), -jnp.inf, scores)
    # top-p: keep the smallest prefix of the sorted distribution whose mass reaches top_p.
    ordered = jnp.sort(scores, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(ordered, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    n_keep = jnp.maximum(jnp.sum(mass_before < top_p, axis=-1, keepdims=True), 1)
    cutoff = jnp.take_along_axis(ordered, n_keep - 1, axis=-1)
    scores = jnp.where(scores < cutoff, -jnp.inf, scores)
    return jax.random.categorical(key, scores, axis=-1).astype(jnp.int32)


def accepted_length(drafts, posterior):
    """Number of leading draft tokens equal to the target's choices.

    drafts [B, K-1] (d_1..d_{K-1}), posterior [B, K] (p_0..p_{K-1}); d_k is accepted while d_k == p_{k-1}.
    """
    match = (drafts == posterior[:, :-1]).astype(jnp.int32)
    return jnp.sum(jnp.cumprod(match, axis=-1), axis=-1)
