"""One device mesh, one table of logical-axis rules, and helpers to place params, batches and KV caches.

The mesh always has the axes ``('data', 'fsdp', 'tensor')`` (sizes may be 1). Every parameter carries
logical axis names (``dflash_jax.layers``: ``nn.with_logical_partitioning``); ``LOGICAL_RULES`` maps them
to mesh axes, and JAX's own sharding machinery (jit + GSPMD) does all communication:

============  ===================  =====================================================
logical axis  mesh axes            what it is
============  ===================  =====================================================
batch         ('data', 'fsdp')     rows of a batch, KV caches and decode state
length        None                 sequence / cache slots (never split: decoding scatters)
embed         'fsdp'               hidden size of every weight (ZeRO-3 style in training)
heads         'tensor'             fused num_heads * head_dim of q_proj / o_proj
kv_heads      'tensor'             fused kv_heads * head_dim of k/v_proj; cache kv-head dim
mlp           'tensor'             intermediate size
vocab         'tensor'             embedding rows / lm_head columns
head_dim      None                 q_norm / k_norm weights, cache head dim
features      None                 draft ``fc`` input (n target layers * hidden)
layers        None                 a stacked-layers axis, if layers are ever scanned
============  ===================  =====================================================

Inference uses ``data`` and ``tensor`` (``fsdp=1``): weights Megatron-style over ``tensor``, rows and
caches over ``data``. Training adds ``fsdp``: rows over ``data*fsdp``, weights' hidden dim over ``fsdp``.

Divisibility: the attention head count must divide by ``tensor`` (else an error says what to change).
KV heads that do not divide by ``tensor`` (e.g. 8 KV heads on tensor=16) are replicated over
``tensor`` instead: k/v_proj weights and the caches' kv-head dim are then copied on each tensor shard
(correct, more memory). Any other dimension that does not divide by its mesh axes is replicated too.

Multi-host (TPU pod slice, multi-node GPU): call ``maybe_initialize_distributed()`` first thing; the
mesh then spans every process's devices, params are placed shard by shard (``placer``) and each
process loads only ``process_slice(n)`` of the training data (``shard_local_batch``).
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import re
from typing import Any, Callable, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

log = logging.getLogger(__name__)

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

LOGICAL_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("head_dim", None),
    ("features", None),
    ("layers", None),  # a stacked-layers axis (none today: layers are separate modules)
)

# --- the mesh -----------------------------------------------------------------------------------------


def _fmt(sizes: Mapping[str, int]) -> str:
    return ",".join(f"{a}={sizes[a]}" for a in AXES)


def parse_mesh_spec(spec, num_devices: int, auto_axis: str = "data") -> dict[str, int]:
    """``spec`` -> {'data': d, 'fsdp': f, 'tensor': t} with d*f*t == num_devices.

    Accepted: None / "" / "auto" (every device on ``auto_axis``); "data=2,fsdp=1,tensor=4" (omitted axes
    are 1, one axis may be -1 = whatever is left); a dict of the same; a (data, fsdp, tensor) tuple.
    """
    if auto_axis not in AXES:
        raise ValueError(f"auto_axis must be one of {AXES}, got {auto_axis!r}")
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in ("", "auto")):
        return {a: (num_devices if a == auto_axis else 1) for a in AXES}
    if isinstance(spec, str):
        sizes = {}
        for part in spec.split(","):
            if not part.strip():
                continue
            m = re.fullmatch(r"\s*([a-z_]+)\s*[=:]\s*(-?\d+)\s*", part)
            if not m:
                raise ValueError(f"mesh spec {spec!r}: cannot read {part.strip()!r}; write axis=size pairs like "
                                 f"'data=2,fsdp=1,tensor=4' (axes {', '.join(AXES)}) or 'auto'")
            if m.group(1) in sizes:
                raise ValueError(f"mesh spec {spec!r} gives axis {m.group(1)!r} twice")
            sizes[m.group(1)] = int(m.group(2))
    elif isinstance(spec, Mapping):
        sizes = {str(k): int(v) for k, v in spec.items()}
    elif isinstance(spec, Sequence) and len(spec) == len(AXES):
        sizes = dict(zip(AXES, (int(s) for s in spec)))
    else:
        raise ValueError(f"mesh spec {spec!r}: expected 'data=2,fsdp=1,tensor=4', 'auto', a dict or a "
                         f"(data, fsdp, tensor) tuple")
    unknown = sorted(set(sizes) - set(AXES))
    if unknown:
        raise ValueError(f"mesh spec {spec!r}: unknown axes {unknown}; the axes are {', '.join(AXES)}")
    sizes = {a: sizes.get(a, 1) for a in AXES}
    fill = [a for a in AXES if sizes[a] == -1]
    bad = [a for a in AXES if sizes[a] < 1 and sizes[a] != -1]
    if bad or len(fill) > 1:
        raise ValueError(f"mesh spec {spec!r}: sizes must be >= 1 (at most one axis may be -1 = the rest)")
    if fill:
        rest = math.prod(s for a, s in sizes.items() if a != fill[0])
        if num_devices % rest:
            raise ValueError(f"mesh spec {spec!r}: the other axes use {rest} devices, which does not divide the "
                             f"{num_devices} devices; change the fixed sizes")
        sizes[fill[0]] = num_devices // rest
    product = math.prod(sizes.values())
    if product != num_devices:
        hint = ("; set one axis to -1 to take whatever is left (e.g. 'data=-1,tensor=...')"
                if num_devices % max(sizes["tensor"], 1) == 0 else "")
        raise ValueError(
            f"mesh spec {spec!r} asks for data*fsdp*tensor = {sizes['data']}*{sizes['fsdp']}*{sizes['tensor']} = "
            f"{product} devices, but there are {num_devices} (jax.device_count()); change the sizes so that their "
            f"product is {num_devices}, e.g. {_fmt({'data': num_devices, 'fsdp': 1, 'tensor': 1})}{hint}")
    return sizes


def make_mesh(spec=None, *, devices=None, auto_axis: str = "data") -> Mesh:
    """A mesh with axes ('data', 'fsdp', 'tensor') over all devices (of every process).

    ``spec``: see ``parse_mesh_spec``; a ``Mesh`` is returned as is (after checking its axes). "auto"
    puts every device on ``auto_axis``: 'data' (the default) suits inference of a model that fits on one
    device (params replicated, rows split); training of a large model wants ``auto_axis='fsdp'``; a
    model too big for one device needs an explicit ``tensor=`` size. Axes are ``AxisType.Auto`` (jit
    propagates shardings; no explicit-sharding mode), devices ordered by ``jax.make_mesh`` (TPU topology
    aware: the last axis, tensor, gets the fastest interconnect).
    """
    if isinstance(spec, Mesh):
        if tuple(spec.axis_names) != AXES:
            raise ValueError(f"mesh has axes {spec.axis_names}; expected {AXES} (build it with make_mesh)")
        return spec
    devices = list(devices) if devices is not None else jax.devices()
    sizes = parse_mesh_spec(spec, len(devices), auto_axis)
    shape = tuple(sizes[a] for a in AXES)
    auto = (jax.sharding.AxisType.Auto,) * len(AXES)
    return jax.make_mesh(shape, AXES, axis_types=auto, devices=devices)


def mesh_str(mesh: Mesh) -> str:
    return _fmt(dict(mesh.shape))


def batch_multiple(mesh: Mesh | None) -> int:
    """Rows of a batch must be a multiple of this (data * fsdp)."""
    return 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]


@contextlib.contextmanager
def mesh_context(mesh: Mesh, rules=LOGICAL_RULES):
    """``with mesh_context(mesh):`` = ``jax.set_mesh(mesh)`` + Flax logical-axis rules, so bare
    PartitionSpecs and ``nn.with_logical_constraint`` inside traced code resolve against this mesh."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield mesh


