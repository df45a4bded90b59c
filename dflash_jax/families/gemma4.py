"""The Gemma 4 family (gemma-4-31B-it and kin; text config ``gemma4_text``), as transformers'
``Gemma4ForCausalLM`` / the language model of ``Gemma4ForConditionalGeneration``.

Embedding: the table times sqrt(hidden) (in the table's dtype) feeds the layers and is ``hidden_states[0]``;
``embed`` (the draft's block embedding) and the tied head use the RAW table. Logits: ``lm_head(norm(h))``,
then ``cap * tanh(logits / cap)`` with ``final_logit_softcapping``: in the target's own logits only (``logits``),
never in ``head``, through which the draft predicts (its own ``output_multiplier`` / softcap apply there).

Layer i (``Gemma4TextDecoderLayer``; every RMSNorm ``w * x_hat`` in float32)::

    x = x + post_attention_layernorm(attn(input_layernorm(x)))
    h = mlp(pre_feedforward_layernorm(x))                       # down(gelu_tanh(gate) * up)
    (MoE: h = post_feedforward_layernorm_1(h)
            + post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(x), router(x))))
    x = x + post_feedforward_layernorm(h)
    (per-layer input p_i: x = x + post_per_layer_input_norm(per_layer_projection(gelu_tanh(per_layer_input_gate(x)) * p_i)))
    x = x * layer_scalar

Attention: scale 1.0; q = rope(q_norm(q)), k = rope(k_norm(k)), v = v_norm(v) (no weight). Sliding layers:
``head_dim``, ``num_key_value_heads``, window ``sliding_window``, rope ``rope_parameters.sliding_attention``
(default). Full layers: ``global_head_dim``, ``num_global_key_value_heads`` (with ``attention_k_eq_v``; then
there is no ``v_proj`` and v = v_norm(k_proj(x)), k before its norm and rope), rope
``rope_parameters.full_attention``: ``proportional`` = rotary frequencies over the FULL head dim of which
only the first ``partial_rotary_factor`` * head_dim / 2 are non-zero (``layers.rope_frequencies``).
transformers 5.x may write the full layers' sizes as ``per_layer_config`` instead of ``global_head_dim`` /
``num_global_key_value_heads``; both are read.

KV sharing (``num_kv_shared_layers`` = n): each of the last n layers has only q_proj / q_norm / o_proj and
attends, with its own queries, to the keys / values of the last earlier layer of its type (sliding or
full) exactly as that layer does (same cache, same window); it keeps no decode state (``state.SharedKV``).

Per-layer embeddings (``hidden_size_per_layer_input`` = P > 0): p = (norm(per_layer_model_projection(e) *
hidden**-0.5) + embed_tokens_per_layer(ids) * sqrt(P)) * 2**-0.5 reshaped [B, T, L, P] (e the scaled embedding),
layer i reads p[:, :, i].

MoE (``enable_moe_block``): router = proj(x_hat * scale * hidden**-0.5) -> softmax -> top-k, renormalised,
times ``per_expert_scale``; experts ``gate_up_proj`` [E, 2I, D] (gate rows first) / ``down_proj`` [E, D, I] with
gelu_tanh, beside the dense MLP of every layer.

Checkpoints: the released ones are vision-language (``Gemma4ForConditionalGeneration``, ``model_type: gemma4``
with a ``text_config``): text weights under ``model.language_model.``; vision / audio towers and their
embedders are skipped (and reported). Text-only (``Gemma4ForCausalLM``, ``gemma4_text``): ``model.``.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dflash_jax import layer_scan, moe
from dflash_jax.attention import injected_attention
from dflash_jax.checkpoints import skip_tensors
from dflash_jax.config import RopeConfig, TargetConfig, read_config_json
from dflash_jax.families import dense
from dflash_jax.families.family import DraftStack, Family
from dflash_jax.layers import MLP, AttentionProjections, Embed, Linear, RMSNorm, apply_rope, gelu_tanh, initializer
from dflash_jax.moe import Experts
from dflash_jax.state import KVSpec, SharedKVSpec

VL_PREFIX, TEXT_PREFIX = "model.language_model.", "model."
SKIPPED = ((r"^model\.vision_tower\.", "vision tower (model.vision_tower.*)"),
           (r"^model\.audio_tower\.", "audio tower (model.audio_tower.*)"),
           (r"^model\.embed_(vision|audio)\.", "multimodal embedder (model.embed_vision / embed_audio)"))
# transformers' Gemma4TextConfig defaults, for config.json files that leave them out
_DEFAULTS = {"vocab_size": 262144, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 30,
             "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131072,
             "rms_norm_eps": 1e-6, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
             "tie_word_embeddings": True, "sliding_window": 512, "vocab_size_per_layer_input": 262144,
             "hidden_size_per_layer_input": 256, "hidden_activation": "gelu_pytorch_tanh"}
_DEFAULT_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                 "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                    "rope_theta": 1000000.0}}
# (flax leaf, checkpoint leaf, transposed): experts are stored [E, out, in]; the scalars and scales as they are
_LEAVES = (("gate_up_proj", "gate_up_proj", True), ("down_proj", "down_proj", True),
           ("layer_scalar", "layer_scalar", False), ("scale", "scale", False),
           ("per_expert_scale", "per_expert_scale", False))


def _rope(d: dict, max_pos: int) -> RopeConfig:
    """One layer type's ``rope_parameters`` entry: ``proportional`` (kept whole: its partial factor shapes the
    frequencies over the full head) or any type ``RopeConfig`` reads."""
    if d.get("rope_type") != "proportional":
        return RopeConfig.from_hf({"rope_parameters": dict(d)}, max_pos)
    extra = {k: float(v) for k, v in d.items() if k not in ("rope_type", "rope_theta")}
    return RopeConfig(theta=float(d.get("rope_theta") or 10000.0), rope_type="proportional",
                      params=tuple(sorted(extra.items())))


def _full_layer_sizes(text: dict, types: tuple[str, ...]) -> tuple[int, int]:
    """(head_dim, KV heads) of the full-attention layers: transformers 5.x's ``per_layer_config`` (one setting
    for every full layer, none for sliding ones) or the released ``global_head_dim`` (default 512) /
    ``num_global_key_value_heads`` (read only with ``attention_k_eq_v``, as transformers does)."""
    base = (int(text["head_dim"]), int(text["num_key_value_heads"]))
    per_layer = text.get("per_layer_config")
    if per_layer is None:
        heads = text.get("num_global_key_value_heads") if text.get("attention_k_eq_v") else None
        return int(text.get("global_head_dim") or 512), int(heads or base[1])
    full = {i for i, t in enumerate(types) if t == "full_attention"}
    settings = {int(i): dict(v) for i, v in dict(per_layer).items()}
    sizes = {json.dumps(v, sort_keys=True) for v in settings.values()}
    if set(settings) - full or len(sizes) > 1 or any(set(v) - {"head_dim", "num_key_value_heads"}
                                                     for v in settings.values()):
        raise ValueError(f"per_layer_config must give every full-attention layer the same head_dim / "
                         f"num_key_value_heads and nothing else, got {per_layer}")
    s = next(iter(settings.values()), {})
    return int(s.get("head_dim", base[0])), int(s.get("num_key_value_heads", base[1]))


@dataclasses.dataclass(frozen=True)
class Gemma4Config(TargetConfig):
    """The text model of a Gemma 4 checkpoint: ``head_dim`` / ``num_key_value_heads`` / ``rope`` are the sliding
    layers', ``global_*`` the full layers'; ``vision_language``: the VL layout (weights under model.language_model.)."""

    global_head_dim: int = 512
    num_global_key_value_heads: int = 1
    global_rope: RopeConfig = RopeConfig()
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 0
    final_logit_softcapping: float | None = None
    use_double_wide_mlp: bool = False
    enable_moe_block: bool = False
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    vision_language: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.num_attention_heads % self.num_global_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_global_key_value_heads={self.num_global_key_value_heads}")
        if not 0 <= self.num_kv_shared_layers < self.num_hidden_layers:
            raise ValueError(f"num_kv_shared_layers must be in 0..{self.num_hidden_layers - 1}, got "
                             f"{self.num_kv_shared_layers}")
        for i in range(self.first_kv_shared_layer, self.num_hidden_layers):
            self.kv_source(i)  # raises when no earlier layer of its type produces K/V
        if self.hidden_size_per_layer_input and self.vocab_size_per_layer_input < 1:
            raise ValueError("hidden_size_per_layer_input needs vocab_size_per_layer_input >= 1")
        if self.enable_moe_block and not 1 <= self.top_k_experts <= self.num_experts:
            raise ValueError(f"enable_moe_block needs 1 <= top_k_experts ({self.top_k_experts}) <= num_experts "
                             f"({self.num_experts})")

    @property
    def first_kv_shared_layer(self) -> int:
        return self.num_hidden_layers - self.num_kv_shared_layers

    def kv_source(self, i: int) -> int | None:
        """For a kv-shared layer i: the layer whose keys / values it reads (the last non-shared one of its
        type); None for a layer with its own."""
        if i < self.first_kv_shared_layer:
            return None
        same = [j for j in range(self.first_kv_shared_layer) if self.layer_types[j] == self.layer_types[i]]
        if not same:
            raise ValueError(f"kv-shared layer {i} ({self.layer_types[i]}) has no earlier {self.layer_types[i]} "
                             "layer to share keys / values with")
        return same[-1]

    def layer_attention(self, i: int) -> "Gemma4Config":
        """Layer i's attention sizes as the config its ``Attention`` reads (full layers: the global ones)."""
        if self.layer_types[i] != "full_attention":
            return dataclasses.replace(self, attention_k_eq_v=False)
        return dataclasses.replace(self, head_dim=self.global_head_dim, rope=self.global_rope,
                                   num_key_value_heads=self.num_global_key_value_heads)

    def mlp_width(self, i: int) -> int:
        double = self.use_double_wide_mlp and self.kv_source(i) is not None
        return self.intermediate_size * (2 if double else 1)

    @classmethod
    def from_hf(cls, path_or_dict) -> "Gemma4Config":
        d = read_config_json(path_or_dict)
        model_type = d.get("model_type")
        if model_type == "gemma4":
            if not isinstance(d.get("text_config"), dict):
                raise ValueError("a gemma4 config.json needs a text_config (the language model's settings)")
            text = {**d["text_config"], "tie_word_embeddings": d.get("tie_word_embeddings", True)}
            if d.get("eos_token_id") is not None:  # the VL model's own stop tokens, when it names them
                text["eos_token_id"] = d["eos_token_id"]
        elif model_type == "gemma4_text":
            text = d
        else:
            raise ValueError(f"not a Gemma 4 config: model_type {model_type!r} (expected 'gemma4' or 'gemma4_text')")
        text = {**_DEFAULTS, **{k: v for k, v in text.items() if v is not None}}
        if text.get("use_bidirectional_attention") == "all":
            raise ValueError("use_bidirectional_attention='all' (a non-causal Gemma 4) is not supported")
        if text["hidden_activation"] != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation {text['hidden_activation']!r} is not supported (gelu_pytorch_tanh)")
        n = int(text["num_hidden_layers"])
        types = list(text.get("layer_types") or ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                                 for i in range(n)])
        if types:
            types[-1] = "full_attention"  # transformers forces the last layer to full attention
        max_pos = int(text["max_position_embeddings"])
        rope = {**_DEFAULT_ROPE, **(text.get("rope_parameters") or {})}
        if set(rope) != set(_DEFAULT_ROPE):
            raise ValueError(f"rope_parameters must be keyed by {sorted(_DEFAULT_ROPE)}, got {sorted(rope)}")
        base = {k: v for k, v in text.items() if k not in ("rope_parameters", "rope_scaling", "layer_types")}
        c = cls._from_dict({**base, "layer_types": types}, "gemma4_text")
        head_dim, kv_heads = _full_layer_sizes(text, tuple(types))
        moe_on = bool(text.get("enable_moe_block", False))
        cap = text.get("final_logit_softcapping")
        return dataclasses.replace(
            c, model_type=model_type, qk_norm=True, rope=_rope(rope["sliding_attention"], max_pos),
            global_rope=_rope(rope["full_attention"], max_pos), global_head_dim=head_dim,
            num_global_key_value_heads=kv_heads, attention_k_eq_v=bool(text.get("attention_k_eq_v", False)),
            num_kv_shared_layers=int(text.get("num_kv_shared_layers") or 0),
            hidden_size_per_layer_input=int(text["hidden_size_per_layer_input"] or 0),
            vocab_size_per_layer_input=int(text["vocab_size_per_layer_input"]),
            final_logit_softcapping=float(cap) if cap else None,
            use_double_wide_mlp=bool(text.get("use_double_wide_mlp", False)), enable_moe_block=moe_on,
            num_experts=int(text.get("num_experts") or 0) if moe_on else 0,
            top_k_experts=int(text.get("top_k_experts") or 0) if moe_on else 0,
            moe_intermediate_size=int(text.get("moe_intermediate_size") or 0) if moe_on else 0,
            vision_language=model_type == "gemma4")

    def to_hf(self) -> dict:
        text = TargetConfig.to_hf(self)
        for k in ("use_sliding_window", "max_window_layers", "hidden_act", "rope_theta", "rope_scaling"):
            del text[k]
        if text["sliding_window"] is None:  # no sliding layer (a DSpark draft's stack): transformers wants an int
            del text["sliding_window"]
        text.update({
            "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text",
            "hidden_activation": "gelu_pytorch_tanh",
            "rope_parameters": {"sliding_attention": self.rope.to_hf()["rope_parameters"],
                                "full_attention": self.global_rope.to_hf()["rope_parameters"]},
            "global_head_dim": self.global_head_dim, "num_global_key_value_heads": self.num_global_key_value_heads,
            "attention_k_eq_v": self.attention_k_eq_v, "num_kv_shared_layers": self.num_kv_shared_layers,
            "hidden_size_per_layer_input": self.hidden_size_per_layer_input,
            "vocab_size_per_layer_input": self.vocab_size_per_layer_input,
            "final_logit_softcapping": self.final_logit_softcapping, "use_double_wide_mlp": self.use_double_wide_mlp,
            "enable_moe_block": self.enable_moe_block, "num_experts": self.num_experts or None,
            "top_k_experts": self.top_k_experts or None, "moe_intermediate_size": self.moe_intermediate_size or None})
        if not self.attention_k_eq_v and self.num_global_key_value_heads != self.num_key_value_heads:
            # transformers reads num_global_key_value_heads only with attention_k_eq_v: say it per layer
            text["per_layer_config"] = {str(i): {"head_dim": self.global_head_dim,
                                                 "num_key_value_heads": self.num_global_key_value_heads}
                                        for i, t in enumerate(self.layer_types) if t == "full_attention"}
        if not self.vision_language:
            return text
        del text["architectures"]
        return {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "text_config": text,
                "tie_word_embeddings": self.tie_word_embeddings}


