"""What rows' caches cost in device memory and how many rows fit: the bytes of one row's caches (the target's and
the draft's context, slots or the unpaged part of a paged row) and the device's free memory, read where the device
reports it (TPU, GPU; a CPU does not)."""
from __future__ import annotations

import jax

from dflash_jax import target as target_lib
from dflash_jax.drafts import model as draft_lib


def param_dtype(model) -> str:
    """The dtype a loaded model's parameters (and so its compute) are in."""
    return str(jax.tree_util.tree_leaves(model.params)[0].dtype)


def free_device_bytes() -> int | None:
    """The first local device's free memory in bytes, or None where it reports none (a CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0)


def row_cache_bytes(target_config, draft_config, cache_len: int, dtype, max_block: int = 16, page: int = 0) -> int:
    """Bytes of one row's caches of ``cache_len`` slots, the target's and the draft's (None: plain decoding) in
    ``dtype``: all of them (``page`` 0: ``--page-size 0``), or with pages the part no page pool holds (sliding
    rings, recurrent states, lengths)."""
    caches = [jax.eval_shape(lambda: target_lib.new_cache(target_config, 1, cache_len, dtype, max_block, page=page))]
    if draft_config is not None:
        caches.append(jax.eval_shape(lambda: draft_lib.new_cache(draft_config, 1, cache_len, dtype, page=page)))
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(caches))


def slots_that_fit(target, draft, cache_len: int, n: int, max_block: int = 16) -> int:
    """At most ``n`` rows of ``cache_len`` cache slots (forwards of up to ``max_block`` tokens rolled back: the
    rings and recurrent stashes grow with it): fewer where their caches would pass a quarter of the device's free
    memory (TPU / GPU report it; CPU: no cap)."""
    free = free_device_bytes()
    if free is None:
        return n
    per_row = row_cache_bytes(target.config, draft and draft.config, cache_len, param_dtype(target), max_block)
    return max(1, min(n, int(free // 4 // max(per_row, 1))))
