"""The DeepSeek-V3 family (``deepseek_v3``) and Kimi-K2 / K2.5 (``kimi_k25``: a vision-language checkpoint whose
text model is a ``deepseek_v3`` one), as transformers' ``DeepseekV3ForCausalLM`` / the language model of
``Kimi_K25ForConditionalGeneration``.

Attention is multi-head latent attention (``DeepseekV3Attention``)::

    q = q_b_proj(q_a_layernorm(q_a_proj(x)))  (or q_proj(x) when q_lora_rank is None), per head [nope | rope]
    c, k_rot = kv_a_proj_with_mqa(x) split [kv_lora_rank | qk_rope_head_dim];  c = kv_a_layernorm(c)
    k_nope, v = kv_b_proj(c) per head [qk_nope_head_dim | v_head_dim];  K = [k_nope | rope(k_rot)] (k_rot shared)
    scale = (nope + rope) ** -0.5, times yarn_mscale(factor, mscale_all_dim) ** 2 with a rope that sets it

(both sub-norms at eps 1e-6; ``rope_interleave``: the rope dims are (x0, x1), (x2, x3), ... pairs, which is neox rope
on the de-interleaved [x0, x2, .. | x1, x3, ..]; the order is the same for q and k, so scores are unchanged).
The decode state holds the latent per token, not the expanded K/V: one "head" of keys [c | k_rot] (r + rope wide)
and values c (r wide), a ``KVSpec`` whose value width differs from its key width. Every forward attends in the
latent space with ``kv_b_proj`` absorbed (MQA over the latent): q_lat = q_nope @ W_uk per head, scores = q_lat . c
+ q_rot . k_rot, out = softmax . c @ W_uv per head; so the dense family's attention (the reference, the tiled loop,
the decode kernel, tree verification, rollback) serves it unchanged.

MoE (``DeepseekV3MoE``, layers >= ``first_k_dense_replace``; the first ones have the dense MLP of
``intermediate_size``): the DeepSeek router (``dflash_jax.routing``: sigmoid scores, correction bias for selection
only, group-limited top-k, normalised unbiased weights times ``routed_scaling_factor``), the routed experts
(``dflash_jax.moe.Experts``) and ``n_shared_experts`` shared experts as one MLP of ``moe_intermediate_size *
n_shared_experts`` added for every token.

Checkpoints: ``deepseek_v3``: ``model.`` (+ ``lm_head``), one tensor per expert (stacked on load, as qwen3_moe),
multi-token-prediction layers ``model.layers.{L..}`` skipped and reported. ``kimi_k25``: the language model under
``language_model.model.`` / ``language_model.lm_head`` (the released layout; transformers 5.x's save_pretrained
writes its layers as ``language_model.model.blocks.N``, read too), vision tower and projector skipped; the text
config may say ``kimi_k2`` (read as ``deepseek_v3``); the tie flag is the top-level one. Block-wise FP8
releases (DeepSeek-V3's) are dequantised on load (``dflash_jax.fp8``); other quantisations (Kimi-K2's INT4
compressed tensors) are refused with the format named.
"""
from __future__ import annotations

import dataclasses
import math
import re

import flax.linen as nn
import jax.numpy as jnp

from dflash_jax import fp8, moe
from dflash_jax.checkpoints import NameTable, skip_tensors
from dflash_jax.config import TargetConfig, read_config_json
from dflash_jax.families import dense, qwen3_moe
from dflash_jax.families.family import Family
from dflash_jax.layers import MLP, AttentionProjections, Linear, RMSNorm, apply_rope, initializer
from dflash_jax.routing import ROUTER_LEAVES, SigmoidMoE, check_grouped_routing
from dflash_jax.state import KVSpec

