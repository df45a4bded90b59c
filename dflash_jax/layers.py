"""Building blocks shared by target and draft: Linear, Embed, RMSNorm, RoPE, gated MLP, attention projections.

Parameter names mirror Hugging Face (``q_proj``, ``input_layernorm``, ...); Linear kernels are stored
``[in, out]`` (the transpose of PyTorch). Every parameter carries logical axis names for sharding.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from dflash_jax.config import RopeConfig, TargetConfig

INIT_STD = 0.02
# The parameters that start at a constant, by leaf name; every other parameter starts normal(INIT_STD). The
# modules declare their initialisers through ``initializer`` and ``random_params`` / ``device_random_params``
# read the same table, so what a module declares is what a fresh model gets.
CONSTANT_INIT = {"weight": 1.0, "dt_bias": 1.0, "bias": 0.0, "gate_up_proj_bias": 0.0, "down_proj_bias": 0.0,
                 "A_log": 0.0, "base_kernel": 0.0, "e_score_correction_bias": 0.0, "layer_scalar": 1.0, "scale": 1.0,
                 "per_expert_scale": 1.0}


def initializer(name: str):
    """The Flax initialiser of the parameter called ``name`` (``CONSTANT_INIT``, else normal(INIT_STD))."""
    c = CONSTANT_INIT.get(name)
    if c is None:
        return nn.initializers.normal(INIT_STD)
    return nn.initializers.constant(c)


def random_params(shapes, seed: int, *, std: float = INIT_STD, dtype=jnp.float32):
    """Parameters shaped like ``shapes`` (ShapeDtypeStructs) with the declared initialisers -- the constants of
    ``CONSTANT_INIT`` (unit norm weights, zero biases, ...), normal(std) for the rest, in sorted path order --
    drawn with numpy: no per-op compilation (Flax's eager ``init`` compiles every op, seconds per model on a
    small CPU)."""
    rng = np.random.default_rng(seed)
    out = {}
    for path, leaf in sorted(traverse_util.flatten_dict(shapes).items()):
        c = CONSTANT_INIT.get(path[-1])
        v = rng.standard_normal(leaf.shape, np.float32) * std if c is None else np.full(leaf.shape, c, np.float32)
        out[path] = jnp.asarray(v, dtype)
    return traverse_util.unflatten_dict(out)


@functools.lru_cache(maxsize=None)
def _leaf_fn(shape, dtype, constant: float | None, sharding):
    """A jitted maker of one parameter on its device(s); one compile per distinct (shape, init, sharding)."""
    def make(key):
        if constant is not None:
            return jnp.full(shape, constant, dtype)
        return (jax.random.normal(key, shape, jnp.float32) * INIT_STD).astype(dtype)

    return jax.jit(make, out_shardings=sharding)


def device_random_params(shapes, seed: int, dtype, shardings=None):
    """Parameters with ``random_params``' initialisers (constants of ``CONSTANT_INIT``, normal(INIT_STD)), each
    drawn by a jitted function on the device(s) it lives on (``shardings``: a matching tree, or None = default
    device); the host never holds a copy (an 8B model in seconds)."""
    flat = traverse_util.flatten_dict(shapes)
    flat_sh = traverse_util.flatten_dict(shardings) if shardings is not None else {}
    key = jax.random.PRNGKey(seed)
    out = {}
    for i, (path, leaf) in enumerate(sorted(flat.items())):
        make = _leaf_fn(tuple(leaf.shape), jnp.dtype(dtype), CONSTANT_INIT.get(path[-1]), flat_sh.get(path))
        out[path] = make(jax.random.fold_in(key, i))
    return traverse_util.unflatten_dict(out)


class Linear(nn.Module):
    """y = x @ kernel (+ bias); kernel [in, out] with logical axes ``axes``."""

    features: int
    use_bias: bool = False
    axes: tuple[str, str] = ("embed", "mlp")

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.with_logical_partitioning(initializer("kernel"), self.axes),
                            (x.shape[-1], self.features))
        kernel = jnp.asarray(kernel, x.dtype)
        y = jnp.einsum("...I,IO->...O", x, kernel)
        if self.use_bias:
            bias = self.param("bias", nn.with_logical_partitioning(initializer("bias"), self.axes[1:]),
                              (self.features,))
            y = y + jnp.asarray(bias, x.dtype)
        return y


class Embed(nn.Module):
    """Token embedding [vocab, embed]; ``attend`` gives tied-head logits."""

    vocab_size: int
    features: int

    def setup(self):
        self.embedding = self.param("embedding",
                                    nn.with_logical_partitioning(initializer("embedding"), ("vocab", "embed")),
                                    (self.vocab_size, self.features))

    def __call__(self, ids):
        return jnp.take(self.embedding, ids, axis=0)

    def attend(self, x):
        return jnp.einsum("...D,VD->...V", x, jnp.asarray(self.embedding, x.dtype),
                          preferred_element_type=jnp.float32)


class RMSNorm(nn.Module):
    """weight * x / rms(x), statistics in float32 (as Qwen3RMSNorm / LlamaRMSNorm); ``zero_centred``:
    (1 + weight) * x / rms(x), the product in float32 (Qwen3_5RMSNorm / Qwen3NextRMSNorm); ``with_scale``
    False: x / rms(x), no weight (Gemma 4's value norm and router norm, MuseGlimmerRMSNorm(with_scale=False))."""

    eps: float = 1e-6
    axis_name: str = "embed"
    zero_centred: bool = False
    with_scale: bool = True

    @nn.compact
    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x_hat = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if not self.with_scale:
            return x_hat.astype(x.dtype)
        weight = self.param("weight", nn.with_logical_partitioning(initializer("weight"), (self.axis_name,)),
                            (x.shape[-1],))
        if self.zero_centred:
            return (x_hat * (1.0 + jnp.asarray(weight, jnp.float32))).astype(x.dtype)
        return jnp.asarray(weight, x.dtype) * x_hat.astype(x.dtype)


@functools.lru_cache(maxsize=None)
def rope_frequencies(rope: RopeConfig, head_dim: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies [head_dim/2] (float32) and the cos/sin scale, for each supported rope type."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv = (1.0 / (np.float32(rope.theta) ** exponents)).astype(np.float32)
    scale = 1.0
    if rope.rope_type == "linear":
        inv = inv / np.float32(rope.get("factor"))
    elif rope.rope_type == "llama3":
        factor, low, high = rope.get("factor"), rope.get("low_freq_factor"), rope.get("high_freq_factor")
        old = rope.get("original_max_position_embeddings")
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    elif rope.rope_type == "yarn":
        old = rope.get("original_max_position_embeddings")
        factor = rope.get("factor")
        if factor is None:
            raise ValueError("yarn rope needs factor")
        attention_factor, mscale, mscale_all = rope.get("attention_factor"), rope.get("mscale"), rope.get("mscale_all_dim")

        def get_mscale(s, m=1.0):
            return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

        if attention_factor is None:
            attention_factor = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
                                if mscale and mscale_all else get_mscale(factor))
        beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

        def correction_dim(rotations):
            return head_dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

        lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
        if rope.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, head_dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - lo) / (hi - lo), 0, 1)
        extrapolation = 1 - ramp
        inv = (inv / factor * (1 - extrapolation) + inv * extrapolation).astype(np.float32)
        scale = float(attention_factor)
    elif rope.rope_type == "proportional":  # Gemma 4's full layers: the first `angles` frequencies of the full
        angles = int(rope.get("partial_rotary_factor", 1.0) * head_dim // 2)  # head, the rest 0 (not rotated)
        inv = (np.where(np.arange(head_dim // 2) < angles, inv, 0) / np.float32(rope.get("factor", 1.0)))
        inv = inv.astype(np.float32)
    return inv, scale


def apply_rope(x, positions, rope: RopeConfig):
    """Rotate x [B, T, N, H] (neox rotate_half layout) to absolute ``positions`` [B, T]; with a
    ``partial_rotary_factor`` the frequencies are those of r = int(H * factor) dims and the first 2 * ceil(r / 2)
    dims rotate (r itself when even; transformers' rule for an odd r, e.g. MiMo-V2-Flash's 0.334 of a small head),
    the rest pass through."""
    inv, scale = rope_frequencies(rope, int(x.shape[-1] * rope.partial_rotary_factor))
    rot = 2 * len(inv)
    x, rest = x[..., :rot], x[..., rot:]
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv)  # [B, T, rot/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    cos, sin = (jnp.cos(angles) * scale).astype(x.dtype), (jnp.sin(angles) * scale).astype(x.dtype)
    half = rot // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x * cos + rotated * sin
    return jnp.concatenate([out, rest], axis=-1) if rest.shape[-1] else out


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)), ``intermediate_size`` wide (default: the config's); act silu, or another
    ``activation`` (Gemma 4: ``gelu_tanh``)."""

    cfg: TargetConfig
    intermediate_size: int | None = None  # another width (a MoE family's shared expert)
    activation: Callable = nn.silu

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        width = self.intermediate_size or c.intermediate_size
        gate = Linear(width, c.mlp_bias, ("embed", "mlp"), name="gate_proj")(x)
        up = Linear(width, c.mlp_bias, ("embed", "mlp"), name="up_proj")(x)
        return Linear(c.hidden_size, c.mlp_bias, ("mlp", "embed"), name="down_proj")(self.activation(gate) * up)


def gelu_tanh(x):
    """transformers' ``gelu_pytorch_tanh``: the tanh approximation of GELU."""
    return jax.nn.gelu(x, approximate=True)


class AttentionProjections(nn.Module):
    """q/k/v/o projections with optional per-head q/k RMSNorm (Qwen3), RoPE and per-head attention sink
    logits (gpt-oss); no attention itself.

    Target and draft layers both use it; they differ only in which keys the queries see.
    """

    cfg: TargetConfig

    def setup(self):
        c = self.cfg
        q_width = c.num_attention_heads * c.head_dim * (2 if c.attn_output_gate else 1)
        self.q_proj = Linear(q_width, c.attention_bias, ("embed", "heads"))
        self.k_proj = Linear(c.num_key_value_heads * c.head_dim, c.attention_bias, ("embed", "kv_heads"))
        self.v_proj = Linear(c.num_key_value_heads * c.head_dim, c.attention_bias, ("embed", "kv_heads"))
        self.o_proj = Linear(c.hidden_size, c.attention_bias, ("heads", "embed"))
        if c.qk_norm:
            self.q_norm = RMSNorm(c.rms_norm_eps, axis_name="head_dim", zero_centred=c.norm_offset)
            self.k_norm = RMSNorm(c.rms_norm_eps, axis_name="head_dim", zero_centred=c.norm_offset)
        if c.attention_sinks:
            self.sinks = self.param("sinks", nn.with_logical_partitioning(initializer("sinks"), (None,)),
                                    (c.num_attention_heads,))

    def sink_logits(self):
        """[N] sink logits for ``attend``, or None without sinks."""
        return self.sinks if self.cfg.attention_sinks else None

    def attention_scale(self) -> float | None:
        """The softmax scale of q . k (None: head_dim ** -0.5; a family with another scale overrides it)."""
        return None

    def queries(self, x, positions):
        """[B, T, D] -> rotated queries [B, T, N, H]."""
        return self.gated_queries(x, positions)[0]

    def gated_queries(self, x, positions):
        """[B, T, D] -> (rotated queries [B, T, N, H], output gate [B, T, N, H] or None). With
        ``attn_output_gate`` q_proj holds per head [query | gate] (as Qwen3_5Attention)."""
        c = self.cfg
        q = jax.lax.optimization_barrier(self.q_proj(x)).reshape(*x.shape[:-1], c.num_attention_heads, -1)
        gate = None
        if c.attn_output_gate:
            q, gate = q[..., :c.head_dim], q[..., c.head_dim:]
        if c.qk_norm:
            q = self.q_norm(q)
        return apply_rope(q, positions, c.rope), gate

    def keys_values(self, x, positions):
        """[B, T, D] -> rotated keys and values, each [B, T, K, H]."""
        c = self.cfg
        k, v = jax.lax.optimization_barrier((self.k_proj(x), self.v_proj(x)))
        k = k.reshape(*x.shape[:-1], c.num_key_value_heads, c.head_dim)
        v = v.reshape(*x.shape[:-1], c.num_key_value_heads, c.head_dim)
        if c.qk_norm:
            k = self.k_norm(k)
        return apply_rope(k, positions, c.rope), v

    def output(self, o, gate=None):
        """[B, T, N, H] (times sigmoid(gate) when gated) -> [B, T, D]."""
        if gate is not None:
            o = o * jax.nn.sigmoid(gate).astype(o.dtype)
        return self.o_proj(o.reshape(*o.shape[:-2], -1))
