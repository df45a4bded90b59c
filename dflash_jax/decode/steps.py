"""The decode programs, pure functions of (spec, inputs, state): ``prefill`` of new rows, ``admit`` (a prefill into
chosen rows of a running state), ``step`` (one draft + verify + commit of every row), ``run`` (steps in one
``lax.while_loop`` until a row finishes or a step count is reached) and ``generate`` (prefill, then steps until every
row is done), each jitted with the spec static."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dflash_jax.drafts import model as draft_lib
from dflash_jax import sharding
from dflash_jax import target as target_lib
from dflash_jax.decode.types import DecodeState, EngineSpec, Finish, Inputs, Rows
from dflash_jax.decode.verify import (chain_verify, commit, draft_view, plain_commit, plain_forward, stop_hits,
                                     tree_verify)
from dflash_jax.sampling import apply_bitmask, choose, row_keys, token_logps
from dflash_jax import state as state_lib
from dflash_jax.state import NO_PAGE, new_pools


def prefill(spec: EngineSpec, inp: Inputs, rows: Rows, pools=None, table=None) -> DecodeState:
    """A state of the new ``rows`` alone: the target (and the draft's context) prefilled with their prompts, and
    each row's first token drawn. Paged (``spec.page``): written into ``pools`` (target's, draft's) through the rows'
    block ``table`` [A, columns]; the state holds them apart (``split``)."""
    prompts, lens, budget = rows.prompts, rows.lens, rows.budget
    b, p = prompts.shape
    dtype = jax.tree_util.tree_leaves(inp.tparams)[0].dtype
    tcache = target_lib.new_cache(spec.target_config, b, spec.cache_len, dtype, max_block=spec.max_block,
                                  page=spec.page)
    if spec.page:
        tcache = tcache.join_pages(pools[0], table)
    offsets = rows.start[:, None] + jnp.arange(p, dtype=jnp.int32)  # a cached prefix's pages hold the rest
    positions = jnp.where(offsets < lens[:, None], offsets, -1)  # padding: never cached, never attended
    logits, features, tcache = target_lib.forward(spec.target_config, inp.tparams, prompts, positions, tcache,
                                                  spec.feature_layer_ids, lens - 1 - rows.start,
                                                  attention_impl=spec.attention_impl)
    key, sub = row_keys(rows.key, 2)
    logits = logits[:, 0] if rows.allowed is None else apply_bitmask(logits[:, 0], rows.allowed)
    first = choose(logits, sub, rows.sampling, greedy=spec.greedy)
    idx = jnp.arange(b)
    logps = jnp.zeros((b, spec.cache_len), jnp.float32).at[idx, lens].set(  # one position: always kept
        token_logps(logits, first, rows.sampling.temperature))
    tokens = jnp.zeros((b, spec.cache_len), jnp.int32).at[idx[:, None], jnp.where(positions >= 0, positions,
                                                                                  spec.cache_len)].set(
        prompts, mode="drop").at[idx, lens].set(first)  # a cached prefix's tokens: ``put_prefix``
    dcache = None
    if spec.speculative:
        dcache = draft_lib.new_cache(spec.draft_config, b, spec.cache_len, dtype, page=spec.page)
        if spec.page:
            dcache = dcache.join_pages(pools[1], table)
        dcache = draft_lib.materialize(spec.draft_config, inp.dparams, dcache, features, positions).commit(lens)
    stopped = stop_hits(first[:, None], rows.stop_ids)[:, 0]
    finish = jnp.where(stopped, Finish.STOP, jnp.where(budget <= 1, Finish.LENGTH, Finish.RUNNING)).astype(jnp.int32)
    zeros = jnp.zeros((b, spec.cache_len), jnp.int32)
    state = DecodeState(tokens=tokens, tcache=tcache.commit(lens), dcache=dcache, prompt_len=lens,
                        generated=jnp.ones((b,), jnp.int32), budget=budget, finish=finish, acceptance=zeros,
                        verified=zeros, steps=jnp.zeros((b,), jnp.int32), key=key, stop_ids=rows.stop_ids,
                        sampling=rows.sampling, logps=logps, pages=table)
    return spec.place(split(state) if spec.page else state)


def split(state: DecodeState) -> DecodeState:
    """A paged state with its caches' pools taken out into ``pools``: every other leaf is rows first."""
    tcache, tpools = state.tcache.split_pages()
    dcache, dpools = state.dcache.split_pages() if state.dcache is not None else (None, ())
    return state.replace(tcache=tcache, dcache=dcache, pools=(tpools, dpools))


def join(state: DecodeState) -> DecodeState:
    """``split`` undone: the pools back in the caches, read through the rows' block tables (``pages``)."""
    tpools, dpools = state.pools
    dcache = state.dcache.join_pages(dpools, state.pages) if state.dcache is not None else None
    return state.replace(tcache=state.tcache.join_pages(tpools, state.pages), dcache=dcache, pools=None)


def _put_rows(state: DecodeState, new: DecodeState, at) -> DecodeState:
    """``state`` with ``new``'s rows (every rows-first leaf) at its rows ``at`` (out of range: dropped)."""
    put = lambda old, x: old.at[at].set(x.astype(old.dtype), mode="drop")  # noqa: E731
    return jax.tree_util.tree_map(put, state.replace(pools=None), new.replace(pools=None)).replace(pools=new.pools)


def admit(spec: EngineSpec, inp: Inputs, state: DecodeState, rows: Rows, at, table=None) -> DecodeState:
    """``state`` with the new ``rows`` prefilled into its rows ``at`` [A] (an index >= the state's rows: that new row
    is dropped, padding of a fixed group size); every other row keeps its caches and counters as they are. Paged:
    the new rows' block ``table`` [A, columns] (padding rows: no pages)."""
    return spec.place(_put_rows(state, prefill(spec, inp, rows, state.pools, table), at))


def restore(spec: EngineSpec, state: DecodeState, at, saved: dict) -> DecodeState:
    """Rows ``at`` given back the decode fields ``saved`` (``RESUMED`` of each, rows first) they had when preempted:
    their caches were prefilled again from their committed tokens, the rest continues where it stopped."""
    put = lambda x, v: x.at[at].set(v.astype(x.dtype), mode="drop")  # noqa: E731
    return spec.place(state.replace(**{f: put(getattr(state, f), saved[f]) for f in RESUMED}))


def put_prefix(state: DecodeState, at, prefix, start) -> DecodeState:
    """Rows ``at`` [A] given the tokens of their cached prefixes (``prefix`` [A, P]: positions below ``start`` [A];
    the prefill wrote the rest; a row index past the state: dropped)."""
    j = jnp.arange(prefix.shape[1], dtype=jnp.int32)[None]
    cols = jnp.where(j < start[:, None], j, state.tokens.shape[1])
    return state.replace(tokens=state.tokens.at[at[:, None], cols].set(prefix, mode="drop"))


RESUMED = ("tokens", "prompt_len", "generated", "budget", "finish", "acceptance", "verified", "steps", "key", "logps")


# positional: an engine program's arguments (spec, inputs, state, ...: ``Engine._compiled``), the inputs unused here
def release(spec: EngineSpec, inp: Inputs, state: DecodeState, at) -> DecodeState:
    """``state`` with its rows ``at`` [A] marked free (out of range: ignored); their caches stay until overwritten.
    A free row's sampling settings are reset to greedy, so that a batch with no sampling row skips the draws and
    the sorts over the vocabulary (``sampling.if_sampling``, ``filtered_scores``)."""
    put = lambda x, v: x.at[at].set(v, mode="drop")  # noqa: E731
    pages = state.pages if state.pages is None else put(state.pages, NO_PAGE)
    return state.replace(finish=put(state.finish, Finish.FREE), sampling=state.sampling.off(at), pages=pages)


def step(spec: EngineSpec, inp: Inputs, state: DecodeState, given=None, allowed=None) -> DecodeState:
    """One draft + verify + commit for every row that is not done (done rows do not change). Structured outputs: the
    proposal ``given`` (``propose``'s) and the grammar bitmasks ``allowed`` of its positions (``chain_verify``)."""
    key, k_draft, k_target = row_keys(state.key, 3)
    if spec.tree_budget:
        return commit(spec, state, *tree_verify(spec, inp, state, k_draft, k_target), key)
    return commit(spec, state, *chain_verify(spec, inp, state, k_draft, k_target, given, allowed), key)


def propose(spec: EngineSpec, inp: Inputs, state: DecodeState):
    """The proposal ``step`` would draft (its keys), for the host to compute a grammar's masks along it."""
    _, k_draft, _ = row_keys(state.key, 3)
    return spec.proposer.propose(spec, draft_view(spec, inp, state, k_draft))


def run(spec: EngineSpec, inp: Inputs, state: DecodeState, max_steps):
    """Steps until a row that was running finishes, no row runs, or ``max_steps`` steps (a runtime scalar) ran ->
    (state, steps taken)."""
    running = ~state.done

    def more(c):
        s, n = c
        return (n < max_steps) & jnp.any(~s.done) & ~jnp.any(running & s.done)

    return jax.lax.while_loop(more, lambda c: (step(spec, inp, c[0]), c[1] + 1), (state, jnp.int32(0)))


def _gather(spec: EngineSpec, inp: Inputs, state: DecodeState, at):
    """Rows ``at`` [A] of a state (an index >= its rows: a padding row, free and without pages; paged: the pools in
    place) and the inputs with their proposer arrays -> (rows, inputs, which are padding)."""
    take = lambda x: jnp.take(x, at, axis=0, mode="clip")  # noqa: E731
    pad = at >= state.finish.shape[0]
    rows = jax.tree_util.tree_map(take, state.replace(pools=None))
    rows = rows.replace(finish=jnp.where(pad, Finish.FREE, rows.finish).astype(jnp.int32),
                        sampling=rows.sampling.off(pad), pools=state.pools)
    if spec.page:
        rows = rows.replace(pages=jnp.where(pad[:, None], NO_PAGE, rows.pages))
    return rows, inp.replace(proposer_args=jax.tree_util.tree_map(take, inp.proposer_args)), pad


def _scatter(spec: EngineSpec, state: DecodeState, rows: DecodeState, at, pad) -> DecodeState:
    """``_gather`` undone: ``rows`` back at ``at`` (padding dropped), their pools the state's."""
    return spec.place(_put_rows(state, rows, jnp.where(pad, state.finish.shape[0], at)))


GUIDE_CANDIDATES = 64  # a constrained greedy row's proposal picks among the draft's most probable tokens (8 -> 64:
# tau 1.48 -> 1.75 under the structured benchmark's schema on the demo pair; 256: 1.87 at a slower host step)
CAUGHT_UP = ("tail", "generated", "finish")  # of ``recent``: what a constrained step's matchers catch up on


def _caught_up(spec: EngineSpec, rows: DecodeState) -> dict:
    """The rows' newest tokens, counts and finish (``CAUGHT_UP``), a step's worth wide."""
    seen = recent(rows, spec.max_block + 1)
    return {k: seen[k] for k in CAUGHT_UP}


def propose_rows(spec: EngineSpec, inp: Inputs, state: DecodeState, at):
    """``propose`` for the rows ``at`` [A] (paged or not) -> (the proposal, the draft's ``GUIDE_CANDIDATES`` most
    probable tokens at each position [A, K-1, C]: what a grammar's greedy rows choose from, and the rows' ``recent``
    tokens, counts and finish: what their matchers catch up on, and whether a row finished; ``decode.constrained``)."""
    rows, sub_inp, _ = _gather(spec, inp, state, at)
    proposal = propose(spec, sub_inp, join(rows) if spec.page else rows)
    return (proposal, jax.lax.top_k(proposal.scores, min(GUIDE_CANDIDATES, proposal.scores.shape[-1]))[1],
            _caught_up(spec, rows))


def step_rows(spec: EngineSpec, inp: Inputs, state: DecodeState, at, given, allowed):
    """One ``step`` of the rows ``at`` [A] with the proposal ``given`` and the grammar bitmasks ``allowed`` [A, K,
    words]: a constrained step, the host between its draft and its verify (``Engine.run``) -> (state, the rows'
    ``recent`` tokens, counts and finish after it: what the next plain step's matchers catch up on)."""
    rows, sub_inp, pad = _gather(spec, inp, state, at)
    rows = (join_step if spec.page else step)(spec, sub_inp, rows, given, allowed)
    return _scatter(spec, state, rows, at, pad), _caught_up(spec, rows)


def forward_rows(spec: EngineSpec, inp: Inputs, state: DecodeState, at):
    """A constrained plain step of the rows ``at`` [A], first half: ``plain_forward`` (the caches' writes pending) ->
    (state, the logits [A, 1, V]); the host computes the grammar's masks of the next token meanwhile."""
    rows, sub_inp, pad = _gather(spec, inp, state, at)
    full = join(rows) if spec.page else rows
    logits, tcache, dcache = plain_forward(spec, sub_inp, full)
    full = full.replace(tcache=tcache, dcache=dcache)
    return _scatter(spec, state, split(full) if spec.page else full, at, pad), logits


def commit_rows(spec: EngineSpec, inp: Inputs, state: DecodeState, at, logits, allowed):
    """The second half: the masked draw from ``forward_rows``' ``logits`` committed (``plain_commit``, this step's
    keys as ``step`` takes them) -> (state, the rows' ``recent`` tokens, counts and finish, as ``step_rows``)."""
    rows, sub_inp, pad = _gather(spec, inp, state, at)
    full = join(rows) if spec.page else rows
    key, _, k_target = row_keys(full.key, 3)
    full = plain_commit(spec, full, logits, allowed, k_target, key)
    rows = split(full) if spec.page else full
    return _scatter(spec, state, rows, at, pad), _caught_up(spec, rows)


def run_rows(spec: EngineSpec, inp: Inputs, state: DecodeState, at, max_steps):
    """``run`` over the rows ``at`` [A] of a paged state only (an index >= its rows: a padding row, free and without
    pages), their pools read in place -> (state, steps taken). It also returns when a running row lacks the pages
    for its next step (fewer than length + max block positions), for the host to give it more."""
    rows, sub_inp, pad = _gather(spec, inp, state, at)
    capacity = jnp.sum(rows.pages != NO_PAGE, axis=1) * spec.page
    running = ~rows.done

    def more(c):
        s, n = c
        short = ~s.done & (s.tcache.lengths + spec.max_block > capacity)
        return (n < max_steps) & jnp.any(~s.done) & ~jnp.any(running & s.done) & ~jnp.any(short)

    out, taken = jax.lax.while_loop(more, lambda c: (join_step(spec, sub_inp, c[0]), c[1] + 1),
                                    (rows, jnp.int32(0)))
    return _scatter(spec, state, out, at, pad), taken


def join_step(spec: EngineSpec, inp: Inputs, state: DecodeState, given=None, allowed=None) -> DecodeState:
    """``step`` of a split paged state (its pools joined for the step, split after)."""
    return split(step(spec, inp, join(state), given, allowed))


def decode_loop(spec: EngineSpec, inp: Inputs, rows: Rows) -> DecodeState:
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
run_rows_jit = jax.jit(_on_mesh(run_rows), static_argnames=("spec",), donate_argnames=("state",))
propose_rows_jit = jax.jit(_on_mesh(propose_rows), static_argnames=("spec",))
step_rows_jit = jax.jit(_on_mesh(step_rows), static_argnames=("spec",), donate_argnames=("state",))
forward_rows_jit = jax.jit(_on_mesh(forward_rows), static_argnames=("spec",), donate_argnames=("state",))
commit_rows_jit = jax.jit(_on_mesh(commit_rows), static_argnames=("spec",), donate_argnames=("state",))
put_prefix_jit = jax.jit(put_prefix, donate_argnames=("state",))
restore_jit = jax.jit(restore, static_argnames=("spec",), donate_argnames=("state",))
decode_loop_jit = jax.jit(_on_mesh(decode_loop), static_argnames=("spec",))


def empty(spec: EngineSpec, inp: Inputs, rows: Rows, pages: int = 0) -> DecodeState:
    """A state of ``rows``' row count with every row free (zeros: an admission overwrites a whole row); paged
    (``spec.page``): with empty pools of ``pages`` pages and no row owning any."""
    pools = table = None
    if spec.page:
        dtype = jax.tree_util.tree_leaves(inp.tparams)[0].dtype
        pools = tuple(new_pools(specs, pages, spec.page, dtype, spec.cache_len, spec.max_block)
                      for specs in page_specs(spec))
        table = jnp.full((rows.lens.shape[0], spec.cache_len // spec.page), NO_PAGE, jnp.int32)
    shapes = jax.eval_shape(functools.partial(prefill, spec), inp, rows, pools, table)
    state = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return spec.place(state.replace(finish=jnp.full(state.finish.shape, Finish.FREE, jnp.int32),
                                    sampling=state.sampling.off(jnp.ones(state.finish.shape, bool)),  # free rows
                                    pages=table))


def page_bytes(spec: EngineSpec, inp: Inputs) -> int:
    """Bytes one page costs: its tokens' K/V in every paged layer of the target and the draft."""
    dtype = jax.tree_util.tree_leaves(inp.tparams)[0].dtype
    return sum(state_lib.page_bytes(specs, spec.page, dtype, spec.cache_len, spec.max_block)
               for specs in page_specs(spec))


def pages_every_layer(spec: EngineSpec) -> bool:
    """Whether pages hold every layer's whole state (no sliding ring, no recurrent state): what a cached prefix
    needs, since only pages can be shared."""
    def paged(s):
        s = s.spec if isinstance(s, state_lib.StackedSpec) else s
        if isinstance(s, state_lib.SharedKVSpec):
            return True
        return isinstance(s, state_lib.KVSpec) and s.paged(spec.cache_len, spec.max_block, spec.page)

    return all(paged(s) for specs in page_specs(spec) for s in specs)


def page_specs(spec: EngineSpec) -> tuple[tuple, tuple]:
    """The layer specs (``state.KVSpec``, ...; a scanned group's ``StackedSpec``) of the target's cache and the draft's
    (none for plain decoding)."""
    target = target_lib.state_specs(spec.target_config)
    return target, draft_lib.state_specs(spec.draft_config) if spec.speculative else ()


# positional: an engine program's arguments (spec, inputs, state, ...: ``Engine._compiled``), spec and inputs unused
def take(spec: EngineSpec, inp: Inputs, state: DecodeState, at, *, logprobs: bool = False):
    """The fields a result reads, of rows ``at`` [A] only (what ``types.row_result`` takes, prompt lengths added;
    ``logprobs``: the rows' log-probabilities too)."""
    pick = lambda x: jnp.take(x, at, axis=0)  # noqa: E731
    out = dict(tokens=pick(state.tokens), generated=pick(state.generated), acceptance=pick(state.acceptance),
               verified=pick(state.verified), steps=pick(state.steps), finish=pick(state.finish),
               prompt_length=pick(state.prompt_len))
    return dict(out, logps=pick(state.logps)) if logprobs else out


def recent(state: DecodeState, width: int, steps: int = 1):
    """Per row: its counters, its cache length, its last ``width`` tokens ending at the newest committed one, and
    the acceptance lengths of its last ``steps`` verify steps (oldest first; ``acceptance``: the newest), what a
    streaming host reads after a run of at most ``steps`` steps (each commits at most a block, so ``width`` =
    steps x max block + 1 covers an admission too)."""
    end = state.prompt_len + state.generated
    at = jnp.clip(end[:, None] - width + jnp.arange(width, dtype=end.dtype), 0, state.tokens.shape[1] - 1)
    last = jnp.maximum(state.steps[:, None] - steps + jnp.arange(steps, dtype=state.steps.dtype), 0)
    acceptances = jnp.take_along_axis(state.acceptance, last, axis=1)
    return dict(tail=jnp.take_along_axis(state.tokens, at, axis=1), generated=state.generated, finish=state.finish,
                steps=state.steps, acceptance=acceptances[:, -1], acceptances=acceptances,
                lengths=state.tcache.lengths)


empty_jit = jax.jit(_on_mesh(empty), static_argnames=("spec", "pages"))
take_jit = jax.jit(take, static_argnames=("spec", "logprobs"))


def read(spec: EngineSpec, inp: Inputs, state: DecodeState, *, steps: int):
    """What a streaming host reads after a run of at most ``steps`` steps: ``recent`` of every row, its tail wide
    enough for them (``Engine.progress``)."""
    return recent(state, steps * spec.max_block + 1, steps)


read_jit = jax.jit(read, static_argnames=("spec", "steps"))
