"""The decode engine: lossless against plain decoding, stop/length edges, statistics, top-k / top-p support,
bad input. The law of sampled output (plain and speculative) is tested in test_sampling.py."""
from __future__ import annotations

import numpy as np
import pytest

from dflash_jax import decode as S
from dflash_jax.sampling import RowSampling, choose
from pairs import adaptive_lossless, random_pair
from tolerances import assert_close, draft_depth

MAX_NEW = 40


@pytest.fixture(scope="module", params=["random", "trained"])
def case(request):
    """(target, draft, ragged prompts): a random pair with a tiny vocabulary (a random draft is right now
    and then), and a pair whose draft was trained for a few steps on the target's own outputs."""
    if request.param == "random":
        rng = np.random.RandomState(0)
        target, draft = random_pair(vocab=8, block_size=16)
        return "random", target, draft, [rng.randint(2, 7, n).tolist() for n in (3, 9, 1, 17)]
    target, draft, prompts = request.getfixturevalue("trained")
    return "trained", target, draft, [prompts[0], prompts[1][:1], prompts[2], prompts[3] + prompts[4]]


@pytest.fixture(scope="module")
def pair(case):
    return case[1:3]


@pytest.fixture(scope="module")
def prompts(case):
    return case[3]


@pytest.fixture(scope="module")
def plain(pair, prompts):
    return S.generate(pair[0], prompts, max_new_tokens=MAX_NEW, stop_token_ids=[])


def check_stats(results, block, max_new):
    for r in results:
        assert all(1 <= a <= block for a in r.acceptance_lengths)
        # The first token comes from the prefill; each step counts the tokens it committed.
        assert r.num_generated == 1 + sum(r.acceptance_lengths) <= max_new
        assert r.target_forwards == len(r.acceptance_lengths) + 1


@pytest.mark.parametrize("block", [2, 4, 8, 16])
def test_lossless_batched_ragged(case, pair, prompts, plain, block):
    target, draft = pair
    spec = S.speculative_generate(target, draft, prompts, max_new_tokens=MAX_NEW, block_size=block, stop_token_ids=[])
    if case[0] == "trained" and block >= 4:  # drafts are really accepted, several in a row
        assert max(a for r in spec for a in r.acceptance_lengths) >= 3
    for s, p, prompt in zip(spec, plain, prompts):
        assert s.output_ids == p.output_ids
        assert s.output_ids[:len(prompt)] == prompt and s.num_generated == MAX_NEW
        assert s.finish_reason == "length"
    check_stats(spec, block, MAX_NEW)


def test_batch_of_one_equals_batched_row(pair, prompts, plain):
    target, draft = pair
    for i in (1, 3):
        (one,) = S.speculative_generate(target, draft, [prompts[i]], max_new_tokens=MAX_NEW, block_size=8,
                                        stop_token_ids=[])
        assert one.output_ids == plain[i].output_ids


@pytest.mark.parametrize("max_new", [1, 2, 5, 13])
def test_max_new_tokens_mid_block(pair, prompts, plain, max_new):
    target, draft = pair
    spec = S.speculative_generate(target, draft, prompts, max_new_tokens=max_new, block_size=16, stop_token_ids=[])
    for s, p, prompt in zip(spec, plain, prompts):
        assert s.output_ids == p.output_ids[:len(prompt) + max_new]
        assert s.finish_reason == "length"
    check_stats(spec, 16, max_new)


def test_stop_token_mid_block(pair, prompts, plain):
    target, draft = pair
    # Pick, per row, a token first generated a few tokens in, so the stop lands inside a block.
    row = plain[1].generated_ids
    stop = next(t for i, t in enumerate(row) if i >= 3 and t not in row[:i])
    spec = S.speculative_generate(target, draft, prompts, max_new_tokens=MAX_NEW, block_size=16, stop_token_ids=[stop])
    ref = S.generate(target, prompts, max_new_tokens=MAX_NEW, stop_token_ids=[stop])
    for s, r, p in zip(spec, ref, plain):
        assert s.output_ids == r.output_ids
        gen = p.generated_ids
        if stop in gen:
            cut = gen.index(stop) + 1
            assert s.generated_ids == gen[:cut] and s.finish_reason == "stop"  # nothing after the first stop
        else:
            assert s.generated_ids == gen and s.finish_reason == "length"
    assert spec[1].finish_reason == "stop"
    check_stats(spec, 16, MAX_NEW)