SUB_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: DeepseekV3RMSNorm's default, not rms_norm_eps
# transformers' DeepseekV3Config defaults, for config.json files that leave them out
_DEFAULTS = {"vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
             "num_hidden_layers": 61, "num_attention_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
             "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
             "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
             "first_k_dense_replace": 3, "norm_topk_prob": True, "hidden_act": "silu", "max_position_embeddings": 4096,
             "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
             "rope_theta": 10000.0, "rope_interleave": True, "attention_bias": False, "num_nextn_predict_layers": 0}
_INTS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "first_k_dense_replace",
         "moe_intermediate_size", "n_shared_experts", "n_routed_experts", "num_experts_per_tok", "n_group",
         "topk_group", "num_nextn_predict_layers")
VL_SKIPPED = ((r"^(vision_tower|mm_projector|model\.vision_tower|model\.mm_projector)\.",
               "vision tower / projector (vision_tower.*, mm_projector.*)"),)
# (flax leaf, checkpoint leaf, transposed): experts stored [E, out, in]; the router's bias as it is
_LEAVES = (("gate_up_proj", "gate_up_proj", True), ("down_proj", "down_proj", True)) + ROUTER_LEAVES


def _text_config(d: dict) -> dict:
    """A deepseek_v3 config.json, or a kimi_k25 one's text_config with the top-level tie flag (Kimi_K25Config's
    default True when absent: transformers ties by it whatever the text config says) and stop tokens."""
    model_type = d.get("model_type")
    if model_type == "kimi_k25":
        text = d.get("text_config")
        if not isinstance(text, dict):
            raise ValueError("a kimi_k25 config.json needs a text_config (the language model's settings)")
        if text.get("model_type", "deepseek_v3") not in ("deepseek_v3", "kimi_k2"):
            raise ValueError(f"kimi_k25 text_config model_type {text.get('model_type')!r} is not supported "
                             "(deepseek_v3 / kimi_k2)")
        text = {**text, "tie_word_embeddings": d.get("tie_word_embeddings", True)}  # Kimi_K25Config's default
        if d.get("eos_token_id") is not None:
            text["eos_token_id"] = d["eos_token_id"]
    elif model_type == "deepseek_v3":
        text = d
    else:
        raise ValueError(f"not a DeepSeek-V3 config: model_type {model_type!r} (expected deepseek_v3 or kimi_k25)")
    return text


