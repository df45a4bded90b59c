"""Speculative decoding with a DFlash draft: prefill, then the whole decode as one ``lax.while_loop``.

Per step and per row: the draft predicts a block [x_n, d_1..d_{K-1}] from its context cache in one
forward; the target verifies it in one forward; the longest prefix with d_k == p_{k-1} is accepted
and p_a (the target's own next token) is the bonus. Committed: p_0..p_a at positions n+1..n+a+1, so
n (the committed length of both caches) grows by a+1, and the verified tokens' features become new
draft context. Both caches roll back through the per-layer state protocol (``DecodeCache.commit``:
each layer keeps the first a+1 tokens of the verify forward in its own way). With no draft (or a
block of 1) the same loop is plain autoregressive decoding, the baseline of every comparison.

Adaptive verify (``verify_lengths``): the target verifies only the first L block tokens, L one of a few
static lengths chosen each step from the draft's own confidence (``_verify_choice``; one L for the
batch). Every layer state is written for those L tokens only, and a+1 <= L are kept, so the state
protocol is unchanged; L depends on the draft's distributions, never on the tokens drawn from them, so
the speculation is cut before any draw and the output stays exact (greedy: identical).

Tree verification (``tree_budget`` N > 0; ``_tree_verify``, README "Tree verification"): the draft's one forward gives a
tree of the N most probable prefixes (``tree.build_tree``); the target verifies [pending, N nodes] at
positions n + depth in one forward, each token seeing the cache [0, n) and its tree ancestors
(``tree.ancestor_mask``); the walk (``tree.walk``) follows the target's own tokens from the root, and the
accepted path's K/V and features are compacted to positions n..n+a, so ``_commit`` and the rollback protocol
are the chain's. Attention-only targets (``_check_tree_target``; no Gated DeltaNet).

Counting: the first token comes from the prefill; each verify step's acceptance length is the
number of tokens it committed: a+1 (accepted drafts plus the bonus token, as in the paper), between 1
and the block size, except that the row's last step counts only the tokens kept before
max_new_tokens or the first stop token cut it (as the PyTorch reference's ``dflash_generate`` does).
So tokens generated = 1 + sum(acceptance lengths), always.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Iterator, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import draft as draft_lib
from dflash_jax import proposers, sharding
from dflash_jax import target as target_lib
from dflash_jax import tree as tree_lib
from dflash_jax.attention import DECODE_IMPLS
from dflash_jax.config import DraftConfig
from dflash_jax.families import family_of
from dflash_jax.proposers import Proposer, StepView
from dflash_jax.sampling import SamplingParams, accepted_length, choose, filtered_scores, rejection_sample
from dflash_jax.state import DecodeCache, KVSpec, SharedKVSpec, put_rows
from dflash_jax.target import Target, check_token_ids

FINISH_REASONS = ("running", "length", "stop")


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """Everything static about a compiled decode loop (the one frozen object its functions are bound to)."""

    target_config: Any  # the target's config (any family)
    draft_config: DraftConfig | None
    block_size: int
    greedy: bool
    mesh: Any = None  # jax.sharding.Mesh the params live on (None: one device); rows and caches go over data
    acceptance: str = "rejection"  # "match" | "rejection" (sampling.py); greedy decoding always matches
    proposer: Proposer | None = None  # what a step drafts (``proposers``); None: plain decoding
    attention_impl: str = "auto"  # target decode / verify and draft attention (``attention.decode_attention``)
    verify_lengths: tuple[int, ...] | None = None  # adaptive verify: the lengths a step may verify (None: the block)
    tree_budget: int = 0  # tree verification with this many draft nodes (``_tree_verify``); 0: the chain

    def place(self, state: "DecodeState") -> "DecodeState":
        """Pin the decode state's layout on the mesh (rows over data*fsdp, KV heads over tensor)."""
        if self.mesh is None:
            return state
        names = ("tokens", "generated", "budget", "finish", "acceptance", "verified", "steps")
        rows = sharding.constrain_batch(tuple(getattr(state, n) for n in names), self.mesh)
        return state.replace(**dict(zip(names, rows)),
                             tcache=sharding.constrain_cache(state.tcache, self.mesh),
                             dcache=sharding.constrain_cache(state.dcache, self.mesh))

    @property
    def speculative(self) -> bool:
        return self.draft_config is not None and self.block_size > 1

    @property
    def rejection(self) -> bool:
        return self.speculative and not self.greedy and self.acceptance == "rejection" and not self.tree_budget

    @property
    def lengths(self) -> tuple[int, ...]:
        """The verify lengths a step chooses from (one static forward each)."""
        return self.verify_lengths or (self.block_size,)

    @property
    def feature_layer_ids(self) -> tuple[int, ...]:
        return self.draft_config.target_layer_ids if self.speculative else ()


