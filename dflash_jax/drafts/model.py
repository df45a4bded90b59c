"""The DFlash draft: fused target features injected as K/V into every layer, one block per forward.

Context: concatenated target layer outputs -> ``fc`` -> ``hidden_norm``; each layer projects it with its
own k_proj (+k_norm, RoPE at the context positions) and v_proj, without ``input_layernorm``. A block
of queries anchored at position a sees context positions < a and its own block bidirectionally
(``attention.block_attention``); inference runs one block per row against the draft cache (with a
``decode_impl``: ``attention.decode_attention``, reading only the context below each row's anchor), training
many blocks per sequence against the whole context: ``draft_hidden`` is the one forward of both.
Embedding and lm_head are the target's, except for DSpark drafts, which carry frozen copies of their own and
add a Markov head and a confidence head (``dflash_jax.drafts.dspark``); DFlash2 drafts convolve around each
sublayer and select among candidates (``dflash_jax.drafts.dflash2``); what a draft's architecture changes is asked of
its config (``DraftConfig.shifted`` / ``own_embeddings`` / ``convolves`` / ``markov``), never of its name.
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
from dflash_jax.attention import injected_attention
from dflash_jax.checkpoints import NameTable, export_params, load_params, resolve_path, save_safetensors
from dflash_jax.drafts import DraftConfig
from dflash_jax.drafts.dflash2 import CandidateSelector, DynamicConv
from dflash_jax.drafts.dspark import ConfidenceHead, MarkovHead, walk
from dflash_jax.families.dense import DecoderLayer
from dflash_jax.layers import Embed, Linear, RMSNorm, random_params
from dflash_jax.sampling import categorical, row_keys
from dflash_jax.state import LayerStates, KVSpec, PagedKV
from dflash_jax.target import Target, check_token_ids

_CODEBOOKS = ("predecessor_codebook", "successor_codebook")
# muse_glimmer_assistant drafts (MuseGlimmerAssistantModel) name fc / hidden_norm after their context encoder
_ALIASES = {"encoder.fc.weight": "fc.weight", "encoder.output_norm_enc.weight": "hidden_norm.weight"}


def _draft_names(stream):
    """The released names: ``_ALIASES`` renamed; DFlash2 codebooks are stored without a ``.weight`` suffix
    (checkpoints written with one are accepted)."""
    for name, array in stream:
        name = _ALIASES.get(name, name)
        stem = name[:-len(".weight")] if name.endswith(".weight") else name
        yield (stem if stem.split(".")[-1] in _CODEBOOKS else name), array


# released drafts: layer names without a prefix; DFlash2's own leaves keep their names
CHECKPOINT = NameTable(leaves=(("base_kernel", "base_kernel", False), ("layer_scalar", "layer_scalar", False))
                       + tuple((c, c, False) for c in _CODEBOOKS), rewrite=_draft_names)


class DraftLayer(DecoderLayer):
    """A Qwen3 layer whose queries (the block) attend to injected context K/V plus the block itself;
    a DFlash2 layer also convolves around each sublayer (``DynamicConv``)."""

    draft: DraftConfig | None = None

    def setup(self):
        super().setup()
        if self.convolves:
            args = (self.cfg.hidden_size, self.draft.conv_kernel_size, self.draft.conv_group_size)
            self.attention_conv, self.mlp_conv = DynamicConv(*args), DynamicConv(*args)

    @property
    def convolves(self) -> bool:
        return self.draft is not None and self.draft.convolves

    def __call__(self, x, positions, anchors, k_ctx, v_ctx, *, impl: str, decode: bool, ctx_start=None,
                 block_len=None):
        """``decode`` False (training, N blocks per row): ``attention.block_attention`` with ``impl`` (and
        ``ctx_start``); True (decoding, one block per row): ``attention.decode_attention`` with ``impl`` (and
        ``block_len``)."""
        block = x.shape[1] // anchors.shape[1]
        h = self.input_layernorm(x)
        if self.convolves:
            h, dyn = self.attention_conv.prepare(h, block)
        o = injected_attention(self, h, positions, anchors, k_ctx, v_ctx, impl=impl, decode=decode,
                               ctx_start=ctx_start, block_len=block_len)
        if self.convolves:
            o = self.attention_conv.finish(o, dyn, block)
        x = x + o
        h = self.post_attention_layernorm(x)
        if self.convolves:
            h, dyn = self.mlp_conv.prepare(h, block)
        h = self.mlp(h)
        if self.convolves:
            h = self.mlp_conv.finish(h, dyn, block)
        return x + h


class DraftModel(nn.Module):
    """Parameter names as in the released checkpoints: ``fc``, ``hidden_norm``, ``layers_N``, ``norm``
    (+ DFlash2's ``candidate_selector``; + DSpark's ``embed_tokens``, ``lm_head``, ``markov_head``,
    ``confidence_head``)."""

    cfg: DraftConfig

    def setup(self):
        d = self.cfg
        c = d.layers
        self.fc = Linear(c.hidden_size, False, ("features", "embed"))
        self.hidden_norm = RMSNorm(c.rms_norm_eps)
        layer = d.stack.layer or DraftLayer
        self.layers = [layer(c, i, draft=d) for i in range(c.num_hidden_layers)]
        self.norm = RMSNorm(c.rms_norm_eps)
        if d.convolves:
            self.candidate_selector = CandidateSelector(c.vocab_size, d.selector_rank)
        if d.own_embeddings:
            self.embed_tokens = Embed(c.vocab_size, c.hidden_size)
            self.lm_head = Linear(c.vocab_size, False, ("embed", "vocab"))
        if d.markov:
            self.markov_head = MarkovHead(c.vocab_size, d.markov_rank, d.markov_head_type)
        if d.confidence_head:
            self.confidence_head = ConfidenceHead()

    def embed(self, ids):
        """The draft's own embedding (DSpark): a lookup; Gemma 4 layers' times sqrt(hidden) in the table's dtype
        (``Gemma4TextScaledWordEmbedding``)."""
        x = self.embed_tokens(ids)
        if self.cfg.stack.scaled_embedding:
            x = x * jnp.asarray(self.cfg.layers.hidden_size ** 0.5, x.dtype)
        return x

    def head(self, h):
        """The draft's own lm_head (DSpark), float32 logits."""
        return self.lm_head(h).astype(jnp.float32)

    def spark_step(self, prev, h, state):
        """One DSpark slot: previous tokens [B], hidden [B, D], rnn state -> (Markov bias [B, V] float32 (zero
        without a Markov head), state, confidence logit [B] or None)."""
        e = None
        if self.cfg.markov:
            bias, state, e = self.markov_head(prev, h, state)
        else:
            bias = jnp.zeros((h.shape[0], self.cfg.layers.vocab_size), jnp.float32)
        if not self.cfg.confidence_head:
            return bias, state, None
        return bias, state, self.confidence_head(h, e if self.cfg.confidence_with_markov else None)

    def context_kv(self, features, positions):
        """Target features [B, T, n*D] at ``positions`` [B, T] -> per-layer (k, v) tuples, each [B, T, K, H]."""
        ctx = self.hidden_norm(self.fc(features))
        kv = [layer.self_attn.keys_values(ctx, positions) for layer in self.layers]
        return tuple(k for k, _ in kv), tuple(v for _, v in kv)

    def __call__(self, x, anchors, k_ctx, v_ctx, impl: str = "auto", ctx_start=None, *, decode: bool = False,
                 block_len=None):
        """Block embeddings x [B, N*Bk, D] (block b anchored at anchors[:, b]) -> final-normed hidden.

        k_ctx / v_ctx: per-layer [B, S, K, H] context K/V, slot s holding position s; ``ctx_start``
        [B, N] (training on packed rows): the first context slot each block sees (None: 0). ``decode``
        False (training): ``impl`` is the block attention's; True (decoding, one block per row): the decode
        attention's, and ``block_len`` [B] (optional) the block positions a row keeps (the later ones are left
        out, as a shorter block would be: the reference's last step).
        """
        block = x.shape[1] // anchors.shape[1]
        if decode and anchors.shape[1] != 1:
            raise ValueError(f"decode attention takes one block per row, got {anchors.shape[1]}")
        positions = (anchors[:, :, None] + jnp.arange(block, dtype=anchors.dtype)).reshape(x.shape[:2])
        for layer, k, v in zip(self.layers, k_ctx, v_ctx):
            x = layer(x, positions, anchors, k, v, impl=impl, decode=decode, ctx_start=ctx_start, block_len=block_len)
        return self.norm(x)

    def select_inputs(self, h):
        return self.candidate_selector(h)

    def initialize(self, features, x):
        positions = jnp.broadcast_to(jnp.arange(features.shape[1]), features.shape[:2])
        k, v = self.context_kv(features, positions)
        h = self(x, jnp.full((x.shape[0], 1), features.shape[1]), k, v)
        if self.cfg.own_embeddings:
            self.embed(jnp.zeros(x.shape[:2], jnp.int32))
            self.head(h)
            state = jnp.zeros((x.shape[0], spark_state_width(self.cfg)), h.dtype)
            self.spark_step(jnp.zeros(x.shape[:1], jnp.int32), h[:, 0], state)
        return self.candidate_selector(h) if self.cfg.convolves else h


