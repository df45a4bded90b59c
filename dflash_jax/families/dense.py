"""The dense family: Qwen3 (q/k norm) and LLaMA-3.x decoders; GQA, optional sliding-window layers.

One forward serves prefill, verification and plain full-sequence scoring: with a cache, each layer's
decode state (``dflash_jax.state``) takes the new K/V and returns the keys the queries may see; queries
see keys at positions <= their own (offset-causal: committed context plus the causal part of the new
tokens); without a cache, plain causal attention over the given tokens. Decode and verify forwards on a
full-attention cache read only the slots below each row's length (``attention.decode_attention``; a paged
cache's pages in place: ``attention.paged_decode_attention``).
"""
from __future__ import annotations

from typing import ClassVar

import flax.linen as nn
import jax.numpy as jnp

from dflash_jax.attention import (MAX_QUERIES, attend, decode_attention, paged_decode_attention, position_mask,
                                  stacked_decode_attention)
from dflash_jax import layer_scan
from dflash_jax.checkpoints import NameTable
from dflash_jax.config import TargetConfig
from dflash_jax.families.family import Family
from dflash_jax.layers import MLP, AttentionProjections, Embed, Linear, RMSNorm
from dflash_jax.state import LayerStates, FullKV, KVSpec, PagedKV, SlidingKV


# positional: the attention operands (q, and their positions / lengths / own keys), as decode_attention orders them
def _cache_attention(state, q, q_pos, lengths, k_new=None, v_new=None, **kw):
    """``decode_attention`` over a full cache: a ``FullKV``'s rows, a ``PagedKV``'s pages read in place, or a scanned
    layer's stack (``state.Stacked``: its pages, or its rows read as pages)."""
    if isinstance(state, PagedKV):
        return paged_decode_attention(q, *state.pages(), q_pos, lengths, k_new, v_new, **kw)
    if state.layer is not None:
        return stacked_decode_attention(q, state.k, state.v, state.layer, q_pos, lengths, k_new, v_new, **kw)
    return decode_attention(q, *state.view(), q_pos, lengths, k_new, v_new, **kw)