@flax.struct.dataclass
class Inputs:
    """The compiled loop's runtime inputs (rows first where they have rows)."""

    tparams: Any
    dparams: Any  # None for plain decoding
    prompts: jax.Array  # [B, P] int32, padded to a bucket
    lens: jax.Array  # [B] prompt lengths
    budget: jax.Array  # [B] most tokens each row may generate
    stop_ids: jax.Array  # [8k] int32 stop token ids, padded with -1
    sampling: tuple  # (temperature, top_k, top_p) scalars
    key: jax.Array
    mask_token_id: jax.Array
    threshold: jax.Array  # the adaptive verify rule's (``_verify_choice``; unused with one verify length)
    proposer_args: Any = None  # the proposer's runtime arrays (``Proposer.arrays``)


@flax.struct.dataclass
class DecodeState:
    tokens: jax.Array  # [B, S] tokens by position; tokens[b, n_b] is the pending (not yet cached) token
    tcache: DecodeCache  # target layer states; lengths = n, the committed tokens they hold
    dcache: DecodeCache | None  # draft context K/V; lengths == tcache.lengths at every step
    generated: jax.Array  # [B] tokens generated so far, the pending one included
    budget: jax.Array  # [B] most tokens the row may generate
    finish: jax.Array  # [B] int32 index into FINISH_REASONS
    acceptance: jax.Array  # [B, S] acceptance length of each verify step
    verified: jax.Array  # [B, S] tokens each verify step's target forward ran on (its verify length)
    steps: jax.Array  # [B] verify steps taken
    key: jax.Array

    @property
    def done(self):
        return self.finish > 0


def _prefill(spec: EngineSpec, inp: Inputs, cache_len: int):
    tparams, dparams, prompts, lens, budget = inp.tparams, inp.dparams, inp.prompts, inp.lens, inp.budget
    b, p = prompts.shape
    dtype = jax.tree_util.tree_leaves(tparams)[0].dtype
    # max_block: a sliding ring must also hold a tree verify's N + 1 tokens beside its window
    max_block = max(spec.block_size, spec.tree_budget + 1)
    tcache = target_lib.new_cache(spec.target_config, b, cache_len, dtype, max_block=max_block)
    offsets = jnp.arange(p, dtype=jnp.int32)
    positions = jnp.where(offsets < lens[:, None], offsets, -1)  # padding: never cached, never attended
    logits, features, tcache = target_lib.forward(spec.target_config, tparams, prompts, positions, tcache,
                                                  spec.feature_layer_ids, lens - 1,
                                                  attention_impl=spec.attention_impl)
    key, sub = jax.random.split(inp.key)
    first = choose(logits[:, 0], sub, *inp.sampling, greedy=spec.greedy)
    rows = jnp.arange(b)
    tokens = jnp.zeros((b, cache_len), jnp.int32).at[:, :p].set(prompts).at[rows, lens].set(first)
    dcache = None
    if spec.speculative:
        dcache = draft_lib.new_cache(spec.draft_config, b, cache_len, dtype)
        dcache = draft_lib.materialize(spec.draft_config, dparams, dcache, features, positions).commit(lens)
    stopped = jnp.isin(first, inp.stop_ids)
    finish = jnp.where(stopped, 2, jnp.where(budget <= 1, 1, 0)).astype(jnp.int32)
    return spec.place(DecodeState(tokens=tokens, tcache=tcache.commit(lens), dcache=dcache,
                                  generated=jnp.ones((b,), jnp.int32), budget=budget, finish=finish,
                                  acceptance=jnp.zeros((b, cache_len), jnp.int32),
                                  verified=jnp.zeros((b, cache_len), jnp.int32), steps=jnp.zeros((b,), jnp.int32),
                                  key=key))


def _verify_choice(confidence, active, lengths: tuple[int, ...], threshold):
    """Index into ``lengths`` (ascending) of this step's verify length, from the draft's own confidence
    [B, K-1] (its largest probability at each block position): the cumulative product estimates P(d_1..d_j all
    accepted), so its sum over the positions a longer length adds is the tokens the extra verify work is
    expected to gain. Longer lengths are taken while that gain per added position, averaged over the
    active rows (the work is paid for every row), is at least ``threshold``; the rule is monotone (later
    positions never gain more), so this is the longest such length."""
    reach = jnp.cumprod(confidence, axis=1)
    weight = active / jnp.maximum(jnp.sum(active), 1)
    gains = jnp.stack([jnp.sum(weight * jnp.mean(reach[:, lo - 1:hi - 1], axis=1))
                       for lo, hi in zip(lengths[:-1], lengths[1:])])
    return jnp.sum(jnp.cumprod(gains >= threshold))


