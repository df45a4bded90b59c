"""Timing helpers of the benchmark CLIs (``infer.benchmark``, its ``--synthetic`` mode, ``infer.context_sweep``):
the fastest of repeated runs, single draft / verify forwards timed in jitted loops, and where DFlash's output
first differs from plain decoding's.
"""
from __future__ import annotations

import time

import numpy as np


def time_forwards(target, draft, block_sizes=(4, 8, 16), *, context: int = 256, iters: int = 20,
                  repeats: int = 5, batch: int = 1, cache_len: int | None = None, attention_impl: str = "auto") -> dict:
    """Seconds per draft forward (``propose``) and per target verify forward at block K, with ``context``
    tokens of cache (of ``cache_len`` slots, default context + 32) for ``batch`` rows, attending as the
    engine does with ``attention_impl``. Each is timed as ONE jitted loop of ``iters`` forwards, each fed the
    previous one's output (as inside the decode loop: no per-call dispatch, no cache copies), best of ``repeats``."""
    import jax
    import jax.numpy as jnp

    from dflash_jax import draft as draft_lib
    from dflash_jax import target as target_lib

    out = {}
    tcfg = target.config

    def timed(body, carry, *consts):
        # The carry (the cache) is donated, a fresh copy per run made before the clock starts: otherwise every
        # run would first copy the whole cache into the loop's buffers, a cost of the bucket, not of a forward.
        loop = jax.jit(lambda c, *a: jax.lax.fori_loop(0, iters, lambda i, c: body(c, *a), c), donate_argnums=0)
        fresh = lambda: jax.block_until_ready(jax.tree_util.tree_map(jnp.copy, carry))  # noqa: E731
        jax.block_until_ready(loop(fresh(), *consts))
        best = float("inf")
        for _ in range(repeats):
            c = fresh()
            start = time.perf_counter()
            jax.block_until_ready(loop(c, *consts))
            best = min(best, time.perf_counter() - start)
        return best / iters

    def draft_fwd(ids, tp, dp, dk, dv):
        anchors = jnp.full((batch, 1), context)
        return ids.at[:, 1:].set(draft_lib.propose(tcfg, tp, draft.config, dp, ids, anchors, dk, dv,
                                                   decode_impl=attention_impl))

    def verify(carry, tp):
        ids, cache = carry
        pos = jnp.broadcast_to(context + jnp.arange(ids.shape[1]), ids.shape)
        logits, _, cache = target_lib.forward(tcfg, tp, ids, pos, cache, attention_impl=attention_impl)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

    cache_len = cache_len or context + 32
    tcache = target.new_cache(batch, cache_len, max_block=max(block_sizes))
    dcache = draft_lib.cache_kv(draft.new_cache(batch, cache_len)) if draft is not None else None
    for k in sorted(set(block_sizes) | {1}):
        ids = jnp.zeros((batch, k), jnp.int32)
        if draft is not None and 1 < k <= draft.config.block_size:
            out[f"draft_forward_s_block{k}"] = timed(draft_fwd, ids, target.params, draft.params, *dcache)
        out[f"verify_forward_s_block{k}"] = timed(verify, (ids, tcache), target.params)
    return out


def first_mismatch(target, plain, dflash) -> dict | None:
    """Where DFlash's output first differs from plain decoding's (None where they are identical), and how
    close the target's choice was there: one target forward on the plain output up to that token, then the
    gap between its two largest logits (``top2_logit_gap``) and between the largest and DFlash's token's
    (``dflash_token_gap``). In low precision, verifying a block in one forward rounds differently from one
    token at a time, so a near-tie (a gap near the dtype's rounding) can flip; a real bug flips clear choices.
    This forward rounds too: at a near-tie DFlash's token can come out on top here (``dflash_token_gap`` 0)."""
    from dflash_jax.target import target_logits

    a, b = plain.output_ids, dflash.output_ids
    if a == b:
        return None
    n = plain.prompt_length
    i = next((j for j in range(n, min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))
    logits = np.asarray(target_logits(target, np.array([a[:i]], np.int32))[0, -1], np.float64)
    top2 = np.sort(logits)[-2:]
    out = {"position": i - n, "plain_token": a[i] if i < len(a) else None,
           "dflash_token": b[i] if i < len(b) else None, "top2_logit_gap": float(top2[1] - top2[0])}
    out["dflash_token_gap"] = float(top2[1] - logits[b[i]]) if i < len(b) else None
    return out


def fastest(repeats: int, *methods):
    """One untimed warm-up run of every method (plain, DFlash, and with adaptive verify the fixed block), then
    ``repeats`` runs alternating; the fastest of each.
    The warm-up matters: the first execution of a newly compiled shape bucket carries one-time setup
    (0.1-0.25 s per executable on a CPU, from XLA's YNNPACK fusions), and prompts of different lengths
    land in different buckets. Every run (same seed) must give the same tokens."""
    runs = [tuple(method() for method in methods) for _ in range(repeats + 1)]
    for m, name in enumerate(("plain", "DFlash", "fixed-block DFlash")[:len(methods)]):
        if any(r[m].output_ids != runs[0][m].output_ids for r in runs):
            raise ValueError(f"{name} decoding gave different outputs on repeated runs with the same seed")
    return tuple(min((r[m] for r in runs[1:]), key=lambda g: g.wall_time_s) for m in range(len(methods)))
