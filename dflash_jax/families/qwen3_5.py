"""The Qwen3.5 / Qwen3.6 dense hybrid family (Qwen3.5-4B / 9B / 27B, Qwen3.6-27B): three of every four
layers are Gated DeltaNet linear attention, every 4th is gated full attention; a gated SiLU MLP in all.

Linear-attention layers (``linear_attn``, as transformers' ``Qwen3_5GatedDeltaNet``): ``in_proj_qkv`` ->
depthwise causal conv1d (kernel ``linear_conv_kernel_dim``, no bias) + SiLU over [q; k; v]; q and k
L2-normalised, q scaled by dk**-0.5, each key head serving ``Hv / Hk`` consecutive value heads; decay
g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b); the gated delta rule per value head

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - (exp(g_t) S_{t-1})^T k_t))^T,   o_t = S_t^T q_t

then RMSNorm(o) * silu(z) per head (plain weights) and ``out_proj``. Two forms that agree: the
**chunked** form (chunk-parallel within chunks of 64 through a unit-triangular solve, a ``lax.scan``
across chunks, fp32 state; transformers' ``torch_chunk_gated_delta_rule``) for prefill, verification and
training, and the **recurrent** form (one token per step; ``torch_recurrent_gated_delta_rule``) for
single-token decoding. Decode state per layer (``state.Recurrent``): the conv window [conv_dim, K-1]
(the last K-1 inputs, cache dtype) and the recurrent state [Hv, dk, dv] (float32). A forward of at most
``max_block`` tokens leaves them as they are and stashes, per token, its key, its corrected value u, its
summed log decay G and its conv input; the engine's ``LayerStates.commit(kept)`` then folds the kept ones
in (``fold``: S = exp(G_l) S_0 + sum_{j<=l} exp(G_l - G_j) k_j u_j^T, the chunked form's own state
formula), so nothing is rolled back and no per-token state is stored. Padding tokens (position < 0) get
g = 0 and beta = 0 (the state passes through them bit-exactly) and are left out of the conv window.

Tree verification (``new_mask``, docs/tree-verification.md): every slot of [root, nodes] sees the
committed state and its tree ancestors only, exactly as a sequential run over its root-to-node path: the
conv taps walk up the tree (``tree_conv``), and the chunked form runs as one chunk with the ancestor mask
for the causal one and path-summed log decays (``chunked_delta_rule(ancestors=)``). The stash holds every
slot; ``LayerStates.compact`` moves the accepted path's to the front, and the commit folds that path in as
it folds a chain.

Full-attention layers: ``dense`` attention with ``attn_output_gate`` (q_proj yields per head [query |
gate], output * sigmoid(gate)), q/k RMSNorm, rotary on ``partial_rotary_factor`` (0.25) of the head dim.
Every RMSNorm outside the gated one is zero-centred ((1 + w) * x_hat, ``norm_offset``).

Rope: the multimodal sections (``mrope_section``) apply three position streams (t, h, w) to interleaved
frequency bands; for text, transformers gives all three streams the same positions, so the rotation
is plain rope over the rotary dims (tests check this against ``Qwen3_5ForConditionalGeneration``).

Checkpoints: the released ones are vision-language (``Qwen3_5ForConditionalGeneration``; config.json
``model_type: qwen3_5`` with a ``text_config`` of ``model_type: qwen3_5_text``): text weights under
``model.language_model.``, vision tower ``model.visual.*`` and multi-token-prediction ``mtp.*`` skipped
(and reported). Text-only checkpoints (``Qwen3_5ForCausalLM``, ``qwen3_5_text``) use ``model.``.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.checkpoints import skip_tensors
from dflash_jax.config import TargetConfig, read_config_json
from dflash_jax.families import dense
from dflash_jax.families.family import Family
from dflash_jax.layers import Linear, RMSNorm, initializer
from dflash_jax.state import KVSpec, RecurrentSpec

CHUNK = 64  # chunk length of the chunked delta rule (transformers' and FLA's default)
LAYER_TYPES = ("linear_attention", "full_attention")
VL_PREFIX, TEXT_PREFIX = "model.language_model.", "model."
SKIPPED = ((r"^model\.visual\.", "vision tower (model.visual.*)"), (r"^mtp\.", "multi-token prediction (mtp.*)"))
# transformers' Qwen3_5TextConfig defaults, for config.json files that leave them out
_DEFAULTS = {"head_dim": 256, "rms_norm_eps": 1e-6, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
             "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32}
_LINEAR = tuple(k for k in _DEFAULTS if k.startswith("linear_"))
# (flax leaf, checkpoint leaf, transposed): the conv kernel is stored [conv_dim, 1, K] like ours
_LEAVES = (("A_log", "A_log", False), ("dt_bias", "dt_bias", False), ("conv_weight", "weight", False))


@dataclasses.dataclass(frozen=True)
class Qwen35Config(TargetConfig):
    """The text model of a Qwen3.5 / 3.6 dense checkpoint; ``layer_types`` mixes linear_attention and
    full_attention; ``vision_language``: the checkpoint is the VL layout (weights under model.language_model.)."""

    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    vision_language: bool = False

    def _check_layer_types(self) -> None:
        """Linear (Gated DeltaNet) and full attention layers, one per layer (no sliding window layers)."""
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad or len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types must be {self.num_hidden_layers} of {LAYER_TYPES}, got {list(self.layer_types)}")

    def __post_init__(self):
        object.__setattr__(self, "layer_types", tuple(self.layer_types))  # hashable (a static jit argument)
        super().__post_init__()
        for k in _LINEAR:
            if getattr(self, k) < 1:
                raise ValueError(f"{k} must be >= 1, got {getattr(self, k)}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                             f"linear_num_key_heads={self.linear_num_key_heads}")

    def is_linear(self, i: int) -> bool:
        return self.layer_types[i] == "linear_attention"

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.value_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    # (vision-language, text-only) model_type and transformers class ("" / None: no VL layout); a family
    # built on this one (the MoE variants) names its own and adds its fields by ``_extra_fields`` / ``_extra_hf``
    MODEL_TYPES: ClassVar[tuple[str, str]] = ("qwen3_5", "qwen3_5_text")
    ARCHITECTURES: ClassVar[tuple[str, str]] = ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM")

    @classmethod
    def _text_config(cls, d: dict) -> dict:
        """The language model's settings of a config.json (its ``text_config`` in the VL layout)."""
        model_type = d.get("model_type")
        vl, text_only = cls.MODEL_TYPES
        if vl and model_type == vl:
            if not isinstance(d.get("text_config"), dict):
                raise ValueError(f"a {vl} config.json needs a text_config (the language model's settings)")
            return {"eos_token_id": d.get("eos_token_id"), **d["text_config"],
                    "tie_word_embeddings": d.get("tie_word_embeddings", False)}  # the VL model ties by its own flag
        if model_type == text_only:
            return d
        raise ValueError(f"not a {cls.__name__} config: model_type {model_type!r} (expected {vl!r} or {text_only!r})")

    @classmethod
    def _extra_fields(cls, text: dict) -> dict:
        """Fields a subclass reads from the text config (after the defaults are filled in)."""
        return {}

    def _extra_hf(self) -> dict:
        """Entries a subclass adds to the text config it writes."""
        return {}

    @classmethod
    def from_hf(cls, path_or_dict) -> "Qwen35Config":
        d = read_config_json(path_or_dict)
        model_type = d.get("model_type")
        text = cls._text_config(d)
        text = {**_DEFAULTS, **{k: v for k, v in text.items() if v is not None}}
        n = int(text.get("num_hidden_layers", 0))
        interval = int(text.get("full_attention_interval", 4))
        types = tuple(text.get("layer_types") or [LAYER_TYPES[(i + 1) % interval == 0] for i in range(n)])
        # rope: the mrope sections reduce to one stream for text (see the module docstring); the partial
        # factor (transformers' default 0.25) is ours to apply
        key = "rope_parameters" if text.get("rope_parameters") else "rope_scaling"
        rope = dict(text.get(key) or {})
        partial = float(rope.pop("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
        for k in ("mrope_section", "mrope_interleaved"):
            rope.pop(k, None)
        base = {k: v for k, v in text.items() if k not in ("partial_rotary_factor", "layer_types")}
        c = cls._from_dict({**base, key: rope or None}, "qwen3_5")
        return dataclasses.replace(
            c, model_type=model_type, qk_norm=True, attn_output_gate=True, norm_offset=True, layer_types=types,
            rope=dataclasses.replace(c.rope, partial_rotary_factor=partial),
            vision_language=model_type == cls.MODEL_TYPES[0], **{k: int(text[k]) for k in _LINEAR},
            **cls._extra_fields(text))

    def to_hf(self) -> dict:
        text = TargetConfig.to_hf(dataclasses.replace(self, layer_types=()))
        for k in ("use_sliding_window", "max_window_layers", "sliding_window"):
            del text[k]
        vl, text_only = self.MODEL_TYPES
        text.update({"architectures": [self.ARCHITECTURES[1]], "model_type": text_only,
                     "layer_types": list(self.layer_types), **{k: getattr(self, k) for k in _LINEAR},
                     **self._extra_hf()})
        if not self.vision_language:
            return text
        del text["architectures"]
        return {"architectures": [self.ARCHITECTURES[0]], "model_type": vl, "text_config": text,
                "tie_word_embeddings": self.tie_word_embeddings}


# ----------------------------------------------------------------------------------------------------
# The gated delta rule: chunked and recurrent forms
# ----------------------------------------------------------------------------------------------------

def recurrent_delta_rule(q, k, v, g, beta, state):
    """One token at a time. q, k [B, T, H, dk] (normalised, q scaled), v [B, T, H, dv], g, beta [B, T, H],
    state [B, H, dk, dv] (all float32) -> (outputs [B, T, H, dv], final state, the corrected value each token
    writes u_t = beta_t (v_t - (exp(g_t) S_{t-1})^T k_t) [B, T, H, dv])."""
    def step(s, x):
        q_t, k_t, v_t, g_t, b_t = x
        s = s * jnp.exp(g_t)[..., None, None]
        delta = (v_t - jnp.einsum("bhkv,bhk->bhv", s, k_t)) * b_t[..., None]
        s = s + k_t[..., :, None] * delta[..., None, :]
        return s, (jnp.einsum("bhkv,bhk->bhv", s, q_t), delta)

    final, (out, u) = jax.lax.scan(step, state, tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta)))
    return jnp.moveaxis(out, 0, 1), final, jnp.moveaxis(u, 0, 1)