class DecoderLayer(nn.Module):
    cfg: TargetConfig
    index: int
    attention_impl: str = "auto"  # decode attention on a full cache (``attention.decode_attention``'s impl)

    def setup(self):
        c = self.cfg
        self.token_mixer()
        self.mlp = self.feed_forward()
        self.input_layernorm = RMSNorm(c.rms_norm_eps, zero_centred=c.norm_offset)
        self.post_attention_layernorm = RMSNorm(c.rms_norm_eps, zero_centred=c.norm_offset)

    def token_mixer(self) -> None:
        """Build the block before the MLP as a submodule (its attribute name is its checkpoint name):
        attention, ``self_attn`` (a family with other layers overrides this and ``mix``)."""
        self.self_attn = AttentionProjections(self.cfg)

    def feed_forward(self) -> nn.Module:
        """The block after attention (``mlp``): the gated MLP here; a family with experts overrides it."""
        return MLP(self.cfg)

    def mix(self, h, positions, state, segment_ids=None, new_mask=None):
        """The token mixer on the normed input h [B, T, D] -> (output [B, T, D], new layer state or None);
        ``segment_ids`` [B, T] (no state): a token sees only keys of its own segment (packed documents);
        ``new_mask`` [B, T, T]: a tree verify (``tree_attention``)."""
        q, gate = self.self_attn.gated_queries(h, positions)
        k, v = self.self_attn.keys_values(h, positions)
        o, state = self.attend(q, k, v, positions, state, segment_ids, new_mask)
        return self.self_attn.output(o, gate), state

    # positional: the hook families override and call (gemma4, deepseek_v3), in the layer's own argument order
    def attend(self, q, k, v, positions, state, segment_ids=None, new_mask=None):
        """Queries q [B, T, N, H] against the new keys / values k, v [B, T, K, H] and the layer's state (this
        layer's window, sinks and scale) -> (o [B, T, N, H], the state with k, v written)."""
        window, sinks = self.cfg.layer_window(self.index), self.self_attn.sink_logits()
        scale = self.self_attn.attention_scale()
        if new_mask is not None:
            return self.tree_attention(q, k, v, positions, state, new_mask, window=window, sinks=sinks, scale=scale)
        if isinstance(state, (FullKV, PagedKV)) and positions.shape[1] <= MAX_QUERIES:  # decode / verify: bounded
            state = state.write(k, v, positions)
            o = _cache_attention(state, q, positions, jnp.max(positions, axis=1) + 1,
                                 sliding_window=window, sinks=sinks, impl=self.attention_impl, scale=scale)
            return o, state
        if isinstance(state, (FullKV, PagedKV)):  # a prefill: the cache below its first position, then its own
            # tokens causally, so that its cost follows the prompt, not the cache's length. Written first: reading
            # the old pool beside the write made XLA copy the whole pool
            impl = "loop" if self.attention_impl in ("auto", "kernel", "interpret") else self.attention_impl
            first = jnp.min(jnp.where(positions >= 0, positions, jnp.iinfo(jnp.int32).max), axis=1)
            state = state.write(k, v, positions)
            o = _cache_attention(state, q, positions, jnp.where(jnp.any(positions >= 0, axis=1), first, 0), k, v,
                                 sliding_window=window, sinks=sinks, impl=impl, new_causal=True, scale=scale)
            return o, state
        if state is None:
            k_pos, exists = positions, positions >= 0
            if segment_ids is not None:
                exists = exists[:, None, :] & (segment_ids[:, :, None] == segment_ids[:, None, :])
        else:
            state, k, v, k_pos, exists = state.update(k, v, positions)
        mask = position_mask(positions, k_pos, causal=True, sliding_window=window, k_valid=exists)
        return attend(q, k, v, mask, sinks=sinks, scale=scale), state

    def tree_attention(self, q, k, v, positions, state, new_mask, *, window, sinks, scale=None):
        """Tree verify: tokens [root, nodes] at positions n + depth (the root's, positions[:, 0], is the
        committed length n); each query sees the cache below n (within the window) and the new tokens
        ``new_mask`` allows. Their K/V are stored in slot order (``tree_write``), for ``LayerStates.compact``."""
        n = positions[:, 0]
        if isinstance(state, SlidingKV):  # the ring is small: dense over [ring | new tokens]
            ctx = position_mask(positions, state.pos, causal=True, sliding_window=window,
                                k_valid=(state.pos >= 0) & (state.pos < n[:, None]))
            valid = positions >= 0
            own = new_mask & valid[:, :, None] & valid[:, None, :]
            o = attend(q, jnp.concatenate([state.k, k.astype(state.k.dtype)], axis=1),
                       jnp.concatenate([state.v, v.astype(state.v.dtype)], axis=1),
                       jnp.concatenate([ctx, own], axis=-1), sinks=sinks, scale=scale)
            return o, state.tree_write(k, v, n)
        if not isinstance(state, (FullKV, PagedKV)):
            raise ValueError(f"tree verification needs an attention cache, not {type(state).__name__}")
        impl = self.attention_impl
        if positions.shape[1] > MAX_QUERIES and impl in ("auto", "kernel", "interpret"):
            impl = "loop"  # the kernel holds at most MAX_QUERIES queries per row; the tiled jnp loop any number
        o = _cache_attention(state, q, positions, n, k, v, sliding_window=window, sinks=sinks,
                             impl=impl, new_mask=new_mask, scale=scale)
        return o, state.tree_write(k, v, n)

    def __call__(self, x, positions, state, segment_ids=None, new_mask=None):
        """x [B, T, D] at ``positions`` [B, T] -> (x, new layer state or None); ``new_mask``: see ``mix``."""
        out, state = self.mix(self.input_layernorm(x), positions, state, segment_ids, new_mask)
        x = x + out
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, state


