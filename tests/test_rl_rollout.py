"""Tunix rollouts (issue 56): ``dflash_jax.rl.SpeculativeRollout``'s outputs padded as Tunix's engines pad them and
stopped at EOS; greedy rollouts equal plain decoding (before and after ``update_params``, from the project's tree or
Tunix's Qwen3 layout); sampled groups' log-probabilities equal the target's own; Tunix's Qwen3 NNX layout maps both
ways. With google-tunix installed: the engine is Tunix's ``BaseRollout``, and Tunix's own Qwen3 model and
``compute_per_token_logps`` agree with the weights it maps and the log-probabilities it returns."""
from __future__ import annotations

import jax
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax import decode
from dflash_jax.config import RopeConfig
from dflash_jax.rl import RolloutConfig, SpeculativeRollout, from_tunix_qwen3, seed_int, to_tunix_qwen3
from dflash_jax.rl import rollout as rl_rollout
from dflash_jax.target import Target, init_params, scanned as scan
from pairs import random_pair, tiny_target_config

BUDGET = 10
PAD = 0
PROMPTS = [[5, 17, 3, 9], [11, 12, 13, 60, 61, 7, 8], [2, 3]]


@pytest.fixture(scope="module")
def pair():
    """Rotary theta 1e6: Qwen3's, and the one Tunix 0.1.5's Qwen3 applies whatever its config says."""
    return random_pair(seed=0, rope=RopeConfig(theta=1_000_000.0))


@pytest.fixture(scope="module")
def eos(pair) -> int:
    """The third token of plain greedy decoding of the first prompt: the EOS the first rollout row stops at (the
    same batch and budget as ``_plain``'s: one compiled program)."""
    return _plain(pair[0], PROMPTS, eos=None)[0][2]


@pytest.fixture(scope="module")
def rollout(pair, eos):
    """One engine for the module (its programs compile once): a draft, 4 rows, unpaged caches (fewer programs to
    compile than the paged default's buckets: the module stays fast)."""
    target, draft = pair
    return SpeculativeRollout(target, draft, None, max_batch=4, max_length=32, eos_id=eos, pad_id=PAD,
                              engine_kw={"page": 0})


def _greedy(max_prompt_length: int = 8) -> RolloutConfig:
    return RolloutConfig(max_tokens_to_generate=BUDGET, temperature=0.0, max_prompt_length=max_prompt_length)


def _plain(target, prompts, eos) -> list[list[int]]:
    """Plain greedy decoding, stopped at ``eos`` (None: no stop)."""
    return [r.generated_ids for r in decode.speculative_generate(target, None, prompts, max_new_tokens=BUDGET,
                                                                 stop_token_ids=[] if eos is None else [eos])]


def test_greedy_rollout_is_plain_decoding_padded_as_tunix_pads(rollout, pair):
    """Prompts left-padded with the pad id to max_prompt_length (a longer prompt: the next power of two, as Tunix's
    sampler); completions = plain greedy decoding up to and including EOS, right-padded with the pad id; logprobs
    one float32 array per row, 0 past the completion; no logits kept; text without the EOS."""
    target, _ = pair
    out = rollout.generate(PROMPTS, _greedy())
    plain = _plain(target, PROMPTS, rollout.eos_id())
    assert plain[0][-1] == rollout.eos_id() and len(plain[0]) < BUDGET  # the first row stops at EOS
    prompts, tokens = np.asarray(out.left_padded_prompt_tokens), np.asarray(out.tokens)
    assert prompts.shape == (3, 8) and tokens.shape == (3, BUDGET) and out.logits is None
    for i, (p, c) in enumerate(zip(PROMPTS, plain)):
        assert prompts[i].tolist() == [PAD] * (8 - len(p)) + p
        assert tokens[i].tolist() == c + [PAD] * (BUDGET - len(c))
        assert out.logprobs[i].dtype == np.float32 and out.logprobs[i].shape == (BUDGET,)
        assert np.all(out.logprobs[i][len(c):] == 0) and np.all(out.logprobs[i][:len(c)] < 0)
    assert out.text[0] == " ".join(map(str, plain[0][:-1]))
    longer = rollout.generate([list(range(3, 12))], _greedy(max_prompt_length=8))  # 9 tokens > 8
    assert np.asarray(longer.left_padded_prompt_tokens).shape == (1, 16)
    with pytest.raises(ValueError, match="exceeds the engine's max_length 32"):
        rollout.generate([list(range(3, 30))], _greedy())


