"""Speculation that follows the load (``decode.load_policy``, ``Engine(block_policy=...)``): the policy's choice on
hand-made cost tables and acceptance, and exactness whatever it chooses: greedy output equals plain decoding with
the block switched at every step and across bucket changes, and the draft's context written during plain steps
equals a run that drafted all along. The sampled law under switching: tests/test_sampling.py (mixed settings)."""
from __future__ import annotations

import numpy as np
import pytest

from dflash_jax.decode import DecodeOptions, Engine, Request, continuous_generate, generate
from dflash_jax.decode import load_policy as lp
from dflash_jax.decode.types import Finish

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
BLOCKS = (1, 4, 8, 16)


def policy(cost, p=0.8) -> lp.BlockPolicy:
    """A policy over ``cost(bucket, block)`` seconds per step, with every position accepted at ``p`` (seen in
    many steps: the prior no longer matters)."""
    acc = lp.Acceptance()
    for k in BLOCKS[1:]:
        acc.reached[k], acc.accepted[k] = np.full(k, 1e6), np.full(k, 1e6 * p)
    return lp.BlockPolicy({(b, k): cost(b, k) for b in BUCKETS for k in BLOCKS}, acc)


def test_a_flat_cost_table_keeps_the_full_block():
    """A verify of any length costs one step (an accelerator at few rows): the full block everywhere."""
    assert set(policy(lambda b, k: 1e-3 * b).table().values()) == {16}


def test_a_compute_bound_table_drives_the_block_to_plain_steps():
    """A step costs a fixed 2 ms until rows x tokens make it compute-bound (a CPU): the full block at one row,
    plain steps at 32 and 64 rows, shorter blocks between, never longer at more rows, and each chosen block expected
    at least as fast as plain steps."""
    pol = policy(lambda b, k: max(2e-3, 1e-4 * b * k), p=0.9)
    table = pol.table()
    assert table == {1: 16, 2: 8, 4: 8, 8: 4, 16: 4, 32: 1, 64: 1}
    for b in BUCKETS:
        rates = pol.rates(b)
        assert rates[table[b]] == max(rates.values()) >= rates[1]
    assert pol.choose(3) == table[2] and pol.choose(64) == table[64]  # an unmeasured bucket: the one below


def test_no_cliff_the_block_moves_one_size_per_bucket():
    """Drafting pays fully up to 8 rows (flat costs) and not at all from 16 (a step of k tokens costs k plain
    ones): the best choice would jump 16 -> plain between 8 and 16 rows; the policy steps down one size per bucket
    instead (shortening the smaller buckets, each still expected faster than plain steps)."""
    pol = policy(lambda b, k: 1e-3 if b <= 8 else 1e-3 * k, p=0.9)
    table = pol.table()
    assert table == {1: 16, 2: 16, 4: 8, 8: 4, 16: 1, 32: 1, 64: 1}
    assert all(pol.rates(b)[table[b]] > pol.rates(b)[1] for b in (1, 2, 4, 8))


def test_the_table_follows_what_it_is_computed_from():
    """``table()`` is kept between engine runs and computed again when its inputs change: a draft that stops being
    accepted turns the drafting buckets to plain steps, new step costs change the choice."""
    pol = policy(lambda b, k: 1e-3 * (1 + 0.02 * k), p=0.9)  # a longer verify costs a little more
    assert set(pol.table().values()) == {16}
    pol.acceptance.observe([1] * 60000, [4, 8, 16] * 20000)  # every draft rejected, at every block: it falls
    assert set(pol.table().values()) == {1}
    pol = policy(lambda b, k: 1e-3, p=0.9)
    assert set(pol.table().values()) == {16}
    pol.step_s.update({key: 1e-3 * key[1] for key in pol.step_s})  # in place: a step of k tokens costs k plain ones
    assert set(pol.table().values()) == {1}