# positional: _verify_chosen binds the step's fixed operands in this order (functools.partial)
def _verify(spec: EngineSpec, tparams, dparams, block, positions, active, tcache, dcache, length: int):
    """The target forward on the first ``length`` (static) tokens of the block, and their features as new draft
    context -> (logits [B, K, V], zero past ``length``; tcache; dcache), every layer state written for those
    tokens only (the rest of the block is never cached, so no state needs rolling back past them)."""
    logits, features, tcache = target_lib.forward(spec.target_config, tparams, block[:, :length], positions[:, :length],
                                                  tcache, spec.feature_layer_ids, attention_impl=spec.attention_impl)
    if spec.speculative:  # slots past n+a are masked until overwritten
        ctx_positions = jnp.where(active[:, None], positions[:, :length], -1)
        dcache = spec.proposer.update_context(spec, dparams, dcache, features, ctx_positions)
    return jnp.pad(logits, ((0, 0), (0, block.shape[1] - length), (0, 0))), tcache, dcache


# positional: one decode step's operands, in the order the loop body holds them
def _verify_chosen(spec: EngineSpec, choice, tparams, dparams, tcache, dcache, block, positions, active):
    """``_verify`` at length ``spec.lengths[choice]``: one static forward per length, each inside a while loop
    that runs once when chosen and not at all otherwise (XLA updates a loop's carried caches in place, where
    ``lax.switch`` copied every cache of both models on every step)."""
    verify = functools.partial(_verify, spec, tparams, dparams, block, positions, active)
    if len(spec.lengths) == 1:
        return verify(tcache, dcache, length=spec.lengths[0])
    carry = (jnp.zeros(block.shape + (spec.target_config.vocab_size,), jnp.float32), tcache, dcache)
    for i, length in enumerate(spec.lengths):
        def once(c, length=length):
            _, (_, t, d) = c
            return jnp.bool_(False), verify(t, d, length=length)

        carry = jax.lax.while_loop(lambda c: c[0], once, (choice == i, carry))[1]
    return carry


def _view(spec: EngineSpec, inp: Inputs, state: DecodeState, key) -> StepView:
    """The proposer's view of this step: the block [pending token, MASK...] at each row's committed length."""
    b, k = state.tokens.shape[0], spec.block_size
    n = state.tcache.lengths
    pending = state.tokens[jnp.arange(b), n]
    block = jnp.concatenate([pending[:, None], jnp.full((b, k - 1), inp.mask_token_id, jnp.int32)], axis=1)
    # the block positions a row can still commit (the reference drafts a shorter block at the end)
    block_len = jnp.clip(state.budget - state.generated + 1, 1, k)
    return StepView(inp.tparams, inp.dparams, block, n, block_len, state.dcache, key, inp.sampling, inp.proposer_args)


def _chain_verify(spec: EngineSpec, inp: Inputs, state: DecodeState, k_draft, k_target):
    """Draft a chain d_1..d_{K-1} and verify it -> (p_0..p_{K-1}, accepted drafts a [B], verify length, caches)."""
    tparams, dparams, sampling = inp.tparams, inp.dparams, inp.sampling
    b, k = state.tokens.shape[0], spec.block_size
    n = state.tcache.lengths
    active = ~state.done
    choice = jnp.int32(0)
    if spec.speculative:
        view = _view(spec, inp, state, k_draft)
        proposal = spec.proposer.propose(spec, view)
        block = view.block.at[:, 1:].set(proposal.tokens)
        if len(spec.lengths) > 1:  # confidence: the largest probability (never the drawn token's: see README)
            scores = proposal.scores
            confidence = jnp.exp(jnp.max(scores, axis=-1) - jax.nn.logsumexp(scores, axis=-1))
            choice = _verify_choice(confidence, active, spec.lengths, inp.threshold)
    else:
        block = state.tokens[jnp.arange(b), n][:, None]
    positions = n[:, None] + jnp.arange(k, dtype=jnp.int32)
    logits, tcache, dcache = _verify_chosen(spec, choice, tparams, dparams, state.tcache, state.dcache, block,
                                            positions, active)
    length = jnp.asarray(spec.lengths, jnp.int32)[choice]
    if spec.rejection:  # posterior: d_1..d_a, then the residual / bonus token
        a, posterior = rejection_sample(proposal.scores, proposal.tokens, filtered_scores(logits, *sampling),
                                        k_target, verified=length - 1)
    else:
        posterior = choose(logits, k_target, *sampling, greedy=spec.greedy)  # p_0..p_{k-1}
        a = jnp.minimum(accepted_length(block[:, 1:], posterior), length - 1) if k > 1 else jnp.zeros((b,), jnp.int32)
    return posterior, a, length, tcache, dcache


