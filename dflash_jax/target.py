"""The target model, family-independent: load, save, forward (logits + selected-layer features), caches.

Everything here goes through the family registry (``dflash_jax.families``), so the engine, the draft
and the trainer work for any registered ``model_type`` without knowing its layers.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from dflash_jax import layer_scan
from dflash_jax.checkpoints import export_params, load_params, resolve_path, save_safetensors
from dflash_jax.families import config_from_hf, family_of
from dflash_jax.layers import random_params
from dflash_jax.state import LayerStates


def decoder(cfg, attention_impl: str = "auto") -> nn.Module:
    """The family's Flax decoder for ``cfg`` (``attention_impl``: its decode attention, see ``forward``)."""
    if cfg.scan_layers:
        return family_of(cfg).decoder(cfg, attention_impl, groups=layer_groups(cfg))
    return family_of(cfg).decoder(cfg, attention_impl)


def layer_groups(cfg) -> tuple[tuple[int, int, int], ...]:
    """(first layer, repeats, period) of each group of layers that scans as one (``cfg.scan_layers``;
    ``layer_scan.groups``); every layer alone without it. An error for a family whose layers do not scan yet."""
    kinds = family_of(cfg).layer_kinds
    if not cfg.scan_layers:
        return tuple((i, 1, 1) for i in range(cfg.num_hidden_layers))
    if kinds is None:
        raise ValueError(f"scanned layers are not built for the {family_of(cfg).name} family yet "
                         f"(model_type {cfg.model_type!r}): leave scan_layers off")
    return layer_scan.groups(kinds(cfg))


def state_specs(cfg) -> tuple:
    """One decode-state spec per layer; scanned, per lone layer and per position of a group's period
    (``layer_scan.group_specs``)."""
    specs = family_of(cfg).state_specs(cfg)
    return layer_scan.group_specs(specs, layer_groups(cfg)) if cfg.scan_layers else specs


def scanned(target: "Target", scan: bool = True) -> "Target":
    """The target with its layers scanned (``scan`` True: repeating layers compiled as one, parameters stacked;
    ``layer_scan``) or unrolled (False); the same target if it already is."""
    cfg = target.config
    if cfg.scan_layers == scan:
        return target
    new = dataclasses.replace(cfg, scan_layers=scan)
    params = (layer_scan.stack_params(target.params, layer_groups(new)) if scan else
              layer_scan.unstack_params(target.params, layer_groups(cfg)))
    return Target(new, params, target.path)


@dataclasses.dataclass(frozen=True, eq=False)
class Target:
    """A loaded target: config + parameter pytree (+ the checkpoint directory, for its tokenizer)."""

    config: Any
    params: Any
    path: str | None = None

    def new_cache(self, batch: int, max_len: int, dtype=None, max_block: int = 16) -> LayerStates:
        """Empty decode state of every layer; ``max_block``: the most tokens of a forward that may be rolled back."""
        dtype = dtype or jax.tree_util.tree_leaves(self.params)[0].dtype
        return new_cache(self.config, batch, max_len, dtype, max_block)


def new_cache(cfg, batch: int, max_len: int, dtype, max_block: int = 16, page: int = 0) -> LayerStates:
    """``page`` > 0: full-attention layers paged (``LayerStates.join_pages`` gives them pools)."""
    return LayerStates.create(state_specs(cfg), batch, max_len, dtype, max_block, page)


def abstract_variables(cfg):
    """The decoder's boxed variables as ShapeDtypeStructs (shapes + logical axes; nothing allocated)."""
    def init(key):
        return decoder(cfg).init(key, jnp.zeros((1, 2), jnp.int32), jnp.arange(2)[None])

    return jax.eval_shape(init, jax.ShapeDtypeStruct((2,), jnp.uint32))["params"]


def param_shapes(cfg):
    """ShapeDtypeStructs of every parameter."""
    return nn.meta.unbox(abstract_variables(cfg))


def init_params(cfg, seed: int = 0, dtype=jnp.float32):
    """Random parameters (the library's initialisers), e.g. for tests and pretraining from scratch."""
    return random_params(param_shapes(cfg), seed, dtype=dtype)


