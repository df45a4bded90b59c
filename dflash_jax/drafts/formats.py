"""Draft formats: the layouts a draft's ``config.json`` may name (DFlash v1, DFlash2, DSpark), each a
``DraftFormat`` record: the Hugging Face architectures naming it, what it changes in the draft (its capabilities),
its own ``DraftConfig`` fields and how they are read, checked and written back. ``DraftConfig`` asks its format,
never compares names; a new format is one record in ``FORMATS`` (its layers in their own module, a proposer in
``dflash_jax.decode.proposers``)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from dflash_jax.config import TargetConfig
from dflash_jax.families import draft_stacks
from dflash_jax.families.family import DraftStack

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")  # DSpark's Markov heads (dflash_jax/drafts/dspark.py)
# DFlash2 keys of ``dflash_config`` -> their defaults (docs/models.md, "Draft formats")
DFLASH2_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
# DSpark's top-level config keys (DeepSpec's build_draft_config) -> the DraftConfig fields they fill
DSPARK_KEYS = {"markov_rank": "markov_rank", "markov_head_type": "markov_head_type",
               "enable_confidence_head": "confidence_head", "confidence_head_with_markov": "confidence_with_markov",
               "num_anchors": "num_anchors"}
# Qwen3 layers: every DFlash / DFlash2 draft's stack, and DeepSpec's Qwen3DSparkModel (layer None: the shared
# draft layer, ``dflash_jax.drafts.model.DraftLayer``)
QWEN3_STACK = DraftStack(architecture="Qwen3DSparkModel", model_type="qwen3",
                         layers=lambda d: TargetConfig._from_dict(d, "qwen3"), layer=None)


@dataclasses.dataclass(frozen=True)
class DraftFormat:
    """One draft layout. ``read(d, key)``: its fields from a config.json dict (``key(name, default)`` reads
    ``dflash_config`` first, then the top level); ``write(cfg, out)``: the whole config.json from ``out``, its layer
    stack's keys; ``check(cfg)``: raise on settings it cannot run."""

    name: str  # ``DraftConfig.architecture``
    title: str  # its name in messages
    architectures: tuple[str, ...]  # config.json ``architectures`` naming it (a family's DSpark stack adds its own)
    write: Callable[[Any, dict], dict]
    fields: tuple[str, ...] = ()  # its own DraftConfig fields (None in every other format's drafts)
    read: Callable[[Mapping, Callable], dict] = lambda d, key: {}
    check: Callable[[Any], None] = lambda cfg: None
    shifted: bool = False  # every block slot predicts the next position, the anchor's too: B inputs propose B
    own_embeddings: bool = False  # its own frozen ``embed_tokens`` / ``lm_head`` instead of the target's
    convolves: bool = False  # DFlash2's dynamic convolutions around each sublayer and its candidate selector
    full_attention: bool = False  # its layers are full bidirectional attention whatever config.json says
    trainable: bool = False  # ``python -m train`` builds, trains and exports it


def _write_dflash(cfg, out: dict) -> dict:
    """The released DFlash layout: ``dflash_config`` holding the block-diffusion keys (optional ones only when they
    differ from their defaults, so older readers that know none of them read the same draft)."""
    arch = cfg.format.architectures[0]
    out["architectures"] = [arch]
    out["model_type"] = "qwen3"
    dflash = {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)}
    if cfg.input_embedding_scale != 1.0:
        dflash["input_embedding_scale"] = cfg.input_embedding_scale
    if cfg.output_multiplier != 1.0:
        dflash["output_multiplier"] = cfg.output_multiplier
    if cfg.final_logit_softcapping is not None:
        dflash["final_logit_softcapping"] = cfg.final_logit_softcapping
    dflash.update({k: getattr(cfg, k) for k in cfg.format.fields})
    out["dflash_config"] = dflash
    if cfg.is_causal is not None:
        out["is_causal"] = cfg.is_causal
    if cfg.target_hidden_size is not None:
        out["target_hidden_size"] = cfg.target_hidden_size
    out["auto_map"] = {"AutoModel": f"dflash.{arch}"}
    return out


def _read_dflash2(d: Mapping, key) -> dict:
    return {k: int(key(k, v)) for k, v in DFLASH2_DEFAULTS.items()}


def _check_dflash2(cfg) -> None:
    bad = {k: getattr(cfg, k) for k in DFLASH2_DEFAULTS if getattr(cfg, k) is None or getattr(cfg, k) < 1}
    if bad:
        raise ValueError(f"a DFlash2 draft needs {', '.join(bad)} >= 1, got {bad}")
    if cfg.layers.hidden_size % cfg.conv_group_size:
        raise ValueError(f"conv_group_size {cfg.conv_group_size} does not divide hidden_size {cfg.layers.hidden_size}")