# --- logical axes -> shardings ---------------------------------------------------------------------


def _config_of(obj):
    from dflash_jax.config import DraftConfig, TargetConfig

    cfg = getattr(obj, "config", obj)
    if not isinstance(cfg, (TargetConfig, DraftConfig)):
        raise TypeError(f"expected a TargetConfig / DraftConfig (or a Target / Draft), got {type(obj).__name__}")
    return cfg


def _layer_configs(*objs):
    from dflash_jax.config import DraftConfig

    out = []
    for o in objs:
        c = _config_of(o)
        out.append(c.layers if isinstance(c, DraftConfig) else c)
    return out


def check_divisible(mesh: Mesh, *models) -> None:
    """Attention heads of every model must divide by the mesh's tensor size (error says what to change)."""
    t = mesh.shape["tensor"]
    for c in _layer_configs(*models):
        if c.num_attention_heads % t:
            ok = [d for d in range(1, c.num_attention_heads + 1) if c.num_attention_heads % d == 0 and
                  mesh.size % d == 0]
            raise ValueError(
                f"tensor={t} does not divide num_attention_heads={c.num_attention_heads}: choose a tensor size "
                f"that divides {c.num_attention_heads} and {mesh.size} devices ({', '.join(map(str, ok))}) and put "
                f"the rest on data (e.g. --mesh data={mesh.size // max(ok)},tensor={max(ok)})")