def log_decay(g, ancestors=None):
    """The summed log decay of each token since the forward's start: g [B, T, H] -> [B, T, H], the cumulative sum,
    or over each node's path (``ancestors`` [B, T, T] bool, inclusive) for a tree."""
    if ancestors is None:
        return jnp.cumsum(g, axis=1)
    return jnp.einsum("bij,bjh->bih", ancestors.astype(g.dtype), g, precision=jax.lax.Precision.HIGHEST)


def chunked_delta_rule(q, k, v, g, beta, state, *, chunk: int = CHUNK, segments=None, ancestors=None):
    """Chunk-parallel within chunks, recurrent across them; same arguments as ``recurrent_delta_rule``.
    ``segments`` [B, T] (packed documents, contiguous, distinct ids): the state restarts from zero at each
    segment's first token (``state`` feeds the first segment only). ``ancestors`` [B, T, T] bool (tree
    verification, inclusive, every ancestor before its node): each token sees ``state`` and its ancestors only,
    as a sequential run over its root-to-node path would (one chunk: the causal mask becomes the ancestor mask,
    the cumulative decay the path's); the final state is then the incoming one.
    -> (outputs [B, T, H, dv], final state [B, H, dk, dv], corrected values u [B, T, H, dv] as
    ``recurrent_delta_rule``'s)."""
    b, t, h, dk = k.shape
    c = t if ancestors is not None else min(chunk, t)
    pad = -t % c
    n = (t + pad) // c

    def chunks(a):  # [B, T, H, ...] -> [N, B, H, C, ...]
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        a = a.reshape((b, n, c) + a.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(a, 1, 0), 3, 2)

    if ancestors is None:
        q, k, v, g, beta = (chunks(a) for a in (q, k, v, g, beta))
        cum = jnp.cumsum(g, axis=-1)  # [N, B, H, C]
        lower = jnp.tril(jnp.ones((c, c), bool))
    else:
        cum = chunks(log_decay(g, ancestors))
        q, k, v, g, beta = (chunks(a) for a in (q, k, v, g, beta))
        lower = ancestors[None, :, None]  # [1, B, 1, C, C]
    carried = last = None  # segments: the tokens the incoming state reaches / that reach the outgoing one
    if segments is not None:  # cut every path between tokens of different segments
        seg = jnp.pad(segments, [(0, 0), (0, pad)], mode="edge").reshape(b, n, 1, c)
        seg = jnp.broadcast_to(jnp.moveaxis(seg, 1, 0), (n, b, h, c))
        before = jnp.concatenate([seg[:1, ..., :1], seg[:-1, ..., -1:]])  # the segment the incoming state holds
        carried, last = seg == before, seg == seg[..., -1:]
        lower = lower & (seg[..., :, None] == seg[..., None, :])
    keep = lambda x, m: x if m is None else x * m  # noqa: E731
    decay = jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf))  # exp(G_i - G_j), j <= i
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    system = jnp.where(jnp.tril(lower, -1), (k_beta @ jnp.swapaxes(k, -1, -2)) * decay, 0) + jnp.eye(c)
    solve = lambda rhs: jax.lax.linalg.triangular_solve(system, rhs, left_side=True, lower=True,  # noqa: E731
                                                        unit_diagonal=True)
    u, w = solve(v_beta), solve(k_beta * keep(jnp.exp(cum), carried)[..., None])
    intra = (q @ jnp.swapaxes(k, -1, -2)) * decay
    q_dec = q * keep(jnp.exp(cum), carried)[..., None]
    if ancestors is None:
        k_dec = k * keep(jnp.exp(cum[..., -1:] - cum), last)[..., None]
        chunk_decay = keep(jnp.exp(cum[..., -1]), None if carried is None else carried[..., -1])[..., None, None]
    else:  # a tree has no last token: the state passes through (exp(G_last - G_j) would overflow off the paths)
        k_dec, chunk_decay = jnp.zeros_like(k), jnp.ones(cum.shape[:-1] + (1, 1), cum.dtype)

    def step(s, x):
        u_i, w_i, q_i, kd_i, intra_i, dec_i = x
        v_new = u_i - w_i @ s  # the corrections each token writes
        out = q_i @ s + intra_i @ v_new
        return s * dec_i + jnp.swapaxes(kd_i, -1, -2) @ v_new, (out, v_new)

    final, (out, v_new) = jax.lax.scan(step, state, (u, w, q_dec, k_dec, intra, chunk_decay))

    def unchunk(a):  # [N, B, H, C, ...] -> [B, T, H, ...]
        a = jnp.moveaxis(jnp.moveaxis(a, 2, 3), 0, 1)
        return a.reshape((b, n * c) + a.shape[3:])[:, :t]

    return unchunk(out), final, unchunk(v_new)


