"""One table of logical-axis rules (logical axis -> mesh axes) and its adaptation to a mesh and models.

============  ===================  =====================================================
logical axis  mesh axes            what it is
============  ===================  =====================================================
batch         ('data', 'fsdp')     rows of a batch, KV caches and decode state
length        None                 sequence / cache slots (never split: decoding scatters)
embed         'fsdp'               hidden size of every weight (ZeRO-3 style in training)
heads         'tensor'             fused num_heads * head_dim of q_proj / o_proj; query heads of attention
kv_heads      'tensor'             fused kv_heads * head_dim of k/v_proj; key / value heads of attention
mlp           'tensor'             intermediate size
vocab         'tensor'             embedding rows / lm_head columns
head_dim      None                 q_norm / k_norm weights, cache head dim
features      None                 draft ``fc`` input (n target layers * hidden)
cache_batch   ('data', 'fsdp')     rows of every decode state (caches, rings, recurrences, lengths)
cache_len     None                 cache / ring slots (never split: decoding scatters)
cache_heads   'tensor'             query heads of decode attention (and its sinks)
cache_kv_heads 'tensor'            KV heads of a cache
cache_head_dim None                head dim of a cache
cache_state   'tensor'             a recurrent state's first per-row dim (conv channels, linear-attention heads)
cache_snapshot None                a recurrent state's per-token stash (index into the last forward)
cache_pages   None                 pages of a paged cache's pool (shared by every row: not split over rows)
layers        None                 the layer axis of a scanned group's stacked weights and states
============  ===================  =====================================================

Decode state (``dflash_jax.state``) declares the logical axes of its leaves (``LOGICAL_AXES`` of each state
class); ``placement.constrain_cache`` maps them through these rules, and the Pallas kernels run per shard
of the same split (``per_shard``).

A target family may add rules of its own (``Family.logical_rules``; the MoE families: ``expert`` ->
'expert', the expert dimension of stacked expert weights). Divisibility: the attention head
count must divide by ``tensor`` (else an error says what to change). KV heads that do not divide by
``tensor`` are replicated over it (correct, more memory); so is any other dimension that does not divide.
Models are passed as configs (or objects with a ``config``); a draft's heads are its ``layers``'.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Sequence

from jax.sharding import Mesh, PartitionSpec as P

log = logging.getLogger(__name__)

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
    ("cache_batch", ("data", "fsdp")),
    ("cache_len", None),
    ("cache_heads", "tensor"),
    ("cache_kv_heads", "tensor"),
    ("cache_head_dim", None),
    ("cache_state", "tensor"),
    ("cache_snapshot", None),
    ("cache_pages", None),
    ("layers", None),
)


def _layer_configs(*models):
    """The configs that own attention heads: a model's config, or a draft config's ``layers``."""
    cfgs = [getattr(m, "config", m) for m in models]
    return [getattr(c, "layers", c) for c in cfgs]


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
        rules = tuple((k, None if k in ("kv_heads", "cache_kv_heads") else v) for k, v in rules)
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


def logical_fit(spec: P, shape, mesh: Mesh) -> P:
    """``spec`` with any dimension that does not divide by its mesh axes replicated."""
    out = []
    for i, axes in enumerate(tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = (axes,) if isinstance(axes, str) else tuple(axes or ())
        n = math.prod(mesh.shape[a] for a in names)
        out.append(axes if names and shape[i] % n == 0 else None)
    return P(*out)
