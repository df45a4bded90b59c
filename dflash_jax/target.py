"""The target model: a Qwen3 / LLaMA-3.x decoder returning logits and selected layer outputs.

One forward serves prefill, verification and plain full-sequence scoring: with a cache, new K/V are
written at the tokens' positions and queries see every slot at a position <= their own (offset-causal:
committed context plus the causal part of the new block); without a cache, plain causal attention.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.attention import attend, position_mask
from dflash_jax.cache import KVCache
from dflash_jax.config import TargetConfig
from dflash_jax.layers import MLP, AttentionProjections, Embed, Linear, RMSNorm


class DecoderLayer(nn.Module):
    cfg: TargetConfig
    index: int

    def setup(self):
        c = self.cfg
        self.self_attn = AttentionProjections(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.rms_norm_eps)

    def __call__(self, x, positions, cache: KVCache | None):
        window = self.cfg.layer_window(self.index)
        h = self.input_layernorm(x)
        q = self.self_attn.queries(h, positions)
        k, v = self.self_attn.keys_values(h, positions)
        if cache is None:
            mask = position_mask(positions, positions, causal=True, sliding_window=window)
        else:
            cache = cache.write(self.index, k, v, positions)
            k, v = cache.k[self.index], cache.v[self.index]
            mask = position_mask(positions, cache.slot_positions(), causal=True, sliding_window=window)
        x = x + self.self_attn.output(attend(q, k, v, mask))
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, cache


class Transformer(nn.Module):
    """Decoder with Hugging Face parameter names (``embed_tokens``, ``layers_N``, ``norm``, ``lm_head``)."""

    cfg: TargetConfig

    def setup(self):
        c = self.cfg
        self.embed_tokens = Embed(c.vocab_size, c.hidden_size)
        self.layers = [DecoderLayer(c, i) for i in range(c.num_hidden_layers)]
        self.norm = RMSNorm(c.rms_norm_eps)
        if not c.tie_word_embeddings:
            self.lm_head = Linear(c.vocab_size, False, ("embed", "vocab"))

    def embed(self, ids):
        return self.embed_tokens(ids)

    def head(self, h):
        """Logits (float32) of already-normalised hidden states; the draft reuses it."""
        if self.cfg.tie_word_embeddings:
            return self.embed_tokens.attend(h)
        return self.lm_head(h).astype(jnp.float32)

    def __call__(self, input_ids, positions, cache: KVCache | None = None, feature_layer_ids: tuple = (),
                 logits_index=None):
        """input_ids, positions [B, T] -> (logits [B, T or 1, V] float32, features [B, T, n*D] or None, cache).

        Features are Hugging Face ``hidden_states[id + 1]`` for each id in ``feature_layer_ids``,
        concatenated in that order: the output of layer ``id``, except that for the LAST layer Hugging
        Face (and so every released draft) sees it after the final norm. ``logits_index`` [B] keeps
        only the logits at one position per row (prefill needs just the last prompt token's).
        """
        x = self.embed(input_ids)
        hidden = []
        for layer in self.layers:
            x, cache = layer(x, positions, cache)
            hidden.append(x)
        last = self.cfg.num_hidden_layers - 1
        if last in feature_layer_ids:
            hidden[last] = self.norm(x)
        features = jnp.concatenate([hidden[i] for i in feature_layer_ids], axis=-1) if feature_layer_ids else None
        if logits_index is not None:
            x = jnp.take_along_axis(x, logits_index[:, None, None], axis=1)
        return self.head(self.norm(x)), features, cache


@dataclasses.dataclass(frozen=True, eq=False)
class Target:
    """A loaded target: config + parameter pytree (+ tokenizer path, when the checkpoint has one)."""

    config: TargetConfig
    params: Any
    path: str | None = None

    @property
    def module(self) -> Transformer:
        return Transformer(self.config)

    def new_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        dtype = dtype or jax.tree_util.tree_leaves(self.params)[0].dtype
        return KVCache.for_model(self.config, batch, max_len, dtype)


def init_params(cfg: TargetConfig, seed: int = 0, dtype=jnp.float32):
    """Random parameters (unboxed), e.g. for tests and pretraining from scratch."""
    ids = jnp.zeros((1, 2), jnp.int32)
    variables = Transformer(cfg).init(jax.random.PRNGKey(seed), ids, jnp.arange(2)[None])
    params = nn.meta.unbox(variables["params"])
    return jax.tree_util.tree_map(lambda x: x.astype(dtype), params)


@functools.partial(jax.jit, static_argnames=("cfg", "feature_layer_ids"))
def forward(cfg: TargetConfig, params, input_ids, positions, cache=None, feature_layer_ids=(), logits_index=None):
    """Jitted ``Transformer.__call__``; see there."""
    return Transformer(cfg).apply({"params": params}, input_ids, positions, cache, feature_layer_ids, logits_index)


def param_shapes(cfg: TargetConfig):
    """ShapeDtypeStructs of every parameter, without allocating them."""
    return jax.eval_shape(lambda: init_params(cfg))


def load_target(path_or_hub_id, dtype="float32", place=None) -> Target:
    """Load a Hugging Face Qwen3 / LLaMA-3.x checkpoint (directory or hub id)."""
    from dflash_jax.checkpoints import load_params, resolve_path

    path = resolve_path(path_or_hub_id)
    cfg = TargetConfig.from_hf(path)
    ignore = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    params = load_params(path, param_shapes(cfg), prefix="model.", dtype=dtype, place=place, ignore=ignore)
    return Target(cfg, params, path)


def check_token_ids(ids, vocab_size: int, what: str = "input_ids"):
    """[B, T] int32 ids, or a clear error: wrong rank, empty, or ids outside the vocabulary."""
    ids = np.asarray(ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[1] == 0:
        raise ValueError(f"{what} must be a non-empty [batch, length] array of token ids, got shape {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{what} must be integer token ids, got dtype {ids.dtype}")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"{what} has ids outside the vocabulary [0, {vocab_size}): min {ids.min()}, max {ids.max()}")
    return ids.astype(np.int32)


def target_logits(target: Target, input_ids) -> np.ndarray:
    """Full causal forward: logits [B, T, V] float32 for token ids [B, T] at positions 0..T-1."""
    ids = check_token_ids(input_ids, target.config.vocab_size)
    positions = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)
    logits, _, _ = forward(target.config, target.params, ids, positions)
    return np.asarray(logits)