@dataclasses.dataclass(frozen=True, eq=False)
class Draft:
    config: DraftConfig
    params: Any
    path: str | None = None

    def new_cache(self, batch: int, max_len: int, dtype=None) -> LayerStates:
        """Context-only K/V of every draft layer (full length: the block attention applies any window)."""
        dtype = dtype or jax.tree_util.tree_leaves(self.params)[0].dtype
        return new_cache(self.config, batch, max_len, dtype)


def state_specs(cfg: DraftConfig) -> tuple[KVSpec, ...]:
    """Every draft layer's context cache: full length (the block attention applies any window)."""
    return tuple(KVSpec(a.num_key_value_heads, a.head_dim)
                 for a in map(cfg.layers.layer_attention, range(cfg.layers.num_hidden_layers)))


def new_cache(cfg: DraftConfig, batch: int, max_len: int, dtype, page: int = 0) -> LayerStates:
    """``page`` > 0: paged (``LayerStates.join_pages`` gives it pools)."""
    return LayerStates.create(state_specs(cfg), batch, max_len, dtype, page=page)


def cache_kv(cache: LayerStates) -> tuple[tuple, tuple]:
    """Per-layer context keys and values of a draft cache, as ``draft_hidden`` takes them; a paged layer as its
    ``PagedKV`` (keys) and None (values), which decoding reads in place (``paged_decode_attention``)."""
    paged = [isinstance(s, PagedKV) for s in cache.layers]
    return (tuple(s if p else s.k for s, p in zip(cache.layers, paged)),
            tuple(None if p else s.v for s, p in zip(cache.layers, paged)))