def _tree_verify(spec: EngineSpec, inp: Inputs, state: DecodeState, k_draft, k_target):
    """Draft a tree of N = ``spec.tree_budget`` nodes, verify [root, nodes] in one masked target forward, walk
    it (``tree.walk``) and compact the accepted path into both caches -> (the target's tokens along the path
    p_0..p_{K-1}, accepted nodes a [B], verify length N + 1, caches). Exact: see README "Tree verification"."""
    b, k = state.tokens.shape[0], spec.block_size
    n = state.tcache.lengths
    view = _view(spec, inp, state, k_draft)
    max_depth = jnp.clip(state.budget - state.generated - 1, 0, k - 1)  # drafts past it could not be committed
    tree = spec.proposer.propose_tree(spec, view, max_depth)
    tokens = jnp.concatenate([view.block[:, :1], tree.tokens], axis=1)
    positions = n[:, None] + jnp.concatenate([jnp.zeros((b, 1), jnp.int32), tree.depths], axis=1)
    logits, features, tcache = target_lib.forward(spec.target_config, inp.tparams, tokens, positions, state.tcache,
                                                  spec.feature_layer_ids, attention_impl=spec.attention_impl,
                                                  new_mask=tree_lib.ancestor_mask(tree.parents, d_max=k - 1))
    y = choose(logits, k_target, *inp.sampling, greedy=spec.greedy)  # every node independently (one categorical)
    path, a, _ = tree_lib.walk(tree, y)  # path [B, K]: accepted slots root first, -1 after
    on_path, slots = path >= 0, jnp.maximum(path, 0)
    dst = n[:, None] + jnp.arange(k, dtype=jnp.int32)
    tcache = tcache.compact(jnp.where(on_path, n[:, None] + path, -1), dst)  # slot n+path[j] -> n+j
    ctx_positions = jnp.where(~state.done[:, None] & on_path, dst, -1)
    dcache = spec.proposer.update_context(spec, inp.dparams, state.dcache,
                                          jnp.take_along_axis(features, slots[..., None], axis=1), ctx_positions)
    return jnp.take_along_axis(y, slots, axis=1), a, jnp.int32(spec.tree_budget + 1), tcache, dcache


# positional: one decode step's operands, in the order the loop body holds them
def _commit(spec: EngineSpec, inp: Inputs, state: DecodeState, posterior, a, length, tcache, dcache, key):
    """Commit p_0..p_a (``posterior`` [B, K]) at positions n+1.., cut at the budget and just after the first stop
    token; both caches keep a+1 verified tokens (x_n, d_1..d_a); done rows do not change."""
    b, cache_len = state.tokens.shape
    active = ~state.done
    offsets = jnp.arange(posterior.shape[1], dtype=jnp.int32)
    positions = state.tcache.lengths[:, None] + offsets
    limit = jnp.minimum(a + 1, state.budget - state.generated)
    is_stop = jnp.isin(posterior, inp.stop_ids) & (offsets[None] < limit[:, None])
    hit_stop = is_stop.any(axis=1)
    keep = jnp.where(hit_stop, jnp.argmax(is_stop, axis=1) + 1, limit)
    write = active[:, None] & (offsets[None] < keep[:, None])
    tokens = put_rows(state.tokens, jnp.where(write, positions + 1, cache_len), posterior)
    generated = state.generated + jnp.where(active, keep, 0)
    finish = jnp.where(active & hit_stop, 2, jnp.where(active & (generated >= state.budget), 1, state.finish))
    kept = jnp.where(active, a + 1, 0)  # verified tokens whose state every layer keeps: x_n, d_1..d_a
    step = jnp.where(active, state.steps, cache_len)
    return spec.place(DecodeState(tokens=tokens, tcache=tcache.commit(kept),
                                  dcache=dcache.commit(kept) if spec.speculative else dcache,
                                  generated=generated, budget=state.budget, finish=finish.astype(jnp.int32),
                                  acceptance=put_rows(state.acceptance, step[:, None], keep[:, None]),
                                  verified=put_rows(state.verified, step[:, None],
                                                    jnp.broadcast_to(length, (b,))[:, None]),
                                  steps=state.steps + active.astype(jnp.int32), key=key))


def _step(spec: EngineSpec, inp: Inputs, state: DecodeState) -> DecodeState:
    """One draft + verify + commit for every row that is not done (done rows do not change)."""
    key, k_draft, k_target = jax.random.split(state.key, 3)
    verify = _tree_verify if spec.tree_budget else _chain_verify
    posterior, a, length, tcache, dcache = verify(spec, inp, state, k_draft, k_target)
    return _commit(spec, inp, state, posterior, a, length, tcache, dcache, key)


