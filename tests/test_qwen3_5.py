"""The qwen3_5 family (Qwen3.5 / 3.6 dense hybrids) against transformers' Qwen3_5ForCausalLM and
Qwen3_5ForConditionalGeneration: parity, the two delta-rule forms, incremental decoding, rollback of the
recurrent state, speculative == plain == transformers' greedy, the vision-language checkpoint layout.

One tiny random checkpoint (transformers' own classes + save_pretrained, no network): 4 layers (3 Gated
DeltaNet, 1 gated full attention), 2 key heads / 4 value heads, partial rotary 0.25 of head_dim 16,
mrope sections in the rope parameters, a vocabulary of 16 (so that a random draft is sometimes right),
weights at std 0.2 and perturbed norms / dt_bias so that a mis-mapped tensor shows.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax.families.qwen3_5 import Qwen35Config, chunked_delta_rule, recurrent_delta_rule, stash_bytes
from dflash_jax.target import forward
from hf_models import packed_features_match, positions_for, ragged_parity, vision_language_loads
from pairs import decode_in_chunks, lossless_greedy_with_partial_acceptance
from tolerances import assert_close, forward_depth

V, L, D = 16, 4, 32
ALL = tuple(range(L))
CFG = dict(vocab_size=V, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
           linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=False, initializer_range=0.1,
           rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [1, 1, 0], "mrope_interleaved": True})
# Qwen3.5-9B's config.json text part (the VL layout), as released
RELEASED_TEXT = {
    "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True, "dtype": "bfloat16",
    "eos_token_id": 248044, "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 12288,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 8,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_value_head_dim": 128, "mamba_ssm_dtype": "float32", "max_position_embeddings": 262144,
    "mlp_only_layers": [], "model_type": "qwen3_5_text", "mtp_num_hidden_layers": 1,
    "mtp_use_dedicated_embeddings": False, "num_attention_heads": 16, "num_hidden_layers": 32,
    "num_key_value_heads": 4, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06, "use_cache": True,
    "vocab_size": 248320,
    "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
                        "rope_theta": 10000000, "rope_type": "default"}}
RELEASED = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "image_token_id": 248056,
            "text_config": RELEASED_TEXT, "tie_word_embeddings": False, "vision_config": {"depth": 27}}


@pytest.fixture(scope="module")
def qwen(tiny_hf):
    """(checkpoint dir, torch model, loaded fp32 Target)."""
    path, model = tiny_hf("qwen3_5", "qwen3_5", **CFG)
    return path, model, dj.load_target(path)


def test_config_reads_the_released_vision_language_layout():
    c = Qwen35Config.from_hf(RELEASED)
    assert c.model_type == "qwen3_5" and c.vision_language and not c.tie_word_embeddings
    assert list(c.layer_types) == RELEASED_TEXT["layer_types"]
    assert [c.is_linear(i) for i in range(4)] == [True, True, True, False]
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim) == (
        16, 32, 128, 128)
    assert c.conv_dim == 2 * 16 * 128 + 32 * 128 and c.head_dim == 256
    assert c.rope.theta == 1e7 and c.rope.partial_rotary_factor == 0.25 and c.rope.params == ()
    assert c.qk_norm and c.attn_output_gate and c.norm_offset and c.eos_token_id == (248044,)
    assert Qwen35Config.from_hf(c.to_hf()) == c
    text = Qwen35Config.from_hf(RELEASED_TEXT)  # a text-only config
    assert text == dataclasses.replace(c, model_type="qwen3_5_text", vision_language=False)
    assert Qwen35Config.from_hf(text.to_hf()) == text
    no_types = {k: v for k, v in RELEASED_TEXT.items() if k != "layer_types"}  # full_attention_interval decides
    assert Qwen35Config.from_hf(no_types).layer_types == c.layer_types
    # Qwen3.5-9B: 24 linear layers, each stashing 16 tokens of a key, a corrected value and a log decay per value
    # head (fp32) and a conv input of 8192 (bf16) per row: 24 * 16 * 49 KiB, where a state per token was 2 MiB
    assert stash_bytes(c, 16) == 16 * 24 * (32 * (128 + 128 + 1) * 4 + 8192 * 2)


def test_logits_and_every_layer_match_transformers_on_a_ragged_batch(qwen):
    """Rows of 70 (two chunks), 45 and 9 tokens, padded with position -1, against transformers on each
    prompt alone: logits and every hidden_states[i]."""
    _, model, target = qwen
    assert ragged_parity(model, target, [70, 45, 9]) > 0.5  # the comparison is not between near-zero activations


def _delta_inputs(seed: int, b: int = 2, t: int = 11, h: int = 3, dk: int = 4, dv: int = 5):
    """Random delta-rule inputs: L2-normalised q, k; v; log-decay g < 0; beta in (0, 1); a nonzero state."""
    rng = np.random.RandomState(seed)
    q, k = (jnp.asarray(rng.randn(b, t, h, dk), jnp.float32) for _ in range(2))
    q, k = q / jnp.linalg.norm(q, axis=-1, keepdims=True), k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jnp.asarray(rng.randn(b, t, h, dv), jnp.float32)
    g = jnp.asarray(-rng.rand(b, t, h), jnp.float32)
    beta = jnp.asarray(rng.rand(b, t, h), jnp.float32)
    return q, k, v, g, beta, jnp.asarray(rng.randn(b, h, dk, dv), jnp.float32)


def _delta_depth(q, chunk: int = 4) -> int:
    """The two forms sum the same terms in other orders: per token, a reduction over the key width and a
    forward substitution through its chunk; over the tokens, the state's recurrence."""
    return q.shape[1] * (q.shape[-1] + chunk)