def test_cache_full_stops_rows_at_max_length(pair, prompts, plain):
    target, draft = pair
    max_length = 20  # prompts of 3..17 tokens: every row runs into it at a different point
    spec = S.speculative_generate(target, draft, prompts, max_new_tokens=MAX_NEW, block_size=8,
                                  stop_token_ids=[], max_length=max_length)
    for s, p in zip(spec, plain):
        assert len(s.output_ids) == max_length
        assert s.output_ids == p.output_ids[:max_length]


@pytest.mark.parametrize("active,threshold,want", [
    ([True, False], 0.25, 16), ([True, False], 0.5, 8), ([True, False], 0.6, 4), ([True, False], 2.0, 4),
    ([True, True], 0.25, 8), ([True, True], 0.0, 16)])
def test_verify_choice(active, threshold, want):
    """Row 0's draft is 0.9 sure of each token: it expects 0.56 accepted tokens per position from 5 to 8 and
    0.31 from 9 to 16; row 1's (0.1 sure) expects almost none, and halves the batch's gain when active."""
    confidence = np.stack([np.full(15, 0.9), np.full(15, 0.1)]).astype(np.float32)
    lengths = (4, 8, 16)
    assert lengths[int(S.verify_choice(confidence, np.array(active), lengths, threshold))] == want


@pytest.mark.parametrize("edge", ["none", "max_new_tokens", "stop", "max_length", "one_row"])
def test_adaptive_verify_lossless(case, pair, prompts, plain, edge):
    """Adaptive verify (lengths 2 / 5 / 16 of a block of 16) equals plain decoding, with each cut inside a step.
    The trained draft's confidence varies from step to step, so a run switches between lengths; the random
    draft's hardly does (each threshold picks one length, but every length is picked at some threshold)."""
    target, draft = pair
    kw = dict(max_new_tokens=MAX_NEW, stop_token_ids=[])
    if edge == "max_new_tokens":
        kw["max_new_tokens"] = 13
    if edge == "stop":  # a token first generated a few tokens into row 1
        row = plain[1].generated_ids
        kw["stop_token_ids"] = [next(t for i, t in enumerate(row) if i >= 3 and t not in row[:i])]
    if edge == "max_length":
        kw["max_length"] = 20
    rows = [prompts[3]] if edge == "one_row" else prompts
    want = [r.output_ids for r in S.generate(target, rows, **kw)]
    chosen = adaptive_lossless(target, draft, rows, want, (2, 5, 16), **kw)
    if case[0] == "trained":
        assert len(_switching_run(target, draft, rows, want, (2, 5, 16), chosen, **kw)) > 1, chosen


def _switching_run(target, draft, rows, want, lengths, chosen, **kw) -> set:
    """The lengths of a run that switches between them (lossless too): one of ``chosen``'s runs, else one
    found by bisecting the threshold between two runs that each kept to a different single length (each step
    flips at its own threshold, so in between some run mixes them, unless every step's confidence is equal)."""
    mixed = [c for c in chosen.values() if len(c) > 1]
    if mixed:
        return mixed[0]
    ts = sorted(chosen)
    lo, hi = next((a, b) for a, b in zip(ts, ts[1:]) if chosen[a] != chosen[b])
    for _ in range(16):
        mid = (lo + hi) / 2
        out = S.speculative_generate(target, draft, rows, verify_lengths=lengths, verify_threshold=mid, **kw)
        assert [r.output_ids for r in out] == want, mid
        c = {v for r in out for v in r.verify_lengths}
        if len(c) > 1:
            return c
        lo, hi = (mid, hi) if c == chosen[lo] else (lo, mid)
    return c


