"""Token choice from logits (greedy, or temperature with top-k / top-p) and the two acceptance rules.

``match`` (the reference implementation's rule): the draft proposes greedily and a proposal is accepted
while it equals the token the target samples at that position. Every committed token is the target's
own choice given the committed prefix, so the output is distributed exactly as the target's (greedy:
identical tokens).

``rejection`` (speculative sampling, Leviathan et al. 2023 / Chen et al. 2023; the default), for
temperature > 0:
draft token d_k is sampled from the draft's processed distribution q_k and accepted with probability
min(1, p_k(d_k) / q_k(d_k)); at the first rejection the token is drawn from the normalised residual
max(0, p_k - q_k); after K-1 acceptances the bonus comes from the target's p_K. For one position this
makes the committed token distributed exactly as p_k: P(x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(q(y),
p(y))) (p(x) - q(x))+ / sum_y (p(y) - q(y))+ = min(q(x), p(x)) + (p(x) - q(x))+ = p(x). The DFlash draft
predicts the whole block in one forward, so q_k depends only on the committed context, not on
d_1..d_{k-1}: each d_k is sampled independently from its marginal. That is still a valid proposal for
position k given any accepted prefix (the argument above holds for any q fixed before d_k is drawn;
p_k is the target's distribution after the actual prefix x_n, d_1..d_{k-1}), so the rule stays exact
position by position, and by induction for the whole sequence. On the demo pair it accepts more:
tau 1.35 vs 1.26 at T = 0.7 and 1.27 vs 1.08 at T = 1.0 (README "Sampling").
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


ACCEPTANCE_RULES = ("match", "rejection")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    acceptance: str = "rejection"  # "match" | "rejection" (module docstring); greedy decoding always matches

    def __post_init__(self):
        if self.acceptance not in ACCEPTANCE_RULES:
            raise ValueError(f"acceptance must be one of {', '.join(ACCEPTANCE_RULES)}, got {self.acceptance!r}")
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
    return jax.random.categorical(key, filtered_scores(logits, temperature, top_k, top_p), axis=-1).astype(jnp.int32)


def filtered_scores(logits, temperature, top_k, top_p):
    """logits [..., V] -> tempered scores, -inf outside the top-k / top-p set: the log-weights of the
    distribution ``choose`` samples from (softmax of them: its probabilities)."""
    scores = logits.astype(jnp.float32) / temperature

    def truncate(scores):
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
        return jnp.where(scores < cutoff, -jnp.inf, scores)

    # the two sorts over the vocabulary only when top-k / top-p asks for them (runtime scalars)
    return jax.lax.cond((top_k > 0) | (top_p < 1), truncate, lambda s: s, scores)


def accepted_length(drafts, posterior):
    """Number of leading draft tokens equal to the target's choices.

    drafts [B, K-1] (d_1..d_{K-1}), posterior [B, K] (p_0..p_{K-1}); d_k is accepted while d_k == p_{k-1}.
    """
    match = (drafts == posterior[:, :-1]).astype(jnp.int32)
    return jnp.sum(jnp.cumprod(match, axis=-1), axis=-1)


def rejection_sample(draft_scores, drafts, target_scores, key, verified=None):
    """The ``rejection`` rule (module docstring). draft_scores [B, K-1, V] (q_1..q_{K-1} as log-weights),
    drafts [B, K-1] sampled from them, target_scores [B, K, V] (p_0..p_{K-1}: p_j predicts the token
    after block position j) -> (accepted drafts a [B], tokens [B, K]: d_1..d_a, then the residual or
    bonus token at index a; entries after it are unused). ``verified`` (default K-1): only d_1..d_verified
    are verified (an adaptive verify length), the bonus after them drawn from p_verified; exact as long as
    ``verified`` does not depend on the drawn drafts (a speculation cut before it is drawn)."""
    k1 = drafts.shape[1]
    verified = k1 if verified is None else verified
    p, q = jax.nn.softmax(target_scores, axis=-1), jax.nn.softmax(draft_scores, axis=-1)
    p_d = jnp.take_along_axis(p[:, :-1], drafts[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    k_accept, k_next = jax.random.split(key)
    accept = jax.random.uniform(k_accept, drafts.shape) * q_d < p_d  # probability min(1, p / q)
    accept &= jnp.arange(k1) < verified
    a = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=-1), axis=-1)
    residual = jnp.maximum(p[:, :-1] - q, 0.0)
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 1e-9, residual, p[:, :-1])  # p == q: never rejects
    at = lambda x, i: jnp.take_along_axis(x, i[:, None, None], axis=1)[:, 0]  # noqa: E731
    dist = jnp.where((a < verified)[:, None], at(residual, jnp.minimum(a, k1 - 1)), at(p, a))
    nxt = jax.random.categorical(k_next, jnp.log(dist), axis=-1).astype(jnp.int32)
    padded = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], axis=1)
    return a, jnp.where(jnp.arange(padded.shape[1]) == a[:, None], nxt[:, None], padded)
