"""The qwen3_moe family (Qwen3-Coder-30B-A3B): Qwen3 attention (q/k norm, GQA) with routed experts after it.

A layer's ``mlp`` is a sparse block (router ``gate`` + ``dflash_jax.moe.Experts``) unless the layer is in
``mlp_only_layers`` or off ``decoder_sparse_step``, where it is the dense gated MLP of width
``intermediate_size``. Everything else (attention, decode state, features) is the dense family's.

Checkpoints: released / transformers-4.x ones (and what transformers 5.x ``save_pretrained`` writes) store
one tensor per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``); transformers 5.x's in-memory layout
(``mlp.experts.gate_up_proj`` [E, 2I, D], gate rows first, and ``mlp.experts.down_proj`` [E, D, I]) is the
one the name table names, and ``stack_experts`` rewrites the first layout into it while loading.
"""
from __future__ import annotations

import dataclasses
import re
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import moe
from dflash_jax.checkpoints import NameTable
from dflash_jax.config import TargetConfig, read_config_json
from dflash_jax.families import dense
from dflash_jax.families.family import Family
from dflash_jax.layers import MLP, Linear
from dflash_jax.moe import Experts

MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(TargetConfig):
    """A Qwen3-MoE decoder: the dense Qwen3 fields (``intermediate_size`` = the dense layers' MLP width)
    plus the experts'."""

    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self):
        super().__post_init__()
        check_experts(self)

    def is_sparse(self, i: int) -> bool:
        return is_sparse(self, i)

    @classmethod
    def from_hf(cls, path_or_dict) -> "Qwen3MoeConfig":
        d = read_config_json(path_or_dict)
        if d.get("model_type") != "qwen3_moe":
            raise ValueError(f"expected model_type 'qwen3_moe', got {d.get('model_type')!r}")
        d.setdefault("num_experts", d.get("num_local_experts"))  # transformers 5.x writes num_local_experts
        missing = [k for k in MOE_FIELDS if d.get(k) is None]
        if missing:
            raise ValueError(f"qwen3_moe config.json is missing {missing}")
        # transformers' Qwen3-MoE slides every layer when use_sliding_window (it has no max_window_layers);
        # intermediate_size (dense layers only) defaults as there.
        base = cls._from_dict({"intermediate_size": 6144, **d, "max_window_layers": 0}, "qwen3_moe")
        return dataclasses.replace(
            base, qk_norm=True, num_experts=int(d["num_experts"]), num_experts_per_tok=int(d["num_experts_per_tok"]),
            moe_intermediate_size=int(d["moe_intermediate_size"]), norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            decoder_sparse_step=int(d.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()))

    def to_hf(self) -> dict:
        out = super().to_hf()
        out.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=self.num_experts,
                   num_experts_per_tok=self.num_experts_per_tok, moe_intermediate_size=self.moe_intermediate_size,
                   norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=self.decoder_sparse_step,
                   mlp_only_layers=list(self.mlp_only_layers))
        return out


def check_experts(cfg) -> None:
    """The checks of the expert fields, for every config that carries them (``Qwen3MoeConfig``'s and the
    Qwen3.5 MoE hybrids')."""
    if cfg.num_experts and not 1 <= cfg.num_experts_per_tok <= cfg.num_experts:
        raise ValueError(f"num_experts_per_tok={cfg.num_experts_per_tok} must be in 1..num_experts={cfg.num_experts}")
    if cfg.decoder_sparse_step < 1:
        raise ValueError(f"decoder_sparse_step must be >= 1, got {cfg.decoder_sparse_step}")


def is_sparse(cfg, i: int) -> bool:
    """Whether layer i routes to experts (transformers' ``Qwen3MoeDecoderLayer`` rule)."""
    return i not in cfg.mlp_only_layers and cfg.num_experts > 0 and (i + 1) % cfg.decoder_sparse_step == 0


