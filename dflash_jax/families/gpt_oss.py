"""The gpt-oss family (gpt-oss-20b / 120b): the dense decoder with attention sinks, q/k/v/o biases,
alternating sliding-window / full layers, YaRN rope, and a routed mixture of experts in every layer.

Router (``mlp.router``): a biased linear layer over the experts, top-k of its logits, softmax over those k
(as transformers' ``GptOssTopKRouter``). Experts (``mlp.experts``): ``dflash_jax.moe.Experts`` with biases,
gate/up interleaved in one tensor and the clamped SwiGLU. Released checkpoints keep the experts in
MXFP4, dequantized on load (``dflash_jax.mxfp4``).
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from dflash_jax import moe, mxfp4
from dflash_jax.config import TargetConfig, read_config_json
from dflash_jax.families import dense
from dflash_jax.families.family import Family
from dflash_jax.layers import Linear
from dflash_jax.moe import Experts

# transformers' GptOssConfig defaults, for config.json files that leave them out
_DEFAULTS = {"attention_bias": True, "rms_norm_eps": 1e-5, "rope_theta": 150000.0, "sliding_window": 128}
_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
# (flax leaf, checkpoint leaf, transposed): experts are stored [E, in, out] like ours, sinks as they are
_LEAVES = tuple((n, n, False) for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias", "sinks"))


@dataclasses.dataclass(frozen=True)
class GptOssConfig(TargetConfig):
    """A gpt-oss decoder: ``intermediate_size`` is each expert's."""

    attention_sinks: bool = True
    num_local_experts: int = 1
    num_experts_per_tok: int = 1
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.num_experts_per_tok <= self.num_local_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and "
                             f"num_local_experts={self.num_local_experts}")

    @classmethod
    def from_hf(cls, path_or_dict) -> "GptOssConfig":
        d = read_config_json(path_or_dict)
        if d.get("model_type") != "gpt_oss":
            raise ValueError(f"not a gpt-oss config: model_type {d.get('model_type')!r}")
        d = {**_DEFAULTS, **{k: v for k, v in d.items() if v is not None}}
        if not d.get("rope_parameters") and not d.get("rope_scaling"):
            d["rope_parameters"] = {**_DEFAULT_ROPE, "rope_theta": d["rope_theta"]}
        if "layer_types" not in d and "num_hidden_layers" in d:  # transformers' default: sliding first
            d["layer_types"] = [("full_attention", "sliding_attention")[(i + 1) % 2]
                                for i in range(int(d["num_hidden_layers"]))]
        experts = d.get("num_local_experts", d.get("num_experts"))
        per_token = d.get("num_experts_per_tok", d.get("experts_per_token"))  # the latter: early 4.x configs
        for key, value in (("num_local_experts", experts), ("num_experts_per_tok", per_token)):
            if value is None:
                raise ValueError(f"config.json is missing {key!r}")
        return dataclasses.replace(cls._from_dict(d, "gpt_oss"), num_local_experts=int(experts),
                                   num_experts_per_tok=int(per_token), swiglu_alpha=float(d.get("swiglu_alpha", 1.702)),
                                   swiglu_limit=float(d.get("swiglu_limit", 7.0)))

    def to_hf(self) -> dict:
        out = super().to_hf()
        for k in ("use_sliding_window", "max_window_layers"):
            del out[k]
        return {**out, "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
                "num_local_experts": self.num_local_experts, "num_experts_per_tok": self.num_experts_per_tok,
                "swiglu_alpha": self.swiglu_alpha, "swiglu_limit": self.swiglu_limit}


class MoE(nn.Module):
    """``GptOssMLP``: route each token to its top-k experts, weights = softmax over the k router logits."""

    cfg: GptOssConfig

    def setup(self):
        c = self.cfg
        self.router = Linear(c.num_local_experts, True, ("embed", None))
        self.experts = Experts(c.num_local_experts, c.hidden_size, c.intermediate_size, use_bias=True,
                               gate_up_layout="interleave", swiglu_alpha=c.swiglu_alpha, swiglu_limit=c.swiglu_limit)

    def __call__(self, x):
        """x [B, T, D] -> [B, T, D]."""
        tokens = x.reshape(-1, x.shape[-1])
        top, index = jax.lax.top_k(self.router(tokens), self.cfg.num_experts_per_tok)
        weight = jax.nn.softmax(top.astype(jnp.float32), axis=-1)
        return self.experts(tokens, index, weight).reshape(x.shape)


class DecoderLayer(dense.DecoderLayer):
    def feed_forward(self) -> nn.Module:
        return MoE(self.cfg)


class Decoder(dense.Decoder):
    layer_class = DecoderLayer


def checkpoint(cfg: GptOssConfig):
    """The dense table plus the expert / sink leaves; MXFP4 ``*_blocks`` / ``*_scales`` dequantized on load."""
    return dataclasses.replace(dense.checkpoint(cfg), leaves=_LEAVES, rewrite=mxfp4.dequantize_stream)


FAMILY = Family(name="gpt_oss", config=GptOssConfig, decoder=Decoder, checkpoint=checkpoint,
                state_specs=dense.state_specs, logical_rules=moe.LOGICAL_RULES, layer_kinds=dense.layer_kinds)
