"""One decode step's draft, verification and commit: the chain (``chain_verify``, with the adaptive verify length
``verify_choice``), the tree (``tree_verify``), and ``commit`` (what both keep).

Chain, per row: the draft predicts a block [x_n, d_1..d_{K-1}] from its context cache in one forward; the target
verifies it in one forward; the longest prefix with d_k == p_{k-1} is accepted and p_a (the target's own next
token) is the bonus. Committed: p_0..p_a at positions n+1..n+a+1, so n (the committed length of both caches) grows
by a+1, and the verified tokens' features become new draft context. Both caches roll back through the per-layer
state protocol (``LayerStates.commit``). With no draft (or a block of 1) the same step is plain autoregressive
decoding, the baseline of every comparison.

Adaptive verify (``verify_lengths``): the target verifies only the first L block tokens, L one of a few static
lengths chosen each step from the draft's own confidence (``verify_choice``; one L for the batch). L depends on the
draft's distributions, never on the tokens drawn from them, so the output stays exact (greedy: identical).

Tree verification (``tree_budget`` N > 0; docs/tree-verification.md): the draft's one forward gives a tree of the N
most probable prefixes (``tree.build_tree``); the target verifies [pending, N nodes] at positions n + depth in one
forward, each token seeing the cache [0, n) and its tree ancestors; the walk follows the target's own tokens from
the root, and the accepted path's K/V and features are compacted to positions n..n+a, so ``commit`` and the
rollback protocol are the chain's (a recurrent layer stashes every slot and folds in the path).

Counting: each verify step's acceptance length is the number of tokens it committed: a+1 (accepted drafts plus the
bonus token, as in the paper), except that the row's last step counts only the tokens kept before its budget or
its first stop token cut it. So tokens generated = 1 + sum(acceptance lengths), always.

Per-row sampling: every row has its own temperature / top-k / top-p and key (``DecodeState``); a row at temperature
0 is greedy (argmax, the match rule) in any batch.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dflash_jax import target as target_lib
from dflash_jax import tree as tree_lib
from dflash_jax.decode.proposers import StepView
from dflash_jax.decode.types import DecodeState, EngineSpec, Finish, Inputs
from dflash_jax.sampling import (accepted_length, apply_bitmask, choose, filtered_scores, if_sampling, rejection_sample,
                                token_logps)
from dflash_jax.state import put_rows


def verify_choice(confidence, active, lengths: tuple[int, ...], threshold):
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


# positional: one decode step's operands, in the order the step holds them
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


def draft_view(spec: EngineSpec, inp: Inputs, state: DecodeState, keys) -> StepView:
    """The proposer's view of this step: the block [pending token, MASK...] at each row's committed length."""
    b, k = state.tokens.shape[0], spec.step_block
    n = state.tcache.lengths
    pending = state.tokens[jnp.arange(b), n]
    block = jnp.concatenate([pending[:, None], jnp.full((b, k - 1), inp.mask_token_id, jnp.int32)], axis=1)
    # the block positions a row can still commit (the reference drafts a shorter block at the end)
    block_len = jnp.clip(state.budget - state.generated + 1, 1, k)
    return StepView(inp.tparams, inp.dparams, block, n, block_len, state.dcache, keys, state.sampling,
                    inp.proposer_args)


def _logps(spec: EngineSpec, state: DecodeState, logits, tokens):
    """The log-probabilities of ``tokens`` [B, K] under ``logits`` [B, K, V] at each row's temperature, when the
    spec keeps them (``EngineSpec.logprobs``; else None: nothing computed)."""
    return token_logps(logits, tokens, state.sampling.temperature) if spec.logprobs else None


def chain_verify(spec: EngineSpec, inp: Inputs, state: DecodeState, k_draft, k_target, given=None, allowed=None):
    """Draft a chain d_1..d_{K-1} and verify it -> (p_0..p_{K-1}, accepted drafts a [B], verify length, caches,
    log-probabilities of p_0..p_{K-1} or None: ``_logps``). Structured outputs (``constrained``): the proposal
    ``given`` (drafted by ``steps.propose`` with this step's keys) and the grammar's bitmask of each verified position
    ``allowed`` [B, K, words]: the target's distributions masked, so greedy rows take the masked argmax and sampled
    rows' rejection rule compares the draft's q as drawn with the masked, renormalised target (exact for any target
    law: a forbidden draft token has p = 0 and is always rejected, the residual max(0, p - q) lies in the grammar).
    K is the step's block (``spec.step_block``); at K = 1 with a draft, a plain step that writes the draft's context."""
    b, k = state.tokens.shape[0], spec.step_block
    n = state.tcache.lengths
    active = ~state.done
    choice = jnp.int32(0)
    if spec.drafting:
        view = draft_view(spec, inp, state, k_draft)
        proposal = spec.proposer.propose(spec, view) if given is None else given
        block = view.block.at[:, 1:].set(proposal.tokens)
        if len(spec.lengths) > 1:  # confidence: the largest probability (not the drawn token's: docs/adaptive-verify.md)
            scores = proposal.scores
            confidence = jnp.exp(jnp.max(scores, axis=-1) - jax.nn.logsumexp(scores, axis=-1))
            choice = verify_choice(confidence, active, spec.lengths, inp.threshold)
    else:
        block = state.tokens[jnp.arange(b), n][:, None]
    positions = n[:, None] + jnp.arange(k, dtype=jnp.int32)
    logits, tcache, dcache = _verify_chosen(spec, choice, inp.tparams, inp.dparams, state.tcache, state.dcache, block,
                                            positions, active)
    length = jnp.asarray(spec.lengths, jnp.int32)[choice]
    logits, posterior = _posterior(spec, state, logits, k_target, allowed)
    verified = length - 1  # drafts the target verifies: the verify length's, or fewer where a proposal was cut
    if spec.drafting and proposal.length is not None:
        verified = jnp.minimum(verified, proposal.length)
        length = verified + 1  # recorded per row: the tokens whose verification counted
    a = jnp.minimum(accepted_length(block[:, 1:], posterior), verified) if k > 1 else jnp.zeros((b,), jnp.int32)
    if spec.rejection:  # sampled rows: d_1..d_a, then the residual / bonus token; greedy rows keep the match rule
        sampled = state.sampling.temperature > 0
        a_r, posterior_r = if_sampling(
            jnp.where(active, state.sampling.temperature, 0),
            lambda: rejection_sample(proposal.scores, proposal.tokens, filtered_scores(logits, state.sampling),
                                     k_target, verified=verified), (a, posterior))
        a, posterior = jnp.where(sampled, a_r, a), jnp.where(sampled[:, None], posterior_r, posterior)
    return posterior, a, length, tcache, dcache, _logps(spec, state, logits, posterior)


def _posterior(spec: EngineSpec, state: DecodeState, logits, k_target, allowed):
    """(the logits masked by the grammar's bitmasks ``allowed``, if any; the target's tokens p_0..p_{K-1} from them:
    with the rejection rule only greedy rows use these (the argmax), sampled rows draw in ``rejection_sample``)."""
    if allowed is not None:
        logits = apply_bitmask(logits, allowed)
    return logits, (jnp.argmax(logits, axis=-1).astype(jnp.int32) if spec.rejection
                    else choose(logits, k_target, state.sampling, greedy=spec.greedy))


def plain_forward(spec: EngineSpec, inp: Inputs, state: DecodeState):
    """A plain step's (K = 1, no proposal) first half: the target's forward of each row's pending token x_n (with a
    draft, its features written as draft context) -> (logits [B, 1, V], tcache, dcache), the caches' writes pending
    until ``plain_commit`` (uncommitted, a later forward overwrites them, as a rejected draft's)."""
    n = state.tcache.lengths
    block = state.tokens[jnp.arange(state.tokens.shape[0]), n][:, None]
    return _verify_chosen(spec, jnp.int32(0), inp.tparams, inp.dparams, state.tcache, state.dcache, block,
                          n[:, None], ~state.done)


def plain_commit(spec: EngineSpec, state: DecodeState, logits, allowed, k_target, key) -> DecodeState:
    """A plain step's second half: the token drawn from ``plain_forward``'s ``logits`` (masked by the grammar's
    ``allowed`` [B, 1, words]) and committed with the caches the forward wrote (``state``'s): the step
    ``chain_verify`` + ``commit`` take at K = 1, split so the host computes the masks while the forward runs."""
    logits, posterior = _posterior(spec, state, logits, k_target, allowed)
    return commit(spec, state, posterior, jnp.zeros_like(state.generated), jnp.asarray(spec.lengths, jnp.int32)[0],
                  state.tcache, state.dcache, _logps(spec, state, logits, posterior), key)


def tree_verify(spec: EngineSpec, inp: Inputs, state: DecodeState, k_draft, k_target):
    """Draft a tree of N = ``spec.tree_budget`` nodes, verify [root, nodes] in one masked target forward, walk
    it (``tree.walk``) and compact the accepted path into both caches -> (the target's tokens along the path
    p_0..p_{K-1}, accepted nodes a [B], verify length N + 1, caches, their log-probabilities or None). Exact: see
    docs/tree-verification.md."""
    b, k = state.tokens.shape[0], spec.block_size
    n = state.tcache.lengths
    view = draft_view(spec, inp, state, k_draft)
    max_depth = jnp.clip(state.budget - state.generated - 1, 0, k - 1)  # drafts past it could not be committed
    tree = spec.proposer.propose_tree(spec, view, max_depth)
    tokens = jnp.concatenate([view.block[:, :1], tree.tokens], axis=1)
    positions = n[:, None] + jnp.concatenate([jnp.zeros((b, 1), jnp.int32), tree.depths], axis=1)
    logits, features, tcache = target_lib.forward(spec.target_config, inp.tparams, tokens, positions, state.tcache,
                                                  spec.feature_layer_ids, attention_impl=spec.attention_impl,
                                                  new_mask=tree_lib.ancestor_mask(tree.parents, d_max=k - 1))
    y = choose(logits, k_target, state.sampling, greedy=spec.greedy)  # every node independently (one categorical)
    path, a, _ = tree_lib.walk(tree, y)  # path [B, K]: accepted slots root first, -1 after
    on_path, slots = path >= 0, jnp.maximum(path, 0)
    dst = n[:, None] + jnp.arange(k, dtype=jnp.int32)
    tcache = tcache.compact(jnp.where(on_path, n[:, None] + path, -1), dst)  # slot n+path[j] -> n+j
    ctx_positions = jnp.where(~state.done[:, None] & on_path, dst, -1)
    dcache = spec.proposer.update_context(spec, inp.dparams, state.dcache,
                                          jnp.take_along_axis(features, slots[..., None], axis=1), ctx_positions)
    logp = _logps(spec, state, logits, y)  # every node's, then along the path
    logp = None if logp is None else jnp.take_along_axis(logp, slots, axis=1)
    return jnp.take_along_axis(y, slots, axis=1), a, jnp.int32(spec.tree_budget + 1), tcache, dcache, logp


def stop_hits(tokens, stop_ids):
    """tokens [B, T] that are one of their row's stop ids ``stop_ids`` [B, W] (-1: none) -> bool [B, T]."""
    return jnp.any(tokens[:, :, None] == stop_ids[:, None, :], axis=-1)  # tokens are >= 0: padding never matches


# positional: one decode step's operands, in the order the step holds them
def commit(spec: EngineSpec, state: DecodeState, posterior, a, length, tcache, dcache, logp, key):
    """Commit p_0..p_a (``posterior`` [B, K]) at positions n+1.., cut at the budget and just after the first stop
    token, with their log-probabilities ``logp`` [B, K] (None: not kept); both caches keep a+1 verified tokens
    (x_n, d_1..d_a); done rows do not change."""
    b, cache_len = state.tokens.shape
    active = ~state.done
    offsets = jnp.arange(posterior.shape[1], dtype=jnp.int32)
    positions = state.tcache.lengths[:, None] + offsets
    limit = jnp.minimum(a + 1, state.budget - state.generated)
    is_stop = stop_hits(posterior, state.stop_ids) & (offsets[None] < limit[:, None])
    hit_stop = is_stop.any(axis=1)
    keep = jnp.where(hit_stop, jnp.argmax(is_stop, axis=1) + 1, limit)
    write = active[:, None] & (offsets[None] < keep[:, None])
    cols = jnp.where(write, positions + 1, cache_len)
    tokens = put_rows(state.tokens, cols, posterior)
    logps = state.logps if logp is None else put_rows(state.logps, cols, logp)
    generated = state.generated + jnp.where(active, keep, 0)
    finish = jnp.where(active & hit_stop, Finish.STOP,
                       jnp.where(active & (generated >= state.budget), Finish.LENGTH, state.finish))
    kept = jnp.where(active, a + 1, 0)  # verified tokens whose state every layer keeps: x_n, d_1..d_a
    step = jnp.where(active, state.steps, cache_len)
    return spec.place(state.replace(tokens=tokens, logps=logps, tcache=tcache.commit(kept),
                                    dcache=dcache.commit(kept) if spec.speculative else dcache,
                                    generated=generated, finish=finish.astype(jnp.int32),
                                    acceptance=put_rows(state.acceptance, step[:, None], keep[:, None]),
                                    verified=put_rows(state.verified, step[:, None],
                                                      jnp.broadcast_to(length, (b,))[:, None]),
                                    steps=state.steps + active.astype(jnp.int32), key=key))
