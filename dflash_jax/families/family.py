"""``Family``: what a target family module declares (see ``dflash_jax/families/__init__.py``); ``DraftStack``: a
draft layer stack a family brings with it."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from dflash_jax.checkpoints import NameTable


@dataclasses.dataclass(frozen=True)
class DraftStack:
    """A DSpark draft layer stack of a family's own layers (DeepSpec's ``Gemma4DSparkModel``): the draft
    ``architecture`` naming it, its layers' ``model_type``, their config read from the draft's config.json
    (``layers``), the draft layer module (``layer``, built as ``layer(layers_config, index, draft=draft_config)``,
    called as ``dflash_jax.drafts``' shared draft layer), whether the draft's own embedding is scaled by sqrt(hidden),
    the keys an export writes beside the draft's (``hf_keys(draft_config)``), and how a new draft for a target of the
    family is made (``for_target(target_config, num_layers) -> (layers config, DraftConfig fields)``: the trainer's
    DSpark drafts of such a target take this stack)."""

    architecture: str
    model_type: str
    layers: Callable[[dict], Any]
    layer: type | None  # None: the shared draft layer (a Qwen3 layer)
    scaled_embedding: bool = False
    hf_keys: Callable[[Any], dict] = lambda draft: {}
    for_target: Callable[[Any, int], tuple[Any, dict]] | None = None


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    config: type  # frozen dataclass: from_hf(dict) -> config, to_hf() -> dict
    # Flax module class, built as decoder(config, attention_impl); called as (input_ids, positions, cache=None,
    # feature_layer_ids=(), logits_index=None, segment_ids=None, new_mask=None) -> (logits, features, cache)
    decoder: type
    checkpoint: Callable[[Any], NameTable]  # config -> its HF tensor-name table
    state_specs: Callable[[Any], tuple]  # config -> one decode-state spec per layer (dflash_jax.state)
    logical_rules: tuple[tuple[str, Any], ...] = ()  # extra logical-axis rules (added to the sharding table)
    draft_stacks: tuple[DraftStack, ...] = ()  # draft layer stacks of this family's layers
    # config -> one kind per layer: a repeating pattern of kinds runs as one scan with ``scan_layers`` (``layer_scan``);
    # None: this family's layers are not scanned yet
    layer_kinds: Callable[[Any], tuple] | None = None