def fold(value, stash, kept):
    """A Gated DeltaNet layer's state after the first ``kept`` [B] stashed tokens (``state.Recurrent``):
    S = exp(G_l) S_0 + sum_{j <= l} exp(G_l - G_j) k_j u_j^T (l = kept - 1, G the stashed log decay, u the
    corrected values; the chunked form's own state formula, so a tree's accepted path folds like a chain), and
    the conv window = the last K-1 of [window, x_0..x_{kept-1}]."""
    cum, m = stash["cum"], stash["cum"].shape[1]
    last = jnp.take_along_axis(cum, jnp.clip(kept - 1, 0, m - 1)[:, None, None], axis=1)  # [B, 1, H]
    inside = (jnp.arange(m)[None, :] < kept[:, None])[..., None]
    weight = jnp.exp(jnp.where(inside, last - cum, -jnp.inf))  # <= 1 on the path; 0 past it
    ssm = (jnp.exp(last[:, 0])[..., None, None] * value["ssm"]
           + jnp.einsum("bjh,bjhk,bjhv->bhkv", weight, stash["k"], stash["u"], precision=jax.lax.Precision.HIGHEST))
    window = value["conv"]
    xs = jnp.concatenate([jnp.swapaxes(window, 1, 2), stash["x"].astype(window.dtype)], axis=1)  # [B, K-1+M, C]
    idx = kept[:, None] + jnp.arange(window.shape[-1])  # the last K-1 of the first K-1 + kept
    return {"conv": jnp.swapaxes(jnp.take_along_axis(xs, idx[..., None], axis=1), 1, 2), "ssm": ssm}