def _read_dspark(d: Mapping, key) -> dict:
    """DeepSpec writes its keys at the top level; its defaults and spellings made explicit."""
    extra = {field: d.get(k) for k, field in DSPARK_KEYS.items()}
    extra["markov_rank"] = int(extra["markov_rank"] or 0)
    extra["confidence_head"] = bool(extra["confidence_head"])
    # the head reads [h; W1[x]]: without a Markov head (rank 0) W1[x] is empty and it reads h alone
    with_markov = extra["confidence_with_markov"]
    extra["confidence_with_markov"] = (None if not extra["confidence_head"] else
                                       bool(extra["markov_rank"]) and (with_markov is None or bool(with_markov)))
    if not extra["markov_rank"]:
        extra["markov_head_type"] = None
    elif extra["markov_head_type"] is None:
        extra["markov_head_type"] = "vanilla"
    else:  # DeepSpec lower-cases it
        extra["markov_head_type"] = str(extra["markov_head_type"]).lower()
    if extra["num_anchors"] is not None:
        extra["num_anchors"] = int(extra["num_anchors"])
    return extra


def _check_dspark(cfg) -> None:
    if cfg.markov_rank is None or cfg.markov_rank < 0:
        raise ValueError(f"a DSpark draft needs markov_rank >= 0, got {cfg.markov_rank!r}")
    if cfg.markov_rank and cfg.markov_head_type not in MARKOV_HEAD_TYPES:
        raise ValueError(f"markov_head_type must be one of {', '.join(MARKOV_HEAD_TYPES)}, "
                         f"got {cfg.markov_head_type!r}")
    if cfg.confidence_head is None:
        raise ValueError("a DSpark draft needs enable_confidence_head (true or false)")
    if cfg.confidence_with_markov and not cfg.markov_rank:
        raise ValueError("confidence_head_with_markov needs a Markov head (markov_rank > 0)")
    n = cfg.layers.num_hidden_layers
    if any(cfg.layer_causal(i) or cfg.layers.layer_window(i) for i in range(n)):
        raise ValueError("DSpark draft layers are full, bidirectional attention (no causal or sliding layers)")
    types = sorted({s.model_type for s in stacks().values()})
    if cfg.layers.model_type not in types:
        raise ValueError(f"a DSpark draft's layers are one of {types}, got {cfg.layers.model_type!r}")


def _write_dspark(cfg, out: dict) -> dict:
    """DeepSpec's layout (``build_draft_config``): its keys at the top level, no ``dflash_config``; the optional ones
    only where DeepSpec writes them (the head type with a Markov head, the confidence head's input with that head),
    plus what the layer stack's family writes (Gemma 4: the target's model types, the logit soft cap)."""
    stack = cfg.stack
    out.update(architectures=[stack.architecture], model_type=stack.model_type)
    out.update(stack.hf_keys(cfg))
    out.update(tie_word_embeddings=False, mask_token_id=cfg.mask_token_id,
               target_layer_ids=list(cfg.target_layer_ids), markov_rank=cfg.markov_rank,
               enable_confidence_head=cfg.confidence_head)
    if cfg.markov_rank:
        out["markov_head_type"] = cfg.markov_head_type
    if cfg.confidence_head:
        out["confidence_head_with_markov"] = cfg.confidence_with_markov
    out["num_anchors"] = 512 if cfg.num_anchors is None else cfg.num_anchors  # DeepSpec's model requires it
    return out


FORMATS = {f.name: f for f in (
    DraftFormat("dflash", "DFlash", ("DFlashDraftModel",), _write_dflash, trainable=True),
    DraftFormat("dflash2", "DFlash2", ("DFlash2DraftModel",), _write_dflash, fields=tuple(DFLASH2_DEFAULTS),
                read=_read_dflash2, check=_check_dflash2, convolves=True),
    DraftFormat("dspark", "DSpark", ("Qwen3DSparkModel",), _write_dspark, fields=tuple(DSPARK_KEYS.values()),
                read=_read_dspark, check=_check_dspark, shifted=True, own_embeddings=True, full_attention=True,
                trainable=True),
)}


def stacks() -> dict[str, DraftStack]:
    """DSpark architecture -> its layer stack: Qwen3 layers, then the stacks families bring (Gemma 4's)."""
    return {QWEN3_STACK.architecture: QWEN3_STACK, **draft_stacks()}


def architecture_formats() -> dict[str, DraftFormat]:
    """config.json architecture -> the format it names (a family's layer stack names a DSpark draft)."""
    named = {a: f for f in FORMATS.values() for a in f.architectures}
    return {**named, **{a: FORMATS["dspark"] for a in stacks()}}
