"""Tiny target + draft pairs for engine tests (random weights; no network)."""
from __future__ import annotations

import dataclasses

from dflash_jax.config import DraftConfig, TargetConfig
from dflash_jax.draft import Draft, init_draft_params
from dflash_jax.target import Target, init_params


def tiny_target_config(vocab: int = 96, layers: int = 4, **kw) -> TargetConfig:
    base = dict(model_type="qwen3", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                eos_token_id=(1,))
    return TargetConfig(**{**base, **kw})


def random_pair(vocab: int = 96, block_size: int = 16, seed: int = 0, draft_layers: int = 2,
                target_layer_ids=(0, 2, 3), **target_kw) -> tuple[Target, Draft]:
    tcfg = tiny_target_config(vocab, **target_kw)
    dlayers = dataclasses.replace(tcfg, num_hidden_layers=draft_layers, layer_types=())
    dcfg = DraftConfig(layers=dlayers, block_size=block_size, num_target_layers=tcfg.num_hidden_layers,
                       mask_token_id=vocab - 1, target_layer_ids=tuple(target_layer_ids))
    return Target(tcfg, init_params(tcfg, seed)), Draft(dcfg, init_draft_params(dcfg, seed + 1))
