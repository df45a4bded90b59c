"""Putting arrays on a mesh: parameters, batches (rows over data*fsdp), decode state, optimizer state;
and bringing results back to the host."""
from __future__ import annotations


import jax
import numpy as np
from flax import traverse_util
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dflash_jax.sharding.mesh import BATCH_AXES, batch_multiple, mesh_str
from dflash_jax.sharding.rules import LOGICAL_RULES, logical_fit, logical_to_mesh
from dflash_jax.state import KV_AXES, PagedKV, Stacked


def _as_dict(tree):
    return tree.unfreeze() if hasattr(tree, "unfreeze") else tree


def _put(x, sharding: NamedSharding):
    """One array onto ``sharding``; across processes each one transfers only its addressable shards."""
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    host = np.asarray(jax.device_get(x)) if isinstance(x, jax.Array) and x.is_fully_addressable else x
    if isinstance(host, jax.Array):  # already global: let jit reshard it
        return jax.jit(lambda a: a, out_shardings=sharding)(host)
    return jax.make_array_from_callback(np.shape(host), sharding, lambda idx: np.asarray(host[idx]))


def shard_params(params, shardings):
    """Put every leaf of ``params`` onto its sharding (a matching tree, e.g. from ``param_shardings``)."""
    return jax.tree_util.tree_map(_put, params, shardings)


def batch_spec(mesh: Mesh, ndim: int, batch_axis: int = 0) -> P:
    axes = tuple(a for a in BATCH_AXES if mesh.shape[a] > 1)
    spec = [None] * ndim
    if axes:
        spec[batch_axis] = axes[0] if len(axes) == 1 else axes
    return P(*spec)


def batch_sharding(mesh: Mesh, ndim: int, batch_axis: int = 0) -> NamedSharding:
    return NamedSharding(mesh, batch_spec(mesh, ndim, batch_axis))


def check_batch_rows(n: int, mesh: Mesh, what: str, scale: int = 1) -> None:
    """Raise a ValueError that says what to change unless ``n`` rows split evenly over data*fsdp."""
    m = batch_multiple(mesh) // scale
    if n % m:
        raise ValueError(f"{what} has {n} rows, not a multiple of data*fsdp = {batch_multiple(mesh)} "
                         f"({mesh_str(mesh)}{', per process' if scale > 1 else ''}); use a batch size that is a "
                         f"multiple of {m}, or a mesh with a smaller data*fsdp")


def shard_batch(tree, mesh: Mesh, batch_axis: int = 0):
    """Global host arrays (the same on every process) -> jax.Arrays split over data*fsdp along
    ``batch_axis`` (scalars and 0-d leaves are replicated)."""
    def one(x):
        x = np.asarray(x)
        if x.ndim <= batch_axis:
            return _put(x, NamedSharding(mesh, P()))
        check_batch_rows(x.shape[batch_axis], mesh, f"batch array of shape {x.shape}")
        return _put(x, batch_sharding(mesh, x.ndim, batch_axis))

    return jax.tree_util.tree_map(one, tree)


def shard_local_batch(tree, mesh: Mesh, batch_axis: int = 0):
    """Per-process host arrays (this process's ``process_slice`` of the rows) -> global jax.Arrays whose
    batch is every process's rows concatenated in process order (single process: same as ``shard_batch``)."""
    def one(x):
        x = np.asarray(x)
        n_proc = jax.process_count()
        check_batch_rows(x.shape[batch_axis] * n_proc, mesh, f"batch array of shape {x.shape} x {n_proc} processes")
        shape = list(x.shape)
        shape[batch_axis] *= n_proc
        return jax.make_array_from_process_local_data(batch_sharding(mesh, x.ndim, batch_axis), x, tuple(shape))

    return jax.tree_util.tree_map(one, tree)


def cache_spec(mesh: Mesh, kv_heads: int, rules=LOGICAL_RULES) -> P:
    """[B, S, K, H] caches (``state.KV_AXES`` through ``rules``): rows over data*fsdp, KV heads over tensor
    (replicated if they do not divide)."""
    spec = tuple(logical_to_mesh(KV_AXES, (batch_multiple(mesh), 1, kv_heads, 1), mesh, rules))
    return P(*spec + (None,) * (len(KV_AXES) - len(spec)))


def constrain_state(state, mesh: Mesh, rules=LOGICAL_RULES):
    """Inside jit: pin every array of a decode state (a layer's, or a ``LayerStates``'s own) to the layout its
    class's ``LOGICAL_AXES`` give through ``rules``; a scanned group's (``Stacked``) with its layer axis
    (``layers``) second, or first in a paged group's pools."""
    if isinstance(state, Stacked):
        inner = state.inner
        paged = isinstance(inner, PagedKV)
        axes = {f: ("layers",) + names if paged and f in ("k", "v") else
                names if paged else names[:1] + ("layers",) + names[1:]
                for f, names in type(inner).LOGICAL_AXES.items()}
        return state.replace(inner=_pin(inner, axes, mesh, rules))
    axes = getattr(type(state), "LOGICAL_AXES", None)
    if axes is None:
        raise ValueError(f"{type(state).__name__} declares no LOGICAL_AXES (the logical axes of its leaves)")

    return _pin(state, axes, mesh, rules)


