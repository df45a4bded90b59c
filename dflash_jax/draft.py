"""The DFlash draft: fused target features injected as K/V into every layer, one block per forward.

Context: concatenated target layer outputs -> ``fc`` -> ``hidden_norm``; each layer projects it with its
own k_proj (+k_norm, RoPE at the context positions) and v_proj, without ``input_layernorm``. A block
of queries anchored at position a sees context positions < a and its own block bidirectionally
(``attention.block_attention``); inference runs one block per row against the draft cache (with a
``decode_impl``: ``attention.decode_attention``, reading only the context below each row's anchor), training
many blocks per sequence against the whole context: ``draft_hidden`` is the one forward of both.
Embedding and lm_head are the target's.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import target as target_lib
from dflash_jax.attention import block_attention, decode_attention
from dflash_jax.checkpoints import NameTable, export_params, load_params, resolve_path, save_safetensors
from dflash_jax.config import DraftConfig
from dflash_jax.families.dense import DecoderLayer
from dflash_jax.layers import Linear, RMSNorm, random_params
from dflash_jax.state import DecodeCache, KVSpec
from dflash_jax.target import Target, check_token_ids

CHECKPOINT = NameTable()  # released drafts: layer names without a prefix


class DraftLayer(DecoderLayer):
    """A Qwen3 layer whose queries (the block) attend to injected context K/V plus the block itself."""

    def context_kv(self, ctx, positions):
        return self.self_attn.keys_values(ctx, positions)

    def __call__(self, x, positions, anchors, k_ctx, v_ctx, impl: str = "auto", ctx_start=None,
                 decode_impl: str | None = None):
        h = self.input_layernorm(x)
        q = self.self_attn.queries(h, positions)
        k, v = self.self_attn.keys_values(h, positions)
        window = self.cfg.layer_window(self.index)
        if decode_impl is None:
            o = block_attention(q, k_ctx, v_ctx, k, v, anchors, block_size=x.shape[1] // anchors.shape[1],
                                sliding_window=window, impl=impl, ctx_start=ctx_start)
        else:  # one block per row: context slots < its anchor, its own block bidirectionally
            q_pos = jnp.where(anchors >= 0, positions, -1)
            o = decode_attention(q, k_ctx, v_ctx, q_pos, jnp.maximum(anchors[:, 0], 0), k, v, sliding_window=window,
                                 impl=decode_impl)
        x = x + self.self_attn.output(o)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraft(nn.Module):
    """Parameter names as in the released checkpoints: ``fc``, ``hidden_norm``, ``layers_N``, ``norm``."""

    cfg: DraftConfig

    def setup(self):
        c = self.cfg.layers
        self.fc = Linear(c.hidden_size, False, ("features", "embed"))
        self.hidden_norm = RMSNorm(c.rms_norm_eps)
        self.layers = [DraftLayer(c, i) for i in range(c.num_hidden_layers)]
        self.norm = RMSNorm(c.rms_norm_eps)

    def context_kv(self, features, positions):
        """Target features [B, T, n*D] at ``positions`` [B, T] -> per-layer (k, v) tuples, each [B, T, K, H]."""
        ctx = self.hidden_norm(self.fc(features))
        kv = [layer.context_kv(ctx, positions) for layer in self.layers]
        return tuple(k for k, _ in kv), tuple(v for _, v in kv)

    def __call__(self, x, anchors, k_ctx, v_ctx, impl: str = "auto", ctx_start=None, decode_impl: str | None = None):
        """Block embeddings x [B, N*Bk, D] (block b anchored at anchors[:, b]) -> final-normed hidden.

        k_ctx / v_ctx: per-layer [B, S, K, H] context K/V, slot s holding position s; ``ctx_start``
        [B, N] (training on packed rows): the first context slot each block sees (None: 0). ``impl``: the
        block attention's (training); ``decode_impl`` (decoding, one block per row): the decode attention's
        instead.
        """
        block = x.shape[1] // anchors.shape[1]
        if decode_impl is not None and anchors.shape[1] != 1:
            raise ValueError(f"decode attention takes one block per row, got {anchors.shape[1]}")
        positions = (anchors[:, :, None] + jnp.arange(block, dtype=anchors.dtype)).reshape(x.shape[:2])
        for layer, k, v in zip(self.layers, k_ctx, v_ctx):
            x = layer(x, positions, anchors, k, v, impl, ctx_start, decode_impl)
        return self.norm(x)

    def initialize(self, features, x):
        positions = jnp.broadcast_to(jnp.arange(features.shape[1]), features.shape[:2])
        k, v = self.context_kv(features, positions)
        return self(x, jnp.full((x.shape[0], 1), features.shape[1]), k, v)


@dataclasses.dataclass(frozen=True, eq=False)
class Draft:
    config: DraftConfig
    params: Any
    path: str | None = None

    def new_cache(self, batch: int, max_len: int, dtype=None) -> DecodeCache:
        """Context-only K/V of every draft layer (full length: the block attention applies any window)."""
        dtype = dtype or jax.tree_util.tree_leaves(self.params)[0].dtype
        return new_cache(self.config, batch, max_len, dtype)


def new_cache(cfg: DraftConfig, batch: int, max_len: int, dtype) -> DecodeCache:
    c = cfg.layers
    return DecodeCache.create([KVSpec(c.num_key_value_heads, c.head_dim)] * c.num_hidden_layers, batch, max_len, dtype)


def cache_kv(cache: DecodeCache) -> tuple[tuple, tuple]:
    """Per-layer context keys and values of a draft cache, as ``draft_hidden`` takes them."""
    return tuple(s.k for s in cache.layers), tuple(s.v for s in cache.layers)


def abstract_variables(cfg: DraftConfig):
    """The draft's boxed variables as ShapeDtypeStructs (shapes + logical axes; nothing allocated)."""
    d = cfg.layers.hidden_size

    def init(key):
        feats, x = jnp.zeros((1, 2, cfg.num_features * d)), jnp.zeros((1, 2, d))
        return DFlashDraft(cfg).init(key, feats, x, method=DFlashDraft.initialize)

    return jax.eval_shape(init, jax.ShapeDtypeStruct((2,), jnp.uint32))["params"]