def _on_mesh(fn):
    """``fn(spec, ...)`` traced with ``spec.mesh`` as the abstract mesh: its Pallas kernels run per shard."""
    @functools.wraps(fn)
    def traced(spec: EngineSpec, *args, **kw):
        with sharding.mesh_scope(spec.mesh):
            return fn(spec, *args, **kw)

    return traced


@functools.partial(jax.jit, static_argnames=("spec", "cache_len"))
@_on_mesh
def _generate(spec: EngineSpec, inp: Inputs, *, cache_len: int):
    state = _prefill(spec, inp, cache_len)
    return jax.lax.while_loop(lambda s: ~jnp.all(s.done), functools.partial(_step, spec, inp), state)


_prefill_jit = jax.jit(_on_mesh(_prefill), static_argnames=("spec", "cache_len"))
_step_jit = jax.jit(_on_mesh(_step), static_argnames=("spec",), donate_argnames=("state",))


@dataclasses.dataclass
class GenerationResult:
    """One row's output. ``output_ids`` = prompt + generated ids (after a stop token: nothing)."""

    output_ids: list[int]
    prompt_length: int
    acceptance_lengths: list[int]
    verify_lengths: list[int]  # tokens each verify step's target forward ran on (the block, or the adaptive choice)
    target_forwards: int  # prefill + verify steps
    finish_reason: str
    wall_time_s: float
    tokens_per_second: float
    time_to_first_token_s: float | None = None  # streaming only: prefill until the first token reached the host

    @property
    def generated_ids(self) -> list[int]:
        return self.output_ids[self.prompt_length:]

    @property
    def num_generated(self) -> int:
        return len(self.output_ids) - self.prompt_length

    @property
    def mean_acceptance_length(self) -> float:
        return float(np.mean(self.acceptance_lengths)) if self.acceptance_lengths else 0.0

    def to_json(self) -> dict:
        return {"output_ids": self.output_ids, "prompt_length": self.prompt_length,
                "generated_ids": self.generated_ids, "num_generated": self.num_generated,
                "acceptance_lengths": self.acceptance_lengths, "verify_lengths": self.verify_lengths,
                "tau": self.mean_acceptance_length,
                "target_forwards": self.target_forwards, "finish_reason": self.finish_reason,
                "wall_time_s": self.wall_time_s, "tokens_per_second": self.tokens_per_second,
                "time_to_first_token_s": self.time_to_first_token_s}


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclasses.dataclass(frozen=True)
class _Request:
    spec: EngineSpec
    inputs: Inputs
    cache_len: int
    lens: np.ndarray


def cache_length(prompt_lengths, budget, block_size: int, cache_len: int | None = None) -> int:
    """Cache slots per row for these prompt lengths and budgets: prompt bucket or prompt + budget, plus a
    block, rounded up to 128 (buckets bound the number of compilations); at least ``cache_len``."""
    lens, budget = np.asarray(prompt_lengths), np.asarray(budget)
    p_bucket = _round_up(int(lens.max()), 32)
    return max(_round_up(max(int((lens + budget).max()), p_bucket) + block_size + 1, 128), cache_len or 0)


# How the option checks below name the options in their messages: the library's parameter names (the CLIs
# pass their flags: ``infer.common.FLAGS``).
PARAMS = {"max_new_tokens": "max_new_tokens", "seed": "seed", "block_size": "block_size", "draft": "a draft"}


def check_budget_and_seed(max_new_tokens, seed, names=PARAMS) -> None:
    """``max_new_tokens`` >= 1 and ``seed`` in [0, 2**63): checked by every decode call and, before any weight
    is loaded, by the CLIs (with their flags' ``names``)."""
    is_int = isinstance(max_new_tokens, (int, np.integer))
    if not is_int or max_new_tokens < 1:
        raise ValueError(f"{names['max_new_tokens']} must be {'' if is_int else 'an integer '}>= 1, "
                         f"got {max_new_tokens!r}")
    if not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2 ** 63:
        raise ValueError(f"{names['seed']} must be an integer in [0, 2**63), got {seed!r}")


def resolve_block_size(block_size, trained: int | None, names=PARAMS) -> int:
    """The block to decode with: ``block_size`` in [1, ``trained``] (the draft's trained block; None: that
    block), or 1 without a draft (``trained`` None). Shared with the CLIs' checks before loading."""
    if trained is None:
        if block_size not in (None, 1):
            raise ValueError(f"{names['block_size']} {block_size} needs {names['draft']}; plain decoding uses a "
                             "block of 1")
        return 1
    block_size = trained if block_size is None else block_size
    if not 1 <= block_size <= trained:
        raise ValueError(f"{names['block_size']} must be in [1, {trained}] (the draft was trained with block_size "
                         f"{trained}), got {block_size}")
    return block_size