def causal_conv(x, window, weight, valid, segments=None):
    """Depthwise causal conv1d + SiLU over the valid tokens of each row, continuing from ``window``.

    x [B, T, C] new inputs, window [B, C, K-1] the K-1 inputs before them (oldest first), weight [C, 1, K],
    valid [B, T]. Padding tokens are skipped (valid tokens keep their order). ``segments`` [B, T] (packed
    documents): a tap never reaches into another segment (``window`` feeds the first one). -> (outputs
    [B, T, C] (padding: any value), the window after every valid token [B, C, K-1])."""
    kernel = weight.shape[-1]
    order = jnp.argsort(~valid, axis=1, stable=True)  # valid tokens first
    xs = jnp.concatenate([jnp.swapaxes(window, 1, 2).astype(x.dtype), jnp.take_along_axis(x, order[..., None], 1)],
                         axis=1)  # [B, K-1+T, C]
    t = x.shape[1]
    w = weight[:, 0, :].astype(x.dtype)  # [C, K]
    if segments is not None:
        seg = jnp.take_along_axis(segments, order, 1)
        seg = jnp.concatenate([jnp.repeat(seg[:, :1], kernel - 1, axis=1), seg], axis=1)  # aligned with xs
        same = lambda j: (seg[:, j:j + t] == seg[:, kernel - 1:])[..., None]  # noqa: E731
        xs_at = lambda j: jnp.where(same(j), xs[:, j:j + t], 0)  # noqa: E731
    else:
        xs_at = lambda j: xs[:, j:j + t]  # noqa: E731
    out = sum(xs_at(j) * w[:, j] for j in range(kernel))
    out = jnp.take_along_axis(jax.nn.silu(out), jnp.argsort(order, axis=1)[..., None], 1)
    idx = jnp.sum(valid, axis=1)[:, None] + jnp.arange(kernel - 1)  # [B, K-1]
    return out, jnp.swapaxes(jnp.take_along_axis(xs, idx[..., None], axis=1), 1, 2)


