"""Guard on the paged engine's preemption (issue #57): a preempted sampled row continues with the key it had, so its
tokens are those of an uninterrupted run. Seen to fail with the bug put in by hand: the restored decode fields
leaving out the row's key (the row then samples again from its admission key), which the existing preemption test
let pass: its preempted rows had not stepped yet (the newest row goes first, often just admitted), and its one
sampled row draws from a target so peaked that any key gives the same tokens."""
from __future__ import annotations

import numpy as np

from dflash_jax import decode
from dflash_jax.decode import DecodeOptions, Engine, Request
from pairs import random_pair

BUDGETS = [60, 50, 56, 40, 46, 58]


def test_preempted_sampled_rows_draw_what_they_would_have_drawn(monkeypatch):
    """Every request samples (its own seed and settings) from a random target (flat distributions: every draw
    matters); pages of 8 tokens, a pool that starts 3 rows but cannot grow them all, so that rows are preempted
    after steps of their own (not only just admitted, before any step): each output equals the run whose pool never
    runs dry."""
    target, draft = random_pair(vocab=32, block_size=4)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(1, 31, rng.randint(3, 12)).tolist() for _ in BUDGETS]
    requests = [Request(p, max_new_tokens=b, temperature=0.8 + 0.1 * i, top_k=(0, 20)[i % 2], seed=10 + i)
                for i, (p, b) in enumerate(zip(prompts, BUDGETS))]
    kw = dict(max_batch=3, stop_token_ids=[], warm=False, page=8)
    roomy = decode.continuous_generate(target, draft, requests, **kw)
    longest = max(len(r.prompt_ids) + r.max_new_tokens for r in requests)
    probe = Engine(target, draft, DecodeOptions(max_new_tokens=60, stop_token_ids=()), max_batch=3,
                   max_length=longest, sampled=True, page=8)
    pages = probe.pool.pages_for(longest - 1 + probe.spec.max_block) + 6
    preempted = []
    take = Engine.take_preempted

    def taking(self):
        out = take(self)
        preempted.extend(int(again.saved["steps"]) for _, again in out)
        return out

    monkeypatch.setattr(Engine, "take_preempted", taking)
    tight = decode.continuous_generate(target, draft, requests, kv_cache_memory=pages * probe.page_bytes, **kw)
    assert max(preempted, default=0) > 0, preempted  # a row that had stepped (its key moved on) was preempted
    assert [r.output_ids for r in tight] == [r.output_ids for r in roomy]


def test_warming_a_small_pool_compiles_what_it_can_hold():
    """``warm`` on a pool that holds one long row but not half the rows' prompts (the group admission's program):
    it compiles what this pool can run and leaves every page free, instead of failing the server's start."""
    target, draft = random_pair(vocab=32, block_size=4)
    probe = Engine(target, draft, DecodeOptions(max_new_tokens=8), max_batch=8, max_length=64, page=8)
    pages = probe.pool.pages_for(63 + probe.spec.max_block) + 1
    engine = Engine(target, draft, DecodeOptions(max_new_tokens=8), max_batch=8, max_length=64, page=8,
                    kv_cache_memory=pages * probe.page_bytes)
    assert not engine.can_admit([Request([1] * 40)] * 5)  # the 8-row group's admission never fits this pool
    engine.warm([40])
    engine.pool.check()
    assert len(engine.pool.free) == engine.pool.pages
    out = decode.continuous_generate(target, draft, [Request([1, 2, 3], max_new_tokens=5)] * 3, max_batch=8,
                                     page=8, kv_cache_memory=pages * probe.page_bytes)
    assert all(r.num_generated == 5 for r in out)