def rules_for(mesh: Mesh, *models, rules=LOGICAL_RULES) -> tuple:
    """``rules`` adapted to ``models`` on ``mesh``: checks heads (``check_divisible``) and replicates
    ``kv_heads`` when some model's KV head count does not divide by the tensor size."""
    check_divisible(mesh, *models)
    t = mesh.shape["tensor"]
    kv_bad = [c.num_key_value_heads for c in _layer_configs(*models) if c.num_key_value_heads % t]
    if kv_bad:
        log.warning("num_key_value_heads %s does not divide by tensor=%d: KV projections and caches are "
                    "replicated over the tensor axis", kv_bad, t)
        rules = tuple((k, None if k == "kv_heads" else v) for k, v in rules)
    return tuple(rules)


def logical_to_mesh(logical: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules=LOGICAL_RULES) -> P:
    """Logical axis names of an array of ``shape`` -> a mesh PartitionSpec. Mesh axes of size 1 are left
    out; a dimension that does not divide by its mesh axes, or whose axes an earlier dimension already
    uses, is replicated."""
    table = dict(rules)
    used, out = set(), []
    for name, size in zip(tuple(logical) + (None,) * (len(shape) - len(logical)), shape):
        axes = table.get(name) if name is not None else None
        if name is not None and name not in table:
            raise ValueError(f"logical axis {name!r} has no rule; rules cover {sorted(table)}")
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        axes = tuple(a for a in axes if mesh.shape[a] > 1 and a not in used)
        n = math.prod(mesh.shape[a] for a in axes)
        if axes and size % n:
            log.info("dimension %s of size %d does not divide by %s=%d: replicated", name, size, axes, n)
            axes = ()
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def param_logical_axes(model):
    """Tree (like the params) of logical PartitionSpecs, read from the modules' boxed init (no FLOPs)."""
    from dflash_jax.config import DraftConfig

    cfg = _config_of(model)
    if isinstance(cfg, DraftConfig):
        from dflash_jax.draft import DFlashDraft

        d = cfg.layers.hidden_size

        def init(key):
            feats, x = jnp.zeros((1, 2, cfg.num_features * d)), jnp.zeros((1, 2, d))
            return DFlashDraft(cfg).init(key, feats, x, method=DFlashDraft.initialize)
    else:
        from dflash_jax.target import Transformer

        def init(key):
            return Transformer(cfg).init(key, jnp.zeros((1, 2), jnp.int32), jnp.arange(2)[None])
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)  # eval_shape: no device is touched
    return nn.get_partition_spec(jax.eval_shape(init, key)["params"])