def test_acceptance_follows_observed_steps():
    """Plain steps teach nothing, the last step of a request (cut by its budget) is left out, one rejected step
    does not turn drafting off (the start is worth ``START_WEIGHT`` steps), and older steps are forgotten: a
    draft that stops being accepted lowers the estimate."""
    acc = lp.Acceptance(memory=8)
    acc.observe([1, 1, 1, 3], [1, 1, 1, 4])  # plain steps, then a cut last step: nothing
    assert acc.steps == 0 and acc.p(4).tolist() == [lp.START] * 3
    acc.observe([1, 1], [4, 4])  # one rejected step (and the cut last one)
    assert acc.p(4)[0] > 0.8
    acc.observe([4] * 200 + [1], [4] * 201)
    assert acc.p(4)[0] > 0.98
    acc.observe([1] * 200 + [1], [4] * 201)
    assert acc.p(4)[0] <= lp.START * lp.START_WEIGHT / 200  # what is left is the start, worth 8 of 208 steps
    assert lp.candidates(16) == BLOCKS and lp.candidates(4) == (1, 4)


def test_each_block_has_its_own_acceptance():
    """A draft may accept differently at each block: a block's own steps judge it, over the other blocks' steps at
    its positions (all that a block never run has); a position past every block run follows the ones before it; an
    engine that has seen nothing expects every token accepted; a block left unused drifts back to what the other
    blocks' steps say."""
    acc = lp.Acceptance(memory=512)
    assert acc.tau(16) == pytest.approx(16.0) and np.allclose(acc.p(4), lp.START)
    acc.observe([16] * 100 + [1], [16] * 101)  # block 16: every step accepts the whole block
    assert acc.tau(16) > 14 and acc.tau(4) > 3.9 and acc.tau(8) > 7.5  # 4 and 8, never run: judged by 16's steps
    acc.observe([2] * 200 + [1], [8] * 201)  # block 8: each step accepts one draft token, rejects the next
    assert acc.tau(8) < 3 and acc.tau(16) > 8  # each mostly by its own steps
    assert 2 < acc.tau(4) < 3.5  # never run: position 2 accepted in block 16's steps, rejected in block 8's
    assert np.allclose(acc.p(32)[15:], acc.p(32)[14], atol=0.02)  # past every block run: the position before
    pol = lp.BlockPolicy({(1, k): 1e-3 * (1 + k / 16) for k in BLOCKS}, acc)  # a longer verify costs a little more
    assert pol.block_for(1) == 16
    acc.observe([16] * 3000 + [1], [16] * 3001)  # about 6 time constants
    assert acc.tau(8) > 7  # its own steps forgotten: block 16's, which accept every token, judge it


def test_a_block_that_commits_less_than_a_shorter_one_is_stepped_over():
    """No cliff moves one block size per bucket, but not through a block that commits fewer tokens a step than a
    shorter one (it costs more and gives less): with block 8 accepting less than block 4, one row takes 16 beside
    two rows' 4, where capping it at 8 would be slower than plain steps."""
    acc = lp.Acceptance()
    acc.observe([16] * 100 + [1], [16] * 101)
    acc.observe([2] * 100 + [1], [8] * 101)
    acc.observe([4] * 100 + [1], [4] * 101)
    cost = {1: {1: 1.0, 4: 1.5, 8: 2.6, 16: 3.3}, 2: {1: 1.2, 4: 2.0, 8: 4.0, 16: 12.0}}
    pol = lp.BlockPolicy({(b, k): 1e-3 * c for b, row in cost.items() for k, c in row.items()}, acc)
    assert pol.ladder() == (1, 4, 16) and pol.table() == {1: 16, 2: 4}
    assert pol.rates(1)[8] < pol.rates(1)[1]  # the capped choice it replaces


def test_plain_buckets_explore_after_many_plain_steps():
    """Plain steps teach nothing: after ``EXPLORE_EVERY`` of them a run drafts (the bucket's best drafting block)
    to learn, and any drafting run resets the count."""
    pol = policy(lambda b, k: 1e-3 * k, p=0.5)  # every bucket plain
    assert pol.choose(8) == 1 and not pol.exploring
    pol.ran(1, lp.EXPLORE_EVERY - 1)
    assert pol.choose(8) == 1 and not pol.exploring
    pol.ran(1, 1)
    k = pol.choose(8)
    assert pol.exploring and k == max((x for x in BLOCKS if x > 1), key=pol.rates(8).get)
    pol.ran(k, 2)
    assert pol.choose(8) == 1 and not pol.exploring and pol.plain_steps == 0


