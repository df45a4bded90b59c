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
``max_block`` tokens records the state after each token (the chunked form yields them from its
corrected values: S_t = exp(G_t) S_0 + sum_{j<=t} exp(G_t - G_j) k_j u_j^T), so the engine's
``DecodeCache.commit(kept)`` keeps exactly the state after the last accepted token. Padding tokens
(position < 0) get g = 0 and beta = 0 (the state passes through them bit-exactly) and are left out of
the conv window.

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
    state [B, H, dk, dv] (all float32) -> (outputs [B, T, H, dv], state after each token [B, T, H, dk, dv])."""
    def step(s, x):
        q_t, k_t, v_t, g_t, b_t = x
        s = s * jnp.exp(g_t)[..., None, None]
        delta = (v_t - jnp.einsum("bhkv,bhk->bhv", s, k_t)) * b_t[..., None]
        s = s + k_t[..., :, None] * delta[..., None, :]
        return s, (jnp.einsum("bhkv,bhk->bhv", s, q_t), s)

    _, (out, states) = jax.lax.scan(step, state, tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta)))
    return jnp.moveaxis(out, 0, 1), jnp.moveaxis(states, 0, 1)


def chunked_delta_rule(q, k, v, g, beta, state, *, chunk: int = CHUNK, per_token: bool = False, segments=None):
    """Chunk-parallel within chunks, recurrent across them; same arguments as ``recurrent_delta_rule``.
    ``segments`` [B, T] (packed documents, contiguous, distinct ids): the state restarts from zero at each
    segment's first token (``state`` feeds the first segment only).
    -> (outputs [B, T, H, dv], final state [B, H, dk, dv], state after each token [B, T, H, dk, dv] when
    ``per_token``, else None)."""
    b, t, h, dk = k.shape
    c = min(chunk, t)
    pad = -t % c
    n = (t + pad) // c

    def chunks(a):  # [B, T, H, ...] -> [N, B, H, C, ...]
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        a = a.reshape((b, n, c) + a.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(a, 1, 0), 3, 2)

    q, k, v, g, beta = (chunks(a) for a in (q, k, v, g, beta))
    cum = jnp.cumsum(g, axis=-1)  # [N, B, H, C]
    lower = jnp.tril(jnp.ones((c, c), bool))
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
    k_dec = k * keep(jnp.exp(cum[..., -1:] - cum), last)[..., None]
    chunk_decay = keep(jnp.exp(cum[..., -1]), None if carried is None else carried[..., -1])[..., None, None]

    def step(s, x):
        u_i, w_i, q_i, k_i, kd_i, intra_i, dec_i, cum_i, decay_i, carried_i = x
        v_new = u_i - w_i @ s  # the corrections each token writes
        out = q_i @ s + intra_i @ v_new
        states = None
        if per_token:
            states = (keep(jnp.exp(cum_i), carried_i)[..., None, None] * s[:, :, None]
                      + jnp.einsum("bhij,bhjk,bhjv->bhikv", decay_i, k_i, v_new))
        return s * dec_i + jnp.swapaxes(kd_i, -1, -2) @ v_new, (out, states)

    final, (out, states) = jax.lax.scan(step, state, (u, w, q_dec, k, k_dec, intra, chunk_decay, cum, decay, carried))

    def unchunk(a):  # [N, B, H, C, ...] -> [B, T, H, ...]
        a = jnp.moveaxis(jnp.moveaxis(a, 2, 3), 0, 1)
        return a.reshape((b, n * c) + a.shape[3:])[:, :t]

    return unchunk(out), final, (unchunk(states) if per_token else None)


def causal_conv(x, window, weight, valid, windows_after, segments=None):
    """Depthwise causal conv1d + SiLU over the valid tokens of each row, continuing from ``window``.

    x [B, T, C] new inputs, window [B, C, K-1] the K-1 inputs before them (oldest first), weight [C, 1, K],
    valid [B, T]. Padding tokens are skipped (valid tokens keep their order). ``windows_after`` [B, T'] :
    how many valid new tokens each returned window has taken in. ``segments`` [B, T] (packed documents):
    a tap never reaches into another segment (``window`` feeds the first one). -> (outputs [B, T, C]
    (padding: any value), windows [B, T', C, K-1])."""
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
    idx = windows_after[..., None] + jnp.arange(kernel - 1)  # [B, T', K-1]
    windows = jnp.take_along_axis(xs[:, None], idx[..., None], axis=2)  # [B, T', K-1, C]
    return out, jnp.swapaxes(windows, -1, -2)


class DepthwiseConv(nn.Module):
    """The conv1d kernel [conv_dim, 1, K] (PyTorch's layout, checkpoint name ``conv1d.weight``)."""

    channels: int
    kernel: int

    def setup(self):
        self.conv_weight = self.param("conv_weight", nn.with_logical_partitioning(
            initializer("conv_weight"), (None, None, None)), (self.channels, 1, self.kernel))


class GatedDeltaNet(nn.Module):
    """``Qwen3_5GatedDeltaNet``: (x [B, T, D], positions [B, T], Recurrent state or None, segment ids [B, T] or
    None (packed documents, without a state: conv window and state restart at each)) -> (out, state)."""

    cfg: Qwen35Config

    def setup(self):
        c = self.cfg
        hv = c.linear_num_value_heads
        self.in_proj_qkv = Linear(c.conv_dim, False, ("embed", None))
        self.in_proj_z = Linear(c.value_dim, False, ("embed", None))
        self.in_proj_b = Linear(hv, False, ("embed", None))
        self.in_proj_a = Linear(hv, False, ("embed", None))
        self.conv1d = DepthwiseConv(c.conv_dim, c.linear_conv_kernel_dim)
        self.A_log = self.param("A_log", nn.with_logical_partitioning(initializer("A_log"), (None,)), (hv,))
        self.dt_bias = self.param("dt_bias", nn.with_logical_partitioning(initializer("dt_bias"), (None,)), (hv,))
        self.norm = RMSNorm(c.rms_norm_eps, axis_name="head_dim")
        self.out_proj = Linear(c.hidden_size, False, (None, "embed"))

    def __call__(self, x, positions, state, segment_ids=None):
        c = self.cfg
        b, t, _ = x.shape
        hk, hv, dk, dv = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                          c.linear_value_head_dim)
        valid = positions >= 0
        snapshots = state is not None and t <= state.max_block
        if state is None:
            window = jnp.zeros((b, c.conv_dim, c.linear_conv_kernel_dim - 1), x.dtype)
            s0 = jnp.zeros((b, hv, dk, dv), jnp.float32)
        else:
            window, s0 = state.value["conv"], state.value["ssm"]
        seen = jnp.cumsum(valid, axis=1) if snapshots else jnp.sum(valid, axis=1, keepdims=True)
        mixed, windows = causal_conv(self.in_proj_qkv(x), window, self.conv1d.conv_weight, valid, seen, segment_ids)
        q, k, v = jnp.split(mixed.astype(jnp.float32), [hk * dk, 2 * hk * dk], axis=-1)
        q, k = (jnp.repeat(_l2norm(a.reshape(b, t, hk, dk)), hv // hk, axis=2) for a in (q, k))
        q = q * dk ** -0.5
        v = v.reshape(b, t, hv, dv)
        beta = jnp.where(valid[..., None], jax.nn.sigmoid(self.in_proj_b(x).astype(jnp.float32)), 0.0)
        g = -jnp.exp(jnp.asarray(self.A_log, jnp.float32)) * jax.nn.softplus(
            self.in_proj_a(x).astype(jnp.float32) + jnp.asarray(self.dt_bias, jnp.float32))
        g = jnp.where(valid[..., None], g, 0.0)  # padding: decay 1, no write -> the state passes through
        if t == 1 and state is not None:  # single-token decoding: the recurrent form
            out, states = recurrent_delta_rule(q, k, v, g, beta, s0)
            final = states[:, -1]
        else:
            out, final, states = chunked_delta_rule(q, k, v, g, beta, s0, per_token=snapshots, segments=segment_ids)
        z = self.in_proj_z(x).reshape(b, t, hv, dv)
        out = self.norm(out.astype(x.dtype)) * jax.nn.silu(z.astype(jnp.float32)).astype(x.dtype)
        out = self.out_proj(out.reshape(b, t, hv * dv))
        if state is not None:
            after = ({"conv": windows, "ssm": states} if snapshots
                     else {"conv": windows, "ssm": final[:, None]})  # too long to roll back: the final state only
            after["conv"] = after["conv"].astype(window.dtype)
            state = state.advance(state.value, after, valid)
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
            if new_mask is not None:  # a scan cannot separate siblings (a state per node is not implemented)
                raise ValueError("tree verification is not supported on Gated DeltaNet layers")
            return self.linear_attn(h, positions, state, segment_ids)
        return super().mix(h, positions, state, segment_ids, new_mask)


class Decoder(dense.Decoder):
    layer_class = DecoderLayer


def checkpoint(cfg: Qwen35Config):
    """The dense table under the language-model prefix, plus the linear-attention leaves."""
    return dataclasses.replace(dense.checkpoint(cfg), prefix=VL_PREFIX if cfg.vision_language else TEXT_PREFIX,
                               leaves=_LEAVES, rewrite=skip_tensors(SKIPPED, "qwen3_5"))


def state_specs(cfg: Qwen35Config) -> tuple:
    """Full-attention layers: a KV cache; linear-attention layers: the conv window [conv_dim, K-1] (cache
    dtype) and the recurrent state [Hv, dk, dv] (float32)."""
    linear = RecurrentSpec((("conv", (cfg.conv_dim, cfg.linear_conv_kernel_dim - 1), None),
                            ("ssm", (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
                             jnp.float32)))
    return tuple(linear if cfg.is_linear(i) else KVSpec(cfg.num_key_value_heads, cfg.head_dim)
                 for i in range(cfg.num_hidden_layers))


def snapshot_bytes(cfg: Qwen35Config, max_block: int, dtype=jnp.bfloat16) -> int:
    """Bytes of the rollback snapshots per row: (max_block + 1) states of every linear-attention layer."""
    per_state = (cfg.conv_dim * (cfg.linear_conv_kernel_dim - 1) * np.dtype(dtype).itemsize
                 + cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4)
    return (max_block + 1) * per_state * sum(cfg.is_linear(i) for i in range(cfg.num_hidden_layers))


FAMILY = Family(name="qwen3_5", config=Qwen35Config, decoder=Decoder, checkpoint=checkpoint, state_specs=state_specs)