def param_shardings(model, mesh: Mesh, rules=None, params=None):
    """Tree of NamedShardings for the params of ``model`` (a Target/Draft or its config) on ``mesh``.

    ``rules`` default: ``rules_for(mesh, model)`` (heads checked, KV-head fallback). ``params`` (arrays
    or ShapeDtypeStructs) gives the shapes when they are at hand; otherwise they come from the config.
    """
    rules = rules_for(mesh, model) if rules is None else rules
    logical = param_logical_axes(model)
    if params is None:
        params = getattr(model, "params", None)
    shapes = _param_shapes(model) if params is None else params
    flat_l = traverse_util.flatten_dict(_as_dict(logical))
    flat_s = traverse_util.flatten_dict(_as_dict(shapes))
    if set(flat_l) != set(flat_s):
        raise ValueError(f"params do not match the model's structure: missing {sorted(set(flat_l) - set(flat_s))[:3]}"
                         f", unexpected {sorted(set(flat_s) - set(flat_l))[:3]}")
    out = {k: NamedSharding(mesh, logical_to_mesh(tuple(flat_l[k]), flat_s[k].shape, mesh, rules)) for k in flat_l}
    return traverse_util.unflatten_dict(out)


def _param_shapes(model):
    from dflash_jax.config import DraftConfig

    cfg = _config_of(model)
    if isinstance(cfg, DraftConfig):
        from dflash_jax.draft import draft_param_shapes
        return draft_param_shapes(cfg)
    from dflash_jax.target import param_shapes
    return param_shapes(cfg)


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


def shard_target(target, mesh: Mesh, rules=None):
    """The same Target with params on ``mesh`` (tensor-parallel per the rules)."""
    import dataclasses

    shardings = param_shardings(target, mesh, rules)
    return dataclasses.replace(target, params=shard_params(target.params, shardings))


def shard_draft(draft, mesh: Mesh, rules=None):
    import dataclasses

    shardings = param_shardings(draft, mesh, rules)
    return dataclasses.replace(draft, params=shard_params(draft.params, shardings))


def placer(model_config, mesh: Mesh, rules=None) -> Callable[[tuple, np.ndarray], jax.Array]:
    """``place(path, host_array)`` for ``load_target`` / ``load_draft``: each tensor goes straight onto
    its shards (each device receives only its slice; no full copy on any device)::

        mesh = make_mesh("data=2,tensor=4")
        cfg = TargetConfig.from_hf(path)
        target = load_target(path, place=placer(cfg, mesh))
    """
    flat = traverse_util.flatten_dict(_as_dict(param_shardings(model_config, mesh, rules)))

    def place(path, array):
        path = tuple(path)
        if path not in flat:
            raise KeyError(f"no sharding for parameter {'/'.join(path)}")
        return jax.make_array_from_callback(array.shape, flat[path], lambda idx: np.asarray(array[idx]))

    return place


def load_sharded(target_path, draft_path, mesh: Mesh, dtype="float32"):
    """(target, draft or None) loaded straight onto ``mesh`` (heads checked on both before any read)."""
    from dflash_jax.config import DraftConfig, TargetConfig
    from dflash_jax.checkpoints import resolve_path
    from dflash_jax.draft import load_draft
    from dflash_jax.target import load_target

    tpath = resolve_path(target_path)
    tcfg = TargetConfig.from_hf(tpath)
    dpath = resolve_path(draft_path) if draft_path else None
    dcfg = DraftConfig.from_hf(dpath) if dpath else None
    rules = rules_for(mesh, tcfg, *([dcfg] if dcfg else []))
    target = load_target(tpath, dtype=dtype, place=placer(tcfg, mesh, rules))
    draft = load_draft(dpath, dtype=dtype, place=placer(dcfg, mesh, rules)) if dpath else None
    return target, draft


# --- batches, caches, state ------------------------------------------------------------------------


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


def cache_spec(mesh: Mesh, kv_heads: int) -> P:
    """[B, S, K, H] caches: rows over data*fsdp, KV heads over tensor (replicated if they do not divide)."""
    t = mesh.shape["tensor"]
    b = batch_spec(mesh, 1)[0]
    return P(b, None, "tensor" if t > 1 and kv_heads % t == 0 else None, None)


