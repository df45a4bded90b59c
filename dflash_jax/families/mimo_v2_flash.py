"""The mimo_v2_flash family (MiMo-V2-Flash), as transformers' ``MiMoV2FlashForCausalLM``.

Layers are the dense family's pre-norm blocks. Attention (``MiMoV2FlashAttention``): q / k of ``head_dim``
(192), v of ``v_head_dim`` (128) times ``attention_value_scale`` before the cache; scale head_dim ** -0.5;
partial rotary (the first int(head_dim * partial_rotary_factor) dims, neox layout) with its own theta per
layer type (``rope_parameters.full_attention`` / ``.sliding_attention``). Sliding layers have TWICE
``num_key_value_heads`` and per-head sinks (as gpt-oss) and see the last ``sliding_window`` positions, itself
included (the released ``sliding_window_size`` + 1, as transformers reads it); full layers have
``num_key_value_heads`` and no sinks. o_proj has no bias.

MLP: per ``mlp_layer_types`` a dense gated MLP (``intermediate_size``) or routed experts
(``moe_intermediate_size``) behind DeepSeek's biased sigmoid group-limited router (``dflash_jax.routing``),
no shared experts.

Checkpoints: per-expert tensors (what transformers writes and the release has) are stacked on load
(``qwen3_moe.stack_experts``); sinks are ``self_attn.attention_sink_bias`` (``self_attn.sinks`` read too);
multi-token-prediction weights (``mtp.*``) are skipped and reported. Block-wise FP8 releases
(``quantization_config``, quant_method fp8) are dequantised on load (``dflash_jax.fp8``); other formats are
refused by name.
"""
from __future__ import annotations

import dataclasses
import re
from typing import ClassVar

import flax.linen as nn

from dflash_jax import fp8, moe
from dflash_jax.checkpoints import skip_tensors
from dflash_jax.config import RopeConfig, TargetConfig, read_config_json
from dflash_jax.families import dense
from dflash_jax.families.family import Family
from dflash_jax.families.qwen3_moe import stack_experts
from dflash_jax.layers import MLP, AttentionProjections, Linear, apply_rope, initializer
from dflash_jax.routing import ROUTER_LEAVES, SigmoidMoE, check_grouped_routing
from dflash_jax.state import KVSpec

SKIPPED = ((r"^(model\.)?mtp\.", "multi-token prediction (mtp.*)"),)
# transformers' MiMoV2FlashConfig defaults, for config.json files that leave them out
_DEFAULTS = {"vocab_size": 152576, "hidden_size": 4096, "intermediate_size": 16384, "num_hidden_layers": 48,
             "num_attention_heads": 64, "num_key_value_heads": 4, "max_position_embeddings": 131072,
             "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": False, "bos_token_id": 1,
             "moe_intermediate_size": 2048, "num_experts_per_tok": 8, "n_routed_experts": 256, "n_group": 1,
             "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0, "head_dim": 192,
             "v_head_dim": 128, "sliding_window": 129, "attention_value_scale": 0.707, "hidden_act": "silu"}
_DEFAULT_ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.334},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.334}}
# (flax leaf, checkpoint leaf, transposed): experts stored [E, out, in]; sinks under transformers' file name
_LEAVES = (("gate_up_proj", "gate_up_proj", True), ("down_proj", "down_proj", True),
           ("sinks", "attention_sink_bias", False)) + ROUTER_LEAVES


def _rope(d, max_pos: int) -> RopeConfig:
    """One layer type's ``rope_parameters`` entry (default rope only; partial factor default 0.334, as there)."""
    d = dict(d or {})
    if d.get("rope_type", "default") != "default" or set(d) - {"rope_type", "rope_theta", "partial_rotary_factor"}:
        raise ValueError(f"mimo_v2_flash supports default rope (rope_theta, partial_rotary_factor) only, got {d}")
    return RopeConfig(theta=float(d.get("rope_theta") or 10000.0),
                      partial_rotary_factor=float(d.get("partial_rotary_factor", 0.334)))