def test_chunked_form_equals_recurrent_form():
    """Chunks of 4 over 11 tokens (a ragged last chunk), from a nonzero state: outputs, the corrected values
    each token writes and the final state equal the one-token recurrence."""
    q, k, v, g, beta, s0 = _delta_inputs(0)
    want_out, want_final, want_u = recurrent_delta_rule(q, k, v, g, beta, s0)
    out, final, u = chunked_delta_rule(q, k, v, g, beta, s0, chunk=4)
    depth = _delta_depth(q)
    assert_close(out, want_out, depth, what="outputs")
    assert_close(u, want_u, depth, what="corrected values")
    assert_close(final, want_final, depth, what="final state")


def test_chunked_form_restarts_at_segment_starts():
    """Segments [0:3), [3:9) (crossing a chunk boundary), [9:11): each one equals the recurrence run on it
    alone, the first from the given state, the others from zero (packed documents)."""
    q, k, v, g, beta, s0 = _delta_inputs(1)
    b, t = q.shape[:2]
    cuts = [(0, 3), (3, 9), (9, 11)]
    segments = jnp.asarray(np.repeat([lo for lo, hi in cuts], [hi - lo for lo, hi in cuts])[None].repeat(b, 0))
    out, final, u = chunked_delta_rule(q, k, v, g, beta, s0, chunk=4, segments=segments)
    for lo, hi in cuts:
        init = s0 if lo == 0 else jnp.zeros_like(s0)
        want_out, want_final, want_u = recurrent_delta_rule(*(a[:, lo:hi] for a in (q, k, v, g, beta)), init)
        assert_close(out[:, lo:hi], want_out, _delta_depth(q), what=f"outputs {lo}:{hi}")
        assert_close(u[:, lo:hi], want_u, _delta_depth(q), what=f"corrected values {lo}:{hi}")
    assert_close(final, want_final, _delta_depth(q), what="final state")


def test_packed_documents_keep_their_features(qwen):
    """Two documents packed in one row: the conv window and the recurrent state restart at the second, the
    attention layers stay inside each, so each document's features equal its own unpacked forward's."""
    _, _, target = qwen
    packed_features_match(target, tuple(range(target.config.num_hidden_layers)))


