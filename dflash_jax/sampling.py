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
tau 1.35 vs 1.26 at T = 0.7 and 1.27 vs 1.08 at T = 1.0 (docs/sampling.md).
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


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


@flax.struct.dataclass
class RowSampling:
    """Each row's sampling settings, passed whole: [B] arrays (or scalars, for every row). A new sampling knob is one
    field here (its dtype and its off value in ``FIELDS``) and its step in ``filtered_scores``; the engine moves,
    pads and releases rows through ``FIELDS`` without naming any knob."""

    temperature: jax.Array  # 0: greedy (the argmax)
    top_k: jax.Array  # 0: off
    top_p: jax.Array  # 1: off
    FIELDS: ClassVar[dict] = {"temperature": (jnp.float32, 0.0), "top_k": (jnp.int32, 0), "top_p": (jnp.float32, 1.0)}

    @classmethod
    def of(cls, settings, fill: int = 0) -> "RowSampling":
        """Host arrays of ``settings`` (objects with the fields: ``DecodeOptions`` / ``Request`` settings), then
        ``fill`` rows of off values."""
        return cls(**{f: np.array([getattr(s, f) for s in settings] + [off] * fill, dtype)
                      for f, (dtype, off) in cls.FIELDS.items()})

    def off(self, rows) -> "RowSampling":
        """Rows ``rows`` (a boolean mask [B], or indices [A]; out of range: ignored) set to greedy and unfiltered, so
        a batch without a sampling row skips the draws and the sorts (``if_sampling``, ``filtered_scores``)."""
        if getattr(rows, "dtype", None) == jnp.bool_:
            return self.replace(**{f: jnp.where(rows, jnp.asarray(off, getattr(self, f).dtype), getattr(self, f))
                                   for f, (_, off) in self.FIELDS.items()})
        return self.replace(**{f: getattr(self, f).at[rows].set(off, mode="drop") for f, (_, off) in self.FIELDS.items()})


def per_row(x, ndim: int):
    """A per-row setting ([B], or a scalar for every row) shaped to broadcast against a [B, ..., V] array of ``ndim``."""
    x = jnp.asarray(x)
    return x.reshape(x.shape + (1,) * (ndim - x.ndim))


def row_keys(keys, n: int):
    """Per-row keys [B, 2] -> [n, B, 2]: n independent keys for every row (each row's draws depend on its own key
    only, so a request's seed gives the same draws whatever batch it is in)."""
    return jnp.swapaxes(jax.vmap(lambda k: jax.random.split(k, n))(keys), 0, 1)


def categorical(keys, scores):
    """One draw per row from softmax(scores) [B, ..., V] with that row's key [B, 2] -> int32 [B, ...]."""
    return jax.vmap(lambda k, s: jax.random.categorical(k, s, axis=-1))(keys, scores).astype(jnp.int32)


def if_sampling(temperature, sample, otherwise):
    """``sample()`` when some row's temperature is > 0, else ``otherwise`` (an array of the same shape): a batch of
    greedy rows in a program that can sample (a server's) skips the draws over the vocabulary (a random number
    per vocabulary entry and position, the dominant cost of a sampled step on a CPU)."""
    return jax.lax.cond(jnp.any(jnp.asarray(temperature) > 0), sample, lambda: otherwise)


def choose(logits, keys, sampling: RowSampling, *, greedy: bool):
    """logits [B, ..., V] -> token ids [B, ...]; ``keys`` [B, 2] and the ``sampling`` settings (runtime) are per row,
    and a row at temperature 0 takes the argmax. ``greedy`` (static): every row is greedy."""
    best = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if greedy:
        return best
    drawn = if_sampling(sampling.temperature, lambda: categorical(keys, filtered_scores(logits, sampling)), best)
    return jnp.where(per_row(sampling.temperature, best.ndim) == 0, best, drawn)