def draft_param_shapes(cfg: DraftConfig):
    return nn.meta.unbox(abstract_variables(cfg))


def init_draft_params(cfg: DraftConfig, seed: int = 0, dtype=jnp.float32):
    """Fresh draft parameters (the library's initialisers)."""
    return random_params(draft_param_shapes(cfg), seed, dtype=dtype)


def check_fits(target: Target, draft: Draft) -> None:
    """Config checks plus the fused-feature width, before any compute; messages name both sides."""
    draft.config.check_fits(target.config)
    fc_in = draft.params["fc"]["kernel"].shape[0]
    want = draft.config.num_features * target.config.hidden_size
    if fc_in != want:
        raise ValueError(f"draft fc takes {fc_in} input features but {draft.config.num_features} target layers x "
                         f"target hidden_size {target.config.hidden_size} = {want}")


# --- jitted pieces -----------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("cfg",))
def context_kv(cfg: DraftConfig, params, features, positions):
    return DFlashDraft(cfg).apply({"params": params}, features, positions, method=DFlashDraft.context_kv)


def materialize(cfg: DraftConfig, params, cache: DecodeCache, features, positions) -> DecodeCache:
    """Write the context K/V of ``features`` [B, T, n*D] at ``positions`` [B, T] (< 0: skipped) into the
    draft cache; its committed length is left to ``DecodeCache.commit``."""
    k, v = context_kv(cfg, params, features, positions)
    return cache.replace(layers=tuple(s.write(ki, vi, positions) for s, ki, vi in zip(cache.layers, k, v)))