# positional through logits_index: the decoder's own argument order (the engine passes them so); the rest by name
@functools.partial(jax.jit, static_argnames=("cfg", "feature_layer_ids", "attention_impl"))
def forward(cfg, params, input_ids, positions, cache=None, feature_layer_ids=(), logits_index=None, *,
            segment_ids=None, attention_impl: str = "auto", new_mask=None):
    """The family decoder's forward: (logits float32, features or None, cache); see ``dense.Decoder``
    (``new_mask``: tree verification).
    ``attention_impl``: how decode / verify forwards attend to a full-attention cache
    (``attention.decode_attention``: "auto", "kernel", "interpret", "loop"; "reference" = dense, unbounded)."""
    return decoder(cfg, attention_impl).apply({"params": params}, input_ids, positions, cache, feature_layer_ids,
                                              logits_index, segment_ids, new_mask)


def embed(cfg, params, ids):
    """Token embeddings [.., D] (the draft embeds its blocks with the target's table)."""
    return decoder(cfg).apply({"params": params}, ids, method="embed")


def head(cfg, params, h):
    """Float32 logits of final-normed hidden states (the draft predicts through the target's head)."""
    return decoder(cfg).apply({"params": params}, h, method="head")


def logits(cfg, params, h):
    """The target's own float32 logits of final-normed hidden states: ``head`` plus any transform of its family
    (a soft cap); a DSpark draft's training target distribution."""
    return decoder(cfg).apply({"params": params}, h, method="logits")


def load_target(path_or_hub_id, dtype="float32", place=None, scan_layers: bool = False) -> Target:
    """Load a Hugging Face checkpoint of any supported family (directory or hub id); ``scan_layers``: see
    ``scanned`` (the checkpoint is read per layer, then stacked, then placed)."""
    path = resolve_path(path_or_hub_id)
    cfg = config_from_hf(path)
    if not scan_layers:
        return Target(cfg, load_params(path, param_shapes(cfg), family_of(cfg).checkpoint(cfg), dtype=dtype,
                                       place=place), path)
    cfg = dataclasses.replace(cfg, scan_layers=True)
    groups = layer_groups(cfg)  # a family that does not scan fails here, before reading
    params = load_params(path, param_shapes(dataclasses.replace(cfg, scan_layers=False)),
                         family_of(cfg).checkpoint(cfg), dtype=dtype, place=lambda k, a: a)  # on the host
    place = place or (lambda k, a: jnp.asarray(a))
    flat = traverse_util.flatten_dict(layer_scan.stack_params(params, groups))
    return Target(cfg, traverse_util.unflatten_dict({k: place(k, v) for k, v in flat.items()}), path)


def save_target(target: Target, out_dir: str, dtype=None) -> str:
    """Write ``config.json`` + ``model.safetensors`` in the Hugging Face layout of the target's family."""
    os.makedirs(out_dir, exist_ok=True)
    hf = target.config.to_hf()
    if dtype is not None:
        hf["torch_dtype"] = hf["dtype"] = str(np.dtype(jnp.dtype(dtype)))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    target = scanned(target, False)  # checkpoints name layers one by one
    table = family_of(target.config).checkpoint(target.config)
    save_safetensors(os.path.join(out_dir, "model.safetensors"), export_params(target.params, table, dtype))
    return out_dir


def check_token_ids(ids, vocab_size: int, what: str = "input_ids"):
    """[B, T] int32 ids, or a clear error: wrong rank, empty, or ids outside the vocabulary."""
    ids = np.asarray(ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[1] == 0:
        raise ValueError(f"{what} must be a non-empty [batch, length] array of token ids, got shape {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{what} must be integer token ids, got dtype {ids.dtype}")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"{what} has ids outside the vocabulary [0, {vocab_size}): min {ids.min()}, max {ids.max()}")
    return ids.astype(np.int32)


def target_logits(target: Target, input_ids) -> np.ndarray:
    """Full causal forward: logits [B, T, V] float32 for token ids [B, T] at positions 0..T-1."""
    ids = check_token_ids(input_ids, target.config.vocab_size)
    positions = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)
    logits, _, _ = forward(target.config, target.params, ids, positions)
    return np.asarray(logits)