def _prepare(target: Target, draft, prompts, *, max_new_tokens, sampling: SamplingParams, block_size=None,
             stop_token_ids=None, seed=0, max_length=None, proposer: Proposer | None = None,
             attention_impl: str = "auto", cache_len: int | None = None, verify_lengths=None,
             verify_threshold: float = 0.1, tree_budget: int = 0) -> _Request:
    """Validate everything before any compute and build padded, bucketed inputs."""
    if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
        prompts = list(prompts)
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    if all(isinstance(t, (int, np.integer)) for t in prompts):
        prompts = [prompts]  # a single prompt given as a flat list
    vocab = target.config.vocab_size
    rows = [check_token_ids(np.asarray(p).reshape(1, -1) if len(p) else np.zeros((1, 0), np.int32), vocab,
                            f"prompt {i}")[0] for i, p in enumerate(prompts)]
    check_budget_and_seed(max_new_tokens, seed)
    if draft is not None:
        draft_lib.check_fits(target, draft)
    elif proposer is not None and block_size in (None, 1):
        raise ValueError("a proposer needs a draft")
    block_size = resolve_block_size(block_size, draft.config.block_size if draft is not None else None)
    verify_lengths = _check_verify_lengths(verify_lengths, block_size, verify_threshold)
    lens = np.array([len(r) for r in rows], np.int32)
    limit = max_length or target.config.max_position_embeddings
    too_long = [i for i, n in enumerate(lens) if n >= limit]
    if too_long:
        raise ValueError(f"prompt {too_long[0]} has {lens[too_long[0]]} tokens; the max length is {limit} "
                         "(prompt + generated tokens), so nothing can be generated")
    if attention_impl not in DECODE_IMPLS:
        raise ValueError(f"attention_impl must be one of {', '.join(DECODE_IMPLS)}, got {attention_impl!r}")
    budget = np.minimum(max_new_tokens, limit - lens).astype(np.int32)
    p_bucket = _round_up(int(lens.max()), 32)
    _check_tree_budget(tree_budget, draft is not None and block_size > 1, verify_lengths)
    cache_len = cache_length(lens, budget, max(block_size, tree_budget + 1), cache_len)
    if tree_budget:
        _check_tree_target(target.config, block_size)
    padded = np.zeros((len(rows), p_bucket), np.int32)
    for i, r in enumerate(rows):
        padded[i, :len(r)] = r
    stops = sorted({int(s) for s in (stop_token_ids or ())})
    stop_arr = np.full((_round_up(max(len(stops), 1), 8),), -1, np.int32)
    stop_arr[:len(stops)] = stops
    speculative = draft is not None and block_size > 1
    dparams = draft.params if speculative else None
    mesh = sharding.mesh_of(target.params, dparams)
    if speculative and proposer is None:
        proposer = proposers.for_draft(draft.config, sampled=not sampling.greedy and sampling.acceptance == "rejection")
    spec = EngineSpec(target.config, draft.config if draft is not None else None, block_size, sampling.greedy, mesh,
                      sampling.acceptance, proposer if speculative else None, attention_impl, verify_lengths,
                      tree_budget)
    extra = spec.proposer.arrays(spec, len(rows), cache_len) if speculative else None
    batch = (padded, lens, budget)
    if mesh is not None:  # rows over data*fsdp: pad with 1-token rows that finish at prefill (budget 1)
        pad = sharding.pad_rows(len(rows), mesh)
        batch = sharding.shard_batch((np.pad(padded, ((0, pad), (0, 0))), np.pad(lens, (0, pad), constant_values=1),
                                      np.pad(budget, (0, pad), constant_values=1)), mesh)
        if extra is not None:  # the proposer's arrays are rows first
            extra = sharding.shard_batch(jax.tree_util.tree_map(
                lambda x: np.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1)), extra), mesh)
    samp = (np.float32(max(sampling.temperature, 1e-6)), np.int32(sampling.top_k), np.float32(sampling.top_p))
    inputs = Inputs(tparams=target.params, dparams=dparams, prompts=batch[0], lens=batch[1], budget=batch[2],
                    stop_ids=stop_arr, sampling=samp, key=jax.random.PRNGKey(seed),
                    mask_token_id=np.int32(draft.config.mask_token_id if draft is not None else 0),
                    threshold=np.float32(verify_threshold), proposer_args=extra)
    return _Request(spec, inputs, cache_len, lens)


def _check_verify_lengths(lengths, block_size: int, threshold) -> tuple[int, ...] | None:
    """The adaptive verify lengths as the engine takes them (None: always the whole block), checked."""
    if not isinstance(threshold, (int, float, np.floating)) or not np.isfinite(threshold):
        raise ValueError(f"verify_threshold must be a finite number, got {threshold!r}")
    if lengths is None:
        return None
    lengths = tuple(sorted({int(x) for x in lengths}))
    if block_size == 1:
        raise ValueError("verify_lengths needs a draft and a block size > 1")
    if not lengths or lengths[0] < 1 or lengths[-1] > block_size:
        raise ValueError(f"verify_lengths must be in [1, {block_size}] (the block size), got {list(lengths)}")
    return None if lengths == (block_size,) else lengths


