"""Pallas kernels per shard: a Pallas call is opaque to XLA's partitioner (it would gather its operands and
run the whole global batch on every device), so on a mesh the attention kernels run inside ``jax.shard_map``
over the mesh axes their operands are split on, each device calling the kernel on its own shard.

The split of each operand comes from its logical axes through the rules table (``rules.LOGICAL_RULES``:
rows over data*fsdp, heads over tensor); the mesh is the trace's abstract mesh (``mesh_scope`` inside a
trace, or ``jax.set_mesh`` around the call). Without one, or on one device, the kernel is called as is.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Callable, Sequence

import jax
from jax.sharding import AxisType, PartitionSpec as P

from dflash_jax.sharding.rules import LOGICAL_RULES, logical_to_mesh

log = logging.getLogger(__name__)
_said: set[str] = set()


def mesh_scope(mesh):
    """``with mesh_scope(mesh):`` inside a trace makes ``mesh`` the abstract mesh the per-shard kernels split
    over (a no-op for None)."""
    return contextlib.nullcontext() if mesh is None else jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def trace_mesh():
    """The trace's abstract mesh when it has more than one device and no manual axes (not already inside a
    shard_map), else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1 or AxisType.Manual in mesh.axis_types:
        return None
    return mesh


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        log.warning(message)


def _heads_axes(spec: P, dim: int = 2) -> tuple[str, ...]:
    axes = tuple(spec)[dim] if len(spec) > dim else None
    return (axes,) if isinstance(axes, str) else tuple(axes or ())


def _without(spec: P, axes: tuple[str, ...]) -> P:
    """``spec`` with the mesh ``axes`` dropped from every dimension (those dimensions replicated over them)."""
    def keep(d):
        left = tuple(a for a in ((d,) if isinstance(d, str) else tuple(d or ())) if a not in axes)
        return None if not left else left[0] if len(left) == 1 else left

    return P(*(keep(d) for d in spec))


def attention_per_shard(kernel: Callable, args: Sequence, names: Sequence, *, what: str, rules=LOGICAL_RULES):
    """``kernel(*args)`` on each shard of the trace's mesh, each arg split as its logical ``names`` say (None
    args pass through). ``args[0]`` is the queries [B, T, Hq, D] (the output [B, T, Hq, Dv] has their layout),
    ``args[1]`` the keys [.., Hkv, D] (rows [B, S, ...], a pool [P, page, ...], a scanned stack [B, n, S,
    ...]). Heads that cannot split alike (KV heads replicated while the query
    heads split, as with fewer KV heads than the tensor axis; one KV head is fine) are not split at all:
    every device of a row shard runs all heads (said once in the log)."""
    mesh = trace_mesh()
    if mesh is None:
        return kernel(*args)
    specs = [None if a is None else logical_to_mesh(n, a.shape, mesh, rules) for a, n in zip(args, names)]
    q_heads, kv_heads = _heads_axes(specs[0]), _heads_axes(specs[1], args[1].ndim - 2)
    if q_heads != kv_heads and not (not kv_heads and args[1].shape[-2] == 1):
        _say_once(f"{what}: {args[0].shape[2]} query heads and {args[1].shape[-2]} KV heads do not split alike "
                  f"over the mesh {dict(mesh.shape)}; the kernel runs every head on each device of a row shard")
        specs = [None if s is None else _without(s, q_heads + kv_heads) for s in specs]
    present = [i for i, a in enumerate(args) if a is not None]

    def local(*xs):
        full = list(args)
        for i, x in zip(present, xs):
            full[i] = x
        return kernel(*full)

    return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs[i] for i in present), out_specs=specs[0],
                         check_vma=False)(*(args[i] for i in present))