def test_sampled_groups_logprobs_equal_the_targets(rollout, pair):
    """n = 2 samples per prompt at T = 0.8 (top-k 40, top-p 0.9): the two samples of a prompt differ, the same seed
    repeats them, and each row's logprobs equal ``per_token_logps`` at T (1e-4), as ``get_per_token_logps`` (with
    Tunix's completion mask) also returns them."""
    target, _ = pair
    cfg = RolloutConfig(max_tokens_to_generate=BUDGET, temperature=0.8, top_k=40, top_p=0.9, max_prompt_length=8,
                        seed=3, eos_tokens=[1])
    out = rollout.generate(PROMPTS[:2], cfg, n=2)
    tokens = np.asarray(out.tokens)
    assert tokens.shape == (4, BUDGET) and tokens[0].tolist() != tokens[1].tolist()
    assert np.array_equal(np.asarray(rollout.generate(PROMPTS[:2], cfg, n=2).tokens), tokens)
    lengths = [next((j + 1 for j, t in enumerate(row) if t == 1), BUDGET) for row in tokens.tolist()]
    completions = [row[:n] for row, n in zip(tokens.tolist(), lengths)]
    prompts = [p for p in PROMPTS[:2] for _ in range(2)]
    want = dj.per_token_logps(target, prompts, completions, 0.8)
    mask = np.arange(BUDGET)[None] < np.asarray(lengths)[:, None]
    got = np.asarray(rollout.get_per_token_logps(out.left_padded_prompt_tokens, out.tokens, mask, temperature=0.8))
    for i, w in enumerate(want):
        np.testing.assert_allclose(out.logprobs[i][:len(w)], w, atol=1e-4)
        np.testing.assert_allclose(got[i][:len(w)], w, atol=1e-4)
        assert np.all(got[i][len(w):] == 0)


def test_update_params_then_plain_decoding_of_the_new_target(rollout, pair):
    """New weights (the project's tree, then the old ones in Tunix's Qwen3 layout) swapped in: each rollout equals
    plain greedy decoding of the weights just given; ``model()`` is the new target."""
    target, _ = pair
    new = Target(target.config, init_params(target.config, seed=7))
    assert _plain(new, PROMPTS, rollout.eos_id()) != _plain(target, PROMPTS, rollout.eos_id())
    try:
        rollout.update_params(new.params)
        assert rollout.model().params is rollout.engine.inputs.tparams
        assert np.asarray(rollout.generate(PROMPTS, _greedy()).tokens).tolist() == [
            c + [PAD] * (BUDGET - len(c)) for c in _plain(new, PROMPTS, rollout.eos_id())]
    finally:
        rollout.update_params(to_tunix_qwen3(target.params, target.config))
    assert np.asarray(rollout.generate(PROMPTS, _greedy()).tokens).tolist() == [
        c + [PAD] * (BUDGET - len(c)) for c in _plain(target, PROMPTS, rollout.eos_id())]
    with pytest.raises(NotImplementedError, match="LoRA states are not supported"):
        rollout.update_params(target.params, filter_types=(object,))