def test_stream_matches_one_call(pair, prompts, plain):
    target, draft = pair
    chunks, final = [], None
    for event in S.stream_generate(target, draft, [prompts[0]], max_new_tokens=MAX_NEW, block_size=4,
                                   stop_token_ids=[]):
        if event and isinstance(event[0], list):
            chunks += event[0]
        else:
            final = event
    assert chunks == plain[0].generated_ids == final[0].generated_ids


def test_top_k_top_p_restrict_support():
    import jax

    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32)).repeat(4000, 0)
    key = jax.random.split(jax.random.PRNGKey(0), 4000)  # a key per row
    k2 = np.asarray(choose(logits, key, RowSampling(1.0, 2, 1.0), greedy=False))
    assert set(k2.tolist()) == {0, 1}
    p = np.asarray(choose(logits, key, RowSampling(1.0, 0, 0.7), greedy=False))  # 0.5 + 0.3 reaches 0.7
    assert set(p.tolist()) == {0, 1}
    assert abs((p == 0).mean() - 0.5 / 0.8) < 0.03
    full = np.asarray(choose(logits, key, RowSampling(1.0, 0, 1.0), greedy=False))
    assert set(full.tolist()) == {0, 1, 2, 3}


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompts=[]), "non-empty"),
    (dict(prompts=[[]]), "prompt 0"),
    (dict(prompts=[[3, 4, 999]]), "outside the vocabulary"),
    (dict(prompts=[[-1]]), "outside the vocabulary"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(block_size=0), "block_size"),
    (dict(block_size=17), "block_size"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(prompts=[[3] * 30], max_length=30), "max length"),
    (dict(verify_lengths=[0, 16]), "verify_lengths"),
    (dict(verify_lengths=[4, 17]), "verify_lengths"),
    (dict(verify_lengths=[2, 4], block_size=1), "verify_lengths"),
    (dict(verify_lengths=[4, 16], verify_threshold=float("nan")), "verify_threshold"),
])
def test_bad_input(pair, kwargs, match):
    target, draft = pair
    args = dict(prompts=[[3, 4]], max_new_tokens=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        S.speculative_generate(target, draft, args.pop("prompts"), **args)


def test_sliding_window_ring_rollback_is_lossless():
    """Sliding-window layers keep a ring of window + block slots; rejected drafts are rolled back through
    the state protocol. Greedy output must equal a cache-free full forward's, token by token."""
    import dflash_jax as dj

    types = ("sliding_attention", "full_attention", "sliding_attention", "full_attention")
    target, draft = random_pair(vocab=8, block_size=8, layer_types=types, sliding_window=4)
    assert [type(s).__name__ for s in target.new_cache(1, 128, max_block=8).layers] == [
        "SlidingKV", "FullKV", "SlidingKV", "FullKV"]  # the engine's caches are >= 128 slots: a real ring
    rng = np.random.RandomState(3)
    prompts = [rng.randint(2, 7, n).tolist() for n in (3, 9, 1, 6)]
    new = 24
    want = []
    for p in prompts:  # greedy by full forwards over a fixed-length buffer (causal: the tail never matters)
        seq = list(p)
        for _ in range(new):
            buf = np.zeros((1, len(p) + new), np.int32)
            buf[0, :len(seq)] = seq
            seq.append(int(dj.target_logits(target, buf)[0, len(seq) - 1].argmax()))
        want.append(seq)
    for block in (1, 4, 8):
        out = S.speculative_generate(target, draft, prompts, max_new_tokens=new, block_size=block, stop_token_ids=[])
        assert [r.output_ids for r in out] == want, block
        if block > 1:
            assert any(1 < a < block for r in out for a in r.acceptance_lengths)  # partial acceptance: rollback


def _assert_draft_context_is_committed(target, draft, state):
    """The draft cache holds exactly the committed tokens' context: its length is the target cache's, and
    every slot below it holds the context K/V of the target feature of the token at that position."""
    import jax.numpy as jnp

    from dflash_jax.drafts import model as D
    from dflash_jax.target import forward

    from dflash_jax.decode import steps

    if state.pools is not None:  # a paged engine's state: its caches read through the rows' block tables
        state = steps.join(state)
    n = np.asarray(state.tcache.lengths)
    np.testing.assert_array_equal(np.asarray(state.dcache.lengths), n)
    tokens = np.asarray(state.tokens)
    pos = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)  # later tokens never reach earlier features
    _, feats, _ = forward(target.config, target.params, jnp.asarray(tokens), pos,
                          feature_layer_ids=draft.config.target_layer_ids)
    k, v = D.context_kv(draft.config, draft.params, feats, pos)
    # the engine computed them from the features of other forwards (prefill, verify blocks): a target forward's
    # rounding, then the context projections (within the draft's depth), relative to each row's scale
    depth = draft_depth(target.config, draft.config.layers, tokens.shape[1], 0)
    for layer, (kl, vl) in enumerate(zip(k, v)):
        got_k, got_v = (np.asarray(x) for x in state.dcache.layers[layer].view())
        for r, m in enumerate(n):
            assert_close(got_k[r, :m], np.asarray(kl)[r, :m], depth, what=f"layer {layer} row {r} k")
            assert_close(got_v[r, :m], np.asarray(vl)[r, :m], depth, what=f"layer {layer} row {r} v")