class Decoder(nn.Module):
    """Decoder with Hugging Face parameter names (``embed_tokens``, ``layers_N``, ``norm``, ``lm_head``)."""

    cfg: TargetConfig
    attention_impl: str = "auto"
    # (first layer, repeats, period) of each group scanned as one (``layer_scan``; ``target.layer_groups``); empty:
    # unrolled
    groups: tuple = ()
    layer_class: ClassVar[type] = DecoderLayer  # a family whose layers differ only after attention swaps it
    scan_step: ClassVar[type] = layer_scan.ScanStep  # one step of a group's scan (``scan_layers``)

    def setup(self):
        c = self.cfg
        self.embed_tokens = Embed(c.vocab_size, c.hidden_size)
        for first, repeats, period in self.layer_groups():  # each under its name (``layer_scan.group_name``)
            setattr(self, layer_scan.group_name(first, repeats, period),
                    self.layer_class(c, first, self.attention_impl) if repeats == 1 else
                    layer_scan.scanned(self.scan_step, repeats)(self.layer_class, c, first, period,
                                                                self.attention_impl))
        self.norm = RMSNorm(c.rms_norm_eps, zero_centred=c.norm_offset)
        if not c.tie_word_embeddings:
            self.lm_head = Linear(c.vocab_size, False, ("embed", "vocab"))

    def layer_groups(self) -> tuple:
        """``groups``, or every layer alone (unrolled)."""
        return self.groups or tuple((i, 1, 1) for i in range(self.cfg.num_hidden_layers))

    def group(self, first: int, repeats: int, period: int) -> nn.Module:
        """A group's module: a lone layer, or the group's scan."""
        return getattr(self, layer_scan.group_name(first, repeats, period))

    def embed(self, ids):
        """The raw embedding lookup (the draft embeds its blocks with it)."""
        return self.embed_tokens(ids)

    def head(self, h):
        """Logits (float32) of already-normalised hidden states: the plain lm_head, which the draft reuses."""
        if self.cfg.tie_word_embeddings:
            return self.embed_tokens.attend(h)
        return self.lm_head(h).astype(jnp.float32)

    def embed_inputs(self, input_ids):
        """The first layer's input (``hidden_states[0]``): ``embed``, unless a family transforms it."""
        return self.embed(input_ids)

    def logits(self, h):
        """The target's own logits of final-normed states: ``head``, unless a family transforms them."""
        return self.head(h)

    # positional: the family decoder contract (family.py) that target.forward calls in this order
    def __call__(self, input_ids, positions, cache: LayerStates | None = None, feature_layer_ids: tuple = (),
                 logits_index=None, segment_ids=None, new_mask=None):
        """input_ids, positions [B, T] -> (logits [B, T or 1, V] float32, features [B, T, n*D] or None, cache).

        Features are Hugging Face ``hidden_states[id + 1]`` for each id in ``feature_layer_ids``,
        concatenated in that order: the output of layer ``id`` (id -1: the embedding output, the first layer's
        input), except that for the LAST layer Hugging Face (and so every released draft) sees it after the
        final norm. ``logits_index`` [B] keeps only the logits at one position per row (prefill needs just the
        last prompt token's).
        ``segment_ids`` [B, T] (without a cache): attention stays within each segment, so a row packed
        with several documents (positions restarting at 0 in each) gives each its unpacked features.
        ``new_mask`` [B, T, T] bool (with a cache): tree verification (``DecoderLayer.tree_attention``).
        """
        self.check_feature_ids(feature_layer_ids)
        x = self.embed_inputs(input_ids)
        picked, states = {-1: x}, []
        for first, repeats, period in self.layer_groups():  # a group's states: one per position in its period
            layer = self.group(first, repeats, period)
            s = None if cache is None else cache.layers[len(states):len(states) + period]
            if repeats == 1:
                x, s = layer(x, positions, None if s is None else s[0], segment_ids, new_mask)
                picked[first] = x
                states.append(s)
                continue
            x, s, outs = layer_scan.run(layer, first, repeats, period, x, positions, s, feature_layer_ids,
                                        segment_ids, new_mask)
            picked.update(outs)
            states.extend(s or [None] * period)
        return self.outputs(x, picked, states, cache, feature_layer_ids, logits_index)

    def check_feature_ids(self, feature_layer_ids) -> None:
        """Feature layer ids in -1..L-1 (a Python index would wrap: -2 would be the last layer's output)."""
        last = self.cfg.num_hidden_layers - 1
        bad = [i for i in feature_layer_ids if not -1 <= i <= last]
        if bad:
            raise ValueError(f"feature_layer_ids {list(feature_layer_ids)}: {bad} outside -1..{last}")

    def outputs(self, x, picked, states, cache, feature_layer_ids, logits_index):
        """``x``: the last layer's output; ``picked``: Hugging Face's ``hidden_states[i + 1]`` before the final norm
        (the output of layer i; -1: the embedding output) of at least each i in ``feature_layer_ids``; ``states``:
        the cache's new entries (a layer's state, or a scanned group's per position) -> ``__call__``'s (logits,
        features, cache)."""
        last = self.cfg.num_hidden_layers - 1
        hidden = [self.norm(x) if i == last else picked[i] for i in feature_layer_ids]
        features = jnp.concatenate(hidden, axis=-1) if feature_layer_ids else None
        if logits_index is not None:
            x = jnp.take_along_axis(x, logits_index[:, None, None], axis=1)
        if cache is not None:
            cache = cache.replace(layers=tuple(states))
        return self.logits(self.norm(x)), features, cache


def checkpoint(cfg: TargetConfig) -> NameTable:
    """``model.``-prefixed names; a tied checkpoint may still carry an ``lm_head.weight`` copy."""
    tied = (r"^lm_head\.weight$",) if cfg.tie_word_embeddings else ()
    return NameTable(prefix="model.", ignored=NameTable.ignored + tied)


def state_specs(cfg: TargetConfig) -> tuple[KVSpec, ...]:
    return tuple(KVSpec(cfg.num_key_value_heads, cfg.head_dim, cfg.layer_window(i))
                 for i in range(cfg.num_hidden_layers))


def layer_kinds(cfg: TargetConfig) -> tuple:
    """What sets a layer apart (``Family.layer_kinds``): its attention type (full, or a sliding window)."""
    return cfg.layer_types


FAMILY = Family(name="dense", config=TargetConfig, decoder=Decoder, checkpoint=checkpoint, state_specs=state_specs,
                layer_kinds=layer_kinds)
