"""Target-model families: ``model_type`` -> the module that implements it.

A family module exports one ``Family``: its config dataclass (``from_hf`` / ``to_hf``), its Flax decoder,
its checkpoint name table, the per-layer decode-state kinds and any extra logical-axis rules. The
engine, the trainer and the CLIs only ever go through ``family_of(config)``.

Adding a target family
----------------------
1. Write ``dflash_jax/families/<name>.py`` with a config dataclass (``model_type`` field, ``from_hf``
   reading a Hugging Face ``config.json`` dict, ``to_hf``; the fields the rest of the library reads are
   ``vocab_size``, ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
   ``num_key_value_heads``, ``max_position_embeddings``, ``tie_word_embeddings``, ``eos_token_id``,
   ``bos_token_id``, ``pad_token_id``), a Flax decoder built as ``Decoder(config, attention_impl)``
   (``attention_impl``: the decode attention's impl, ``attention.decode_attention``) with
   ``__call__(input_ids, positions, cache=None, feature_layer_ids=(), logits_index=None, segment_ids=None,
   new_mask=None) -> (logits, features, cache)`` (``segment_ids``: packed documents without a cache;
   ``new_mask``: tree verification with a cache; see ``dense.Decoder``), ``embed(ids)`` and ``head(h)``
   (features are Hugging Face ``hidden_states[id + 1]``), and ``FAMILY = Family(...)``.
2. Add one line to ``_REGISTRY`` below per ``model_type`` it serves (and import the module).
3. Test it against transformers' own PyTorch class (see tests/test_target.py).
A family whose layers also make a draft's layer stack (Gemma 4's DSpark drafts) declares it in its ``Family``
(``draft_stacks``); ``dflash_jax.drafts`` finds it through ``draft_stacks()`` (this package imports no draft code).
"""
from __future__ import annotations

from typing import Any

from dflash_jax.config import architectures, read_config_json
from dflash_jax.families import (
    deepseek_v3,
    dense,
    gemma4,
    gpt_oss,
    mimo_v2_flash,
    muse_glimmer,
    qwen3_5,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
)
from dflash_jax.families.family import DraftStack, Family

_REGISTRY: dict[str, Family] = {
    "qwen3": dense.FAMILY,
    "llama": dense.FAMILY,
    "gpt_oss": gpt_oss.FAMILY,
    "qwen3_moe": qwen3_moe.FAMILY,
    "qwen3_5": qwen3_5.FAMILY, "qwen3_5_text": qwen3_5.FAMILY,  # VL checkpoint / text-only
    "qwen3_5_moe": qwen3_5_moe.FAMILY, "qwen3_5_moe_text": qwen3_5_moe.FAMILY,  # VL checkpoint / text-only
    "qwen3_next": qwen3_next.FAMILY,
    "muse_glimmer": muse_glimmer.FAMILY, "muse_glimmer_text": muse_glimmer.FAMILY,  # VL checkpoint / text-only
    "gemma4": gemma4.FAMILY, "gemma4_text": gemma4.FAMILY,  # VL checkpoint / text-only
    "deepseek_v3": deepseek_v3.FAMILY, "kimi_k25": deepseek_v3.FAMILY,  # text-only / Kimi-K2.5's VL checkpoint
    "mimo_v2_flash": mimo_v2_flash.FAMILY,
}


def family_for(model_type: str) -> Family:
    """The family serving ``model_type``, or a ValueError listing the supported ones."""
    if not isinstance(model_type, str) or model_type not in _REGISTRY:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(_REGISTRY)}")
    return _REGISTRY[model_type]


def family_of(cfg) -> Family:
    return family_for(cfg.model_type)


def draft_stacks() -> dict[str, DraftStack]:
    """Draft architecture -> the layer stack a family brings for it (``Family.draft_stacks``)."""
    families = {id(f): f for f in _REGISTRY.values()}.values()
    return {s.architecture: s for f in families for s in f.draft_stacks}


def config_from_hf(path_or_dict) -> Any:
    """A target config of whichever family the ``config.json`` (path, directory or dict) names."""
    d = read_config_json(path_or_dict)
    # the draft formats' architectures (DFlashDraftModel, DFlash2DraftModel, Qwen3DSparkModel) and the DSpark stacks
    # families bring: the registry in ``dflash_jax.drafts`` builds on this package, so it is read by name here
    drafts = [a for a in architectures(d) if "DFlash" in a or "DSpark" in a or a in draft_stacks()]
    if drafts:
        raise ValueError(f"this config.json is a DFlash / DSpark draft (architectures {drafts}), not a target model: "
                         "pass it as the draft")
    return family_for(d.get("model_type")).config.from_hf(d)