def cache_sharding(mesh: Mesh, kv_heads: int) -> NamedSharding:
    return NamedSharding(mesh, cache_spec(mesh, kv_heads))


def constrain_cache(cache, mesh: Mesh | None):
    """Inside jit: pin a KVCache's layout (see ``cache_spec``); no-op without a mesh."""
    if cache is None or mesh is None:
        return cache
    s = cache_sharding(mesh, cache.k[0].shape[2]) if cache.k else None
    pin = lambda t: tuple(jax.lax.with_sharding_constraint(x, s) for x in t)  # noqa: E731
    return cache.replace(k=pin(cache.k), v=pin(cache.v), lengths=constrain_batch(cache.lengths, mesh))


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


# --- training helpers ------------------------------------------------------------------------------


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


def logical_fit(spec: P, shape, mesh: Mesh) -> P:
    """``spec`` with any dimension that does not divide by its mesh axes replicated."""
    out = []
    for i, axes in enumerate(tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = (axes,) if isinstance(axes, str) else tuple(axes or ())
        n = math.prod(mesh.shape[a] for a in names)
        out.append(axes if names and shape[i] % n == 0 else None)
    return P(*out)


def abstract_like(tree, shardings):
    """ShapeDtypeStructs carrying ``shardings``: the ``*_like`` targets for orbax restore onto a mesh
    (any mesh: a checkpoint saved on one mesh restores onto another)."""
    return jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), tree, shardings)


# --- multi-host ------------------------------------------------------------------------------------

_DIST_ENV = ("JAX_COORDINATOR_ADDRESS", "MEGASCALE_COORDINATOR_ADDRESS")


def _wants_distributed() -> str | None:
    if os.environ.get("DFLASH_DISTRIBUTED", "").strip().lower() in ("1", "true", "yes", "on"):
        return "DFLASH_DISTRIBUTED"
    for var in _DIST_ENV:
        if os.environ.get(var):
            return var
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    if len([h for h in hosts.split(",") if h.strip()]) > 1:
        return "TPU_WORKER_HOSTNAMES"
    for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        try:
            if int(os.environ.get(var, "1")) > 1:
                return var
        except ValueError:
            pass
    return None


def maybe_initialize_distributed(force: bool | None = None) -> bool:
    """Call ``jax.distributed.initialize()`` when this is one process of several; True if it did (or had).

    It runs when ``force`` is True, or (``force`` None) when the environment asks for it:
    ``DFLASH_DISTRIBUTED=1`` (TPU pod slices: everything else is auto-detected from the TPU metadata),
    ``JAX_COORDINATOR_ADDRESS`` (+ ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``), multi-host TPU env
    (``TPU_WORKER_HOSTNAMES`` with several hosts, ``MEGASCALE_COORDINATOR_ADDRESS``), or a multi-task
    SLURM / Open MPI launch. Must run before anything touches a device (``jax.devices()``, any array).
    """
    if jax.distributed.is_initialized():
        return True
    reason = "force" if force else (None if force is False else _wants_distributed())
    if reason is None:
        return False
    kw = {}
    if os.environ.get("JAX_NUM_PROCESSES"):
        kw["num_processes"] = int(os.environ["JAX_NUM_PROCESSES"])
    if os.environ.get("JAX_PROCESS_ID"):
        kw["process_id"] = int(os.environ["JAX_PROCESS_ID"])
    jax.distributed.initialize(**kw)
    log.info("jax.distributed initialized (%s): process %d of %d, %d devices in all", reason, jax.process_index(),
             jax.process_count(), jax.device_count())
    return True


def process_slice(n_items: int, process_index: int | None = None, process_count: int | None = None) -> slice:
    """This process's contiguous share of ``n_items`` (a global batch, a dataset): equal shares, the
    remainder goes to the first processes. Single process: everything."""
    i = jax.process_index() if process_index is None else process_index
    n = jax.process_count() if process_count is None else process_count
    base, extra = divmod(n_items, n)
    start = i * base + min(i, extra)
    return slice(start, start + base + (1 if i < extra else 0))
