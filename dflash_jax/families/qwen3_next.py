"""The Qwen3-Next family (Qwen3-Next-80B-A3B, Qwen3-Coder-Next): the ``qwen3_5_moe`` decoder (Gated
DeltaNet + gated full attention, routed experts + gated shared expert) with Qwen3-Next's own choices:

* text-only config.json (``model_type: qwen3_next``, weights under ``model.``, ``mtp.*`` skipped), plain
  partial rope (no multimodal sections);
* the router renormalises its top-k only when ``norm_topk_prob`` (transformers' ``Qwen3NextTopKRouter``);
  layers in ``mlp_only_layers`` or off ``decoder_sparse_step`` have the dense gated MLP of
  ``intermediate_size`` (``Qwen3MoeConfig.is_sparse``);
* the linear-attention input projections are fused per key head: ``in_proj_qkvz`` holds, for each of the
  Hk key heads, [q (dk) | k (dk) | v (r*dv) | z (r*dv)] rows (r = Hv / Hk value heads per key head), and
  ``in_proj_ba`` [b (r) | a (r)] (transformers' ``fix_query_key_value_ordering``). ``split_projections``
  rewrites them while loading into Qwen3.5's ``in_proj_qkv`` ([all q | all k | all v], the order the
  conv1d channels have in both models), ``in_proj_z``, ``in_proj_b`` and ``in_proj_a``, so the layer is
  ``qwen3_5.GatedDeltaNet`` unchanged. ``save_target`` therefore writes the split (Qwen3.5) names: such an
  export reloads here, not in transformers' Qwen3-Next.
"""
from __future__ import annotations

import dataclasses
import re
from typing import ClassVar

import numpy as np

from dflash_jax.families import qwen3_5_moe
from dflash_jax.families.qwen3_5_moe import Qwen35MoeConfig

_FUSED = re.compile(r"^(.*\.linear_attn)\.(in_proj_qkvz|in_proj_ba)\.weight$")


@dataclasses.dataclass(frozen=True)
class Qwen3NextConfig(Qwen35MoeConfig):
    """A Qwen3-Next decoder: ``Qwen35MoeConfig`` read from a flat ``qwen3_next`` config.json, with the
    routing switches of ``Qwen3MoeConfig`` (``norm_topk_prob``, ``decoder_sparse_step``, ``mlp_only_layers``)."""

    MODEL_TYPES: ClassVar[tuple[str, str]] = ("", "qwen3_next")
    ARCHITECTURES: ClassVar[tuple[str, str]] = ("", "Qwen3NextForCausalLM")

    @classmethod
    def _text_config(cls, d: dict) -> dict:
        return super()._text_config({**d, "intermediate_size": d.get("intermediate_size") or 5632})  # transformers'

    @classmethod
    def _extra_fields(cls, text: dict) -> dict:
        return {**super()._extra_fields(text), "norm_topk_prob": bool(text.get("norm_topk_prob", True)),
                "decoder_sparse_step": int(text.get("decoder_sparse_step") or 1),
                "mlp_only_layers": tuple(int(i) for i in text.get("mlp_only_layers") or ())}

    def _extra_hf(self) -> dict:
        return {**super()._extra_hf(), "norm_topk_prob": self.norm_topk_prob,
                "decoder_sparse_step": self.decoder_sparse_step, "mlp_only_layers": list(self.mlp_only_layers)}


def split_projections(cfg: Qwen3NextConfig):
    """A ``NameTable.rewrite``: each ``...linear_attn.in_proj_qkvz.weight`` [Hk*(2dk+2r*dv), D] ->
    ``in_proj_qkv.weight`` and ``in_proj_z.weight``; each ``in_proj_ba.weight`` [2Hv, D] -> ``in_proj_b`` and
    ``in_proj_a`` (see the module docstring). A shape the config does not imply is a ValueError naming the
    tensor; other tensors pass through."""
    hk, hv, dk, dv, d = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                         cfg.linear_value_head_dim, cfg.hidden_size)
    r = hv // hk
    group = {"in_proj_qkvz": 2 * dk + 2 * r * dv, "in_proj_ba": 2 * r}

    def rewrite(stream):
        for name, array in stream:
            m = _FUSED.match(name)
            if not m:
                yield name, array
                continue
            prefix, which = m.groups()
            want = (hk * group[which], d)
            if tuple(array.shape) != want:
                raise ValueError(f"tensor {name} has shape {list(array.shape)} but the config implies {list(want)} "
                                 f"(linear_num_key_heads={hk}, linear_num_value_heads={hv}, linear_key_head_dim={dk}, "
                                 f"linear_value_head_dim={dv}, hidden_size={d})")
            per_head = np.asarray(array).reshape(hk, group[which], d)
            if which == "in_proj_qkvz":
                q, k, v, z = np.split(per_head, np.cumsum([dk, dk, r * dv]), axis=1)
                yield f"{prefix}.in_proj_qkv.weight", np.concatenate([x.reshape(-1, d) for x in (q, k, v)])
                yield f"{prefix}.in_proj_z.weight", z.reshape(-1, d)
            else:
                yield f"{prefix}.in_proj_b.weight", per_head[:, :r].reshape(hv, d)
                yield f"{prefix}.in_proj_a.weight", per_head[:, r:].reshape(hv, d)

    return rewrite


def checkpoint(cfg: Qwen3NextConfig):
    """``qwen3_5_moe``'s table with the fused linear-attention projections split first."""
    table = qwen3_5_moe.checkpoint(cfg)
    split = split_projections(cfg)
    return dataclasses.replace(table, rewrite=lambda stream: table.rewrite(split(stream)))


FAMILY = dataclasses.replace(qwen3_5_moe.FAMILY, name="qwen3_next", config=Qwen3NextConfig, checkpoint=checkpoint)
