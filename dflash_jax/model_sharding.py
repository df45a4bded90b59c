"""Model-aware sharding, beside the target and the draft it reads: parameter shardings from a target's or a
draft's logical axes, sharding a loaded model, and loading a checkpoint straight onto a mesh (each device
receives only its slice). ``dflash_jax.sharding`` itself knows only meshes, rules and placement."""
from __future__ import annotations

import dataclasses
from typing import Callable

import flax.linen as nn
import jax
import numpy as np
from flax import traverse_util
from flax.core import unfreeze
from jax.sharding import Mesh, NamedSharding

from dflash_jax.drafts import model as draft_lib
from dflash_jax import target as target_lib
from dflash_jax.checkpoints import resolve_path
from dflash_jax.drafts import DraftConfig
from dflash_jax.families import config_from_hf, family_of
from dflash_jax.sharding.placement import shard_params
from dflash_jax.sharding.rules import LOGICAL_RULES, logical_to_mesh, rules_for


def _lib(cfg):
    """The module that builds ``cfg``'s model: the draft, or the (family-dispatching) target."""
    return draft_lib if isinstance(cfg, DraftConfig) else target_lib


def model_rules(mesh: Mesh, *models) -> tuple:
    """``rules_for`` over the global table plus the target families' own rules."""
    extra = tuple(r for m in models for c in [getattr(m, "config", m)] if not isinstance(c, DraftConfig)
                  for r in family_of(c).logical_rules)
    return rules_for(mesh, *models, rules=LOGICAL_RULES + extra)


def param_logical_axes(model):
    """Tree (like the params) of logical PartitionSpecs, read from the model's boxed abstract init."""
    cfg = getattr(model, "config", model)
    return nn.get_partition_spec(_lib(cfg).abstract_variables(cfg))


def param_shardings(model, mesh: Mesh, rules=None, params=None):
    """Tree of NamedShardings for the params of ``model`` (a Target/Draft or its config) on ``mesh``.

    ``rules`` default: ``model_rules(mesh, model)`` (heads checked, KV-head fallback). ``params`` (arrays
    or ShapeDtypeStructs) gives the shapes when they are at hand; otherwise they come from the config.
    """
    rules = model_rules(mesh, model) if rules is None else rules
    cfg = getattr(model, "config", model)
    logical = param_logical_axes(cfg)
    if params is None:
        params = getattr(model, "params", None)
    shapes = nn.meta.unbox(_lib(cfg).abstract_variables(cfg)) if params is None else params
    flat_l = traverse_util.flatten_dict(unfreeze(logical))
    flat_s = traverse_util.flatten_dict(unfreeze(shapes))
    if set(flat_l) != set(flat_s):
        raise ValueError(f"params do not match the model's structure: missing {sorted(set(flat_l) - set(flat_s))[:3]}"
                         f", unexpected {sorted(set(flat_s) - set(flat_l))[:3]}")
    out = {k: NamedSharding(mesh, logical_to_mesh(tuple(flat_l[k]), flat_s[k].shape, mesh, rules)) for k in flat_l}
    return traverse_util.unflatten_dict(out)


def shard_target(target, mesh: Mesh, rules=None):
    """The same Target with params on ``mesh`` (tensor-parallel per the rules)."""
    shardings = param_shardings(target, mesh, rules)
    return dataclasses.replace(target, params=shard_params(target.params, shardings))


def shard_draft(draft, mesh: Mesh, rules=None):
    shardings = param_shardings(draft, mesh, rules)
    return dataclasses.replace(draft, params=shard_params(draft.params, shardings))


def placer(model_config, mesh: Mesh, rules=None) -> Callable[[tuple, np.ndarray], jax.Array]:
    """``place(path, host_array)`` for ``load_target`` / ``load_draft``: each tensor goes straight onto
    its shards (each device receives only its slice; no full copy on any device)::

        mesh = make_mesh("data=2,tensor=4")
        cfg = config_from_hf(path)
        target = load_target(path, place=placer(cfg, mesh))
    """
    flat = traverse_util.flatten_dict(unfreeze(param_shardings(model_config, mesh, rules)))

    def place(path, array):
        path = tuple(path)
        if path not in flat:
            raise KeyError(f"no sharding for parameter {'/'.join(path)}")
        return jax.make_array_from_callback(array.shape, flat[path], lambda idx: np.asarray(array[idx]))

    return place


def load_sharded(target_path, draft_path, mesh: Mesh, dtype="float32", scan_layers: bool = False):
    """(target, draft or None) loaded straight onto ``mesh`` (heads checked on both before any read);
    ``scan_layers``: the target's layers scanned (``target.scanned``), placed stacked."""
    tpath = resolve_path(target_path)
    tcfg = dataclasses.replace(config_from_hf(tpath), scan_layers=scan_layers)
    dpath = resolve_path(draft_path) if draft_path else None
    dcfg = DraftConfig.from_hf(dpath) if dpath else None
    rules = model_rules(mesh, tcfg, *([dcfg] if dcfg else []))
    target = target_lib.load_target(tpath, dtype=dtype, place=placer(tcfg, mesh, rules), scan_layers=scan_layers)
    draft = draft_lib.load_draft(dpath, dtype=dtype, place=placer(dcfg, mesh, rules)) if dpath else None
    return target, draft
