"""Continuous batching (``decode.Engine``, ``decode.continuous_generate``): rows join and leave while the others keep
decoding, and every row's output, acceptance and sampled tokens are those of its prompt decoded alone, whatever its
company and whenever it was admitted; every cache kind (full, sliding ring, recurrent, latent, shared KV); only the
public steps (admit / step / run / release)."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from dflash_jax import decode
from dflash_jax.decode import DecodeOptions, Engine, Request
from dflash_jax.families import config_from_hf
from dflash_jax.target import Target, init_params
from hf_models import hf_config
from pairs import random_draft, tiny_target_config
from test_gemma4 import CFG as GEMMA4
from test_step_copies import DEEPSEEK, QWEN35

BUDGETS = [5, 17, 3, 24, 9, 1, 14, 20]  # per request: rows finish at different steps, so later ones join mid-run


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab - 1, size=int(rng.integers(2, 12))).tolist() for _ in range(n)]


def solo(target, draft, prompt, budget, **kw):
    """The prompt decoded alone, in a batch of one (speculative with ``draft``, else plain)."""
    return decode.speculative_generate(target, draft, [prompt], max_new_tokens=budget, **kw)[0]


def test_rows_equal_their_prompt_decoded_alone(trained):
    """8 requests with budgets 1-24 through 3 slots (admitted as rows free up, a stop token cutting some): every
    row's output equals plain decoding of its prompt alone, and its acceptance lengths those of its prompt decoded
    alone speculatively with the same block; plain continuous batching too; results in input order."""
    target, draft, prompts = trained
    prompts = (list(prompts) * 4)[:len(BUDGETS)]
    stop = solo(target, None, prompts[3], 24).generated_ids[6]  # cuts at least request 3 short
    requests = [Request(p, max_new_tokens=b) for p, b in zip(prompts, BUDGETS)]
    stats = decode.RunStats()
    out = decode.continuous_generate(target, draft, requests, max_batch=3, stop_token_ids=[stop], stats=stats)
    plain = decode.continuous_generate(target, None, requests, max_batch=3, stop_token_ids=[stop])
    for i, (p, b) in enumerate(zip(prompts, BUDGETS)):
        alone, alone_spec = solo(target, None, p, b, stop_token_ids=[stop]), solo(target, draft, p, b,
                                                                                  stop_token_ids=[stop])
        assert out[i].output_ids == plain[i].output_ids == alone.output_ids, i
        assert out[i].acceptance_lengths == alone_spec.acceptance_lengths, i
        assert out[i].finish_reason == alone.finish_reason and out[i].prompt_length == len(p)
        assert out[i].queue_time_s is not None and out[i].wall_time_s > 0
    assert out[3].finish_reason == "stop"
    assert any(a > 1 for r in out for a in r.acceptance_lengths)  # the draft was accepted: rollback exercised
    assert 0 < stats.occupancy <= 1 and stats.loop_steps > 0 and 0 < stats.admit_time_s < stats.wall_time_s
    assert stats.programs == 2 + 3  # an admit of one row and one of all 3 for the one prompt bucket; run of 1, 2, 3 rows


def _kind(kind: str):
    """A tiny target of one cache kind and a random draft for it."""
    cfgs = {
        "sliding": lambda: tiny_target_config(vocab=32, sliding_window=4,
                                              layer_types=("sliding_attention", "full_attention") * 2),
        "recurrent": lambda: config_from_hf(hf_config("qwen3_5", **dict(QWEN35, vocab_size=32)).to_dict()),
        "latent": lambda: config_from_hf(hf_config("deepseek_v3", **dict(DEEPSEEK, vocab_size=32)).to_dict()),
        "shared_kv": lambda: config_from_hf({**GEMMA4, "model_type": "gemma4_text"}),
    }
    cfg = cfgs[kind]()
    n = cfg.num_hidden_layers
    return Target(cfg, init_params(cfg, 0)), random_draft(cfg, block_size=4, target_layer_ids=tuple(sorted({0, n - 1})))


@functools.cache
def kind_pair(kind: str):
    return _kind(kind)


@pytest.mark.parametrize("kind", ["sliding", "recurrent", pytest.param("latent", marks=pytest.mark.slow),
                                  pytest.param("shared_kv", marks=pytest.mark.slow)])
def test_every_cache_kind_admits_rows_beside_running_ones(kind):
    """Rings, recurrent stashes, latent K/V and kv-shared layers: rows admitted while others run keep both
    caches row-local, so each row's greedy output equals its prompt decoded alone (plain), speculative included."""
    target, draft = kind_pair(kind)
    vocab = target.config.vocab_size
    prompts, budgets = _prompts(5, vocab, seed=1), [9, 3, 12, 6, 10]
    requests = [Request(p, max_new_tokens=b) for p, b in zip(prompts, budgets)]
    out = decode.continuous_generate(target, draft, requests, max_batch=2, stop_token_ids=[], warm=False)
    for i, (p, b) in enumerate(zip(prompts, budgets)):
        alone = solo(target, None, p, b, stop_token_ids=[])
        assert out[i].output_ids == alone.output_ids, (kind, i)
        assert out[i].acceptance_lengths == solo(target, draft, p, b, stop_token_ids=[]).acceptance_lengths