LATENT_LANES = 128  # a TPU vector register's lanes: the latent cache's key width is a multiple of it


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config(TargetConfig):
    """A DeepSeek-V3 decoder: ``head_dim`` is the query / key head dim (qk_nope_head_dim + qk_rope_head_dim),
    ``intermediate_size`` the dense layers' MLP width; ``vision_language``: the Kimi-K2.5 layout."""

    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True
    first_k_dense_replace: int = 3
    moe_intermediate_size: int = 2048
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    num_nextn_predict_layers: int = 0  # multi-token-prediction layers after the decoder in a checkpoint (skipped)
    vision_language: bool = False
    fp8_checkpoint: bool = False  # the checkpoint read is block-wise FP8 (dequantised on load; an export is not)
    fp8_block_size: tuple[int, int] | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
            raise ValueError(f"head_dim {self.head_dim} must be qk_nope_head_dim + qk_rope_head_dim = "
                             f"{self.qk_nope_head_dim + self.qk_rope_head_dim}")
        if self.qk_rope_head_dim % 2 or min(self.kv_lora_rank, self.qk_rope_head_dim, self.v_head_dim) < 1:
            raise ValueError(f"kv_lora_rank, v_head_dim and an even qk_rope_head_dim must be >= 1, got "
                             f"{self.kv_lora_rank}, {self.v_head_dim}, {self.qk_rope_head_dim}")
        check_grouped_routing(self.n_routed_experts, self.num_experts_per_tok, self.n_group, self.topk_group)

    @property
    def num_experts(self) -> int:
        """The routed experts (``qwen3_moe.stack_experts`` reads this name)."""
        return self.n_routed_experts

    def is_sparse(self, i: int) -> bool:
        return i >= self.first_k_dense_replace

    @property
    def latent_key_width(self) -> int:
        """The cached key's width: [c | k_rot] (r + rope) zero-padded to a multiple of 128 lanes (576 -> 640). XLA:TPU
        lays an array whose last axis is not a multiple of 128 out with its first axis minor, so an unpadded latent
        cache or page pool was copied into the kernels' layout and back at every step (a pool-sized temporary)."""
        return -(-(self.kv_lora_rank + self.qk_rope_head_dim) // LATENT_LANES) * LATENT_LANES

    def attention_scale(self) -> float:
        """``DeepseekV3Attention.scaling``: qk_head_dim ** -0.5, times mscale ** 2 where a non-default rope sets
        ``mscale_all_dim`` (mscale = 0.1 * mscale_all_dim * ln(factor) + 1 for factor > 1, else 1)."""
        scale = self.head_dim ** -0.5
        m = self.rope.get("mscale_all_dim") or 0
        factor = self.rope.get("factor")
        if self.rope.rope_type != "default" and m and factor and factor > 1:
            scale *= (0.1 * m * math.log(factor) + 1.0) ** 2
        return scale

    @classmethod
    def from_hf(cls, path_or_dict) -> DeepseekV3Config:
        d = read_config_json(path_or_dict)
        model_type = d.get("model_type")
        quantised, fp8_block = fp8.from_config(d)
        text = _text_config(d)
        q_lora = text.get("q_lora_rank", _DEFAULTS["q_lora_rank"])  # an explicit null: a plain q_proj
        text = {**_DEFAULTS, **{k: v for k, v in text.items() if v is not None}}
        if text["hidden_act"] != "silu":
            raise ValueError(f"hidden_act {text['hidden_act']!r} is not supported (silu)")
        head_dim = int(text["qk_nope_head_dim"]) + int(text["qk_rope_head_dim"])
        base = {k: v for k, v in text.items() if k not in ("layer_types", "sliding_window", "use_sliding_window")}
        c = TargetConfig._from_dict({**base, "head_dim": head_dim, "num_key_value_heads": text["num_attention_heads"]},
                                    "deepseek_v3")  # the shared fields; ours are checked together below
        shared = {f.name: getattr(c, f.name) for f in dataclasses.fields(TargetConfig)}
        return cls(
            **{**shared, "model_type": model_type, "qk_norm": False},
            q_lora_rank=None if q_lora is None else int(q_lora), rope_interleave=bool(text["rope_interleave"]),
            routed_scaling_factor=float(text["routed_scaling_factor"]), norm_topk_prob=bool(text["norm_topk_prob"]),
            vision_language=model_type == "kimi_k25", fp8_checkpoint=quantised, fp8_block_size=fp8_block,
            **{k: int(text[k]) for k in _INTS})

    def to_hf(self) -> dict:
        text = TargetConfig.to_hf(self)
        for k in ("use_sliding_window", "max_window_layers", "layer_types", "sliding_window"):
            del text[k]
        text.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", head_dim=self.qk_rope_head_dim,
                    q_lora_rank=self.q_lora_rank, rope_interleave=self.rope_interleave,
                    routed_scaling_factor=self.routed_scaling_factor, norm_topk_prob=self.norm_topk_prob,
                    **{k: getattr(self, k) for k in _INTS})
        if not self.vision_language:
            return text
        del text["architectures"]
        return {"architectures": ["Kimi_K25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text,
                "tie_word_embeddings": self.tie_word_embeddings}


class KVUp(nn.Module):
    """``kv_b_proj``'s weight, [kv_lora_rank, heads * (qk_nope_head_dim + v_head_dim)] ([in, out] as every Linear
    kernel), read as [r, N, nope + v] for the absorbed attention rather than applied."""

    cfg: DeepseekV3Config

    def setup(self):
        c = self.cfg
        self.kernel = self.param("kernel", nn.with_logical_partitioning(initializer("kernel"), (None, "heads")),
                                 (c.kv_lora_rank, c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim)))

    def __call__(self, dtype):
        """-> (W_uk [r, N, nope], W_uv [r, N, v]) in ``dtype``."""
        c = self.cfg
        w = jnp.asarray(self.kernel, dtype).reshape(c.kv_lora_rank, c.num_attention_heads, -1)
        return w[..., :c.qk_nope_head_dim], w[..., c.qk_nope_head_dim:]