def dspark_layers(d: dict) -> Gemma4Config:
    """The layer stack of a ``Gemma4DSparkModel`` config.json (DeepSpec copies the target's text config and sets
    ``num_hidden_layers`` / ``layer_types``): every layer full attention at the full layers' sizes and rope, as
    DeepSpec's draft attention takes them (``global_head_dim``; ``num_global_key_value_heads`` with
    ``attention_k_eq_v``, else ``num_key_value_heads``). A ``per_layer_config`` (a newer transformers' way of
    writing the full layers' sizes) stands in for ``global_head_dim`` / ``num_global_key_value_heads`` when those
    are absent. Refused,
    as DeepSpec's draft layers have none: MoE blocks, per-layer inputs; and kv-shared double-wide MLPs (which
    draft layers they widen changed between transformers versions)."""
    if d.get("model_type") != "gemma4_text":
        raise ValueError(f"a Gemma4DSparkModel config is a Gemma 4 text config (model_type gemma4_text), got "
                         f"model_type {d.get('model_type')!r}")
    n = int(d["num_hidden_layers"])
    text = {**d, "layer_types": ["full_attention"] * n}
    per_layer_input = text.get("hidden_size_per_layer_input", _DEFAULTS["hidden_size_per_layer_input"])
    if text.get("enable_moe_block") or int(per_layer_input or 0):
        raise ValueError("a Gemma4DSparkModel draft has no MoE blocks or per-layer inputs (enable_moe_block / "
                         "hidden_size_per_layer_input must be off)")
    if text.get("use_double_wide_mlp") and int(text.get("num_kv_shared_layers") or 0):
        raise ValueError("a Gemma4DSparkModel draft with use_double_wide_mlp and num_kv_shared_layers > 0 is not "
                         "supported (which draft layers get the double-wide MLP depends on the transformers version)")
    text["num_kv_shared_layers"] = 0
    per_layer = text.pop("per_layer_config", None)
    if per_layer and text.get("global_head_dim") is None:  # DeepSpec reads global_head_dim where it is given
        settings = {json.dumps(dict(v), sort_keys=True) for v in dict(per_layer).values()}
        if len(settings) > 1:
            raise ValueError(f"per_layer_config must give every full-attention layer the same setting, got {per_layer}")
        full = json.loads(next(iter(settings)))
        text["global_head_dim"] = full.get("head_dim", text.get("head_dim"))
        if text.get("attention_k_eq_v"):
            text["num_global_key_value_heads"] = full.get("num_key_value_heads")
    # DeepSpec's draft attention: num_global_key_value_heads with attention_k_eq_v, else num_key_value_heads
    return Gemma4Config.from_hf(text)