class EveryStep:
    """A policy switching the block at every call, through ``blocks`` (the test's ``run(state, 1)`` calls)."""

    def __init__(self, blocks):
        self.blocks, self.calls, self.seen = blocks, 0, []

    def choose(self, bucket):
        self.calls += 1
        self.seen.append(bucket)
        return self.blocks[self.calls % len(self.blocks)]

    def observe(self, results):
        pass


def stepped(engine: Engine, prompts, admit_every: int = 3):
    """Decode ``prompts`` one ``run(state, 1)`` at a time, admitting one more every ``admit_every`` steps while a
    row is free (the live buckets change) -> the results, in order."""
    state, rows, out, waiting, n = engine.empty(), {}, {}, list(enumerate(prompts)), 0
    while waiting or rows:
        if waiting and n % admit_every == 0 and engine.free_rows(state):
            i, p = waiting.pop(0)
            state, (row,) = engine.admit(state, [Request(p)])
            rows[row] = i
        state, _ = engine.run(state, 1)
        n += 1
        done = [r for r in rows if int(np.asarray(state.finish)[r]) in (Finish.LENGTH, Finish.STOP)]
        state, results = engine.release(state, done)
        out.update({rows.pop(r): res for r, res in zip(done, results)})
    return [out[i] for i in range(len(prompts))]


@pytest.mark.parametrize("page", [16, 0])
def test_greedy_output_is_plain_decodings_with_the_block_switched_every_step(trained, page):
    """Blocks 1 (plain), 16, 4 in turn at every step, rows admitted while others run (paged: buckets 1 and 2;
    slots: every row): each row's tokens equal plain decoding's, every block was verified, and the rows' drafted
    steps after plain ones were accepted as often as drafting from a complete context allows (some step after a
    plain step accepted a draft token)."""
    target, draft, prompts = trained
    prompts = prompts[:4]
    plain = generate(target, prompts, max_new_tokens=40, stop_token_ids=[])
    pol = EveryStep((1, 16, 4))
    engine = Engine(target, draft, DecodeOptions(max_new_tokens=40, stop_token_ids=()), max_batch=2,
                    max_length=max(map(len, prompts)) + 48, page=page, block_policy=pol)
    out = stepped(engine, prompts)
    for r, p in zip(out, plain):
        assert r.output_ids == p.output_ids
    lengths = [v for r in out for v in r.verify_lengths]
    assert set(lengths) == {1, 4, 16}
    after_plain = [a for r in out for v0, v, a in zip(r.verify_lengths, r.verify_lengths[1:], r.acceptance_lengths[1:])
                   if v0 == 1 and v > 1]
    assert max(after_plain) > 1, after_plain
    if page:
        assert {1, 2} <= set(pol.seen)


def test_plain_steps_write_the_drafts_context(trained):
    """Slots (page 0): after plain steps at every other step, the draft's cache holds the same K/V at every
    committed position as after a run that drafted at the full block all along (the target's features of the
    same tokens; float tolerance: the features come from verify forwards of different lengths)."""
    target, draft, prompts = trained
    prompts = prompts[:2]
    states = []
    for blocks in ((16,), (1, 16)):
        engine = Engine(target, draft, DecodeOptions(max_new_tokens=30, stop_token_ids=()), max_batch=2,
                        max_length=max(map(len, prompts)) + 40, page=0, block_policy=EveryStep(blocks))
        state, _ = engine.admit(engine.empty(), [Request(p) for p in prompts])
        while not bool(np.all(np.asarray(state.done))):
            state, _ = engine.run(state, 1)
        states.append(state)
    full, mixed = states
    n = np.asarray(full.dcache.lengths)
    assert np.array_equal(n, np.asarray(mixed.dcache.lengths)) and np.array_equal(full.tokens, mixed.tokens)
    assert any(v == 1 for v in np.asarray(mixed.verified)[0, :int(mixed.steps[0])])
    for a, b in zip(full.dcache.layers, mixed.dcache.layers):
        for x, y in ((a.k, b.k), (a.v, b.v)):
            for row, length in enumerate(n):
                np.testing.assert_allclose(np.asarray(x[row, :length], np.float32),
                                           np.asarray(y[row, :length], np.float32), atol=2e-3, rtol=2e-3)