def route(logits, k: int, normalize: bool):
    """Router logits [T, E] -> (expert index [T, k], weight [T, k] float32): softmax over all experts in
    float32, top-k, renormalised to sum 1 when ``normalize`` (as transformers' ``Qwen3MoeTopKRouter``)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weight, index = jax.lax.top_k(probs, k)
    if normalize:
        weight = weight / jnp.sum(weight, axis=-1, keepdims=True)
    return index, weight


class SparseMoeBlock(nn.Module):
    """``mlp`` of a sparse layer: router ``gate`` ([E, D] in the checkpoint) and the routed ``experts``."""

    cfg: Qwen3MoeConfig

    def setup(self):
        c = self.cfg
        self.gate = Linear(c.num_experts, False, ("embed", None))
        self.experts = Experts(c.num_experts, c.hidden_size, c.moe_intermediate_size, gate_up_layout="concat")

    def __call__(self, x):
        """[B, T, D] -> [B, T, D]."""
        flat = x.reshape(-1, x.shape[-1])
        index, weight = route(self.gate(flat), self.cfg.num_experts_per_tok, self.cfg.norm_topk_prob)
        return self.experts(flat, index, weight.astype(x.dtype)).reshape(x.shape)


class DecoderLayer(dense.DecoderLayer):
    def feed_forward(self) -> nn.Module:
        return SparseMoeBlock(self.cfg) if self.cfg.is_sparse(self.index) else MLP(self.cfg)


class Decoder(dense.Decoder):
    layer_class: ClassVar[type] = DecoderLayer


_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def stack_experts(cfg: Qwen3MoeConfig):
    """A ``NameTable.rewrite``: per-expert tensors (``...mlp.experts.{e}.gate_proj.weight`` [I, D], ``up_proj``,
    ``down_proj`` [D, I]) -> the fused ``...mlp.experts.gate_up_proj`` [E, 2I, D] and ``down_proj`` [E, D, I].
    A layer's experts are held until all of them have arrived (one layer at a time in a name-ordered
    checkpoint); an expert index, shape or count that disagrees with the config is a ValueError naming
    the tensor. Other tensors (and already fused ones) pass through."""
    e, d, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    shapes = {"gate_proj": (i, d), "up_proj": (i, d), "down_proj": (d, i)}

    def rewrite(stream):
        pending: dict[str, dict] = {}  # "model.layers.N.mlp.experts" -> {(expert, proj): array}
        for name, array in stream:
            m = _PER_EXPERT.match(name)
            if not m:
                yield name, array
                continue
            prefix, expert, proj = m.group(1), int(m.group(2)), m.group(3)
            if expert >= e:
                raise ValueError(f"tensor {name} is expert {expert}, but the config has num_experts={e} "
                                 f"(experts 0..{e - 1})")
            if tuple(array.shape) != shapes[proj]:
                raise ValueError(f"tensor {name} has shape {list(array.shape)} but the config implies "
                                 f"{list(shapes[proj])} (hidden_size={d}, moe_intermediate_size={i})")
            group = pending.setdefault(prefix, {})
            group[expert, proj] = array
            if len(group) == 3 * e:
                del pending[prefix]
                yield f"{prefix}.gate_up_proj", np.stack(
                    [np.concatenate([group[x, "gate_proj"], group[x, "up_proj"]]) for x in range(e)])
                yield f"{prefix}.down_proj", np.stack([group[x, "down_proj"] for x in range(e)])
        for prefix, group in pending.items():
            missing = [f"{prefix}.{x}.{p}.weight" for x in range(e) for p in shapes if (x, p) not in group]
            raise ValueError(f"checkpoint lacks tensor {missing[0]} ({len(missing)} expert tensors of {prefix} are "
                             f"missing; the config has num_experts={e})")

    return rewrite


def checkpoint(cfg: Qwen3MoeConfig) -> NameTable:
    """The dense table plus the fused expert tensors (stored [E, out, in]) and the per-expert rewrite."""
    return dataclasses.replace(dense.checkpoint(cfg), rewrite=stack_experts(cfg),
                               leaves=(("gate_up_proj", "gate_up_proj", True), ("down_proj", "down_proj", True)))


def layer_kinds(cfg) -> tuple:
    """What sets a layer apart (``Family.layer_kinds``): its attention type and whether it routes to experts."""
    return tuple((t, cfg.is_sparse(i)) for i, t in enumerate(cfg.layer_types))


FAMILY = Family(name="qwen3_moe", config=Qwen3MoeConfig, decoder=Decoder, checkpoint=checkpoint,
                state_specs=dense.state_specs, logical_rules=moe.LOGICAL_RULES, layer_kinds=layer_kinds)