def dspark_stack(target: Gemma4Config, num_layers: int) -> Gemma4Config:
    """A new Gemma 4 DSpark draft's layer stack for ``target`` (DeepSpec's ``build_draft_config``): the target's
    text settings, ``num_layers`` full-attention layers (KV heads as DeepSpec's draft attention takes them), no
    sliding window, MoE, per-layer inputs, kv sharing or tied head."""
    kv = target.num_global_key_value_heads if target.attention_k_eq_v else target.num_key_value_heads
    return dataclasses.replace(target, num_hidden_layers=num_layers, layer_types=("full_attention",) * num_layers,
                               sliding_window=None, num_global_key_value_heads=kv,
                               num_kv_shared_layers=0, hidden_size_per_layer_input=0,
                               enable_moe_block=False, num_experts=0, top_k_experts=0, moe_intermediate_size=0,
                               use_double_wide_mlp=False, tie_word_embeddings=False, model_type="gemma4_text",
                               vision_language=False)


class Attention(AttentionProjections):
    """``Gemma4TextAttention``; ``cfg`` is the layer's (``Gemma4Config.layer_attention``). A kv-shared layer
    (``shared``) has queries and the output projection only."""

    shared: bool = False

    def setup(self):
        c = self.cfg
        self.q_proj = Linear(c.num_attention_heads * c.head_dim, c.attention_bias, ("embed", "heads"))
        self.o_proj = Linear(c.hidden_size, c.attention_bias, ("heads", "embed"))
        self.q_norm = RMSNorm(c.rms_norm_eps, axis_name="head_dim")
        if self.shared:
            return
        self.k_proj = Linear(c.num_key_value_heads * c.head_dim, c.attention_bias, ("embed", "kv_heads"))
        if not c.attention_k_eq_v:
            self.v_proj = Linear(c.num_key_value_heads * c.head_dim, c.attention_bias, ("embed", "kv_heads"))
        self.k_norm = RMSNorm(c.rms_norm_eps, axis_name="head_dim")
        self.v_norm = RMSNorm(c.rms_norm_eps, with_scale=False)

    def attention_scale(self) -> float:
        return 1.0

    def keys_values(self, x, positions):
        """[B, T, D] -> keys rope(k_norm(k)) and values v_norm(v) (v = k_proj(x) with attention_k_eq_v)."""
        c = self.cfg
        k = self.k_proj(x).reshape(*x.shape[:-1], c.num_key_value_heads, c.head_dim)
        v = k if c.attention_k_eq_v else self.v_proj(x).reshape(k.shape)
        return apply_rope(self.k_norm(k), positions, c.rope), self.v_norm(v)


