"""Tree verification in the decode loop (``tree_budget``): greedy output identical to plain decoding (ragged
batches, budgets 1 / 4 / 16 / 64, stop tokens and max_new_tokens / max_length cut inside a step, a DFlash2
draft, qwen3_moe and gpt_oss targets, sliding rings), verify lengths N + 1, tree tau >= chain tau with a
trained draft, and clear refusals (windows narrower than the block, bad budgets). Hybrid (Gated DeltaNet) targets: test_gdn_tree.py. The sampled law is in test_sampling.py."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from dflash_jax import decode as S
from dflash_jax import target as target_lib
from dflash_jax import tree as tree_lib
from dflash_jax.families.gpt_oss import GptOssConfig
from dflash_jax.families.qwen3_moe import Qwen3MoeConfig
from dflash_jax.target import Target, init_params, target_logits
from pairs import random_draft, random_pair, tiny_target_config
from test_draft import make_draft
from test_draft_formats import DFLASH2
from tolerances import assert_close, forward_depth

MAX_NEW = 40


@pytest.fixture(scope="module")
def pair():
    return random_pair(vocab=8, block_size=16)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.RandomState(0)
    return [rng.randint(2, 7, n).tolist() for n in (3, 9, 1, 17)]


@pytest.fixture(scope="module")
def plain(pair, prompts):
    return S.generate(pair[0], prompts, max_new_tokens=MAX_NEW, stop_token_ids=[])


def check(results, want, budget, block=16):
    """Identical outputs, N + 1 tokens verified per step, 1..block committed per step, the token count."""
    assert [r.output_ids for r in results] == [w.output_ids for w in want]
    for r in results:
        assert set(r.verify_lengths) <= {budget + 1} and len(r.verify_lengths) == len(r.acceptance_lengths)
        assert all(1 <= a <= block for a in r.acceptance_lengths)
        assert r.num_generated == 1 + sum(r.acceptance_lengths)
        assert r.target_forwards == len(r.acceptance_lengths) + 1


@pytest.mark.parametrize("impl,budget", [pytest.param("reference", 6, marks=pytest.mark.slow), ("loop", 6),
                                         ("interpret", 6), ("auto", 19)])
def test_tree_forward_equals_each_paths_causal_forward(pair, impl, budget):
    """One tree verify forward (after a prefill of ragged rows): every node's logits are the plain causal
    forward's on prompt + its path, with each attention ("interpret": the Pallas kernel on CPU; 20 queries
    > MAX_QUERIES: routed to the loop)."""
    target, _ = pair
    cfg, rng = target.config, np.random.default_rng(0)
    rows = [rng.integers(0, 8, n).tolist() for n in (5, 11)]
    lens = jnp.asarray([len(r) for r in rows], jnp.int32)
    prompt = jnp.asarray([r + [0] * (11 - len(r)) for r in rows], jnp.int32)
    pos = jnp.where(jnp.arange(11) < lens[:, None], jnp.arange(11), -1)
    _, _, cache = target_lib.forward(cfg, target.params, prompt, pos, target.new_cache(2, 128))
    cache = cache.commit(lens)
    tree = tree_lib.build_tree(jax.nn.log_softmax(jnp.asarray(rng.normal(size=(2, 3, 8)), jnp.float32)), budget)
    root = jnp.asarray([[3], [6]], jnp.int32)
    ids = jnp.concatenate([root, tree.tokens], axis=1)
    positions = lens[:, None] + jnp.concatenate([jnp.zeros((2, 1), jnp.int32), tree.depths], axis=1)
    logits, _, _ = target_lib.forward(cfg, target.params, ids, positions, cache, attention_impl=impl,
                                      new_mask=tree_lib.ancestor_mask(tree.parents))
    parents, tokens = np.asarray(tree.parents), np.asarray(tree.tokens)
    for b, row in enumerate(rows):
        for slot in range(budget + 1):
            path, node = [], slot - 1
            while node >= 0:
                path, node = [int(tokens[b, node])] + path, int(parents[b, node])
            want = target_logits(target, np.array([row + [int(root[b, 0])] + path]))[0, -1]
            # the tree's forward against the path's own: the same forward at other shapes, its rounding
            assert_close(logits[b, slot], want, forward_depth(cfg, 11 + budget + 1), what=f"{b} {slot}")


@pytest.mark.parametrize("budget", [pytest.param(1, marks=pytest.mark.slow), 4,
                                    pytest.param(16, marks=pytest.mark.slow), 64])
def test_lossless_ragged_batch(pair, prompts, plain, budget):
    target, draft = pair
    tree = S.speculative_generate(target, draft, prompts, max_new_tokens=MAX_NEW, stop_token_ids=[],
                                  tree_budget=budget)
    check(tree, plain, budget)
    assert all(r.finish_reason == "length" and r.num_generated == MAX_NEW for r in tree)
    if budget >= 64:  # the chain's 15 nodes, then 49 more: here every depth-1 token of the 8 is among them, so
        # every step but a row's last accepts a draft (deterministic for this pair; not a law for any tree)
        assert all(a >= 2 for r in tree for a in r.acceptance_lengths[:-1])


def test_cuts_inside_a_step(pair, prompts, plain):
    """max_new_tokens, max_length and a stop token end rows in the middle of an accepted path (one compile)."""
    target, draft = pair
    run = lambda **kw: S.speculative_generate(target, draft, prompts, tree_budget=16, **kw)  # noqa: E731
    for new in (1, 2, 5, 13):
        got = run(max_new_tokens=new, stop_token_ids=[])
        assert [r.output_ids for r in got] == [p.output_ids[:len(q) + new] for p, q in zip(plain, prompts)]
        assert all(r.num_generated == 1 + sum(r.acceptance_lengths) == new for r in got)
    got = run(max_new_tokens=MAX_NEW, stop_token_ids=[], max_length=20)
    assert [r.output_ids for r in got] == [p.output_ids[:20] for p in plain]
    row = plain[1].generated_ids
    stop = next(t for i, t in enumerate(row) if i >= 3 and t not in row[:i])
    want = S.generate(target, prompts, max_new_tokens=MAX_NEW, stop_token_ids=[stop])
    got = run(max_new_tokens=MAX_NEW, stop_token_ids=[stop])
    check(got, want, 16)
    assert got[1].finish_reason == "stop" and got[1].generated_ids[-1] == stop


def test_stream_matches_one_call(pair, prompts, plain):
    target, draft = pair
    *chunks, results = S.stream_generate(target, draft, prompts, max_new_tokens=12, stop_token_ids=[], tree_budget=4)
    for i, (r, p) in enumerate(zip(results, plain)):
        assert r.output_ids == p.output_ids[:len(prompts[i]) + 12]
        assert sum((c[i] for c in chunks), []) == r.generated_ids
    assert {v for r in results for v in r.verify_lengths} == {5}


def test_dflash2_draft_is_lossless(pair, prompts, plain):
    """DFlash2: the tree comes from the v1 marginals of its logits (not the selector's conditional scores)."""
    target, _ = pair
    draft = make_draft(target.config, layers=1, block=8, ids=(0, 2, 3), seed=3, **DFLASH2)
    check(S.speculative_generate(target, draft, prompts, max_new_tokens=MAX_NEW, stop_token_ids=[], tree_budget=8),
          plain, 8, block=8)


def test_dspark_draft_is_lossless(pair, prompts, plain):
    """DSpark (block 8: 8 slots draft 8, so up to 9 tokens a step): the tree from the Markov-corrected slot
    distributions along the greedy walk; greedy output identical, and its first path is the chain's proposal,
    so with a budget of at least the block it commits at least what the chain does at each step."""
    from test_dspark import make_dspark

    target, _ = pair
    draft = make_dspark(target, seed=2, head="rnn", rank=4, block=8)
    chain = S.speculative_generate(target, draft, prompts, max_new_tokens=MAX_NEW, stop_token_ids=[])
    tree = S.speculative_generate(target, draft, prompts, max_new_tokens=MAX_NEW, stop_token_ids=[], tree_budget=12)
    check(tree, plain, 12, block=9)
    for c, t in zip(chain, tree):  # same context while both agree, so the tree's first step commits >= the chain's
        assert t.acceptance_lengths[0] >= c.acceptance_lengths[0]
    assert any(a > 1 for r in tree for a in r.acceptance_lengths)


def _as(cls, cfg, **fields):
    """``cfg``'s fields in another family's config class."""
    return cls(**{**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}, **fields})


