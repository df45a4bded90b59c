"""Guards on the decode engine's promises that its outputs alone do not show (issue #57): each test states a property
and was seen to fail with a plausible bug put in by hand (named in its docstring).

- ``Engine.run`` hands control back in the step where the first running row finishes (no finished row waits
  unreported while the others decode on);
- a sampled row's key is fold_in(PRNGKey(seed), stream): two requests of the same prompt and seed but different
  streams draw different tokens, the same stream the same ones;
- a stop id is looked for only among the tokens a row keeps: never one past its budget, never one past a rejected
  draft;
- outputs AND per-step acceptance lengths equal the reference loop's with a draft that is bidirectional inside its
  block, at budgets that end inside a block (where the reference drafts a shorter block);
- a DSpark tree of as many nodes as the chain has drafts is the chain itself: its first path is the Markov-corrected
  greedy walk, so it commits exactly what the chain commits at every step."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from dflash_jax import decode
from dflash_jax.decode import DecodeOptions, Engine, Finish, Request
from dflash_jax.decode.prepare import row_keys, seed_data
from pairs import random_pair
from test_draft_formats import reference_loop

BUDGETS = [3, 11, 6, 19, 9, 14]


def test_run_returns_when_the_first_running_row_finishes(trained):
    """After every ``run``: each row that finished in it stepped in the run's last step (it finished there, none
    earlier), and the rows still running stepped in every step of it. Bug caught: ``run`` stepping on until every
    row is done (a finished row then waits, its slot idle, while the others decode)."""
    target, draft, prompts = trained
    engine = Engine(target, draft, DecodeOptions(max_new_tokens=20, stop_token_ids=()), max_batch=3, max_length=48)
    queue = [Request(p, max_new_tokens=b) for p, b in zip(prompts, BUDGETS)]
    state, live, done, early_returns = engine.empty(), set(), 0, 0
    while queue or live:
        free = engine.free_rows(state)
        batch, queue = queue[:len(free)], queue[len(free):]
        if batch:
            state, rows = engine.admit(state, batch)
            live.update(rows)
        before = engine.progress(state)
        running = {r for r in live if before["finish"][r] == Finish.RUNNING}
        state, taken = engine.run(state)
        assert not engine.take_preempted()  # the default pool holds every row: no preemption here
        after = engine.progress(state)
        finished = {r for r in running if after["finish"][r] != Finish.RUNNING}
        for r in running:  # every running row stepped in every step of this run, the finishing ones included
            assert after["steps"][r] == before["steps"][r] + taken, (r, before["steps"][r], after["steps"][r], taken)
        if finished and finished != running:
            early_returns += 1  # returned while other rows still had steps to go
        ended = engine.finished_rows(state)
        assert finished <= set(ended)
        state, _ = engine.release(state, ended)
        live -= set(ended)
        done += len(ended)
    assert done == len(BUDGETS)
    assert early_returns >= 2  # the property was exercised: rows of different lengths shared runs


def test_row_keys_are_the_documented_fold_in():
    """``Request``'s contract: the key of (seed, stream) is fold_in(PRNGKey(seed), stream), for rows of mixed seeds
    in one call (one program, the seeds' key data made on the host); a stream outside uint32 is a ValueError."""
    pairs = ((0, 0), (7, 3), (0, 1), (2 ** 40 + 5, 123456), (7, 2 ** 32 - 1), (0, 9), (2 ** 31 + 5, 1),
             (2 ** 32 - 1, 4), (2 ** 63 - 1, 2))
    got = row_keys([a for a, _ in pairs], [b for _, b in pairs])
    for (seed, stream), key in zip(pairs, got):
        want = jax.random.key_data(jax.random.fold_in(jax.random.PRNGKey(seed), stream))
        assert np.array_equal(key, np.asarray(want, np.uint32)), (seed, stream)
    assert len({tuple(k) for k in got}) == len(pairs)
    for stream in (-1, 2 ** 32):
        with pytest.raises(ValueError, match="stream must be an integer"):
            row_keys([0], [stream])
    for seed in (0, 9, 2 ** 31, 2 ** 32 + 3, 2 ** 63 - 1):  # the host's key data is PRNGKey's
        assert np.array_equal(seed_data(seed), np.asarray(jax.random.PRNGKey(seed), np.uint32)), seed


def test_streams_of_one_seed_draw_different_tokens():
    """Four sampled requests of one prompt and one seed: streams 1, 2, 3 draw three different continuations, and a
    second request of stream 1 draws stream 1's again (in the same batch).
    Bug caught: a row key that ignores the stream (every request of a seed then draws the same tokens)."""
    target, draft = random_pair(vocab=32, block_size=4)
    prompt = [3, 9, 4, 17, 5]
    kw = dict(max_new_tokens=12, temperature=1.0, seed=11, stop_token_ids=[])
    reqs = [Request(prompt, stream=s) for s in (1, 2, 3, 1)]
    out = [r.generated_ids for r in decode.continuous_generate(target, draft, reqs, max_batch=4, warm=False, **kw)]
    assert out[0] == out[3]
    assert len({tuple(o) for o in out[:3]}) == 3, out


def _stops_beyond(generated: list[int], vocab: int) -> list[int]:
    """Every id the kept tokens do not use: any stop found is one the search should not have looked at."""
    return sorted(set(range(vocab)) - set(generated))


def test_stop_ids_are_looked_for_only_in_kept_tokens(trained):
    """Each request's stop ids are every token its plain greedy output of N tokens does not use (so any stop hit is
    a token the row never keeps), N chosen so that the token right after the budget is one of them. The replay draft
    proposes the target's own continuation and then wrong tokens (accepted lengths drawn, the whole block half the
    time: steps run past the budget, and steps reject a draft): speculative continuous decoding must give the plain
    output, finish "length". Bug caught: the stop search looking one token past the kept ones (at the token after
    the budget's last, or at the target's token after a rejected draft)."""
    from dflash_jax.synthetic import ReplayProposer

    target, draft, prompts = trained
    vocab, k = target.config.vocab_size, draft.config.block_size
    free = decode.generate(target, prompts[:8], max_new_tokens=32, stop_token_ids=[])
    reqs, want, refs = [], [], []
    for p, r in zip(prompts[:8], free):
        g = r.generated_ids
        # the token after the budget is new (a stop id), and the last step does not end exactly at a block's end
        n = next((n for n in range(24, 4, -1) if g[n] not in g[:n] and (n - 1) % k), None)
        if n is not None and len(reqs) < 5:
            reqs.append(Request(p, max_new_tokens=n, stop_token_ids=_stops_beyond(g[:n], vocab), stream=len(reqs)))
            want.append(g[:n])
            refs.append(r.output_ids)
    assert len(reqs) >= 3
    probs = np.full(k, 0.5 / (k - 1))
    probs[-1] = 0.5
    replay = ReplayProposer(reference=refs, probs=probs)
    out = decode.continuous_generate(target, draft, reqs, max_batch=3, proposer=replay, warm=False)
    assert [r.generated_ids for r in out] == want
    assert {r.finish_reason for r in out} == {"length"}
    assert any(a < k for r in out for a in r.acceptance_lengths[:-1])  # drafts were rejected before the last step


def test_reference_loop_with_a_bidirectional_draft(trained):
    """The trained draft attends both ways inside its block: outputs and per-step acceptance lengths equal the
    reference loop's (which drafts a shorter block when the budget ends inside one), at a budget that ends inside a
    block. Bug caught: the engine drafting a block one position short (or long) at the budget's end: output stays
    lossless, but the bidirectional draft's proposals, and so the acceptance, change."""
    target, draft, prompts = trained
    assert not any(draft.config.layer_causal(i) for i in range(draft.config.layers.num_hidden_layers))
    for prompt, new in [(prompts[1], 13)]:  # a budget under the block of 16: every step's block is cut by it
        got = decode.speculative_generate(target, draft, [prompt], max_new_tokens=new, stop_token_ids=[])[0]
        out, acc = reference_loop(target, draft, prompt, new)
        assert got.output_ids == out, (prompt, new)
        assert got.acceptance_lengths == acc, (prompt, new)


def test_dspark_tree_of_chain_size_commits_what_the_chain_commits():
    """A DSpark tree of D nodes (the chain's drafts), built chain first, is the chain's greedy proposal: per step, it
    commits exactly what chain decoding commits while the whole chain fits the budget (near the budget's end the tree
    is cut shorter and spends its nodes on other prefixes), and greedy outputs are identical. Bug caught:
    the tree built from the draft's base logits without the Markov correction (a different first path; still
    lossless)."""
    from test_dspark import make_dspark

    target, _ = random_pair(vocab=8, block_size=8)
    draft = make_dspark(target, seed=2, head="rnn", rank=4, block=8)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(2, 7, n).tolist() for n in (3, 9, 5)]
    kw = dict(max_new_tokens=40, stop_token_ids=[])
    chain = decode.speculative_generate(target, draft, prompts, **kw)
    d = draft.config.block_size  # a DSpark block of K slots drafts K tokens: a chain of D = K drafts
    tree = decode.speculative_generate(target, draft, prompts, tree_budget=d, **kw)
    assert [t.output_ids for t in tree] == [c.output_ids for c in chain]
    for t, c in zip(tree, chain):
        generated, steps = 1, 0  # same state while both commit the same; the chain is whole while it fits the budget
        while steps < len(c.acceptance_lengths) and generated + d + 1 <= kw["max_new_tokens"]:
            assert t.acceptance_lengths[steps] == c.acceptance_lengths[steps], (steps, t.acceptance_lengths,
                                                                                c.acceptance_lengths)
            generated, steps = generated + c.acceptance_lengths[steps], steps + 1
        assert steps > 3
    assert any(a > 2 for r in chain for a in r.acceptance_lengths)  # the chain's drafts were accepted: a real check
