"""The closed-batch drivers: ``speculative_generate`` / ``generate`` (every prompt in one program, one device call
until the slowest row ends), ``stream_generate`` (the same steps from a host loop, yielding tokens), and
``lower_step`` (one step lowered, for reading its HLO)."""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import sharding
from dflash_jax.decode import prepare, steps
from dflash_jax.decode.options import DecodeOptions
from dflash_jax.decode.programs import PROGRAMS, signature
from dflash_jax.decode.types import GenerationResult, row_result, to_host
from dflash_jax.target import Target


@dataclasses.dataclass(frozen=True)
class Batch:
    """A closed batch ready to run: the spec, shared inputs, the rows (placed) and the prompt lengths."""

    spec: object
    inputs: object
    rows: object
    lens: np.ndarray


def build(target: Target, draft, prompts, options: DecodeOptions) -> Batch:
    """Check everything before any compute and pack the prompts as one batch of rows (row i: seed stream i)."""
    rows = prepare.check_prompts(target, prompts)
    lens = np.array([len(r) for r in rows], np.int32)
    budget = prepare.budgets(lens, [options] * len(rows), options.limit(target.config))
    block = options.block_for(draft)
    cache_len = prepare.cache_length(lens, budget, max(block, options.tree_budget + 1), options.cache_len)
    spec, inputs = prepare.engine(target, draft, options, cache_len, greedy=options.sampling.greedy, rows=len(rows),
                                  stop_width=prepare.stop_width([options]))
    pad = sharding.pad_rows(len(rows), spec.mesh)  # rows over data*fsdp: pad with rows that finish at prefill
    packed = prepare.make_rows(spec, rows, budget, [options] * len(rows), range(len(rows)), pad_to=len(rows) + pad)
    return Batch(spec, inputs, prepare.place_rows(spec, packed), lens)


def _executable(batch: Batch):
    """AOT-compile once per (spec, shapes) bucket, then run it once on a one-step budget (the same program: the
    budget is an input), so timings exclude compilation and a program's first-execution setup (on CPU a
    cold first run is several times slower than the next)."""
    def compile_and_warm():
        run = steps.decode_loop_jit.lower(batch.spec, batch.inputs, batch.rows).compile()
        budget = batch.rows.budget  # numpy, or a jax.Array placed on a mesh (kept on its sharding)
        one_step = (jax.jit(lambda b: jnp.minimum(b, 2), out_shardings=budget.sharding)(budget)
                    if isinstance(budget, jax.Array) else np.minimum(budget, 2))  # prefill + one step
        jax.block_until_ready(run(batch.inputs, batch.rows.replace(budget=one_step)))
        return run

    return PROGRAMS.get(("generate", batch.spec, signature(batch.inputs, batch.rows)), compile_and_warm)


def speculative_generate(target: Target, draft, prompts, *, max_new_tokens: int, **options) -> list[GenerationResult]:
    """Generate for a batch of prompts (lists of ids, ragged) in one device call.

    ``draft=None`` (or ``block_size=1``) is plain autoregressive decoding with the same engine. The keyword
    ``options`` are ``DecodeOptions``' (block_size, temperature, top_k, top_p, stop_token_ids, seed, max_length,
    acceptance, proposer, attention_impl, cache_len, verify_lengths, verify_threshold, tree_budget, logprobs). Row i
    samples with the key of (seed, i) (``Request``). Returns one ``GenerationResult`` per prompt; wall time excludes
    compilation and first-run setup."""
    batch = build(target, draft, prompts, DecodeOptions(max_new_tokens=max_new_tokens, **options))
    run = _executable(batch)
    start = time.perf_counter()
    state = jax.block_until_ready(run(batch.inputs, batch.rows))
    wall = time.perf_counter() - start
    host = to_host(state, batch.spec.logprobs)
    return [row_result(host, i, n, wall, batch.spec.logprobs) for i, n in enumerate(batch.lens)]


def generate(target: Target, prompts, *, max_new_tokens: int, **options) -> list[GenerationResult]:
    """Plain autoregressive decoding (the baseline), same engine and options."""
    return speculative_generate(target, None, prompts, max_new_tokens=max_new_tokens, **options)


def stream_generate(target: Target, draft, prompts, *, max_new_tokens: int,
                    **options) -> Iterator[list[list[int]] | list[GenerationResult]]:
    """Host loop over the same jitted step: yields, after prefill and each step, the new token ids of
    every row (a list per row), and finally the list of ``GenerationResult`` (with the time to the first
    token). Prefill and step are compiled and run once before the clock starts, so timings exclude
    compilation as in ``speculative_generate`` (whose options these are)."""
    batch = build(target, draft, prompts, DecodeOptions(max_new_tokens=max_new_tokens, **options))
    prefill = functools.partial(steps.prefill_jit, batch.spec, batch.inputs, batch.rows)
    step = functools.partial(steps.step_jit, batch.spec, batch.inputs)
    jax.block_until_ready(step(prefill()))  # warm-up
    start = time.perf_counter()
    state, first = prefill(), None
    seen = np.zeros(len(batch.lens), np.int64)
    while True:
        tokens, generated, done = sharding.to_host((state.tokens, state.generated, state.done))
        first = time.perf_counter() - start if first is None else first
        yield [tokens[i, n + seen[i]:n + generated[i]].tolist() for i, n in enumerate(batch.lens)]
        seen = generated[:len(batch.lens)].astype(np.int64)
        if done.all():
            break
        state = step(state)
    wall = time.perf_counter() - start
    host = to_host(state, batch.spec.logprobs)
    yield [row_result(host, i, n, wall, batch.spec.logprobs, time_to_first_token_s=first)
           for i, n in enumerate(batch.lens)]


def lower_step(target: Target, draft, prompts, *, max_new_tokens: int, **options):
    """One decode step (draft + verify + commit of every row) lowered after a real prefill of ``prompts`` (the
    options of ``speculative_generate``, greedy) -> (lowered step, the prefilled ``DecodeState`` it takes, donated):
    ``.compile()`` it to read the step's HLO, memory and collectives (``dflash_jax.hlo``,
    ``scripts/mesh_step_costs.py``, ``tests/test_step_copies.py``)."""
    batch = build(target, draft, prompts, DecodeOptions(max_new_tokens=max_new_tokens, **options))
    if not batch.spec.greedy:
        raise ValueError("lower_step lowers the greedy step: leave temperature at 0")
    state = steps.prefill_jit(batch.spec, batch.inputs, batch.rows)
    return steps.step_jit.lower(batch.spec, batch.inputs, state), state
