"""Timing helpers of the benchmark CLIs (``infer.benchmark``, its ``--synthetic`` mode, ``infer.context_sweep``):
the fastest of repeated runs, single draft / verify forwards timed in jitted loops, and where DFlash's output
first differs from plain decoding's.
"""
from __future__ import annotations

import time

import numpy as np


def time_forwards(target, draft, block_sizes=(4, 8, 16), *, context: int = 256, iters: int = 20,
                  repeats: int = 5, batch: int = 1, cache_len: int | None = None, attention_impl: str = "auto",
                  parts_block: int | None = None, whole_step: bool = False) -> dict:
    """Seconds per draft forward (``propose``: the forward and its argmax, the chain's proposal) and per target
    verify forward at block K (with the draft's feature layers, as the engine verifies), with ``context`` tokens
    committed in caches of ``cache_len`` slots (default context + 32) for ``batch`` rows, attending as the engine
    does with ``attention_impl``; and, at block ``parts_block`` (None: not timed), the rest of a DFlash step in
    named parts (``step_parts_s``: acceptance, cache writes, commit; ``step_split``), and with ``whole_step`` the
    engine's whole chain step there (``step_loop_s``: the draft's own proposal, verify, commit). Each is timed as
    ONE jitted loop of ``iters`` calls, each fed the previous one's output (as inside the decode loop: no per-call
    dispatch, no cache copies), best of ``repeats``."""
    import jax
    import jax.numpy as jnp

    from dflash_jax.drafts import model as draft_lib
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

    def draft_fwd(ids, tp, dp, dk, dv):  # ids: the k tokens a step verifies (a DSpark draft reads k - 1 slots)
        anchors = jnp.full((batch, 1), context)
        inputs = ids[:, :-1] if draft.config.shifted else ids
        return ids.at[:, 1:].set(draft_lib.propose(tcfg, tp, draft.config, dp, inputs, anchors, dk, dv,
                                                   decode_impl=attention_impl))

    layer_ids = draft.config.target_layer_ids if draft is not None else ()

    def verify(carry, tp):  # the cache keeps its committed length: each forward re-verifies the same positions
        ids, cache = carry
        pos = cache.lengths[:, None] + jnp.arange(ids.shape[1])
        logits, _, cache = target_lib.forward(tcfg, tp, ids, pos, cache, layer_ids, attention_impl=attention_impl)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

    cache_len = cache_len or context + 32
    committed = jnp.full((batch,), context, jnp.int32)
    tcache = target.new_cache(batch, cache_len, max_block=max(block_sizes)).replace(lengths=committed)
    dcache = draft.new_cache(batch, cache_len).replace(lengths=committed) if draft is not None else None
    for k in sorted(set(block_sizes) | {1}):
        ids = jnp.zeros((batch, k), jnp.int32)
        if draft is not None and 1 < k <= draft.config.verify_length(draft.config.block_size):
            out[f"draft_forward_s_block{k}"] = timed(draft_fwd, ids, target.params, draft.params,
                                                     *draft_lib.cache_kv(dcache))
        out[f"verify_forward_s_block{k}"] = timed(verify, (ids, tcache), target.params)
    if draft is not None and parts_block is not None and 1 < parts_block <= draft.config.verify_length(
            draft.config.block_size):
        out["step_parts_s"] = _step_parts(timed, target, draft, tcache, dcache, parts_block, context)
        if whole_step:
            out["step_loop_s"] = _whole_step(timed, target, draft, tcache, dcache, parts_block, attention_impl)
    return out


def step_split(timings: dict, block: int, step_s: float) -> dict:
    """A DFlash step of ``step_s`` seconds at ``block`` split as draft + verify + rest (``time_forwards``'s
    timings), the rest in its named parts when they were timed, and ``other``: what no part names. With the whole
    step timed in a loop too (``step_loop_s``), the rest splits once more: ``other`` is then the unnamed work
    inside that step (step_loop - draft - verify - parts), and ``runs`` = step_s - step_loop the cost of running
    the steps as the decode does (device calls, the host between them; on a CPU each call's first touch of its
    temporary buffers, docs/benchmarks.md), so draft + verify + parts + other + runs = step_s."""
    d, v = timings.get(f"draft_forward_s_block{block}", 0.0), timings[f"verify_forward_s_block{block}"]
    parts = timings.get("step_parts_s", {})
    rest = step_s - d - v
    out = {"draft": d, "verify": v, "rest": rest, **parts}
    if "step_loop_s" in timings:
        loop = timings["step_loop_s"]
        return {**out, "step_loop": loop, "other": loop - d - v - sum(parts.values()), "runs": step_s - loop}
    return {**out, **({"other": rest - sum(parts.values())} if parts else {})}


