"""Prefix caching: full pages of prompt tokens are shared by every row whose prompt starts with them (reference
counted, evicted least recently used), for the target and the draft's context; a hit prefills only the rest of the
prompt, and every output equals the cold run's (greedy and sampled); hybrid targets refuse it in one line."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_jax import decode
from dflash_jax.decode import DecodeOptions, Engine, Request
from dflash_jax.decode.pages import PagePool
from dflash_jax.decode.slots import stream_requests
from dflash_jax.families import config_from_hf
from dflash_jax.target import Target, init_params
from hf_models import hf_config
from pairs import random_draft

PAGE = 16


def _workload(vocab: int, seed: int = 0) -> list[Request]:
    """Prompts sharing a 40-token system prompt (ending mid-page), one equal to 2 full pages + 1 token, one that is
    exactly 3 pages (its last page is never shared: its last token must be prefilled), a sampled one, and an
    unrelated one."""
    rng = np.random.RandomState(seed)
    system = rng.randint(1, vocab, 40).tolist()
    tails = [rng.randint(1, vocab, n).tolist() for n in (9, 30, 3)]
    out = [Request(system + t, max_new_tokens=24) for t in tails]
    out.append(Request(system[:33], max_new_tokens=12))
    out.append(Request((system + tails[1])[:48], max_new_tokens=20))
    out.append(Request(system + tails[0], max_new_tokens=20, temperature=0.9, top_k=20, seed=7))
    out.append(Request(system + tails[0], max_new_tokens=20, temperature=0.9, top_k=20, seed=7))
    out.append(Request(rng.randint(1, vocab, 21).tolist(), max_new_tokens=10))
    return out


def _both(target, draft, requests, **kw):
    """(cold results, results with prefix caching, the caching engine) over the same requests, in input order."""
    options = DecodeOptions(max_new_tokens=24, stop_token_ids=())
    longest = max(len(r.prompt_ids) + r.max_new_tokens for r in requests)
    out = []
    for on in (False, True):
        engine = Engine(target, draft, options, max_batch=2, max_length=longest, sampled=True, prefix_cache=on, **kw)
        results = dict(stream_requests(engine, requests))
        engine.pool.check()
        out.append([results[i] for i in range(len(requests))])
    return out[0], out[1], engine


def test_a_cached_prefix_gives_the_cold_output(trained):
    """The trained demo-like pair, 2 rows: later requests hit the pages of earlier ones (one while its owner still
    decodes), and every output, greedy and sampled, equals the run without prefix caching and plain decoding."""
    target, draft, _ = trained
    requests = _workload(target.config.vocab_size)
    cold, hot, engine = _both(target, draft, requests)
    assert engine.prefix_cache and engine.cached_tokens > 0
    assert [r.output_ids for r in hot] == [r.output_ids for r in cold]
    cached = [r.cached_tokens for r in hot]
    # the first two are admitted together: the second, opening with the first's pages, is prefilled after it and
    # shares them; full pages only, the last prompt token always prefilled (48 tokens: 2 pages, not 3)
    assert cached[:6] == [0, 32, 32, 32, 32, 48], cached
    assert all(c % PAGE == 0 and c < len(q.prompt_ids) for c, q in zip(cached, requests))
    assert any(a > 1 for r in hot for a in r.acceptance_lengths)  # the draft's cached context is used
    greedy = [i for i, q in enumerate(requests) if not q.temperature]
    plain = decode.speculative_generate(target, None, [requests[i].prompt_ids for i in greedy[:3]],
                                        max_new_tokens=24, stop_token_ids=[])
    assert [r.output_ids for r in plain] == [hot[i].output_ids for i in greedy[:3]]
    assert hot[5].output_ids == hot[6].output_ids  # the same seed: the same draws, hit or not
    # a second run on the same engine starts from a new state (``Engine.empty``: pools that hold nothing yet): the
    # first run's cached pages are not in it, so its prompts are prefilled again, not read from empty pages
    again = dict(stream_requests(engine, requests))
    assert [again[i].output_ids for i in range(len(requests))] == [r.output_ids for r in cold]
    engine.pool.check()


def test_eviction_under_pressure_keeps_outputs(trained):
    """A pool of little more than one max-length row: cached pages are evicted (least recently used) to make
    room, rows are preempted, and the outputs still equal the cold run's."""
    target, draft, _ = trained
    requests = _workload(target.config.vocab_size, seed=1)
    longest = max(len(r.prompt_ids) + r.max_new_tokens for r in requests)
    probe = Engine(target, draft, DecodeOptions(max_new_tokens=24), max_batch=2, max_length=longest)
    pages = probe.pool.pages_for(longest - 1 + probe.spec.max_block) + 2
    cold, hot, engine = _both(target, draft, requests, kv_cache_memory=pages * probe.page_bytes)
    assert [r.output_ids for r in hot] == [r.output_ids for r in cold]
    assert engine.pool.evictions > 0 and engine.cached_tokens > 0