def test_incremental_decoding_equals_one_shot(qwen):
    """A ragged prefill (9 and 3 tokens), then 7-token chunks, then single tokens (the recurrent form):
    logits and features equal the one-shot forward."""
    _, _, target = qwen
    c, params = target.config, target.params
    seq = 30
    ids = np.random.RandomState(2).randint(0, V, (2, seq)).astype(np.int32)
    full, full_feats, _ = forward(c, params, ids, positions_for(ids), feature_layer_ids=ALL)
    cache = target.new_cache(2, 40, max_block=7)
    assert [type(s).__name__ for s in cache.layers] == ["Recurrent"] * 3 + ["FullKV"]
    got, got_feats, cache = decode_in_chunks(target, ids, cache, [9, 3], lambda n: 7 if n < 20 else 1, ALL)
    np.testing.assert_array_equal(cache.lengths, [seq, seq])
    # The chunked and the token-by-token recurrences sum the delta rule in other orders than the one-shot form:
    # a forward's float32 rounding (its depth covers the 30-token recurrence in each layer), relative to each
    # output's scale. Measured 14 ulps on one CPU and 28 on another (issue #39); a wrong state or rollback is
    # off by O(scale).
    depth = forward_depth(c, seq)
    assert_close(got, full, depth, what="logits")
    assert_close(got_feats, full_feats, depth, what="features")


def test_rollback_keeps_the_state_of_exactly_the_accepted_tokens(qwen):
    """After a verify-style forward of K=5 tokens, commit(kept) for every kept in 0..K leaves each
    linear-attention layer in the state a plain forward over exactly the kept tokens reaches (up to the
    rounding of a forward through that layer: layer i's inputs come from forwards of other shapes)."""
    _, _, target = qwen
    c, params = target.config, target.params
    k = 5
    rng = np.random.RandomState(3)
    prompt = rng.randint(0, V, (k + 1, 6)).astype(np.int32)
    block = rng.randint(0, V, (k + 1, k)).astype(np.int32)
    cache = target.new_cache(k + 1, 16, max_block=k)
    _, _, cache = forward(c, params, prompt, positions_for(prompt), cache)
    cache = cache.commit(np.full(k + 1, 6))
    _, _, verified = forward(c, params, block, 6 + positions_for(block), cache)
    kept = np.arange(k + 1)  # row r keeps r of the K tokens
    rolled = verified.commit(kept)
    plain = target.new_cache(k + 1, 16, max_block=k)
    seq = np.concatenate([prompt, block], axis=1)
    lens = 6 + kept
    _, _, plain = forward(c, params, seq, positions_for(seq, lens), plain)
    plain = plain.commit(lens)
    width = max(c.hidden_size, c.intermediate_size, seq.shape[1])
    for i in range(3):
        for leaf in ("conv", "ssm"):
            # layer i's state: the rounding of a forward through layers 0..i (one widest reduction per layer)
            assert_close(rolled.layers[i].value[leaf], plain.layers[i].value[leaf], (i + 1) * width,
                         what=f"layer {i} {leaf}")
    np.testing.assert_array_equal(rolled.lengths, lens)


@pytest.mark.slow  # ~40 s on 2 CPU cores (8 compiled decode loops + transformers generate)
def test_speculative_equals_plain_equals_transformers_greedy(qwen):
    """Batch of 3 ragged prompts, a random draft, blocks 4 and 8, with and without a stop token. Partial
    acceptance (1 < acceptance < block) must occur: it is what exercises the recurrent rollback. Adaptive
    verify (2 or 8 tokens) too: the stash of a short verify folds in as well."""
    _, model, target = qwen
    lossless_greedy_with_partial_acceptance(model, target, adaptive=True)


def test_vision_language_checkpoint_loads(qwen, tmp_path, capfd):
    """The released layout: Qwen3_5ForConditionalGeneration (text under model.language_model., a vision
    tower) plus mtp.* tensors. Loads the language model alone, says what it skipped, and its logits
    equal the VL model's on text (transformers' text positions there come from get_rope_index: the
    three mrope streams)."""
    vision_language_loads(str(tmp_path), qwen[1], capfd)
    jax.clear_caches()