def _step_parts(timed, target, draft, tcache, dcache, k: int, context: int) -> dict:
    """Seconds of a DFlash step's non-forward work at block ``k``, each part alone in a jitted loop:
    acceptance (the accepted prefix of the block given the target's greedy posterior: the posterior's argmax over
    the vocabulary is in the timed verify forward, so it is not counted again here), cache writes (the
    verified tokens' features -> draft context K/V, into the draft cache) and commit (the engine's
    ``decode.verify.commit``: the committed tokens, acceptance and verify-length records, both caches' rollback)."""
    import jax.numpy as jnp

    from dflash_jax.drafts import model as draft_lib
    from dflash_jax.decode import verify
    from dflash_jax.decode.types import EngineSpec
    from dflash_jax.sampling import accepted_length

    b, vocab = tcache.lengths.shape[0], target.config.vocab_size
    offsets = jnp.arange(k, dtype=jnp.int32)

    def acceptance(carry):
        posterior, block = carry
        a = accepted_length(block[:, 1:], posterior)
        return (posterior + a[:, None]) % vocab, block.at[:, 1:].set(posterior[:, :-1])

    def cache_writes(carry, dp):
        cache, features = carry
        cache = draft_lib.materialize(draft.config, dp, cache, features, jnp.broadcast_to(context + offsets, (b, k)))
        return cache, features.at[:, 0, 0].add(1.0)  # new features each call: nothing to hoist out of the loop

    spec = EngineSpec(target.config, draft.config, k, greedy=True, cache_len=tcache.max_len)
    state = _state(spec, tcache, dcache)

    def commit(carry):  # the engine's own commit (decode.verify.commit), then back to the context's length
        st, a = carry
        st = verify.commit(spec, st, st.tokens[:, :k] + 1, a, jnp.int32(k), st.tcache, st.dcache, None, st.key)
        keep = a + 1
        return st.replace(tcache=st.tcache.replace(lengths=st.tcache.lengths - keep),
                          dcache=st.dcache.replace(lengths=st.dcache.lengths - keep),
                          generated=st.generated - keep, steps=st.steps % 64), (a + 3) % k

    features = jnp.ones((b, k, len(draft.config.target_layer_ids) * target.config.hidden_size),
                        draft_lib.cache_kv(dcache)[0][0].dtype)
    return {"acceptance": timed(acceptance, (jnp.zeros((b, k), jnp.int32), jnp.zeros((b, k), jnp.int32))),
            "cache_writes": timed(cache_writes, (dcache, features), draft.params),
            "commit": timed(commit, (state, jnp.zeros((b,), jnp.int32)))}


def _whole_step(timed, target, draft, tcache, dcache, k: int, attention_impl: str) -> float:
    """Seconds of the engine's whole greedy chain step at block ``k`` (``decode.steps.step``: the draft's own
    proposal, verify, commit), attending with ``attention_impl`` as the timed forwards do, every row at the caches'
    committed length and put back there after each step."""
    import jax.numpy as jnp

    from dflash_jax.decode import proposers, steps
    from dflash_jax.decode.types import EngineSpec, Inputs

    n = tcache.lengths
    spec = EngineSpec(target.config, draft.config, k, greedy=True, cache_len=tcache.max_len,
                      proposer=proposers.for_draft(draft.config, sampled=False), attention_impl=attention_impl)
    inputs = Inputs(tparams=target.params, dparams=draft.params, mask_token_id=jnp.int32(draft.config.mask_token_id),
                    threshold=jnp.float32(0.0), proposer_args=spec.proposer.arrays(spec, n.shape[0], spec.cache_len))
    state = _state(spec, tcache, dcache)

    def step(st, inp):
        new = steps.step(spec, inp, st)
        return new.replace(tcache=new.tcache.replace(lengths=n), dcache=new.dcache.replace(lengths=n),
                           generated=st.generated, steps=st.steps, finish=st.finish)

    return timed(step, state, inputs)


def _state(spec, tcache, dcache):
    """A decode state of running rows over these caches (every row at their committed length), for timing."""
    import jax.numpy as jnp

    from dflash_jax.decode.types import DecodeState
    from dflash_jax.sampling import RowSampling

    b = tcache.lengths.shape[0]
    return DecodeState(tokens=jnp.zeros((b, spec.cache_len), jnp.int32), tcache=tcache, dcache=dcache,
                       prompt_len=tcache.lengths, generated=jnp.ones((b,), jnp.int32),
                       budget=jnp.full((b,), spec.cache_len, jnp.int32), finish=jnp.zeros((b,), jnp.int32),
                       acceptance=jnp.zeros((b, spec.cache_len), jnp.int32),
                       verified=jnp.zeros((b, spec.cache_len), jnp.int32), steps=jnp.zeros((b,), jnp.int32),
                       key=jnp.zeros((b, 2), jnp.uint32), stop_ids=jnp.full((b, spec.stop_width), -1, jnp.int32),
                       sampling=RowSampling.of((), b),  # greedy rows
                       logps=jnp.zeros((b, spec.cache_len), jnp.float32))


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