def abstract_variables(cfg: DraftConfig):
    """The draft's boxed variables as ShapeDtypeStructs (shapes + logical axes; nothing allocated)."""
    d = cfg.layers.hidden_size

    def init(key):
        feats, x = jnp.zeros((1, 2, cfg.num_features * d)), jnp.zeros((1, 2, d))
        return DraftModel(cfg).init(key, feats, x, method=DraftModel.initialize)

    return jax.eval_shape(init, jax.ShapeDtypeStruct((2,), jnp.uint32))["params"]


def draft_param_shapes(cfg: DraftConfig):
    return nn.meta.unbox(abstract_variables(cfg))


def init_draft_params(cfg: DraftConfig, seed: int = 0, dtype=jnp.float32):
    """Fresh draft parameters (the library's initialisers)."""
    return random_params(draft_param_shapes(cfg), seed, dtype=dtype)


def spark_state_width(cfg: DraftConfig) -> int:
    """Width of the DSpark Markov head's recurrent state (the rnn head's rank; 0 for the others)."""
    return cfg.markov_rank if cfg.markov and cfg.markov_head_type == "rnn" else 0


def check_pair(target: Target, draft: Draft) -> None:
    """Config checks plus the fused-feature width, before any compute; messages name both sides."""
    draft.config.check_fits(target.config)
    vocab = target.config.vocab_size
    if draft.config.convolves:
        rows = draft.params["candidate_selector"]["successor_codebook"].shape[0]
        if rows < vocab:
            raise ValueError(f"draft codebooks have {rows} rows for a target vocabulary of {vocab}")
    if draft.config.own_embeddings:
        rows = {"embed_tokens": draft.params["embed_tokens"]["embedding"].shape[0],
                "lm_head": draft.params["lm_head"]["kernel"].shape[1]}
        short = {k: r for k, r in rows.items() if r != vocab}
        if short:
            raise ValueError(f"draft {', '.join(f'{k} has {r} rows' for k, r in short.items())} for a target "
                             f"vocabulary of {vocab}")
    fc_in = draft.params["fc"]["kernel"].shape[0]
    want = draft.config.num_features * target.config.hidden_size
    if fc_in != want:
        raise ValueError(f"draft fc takes {fc_in} input features but {draft.config.num_features} target layers x "
                         f"target hidden_size {target.config.hidden_size} = {want}")