def test_public_steps_keep_rows_busy(trained):
    """The research-code loop of README "Continuous batching": S rows kept busy from a generator of prompts with
    admit / run / release; a row admitted into a released row decodes as if alone."""
    target, draft, prompts = trained
    engine = Engine(target, draft, DecodeOptions(max_new_tokens=12, stop_token_ids=()), max_batch=2, max_length=64)
    source = iter(enumerate((list(prompts) * 3)[:5]))
    state, rows, results = engine.empty(), {}, {}
    while True:
        free = engine.free_rows(state)
        batch = [x for _, x in zip(free, source)]
        if batch:
            state, taken = engine.admit(state, [Request(p) for _, p in batch])
            rows.update({r: i for r, (i, _) in zip(taken, batch)})
        if not rows:
            break
        state, steps = engine.run(state)
        assert steps >= 1
        done = engine.finished_rows(state)
        state, finished = engine.release(state, done)
        results.update({rows.pop(r): res for r, res in zip(done, finished)})
    assert sorted(results) == list(range(5))
    for i, p in enumerate((list(prompts) * 3)[:5]):
        assert results[i].output_ids == solo(target, None, p, 12, stop_token_ids=[]).output_ids


def test_a_seeded_request_draws_the_same_tokens_in_any_batch(trained):
    """A sampled request's tokens depend on its own seed only: alone, or admitted late into a batch of other
    sampled and greedy requests with other settings (speculative, the rejection rule: its draws are the draft's,
    the acceptance test's and the residual's, all from the row's own key)."""
    target, draft, prompts = trained
    mine = Request(prompts[0], max_new_tokens=16, temperature=0.8, top_k=20, seed=7)
    others = [Request(prompts[1], max_new_tokens=3, temperature=1.3, seed=1),
              Request(prompts[2], max_new_tokens=20),
              Request(prompts[3], max_new_tokens=2, temperature=0.5, top_p=0.7, seed=2)]
    # 2 slots throughout: one engine (and its programs) for the alone and the mixed runs
    alone = decode.continuous_generate(target, draft, [mine], max_batch=2, stop_token_ids=[], warm=False)[0]
    mixed = decode.continuous_generate(target, draft, others + [mine], max_batch=2, stop_token_ids=[], warm=False)
    assert mixed[-1].output_ids == alone.output_ids
    assert mixed[1].output_ids == solo(target, None, prompts[2], 20, stop_token_ids=[]).output_ids  # greedy row
    batch_row = decode.speculative_generate(target, draft, [prompts[1], prompts[0]], max_new_tokens=16,
                                            temperature=0.8, top_k=20, seed=7, stop_token_ids=[])[1]
    as_stream = decode.continuous_generate(target, draft, [Request(prompts[0], stream=1)], max_batch=2, warm=False,
                                           max_new_tokens=16, temperature=0.8, top_k=20, seed=7, stop_token_ids=[])
    assert as_stream[0].output_ids == batch_row.output_ids  # row i of a batch call is the stream (seed, i)


def test_engine_refuses_bad_requests(trained):
    target, draft, prompts = trained
    engine = Engine(target, draft, DecodeOptions(max_new_tokens=4), max_batch=2, max_length=20)
    state = engine.empty()
    with pytest.raises(ValueError, match="greedy"):
        engine.admit(state, [Request(prompts[0], temperature=0.7)])
    with pytest.raises(ValueError, match="max length is 20"):
        engine.admit(state, [Request(list(range(1, 21)))])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.admit(state, [Request([1, 10 ** 6])])
    with pytest.raises(ValueError, match="free rows"):
        engine.admit(state, [Request(p) for p in prompts[:3]])
    state, rows = engine.admit(state, [Request(prompts[0])])
    with pytest.raises(ValueError, match="distinct free rows"):
        engine.admit(state, [Request(prompts[1])], rows=rows)
    with pytest.raises(ValueError, match="max_batch"):
        Engine(target, draft, DecodeOptions(max_new_tokens=4), max_batch=0, max_length=20)
    with pytest.raises(ValueError, match="max_length"):
        Engine(target, draft, DecodeOptions(max_new_tokens=4), max_batch=2)
    with pytest.raises(ValueError, match="top_p"):
        decode.continuous_generate(target, draft, [Request(prompts[0], top_p=0.0)], max_batch=1, max_new_tokens=3)
    with pytest.raises(ValueError, match="policy must be one of"):
        decode.continuous_generate(target, draft, [Request(prompts[0])], max_batch=1, max_new_tokens=3, policy="x")


def test_slots_on_a_mesh_equal_one_device(trained):
    """Rows and caches over data=2 (admission groups of a row per data shard, or all 4 rows), params over tensor=2:
    every row's output and acceptance equal the single-device continuous run's."""
    import jax

    from dflash_jax import model_sharding as ms
    from dflash_jax import sharding as sh

    target, draft, prompts = trained
    requests = [Request(p, max_new_tokens=b) for p, b in zip((list(prompts) * 2)[:6], BUDGETS)]
    single = decode.continuous_generate(target, draft, requests, max_batch=4, stop_token_ids=[])
    mesh = sh.make_mesh("data=2,tensor=2", devices=jax.devices()[:4])
    ts, ds = ms.shard_target(target, mesh), ms.shard_draft(draft, mesh)
    stats = decode.RunStats()
    out = decode.continuous_generate(ts, ds, requests, max_batch=4, stop_token_ids=[], stats=stats)
    assert [r.output_ids for r in out] == [r.output_ids for r in single]
    assert [r.acceptance_lengths for r in out] == [r.acceptance_lengths for r in single]
    assert stats.slots == 4 and stats.programs == 3