@pytest.mark.parametrize("family,window", [pytest.param("qwen3_moe", None, marks=pytest.mark.slow),
                                           pytest.param("gpt_oss", 512, marks=pytest.mark.slow), ("gpt_oss", 8)])
def test_other_attention_families(prompts, family, window):
    """qwen3_moe (routed experts); gpt_oss (sinks) with windows wider than its cache (full caches) and with a
    window of 8 = the block, whose caches are rings (``state.SlidingKV``) that rows run far past."""
    base = tiny_target_config(vocab=16)
    if family == "qwen3_moe":
        cfg = _as(Qwen3MoeConfig, base, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=16)
    else:
        cfg = _as(GptOssConfig, base, model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2,
                  sliding_window=window, layer_types=("sliding_attention", "full_attention") * 2, attention_bias=True)
    target = Target(cfg, init_params(cfg, 0))
    draft = random_draft(cfg, block_size=8)
    want = S.generate(target, prompts, max_new_tokens=16, stop_token_ids=[])
    check(S.speculative_generate(target, draft, prompts, max_new_tokens=16, stop_token_ids=[], tree_budget=8),
          want, 8, block=8)


@pytest.mark.slow  # a quality claim on the trained pair (36 s); losslessness of every tree shape stays in the fast suite
def test_tree_tau_at_least_chain_with_a_trained_draft(trained):
    target, draft, prompts = trained
    rows = prompts[:8]
    plain = S.generate(target, rows, max_new_tokens=MAX_NEW, stop_token_ids=[])
    chain = S.speculative_generate(target, draft, rows, max_new_tokens=MAX_NEW, stop_token_ids=[])
    tau = {"chain": np.mean([a for r in chain for a in r.acceptance_lengths])}
    for budget in (16, 64):
        tree = S.speculative_generate(target, draft, rows, max_new_tokens=MAX_NEW, stop_token_ids=[],
                                      tree_budget=budget)
        check(tree, plain, budget)
        tau[budget] = np.mean([a for r in tree for a in r.acceptance_lengths])
    print("tau", {k: round(float(v), 3) for k, v in tau.items()})
    assert tau[64] >= tau[16] > tau["chain"] > 1.2  # measured: 2.52, 2.05, 1.39


def test_refusals(pair, prompts):
    target, draft = pair
    run = lambda t, d, **kw: S.speculative_generate(t, d, prompts, max_new_tokens=4, **kw)  # noqa: E731
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="tree_budget must be an integer"):
            run(target, draft, tree_budget=bad)
    with pytest.raises(ValueError, match="needs a draft"):
        run(target, None, tree_budget=4)
    with pytest.raises(ValueError, match="needs a draft"):
        run(target, draft, block_size=1, tree_budget=4)
    with pytest.raises(ValueError, match="verify_lengths"):
        run(target, draft, tree_budget=4, verify_lengths=(4, 16))
    with pytest.raises(ValueError, match="cannot be combined with tree_budget"):
        run(target, draft, tree_budget=4, confidence_threshold=0.5)
    base = tiny_target_config(vocab=16)
    narrow = _as(GptOssConfig, base, model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2,
                 sliding_window=4, layer_types=("sliding_attention", "full_attention") * 2)
    with pytest.raises(ValueError, match="sliding window of 4"):
        run(Target(narrow, init_params(narrow, 0)), random_draft(narrow, block_size=8), tree_budget=4)