class Router(nn.Module):
    """``Gemma4TextRouter``: x [T, D] -> (top-k expert ids [T, k], their weights [T, k] float32)."""

    cfg: Gemma4Config

    def setup(self):
        c = self.cfg
        box = nn.with_logical_partitioning
        self.norm = RMSNorm(c.rms_norm_eps, with_scale=False)
        self.proj = Linear(c.num_experts, False, ("embed", None))
        self.scale = self.param("scale", box(initializer("scale"), ("embed",)), (c.hidden_size,))
        self.per_expert_scale = self.param("per_expert_scale", box(initializer("per_expert_scale"), (None,)),
                                           (c.num_experts,))

    def __call__(self, x):
        c = self.cfg
        h = self.norm(x) * jnp.asarray(self.scale, x.dtype) * jnp.asarray(c.hidden_size ** -0.5, x.dtype)
        probs = jax.nn.softmax(self.proj(h).astype(jnp.float32), axis=-1)
        top, index = jax.lax.top_k(probs, c.top_k_experts)
        top = top / jnp.sum(top, axis=-1, keepdims=True)
        return index, top * jnp.asarray(self.per_expert_scale, jnp.float32)[index]


class DecoderLayer(dense.DecoderLayer):
    """``Gemma4TextDecoderLayer`` (the module docstring's formula)."""

    def token_mixer(self) -> None:
        c = self.cfg
        self.self_attn = Attention(c.layer_attention(self.index), shared=c.kv_source(self.index) is not None)

    def feed_forward(self) -> nn.Module:
        return MLP(self.cfg, self.cfg.mlp_width(self.index), activation=gelu_tanh)

    def setup(self):
        super().setup()
        c = self.cfg
        self.pre_feedforward_layernorm = RMSNorm(c.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(c.rms_norm_eps)
        self.layer_scalar = self.param("layer_scalar", nn.with_logical_partitioning(initializer("layer_scalar"),
                                                                                    (None,)), (1,))
        if c.hidden_size_per_layer_input:
            self.per_layer_input_gate = Linear(c.hidden_size_per_layer_input, False, ("embed", None))
            self.per_layer_projection = Linear(c.hidden_size, False, (None, "embed"))
            self.post_per_layer_input_norm = RMSNorm(c.rms_norm_eps)
        if c.enable_moe_block:
            self.router = Router(c)
            self.experts = Experts(c.num_experts, c.hidden_size, c.moe_intermediate_size, activation=gelu_tanh)
            self.post_feedforward_layernorm_1 = RMSNorm(c.rms_norm_eps)
            self.post_feedforward_layernorm_2 = RMSNorm(c.rms_norm_eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(c.rms_norm_eps)

    def mix(self, h, positions, state, segment_ids=None, new_mask=None, shared_kv=None):
        """-> (attention output, new state, (state before, k, v) for the layers sharing this one's K/V). A kv-shared
        layer gets its source layer's ``shared_kv`` and attends to it as that layer did (its state untouched)."""
        q = self.self_attn.queries(h, positions)
        if shared_kv is not None:
            kv_state, k, v = shared_kv
            o, _ = self.attend(q, k, v, positions, kv_state, segment_ids, new_mask)
            return self.self_attn.output(o), state, None
        k, v = self.self_attn.keys_values(h, positions)
        o, new_state = self.attend(q, k, v, positions, state, segment_ids, new_mask)
        return self.self_attn.output(o), new_state, (state, k, v)

    def ffn(self, x):
        """The block after attention, before ``post_feedforward_layernorm``: the MLP (+ the experts)."""
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if not self.cfg.enable_moe_block:
            return h
        tokens = x.reshape(-1, x.shape[-1])
        index, weight = self.router(tokens)
        routed = self.experts(self.pre_feedforward_layernorm_2(tokens), index, weight).reshape(x.shape)
        return self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(routed)

    def __call__(self, x, positions, state, segment_ids=None, new_mask=None, *, per_layer_input=None, shared_kv=None):
        """-> (x, new layer state, K/V for sharing layers (``mix``))."""
        h, state, kv = self.mix(self.input_layernorm(x), positions, state, segment_ids, new_mask, shared_kv)
        x = x + self.post_attention_layernorm(h)
        x = x + self.post_feedforward_layernorm(self.ffn(x))
        if per_layer_input is not None:
            gated = gelu_tanh(self.per_layer_input_gate(x)) * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return x * jnp.asarray(self.layer_scalar, x.dtype), state, kv


class ScanStep(layer_scan.ScanStep):
    """A scan step of Gemma 4 layers: each takes its per-layer input (kv-shared layers and their sources are never
    scanned: ``layer_kinds``)."""

    def apply(self, layer, x, positions, state, segment_ids, new_mask, inputs):
        x, state, _ = layer(x, positions, state, segment_ids, new_mask, per_layer_input=inputs)
        return x, state


class Decoder(dense.Decoder):
    layer_class = DecoderLayer
    scan_step = ScanStep

    def setup(self):
        super().setup()
        c = self.cfg
        if c.hidden_size_per_layer_input:
            width = c.num_hidden_layers * c.hidden_size_per_layer_input
            self.embed_tokens_per_layer = Embed(c.vocab_size_per_layer_input, width)
            self.per_layer_model_projection = Linear(width, False, ("embed", None))
            self.per_layer_projection_norm = RMSNorm(c.rms_norm_eps, axis_name=None)

    def per_layer_inputs(self, input_ids, x):
        """[B, T] ids and their scaled embeddings x [B, T, D] -> per-layer inputs [B, T, L, P]."""
        c = self.cfg
        shape = (*input_ids.shape, c.num_hidden_layers, c.hidden_size_per_layer_input)
        own = self.embed_tokens_per_layer(input_ids)
        own = own * jnp.asarray(c.hidden_size_per_layer_input ** 0.5, own.dtype)
        projected = self.per_layer_model_projection(x) * jnp.asarray(c.hidden_size ** -0.5, x.dtype)
        projected = self.per_layer_projection_norm(projected.reshape(shape))
        return (projected + own.reshape(shape)) * jnp.asarray(2.0 ** -0.5, x.dtype)

    def logits(self, h):
        logits = self.head(h)
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else cap * jnp.tanh(logits / cap)

    # positional: the family decoder contract (family.py) that target.forward calls in this order
    def __call__(self, input_ids, positions, cache=None, feature_layer_ids: tuple = (), logits_index=None,
                 segment_ids=None, new_mask=None):
        """As ``dense.Decoder.__call__``; the embedding scaled by sqrt(hidden), per-layer inputs, shared K/V."""
        c = self.cfg
        self.check_feature_ids(feature_layer_ids)
        x = self.embed(input_ids)
        x = x * jnp.asarray(c.hidden_size ** 0.5, x.dtype)
        per_layer = self.per_layer_inputs(input_ids, x) if c.hidden_size_per_layer_input else None
        picked, states, shared = {-1: x}, [], {}
        for first, repeats, period in self.layer_groups():  # a group's states: one per position in its period
            s = None if cache is None else cache.layers[len(states):len(states) + period]
            if repeats == 1:
                source, layer = c.kv_source(first), self.group(first, 1, 1)
                x, s, shared[first] = layer(x, positions, None if s is None else s[0], segment_ids, new_mask,
                                            per_layer_input=None if per_layer is None else per_layer[:, :, first],
                                            shared_kv=None if source is None else shared[source])
                picked[first] = x
                states.append(s)
                continue
            x, s, outs = layer_scan.run(self.group(first, repeats, period), first, repeats, period, x, positions, s,
                                        feature_layer_ids, segment_ids, new_mask, per_layer)
            picked.update(outs)
            states.extend(s or [None] * period)
        return self.outputs(x, picked, states, cache, feature_layer_ids, logits_index)


def checkpoint(cfg: Gemma4Config):
    """The dense table under the language-model prefix, plus the expert / scalar leaves; a kv-shared layer's
    k/v projections and norms, when a checkpoint has them, are not used (as in transformers)."""
    table = dense.checkpoint(cfg)
    unused = tuple(rf"\.layers\.{i}\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\." for i in
                   range(cfg.first_kv_shared_layer, cfg.num_hidden_layers))
    return dataclasses.replace(table, prefix=VL_PREFIX if cfg.vision_language else TEXT_PREFIX, leaves=_LEAVES,
                               ignored=table.ignored + unused, rewrite=skip_tensors(SKIPPED, "gemma4"))


def state_specs(cfg: Gemma4Config) -> tuple:
    """Sliding layers: a window ring (or full cache); full layers: a KV cache of the global sizes; kv-shared
    layers: none (``SharedKV``)."""
    def spec(i):
        if cfg.kv_source(i) is not None:
            return SharedKVSpec()
        a = cfg.layer_attention(i)
        return KVSpec(a.num_key_value_heads, a.head_dim, cfg.layer_window(i))

    return tuple(spec(i) for i in range(cfg.num_hidden_layers))


class DraftLayer(DecoderLayer):
    """A Gemma 4 DSpark layer (DeepSpec's ``Gemma4DSparkDecoderLayer``): ``gemma4.DecoderLayer``'s sandwich norms,
    GeLU-tanh MLP and layer scalar around the injected attention (full, bidirectional, scale 1, the full layers'
    head dim, k = v when ``attention_k_eq_v``)."""

    draft: Any = None  # the DraftConfig (dflash_jax.drafts)

    def __call__(self, x, positions, anchors, k_ctx, v_ctx, *, impl: str, decode: bool, ctx_start=None,
                 block_len=None):
        """As the shared draft layer's (``dflash_jax.drafts.model.DraftLayer``)."""
        o = injected_attention(self, self.input_layernorm(x), positions, anchors, k_ctx, v_ctx, impl=impl,
                               decode=decode, ctx_start=ctx_start, block_len=block_len)
        x = x + self.post_attention_layernorm(o)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x * jnp.asarray(self.layer_scalar, x.dtype)


def _dspark_hf_keys(draft) -> dict:
    """What DeepSpec's Gemma 4 DSpark config.json holds beside the draft's keys: the target's model types, the
    logit soft cap."""
    return {"target_model_type": "gemma4", "target_text_model_type": "gemma4_text",
            "final_logit_softcapping": draft.final_logit_softcapping}


def _dspark_for_target(target: Gemma4Config, num_layers: int) -> tuple[Gemma4Config, dict]:
    """A new DSpark draft of a Gemma 4 target: ``dspark_stack`` and the target's logit soft cap."""
    return dspark_stack(target, num_layers), {"final_logit_softcapping": target.final_logit_softcapping}


DSPARK_STACK = DraftStack(architecture="Gemma4DSparkModel", model_type="gemma4_text", layers=dspark_layers,
                          layer=DraftLayer, scaled_embedding=True, hf_keys=_dspark_hf_keys,
                          for_target=_dspark_for_target)
def layer_kinds(cfg: Gemma4Config) -> tuple:
    """What sets a layer apart (``Family.layer_kinds``): its attention type and MLP width. With kv-shared layers
    (the small E2B / E4B models) every layer is a kind of its own, none scanned: their sources' caches, read by
    shared layers beside the sources' writes, were copied by XLA once some layers scanned (the 31B and 26B-A4B
    share none)."""
    if cfg.first_kv_shared_layer < cfg.num_hidden_layers:
        return tuple(range(cfg.num_hidden_layers))
    return tuple((t, cfg.mlp_width(i)) for i, t in enumerate(cfg.layer_types))


FAMILY = Family(name="gemma4", config=Gemma4Config, decoder=Decoder, checkpoint=checkpoint, state_specs=state_specs,
                logical_rules=moe.LOGICAL_RULES, draft_stacks=(DSPARK_STACK,), layer_kinds=layer_kinds)