def _check_tree_budget(tree_budget, speculative: bool, verify_lengths) -> None:
    """tree_budget: an integer >= 0; > 0 needs a draft (block size > 1) and excludes adaptive verify."""
    if not isinstance(tree_budget, (int, np.integer)) or isinstance(tree_budget, bool) or tree_budget < 0:
        raise ValueError(f"tree_budget must be an integer >= 0, got {tree_budget!r}")
    if tree_budget and not speculative:
        raise ValueError("tree_budget needs a draft and a block size > 1")
    if tree_budget and verify_lengths is not None:
        raise ValueError("tree_budget cannot be combined with verify_lengths")


def _check_tree_target(cfg, block_size: int) -> None:
    """Tree verification needs attention layers (full, or sliding with a window >= the block: the tree's own
    keys get no window): a ValueError names what is not (recurrent Gated DeltaNet layers, narrow windows)."""
    for i, s in enumerate(family_of(cfg).state_specs(cfg)):
        if isinstance(s, SharedKVSpec):  # attends to an earlier attention layer's keys
            continue
        if not isinstance(s, KVSpec):
            raise ValueError(f"tree_budget > 0 is not supported for {cfg.model_type} targets: layer {i} is "
                             "recurrent (Gated DeltaNet); use the chain (tree_budget=0)")
        if s.window is not None and s.window < block_size:
            raise ValueError(f"tree_budget > 0 needs sliding windows >= the block size {block_size}: layer {i} "
                             f"has a sliding window of {s.window}; use the chain (tree_budget=0) or a smaller block")


def _results(state: DecodeState, req: _Request, wall: float) -> list[GenerationResult]:
    tokens, generated, acc, verified, steps, finish = sharding.to_host(
        (state.tokens, state.generated, state.acceptance, state.verified, state.steps, state.finish))
    out = []
    for i, n in enumerate(req.lens):
        total = int(n + generated[i])
        out.append(GenerationResult(
            output_ids=tokens[i, :total].tolist(), prompt_length=int(n),
            acceptance_lengths=acc[i, :steps[i]].tolist(), verify_lengths=verified[i, :steps[i]].tolist(),
            target_forwards=int(steps[i]) + 1,
            finish_reason=FINISH_REASONS[int(finish[i])], wall_time_s=wall,
            tokens_per_second=float(generated[i]) / wall if wall > 0 else float("inf")))
    return out


_compiled: dict = {}


def _executable(req: _Request):
    """AOT-compile once per (spec, shapes) bucket, then run it once on a one-step budget (the same program: the
    budget is an input), so timings exclude compilation and a program's first-execution setup (on CPU a
    cold first run is several times slower than the next)."""
    shapes = jax.tree_util.tree_map(lambda x: (np.shape(x), str(getattr(x, "dtype", type(x))),
                                               str(getattr(x, "sharding", None))), req.inputs)
    key = (req.spec, req.cache_len, str(jax.tree_util.tree_structure(req.inputs)), str(shapes))
    if key not in _compiled:
        run = _generate.lower(req.spec, req.inputs, cache_len=req.cache_len).compile()
        budget = req.inputs.budget  # numpy, or a jax.Array placed on a mesh (kept on its sharding)
        one_step = (jax.jit(lambda b: jnp.minimum(b, 2), out_shardings=budget.sharding)(budget)
                    if isinstance(budget, jax.Array) else np.minimum(budget, 2))  # prefill + one step
        jax.block_until_ready(run(req.inputs.replace(budget=one_step)))
        _compiled[key] = run
    return _compiled[key]


