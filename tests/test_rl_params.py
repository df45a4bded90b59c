"""RL rollouts (issue 56): ``Engine.update_params`` swaps a live engine's weights without compiling anything, after
which its greedy output is plain decoding of the new weights; a tree of other shapes or dtypes, or rows still
admitted, are refused; ``per_token_logps`` equals the target's own log-softmax at the temperature used."""
from __future__ import annotations

import jax
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax import decode
from dflash_jax import model_sharding as ms
from dflash_jax import sharding as sh
from dflash_jax.decode import DecodeOptions, Engine, Request
from dflash_jax.decode.programs import PROGRAMS
from dflash_jax.decode.slots import stream_requests
from dflash_jax.target import Target, init_params
from pairs import backend_compiles, random_draft, random_pair

BUDGET = 12
# one prompt past a page (16 tokens): a cached prompt page of the old weights would be shared after the swap
PROMPTS = [[5, 17, 3, 9], list(range(2, 40)), [11, 12, 13, 60, 61, 7, 8]]


@pytest.fixture(scope="module")
def pair():
    return random_pair(seed=0)


def _engine(target, draft) -> Engine:
    return Engine(target, draft, DecodeOptions(max_new_tokens=BUDGET, stop_token_ids=()), max_batch=2, max_length=64)


def _rollout(engine: Engine) -> list[list[int]]:
    out = dict(stream_requests(engine, [Request(p, max_new_tokens=BUDGET) for p in PROMPTS]))
    return [out[i].output_ids for i in range(len(PROMPTS))]


def _plain(target) -> list[list[int]]:
    return [r.output_ids for r in decode.speculative_generate(target, None, PROMPTS, max_new_tokens=BUDGET,
                                                              stop_token_ids=[])]


@pytest.mark.parametrize("mesh", [None, "data=1,fsdp=1,tensor=8"])
def test_update_params_decodes_the_new_weights_and_compiles_nothing(mesh):
    """Target and draft swapped between two rollouts of the same prompts: the second equals plain greedy decoding
    of the new target (not the old one's), and neither the engine's programs, the shared table, nor any jax compile
    (counted by jax.monitoring's backend-compile events) were added by it. On a mesh, the new single-device
    weights are placed on the engine's shardings."""
    target, draft = random_pair(seed=0, num_attention_heads=8, num_key_value_heads=4)  # heads split over tensor=8
    new = Target(target.config, init_params(target.config, seed=7))
    old_plain, new_plain = _plain(target), _plain(new)
    assert old_plain != new_plain  # the two weights decode differently: the comparison below can tell them apart
    if mesh is not None:
        mesh = sh.make_mesh(mesh)
        target, draft = ms.shard_target(target, mesh), ms.shard_draft(draft, mesh)
    engine = _engine(target, draft)
    assert _rollout(engine) == old_plain
    used, table = len(engine.used), len(PROGRAMS._table)
    with backend_compiles() as compiles:
        engine.update_params(new.params, random_draft(target.config, seed=9).params)
        assert _rollout(engine) == new_plain
    assert compiles == [] and (len(engine.used), len(PROGRAMS._table)) == (used, table)
    assert engine.target.params is engine.inputs.tparams and engine.draft.params is engine.inputs.dparams
    if mesh is not None:
        q = engine.target.params["layers_0"]["self_attn"]["q_proj"]["kernel"]
        assert q.sharding == target.params["layers_0"]["self_attn"]["q_proj"]["kernel"].sharding
    engine.pool.check()


def test_update_params_refuses_other_trees_and_rows_in_flight(pair):
    """A leaf of another shape or dtype, a missing or an extra leaf: ValueError naming it, nothing changed; rows
    admitted: refused until released; draft weights for an engine without a draft: refused."""
    target, draft = pair
    engine = _engine(target, draft)
    params = jax.tree_util.tree_map(lambda x: x, target.params)  # a copy of the dicts
    shape = {**params, "embed_tokens": {"embedding": np.zeros((5, 32), np.float32)}}
    with pytest.raises(ValueError, match=r"target parameter \['embed_tokens'\]\['embedding'\].*\(5, 32\).*\(96, 32\)"):
        engine.update_params(shape)
    dtype = {**params, "norm": {"weight": params["norm"]["weight"].astype(np.float16)}}
    with pytest.raises(ValueError, match=r"\['norm'\]\['weight'\].*float16.*float32"):
        engine.update_params(dtype)
    with pytest.raises(ValueError, match=r"\['norm'\]\['weight'\]: the new one is absent"):
        engine.update_params({k: v for k, v in params.items() if k != "norm"})
    with pytest.raises(ValueError, match=r"\['extra'\]: the new one is \(3,\).*the engine's absent"):
        engine.update_params({**params, "extra": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match=r"draft parameter"):
        engine.update_params(params, {"nothing": np.zeros(1)})
    assert engine.inputs.tparams is target.params and engine.target is target
    state, rows = engine.admit(engine.empty(), [Request(PROMPTS[0], max_new_tokens=BUDGET)])
    with pytest.raises(ValueError, match="1 rows admitted.*release every row first"):
        engine.update_params(params)
    engine.release(state, rows)
    engine.update_params(params)
    with pytest.raises(ValueError, match="without a draft"):
        _engine(target, None).update_params(params, draft.params)


def _reference(target, prompt, completion, temperature) -> np.ndarray:
    """float64 log_softmax(target_logits / temperature) at the completion's tokens."""
    ids = list(prompt) + list(completion)
    logits = dj.target_logits(target, [ids])[0].astype(np.float64) / temperature
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    return logp[np.arange(len(prompt) - 1, len(ids) - 1), completion]


def test_per_token_logps_equal_the_targets_log_softmax(pair):
    """Completions of different lengths (one empty) in one call, at temperatures 1, 0.7 and 0 (scored at 1)."""
    target, _ = pair
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 96, n).tolist() for n in (3, 20, 1)]
    completions = [rng.integers(0, 96, n).tolist() for n in (9, 0, 40)]
    for t in (1.0, 0.7):
        got = dj.per_token_logps(target, prompts, completions, temperature=t)
        for g, p, c in zip(got, prompts, completions):
            assert g.dtype == np.float32 and g.shape == (len(c),)
            np.testing.assert_allclose(g, _reference(target, p, c, t), atol=1e-4)
    at_one = dj.per_token_logps(target, prompts, completions)
    for a, b in zip(dj.per_token_logps(target, prompts, completions, temperature=0), at_one, strict=True):
        np.testing.assert_array_equal(a, b)


def test_per_token_logps_errors(pair):
    target, _ = pair
    with pytest.raises(ValueError, match="as many completions as prompts"):
        dj.per_token_logps(target, [[1, 2]], [[3], [4]])
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        dj.per_token_logps(target, [[]], [[3]])
    with pytest.raises(ValueError, match="prompt \\+ completion 1 has ids outside the vocabulary"):
        dj.per_token_logps(target, [[1], [2]], [[3], [96]])
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        dj.per_token_logps(target, [[1]], [[3]], temperature=-1)