class Attention(AttentionProjections):
    """``DeepseekV3Attention`` in the latent space: ``latent_qkv`` gives MQA queries / keys / values over the
    latent (the module docstring), ``output`` expands the attended latent per head and projects it."""

    cfg: DeepseekV3Config

    def setup(self):
        c = self.cfg
        width = c.num_attention_heads * c.head_dim
        if c.q_lora_rank is None:
            self.q_proj = Linear(width, False, ("embed", "heads"))
        else:
            self.q_a_proj = Linear(c.q_lora_rank, c.attention_bias, ("embed", None))
            self.q_a_layernorm = RMSNorm(SUB_NORM_EPS, axis_name=None)
            self.q_b_proj = Linear(width, False, (None, "heads"))
        self.kv_a_proj_with_mqa = Linear(c.kv_lora_rank + c.qk_rope_head_dim, c.attention_bias, ("embed", None))
        self.kv_a_layernorm = RMSNorm(SUB_NORM_EPS, axis_name=None)
        self.kv_b_proj = KVUp(c)
        self.o_proj = Linear(c.hidden_size, c.attention_bias, ("heads", "embed"))

    def attention_scale(self) -> float:
        return self.cfg.attention_scale()

    def rotate(self, x, positions):
        """Rope on the rope dims x [B, T, H, rope] (interleaved pairs de-interleaved first, see the module doc)."""
        if self.cfg.rope_interleave:
            x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        return apply_rope(x, positions, self.cfg.rope)

    def latent_qkv(self, x, positions):
        """x [B, T, D] -> queries [B, T, N, w] ([q_nope @ W_uk | rope(q_rot) | 0]), keys [B, T, 1, w]
        ([c | rope(k_rot) | 0]) and values c [B, T, 1, r], w = ``latent_key_width``."""
        c = self.cfg
        q = self.q_proj(x) if c.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(*x.shape[:-1], c.num_attention_heads, c.head_dim)
        kv = self.kv_a_proj_with_mqa(x)[..., None, :]  # one shared "head"
        latent = self.kv_a_layernorm(kv[..., :c.kv_lora_rank])
        w_uk, _ = self.kv_b_proj(x.dtype)
        q_lat = jnp.einsum("BTNP,RNP->BTNR", q[..., :c.qk_nope_head_dim], w_uk)
        pad = c.latent_key_width - c.kv_lora_rank - c.qk_rope_head_dim  # zero lanes: no score changes
        q_rot = self.rotate(q[..., c.qk_nope_head_dim:], positions)
        k_rot = self.rotate(kv[..., c.kv_lora_rank:], positions)
        queries = jnp.concatenate([q_lat, q_rot, jnp.zeros((*q_rot.shape[:-1], pad), q_rot.dtype)], axis=-1)
        keys = jnp.concatenate([latent, k_rot, jnp.zeros((*k_rot.shape[:-1], pad), k_rot.dtype)], axis=-1)
        return queries, keys, latent

    def output(self, o, gate=None):
        """The attended latent o [B, T, N, r] -> per-head values (@ W_uv) -> o_proj -> [B, T, D]."""
        _, w_uv = self.kv_b_proj(o.dtype)
        heads = jnp.einsum("BTNR,RNV->BTNV", o, w_uv)
        return self.o_proj(heads.reshape(*heads.shape[:-2], -1))