# --- jitted pieces -----------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("cfg",))
def context_kv(cfg: DraftConfig, params, features, positions):
    return DraftModel(cfg).apply({"params": params}, features, positions, method=DraftModel.context_kv)


def materialize(cfg: DraftConfig, params, cache: LayerStates, features, positions) -> LayerStates:
    """Write the context K/V of ``features`` [B, T, n*D] at ``positions`` [B, T] (< 0: skipped) into the
    draft cache; its committed length is left to ``LayerStates.commit``."""
    k, v = context_kv(cfg, params, features, positions)
    return cache.replace(layers=tuple(s.write(ki, vi, positions) for s, ki, vi in zip(cache.layers, k, v)))


# positional: the target's and the draft's (config, params), then the block and its context K/V
def draft_hidden(tcfg, tparams, cfg: DraftConfig, params, block_ids, anchors, k_ctx, v_ctx, *, impl: str = "auto",
                 ctx_start=None, decode_impl: str | None = None, block_len=None):
    """THE draft forward (decoding and training): block token ids [B, N*Bk], block b anchored at
    ``anchors[:, b]`` (seeing context slots from ``ctx_start[:, b]``, default 0), embedded with the
    target's raw table (a DSpark draft's own) times ``input_embedding_scale``; per-layer context K/V [B, S, K, H] (slot s =
    position s) -> final-normed hidden states [B, N*Bk, D] in the context's dtype. ``decode_impl`` given:
    decoding (one block per row) with that decode attention impl instead of ``impl``'s block attention;
    ``block_len``: see ``DraftModel.__call__`` (not differentiable; None for training)."""
    if cfg.own_embeddings:
        x = DraftModel(cfg).apply({"params": params}, block_ids, method=DraftModel.embed)
    else:
        x = target_lib.embed(tcfg, tparams, block_ids)
    x = x.astype(k_ctx[0].dtype)
    if cfg.input_embedding_scale != 1.0:
        x = x * jnp.asarray(cfg.input_embedding_scale, x.dtype)
    decode = decode_impl is not None
    return DraftModel(cfg).apply({"params": params}, x, anchors, k_ctx, v_ctx, decode_impl if decode else impl,
                                  ctx_start, decode=decode, block_len=block_len)


def logits(tcfg, tparams, cfg: DraftConfig, params, h):
    """Draft logits (float32) of final-normed draft hidden states: the target's lm_head (a DSpark draft's own),
    times the draft's ``output_multiplier``, then ``cap * tanh(logits / cap)`` when ``final_logit_softcapping`` is
    set. DSpark's Markov bias comes after (``spark``)."""
    if cfg.own_embeddings:
        out = DraftModel(cfg).apply({"params": params}, h, method=DraftModel.head)
    else:
        out = target_lib.head(tcfg, tparams, h)
    if cfg.output_multiplier != 1.0:
        out = out * jnp.float32(cfg.output_multiplier)
    if cfg.final_logit_softcapping is not None:
        cap = jnp.float32(cfg.final_logit_softcapping)
        out = cap * jnp.tanh(out / cap)
    return out


# positional: the target's and the draft's (config, params), then the block and its context K/V
def block_logits(tcfg, tparams, cfg: DraftConfig, params, block_ids, anchors, k_ctx, v_ctx, *, impl: str = "auto",
                 drop_anchor: bool = False, decode_impl: str | None = None, block_len=None, with_hidden=False):
    """``draft_hidden`` -> float32 ``logits``.
    ``drop_anchor`` (one block per row): logits of positions 1.. only, [B, Bk-1, V]; the lm_head then skips
    the anchor row, whose logits decoding never uses (on a CPU the head is a large part of a draft forward).
    ``with_hidden``: (logits, the hidden states they came from)."""
    h = draft_hidden(tcfg, tparams, cfg, params, block_ids, anchors, k_ctx, v_ctx, impl=impl, decode_impl=decode_impl,
                     block_len=block_len)
    h = h[:, 1:] if drop_anchor else h
    out = logits(tcfg, tparams, cfg, params, h)
    return (out, h) if with_hidden else out