def apply_bitmask(logits, bitmask):
    """logits [..., V] with -inf where ``bitmask`` [..., ceil(V / 32)] int32 (bit v % 32 of word v // 32: token v
    allowed) is 0: a grammar's allowed tokens (``dflash_jax.grammar``), every distribution drawn from them exact."""
    v = jnp.arange(logits.shape[-1], dtype=jnp.int32)
    bits = (jnp.take(bitmask, v // 32, axis=-1) >> (v % 32)) & 1
    return jnp.where(bits == 1, logits, -jnp.inf)


def token_logps(logits, tokens, temperature):
    """log_softmax(logits / T)[token] at every position: logits [B, ..., V], tokens [B, ...] -> float32 [B, ...],
    T the row's temperature ([B] or a scalar; 0, a greedy row: 1). The target's log-probability of each chosen
    token under the distribution its row samples from (before top-k / top-p): what an RL objective's ratios need."""
    t = per_row(jnp.where(jnp.asarray(temperature) > 0, temperature, 1.0), logits.ndim)
    scaled = logits.astype(jnp.float32) / t
    return jnp.take_along_axis(scaled, tokens[..., None], axis=-1)[..., 0] - jax.nn.logsumexp(scaled, axis=-1)


def filtered_scores(logits, sampling: RowSampling):
    """logits [B, ..., V] -> tempered scores, -inf outside the top-k / top-p set: the log-weights of the
    distribution ``choose`` samples from (softmax of them: its probabilities). Settings per row ([B]) or scalars;
    a temperature of 0 is taken as 1e-6 (its row is greedy: ``choose`` takes the argmax)."""
    nd = logits.ndim
    top_k, top_p = per_row(sampling.top_k, nd), per_row(sampling.top_p, nd)
    scores = logits.astype(jnp.float32) / jnp.maximum(per_row(sampling.temperature, nd), 1e-6)

    def truncate(scores):
        vocab = scores.shape[-1]
        ordered = jnp.sort(scores, axis=-1)[..., ::-1]
        at_k = jnp.broadcast_to(jnp.clip(top_k - 1, 0, vocab - 1), scores.shape[:-1] + (1,))
        kth = jnp.take_along_axis(ordered, at_k, axis=-1)
        scores = jnp.where((top_k > 0) & (scores < kth), -jnp.inf, scores)
        # top-p: keep the smallest prefix of the sorted distribution whose mass reaches top_p.
        ordered = jnp.sort(scores, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        n_keep = jnp.maximum(jnp.sum(mass_before < top_p, axis=-1, keepdims=True), 1)
        cutoff = jnp.take_along_axis(ordered, n_keep - 1, axis=-1)
        return jnp.where(scores < cutoff, -jnp.inf, scores)

    # the two sorts over the vocabulary only when some row's top-k / top-p asks for them (runtime settings)
    return jax.lax.cond(jnp.any(top_k > 0) | jnp.any(top_p < 1), truncate, lambda s: s, scores)


def accepted_length(drafts, posterior):
    """Number of leading draft tokens equal to the target's choices.

    drafts [B, K-1] (d_1..d_{K-1}), posterior [B, K] (p_0..p_{K-1}); d_k is accepted while d_k == p_{k-1}.
    """
    match = (drafts == posterior[:, :-1]).astype(jnp.int32)
    return jnp.sum(jnp.cumprod(match, axis=-1), axis=-1)


def rejection_sample(draft_scores, drafts, target_scores, keys, verified=None):
    """The ``rejection`` rule (module docstring). draft_scores [B, K-1, V] (q_1..q_{K-1} as log-weights),
    drafts [B, K-1] sampled from them, target_scores [B, K, V] (p_0..p_{K-1}: p_j predicts the token
    after block position j) -> (accepted drafts a [B], tokens [B, K]: d_1..d_a, then the residual or
    bonus token at index a; entries after it are unused); ``keys`` [B, 2] per row. ``verified`` (default K-1;
    a scalar or per row [B]): only d_1..d_verified are verified (an adaptive verify length, a proposal cut short),
    the bonus after them drawn from p_verified; exact as long as whether d_k is verified is decided before d_k is
    drawn (from the context and d_1..d_{k-1} only)."""
    b, k1 = drafts.shape
    verified = jnp.broadcast_to(jnp.asarray(k1 if verified is None else verified, jnp.int32), (b,))
    p, q = jax.nn.softmax(target_scores, axis=-1), jax.nn.softmax(draft_scores, axis=-1)
    p_d = jnp.take_along_axis(p[:, :-1], drafts[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    k_accept, k_next = row_keys(keys, 2)
    accept = jax.vmap(lambda k: jax.random.uniform(k, (k1,)))(k_accept) * q_d < p_d  # probability min(1, p / q)
    accept &= jnp.arange(k1) < verified[:, None]
    a = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=-1), axis=-1)
    residual = jnp.maximum(p[:, :-1] - q, 0.0)
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 1e-9, residual, p[:, :-1])  # p == q: never rejects
    at = lambda x, i: jnp.take_along_axis(x, i[:, None, None], axis=1)[:, 0]  # noqa: E731
    dist = jnp.where((a < verified)[:, None], at(residual, jnp.minimum(a, k1 - 1)), at(p, a))
    nxt = categorical(k_next, jnp.log(dist))
    padded = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], axis=1)
    return a, jnp.where(jnp.arange(padded.shape[1]) == a[:, None], nxt[:, None], padded)