def speculative_generate(target: Target, draft, prompts, *, max_new_tokens: int, block_size: int | None = None,
                         temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                         stop_token_ids: Sequence[int] | None = None, seed: int = 0,
                         max_length: int | None = None, acceptance: str = "rejection",
                         proposer: Proposer | None = None, attention_impl: str = "auto",
                         cache_len: int | None = None, verify_lengths: Sequence[int] | None = None,
                         verify_threshold: float = 0.1, tree_budget: int = 0) -> list[GenerationResult]:
    """Generate for a batch of prompts (lists of ids, ragged) in one device call.

    ``draft=None`` (or ``block_size=1``) is plain autoregressive decoding with the same engine.
    ``acceptance``: "match" or "rejection" (speculative sampling; ``dflash_jax.sampling``) at temperature > 0.
    ``max_length`` caps prompt + generated tokens per row (default: the target's
    max_position_embeddings). ``proposer``: what each step drafts (``dflash_jax.proposers``; default: the
    draft architecture's own rule; benchmarks pass ``synthetic.ReplayProposer``).
    ``attention_impl``: the decode attention (``attention.decode_attention``: "auto" reads only each row's
    length; "reference" attends densely over the whole cache, the unbounded path). ``cache_len``: at least this
    many cache slots per row (a fixed bucket, for benchmarks; default: just enough, rounded up to 128).
    ``verify_lengths`` (e.g. (4, 8, 16)): adaptive verify; each step verifies only as many block tokens as
    the draft's confidence justifies at ``verify_threshold`` (``_verify_choice``), still lossless.
    ``tree_budget`` N > 0: tree verification (``_tree_verify``): each step verifies the N most probable draft
    prefixes plus the pending token (``verify_lengths`` = N + 1); attention-only targets; lossless.
    Returns one ``GenerationResult`` per prompt; wall time excludes compilation and first-run setup.
    """
    req = _prepare(target, draft, prompts, max_new_tokens=max_new_tokens, block_size=block_size,
                   sampling=SamplingParams(temperature, top_k, top_p, acceptance), stop_token_ids=stop_token_ids,
                   seed=seed, max_length=max_length, proposer=proposer, attention_impl=attention_impl,
                   cache_len=cache_len, verify_lengths=verify_lengths, verify_threshold=verify_threshold,
                   tree_budget=tree_budget)
    run = _executable(req)
    start = time.perf_counter()
    state = jax.block_until_ready(run(req.inputs))
    return _results(state, req, time.perf_counter() - start)


def generate(target: Target, prompts, *, max_new_tokens: int, **kw) -> list[GenerationResult]:
    """Plain autoregressive decoding (the baseline), same engine and options."""
    return speculative_generate(target, None, prompts, max_new_tokens=max_new_tokens, **kw)


def stream_generate(target: Target, draft, prompts, *, max_new_tokens: int, block_size: int | None = None,
                    temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                    stop_token_ids: Sequence[int] | None = None, seed: int = 0,
                    max_length: int | None = None, acceptance: str = "rejection",
                    attention_impl: str = "auto", verify_lengths: Sequence[int] | None = None,
                    verify_threshold: float = 0.1,
                    tree_budget: int = 0) -> Iterator[list[list[int]] | list[GenerationResult]]:
    """Host loop over the same jitted step: yields, after prefill and each step, the new token ids of
    every row (a list per row), and finally the list of ``GenerationResult`` (with the time to the first
    token). Prefill and step are compiled and run once before the clock starts, so timings exclude
    compilation as in ``speculative_generate`` (whose options these are)."""
    req = _prepare(target, draft, prompts, max_new_tokens=max_new_tokens, block_size=block_size,
                   sampling=SamplingParams(temperature, top_k, top_p, acceptance), stop_token_ids=stop_token_ids,
                   seed=seed, max_length=max_length, attention_impl=attention_impl, verify_lengths=verify_lengths,
                   verify_threshold=verify_threshold, tree_budget=tree_budget)

    def prefill():
        return _prefill_jit(req.spec, req.inputs, cache_len=req.cache_len)

    step = functools.partial(_step_jit, req.spec, req.inputs)
    jax.block_until_ready(step(prefill()))  # warm-up
    start = time.perf_counter()
    state, first = prefill(), None
    seen = np.zeros(len(req.lens), np.int64)
    while True:
        tokens, generated, done = sharding.to_host((state.tokens, state.generated, state.done))
        first = time.perf_counter() - start if first is None else first
        yield [tokens[i, n + seen[i]:n + generated[i]].tolist() for i, n in enumerate(req.lens)]
        seen = generated.astype(np.int64)
        if done.all():
            break
        state = step(state)
    yield [dataclasses.replace(r, time_to_first_token_s=first)
           for r in _results(state, req, time.perf_counter() - start)]


def lower_step(target: Target, draft, prompts, *, max_new_tokens: int, attention_impl: str = "auto", **kw):
    """One decode step (draft + verify + commit of every row) lowered after a real prefill of ``prompts`` (the
    options of ``speculative_generate``, greedy) -> (lowered step, the prefilled ``DecodeState`` it takes, donated):
    ``.compile()`` it to read the step's HLO, memory and collectives (``dflash_jax.hlo``,
    ``scripts/mesh_step_costs.py``, ``tests/test_step_copies.py``)."""
    req = _prepare(target, draft, prompts, max_new_tokens=max_new_tokens, sampling=SamplingParams(0.0, 0, 1.0),
                   attention_impl=attention_impl, **kw)
    state = _prefill_jit(req.spec, req.inputs, cache_len=req.cache_len)
    return _step_jit.lower(req.spec, req.inputs, state), state