def _equal(a, b) -> bool:
    """Two parameter trees of one structure with equal leaves."""
    return jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b) and all(
        np.array_equal(x, y) for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


@pytest.mark.parametrize("tied", [False, True])
def test_tunix_qwen3_layout_round_trip(tied):
    """project -> Tunix's layout (shapes of Tunix's Qwen3 einsums) -> project: every leaf equal; string layer keys
    and NNX-variable-like leaves (``.value``) read alike; a non-qwen3 config is refused."""
    cfg = tiny_target_config(tie_word_embeddings=tied)
    params = init_params(cfg, seed=3)
    t = to_tunix_qwen3(params, cfg)
    layer = t["layers"][1]
    assert layer["attn"]["q_proj"]["w"].shape == (32, 4, 8) and layer["attn"]["k_proj"]["w"].shape == (32, 2, 8)
    assert layer["attn"]["o_proj"]["w"].shape == (4, 8, 32) and layer["mlp"]["down_proj"]["kernel"].shape == (64, 32)
    assert t["embedder"]["input_embedding"].shape == (96, 32) and t["lm_head"]["w"].shape == (32, 96)
    back = from_tunix_qwen3(t, cfg)
    assert _equal(back, params)

    class Var:  # what an nnx.State holds
        def __init__(self, value):
            self.value = value

    wrapped = {**jax.tree_util.tree_map(Var, t), "layers": {str(i): jax.tree_util.tree_map(Var, v)
                                                            for i, v in t["layers"].items()}}
    again = from_tunix_qwen3(wrapped, cfg)
    assert _equal(again, params)
    with pytest.raises(ValueError, match="dense qwen3"):
        to_tunix_qwen3(params, tiny_target_config(model_type="llama", qk_norm=False))
    scanned = scan(Target(cfg, params))  # a scanned target's stacked layers: the same Tunix tree, and back
    assert _equal(to_tunix_qwen3(scanned.params, scanned.config), t)
    assert _equal(from_tunix_qwen3(t, scanned.config), scanned.params)


def test_seed_and_interface_without_tunix():
    """Tunix's seeds (None, an int, a PRNG key, raw or typed) become the engine's int seed; the module's own
    ``BaseRollout`` / dataclasses stand in for Tunix's (the same method and field names)."""
    assert seed_int(None) == 0 and seed_int(7) == 7
    assert seed_int(jax.random.PRNGKey(5)) == seed_int(jax.random.key(5)) == 5
    assert seed_int(np.array([1, 2], np.uint32)) == (1 << 32) | 2
    for name in ("generate", "get_per_token_logps", "update_params", "pad_id", "eos_id", "model"):
        assert callable(getattr(SpeculativeRollout, name))
    fields = {f for f in rl_rollout.RolloutOutput.__dataclass_fields__}
    assert {"text", "logits", "tokens", "left_padded_prompt_tokens", "logprobs"} <= fields
    assert {"max_tokens_to_generate", "temperature", "top_p", "top_k", "seed", "max_prompt_length",
            "eos_tokens"} <= set(rl_rollout.RolloutConfig.__dataclass_fields__)


@pytest.mark.slow  # needs the rl extra (pip install -e ".[test,rl]"): Tunix's dependencies are heavy for CI
def test_tunix_accepts_the_rollout(rollout, pair):
    """With google-tunix: the engine is a Tunix ``BaseRollout``; Tunix's Qwen3 holding the target's weights
    (``to_tunix_qwen3``) gives, through Tunix's own ``compute_per_token_logps`` and completion mask, the rollout's
    log-probabilities (1e-4); its NNX state given to ``update_params`` as ``RLCluster.sync_weights`` gives it
    (``filter_types`` nnx.Param), after new weights were loaded into it, decodes as those weights; a LoRA state is
    refused."""
    from flax import nnx
    from tunix.models.qwen3 import model as qwen3
    from tunix.rl import common
    from tunix.rl.rollout import base_rollout

    target, _ = pair
    cfg = target.config
    assert isinstance(rollout, base_rollout.BaseRollout) and rl_rollout.RolloutOutput is base_rollout.RolloutOutput
    model = qwen3.Qwen3(qwen3.ModelConfig(num_layers=cfg.num_hidden_layers, vocab_size=cfg.vocab_size,
                                          embed_dim=cfg.hidden_size, hidden_dim=cfg.intermediate_size,
                                          num_heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
                                          num_kv_heads=cfg.num_key_value_heads, rope_theta=int(cfg.rope.theta),
                                          norm_eps=cfg.rms_norm_eps), rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    state.replace_by_pure_dict(to_tunix_qwen3(target.params, cfg))
    nnx.update(model, state)
    out = rollout.generate(PROMPTS, RolloutConfig(max_tokens_to_generate=BUDGET, temperature=1.0,
                                                  max_prompt_length=8, seed=1))
    mask = common.make_completion_mask(out.tokens, eos_tok=rollout.eos_id()) * (out.tokens != rollout.pad_id())
    theirs = common.compute_per_token_logps(model, out.left_padded_prompt_tokens, out.tokens,
                                            pad_id=rollout.pad_id(), eos_id=rollout.eos_id(), completion_mask=mask)
    mask = np.asarray(mask, bool)  # Tunix's mask also drops sampled tokens equal to the pad id: compared where kept
    np.testing.assert_allclose(np.asarray(theirs)[mask], np.stack(out.logprobs)[mask], atol=1e-4)
    with pytest.raises(NotImplementedError, match="LoRA"):
        rollout.update_params(nnx.state(model, nnx.LoRAParam), (nnx.LoRAParam,))
    new = Target(cfg, init_params(cfg, seed=7))  # the policy moved: Tunix's model holds new weights
    state.replace_by_pure_dict(to_tunix_qwen3(new.params, cfg))
    nnx.update(model, state)
    try:
        rollout.update_params(nnx.state(model, nnx.Param), (nnx.Param,))  # as RLCluster.sync_weights calls it
        assert np.asarray(rollout.generate(PROMPTS, _greedy()).tokens).tolist() == [
            c + [PAD] * (BUDGET - len(c)) for c in _plain(new, PROMPTS, rollout.eos_id())]
    finally:
        rollout.update_params(target.params)