def test_auto_measures_every_bucket_and_block_then_chooses(trained):
    """``block_policy="auto"``: the warm-up times every (bucket, block) up to the run's rows, the policy chooses a
    block for each bucket from them, and a run with it equals plain decoding and teaches it the acceptance."""
    target, draft, prompts = trained
    prompts = prompts[:3]
    engine = Engine(target, draft, DecodeOptions(max_new_tokens=24, stop_token_ids=()), max_batch=4,
                    max_length=max(map(len, prompts)) + 32, block_policy="auto")
    engine.warm([len(p) for p in prompts], most_rows=3)
    seen = engine.block_policy.step_s
    assert set(seen) == {(b, k) for b in (1, 2, 4) for k in BLOCKS} and all(s > 0 for s in seen.values())
    assert isinstance(engine.block_policy, lp.BlockPolicy) and set(engine.block_table()) == {1, 2, 4}
    assert engine.block_policy.acceptance.steps == 0  # the probes' dummy rows teach nothing
    # the run below must draft to teach (measured costs on a loaded machine may choose plain steps): a flat table
    engine.block_policy.step_s = dict.fromkeys(seen, 1e-3)
    assert set(engine.block_table().values()) == {max(BLOCKS)}
    out = continuous_generate(target, draft, prompts, max_batch=4, max_new_tokens=24, stop_token_ids=[],
                              block_policy=engine.block_policy, warm=False)
    plain = generate(target, prompts, max_new_tokens=24, stop_token_ids=[])
    assert [r.output_ids for r in out] == [r.output_ids for r in plain]
    assert engine.block_policy.acceptance.steps > 0  # the run's finished requests did


def test_bad_policies_are_refused(trained):
    target, draft, _ = trained
    opts = DecodeOptions(max_new_tokens=8)
    with pytest.raises(ValueError, match="block_policy must be"):
        Engine(target, draft, opts, max_batch=2, max_length=64, block_policy="fast")
    with pytest.raises(ValueError, match="needs a draft's chain"):
        Engine(target, None, opts, max_batch=2, max_length=64, block_policy="auto")
    with pytest.raises(ValueError, match="needs a draft's chain"):
        Engine(target, draft, opts.replace(tree_budget=6), max_batch=2, max_length=64, block_policy="auto")


@pytest.mark.parametrize("kind", ["dspark", pytest.param("dflash2", marks=pytest.mark.slow)])
def test_other_draft_formats_switch_blocks_exactly(kind):
    """A DSpark draft (block 7 slots: 8 tokens verified; a 4-token step drafts 3 slots) with its confidence cut,
    and a DFlash2 draft (its selector over the block): the block switched at every step (plain steps among them),
    greedy output equal to plain decoding."""
    from pairs import tiny_target_config
    from dflash_jax.target import Target, init_params
    from test_draft import make_draft
    from test_draft_formats import DFLASH2
    from test_dspark import make_dspark

    tcfg = tiny_target_config(16, layers=2)
    params = init_params(tcfg, 0)
    target = Target(tcfg, dict(params, lm_head={"kernel": params["lm_head"]["kernel"] * 8}))
    if kind == "dspark":
        draft = make_dspark(target, head="rnn", rank=6, block=7)
        blocks, opts = (1, 4), dict(confidence_threshold=0.3)
    else:
        draft = make_draft(tcfg, layers=1, block=4, ids=(0, 1), seed=3, dflash2_scale=0.6, **DFLASH2)
        blocks, opts = (1, 4, 2), {}
    prompts = [[3, 5, 7, 2], [1, 9], [4, 4, 6, 8, 10]]
    plain = generate(target, prompts, max_new_tokens=24, stop_token_ids=[])
    pol = EveryStep(blocks)
    engine = Engine(target, draft, DecodeOptions(max_new_tokens=24, stop_token_ids=(), **opts), max_batch=2,
                    max_length=40, block_policy=pol)
    out = stepped(engine, prompts, admit_every=2)
    assert [r.output_ids for r in out] == [p.output_ids for p in plain]
    assert 1 in {v for r in out for v in r.verify_lengths} and max(v for r in out for v in r.verify_lengths) > 1
