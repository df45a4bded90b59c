"""The draft a training run trains: a new one's config from the flags (``build_draft_config``; DSpark and a family's
own DSpark layer stack), an ``--init-draft``'s, or the one a checkpoint resumes (``choose_draft``)."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from dflash_jax.checkpoints import resolve_dtype
from dflash_jax.drafts.config import MASK_TOKEN, DraftConfig, choose_target_layer_ids
from dflash_jax.drafts.model import Draft, check_pair, init_draft_params, load_draft
from dflash_jax.families import family_of
from dflash_jax.target import Target
from train.config import TrainConfig
from train.data import TrainData
from train.errors import TrainingError, warn
from train.resume import ResumePoints, check_resume


def default_mask_token_id(target: Target, tokenizer=None) -> int:
    """The tokenizer's ``<|MASK|>`` token when it has one, else its own mask token (Gemma 4's ``<mask>``, 4, as
    DeepSpec's Gemma 4 draft); else the first embedding row the tokenizer never produces (Qwen3: 151669, as the
    released drafts), else the pad token, else the last vocabulary id."""
    v = target.config.vocab_size
    if tokenizer is not None:
        unk = getattr(tokenizer, "unk_token_id", None)
        for mask in (tokenizer.convert_tokens_to_ids(MASK_TOKEN), getattr(tokenizer, "mask_token_id", None)):
            if isinstance(mask, int) and mask != unk and 0 <= mask < v:
                return mask
    if tokenizer is not None and len(tokenizer) < v:
        return len(tokenizer)
    if target.config.pad_token_id is not None and 0 <= target.config.pad_token_id < v:
        return int(target.config.pad_token_id)
    return v - 1


def build_draft_config(cfg: TrainConfig, target: Target, tokenizer=None) -> DraftConfig:
    """The draft ``python -m train`` makes for ``target`` (``DraftConfig.for_target``) from the flags: its
    layers, block size, target layer ids (chosen when not given), mask token, and its own attention and
    logits (``TrainConfig.draft_options``)."""
    L = target.config.num_hidden_layers
    ids = cfg.layer_ids() or choose_target_layer_ids(L, cfg.num_target_features)
    bad = [i for i in ids if not -1 <= i < L]
    if bad:
        raise ValueError(f"--target-layer-ids {list(ids)}: ids {bad} are outside the target's {L} layers "
                         f"(-1..{L - 1}, -1 the embedding output)")
    mask_id = cfg.mask_token_id if cfg.mask_token_id >= 0 else default_mask_token_id(target, tokenizer)
    dcfg = DraftConfig.for_target(target.config, draft_layers=cfg.draft_layers, block_size=cfg.block_size,
                                  mask_token_id=mask_id, target_layer_ids=ids, **cfg.draft_options())
    return dspark_config(cfg, dcfg, target.config) if cfg.dspark else dcfg


def dspark_config(cfg: TrainConfig, dcfg: DraftConfig, tcfg) -> DraftConfig:
    """The DSpark draft of the DFlash draft ``dcfg`` made from the same flags (the same layer stack, block, target
    layers and mask token; full bidirectional layers, which the flags' checks keep): its Markov and confidence
    heads from the flags, the confidence head reading the Markov embedding when there is one (DeepSpec's default),
    ``num_anchors`` kept for the export as DeepSpec writes it. A target whose family brings its own DSpark layer
    stack (Gemma 4: DeepSpec's ``Gemma4DSparkModel``) gets that stack instead of Qwen3 layers (``DraftStack.
    for_target``). DraftConfig checks the result."""
    for stack in family_of(tcfg).draft_stacks:
        if stack.for_target is not None:
            layers, fields = stack.for_target(tcfg, dcfg.layers.num_hidden_layers)
            dcfg = dataclasses.replace(dcfg, layers=layers, **fields)
            break
    return dataclasses.replace(dcfg, architecture="dspark", markov_rank=cfg.markov_rank,
                               markov_head_type=cfg.markov_head_type if cfg.markov_rank else None,
                               confidence_head=cfg.confidence_head,
                               confidence_with_markov=cfg.markov_rank > 0 if cfg.confidence_head else None,
                               num_anchors=cfg.num_anchors)


def with_target_copies(params, target: Target, dtype):
    """A new DSpark draft's params with ``embed_tokens`` / ``lm_head`` copied from the target (a tied target's head
    is its embedding, transposed), as DeepSpec initialises them; they stay frozen."""
    tp = target.params
    if "embed_tokens" not in tp:
        raise TrainingError(f"the target ({target.config.model_type}) keeps no plain embed_tokens table for a DSpark "
                            "draft to copy")
    emb = tp["embed_tokens"]["embedding"]
    head = tp["lm_head"]["kernel"] if "lm_head" in tp else emb.T
    # copies, not views: the step donates the draft's buffers, and the target's must survive it
    return dict(params, embed_tokens={"embedding": jnp.array(emb, dtype, copy=True)},
                lm_head={"kernel": jnp.array(head, dtype, copy=True)})


# The flags of TrainConfig.draft_options, by DraftConfig.for_target keyword
_DRAFT_OPTION_FLAGS = {"layer_types": "--draft-sliding-layers", "sliding_window": "--draft-sliding-window",
                       "is_causal": "--draft-causal", "input_embedding_scale": "--draft-embedding-scale",
                       "output_multiplier": "--draft-output-multiplier",
                       "final_logit_softcapping": "--draft-logit-softcap"}


def _draft_options_of(dcfg: DraftConfig) -> dict:
    """An existing draft's values of ``TrainConfig.draft_options`` (what an --init-draft fixes)."""
    layers = dcfg.layers
    return {"layer_types": layers.layer_types if "sliding_attention" in layers.layer_types else None,
            "sliding_window": layers.sliding_window, "is_causal": dcfg.is_causal,
            "input_embedding_scale": dcfg.input_embedding_scale, "output_multiplier": dcfg.output_multiplier,
            "final_logit_softcapping": dcfg.final_logit_softcapping}


def _ignored_draft_flags(cfg: TrainConfig, dcfg: DraftConfig) -> list[str]:
    """The draft-architecture flags whose values ``dcfg`` (an --init-draft's config, which wins) does not have."""
    flags = [f for f, ours, theirs in (("--block-size", cfg.block_size, dcfg.block_size),
                                       ("--draft-layers", cfg.draft_layers, dcfg.layers.num_hidden_layers),
                                       ("--draft-arch", cfg.draft_arch, dcfg.architecture))
             if ours != theirs]
    if dcfg.shifted:
        theirs = {"markov_rank": dcfg.markov_rank, "confidence_head": dcfg.confidence_head}
        if dcfg.markov:
            theirs["markov_head_type"] = dcfg.markov_head_type
        flags += [f"--{k.replace('_', '-')}" for k, v in theirs.items() if getattr(cfg, k) != v]
    ours, theirs = cfg.draft_options(), _draft_options_of(dcfg)
    return flags + [flag for k, flag in _DRAFT_OPTION_FLAGS.items() if ours[k] != theirs[k]]


def init_draft(cfg: TrainConfig) -> Draft:
    """The --init-draft to start from (DFlash v1 or DSpark); warns about the architecture flags it overrides."""
    init = load_draft(cfg.init_draft, dtype=cfg.param_dtype)
    dcfg = init.config
    if dcfg.convolves:
        raise TrainingError(f"--init-draft {cfg.init_draft} is a DFlash2 draft (DFlash2DraftModel): DFlash2 "
                            "drafts can be loaded and served but not trained here, because the training recipe "
                            "of their candidate selector is not public; start from a DFlash (DFlashDraftModel) "
                            "draft or train a new one")
    ignored = _ignored_draft_flags(cfg, dcfg)
    if ignored:
        sliding = [i for i, t in enumerate(dcfg.layers.layer_types) if t == "sliding_attention"]
        warn(f"--init-draft {cfg.init_draft} fixes the architecture: block_size {dcfg.block_size}, "
                      f"{dcfg.layers.num_hidden_layers} layers, target_layer_ids {list(dcfg.target_layer_ids)}, "
                      f"sliding layers {sliding} (window {dcfg.layers.sliding_window}), is_causal "
                      f"{dcfg.is_causal}, input_embedding_scale {dcfg.input_embedding_scale}, output_multiplier "
                      f"{dcfg.output_multiplier}, final_logit_softcapping {dcfg.final_logit_softcapping} "
                      f"(the {' / '.join(ignored)} given are ignored)")
    return init


def choose_draft(cfg: TrainConfig, target: Target, tokenizer, data: TrainData, points: ResumePoints):
    """(cfg, draft config, initial params or None when resuming): the checkpoint's draft, --init-draft's, or a
    new one from the flags; checked against the target."""
    param_dtype = resolve_dtype(cfg.param_dtype)
    params = None
    if points.latest is not None:
        points.latest, meta = points.readable_meta()
        check_resume(meta, cfg, data)
        dcfg = DraftConfig.from_hf(meta["draft_config"])
        dcfg.check_fits(target.config)
    else:
        if cfg.init_draft:
            init = init_draft(cfg)
            dcfg, params = init.config, init.params
        else:
            dcfg = build_draft_config(cfg, target, tokenizer)
            params = init_draft_params(dcfg, cfg.seed, param_dtype)
            if dcfg.own_embeddings:
                params = with_target_copies(params, target, param_dtype)
        check_pair(target, Draft(dcfg, params))
    if dcfg.block_size != cfg.block_size:
        cfg = cfg.replace(block_size=dcfg.block_size)
    return cfg, dcfg, params