def tree_parents(ancestors):
    """ancestors [B, T, T] bool (inclusive, every ancestor before its node) -> each slot's parent [B, T] (its
    latest strict ancestor; -1: the committed prefix)."""
    t = ancestors.shape[-1]
    slot = jnp.arange(t, dtype=jnp.int32)
    strict = ancestors & (slot[None, None, :] < slot[None, :, None])
    return jnp.max(jnp.where(strict, slot, -1), axis=-1)


def tree_conv(x, window, weight, parents):
    """``causal_conv`` along each slot's root-to-node path: x [B, T, C], window [B, C, K-1], weight [C, 1, K],
    parents [B, T] (``tree_parents``). The taps walk up the tree and past its root into ``window`` (newest
    column first); siblings never enter. -> outputs [B, T, C]."""
    kernel = weight.shape[-1]
    xs = jnp.concatenate([jnp.swapaxes(window, 1, 2).astype(x.dtype), x], axis=1)  # slot i at K-1+i
    cur = jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), parents.shape)
    taps = []  # taps[m]: the input m steps up the path
    for _ in range(kernel):
        taps.append(jnp.take_along_axis(xs, (cur + kernel - 1)[..., None], axis=1))
        cur = jnp.where(cur >= 0, jnp.take_along_axis(parents, jnp.maximum(cur, 0), axis=1), cur - 1)
    w = weight[:, 0, :].astype(x.dtype)  # [C, K]; tap m meets w[:, K-1-m]
    return jax.nn.silu(sum(taps[kernel - 1 - j] * w[:, j] for j in range(kernel)))


