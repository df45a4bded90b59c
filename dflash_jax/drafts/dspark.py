"""DSpark's heads (DeepSpec ``Qwen3DSparkModel``; docs/models.md, "Draft formats") and the left-to-right walk
that drafts with them.

The backbone is the DFlash draft's (``draft.DraftModel``); what DSpark adds, per block slot j (x_j its previous
token: the anchor for slot 0, then the token drafted at slot j - 1; e_j = W1[x_j], h_j the slot's final-normed
hidden, l_j its base logits through the draft's own lm_head):

  * the Markov head's bias b_j on the logits, l'_j = l_j + b_j: vanilla b_j = W2 e_j; gated
    b_j = W2 (sigmoid(Wg [h_j; e_j] + bg) * e_j); rnn [a; c; o] = J [s_{j-1}; e_j; h_j] + bJ,
    s_j = sigmoid(a) s_{j-1} + (1 - sigmoid(a)) tanh(c) (s_{-1} = 0), b_j = W2 tanh(o);
  * the confidence head c_j = sigmoid(w [h_j; e_j] + b) (or w h_j + b without the Markov input): an estimate that
    slot j's draft is accepted; a threshold cuts the proposal at the first slot below it (``confident_length``).
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from dflash_jax.layers import Embed, Linear
from dflash_jax.sampling import categorical, filtered_scores, if_sampling, per_row, row_keys


class MarkovHead(nn.Module):
    """Parameters ``markov_w1`` [V, r] (an embedding), ``markov_w2`` (r -> V, no bias), and the gated head's
    ``gate_proj`` ([h; e] -> r) or the rnn head's ``joint_proj`` ([s; e; h] -> 3r), as DeepSpec names them."""

    vocab: int
    rank: int
    kind: str

    def setup(self):
        self.markov_w1 = Embed(self.vocab, self.rank)
        self.markov_w2 = Linear(self.vocab, False, (None, "vocab"))
        if self.kind == "gated":
            self.gate_proj = Linear(self.rank, True, ("embed", None))
        elif self.kind == "rnn":
            self.joint_proj = Linear(3 * self.rank, True, ("embed", None))

    def __call__(self, prev, h, state):
        """prev [B] previous tokens, h [B, D] the slot's hidden, state [B, r] (the rnn head's; zeros at a block's
        start) -> (bias [B, V] float32, the next state, e [B, r])."""
        e = self.markov_w1(prev).astype(h.dtype)
        if self.kind == "vanilla":
            z = e
        elif self.kind == "gated":
            z = jax.nn.sigmoid(self.gate_proj(jnp.concatenate([h, e], axis=-1))) * e
        else:
            gate, cand, out = jnp.split(self.joint_proj(jnp.concatenate([state, e, h], axis=-1)), 3, axis=-1)
            gate = jax.nn.sigmoid(gate)
            state = gate * state + (1 - gate) * jnp.tanh(cand)
            z = jnp.tanh(out)
        return self.markov_w2(z).astype(jnp.float32), state, e


class ConfidenceHead(nn.Module):
    """``proj``: [h; e] (or h) -> one logit per slot (DeepSpec's ``AcceptRatePredictor``)."""

    def setup(self):
        self.proj = Linear(1, True, ("embed", None))

    def __call__(self, h, e=None):
        x = h if e is None else jnp.concatenate([h, e.astype(h.dtype)], axis=-1)
        return self.proj(x)[..., 0].astype(jnp.float32)


# positional: the slot function, then the block's hidden states, base logits and anchor
def walk(step, h, base_logits, anchor, *, state_width: int, confident: bool, prev=None, sampling=None, key=None,
         confidence_logits: bool = False):
    """Draft a block left to right: ``step(x, h_j, state) -> (bias [B, V], state, confidence logit [B] or None)``
    (the draft's ``DraftModel.spark_step``; ``state`` [B, ``state_width``] starts at zero), h [B, T, D], base
    logits [B, T, V] float32, ``anchor`` [B] (slot 0's previous token) -> (tokens [B, T] int32, scores [B, T, V]
    float32, confidence [B, T] (``confident``) or None).

    Slot j's previous token is the token drafted at slot j - 1, or ``prev[:, j - 1]`` when ``prev`` [B, T - 1] is
    given (teacher forcing). Greedy (``sampling`` None): the argmax of l'_j and scores = l'_j. Sampled
    (``sampling`` the rows' ``RowSampling``, ``key`` [B, 2]): a draw from the processed l'_j (a row at
    temperature 0 takes the argmax) and scores = those processed log-weights: the q of the rejection rule.
    ``confidence_logits``: the confidence head's raw logits u_j instead of sigmoid(u_j) (training's
    BCE-with-logits; differentiable, as the scores are)."""
    b, t = base_logits.shape[:2]
    keys = row_keys(key, t) if key is not None else jnp.zeros((t, b, 2), jnp.uint32)
    forced = jnp.zeros((t, b), jnp.int32) if prev is None else jnp.swapaxes(
        jnp.concatenate([prev, jnp.zeros((b, 1), prev.dtype)], axis=1), 0, 1).astype(jnp.int32)

    def slot(carry, xs):
        x, state = carry
        h_j, logits_j, key_j, forced_j = xs
        bias, state, conf = step(x, h_j, state)
        scores = logits_j + bias
        token = jnp.argmax(scores, axis=-1).astype(jnp.int32)
        if sampling is not None:
            temperature = sampling.temperature
            scores = filtered_scores(scores, sampling)
            drawn = if_sampling(temperature, lambda: categorical(key_j, scores), token)
            token = jnp.where(per_row(temperature, 1) == 0, token, drawn)
        nxt = token if prev is None else forced_j
        return (nxt, state), (token, scores, jnp.zeros((b,), jnp.float32) if conf is None else conf)

    xs = (jnp.swapaxes(h, 0, 1), jnp.swapaxes(base_logits, 0, 1), keys, forced)
    state0 = jnp.zeros((b, state_width), h.dtype)
    _, (tokens, scores, conf) = jax.lax.scan(slot, (anchor.astype(jnp.int32), state0), xs)
    conf = jnp.swapaxes(conf, 0, 1)
    confidence = (conf if confidence_logits else jax.nn.sigmoid(conf)) if confident else None
    return jnp.swapaxes(tokens, 0, 1), jnp.swapaxes(scores, 0, 1), confidence


def confident_length(confidence, threshold: float):
    """DeepSpec's cut: the proposal keeps slots before the first with confidence below ``threshold`` (> 0), all of
    them when there is none; ``confidence`` [B, T] -> [B] int32."""
    below = confidence < threshold
    t = confidence.shape[1]
    return jnp.where(jnp.any(below, axis=1), jnp.argmax(below, axis=1), t).astype(jnp.int32)