@dataclasses.dataclass(frozen=True)
class MiMoV2FlashConfig(TargetConfig):
    """A MiMo-V2-Flash decoder: ``num_key_value_heads`` / ``rope`` are the full layers' (sliding layers: twice
    the heads, ``sliding_rope``); ``intermediate_size`` the dense layers' MLP width."""

    v_head_dim: int = 128
    attention_value_scale: float = 1.0
    sliding_rope: RopeConfig = RopeConfig()
    mlp_layer_types: tuple[str, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    fp8_checkpoint: bool = False  # the checkpoint read is block-wise FP8 (dequantised on load; an export is not)
    fp8_block_size: tuple[int, int] | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.v_head_dim < 1:
            raise ValueError(f"v_head_dim must be >= 1, got {self.v_head_dim}")
        if not self.mlp_layer_types:
            object.__setattr__(self, "mlp_layer_types", ("dense",) * self.num_hidden_layers)
        if len(self.mlp_layer_types) != self.num_hidden_layers or set(self.mlp_layer_types) - {"dense", "sparse"}:
            raise ValueError(f"mlp_layer_types must give 'dense' or 'sparse' for each of the {self.num_hidden_layers} "
                             f"layers, got {list(self.mlp_layer_types)}")
        if "sparse" in self.mlp_layer_types:
            check_grouped_routing(self.num_experts, self.num_experts_per_tok, self.n_group, self.topk_group)

    def layer_attention(self, i: int) -> "MiMoV2FlashConfig":
        """Layer i's attention as the config its ``Attention`` reads: sliding layers with twice the KV heads,
        sinks and their own rope."""
        if self.layer_types[i] != "sliding_attention":
            return self
        return dataclasses.replace(self, num_key_value_heads=2 * self.num_key_value_heads, attention_sinks=True,
                                   rope=self.sliding_rope)

    @classmethod
    def from_hf(cls, path_or_dict) -> "MiMoV2FlashConfig":
        d = read_config_json(path_or_dict)
        if d.get("model_type") != "mimo_v2_flash":
            raise ValueError(f"not a MiMo-V2-Flash config: model_type {d.get('model_type')!r}")
        quantised, fp8_block = fp8.from_config(d)
        d = {**_DEFAULTS, **{k: v for k, v in d.items() if v is not None}}
        if d["hidden_act"] != "silu":
            raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported (silu)")
        if d.get("sliding_window_size") is not None:  # the reference attends to that many tokens plus the query
            d["sliding_window"] = int(d["sliding_window_size"]) + 1
        n = int(d["num_hidden_layers"])
        types = d.get("layer_types") or ["full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention"
                                         for i in range(n)]
        mlp_types = d.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n - 1)
        rope = d.get("rope_parameters") or _DEFAULT_ROPE
        if not isinstance(rope, dict) or set(rope) - set(_DEFAULT_ROPE):
            raise ValueError(f"rope_parameters must be keyed by layer type {sorted(_DEFAULT_ROPE)}, got {rope}")
        max_pos = int(d["max_position_embeddings"])
        base = {k: v for k, v in d.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
        c = cls._from_dict({**base, "layer_types": types}, "mimo_v2_flash")
        return dataclasses.replace(
            c, qk_norm=False, rope=_rope(rope.get("full_attention"), max_pos),
            sliding_rope=_rope(rope.get("sliding_attention"), max_pos), v_head_dim=int(d["v_head_dim"]),
            attention_value_scale=float(d["attention_value_scale"]), mlp_layer_types=tuple(mlp_types),
            num_experts=int(d.get("num_local_experts") or d["n_routed_experts"]),
            num_experts_per_tok=int(d["num_experts_per_tok"]), moe_intermediate_size=int(d["moe_intermediate_size"]),
            n_group=int(d["n_group"]), topk_group=int(d["topk_group"]), norm_topk_prob=bool(d["norm_topk_prob"]),
            routed_scaling_factor=float(d["routed_scaling_factor"]), fp8_checkpoint=quantised,
            fp8_block_size=fp8_block)

    def to_hf(self) -> dict:
        out = super().to_hf()
        for k in ("use_sliding_window", "max_window_layers", "rope_theta", "rope_scaling"):
            del out[k]
        rope = lambda r: {"rope_type": "default", "rope_theta": r.theta,  # noqa: E731
                          "partial_rotary_factor": r.partial_rotary_factor}
        out.update(architectures=["MiMoV2FlashForCausalLM"], model_type="mimo_v2_flash", v_head_dim=self.v_head_dim,
                   attention_value_scale=self.attention_value_scale, mlp_layer_types=list(self.mlp_layer_types),
                   rope_parameters={"full_attention": rope(self.rope), "sliding_attention": rope(self.sliding_rope)},
                   sliding_window=self.sliding_window or _DEFAULTS["sliding_window"],
                   n_routed_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                   moe_intermediate_size=self.moe_intermediate_size, n_group=self.n_group, topk_group=self.topk_group,
                   norm_topk_prob=self.norm_topk_prob, routed_scaling_factor=self.routed_scaling_factor)
        return out


class Attention(AttentionProjections):
    """``MiMoV2FlashAttention``; ``cfg`` is the layer's (``MiMoV2FlashConfig.layer_attention``)."""

    def setup(self):
        c = self.cfg
        self.q_proj = Linear(c.num_attention_heads * c.head_dim, c.attention_bias, ("embed", "heads"))
        self.k_proj = Linear(c.num_key_value_heads * c.head_dim, c.attention_bias, ("embed", "kv_heads"))
        self.v_proj = Linear(c.num_key_value_heads * c.v_head_dim, c.attention_bias, ("embed", "kv_heads"))
        self.o_proj = Linear(c.hidden_size, False, ("heads", "embed"))
        if c.attention_sinks:
            self.sinks = self.param("sinks", nn.with_logical_partitioning(initializer("sinks"), (None,)),
                                    (c.num_attention_heads,))

    def keys_values(self, x, positions):
        """[B, T, D] -> rotated keys [B, T, K, head_dim], values [B, T, K, v_head_dim] times the value scale."""
        c = self.cfg
        k = self.k_proj(x).reshape(*x.shape[:-1], c.num_key_value_heads, c.head_dim)
        v = self.v_proj(x).reshape(*x.shape[:-1], c.num_key_value_heads, c.v_head_dim)
        return apply_rope(k, positions, c.rope), v * c.attention_value_scale


class DecoderLayer(dense.DecoderLayer):
    def token_mixer(self) -> None:
        self.self_attn = Attention(self.cfg.layer_attention(self.index))

    def feed_forward(self) -> nn.Module:
        return SigmoidMoE(self.cfg) if self.cfg.mlp_layer_types[self.index] == "sparse" else MLP(self.cfg)


class Decoder(dense.Decoder):
    layer_class: ClassVar[type] = DecoderLayer


def _rename_sinks(stream):
    """``self_attn.sinks`` (transformers' in-memory name) -> ``self_attn.attention_sink_bias`` (its file name)."""
    for name, array in stream:
        yield re.sub(r"\.self_attn\.sinks$", ".self_attn.attention_sink_bias", name), array


def checkpoint(cfg: MiMoV2FlashConfig):
    """The dense table plus the expert / router / sink leaves; mtp.* skipped, FP8 dequantised, per-expert tensors
    stacked."""
    skip, stack = skip_tensors(SKIPPED, "mimo_v2_flash"), stack_experts(cfg)
    dequantize = fp8.rewrite_for(cfg)
    return dataclasses.replace(dense.checkpoint(cfg), leaves=_LEAVES,
                               rewrite=lambda stream: stack(_rename_sinks(dequantize(skip(stream)))))


def state_specs(cfg: MiMoV2FlashConfig) -> tuple[KVSpec, ...]:
    """Sliding layers: a window ring (twice the KV heads); full layers: a KV cache; values of ``v_head_dim``."""
    return tuple(KVSpec(cfg.layer_attention(i).num_key_value_heads, cfg.head_dim, cfg.layer_window(i), cfg.v_head_dim)
                 for i in range(cfg.num_hidden_layers))


def layer_kinds(cfg: MiMoV2FlashConfig) -> tuple:
    """What sets a layer apart (``Family.layer_kinds``): its attention (type, sizes) and its MLP (dense or sparse)."""
    return tuple((t, cfg.layer_attention(i), cfg.mlp_layer_types[i]) for i, t in enumerate(cfg.layer_types))


FAMILY = Family(name="mimo_v2_flash", config=MiMoV2FlashConfig, decoder=Decoder, checkpoint=checkpoint,
                state_specs=state_specs, logical_rules=moe.LOGICAL_RULES, layer_kinds=layer_kinds)
