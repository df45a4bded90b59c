"""The Qwen3.5 / Qwen3.6 mixture-of-experts hybrids (Qwen3.5-35B-A3B, Qwen3.5-122B-A10B, Qwen3.6-35B-A3B):
the ``qwen3_5`` decoder (Gated DeltaNet + gated full attention, recurrent-state rollback, VL checkpoint
layout) with every layer's MLP replaced by a sparse MoE block, as transformers' ``Qwen3_5MoeSparseMoeBlock``:

    out = experts(x; top-k of softmax(gate(x)), renormalised to sum 1)
          + sigmoid(shared_expert_gate(x)) * shared_expert(x)

The router is ``qwen3_moe.route`` (softmax in float32, top-k, always renormalised in Qwen3.5: transformers'
``Qwen3_5MoeTopKRouter`` has no ``norm_topk_prob`` switch), the routed experts ``moe.Experts`` (gate/up
fused ``concat``), the shared expert a gated SiLU MLP of ``shared_expert_intermediate_size`` and its gate
one [1, D] projection.

Checkpoints: what transformers' ``save_pretrained`` writes (and the released ones hold) stores one tensor
per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``), in both the VL layout (under
``model.language_model.``) and the text-only one; ``qwen3_moe.stack_experts`` fuses them while loading,
and the fused in-memory layout (``mlp.experts.gate_up_proj`` / ``down_proj``) loads as it is.

``intermediate_size`` (no dense MLP exists in these models; the trainer sizes a draft's MLP by it) is read
when config.json has it, else it is ``moe_intermediate_size``.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import flax.linen as nn
import jax

from dflash_jax import moe
from dflash_jax.families import qwen3_5, qwen3_moe
from dflash_jax.families.family import Family
from dflash_jax.families.qwen3_5 import Qwen35Config
from dflash_jax.layers import MLP, Linear


@dataclasses.dataclass(frozen=True)
class Qwen35MoeConfig(Qwen35Config):
    """A Qwen3.5 / 3.6 MoE text model: the ``Qwen35Config`` hybrid fields plus the expert fields of
    ``Qwen3MoeConfig`` (the same names, defaults and checks; every layer sparse here) and the shared
    expert's width."""

    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = True  # (Qwen3.5 always renormalises; Qwen3-Next reads it)
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 512

    MODEL_TYPES: ClassVar[tuple[str, str]] = ("qwen3_5_moe", "qwen3_5_moe_text")
    ARCHITECTURES: ClassVar[tuple[str, str]] = ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM")

    def __post_init__(self):
        super().__post_init__()
        qwen3_moe.check_experts(self)
        if self.shared_expert_intermediate_size < 1:
            raise ValueError(f"shared_expert_intermediate_size must be >= 1, got {self.shared_expert_intermediate_size}")

    @classmethod
    def _text_config(cls, d: dict) -> dict:
        text = super()._text_config(d)
        missing = [k for k in (*qwen3_moe.MOE_FIELDS, "shared_expert_intermediate_size") if text.get(k) is None]
        if missing:
            raise ValueError(f"{d.get('model_type')} config.json is missing {missing}")
        return {**text, "intermediate_size": text.get("intermediate_size") or text["moe_intermediate_size"]}

    @classmethod
    def _extra_fields(cls, text: dict) -> dict:
        return {k: int(text[k]) for k in (*qwen3_moe.MOE_FIELDS, "shared_expert_intermediate_size")}

    def is_sparse(self, i: int) -> bool:
        return qwen3_moe.is_sparse(self, i)

    def _extra_hf(self) -> dict:  # (intermediate_size is written too: transformers keeps it as an extra key)
        return {k: getattr(self, k) for k in (*qwen3_moe.MOE_FIELDS, "shared_expert_intermediate_size")}


class SparseMoeBlock(qwen3_moe.SparseMoeBlock):
    """``mlp``: the routed experts of ``qwen3_moe.SparseMoeBlock`` plus the gated shared expert."""

    def setup(self):
        super().setup()
        self.shared_expert = MLP(self.cfg, self.cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(1, False, ("embed", None))

    def __call__(self, x):
        """[B, T, D] -> [B, T, D]."""
        shared = self.shared_expert(x) * jax.nn.sigmoid(self.shared_expert_gate(x))
        return super().__call__(x) + shared


class DecoderLayer(qwen3_5.DecoderLayer):
    def feed_forward(self) -> nn.Module:
        return SparseMoeBlock(self.cfg) if self.cfg.is_sparse(self.index) else MLP(self.cfg)


class Decoder(qwen3_5.Decoder):
    layer_class = DecoderLayer


def checkpoint(cfg: Qwen35MoeConfig):
    """``qwen3_5``'s table (prefix, linear-attention leaves, vision / mtp skipped) composed with
    ``qwen3_moe``'s (fused expert leaves, per-expert tensors stacked)."""
    hybrid, experts = qwen3_5.checkpoint(cfg), qwen3_moe.checkpoint(cfg)
    return dataclasses.replace(hybrid, leaves=hybrid.leaves + experts.leaves,
                               rewrite=lambda stream: experts.rewrite(hybrid.rewrite(stream)))


FAMILY = Family(name="qwen3_5_moe", config=Qwen35MoeConfig, decoder=Decoder, checkpoint=checkpoint,
                state_specs=qwen3_5.state_specs, logical_rules=moe.LOGICAL_RULES, layer_kinds=qwen3_moe.layer_kinds)
