"""Exact log-probabilities of given tokens under the target: one causal forward (no cache) over a padded batch of
sequences, the log-softmax of its logits at a temperature. RL objectives need them for the sampled completions
(``per_token_logps``); the server's logprobs (``infer.serve.logprobs``) share the core."""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.decode.prepare import prompt_bucket
from dflash_jax.target import Target, check_token_ids, forward


def padded(cfg, sequences: Sequence[Sequence[int]]) -> np.ndarray:
    """Token sequences -> int32 [B, L], zeros after each; L: the longest rounded up to a power of two >= 32 (one
    program per bucket), the longest itself past the target's positions. Causal: the padding changes no value."""
    longest = max(len(s) for s in sequences)
    out = np.zeros((len(sequences), prompt_bucket(longest, max(cfg.max_position_embeddings, longest))), np.int32)
    for i, s in enumerate(sequences):
        out[i, :len(s)] = s
    return out


def next_token_logps(cfg, params, ids, temperature=1.0):
    """ids [B, L] -> (log_softmax(logits / temperature) [B, L-1, V] float32, position t's distribution of token
    t+1; the log-probability of each actual next token ids[:, t+1] [B, L-1]). Traced: call it inside jit."""
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    logits, _, _ = forward(cfg, params, ids, positions)
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32) / temperature, axis=-1)
    return logp, jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]


@functools.partial(jax.jit, static_argnames=("cfg",))
def _chosen(cfg, params, ids, temperature):
    return next_token_logps(cfg, params, ids, temperature)[1]


def per_token_logps(target: Target, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                    temperature: float = 1.0) -> list[np.ndarray]:
    """log p(completion[t] | prompt + completion[:t]) of every completion token, float32 [len(completion)] per
    pair: the target's log_softmax(logits / temperature), the distribution a row sampled from (before top-k /
    top-p), which is what an RL objective's importance ratios need. ``temperature`` 0 (greedy) scores at 1. One
    forward over the batch, padded to a power of two >= 32 tokens (repeated calls reuse the compiled program)."""
    if len(prompts) != len(completions) or not len(prompts):
        raise ValueError(f"per_token_logps needs as many completions as prompts (at least one), got "
                         f"{len(prompts)} prompts and {len(completions)} completions")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    empty = [i for i, p in enumerate(prompts) if not len(p)]
    if empty:
        raise ValueError(f"prompt {empty[0]} is empty: its completion's first token needs a token before it")
    sequences = [check_token_ids(np.concatenate([np.asarray(p, np.int64), np.asarray(c, np.int64)])[None],
                                 target.config.vocab_size, f"prompt + completion {i}")[0]
                 for i, (p, c) in enumerate(zip(prompts, completions))]
    ids = padded(target.config, sequences)
    chosen = np.asarray(_chosen(target.config, target.params, ids, np.float32(temperature or 1.0)))
    return [chosen[i, len(p) - 1:len(p) - 1 + len(c)] for i, (p, c) in enumerate(zip(prompts, completions))]