@pytest.mark.parametrize("spec", ["data=2,tensor=2", "data=4"])
def test_sharded_speculative_equals_one_device(qwen, spec):
    """Rows, KV caches and recurrent states over data, attention weights over tensor: the same tokens."""
    from dflash_jax import model_sharding as ms
    from dflash_jax import sharding as sh
    from dflash_jax import decode as S
    from pairs import random_draft

    _, _, target = qwen
    draft = random_draft(target.config, block_size=4, target_layer_ids=(0, 2, 3))
    prompts = [[3, 5, 7, 2, 9], [4, 4, 1], [8, 2, 6, 1, 3, 5, 7], [2]]
    want = S.speculative_generate(target, draft, prompts, max_new_tokens=10, stop_token_ids=[])
    mesh = sh.make_mesh(spec, devices=jax.devices()[:4])
    got = S.speculative_generate(ms.shard_target(target, mesh), ms.shard_draft(draft, mesh), prompts,
                                 max_new_tokens=10, stop_token_ids=[])
    assert [r.output_ids for r in got] == [r.output_ids for r in want]


@pytest.mark.slow  # ~30 s on 2 CPU cores (data generation, the train step's and the decode loop's compiles)
def test_training_a_draft_for_qwen3_5_runs_and_the_loss_falls(qwen, tmp_path):
    from pairs import train_briefly

    path, _, target = qwen
    draft, losses = train_briefly(path, target, str(tmp_path))
    assert draft.config.layers.hidden_size == D
    assert len(losses) == 30 and np.all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), losses
    # the trained draft decodes losslessly through the recurrent rollback
    from dflash_jax import decode as S

    p = [[3, 5, 7, 2, 9], [4, 4, 1]]
    assert ([r.output_ids for r in S.speculative_generate(target, draft, p, max_new_tokens=16, stop_token_ids=[])]
            == [r.output_ids for r in S.generate(target, p, max_new_tokens=16, stop_token_ids=[])])


def test_sampled_decoding_keeps_the_targets_joint_law(qwen):
    """Temperature sampling through the recurrent rollback (rejection rule, block 4): the joint law of the
    first three tokens against the exact one, with tests/test_sampling.py's statistic and threshold."""
    from dflash_jax import decode as S
    from pairs import random_draft
    from test_sampling import N, chi_square, exact_joint

    _, _, target = qwen
    draft = random_draft(target.config, block_size=4, target_layer_ids=(0, 2, 3))
    prompt = [3]
    l1 = dj.target_logits(target, np.array([prompt]))[0, -1]
    l2 = dj.target_logits(target, np.array([prompt + [a] for a in range(V)]))[:, -1]
    l3 = dj.target_logits(target, np.array([prompt + [a, b] for a in range(V) for b in range(V)]))[:, -1]
    want = exact_joint((l1, l2, l3.reshape(V, V, V)), 1.0)
    out = S.speculative_generate(target, draft, [prompt] * N, block_size=4, max_new_tokens=3, temperature=1.0,
                                 stop_token_ids=[], seed=5)
    toks = np.array([r.generated_ids for r in out])
    counts = np.bincount(toks @ np.array([V * V, V, 1]), minlength=V ** 3).reshape(V, V, V)
    stat, threshold = chi_square(counts, want)
    assert stat < threshold, (stat, threshold)
    assert np.mean([r.acceptance_lengths[0] > 1 for r in out]) > 0.05  # drafts accepted: rollback exercised


def test_scanned_layers_decode_what_unrolled_ones_do(qwen):
    """``scan_layers``: the family's repeating layers as one scan (``pairs.scanned_decodes_the_same``)."""
    from pairs import scanned_decodes_the_same

    scanned_decodes_the_same(qwen[2], [[3, 5, 7, 2, 9], [4, 4, 1], [8, 2, 6, 1, 3, 5, 7]])