def test_a_latent_target_shares_its_pages():
    """DeepSeek-V3's latent (MLA) cache pages like any other: hits give the cold outputs."""
    cfg = config_from_hf(hf_config(
        "deepseek_v3", hidden_size=32, intermediate_size=48, moe_intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, kv_lora_rank=16,
        q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=1, topk_group=1,
        num_experts_per_tok=2, first_k_dense_replace=1, vocab_size=96, tie_word_embeddings=False).to_dict())
    target = Target(cfg, init_params(cfg, 0))
    draft = random_draft(cfg, block_size=4, target_layer_ids=(0, 1))
    cold, hot, engine = _both(target, draft, _workload(96))
    assert engine.prefix_cache and engine.cached_tokens > 0
    assert [r.output_ids for r in hot] == [r.output_ids for r in cold]


def test_a_hybrid_target_refuses_in_one_line():
    """Qwen3.5's recurrent states cannot be rebuilt from pages: prefix caching is off, and the start-up line says
    why."""
    cfg = config_from_hf(hf_config(
        "qwen3_5", vocab_size=96, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}).to_dict())
    engine = Engine(Target(cfg, init_params(cfg, 0)), None, DecodeOptions(max_new_tokens=4), max_batch=2,
                    max_length=64)
    assert engine.paged and not engine.prefix_cache
    assert "prefix caching off: this model keeps sliding-window rings or recurrent states" in engine.describe()


PROMPTS = [[1] * 40, [1] * 40 + [2] * 9, [1] * 17 + [3] * 30, [4] * 33, [1] * 16]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "grow", "release"]), st.integers(0, 3),
                          st.integers(0, len(PROMPTS) - 1), st.integers(1, 90)), max_size=40))
def test_shared_pages_are_counted_and_never_written(ops):
    """Any sequence of admissions (sharing the cached pages of their prompt's longest cached run, then growing),
    growth (evicting idle cached pages when nothing is free) and releases keeps the pool's invariant (every page
    free, idle, or held by exactly the rows naming it), and a page held by two rows is always one of the full
    prompt pages each holder shares, never a page either may write."""
    pool = PagePool(pages=12, page=4, rows=4, columns=25)
    shared: dict[int, int] = {}  # row -> its leading pages that are cached prompt pages (read-only)
    for op, row, which, tokens in ops:
        if op == "release":
            pool.release(row)
            shared.pop(row, None)
        elif op == "admit" and pool.owned[row] == 0:
            prompt = PROMPTS[which]
            hashes = pool.chain(prompt, pool.page, (len(prompt) - 1) // pool.page)
            hit = pool.lookup(hashes)
            if pool.pages_for(len(prompt)) - len(hit) <= pool.available() - pool.pinned(hit):
                pool.share(row, hit)
                assert pool.grow(row, len(prompt))
                pool.register(row, hashes)
                shared[row] = len(hashes)
        elif op == "grow":
            pool.grow(row, tokens)
        pool.check()
        for r in range(4):  # a page two rows hold lies inside each one's read-only prompt pages
            for j in range(int(pool.owned[r])):
                if pool.refs[pool.table[r, j]] > 1:
                    assert j < shared.get(r, 0), (r, j)


def test_a_sample_group_shares_its_prompt_and_is_reproducible(trained):
    """``Request.group(4)`` with a seed: four sampled rows of one prompt, prefilled once (the later rows read its
    pages), each drawing its own tokens; a rerun gives the same four, and so does a run without prefix caching."""
    target, draft, _ = trained
    prompt = np.random.RandomState(3).randint(1, target.config.vocab_size, 50).tolist()
    group = Request(prompt, max_new_tokens=16, temperature=1.0, seed=11).group(4)
    assert len({r.stream for r in group}) == 4
    runs = [decode.continuous_generate(target, draft, group, max_batch=4, warm=False, prefix_cache=on)
            for on in (True, True, False)]
    outs = [[r.generated_ids for r in run] for run in runs]
    assert outs[0] == outs[1] == outs[2]
    assert len({tuple(o) for o in outs[0]}) > 1  # the samples differ
    assert [r.cached_tokens for r in runs[0]] == [0, 48, 48, 48]