def _as_dflash2(draft):
    """The pair's draft as a DFlash2 draft: its weights, plus DFlash2's convolutions and selector at their own
    initialisation (near inert), so that it is accepted about as often as the draft it came from (a random DFlash2
    draft on the trained target never is, and a test of rollback needs partial acceptance)."""
    import dataclasses

    import jax

    from dflash_jax.drafts import model as D
    from test_draft_formats import DFLASH2

    cfg = dataclasses.replace(draft.config, **DFLASH2)
    fresh = D.init_draft_params(cfg, 0)
    old = dict(jax.tree_util.tree_flatten_with_path(draft.params)[0])
    leaves, tree = jax.tree_util.tree_flatten_with_path(fresh)
    assert sum(path in old for path, _ in leaves) == len(old)  # every weight of the draft kept
    return D.Draft(cfg, jax.tree_util.tree_unflatten(tree, [old.get(path, leaf) for path, leaf in leaves]))


@pytest.mark.parametrize("proposer", ["chain", pytest.param("dflash2", marks=pytest.mark.slow),
                                      pytest.param("tree", marks=pytest.mark.slow)])
def test_draft_cache_tracks_the_committed_tokens(pair, prompts, proposer):
    """After the prefill and after every step of a stepped run (ragged rows, partial acceptance), the draft
    context equals the committed tokens' (the alignment a public TPU port lost); output still lossless."""
    target, draft = pair
    if proposer == "dflash2":
        draft = _as_dflash2(draft)
    options = S.DecodeOptions(max_new_tokens=20, tree_budget=16 if proposer == "tree" else 0)
    engine = S.Engine(target, draft, options, max_batch=len(prompts), max_length=max(map(len, prompts)) + 20)
    state, rows = engine.admit(engine.empty(), [S.Request(p) for p in prompts])
    steps = 0
    while True:
        _assert_draft_context_is_committed(target, draft, state)
        if np.asarray(state.done).all():
            break
        state = engine.step(state)
        steps += 1
    state, out = engine.release(state, rows)
    plain = S.generate(target, prompts, max_new_tokens=20, stop_token_ids=[])
    assert [r.output_ids for r in out] == [r.output_ids for r in plain]
    assert any(a > 1 for r in out for a in r.acceptance_lengths)  # partial acceptance happened
    assert steps == max(len(r.acceptance_lengths) for r in out)