class MoE(SigmoidMoE):
    """``DeepseekV3MoE``: the routed experts plus the shared experts (one MLP), for every token."""

    cfg: DeepseekV3Config

    def setup(self):
        super().setup()
        c = self.cfg
        if c.n_shared_experts:
            self.shared_experts = MLP(c, c.moe_intermediate_size * c.n_shared_experts)

    def __call__(self, x):
        """[B, T, D] -> [B, T, D]."""
        out = super().__call__(x)
        return out + self.shared_experts(x) if self.cfg.n_shared_experts else out


class DecoderLayer(dense.DecoderLayer):
    """``DeepseekV3DecoderLayer``: latent attention, then the dense MLP or the MoE block."""

    def token_mixer(self) -> None:
        self.self_attn = Attention(self.cfg)

    def feed_forward(self) -> nn.Module:
        return MoE(self.cfg) if self.cfg.is_sparse(self.index) else MLP(self.cfg)

    def mix(self, h, positions, state, segment_ids=None, new_mask=None):
        q, k, v = self.self_attn.latent_qkv(h, positions)
        o, state = self.attend(q, k, v, positions, state, segment_ids, new_mask)
        return self.self_attn.output(o), state


class Decoder(dense.Decoder):
    layer_class = DecoderLayer


def _mtp_layers(cfg: DeepseekV3Config) -> str:
    """A regex of the multi-token-prediction layers' indices (L .. L + num_nextn_predict_layers - 1)."""
    first = cfg.num_hidden_layers
    return "|".join(str(i) for i in range(first, first + max(cfg.num_nextn_predict_layers, 1)))


_BLOCKS = re.compile(r"^language_model\.model\.blocks\.")


def _vl_names(stream):
    """transformers 5.x's Kimi-K2.5 save_pretrained writes the text layers as ``language_model.model.blocks.N`` and
    the released checkpoints name the head ``language_model.lm_head``: both to the table's names."""
    for name, array in stream:
        name = _BLOCKS.sub("language_model.model.layers.", name)
        yield ("lm_head.weight" if name == "language_model.lm_head.weight" else name), array


def checkpoint(cfg: DeepseekV3Config) -> NameTable:
    """``model.`` (``language_model.model.`` for kimi_k25) names, the fused expert / router-bias leaves, per-expert
    tensors stacked, multi-token-prediction layers (and a VL checkpoint's vision side) skipped and reported, FP8
    weights dequantised."""
    prefix = "language_model.model." if cfg.vision_language else "model."
    skipped = ((rf"^{re.escape(prefix)}layers\.({_mtp_layers(cfg)})\.", "multi-token prediction"),)
    skip = skip_tensors(skipped + (VL_SKIPPED if cfg.vision_language else ()), cfg.model_type)
    stack = qwen3_moe.stack_experts(cfg)
    names = _vl_names if cfg.vision_language else (lambda stream: stream)
    dequantize = fp8.rewrite_for(cfg)
    return dataclasses.replace(dense.checkpoint(cfg), prefix=prefix, leaves=_LEAVES,
                               rewrite=lambda stream: stack(dequantize(skip(names(stream)))))


def state_specs(cfg: DeepseekV3Config) -> tuple[KVSpec, ...]:
    """Every layer: the latent cache, one head of keys [c | k_rot | 0] (``latent_key_width``) and values c (r): c is
    held twice, so that the one decode attention (reference, loop, kernel) serves it; still a small part of the
    expanded K/V (Kimi-K2.5: 1152 of 20480 values per token and layer)."""
    spec = KVSpec(1, cfg.latent_key_width, v_head_dim=cfg.kv_lora_rank)
    return (spec,) * cfg.num_hidden_layers


FAMILY = Family(name="deepseek_v3", config=DeepseekV3Config, decoder=Decoder, checkpoint=checkpoint,
                state_specs=state_specs, logical_rules=moe.LOGICAL_RULES, layer_kinds=qwen3_moe.layer_kinds)