class DepthwiseConv(nn.Module):
    """The conv1d kernel [conv_dim, 1, K] (PyTorch's layout, checkpoint name ``conv1d.weight``)."""

    channels: int
    kernel: int

    def setup(self):
        self.conv_weight = self.param("conv_weight", nn.with_logical_partitioning(
            initializer("conv_weight"), ("heads", None, None)), (self.channels, 1, self.kernel))


class GatedDeltaNet(nn.Module):
    """``Qwen3_5GatedDeltaNet``: (x [B, T, D], positions [B, T], Recurrent state or None, segment ids [B, T] or
    None (packed documents, without a state: conv window and state restart at each)) -> (out, state)."""

    cfg: Qwen35Config

    def setup(self):
        c = self.cfg
        hv = c.linear_num_value_heads
        # split over tensor as attention is ("heads"): z, a, b, the decays and out_proj by value head; the conv
        # channels [q | k | v] in equal runs (not at the q / k / v bounds: XLA moves the few activations between)
        self.in_proj_qkv = Linear(c.conv_dim, False, ("embed", "heads"))
        self.in_proj_z = Linear(c.value_dim, False, ("embed", "heads"))
        self.in_proj_b = Linear(hv, False, ("embed", "heads"))
        self.in_proj_a = Linear(hv, False, ("embed", "heads"))
        self.conv1d = DepthwiseConv(c.conv_dim, c.linear_conv_kernel_dim)
        self.A_log = self.param("A_log", nn.with_logical_partitioning(initializer("A_log"), ("heads",)), (hv,))
        self.dt_bias = self.param("dt_bias", nn.with_logical_partitioning(initializer("dt_bias"), ("heads",)),
                                  (hv,))
        self.norm = RMSNorm(c.rms_norm_eps, axis_name="head_dim")
        self.out_proj = Linear(c.hidden_size, False, ("heads", "embed"))

    def __call__(self, x, positions, state, segment_ids=None, ancestors=None):
        c = self.cfg
        b, t, _ = x.shape
        hk, hv, dk, dv = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                          c.linear_value_head_dim)
        valid = positions >= 0
        pending = state is not None and t <= state.max_block  # may be rolled back: stashed, folded in at commit
        if ancestors is not None and not pending:
            raise ValueError(f"a tree verify of {t} slots needs a cache with max_block >= {t}")
        if state is None:
            window = jnp.zeros((b, c.conv_dim, c.linear_conv_kernel_dim - 1), x.dtype)
            s0 = jnp.zeros((b, hv, dk, dv), jnp.float32)
        else:
            window, s0 = state.value["conv"], state.value["ssm"]
        inputs = self.in_proj_qkv(x)
        if ancestors is None:
            mixed, window_after = causal_conv(inputs, window, self.conv1d.conv_weight, valid, segment_ids)
        else:
            mixed = tree_conv(inputs, window, self.conv1d.conv_weight, tree_parents(ancestors))
        q, k, v = jnp.split(mixed.astype(jnp.float32), [hk * dk, 2 * hk * dk], axis=-1)
        q, k = (jnp.repeat(_l2norm(a.reshape(b, t, hk, dk)), hv // hk, axis=2) for a in (q, k))
        q = q * dk ** -0.5
        v = v.reshape(b, t, hv, dv)
        beta = jnp.where(valid[..., None], jax.nn.sigmoid(self.in_proj_b(x).astype(jnp.float32)), 0.0)
        g = -jnp.exp(jnp.asarray(self.A_log, jnp.float32)) * jax.nn.softplus(
            self.in_proj_a(x).astype(jnp.float32) + jnp.asarray(self.dt_bias, jnp.float32))
        g = jnp.where(valid[..., None], g, 0.0)  # padding: decay 1, no write -> the state passes through
        if t == 1 and state is not None:  # single-token decoding: the recurrent form
            out, final, u = recurrent_delta_rule(q, k, v, g, beta, s0)
        else:
            out, final, u = chunked_delta_rule(q, k, v, g, beta, s0, segments=segment_ids, ancestors=ancestors)
        z = self.in_proj_z(x).reshape(b, t, hv, dv)
        out = self.norm(out.astype(x.dtype)) * jax.nn.silu(z.astype(jnp.float32)).astype(x.dtype)
        out = self.out_proj(out.reshape(b, t, hv * dv))
        if pending:
            stash = {"k": k, "u": u, "cum": log_decay(g, ancestors), "x": inputs}
            if ancestors is None:  # the real tokens first, in order; a tree keeps slot order (compact maps slots)
                order = jnp.argsort(~valid, axis=1, stable=True)[..., None]
                stash = jax.tree_util.tree_map(
                    lambda a: jnp.take_along_axis(a, order.reshape(order.shape + (1,) * (a.ndim - 3)), 1), stash)
            state = state.pend(stash, valid, positions)
        elif state is not None:  # too long to roll back: committed whole
            state = state.set_value({"conv": window_after.astype(window.dtype), "ssm": final})
        return out, state


def _l2norm(x, eps: float = 1e-6):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


class DecoderLayer(dense.DecoderLayer):
    def token_mixer(self) -> None:
        if self.cfg.is_linear(self.index):
            self.linear_attn = GatedDeltaNet(self.cfg)
        else:
            super().token_mixer()

    def mix(self, h, positions, state, segment_ids=None, new_mask=None):
        if self.cfg.is_linear(self.index):
            return self.linear_attn(h, positions, state, segment_ids, new_mask)
        return super().mix(h, positions, state, segment_ids, new_mask)


class Decoder(dense.Decoder):
    layer_class = DecoderLayer


def checkpoint(cfg: Qwen35Config):
    """The dense table under the language-model prefix, plus the linear-attention leaves."""
    return dataclasses.replace(dense.checkpoint(cfg), prefix=VL_PREFIX if cfg.vision_language else TEXT_PREFIX,
                               leaves=_LEAVES, rewrite=skip_tensors(SKIPPED, "qwen3_5"))


def state_specs(cfg: Qwen35Config) -> tuple:
    """Full-attention layers: a KV cache; linear-attention layers: the conv window [conv_dim, K-1] (cache
    dtype) and the recurrent state [Hv, dk, dv] (float32), with a stash per token of a forward that may be
    rolled back (its key [Hv, dk], corrected value [Hv, dv], log decay [Hv], conv input [conv_dim]; ``fold``)."""
    hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    linear = RecurrentSpec(
        (("conv", (cfg.conv_dim, cfg.linear_conv_kernel_dim - 1), None), ("ssm", (hv, dk, dv), jnp.float32)),
        (("k", (hv, dk), jnp.float32), ("u", (hv, dv), jnp.float32), ("cum", (hv,), jnp.float32),
         ("x", (cfg.conv_dim,), None)), fold)
    return tuple(linear if cfg.is_linear(i) else KVSpec(cfg.num_key_value_heads, cfg.head_dim)
                 for i in range(cfg.num_hidden_layers))


def stash_bytes(cfg: Qwen35Config, max_block: int, dtype=jnp.bfloat16) -> int:
    """Bytes of the rollback stash per row: max_block tokens of every linear-attention layer's ``state_specs``
    stash (key, corrected value and log decay in float32, the conv input in the cache ``dtype``)."""
    return max_block * sum(int(np.prod(shape)) * np.dtype(d or dtype).itemsize for spec in state_specs(cfg)
                           if isinstance(spec, RecurrentSpec) for _, shape, d in spec.stash)


FAMILY = Family(name="qwen3_5", config=Qwen35Config, decoder=Decoder, checkpoint=checkpoint, state_specs=state_specs,
                layer_kinds=dense.layer_kinds)  # linear or full attention