def select(cfg: DraftConfig, params, h, scores, anchor, *, temperature=None, key=None):
    """DFlash2's candidate-selector walk over one block per row: final-normed hidden h [B, T, D] and draft
    logits ``scores`` [B, T, V] of block positions 1..T, ``anchor`` [B] (block token 0) -> (tokens [B, T]
    int32, candidates [B, T, k] int32, walk scores [B, T, k] float32). Per position t the top-k logits
    (unary) are the candidates; s_j = unary_j + sum_r A[pred, r] u[t, r] S[cand_j, r] (A, S the predecessor /
    successor codebooks, u the projected hidden), pred the previous token (the anchor first). Greedy
    (``temperature`` None) takes argmax s; otherwise per row ([B] temperatures, ``key`` [B, 2] per-row keys) a draw
    from softmax(s / temperature), the argmax where a row's temperature is 0."""
    u, pred_book, succ_book = DraftModel(cfg).apply({"params": params}, h, method=DraftModel.select_inputs)
    unary, cand = jax.lax.top_k(scores, cfg.selector_top_k)
    succ = jnp.take(succ_book, cand, axis=0).astype(jnp.float32)  # [B, T, k, r]
    b, t = scores.shape[:2]
    keys = row_keys(key, t) if key is not None else jnp.zeros((t, b, 2), jnp.uint32)

    def walk(pred, xs):
        u_t, unary_t, cand_t, succ_t, key_t = xs
        a = jnp.take(pred_book, pred, axis=0).astype(jnp.float32) * u_t.astype(jnp.float32)
        s = unary_t + jnp.einsum("BR,BKR->BK", a, succ_t)
        j = jnp.argmax(s, axis=-1)
        if temperature is not None:
            temp = jnp.broadcast_to(temperature, (b,))
            j = jnp.where(temp == 0, j, categorical(key_t, s / jnp.maximum(temp, 1e-6)[:, None]))
        token = jnp.take_along_axis(cand_t, j[:, None], axis=1)[:, 0].astype(jnp.int32)
        return token, (token, s)

    xs = tuple(jnp.swapaxes(x, 0, 1) for x in (u, unary, cand, succ)) + (keys,)
    _, (tokens, walk_scores) = jax.lax.scan(walk, anchor.astype(jnp.int32), xs)
    return jnp.swapaxes(tokens, 0, 1), cand.astype(jnp.int32), jnp.swapaxes(walk_scores, 0, 1)


def on_vocab(candidates, values, vocab: int, fill=-jnp.inf):
    """Per-candidate ``values`` [B, T, k] scattered onto the vocabulary [B, T, V] (``fill`` elsewhere)."""
    b, t, _ = candidates.shape
    rows, cols = jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None]
    return jnp.full((b, t, vocab), fill, values.dtype).at[rows, cols, candidates].set(values)


def spark(cfg: DraftConfig, params, h, base_logits, anchor, *, prev=None, sampling=None, key=None,
          confidence_logits: bool = False):
    """DSpark's left-to-right walk (``dspark.walk``) over one block per row with this draft's heads: hidden h
    [B, T, D], base logits [B, T, V] of every slot, ``anchor`` [B] -> (tokens [B, T], Markov-corrected scores
    [B, T, V], confidence [B, T] or None); ``prev`` [B, T - 1] teacher-forces the previous tokens (training),
    ``confidence_logits`` returns the confidence head's logits instead."""
    model = DraftModel(cfg)
    step = lambda x, h_j, s: model.apply({"params": params}, x, h_j, s, method=DraftModel.spark_step)  # noqa: E731
    return walk(step, h, base_logits, anchor, state_width=spark_state_width(cfg), confident=bool(cfg.confidence_head),
                prev=prev, sampling=sampling, key=key, confidence_logits=confidence_logits)


# positional: the target's and the draft's (config, params), then the block and its context K/V
def propose(tcfg, tparams, cfg: DraftConfig, params, block_ids, anchors, k_ctx, v_ctx, *, impl: str = "auto",
            decode_impl: str | None = None, block_len=None):
    """Greedy draft tokens for one block per row: block_ids [B, K] = [anchor token, mask...] -> [B, K-1] int32
    (the argmax of the draft logits; DFlash2: the candidate-selector walk); a DSpark draft (``cfg.shifted``) drafts
    every slot of the block it is given: [B, K] (its Markov walk)."""
    out, h = block_logits(tcfg, tparams, cfg, params, block_ids, anchors, k_ctx, v_ctx, impl=impl,
                          drop_anchor=not cfg.shifted, decode_impl=decode_impl, block_len=block_len, with_hidden=True)
    if cfg.shifted:
        return spark(cfg, params, h, out, block_ids[:, 0])[0]
    if cfg.convolves:
        return select(cfg, params, h, out, block_ids[:, 0])[0]
    return jnp.argmax(out, axis=-1).astype(jnp.int32)


