"""The decode programs, pure functions of (spec, inputs, state): ``prefill`` of new rows, ``admit`` (a prefill into
chosen rows of a running state), ``step`` (one draft + verify + commit of every row), ``run`` (steps in one
``lax.while_loop`` until a row finishes or a step count is reached) and ``generate`` (prefill, then steps until every
row is done), each jitted with the spec static."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dflash_jax import draft as draft_lib
from dflash_jax import sharding
from dflash_jax import target as target_lib
from dflash_jax.decode.types import DecodeState, EngineSpec, Finish, Inputs, Rows
from dflash_jax.decode.verify import chain_verify, commit, stop_hits, tree_verify
from dflash_jax.sampling import choose, row_keys


def prefill(spec: EngineSpec, inp: Inputs, rows: Rows) -> DecodeState:
    """A state of the new ``rows`` alone: the target (and the draft's context) prefilled with their prompts, and
    each row's first token drawn."""
    prompts, lens, budget = rows.prompts, rows.lens, rows.budget
    b, p = prompts.shape
    dtype = jax.tree_util.tree_leaves(inp.tparams)[0].dtype
    tcache = target_lib.new_cache(spec.target_config, b, spec.cache_len, dtype, max_block=spec.max_block)
    offsets = jnp.arange(p, dtype=jnp.int32)
    positions = jnp.where(offsets < lens[:, None], offsets, -1)  # padding: never cached, never attended
    logits, features, tcache = target_lib.forward(spec.target_config, inp.tparams, prompts, positions, tcache,
                                                  spec.feature_layer_ids, lens - 1,
                                                  attention_impl=spec.attention_impl)
    key, sub = row_keys(rows.key, 2)
    first = choose(logits[:, 0], sub, rows.temperature, rows.top_k, rows.top_p, greedy=spec.greedy)
    idx = jnp.arange(b)
    tokens = jnp.zeros((b, spec.cache_len), jnp.int32).at[:, :p].set(prompts).at[idx, lens].set(first)
    dcache = None
    if spec.speculative:
        dcache = draft_lib.new_cache(spec.draft_config, b, spec.cache_len, dtype)
        dcache = draft_lib.materialize(spec.draft_config, inp.dparams, dcache, features, positions).commit(lens)
    stopped = stop_hits(first[:, None], rows.stop_ids)[:, 0]
    finish = jnp.where(stopped, Finish.STOP, jnp.where(budget <= 1, Finish.LENGTH, Finish.RUNNING)).astype(jnp.int32)
    zeros = jnp.zeros((b, spec.cache_len), jnp.int32)
    return spec.place(DecodeState(tokens=tokens, tcache=tcache.commit(lens), dcache=dcache, prompt_len=lens,
                                  generated=jnp.ones((b,), jnp.int32), budget=budget, finish=finish,
                                  acceptance=zeros, verified=zeros, steps=jnp.zeros((b,), jnp.int32), key=key,
                                  stop_ids=rows.stop_ids, temperature=rows.temperature, top_k=rows.top_k,
                                  top_p=rows.top_p))


def admit(spec: EngineSpec, inp: Inputs, state: DecodeState, rows: Rows, at) -> DecodeState:
    """``state`` with the new ``rows`` prefilled into its rows ``at`` [A] (an index >= the state's rows: that new row
    is dropped, padding of a fixed group size); every other row keeps its caches and counters as they are."""
    new = prefill(spec, inp, rows)
    put = lambda old, x: old.at[at].set(x.astype(old.dtype), mode="drop")  # noqa: E731 (every leaf is rows first)
    return spec.place(jax.tree_util.tree_map(put, state, new))


def release(spec: EngineSpec, state: DecodeState, at) -> DecodeState:
    """``state`` with its rows ``at`` [A] marked free (out of range: ignored); their caches stay until overwritten.
    A free row's sampling settings are reset to greedy, so that a batch with no sampling row skips the draws and
    the sorts over the vocabulary (``sampling.if_sampling``, ``filtered_scores``)."""
    put = lambda x, v: x.at[at].set(v, mode="drop")  # noqa: E731
    return state.replace(finish=put(state.finish, Finish.FREE), temperature=put(state.temperature, 0.0),
                         top_k=put(state.top_k, 0), top_p=put(state.top_p, 1.0))


def step(spec: EngineSpec, inp: Inputs, state: DecodeState) -> DecodeState:
    """One draft + verify + commit for every row that is not done (done rows do not change)."""
    key, k_draft, k_target = row_keys(state.key, 3)
    verify = tree_verify if spec.tree_budget else chain_verify
    posterior, a, length, tcache, dcache = verify(spec, inp, state, k_draft, k_target)
    return commit(spec, state, posterior, a, length, tcache, dcache, key)


def run(spec: EngineSpec, inp: Inputs, state: DecodeState, max_steps):
    """Steps until a row that was running finishes, no row runs, or ``max_steps`` steps (a runtime scalar) ran ->
    (state, steps taken)."""
    running = ~state.done

    def more(c):
        s, n = c
        return (n < max_steps) & jnp.any(~s.done) & ~jnp.any(running & s.done)

    return jax.lax.while_loop(more, lambda c: (step(spec, inp, c[0]), c[1] + 1), (state, jnp.int32(0)))


def generate(spec: EngineSpec, inp: Inputs, rows: Rows) -> DecodeState:
    """Prefill ``rows``, then steps until every row is done: a closed batch in one program."""
    return jax.lax.while_loop(lambda s: ~jnp.all(s.done), functools.partial(step, spec, inp), prefill(spec, inp, rows))


def _on_mesh(fn):
    """``fn(spec, ...)`` traced with ``spec.mesh`` as the abstract mesh: its Pallas kernels run per shard."""
    @functools.wraps(fn)
    def traced(spec: EngineSpec, *args, **kw):
        with sharding.mesh_scope(spec.mesh):
            return fn(spec, *args, **kw)

    return traced


prefill_jit = jax.jit(_on_mesh(prefill), static_argnames=("spec",))
admit_jit = jax.jit(_on_mesh(admit), static_argnames=("spec",), donate_argnames=("state",))
release_jit = jax.jit(release, static_argnames=("spec",), donate_argnames=("state",))
step_jit = jax.jit(_on_mesh(step), static_argnames=("spec",), donate_argnames=("state",))
run_jit = jax.jit(_on_mesh(run), static_argnames=("spec",), donate_argnames=("state",))
generate_jit = jax.jit(_on_mesh(generate), static_argnames=("spec",))


def empty(spec: EngineSpec, inp: Inputs, rows: Rows) -> DecodeState:
    """A state of ``rows``' row count with every row free (zeros: an admission overwrites a whole row)."""
    shapes = jax.eval_shape(functools.partial(prefill, spec), inp, rows)
    state = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return spec.place(state.replace(finish=jnp.full(state.finish.shape, Finish.FREE, jnp.int32),
                                    top_p=jnp.ones_like(state.top_p)))  # free rows: greedy settings (``release``)


def take(state: DecodeState, at):
    """The fields a result reads, of rows ``at`` [A] only (what ``types.row_result`` takes, prompt lengths added)."""
    pick = lambda x: jnp.take(x, at, axis=0)  # noqa: E731
    return dict(tokens=pick(state.tokens), generated=pick(state.generated), acceptance=pick(state.acceptance),
                verified=pick(state.verified), steps=pick(state.steps), finish=pick(state.finish),
                prompt_length=pick(state.prompt_len))


def recent(state: DecodeState, width: int):
    """Per row: its counters and its last ``width`` tokens ending at the newest committed one (what a streaming host
    reads after a step: a step commits at most a block, so ``width`` = max block + 1 covers an admission too)."""
    end = state.prompt_len + state.generated
    at = jnp.clip(end[:, None] - width + jnp.arange(width, dtype=end.dtype), 0, state.tokens.shape[1] - 1)
    last = jnp.take_along_axis(state.acceptance, jnp.maximum(state.steps - 1, 0)[:, None], axis=1)[:, 0]
    return dict(tail=jnp.take_along_axis(state.tokens, at, axis=1), generated=state.generated, finish=state.finish,
                steps=state.steps, acceptance=last)


empty_jit = jax.jit(_on_mesh(empty), static_argnames=("spec",))
take_jit = jax.jit(take)
recent_jit = jax.jit(recent, static_argnames=("width",))