def draft_hidden(tcfg, tparams, cfg: DraftConfig, params, block_ids, anchors, k_ctx, v_ctx, impl: str = "auto",
                 ctx_start=None, decode_impl: str | None = None):
    """THE draft forward (decoding and training): block token ids [B, N*Bk], block b anchored at
    ``anchors[:, b]`` (seeing context slots from ``ctx_start[:, b]``, default 0), embedded with the
    target's table; per-layer context K/V [B, S, K, H] (slot s = position s) -> final-normed hidden
    states [B, N*Bk, D] in the context's dtype. ``decode_impl``: see ``DFlashDraft.__call__`` (not
    differentiable; None for training)."""
    x = target_lib.embed(tcfg, tparams, block_ids).astype(k_ctx[0].dtype)
    return DFlashDraft(cfg).apply({"params": params}, x, anchors, k_ctx, v_ctx, impl, ctx_start, decode_impl)


def block_logits(tcfg, tparams, cfg: DraftConfig, params, block_ids, anchors, k_ctx, v_ctx, impl: str = "auto",
                 drop_anchor: bool = False, decode_impl: str | None = None):
    """``draft_hidden`` -> float32 logits through the target's lm_head.
    ``drop_anchor`` (one block per row): logits of positions 1.. only, [B, Bk-1, V]; the lm_head then skips
    the anchor row, whose logits decoding never uses (on a CPU the head is a large part of a draft forward)."""
    h = draft_hidden(tcfg, tparams, cfg, params, block_ids, anchors, k_ctx, v_ctx, impl, decode_impl=decode_impl)
    return target_lib.head(tcfg, tparams, h[:, 1:] if drop_anchor else h)


def propose(tcfg, tparams, cfg: DraftConfig, params, block_ids, anchors, k_ctx, v_ctx, impl: str = "auto",
            decode_impl: str | None = None):
    """Greedy draft tokens for one block per row: block_ids [B, K] = [anchor token, mask...] -> [B, K-1] int32."""
    logits = block_logits(tcfg, tparams, cfg, params, block_ids, anchors, k_ctx, v_ctx, impl, drop_anchor=True,
                          decode_impl=decode_impl)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("tcfg", "cfg"))
def _draft_block_logits(tcfg, tparams, cfg, params, context_ids, block_ids):
    b, t = context_ids.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    _, features, _ = target_lib.forward(tcfg, tparams, context_ids, positions, feature_layer_ids=cfg.target_layer_ids)
    k, v = context_kv(cfg, params, features, positions)
    anchors = jnp.full((b, 1), t, jnp.int32)
    return block_logits(tcfg, tparams, cfg, params, block_ids, anchors, k, v)


def draft_block_logits(target: Target, draft: Draft, context_ids, block_ids) -> np.ndarray:
    """Target runs on ``context_ids`` [B, T] (positions 0..T-1); the draft predicts ``block_ids`` [B, L]
    placed at T..T+L-1 and returns its logits [B, L, V] (float32) through the target's lm_head."""
    check_fits(target, draft)
    v = target.config.vocab_size
    ctx = check_token_ids(context_ids, v, "context_ids")
    blk = check_token_ids(block_ids, v, "block_ids")
    if blk.shape[0] != ctx.shape[0]:
        raise ValueError(f"context_ids has batch {ctx.shape[0]} but block_ids has batch {blk.shape[0]}")
    return np.asarray(_draft_block_logits(target.config, target.params, draft.config, draft.params, ctx, blk))


# --- Hugging Face layout ------------------------------------------------------------------------


def load_draft(path_or_hub_id, dtype="float32", place=None) -> Draft:
    """Load a released-format DFlash draft (config.json + model.safetensors, no ``model.`` prefix)."""
    path = resolve_path(path_or_hub_id)
    cfg = DraftConfig.from_hf(path)
    params = load_params(path, draft_param_shapes(cfg), CHECKPOINT, dtype=dtype, place=place)
    return Draft(cfg, params, path)


def save_draft(draft: Draft, out_dir: str, dtype="bfloat16") -> str:
    """Write ``draft`` in the released layout (loadable by ``load_draft`` and the PyTorch reference)."""
    os.makedirs(out_dir, exist_ok=True)
    cfg = draft.config.to_hf()
    cfg["torch_dtype"] = cfg["dtype"] = str(np.dtype(jnp.dtype(dtype)))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    save_safetensors(os.path.join(out_dir, "model.safetensors"), export_params(draft.params, CHECKPOINT, dtype))
    return out_dir
