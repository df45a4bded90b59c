"""The Muse-Glimmer family (Muse-Glimmer-30B): a dense GQA decoder with sandwich norms, gated attention,
sliding-window rope layers and full-attention NoPE layers, and soft-capped logits (as transformers'
``MuseGlimmerTextModel`` inside ``MuseGlimmerForConditionalGeneration``).

- Embedding: the raw lookup, then a weight-less RMSNorm (eps ``rms_norm_eps``); that normed embedding is
  ``hidden_states[0]``. ``embed`` stays the raw lookup: a DFlash draft embeds its blocks without the norm
  (transformers' ``DFlashTokenCandidateGenerator._get_noise_embeds``).
- Layer: x += post_attention_layernorm(attn(input_layernorm(x))); x += post_feedforward_layernorm(
  mlp(pre_feedforward_layernorm(x))). All four norms are (1 + w) * x_hat; input / pre-feedforward use
  ``rms_norm_eps``, post-attention / post-feedforward ``post_norm_eps``. The final norm is plain w * x_hat
  (so ``norm_offset`` stays False: the layer norms are zero-centred here explicitly).
- Attention (``self_attn``): q, k, v, o projections without q/k norm weights: one weight-less RMSNorm
  (``rms_norm_eps``) per head on q and on k, then q *= ``qk_scale_factor``; rope (neox, the config's global
  theta) on the layers whose ``layer_rope_theta`` is non-zero, none (NoPE) where it is 0 -- transformers
  reads only whether each entry is 0, so a non-zero per-layer value rotates with the global theta too; the
  usual head_dim ** -0.5 scale; the output times sigmoid(``gate_proj(x)``) before ``o_proj``. Sliding layers
  (``layer_types``) see the last ``sliding_window`` positions; by default every 4th layer counted back from
  the last is full attention and NoPE, the others sliding with rope.
- Logits: ``cap * tanh(lm_head(h) * output_multiplier / cap)`` (``final_logit_softcapping``); ``head`` stays
  the plain lm_head, which a draft multiplies and caps by its own config.

Checkpoints: the released one is vision-language (config.json ``model_type: muse_glimmer`` with a
``text_config`` of ``model_type: muse_glimmer_text``): text weights under ``model.language_model.``, the
vision tower, adapter and projection skipped (and reported); input ids of the image / video placeholder
tokens are embedded as token 0, as the VL model does. A text-only config (``muse_glimmer_text``) reads
its weights under ``model.``.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from dflash_jax.checkpoints import skip_tensors
from dflash_jax.config import TargetConfig, read_config_json
from dflash_jax.families import dense
from dflash_jax.families.family import Family
from dflash_jax.layers import AttentionProjections, Linear, RMSNorm, apply_rope

MODEL_TYPES = ("muse_glimmer", "muse_glimmer_text")  # (vision-language, text-only)
ARCHITECTURE = "MuseGlimmerForConditionalGeneration"
VL_PREFIX, TEXT_PREFIX = "model.language_model.", "model."
SKIPPED = ((r"^model\.vision_tower\.", "vision tower (model.vision_tower.*)"),
           (r"^model\.vision_(adapter|projection)\.", "vision adapter / projection (model.vision_*)"))
# transformers' MuseGlimmerTextConfig / MuseGlimmerConfig defaults, for config.json files that leave them out
_DEFAULTS = {"vocab_size": 202048, "hidden_size": 6656, "intermediate_size": 19968, "num_hidden_layers": 52,
             "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "max_position_embeddings": 131072,
             "rms_norm_eps": 1e-5, "eos_token_id": 200001, "bos_token_id": 200000, "sliding_window": 2048,
             "final_logit_softcapping": 20.0, "qk_scale_factor": 3.87, "output_multiplier": 0.19611613513818404,
             "post_norm_eps": 1e-8}
_VL_DEFAULTS = {"image_token_id": 200092, "video_token_id": 200091}
_FLOATS = ("post_norm_eps", "qk_scale_factor", "output_multiplier", "final_logit_softcapping")


def _every_fourth_from_last(n: int) -> list[bool]:
    return [(n - 1 - i) % 4 == 0 for i in range(n)]


@dataclasses.dataclass(frozen=True)
class MuseGlimmerConfig(TargetConfig):
    """The text model of a Muse-Glimmer checkpoint; ``layer_rope_theta`` (0: NoPE) as transformers names it;
    ``vision_language``: the VL layout (weights under model.language_model., ``multimodal_token_ids`` embedded
    as token 0)."""

    post_norm_eps: float = 1e-8
    qk_scale_factor: float = 3.87
    output_multiplier: float = 0.19611613513818404
    final_logit_softcapping: float = 20.0
    layer_rope_theta: tuple[float, ...] = ()
    vision_language: bool = False
    multimodal_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        super().__post_init__()
        if not self.layer_rope_theta:  # transformers' default: NoPE on every 4th layer counted back from the last
            object.__setattr__(self, "layer_rope_theta", tuple(
                0.0 if f else self.rope.theta for f in _every_fourth_from_last(self.num_hidden_layers)))
        if len(self.layer_rope_theta) != self.num_hidden_layers:
            raise ValueError(f"layer_rope_theta has {len(self.layer_rope_theta)} entries for "
                             f"{self.num_hidden_layers} layers")
        for k in _FLOATS:
            if not getattr(self, k) > 0:
                raise ValueError(f"{k} must be > 0, got {getattr(self, k)}")

    def rotary(self, i: int) -> bool:
        """Whether layer i rotates q and k (layer_rope_theta[i] != 0), else NoPE."""
        return bool(self.layer_rope_theta[i])

    @classmethod
    def from_hf(cls, path_or_dict) -> MuseGlimmerConfig:
        d = read_config_json(path_or_dict)
        model_type = d.get("model_type")
        if model_type == MODEL_TYPES[0]:
            if not isinstance(d.get("text_config"), dict):
                raise ValueError(f"a {model_type} config.json needs a text_config (the language model's settings)")
            text = {**d["text_config"], "tie_word_embeddings": d.get("tie_word_embeddings", False)}  # the VL flag
            mm = tuple(int(d.get(k, v)) for k, v in _VL_DEFAULTS.items())
        elif model_type == MODEL_TYPES[1]:
            text, mm = d, ()
        else:
            raise ValueError(f"not a Muse-Glimmer config: model_type {model_type!r} (expected one of {MODEL_TYPES})")
        text = {**_DEFAULTS, **{k: v for k, v in text.items() if v is not None}}
        if text.get("hidden_activation", "silu") != "silu":
            raise ValueError(f"hidden_activation {text['hidden_activation']!r} is not supported (silu only)")
        full = _every_fourth_from_last(int(text["num_hidden_layers"]))
        text.setdefault("layer_types", ["full_attention" if f else "sliding_attention" for f in full])
        c = cls._from_dict({k: v for k, v in text.items() if k != "partial_rotary_factor"}, model_type)
        thetas = tuple(float(t) for t in text.get("layer_rope_theta") or c.layer_rope_theta)
        return dataclasses.replace(
            c, qk_norm=False, layer_rope_theta=thetas,
            vision_language=model_type == MODEL_TYPES[0], multimodal_token_ids=mm,
            **{k: float(text[k]) for k in _FLOATS})

    def to_hf(self) -> dict:
        text = TargetConfig.to_hf(self)
        for k in ("use_sliding_window", "max_window_layers", "hidden_act", "rope_scaling", "rope_theta"):
            del text[k]
        text.update({"model_type": MODEL_TYPES[1], "hidden_activation": "silu",
                     "layer_rope_theta": list(self.layer_rope_theta), **{k: getattr(self, k) for k in _FLOATS}})
        del text["architectures"]
        if not self.vision_language:
            return text
        return {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPES[0], "text_config": text,
                "tie_word_embeddings": self.tie_word_embeddings,
                **dict(zip(_VL_DEFAULTS, self.multimodal_token_ids))}


class Attention(AttentionProjections):
    """``MuseGlimmerTextAttention``: weight-less q/k norm, q scaled by ``qk_scale_factor``, rope unless NoPE,
    output gated by sigmoid(``gate_proj(x)``)."""

    rotary: bool = True

    def setup(self):
        super().setup()  # q/k/v/o (the config has no q/k norm weights)
        c = self.cfg
        self.gate_proj = Linear(c.num_attention_heads * c.head_dim, False, ("embed", "heads"))
        self.qk_norm = RMSNorm(c.rms_norm_eps, with_scale=False)

    def _rope(self, x, positions):
        return apply_rope(x, positions, self.cfg.rope) if self.rotary else x

    def gated_queries(self, x, positions):
        """[B, T, D] -> (queries [B, T, N, H], output gate [B, T, N, H])."""
        c = self.cfg
        heads = (*x.shape[:-1], c.num_attention_heads, c.head_dim)
        q = self.qk_norm(self.q_proj(x).reshape(heads)) * jnp.asarray(c.qk_scale_factor, x.dtype)
        return self._rope(q, positions), self.gate_proj(x).reshape(heads)

    def keys_values(self, x, positions):
        c = self.cfg
        kv = (*x.shape[:-1], c.num_key_value_heads, c.head_dim)
        return self._rope(self.qk_norm(self.k_proj(x).reshape(kv)), positions), self.v_proj(x).reshape(kv)


class DecoderLayer(dense.DecoderLayer):
    def setup(self):
        c = self.cfg
        self.token_mixer()
        self.mlp = self.feed_forward()
        self.input_layernorm = RMSNorm(c.rms_norm_eps, zero_centred=True)
        self.post_attention_layernorm = RMSNorm(c.post_norm_eps, zero_centred=True)
        self.pre_feedforward_layernorm = RMSNorm(c.rms_norm_eps, zero_centred=True)
        self.post_feedforward_layernorm = RMSNorm(c.post_norm_eps, zero_centred=True)

    def token_mixer(self) -> None:
        self.self_attn = Attention(self.cfg, rotary=self.cfg.rotary(self.index))

    def __call__(self, x, positions, state, segment_ids=None, new_mask=None):
        out, state = self.mix(self.input_layernorm(x), positions, state, segment_ids, new_mask)
        x = x + self.post_attention_layernorm(out)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x, state


class Decoder(dense.Decoder):
    layer_class = DecoderLayer

    def setup(self):
        super().setup()
        self.embed_norm = RMSNorm(self.cfg.rms_norm_eps, with_scale=False)

    def embed_inputs(self, input_ids):
        mm = self.cfg.multimodal_token_ids
        if mm:  # placeholders of images / videos: token 0 without their pixels (MuseGlimmerModel.forward)
            input_ids = jnp.where(jnp.isin(input_ids, jnp.asarray(mm)), 0, input_ids)
        return self.embed_norm(self.embed(input_ids))

    def logits(self, h):
        c = self.cfg
        cap = jnp.float32(c.final_logit_softcapping)
        return cap * jnp.tanh(self.head(h) * jnp.float32(c.output_multiplier) / cap)


def checkpoint(cfg: MuseGlimmerConfig):
    """The dense table under the language-model prefix; the vision parts skipped and reported."""
    return dataclasses.replace(dense.checkpoint(cfg), prefix=VL_PREFIX if cfg.vision_language else TEXT_PREFIX,
                               rewrite=skip_tensors(SKIPPED, "muse_glimmer"))


def layer_kinds(cfg: MuseGlimmerConfig) -> tuple:
    """What sets a layer apart (``Family.layer_kinds``): its attention type and its rope theta (0: NoPE)."""
    return tuple(zip(cfg.layer_types, cfg.layer_rope_theta))


FAMILY = Family(name="muse_glimmer", config=MuseGlimmerConfig, decoder=Decoder, checkpoint=checkpoint,
                state_specs=dense.state_specs, layer_kinds=layer_kinds)
