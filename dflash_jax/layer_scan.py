"""Scanned layers (``TargetConfig.scan_layers``): consecutive layers of one kind run as one ``nn.scan``, so a program
compiles one layer body per run instead of one per layer (compile time no longer grows with depth).

A family declares what makes its layers differ (``Family.layer_kinds``); ``runs`` groups equal neighbours. A run's
parameters are stacked on a leading layer axis under ``layers_{first}_{last}`` (a lone layer keeps ``layers_{i}``):
checkpoints are read and written per layer (``stack_params`` / ``unstack_params`` around the one name table). Its
decode state is one ``state.Stacked`` (``group_specs``), read and written in place through the scan's carry.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.state import StackedSpec


def runs(kinds) -> tuple[tuple[int, int], ...]:
    """(first layer, count) of each run of consecutive equal ``kinds`` (one per layer)."""
    out: list[list[int]] = []
    for i, kind in enumerate(kinds):
        if out and kinds[out[-1][0]] == kind:
            out[-1][1] += 1
        else:
            out.append([i, 1])
    return tuple((first, count) for first, count in out)


def group_name(first: int, count: int) -> str:
    """A run's parameter name: ``layers_{i}`` alone (Hugging Face's per-layer name), ``layers_{first}_{last}``."""
    return f"layers_{first}" if count == 1 else f"layers_{first}_{first + count - 1}"


def group_specs(specs, groups) -> tuple:
    """Per-layer state specs -> one per run (``StackedSpec`` for a run of several layers)."""
    return tuple(specs[first] if count == 1 else StackedSpec(specs[first], count) for first, count in groups)


def stack_params(params: dict, groups) -> dict:
    """Per-layer parameters (``layers_{i}``, as checkpoints name them; numpy arrays stay on the host) -> the scanned
    layout."""
    def stack(*a):
        return np.stack(a) if isinstance(a[0], np.ndarray) else jnp.stack(a)

    out = {k: v for k, v in params.items() if not k.startswith("layers_")}
    for first, count in groups:
        layers = [params[f"layers_{i}"] for i in range(first, first + count)]
        out[group_name(first, count)] = layers[0] if count == 1 else {
            "layer": jax.tree_util.tree_map(stack, *layers)}
    return out


def unstack_params(params: dict, groups) -> dict:
    """``stack_params`` undone (for export and per-layer tools)."""
    out = {k: v for k, v in params.items() if not k.startswith("layers_")}
    for first, count in groups:
        group = params[group_name(first, count)]
        for j in range(count):
            out[f"layers_{first + j}"] = group if count == 1 else jax.tree_util.tree_map(lambda a: a[j],
                                                                                           group["layer"])
    return out


class ScanStep(nn.Module):
    """One step of a run's scan: layer ``index + j`` (``layer_class`` built for the run's first layer: every layer of
    a run is of one kind) on the carried activations, its state read from and written back to the run's
    ``Stacked`` state, its output kept in the carried feature buffer's slot ``slot`` (the last slot: not kept)."""

    layer_class: type
    cfg: object
    index: int
    attention_impl: str = "auto"

    def setup(self):
        self.layer = self.layer_class(self.cfg, self.index, self.attention_impl)

    def __call__(self, carry, xs, positions, segment_ids, new_mask):
        x, picked, group = carry
        j, slot = xs
        state = None if group is None else group.layer(j)
        x, state = self.layer(x, positions, state, segment_ids, new_mask)
        if group is not None:
            group = group.put(j, state)
        if picked is not None:
            picked = jax.lax.dynamic_update_index_in_dim(picked, x.astype(picked.dtype), slot, 0)
        return (x, picked, group), None


def scanned(layer_class: type, count: int) -> type:
    """The module class of a run of ``count`` layers: ``ScanStep`` scanned, parameters stacked on axis 0 (logical
    axis ``layers``)."""
    return nn.scan(ScanStep, variable_axes={"params": 0}, split_rngs={"params": True},
                   in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast), length=count,
                   metadata_params={nn.PARTITION_NAME: "layers"})


def run(module, first: int, count: int, x, positions, state, feature_layer_ids, segment_ids, new_mask):
    """A run's scan -> (x, its new ``Stacked`` state or None, {layer: output} of the ``feature_layer_ids`` in it)."""
    wanted = [i for i in dict.fromkeys(feature_layer_ids) if first <= i < first + count]
    picked = jnp.zeros((len(wanted) + 1,) + x.shape, x.dtype) if wanted else None
    slots = jnp.asarray([wanted.index(i) if i in wanted else len(wanted) for i in range(first, first + count)],
                        jnp.int32)
    (x, picked, state), _ = module((x, picked, state), (jnp.arange(count, dtype=jnp.int32), slots), positions,
                                   segment_ids, new_mask)
    return x, state, {i: picked[n] for n, i in enumerate(wanted)}
