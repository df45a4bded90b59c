"""RL rollouts (issue 56): each generated token's log-probability comes back with the tokens (``logprobs``), taken
from the verify forwards, and equals the target's own log-softmax at the row's temperature (``per_token_logps``:
one cacheless forward) for plain decoding, DFlash chains (greedy and rejection-sampled), tree verification, DSpark,
and the paged engine through preemption. Tolerance 1e-4: both are float32, the cached and cacheless forwards
differ by reassociation only (~1e-6 here)."""
from __future__ import annotations

import numpy as np
import pytest

from dflash_jax import decode
from dflash_jax.decode import DecodeOptions, Engine, Request
from dflash_jax.scoring import per_token_logps
from dflash_jax.target import Target, init_params
from pairs import tight_pool, tiny_target_config
from test_dspark import make_dspark

BUDGET = 24


def _check(target, prompts, results, temperatures):
    """Every result's logprobs (one per generated token) against ``per_token_logps`` at its row's temperature."""
    for i, (p, r, t) in enumerate(zip(prompts, results, temperatures)):
        assert r.logprobs is not None and len(r.logprobs) == r.num_generated, i
        want = per_token_logps(target, [p], [r.generated_ids], temperature=t)[0]
        np.testing.assert_allclose(r.logprobs, want, atol=1e-4, err_msg=f"row {i}")
        assert np.all(np.asarray(r.logprobs) <= 0)


@pytest.mark.parametrize("how", ["plain", "greedy", "rejection", "tree"])
def test_closed_batch_logprobs_are_the_targets(trained, how):
    """speculative_generate(..., logprobs=0): a trained pair (several tokens accepted per step, so every
    position of a committed block is checked); sampled rows at T = 0.7 (rejection rule: the residual's tokens are
    scored under the target, as the RL ratio needs), greedy rows at T = 1."""
    target, draft, prompts = trained
    kw = dict(max_new_tokens=BUDGET, stop_token_ids=[], logprobs=0)
    t = 0.7 if how == "rejection" else 0.0
    if how == "rejection":
        kw.update(temperature=t, seed=3)
    if how == "tree":
        kw.update(tree_budget=12)
    out = decode.speculative_generate(target, None if how == "plain" else draft, prompts[:3], **kw)
    if how != "plain":
        assert max(max(r.acceptance_lengths) for r in out) > 1  # blocks of several tokens were committed
    _check(target, prompts[:3], out, [t or 1.0] * 3)
    if how == "plain":  # not asked: none
        off = decode.speculative_generate(target, None, prompts[:3], max_new_tokens=BUDGET, stop_token_ids=[])
        assert off[0].logprobs is None and "logprobs" not in off[0].to_json()


def test_dspark_logprobs():
    """A DSpark draft (every slot drafts, the proposal cut by its confidence head): greedy and sampled rows."""
    tcfg = tiny_target_config(16, layers=2)
    params = init_params(tcfg, 0)
    target = Target(tcfg, dict(params, lm_head={"kernel": params["lm_head"]["kernel"] * 8}))
    draft = make_dspark(target)
    prompts = [[1, 5, 3, 9], [2, 7, 7, 1, 4, 4]]
    for t in (0.0, 0.8):
        out = decode.speculative_generate(target, draft, prompts, max_new_tokens=16, stop_token_ids=[],
                                          temperature=t, seed=1, logprobs=0)
        _check(target, prompts, out, [t or 1.0] * 2)


def test_engine_logprobs_per_request_through_preemption(trained):
    """The paged engine: requests that ask (``Request.logprobs``) get them, the others None, in one run of mixed
    greedy and sampled rows whose pool is too small (rows preempted and admitted again keep the values they had)."""
    target, draft, prompts = trained
    temps = [0.0, 0.9, 0.0, 0.6]
    requests = [Request(p, max_new_tokens=26, temperature=t, seed=i, logprobs=None if i == 2 else 0)
                for i, (p, t) in enumerate(zip((prompts * 2)[:4], temps))]
    stats = decode.RunStats()
    out = decode.continuous_generate(target, draft, requests, max_batch=3, stop_token_ids=[], stats=stats,
                                     kv_cache_memory=tight_pool(target, draft, requests, 3), warm=False)
    assert stats.preemptions >= 1, stats
    assert out[2].logprobs is None
    keep = [0, 1, 3]
    _check(target, [requests[i].prompt_ids for i in keep], [out[i] for i in keep], [temps[i] or 1.0 for i in keep])


def test_bad_logprobs_refused():
    for bad in (-1, True, 1.5, "0"):
        with pytest.raises(ValueError, match="logprobs must be"):
            DecodeOptions(max_new_tokens=4, logprobs=bad)
    with pytest.raises(ValueError, match="logprobs must be"):
        Request([1, 2], logprobs=-2).settings(DecodeOptions(max_new_tokens=4))


def test_engine_turns_logprobs_on_for_a_later_request(trained):
    """One engine: a request without logprobs runs first (the program that computes none), then one that asks:
    its values are the target's (the engine switched to the program that keeps them, not the cached one)."""
    target, draft, prompts = trained
    engine = Engine(target, draft, DecodeOptions(max_new_tokens=BUDGET, stop_token_ids=()), max_batch=2,
                    max_length=64)
    first = dict(decode.stream_requests(engine, [Request(prompts[0], max_new_tokens=BUDGET)]))[0]
    assert first.logprobs is None
    later = dict(decode.stream_requests(engine, [Request(prompts[1], max_new_tokens=BUDGET, logprobs=0)]))[0]
    _check(target, [prompts[1]], [later], [1.0])
