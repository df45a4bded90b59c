"""Scanned layers (``TargetConfig.scan_layers``): layers that repeat run as one ``nn.scan``, so a program compiles one
body per group of layers instead of one per layer (compile time no longer grows with depth).

A family declares what makes its layers differ (``Family.layer_kinds``); ``groups`` covers the layers with runs of a
repeating pattern of kinds: a run of one kind (Qwen3: every layer) or of a period of several (gpt-oss: sliding, full;
Qwen3.5: three linear-attention layers, then a full one), each scan step one period. A group's parameters are
stacked on a leading axis, per position in the period, under ``layers_{first}_{last}`` / ``layer_{k}`` (a lone layer
keeps ``layers_{i}``): checkpoints are read and written per layer (``stack_params`` / ``unstack_params`` around the
one name table). A group's decode state is one ``state.Stacked`` per position in the period (``group_specs``), read
and written in place through the scan's carry.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.state import StackedSpec

MAX_PERIOD = 8  # the longest pattern of layer kinds a group repeats


def groups(kinds) -> tuple[tuple[int, int, int], ...]:
    """(first layer, repeats, period) of each group: from each layer on, the period (<= ``MAX_PERIOD``) whose
    repeats cover the most layers (the shortest on a tie), at least two repeats; else the layer alone (1, 1)."""
    n, i, out = len(kinds), 0, []
    while i < n:
        best = (1, 1)
        for p in range(1, MAX_PERIOD + 1):
            r = 1
            while i + (r + 1) * p <= n and kinds[i + r * p:i + (r + 1) * p] == kinds[i:i + p]:
                r += 1
            if r >= 2 and r * p > best[0] * best[1]:
                best = (r, p)
        out.append((i, *best))
        i += best[0] * best[1]
    return tuple(out)


def group_name(first: int, repeats: int, period: int) -> str:
    """A group's parameter name: ``layers_{i}`` alone (Hugging Face's per-layer name), ``layers_{first}_{last}``."""
    n = repeats * period
    return f"layers_{first}" if n == 1 else f"layers_{first}_{first + n - 1}"


def group_specs(specs, layer_groups) -> tuple:
    """Per-layer state specs -> one per lone layer and per position in each group's period (``StackedSpec``)."""
    return tuple(specs[first + k] if repeats == 1 else StackedSpec(specs[first + k], repeats)
                 for first, repeats, period in layer_groups for k in range(period))


def stack_params(params: dict, layer_groups) -> dict:
    """Per-layer parameters (``layers_{i}``, as checkpoints name them; numpy arrays stay on the host) -> the scanned
    layout."""
    def stack(*a):
        return np.stack(a) if isinstance(a[0], np.ndarray) else jnp.stack(a)

    out = {k: v for k, v in params.items() if not k.startswith("layers_")}
    for first, repeats, period in layer_groups:
        if repeats == 1:
            out[group_name(first, 1, 1)] = params[f"layers_{first}"]
            continue
        out[group_name(first, repeats, period)] = {f"layer_{k}": jax.tree_util.tree_map(
            stack, *[params[f"layers_{first + k + j * period}"] for j in range(repeats)]) for k in range(period)}
    return out


def unstack_params(params: dict, layer_groups) -> dict:
    """``stack_params`` undone (for export and per-layer tools)."""
    out = {k: v for k, v in params.items() if not k.startswith("layers_")}
    for first, repeats, period in layer_groups:
        group = params[group_name(first, repeats, period)]
        if repeats == 1:
            out[f"layers_{first}"] = group
            continue
        for j in range(repeats):
            for k in range(period):
                out[f"layers_{first + k + j * period}"] = jax.tree_util.tree_map(lambda a: a[j], group[f"layer_{k}"])
    return out


class ScanStep(nn.Module):
    """One step of a group's scan: one period of layers (``layer_class`` built for the group's first period: every
    repeat is of the same kinds) on the carried activations, each layer's state read from and written back to its
    position's ``Stacked`` state, its output kept in the carried feature buffer's slot (the last slot: not kept).
    A family whose layers take more than the dense ones overrides ``apply`` (Gemma 4: per-layer inputs)."""

    layer_class: type
    cfg: object
    first: int
    period: int
    attention_impl: str = "auto"

    def setup(self):
        self.layer = [self.layer_class(self.cfg, self.first + k, self.attention_impl) for k in range(self.period)]

    def apply(self, layer, x, positions, state, segment_ids, new_mask, inputs):
        """One layer of the period -> (x, its new state); ``inputs``: this layer's slice of the group's per-layer
        inputs (None: none)."""
        return layer(x, positions, state, segment_ids, new_mask)

    def __call__(self, carry, xs, positions, segment_ids, new_mask):
        x, picked, states = carry
        j, slots, inputs = xs
        new = []
        for k, layer in enumerate(self.layer):
            state = None if states is None else states[k].layer(j)
            x, state = self.apply(layer, x, positions, state, segment_ids, new_mask, None if inputs is None else inputs[k])
            new.append(None if states is None else states[k].put(j, state))
            if picked is not None:
                picked = jax.lax.dynamic_update_index_in_dim(picked, x.astype(picked.dtype), slots[k], 0)
        return (x, picked, None if states is None else tuple(new)), None


def scanned(step: type, repeats: int) -> type:
    """The module class of a group of ``repeats`` periods: ``step`` (a ``ScanStep``) scanned, parameters stacked on
    axis 0 (logical axis ``layers``)."""
    return nn.scan(step, variable_axes={"params": 0}, split_rngs={"params": True},
                   in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast), length=repeats,
                   metadata_params={nn.PARTITION_NAME: "layers"})


def run(module, first: int, repeats: int, period: int, x, positions, states, feature_layer_ids, segment_ids,
        new_mask, inputs=None):
    """A group's scan -> (x, its positions' new ``Stacked`` states or None, {layer: output} of the
    ``feature_layer_ids`` in it); ``inputs`` [B, T, L, ...]: per-layer inputs of every layer of the model (the
    group's are scanned over)."""
    layers = range(first, first + repeats * period)
    wanted = [i for i in dict.fromkeys(feature_layer_ids) if i in layers]
    picked = jnp.zeros((len(wanted) + 1,) + x.shape, x.dtype) if wanted else None
    slots = jnp.asarray([wanted.index(i) if i in wanted else len(wanted) for i in layers], jnp.int32)
    if inputs is not None:  # [B, T, r * p, ...] -> [r, p, B, T, ...]: a step's period
        inputs = inputs[:, :, first:first + repeats * period]
        inputs = jnp.moveaxis(inputs.reshape(inputs.shape[:2] + (repeats, period) + inputs.shape[3:]), (2, 3), (0, 1))
    xs = (jnp.arange(repeats, dtype=jnp.int32), slots.reshape(repeats, period), inputs)
    (x, picked, states), _ = module((x, picked, states), xs, positions, segment_ids, new_mask)
    return x, states, {i: picked[n] for n, i in enumerate(wanted)}