def _context_cache(tcfg, tparams, cfg, params, context_ids, length):
    """The draft's context K/V of ``context_ids`` [B, T'] whose first ``length`` tokens are the context (the rest
    padding: the target is causal and the draft sees only slots before its anchor, so neither reads it)."""
    b, t = context_ids.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    _, features, _ = target_lib.forward(tcfg, tparams, context_ids, positions, feature_layer_ids=cfg.target_layer_ids)
    k, v = context_kv(cfg, params, features, positions)
    return jnp.full((b, 1), length, jnp.int32), k, v


# positional: jitted; the target's and the draft's (config, params), the padded context, its length, the block
@functools.partial(jax.jit, static_argnames=("tcfg", "cfg"))
def _draft_block_logits(tcfg, tparams, cfg, params, context_ids, length, block_ids):
    out, h = block_logits(tcfg, tparams, cfg, params, block_ids,
                          *_context_cache(tcfg, tparams, cfg, params, context_ids, length), with_hidden=True)
    return spark(cfg, params, h, out, block_ids[:, 0])[1] if cfg.shifted else out


# positional: as _draft_block_logits
@functools.partial(jax.jit, static_argnames=("tcfg", "cfg"))
def _draft_block_tokens(tcfg, tparams, cfg, params, context_ids, length, block_ids):
    anchors, k, v = _context_cache(tcfg, tparams, cfg, params, context_ids, length)
    return propose(tcfg, tparams, cfg, params, block_ids, anchors, k, v)


CONTEXT_BUCKET = 32  # context ids are padded to a multiple of this: one program per 32 context lengths


def _checked_inputs(target: Target, draft: Draft, context_ids, block_ids):
    """(context ids padded to a multiple of ``CONTEXT_BUCKET``, the context's length, block ids), checked."""
    check_pair(target, draft)
    v = target.config.vocab_size
    ctx = check_token_ids(context_ids, v, "context_ids")
    blk = check_token_ids(block_ids, v, "block_ids")
    if blk.shape[0] != ctx.shape[0]:
        raise ValueError(f"context_ids has batch {ctx.shape[0]} but block_ids has batch {blk.shape[0]}")
    t = ctx.shape[1]
    return np.pad(ctx, ((0, 0), (0, -t % CONTEXT_BUCKET))), np.int32(t), blk


def draft_block_logits(target: Target, draft: Draft, context_ids, block_ids) -> np.ndarray:
    """Target runs on ``context_ids`` [B, T] (positions 0..T-1); the draft predicts ``block_ids`` [B, L]
    placed at T..T+L-1 and returns its logits [B, L, V] (float32; ``logits``: the target's lm_head, then the
    draft's output multiplier and soft cap). DSpark: slot j's logits predict position T+j+1, Markov-corrected
    given its greedy previous token (the anchor for slot 0)."""
    ctx, t, blk = _checked_inputs(target, draft, context_ids, block_ids)
    return np.asarray(_draft_block_logits(target.config, target.params, draft.config, draft.params, ctx, t, blk))


def draft_block_tokens(target: Target, draft: Draft, context_ids, block_ids) -> np.ndarray:
    """The draft's greedy proposal [B, L-1] (int) for block positions 1..L-1 of ``block_ids`` [B, L] placed
    after ``context_ids`` [B, T]: the argmax of ``draft_block_logits`` (DFlash v1), the candidate-selector
    walk (DFlash2); a DSpark draft proposes L tokens [B, L] (positions T+1..T+L, its greedy Markov walk)."""
    ctx, t, blk = _checked_inputs(target, draft, context_ids, block_ids)
    if blk.shape[1] < 2 and not draft.config.shifted:
        raise ValueError(f"block_ids needs at least 2 positions (an anchor and one to draft), got {blk.shape[1]}")
    return np.asarray(_draft_block_tokens(target.config, target.params, draft.config, draft.params, ctx, t, blk))


# --- Hugging Face layout ------------------------------------------------------------------------


def load_draft(path_or_hub_id, dtype="float32", place=None) -> Draft:
    """Load a released-format DFlash / DFlash2 draft, or a DSpark draft as DeepSpec saves it (config.json +
    model.safetensors, no ``model.`` prefix)."""
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
