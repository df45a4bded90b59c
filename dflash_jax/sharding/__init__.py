"""Sharding: one device mesh, one table of logical-axis rules, placement of params / batches / decode
state. Sections: ``mesh`` (axes, specs, multi-host), ``rules`` (logical axes -> mesh axes), ``placement``
(arrays onto a mesh and back), ``per_shard`` (Pallas kernels under shard_map on the trace's mesh). What
needs a model (param shardings of a Target / Draft, sharding one, loading straight onto a mesh) is
``dflash_jax.model_sharding``, beside target.py and draft.py.

The mesh always has the axes ``('data', 'fsdp', 'expert', 'tensor')`` (sizes may be 1). Every parameter carries
logical axis names (``dflash_jax.layers``: ``nn.with_logical_partitioning``); the rules map them to mesh
axes, and JAX's own sharding machinery (jit + GSPMD) does all communication. Inference uses ``data``
and ``tensor`` (``fsdp=1``): weights Megatron-style over ``tensor``, rows and caches over ``data``.
Training adds ``fsdp``: rows over ``data*fsdp``, weights' hidden dim over ``fsdp``. Mixture-of-experts
targets may add ``expert``: their experts' weights split over it (the family's ``expert`` rule).

Multi-host (TPU pod slice, multi-node GPU): call ``maybe_initialize_distributed()`` first thing; the
mesh then spans every process's devices, params are placed shard by shard (``placer``) and each
process loads only ``process_slice(n)`` of the training data (``shard_local_batch``).
"""
from dflash_jax.sharding.mesh import (AXES, BATCH_AXES, batch_multiple, make_mesh, maybe_initialize_distributed,
                                      mesh_str, parse_mesh_spec, process_slice)
from dflash_jax.sharding.placement import (abstract_like, batch_sharding, batch_spec, cache_spec,
                                           check_batch_rows, constrain_batch, constrain_cache, constrain_state, mesh_of,
                                           opt_state_shardings, pad_rows, shard_batch, shard_local_batch,
                                           shard_params, to_host)
from dflash_jax.sharding.per_shard import mesh_scope
from dflash_jax.sharding.rules import (LOGICAL_RULES, check_divisible, logical_fit, logical_to_mesh,
                                       rules_for)

__all__ = ["AXES", "BATCH_AXES", "LOGICAL_RULES", "abstract_like", "batch_multiple", "batch_sharding", "batch_spec",
           "cache_spec", "check_batch_rows", "check_divisible", "constrain_batch",
           "constrain_cache", "constrain_state", "logical_fit", "logical_to_mesh", "make_mesh",
           "maybe_initialize_distributed", "mesh_of", "mesh_scope", "mesh_str", "opt_state_shardings",
           "pad_rows", "parse_mesh_spec", "process_slice",
           "rules_for", "shard_batch", "shard_local_batch", "shard_params", "to_host"]
