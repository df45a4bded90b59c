"""``Family``: what a target family module declares (see ``dflash_jax/families/__init__.py``)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from dflash_jax.checkpoints import NameTable


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