def _pin(state, axes: dict, mesh: Mesh, rules):
    """``state`` with every array of each field in ``axes`` pinned to that field's logical axes."""
    def pin(names):
        return lambda x: jax.lax.with_sharding_constraint(
            x, NamedSharding(mesh, logical_to_mesh(names, x.shape, mesh, rules)))

    return state.replace(**{f: jax.tree_util.tree_map(pin(names), getattr(state, f)) for f, names in axes.items()})


def constrain_cache(cache, mesh: Mesh | None, rules=LOGICAL_RULES):
    """Inside jit: pin a LayerStates's layout: its lengths and every layer state per ``constrain_state``;
    no-op without a mesh."""
    if cache is None or mesh is None:
        return cache
    cache = constrain_state(cache, mesh, rules)
    return cache.replace(layers=tuple(constrain_state(s, mesh, rules) for s in cache.layers))


def constrain_batch(tree, mesh: Mesh | None, batch_axis: int = 0):
    """Inside jit: pin every array leaf's ``batch_axis`` to data*fsdp (other dims replicated)."""
    if mesh is None:
        return tree
    return jax.tree_util.tree_map(
        lambda x: jax.lax.with_sharding_constraint(x, batch_sharding(mesh, x.ndim, batch_axis)), tree)


def mesh_of(*trees) -> Mesh | None:
    """The mesh the arrays of ``trees`` live on (NamedSharding), None if they are plain single-device
    arrays; an error if they mix meshes or mix mesh and single-device arrays."""
    meshes, single = set(), False
    for leaf in jax.tree_util.tree_leaves(trees):
        s = getattr(leaf, "sharding", None)
        if isinstance(s, NamedSharding):
            meshes.add(s.mesh)
        elif isinstance(leaf, jax.Array):
            single = single or len(leaf.sharding.device_set) == 1
    if len(meshes) > 1:
        raise ValueError(f"arrays live on {len(meshes)} different meshes "
                         f"({', '.join(mesh_str(m) for m in meshes)}); shard every model onto the same mesh")
    if meshes and single:
        raise ValueError(f"some params are sharded on the mesh {mesh_str(next(iter(meshes)))} and some are on one "
                         "device; shard both target and draft (sharding.shard_target / shard_draft, or "
                         "placer(...) when loading)")
    return next(iter(meshes)) if meshes else None


def pad_rows(n: int, mesh: Mesh | None) -> int:
    """Rows to add so that ``n`` becomes a multiple of data*fsdp."""
    m = batch_multiple(mesh)
    return -n % m


def to_host(tree):
    """Device arrays -> numpy on this process, gathering from every process when they span several."""
    leaves = jax.tree_util.tree_leaves(tree)
    if all(not isinstance(x, jax.Array) or x.is_fully_addressable for x in leaves):
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return jax.tree_util.tree_map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), tree)


def opt_state_shardings(opt_state, params_shardings, mesh: Mesh, params=None):
    """Shardings for a tree holding param-shaped leaves somewhere inside (optimizer state: Adam's mu/nu,
    ...): a leaf whose key path ends with a parameter's path gets that parameter's sharding (dimensions
    that do not divide are replicated); everything else (step counts, scalars, factored statistics of
    another rank) is replicated. ``opt_state`` may be abstract (``jax.eval_shape(optimizer.init, params)``);
    ``params`` (arrays or shapes), when given, makes the match exact on shape too."""
    flat = traverse_util.flatten_dict(_as_dict(params_shardings))
    shapes = ({k: tuple(np.shape(v)) for k, v in traverse_util.flatten_dict(_as_dict(params)).items()}
              if params is not None else {})
    longest = max((len(k) for k in flat), default=0)

    def key_names(path):
        return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)

    def one(path, leaf):
        names, shape = key_names(path), tuple(np.shape(leaf))
        for n in range(min(longest, len(names)), 0, -1):
            s = flat.get(names[-n:])
            if s is None:
                continue
            if shapes.get(names[-n:], shape) == shape and len(s.spec) <= len(shape):
                return NamedSharding(mesh, logical_fit(s.spec, shape, mesh))
            break
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map_with_path(one, opt_state)


def abstract_like(tree, shardings):
    """ShapeDtypeStructs carrying ``shardings``: the ``*_like`` targets for orbax restore onto a mesh
    (any mesh: a checkpoint saved on one mesh restores onto another)."""
    return jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), tree, shardings)
