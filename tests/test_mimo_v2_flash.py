"""The mimo_v2_flash family against transformers' MiMoV2FlashForCausalLM.

One tiny random checkpoint (transformers' own class + save_pretrained, no network) with every feature on: q/k
head dim 16 with values of 8 (scaled by attention_value_scale), partial rotary 0.334 (5 dims: an odd count, 6
rotate), a different rope theta per layer type, sliding layers (window sliding_window_size 3 + 1 = 4 < the
prompts) with twice the KV heads and perturbed sinks, full layers without, a dense first layer and MoE layers
behind the grouped sigmoid router (n_group 4, topk_group 2, a non-zero correction bias, routed_scaling_factor 2).
"""
from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
import torch
import transformers

import dflash_jax as dj
from dflash_jax import decode as S
from dflash_jax.families.mimo_v2_flash import MiMoV2FlashConfig
from dflash_jax.target import forward, save_target
from hf_models import (broken_checkpoint, broken_tensors_are_named, fp8_copies, perturb, positions_for, ragged_parity,
                       torch_forward, torch_greedy)
from pairs import decode_in_chunks, lossless_greedy_with_partial_acceptance, random_draft
from tolerances import assert_close, forward_depth, max_diff

V, L = 16, 4
ALL = tuple(range(L))
CFG = {"vocab_size": V, "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": L, "num_attention_heads": 4,
       "num_key_value_heads": 1, "head_dim": 16, "v_head_dim": 8, "moe_intermediate_size": 8, "n_routed_experts": 8,
       "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.0,
       "sliding_window_size": 3, "max_position_embeddings": 128, "initializer_range": 0.1,
       "layer_types": ["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
       "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]}
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def save_mimo(path, seed: int = 0, **overrides):
    """A random tiny MiMoV2FlashForCausalLM saved to ``path``; returns the torch model (eval, fp32)."""
    cfg = transformers.MiMoV2FlashConfig(**{**CFG, **overrides})
    torch.manual_seed(seed)
    model = transformers.MiMoV2FlashForCausalLM(cfg).eval()
    perturb(model, {"norm": 0.1, "sinks": 1.0}, {"e_score_correction_bias": (0.0, 0.3)})  # norms 1, sinks ~0, bias 0
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    """(checkpoint dir, torch model, loaded fp32 Target)."""
    path = str(tmp_path_factory.mktemp("mimo_v2_flash"))
    model = save_mimo(path, seed=7)  # a random draft mostly proposes one token; with seed 7 the target often says it
    return path, model, dj.load_target(path)


def test_config_reads_what_transformers_writes():
    """Window = sliding_window_size + 1; sliding layers twice the KV heads, sinks and their own rope; to_hf is a
    config transformers builds the same model from, and reads back to the same config; transformers' defaults
    (layer / MLP types, rope, window) when a config leaves them out."""
    hf = transformers.MiMoV2FlashConfig(**CFG)
    c = MiMoV2FlashConfig.from_hf(hf.to_dict())
    assert c.sliding_window == hf.sliding_window == 4
    assert [c.layer_window(i) for i in ALL] == [None, 4, 4, None]
    assert [c.layer_attention(i).num_key_value_heads for i in ALL] == [1, 2, 2, 1]
    assert [c.layer_attention(i).attention_sinks for i in ALL] == [False, True, True, False]
    assert (c.rope.theta, c.sliding_rope.theta, c.rope.partial_rotary_factor) == (5e6, 1e4, 0.334)
    assert (c.head_dim, c.v_head_dim, c.attention_value_scale, c.num_experts) == (16, 8, 0.707, 8)
    assert MiMoV2FlashConfig.from_hf(c.to_hf()) == c
    again = transformers.MiMoV2FlashConfig(**c.to_hf())
    for k in ("sliding_window", "layer_types", "mlp_layer_types", "rope_parameters", "n_group", "topk_group",
              "routed_scaling_factor", "v_head_dim", "attention_value_scale", "n_routed_experts"):
        assert getattr(again, k) == getattr(hf, k), k
    bare = {k: v for k, v in CFG.items() if k not in ("layer_types", "mlp_layer_types", "sliding_window_size")}
    bare = {**bare, "num_hidden_layers": 7, "model_type": "mimo_v2_flash"}
    ours, theirs = MiMoV2FlashConfig.from_hf(bare), transformers.MiMoV2FlashConfig(**bare)
    assert list(ours.layer_types) == theirs.layer_types and list(ours.mlp_layer_types) == theirs.mlp_layer_types
    assert ours.sliding_window == theirs.sliding_window == 129


def test_unsupported_quantisation_and_malformed_configs_are_refused():
    """Quantisation other than block-wise FP8 e4m3 by name; a router the experts cannot satisfy; a non-default rope."""
    base = {**transformers.MiMoV2FlashConfig(**CFG).to_dict()}
    for q, match in (({"quant_method": "compressed-tensors"}, "quant_method 'compressed-tensors'"),
                     ({**FP8, "fmt": "e5m2"}, "fmt 'e5m2'"), ({**FP8, "weight_block_size": [128]}, "two positive")):
        with pytest.raises(ValueError, match=match):
            MiMoV2FlashConfig.from_hf({**base, "quantization_config": q})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MiMoV2FlashConfig.from_hf({**base, "num_experts_per_tok": 5})
    with pytest.raises(ValueError, match="default rope"):
        MiMoV2FlashConfig.from_hf({**base, "rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}})


def test_fp8_checkpoint_is_dequantised_on_load(mimo, tmp_path):
    """The released layout: every projection (attention, dense MLP, each expert) FP8 e4m3 with block scales
    (blocks 8 x 12: partial blocks in both dims), norms / router / sinks / embeddings not; the loaded model's
    logits equal transformers' model holding the dequantised weights (weight x its block's scale), and differ
    from the unquantised one. An FP8 tensor without its scales is named."""
    src, model, _ = mimo
    block = (8, 12)
    d, ref_dir, scaled = fp8_copies(src, tmp_path, block)
    assert any(".experts.3.down_proj" in n for n in scaled) and len(scaled) > 20
    target = dj.load_target(d)
    assert target.config.fp8_checkpoint and target.config.fp8_block_size == block
    ref = transformers.MiMoV2FlashForCausalLM.from_pretrained(ref_dir).eval()
    ids = np.random.RandomState(6).randint(0, V, (1, 10)).astype(np.int32)
    got = dj.target_logits(target, ids)
    assert_close(got, torch_forward(ref, ids)[0], forward_depth(target.config, 10), what="dequantised logits")
    assert max_diff(got, torch_forward(model, ids)[0]) > 1e-3  # the quantisation shows
    name = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match=rf"FP8 tensor {name} has no {name}_scale_inv"):
        dj.load_target(broken_checkpoint(d, tmp_path / "unscaled", name + "_scale_inv"))


def test_logits_and_every_layer_match_transformers_on_a_ragged_batch(mimo):
    """A 12- and a 9-token prompt (the short row padded with position -1) against transformers on each alone:
    logits and every hidden_states[i], past the sliding window (4); 2 x 12 token copies > 8 experts take the
    grouped dispatch."""
    _, model, target = mimo
    assert ragged_parity(model, target, [12, 9]) > 1.0  # not a comparison of near-zeros


def test_incremental_decoding_equals_one_shot(mimo):
    """Ragged rows fed 3 tokens at a time through the cache (sliding layers: a ring of window + 3 = 7 slots with
    2 KV heads, which wraps; values 8 wide): logits and features equal the one-shot forward. One token per row
    per step takes the gathered expert dispatch."""
    _, _, target = mimo
    c, params = target.config, target.params
    ids = np.random.RandomState(2).randint(0, V, (2, 12)).astype(np.int32)
    full, full_feats, _ = forward(c, params, ids, positions_for(ids), feature_layer_ids=ALL)
    cache = target.new_cache(2, 24, max_block=3)
    assert [type(s).__name__ for s in cache.layers] == ["FullKV", "SlidingKV", "SlidingKV", "FullKV"]
    assert cache.layers[0].k.shape[2:] == (1, 16) and cache.layers[0].v.shape[2:] == (1, 8)
    assert cache.layers[1].k.shape[1:] == (7, 2, 16) and cache.layers[1].v.shape[1:] == (7, 2, 8)
    depth = forward_depth(c, 12)  # the same forward at other shapes (cached chunks): its rounding, per scale
    for step in (lambda n: 3, lambda n: 1):
        got, got_feats, _ = decode_in_chunks(target, ids, target.new_cache(2, 24, max_block=3), [5, 2], step, ALL)
        assert_close(got, full, depth, what="logits")
        assert_close(got_feats, full_feats, depth, what="features")


def test_speculative_equals_plain_equals_transformers_greedy(mimo):
    """Batch of 3 ragged prompts, a random block-4 draft, with and without a stop token; partial acceptance
    must occur (the sliding rings roll back)."""
    _, model, target = mimo
    lossless_greedy_with_partial_acceptance(model, target, blocks=(4,), new=16)


@pytest.mark.slow  # ~100 s on 2 CPU cores
def test_speculative_blocks_4_and_8_equal_transformers_greedy(mimo):
    _, model, target = mimo
    lossless_greedy_with_partial_acceptance(model, target, blocks=(4, 8))


def test_save_target_reloads_in_transformers(mimo, tmp_path):
    """Our export (fused experts, sinks as attention_sink_bias, the router's bias) is a checkpoint transformers reads
    back into the same model, and we read back to the same config."""
    _, model, target = mimo
    out = save_target(target, str(tmp_path / "saved"))
    again = transformers.MiMoV2FlashForCausalLM.from_pretrained(out).eval()
    ids = np.random.RandomState(4).randint(0, V, (1, 10)).astype(np.int32)
    assert_close(torch_forward(again, ids)[0], torch_forward(model, ids)[0], forward_depth(target.config, 10),
                 what="reloaded torch")
    assert dj.load_target(out).config == target.config


def test_checkpoint_names_mtp_and_bad_tensors(mimo, tmp_path, capfd):
    """mtp.* tensors are skipped and reported, sinks load under transformers' in-memory name too (same logits);
    a missing tensor and a mis-shaped value projection are named."""
    src, _, target = mimo
    ids = np.random.RandomState(4).randint(0, V, (1, 10)).astype(np.int32)
    name = "model.layers.1.self_attn.attention_sink_bias"
    mtp = {"model.mtp.layers.0.enorm.weight": np.ones(32, np.float32), "mtp.fc.weight": np.zeros((32, 64), np.float32),
           "model.layers.1.self_attn.sinks": np.asarray(target.params["layers_1"]["self_attn"]["sinks"])}
    loaded = dj.load_target(broken_checkpoint(src, tmp_path / "mtp", name, extra=mtp))
    assert "mimo_v2_flash: loaded the language model only; skipped 2 multi-token prediction" in capfd.readouterr().err
    assert max_diff(dj.target_logits(loaded, ids), dj.target_logits(target, ids)) == 0.0
    broken_tensors_are_named(src, tmp_path / "broken", (
        ("model.layers.2.self_attn.attention_sink_bias", None),
        ("model.layers.1.self_attn.v_proj.weight", lambda a: np.zeros((32, 32), a.dtype))))
    with open(os.path.join(src, "config.json")) as f:
        assert json.load(f)["sliding_window_size"] == 3
    jax.clear_caches()


@pytest.mark.slow  # ~40 s on 2 CPU cores
def test_tree_verification_equals_transformers_greedy(mimo):
    """Tree verification (4 nodes, within the window of 4): the sliding rings and the full caches with values
    narrower than keys take the tree's own keys; the output is transformers' greedy one."""
    _, model, target = mimo
    draft = random_draft(target.config, block_size=4, target_layer_ids=(0, 2, 3))
    prompts = [[5, 7, 3, 4, 9, 6], [7, 7, 1, 2, 3, 11, 12, 9, 14], [2, 8, 13]]
    out = S.speculative_generate(target, draft, prompts, max_new_tokens=12, stop_token_ids=[], tree_budget=3)
    assert [r.output_ids for r in out] == [torch_greedy(model, p, 12) for p in prompts]


@pytest.mark.slow  # ~60 s on 2 CPU cores
def test_expert_parallel_equals_one_device(mimo):
    """Experts split over a data=2,expert=4 mesh (2 of the 8 per device): the same tokens and acceptance as on one
    device."""
    from dflash_jax import model_sharding as ms
    from dflash_jax import sharding as sh

    _, _, target = mimo
    draft = random_draft(target.config, block_size=4, target_layer_ids=(0, 2, 3))
    prompts = [[5, 7, 3, 4, 9, 6], [7, 7, 1, 2, 3, 11, 12, 9, 14], [2, 8, 13], [4, 4, 1]]
    single = S.speculative_generate(target, draft, prompts, max_new_tokens=12, stop_token_ids=[])
    mesh = sh.make_mesh("data=2,expert=4")
    rules = ms.model_rules(mesh, target, draft)
    starget, sdraft = ms.shard_target(target, mesh, rules), ms.shard_draft(draft, mesh, rules)
    assert starget.params["layers_1"]["mlp"]["experts"]["gate_up_proj"].addressable_shards[0].data.shape[0] == 2
    out = S.speculative_generate(starget, sdraft, prompts, max_new_tokens=12, stop_token_ids=[])
    assert [r.output_ids for r in out] == [r.output_ids for r in single]
    assert [r.acceptance_lengths for r in out] == [r.acceptance_lengths for r in single]


@pytest.mark.slow  # ~60 s on 2 CPU cores (data generation, the train step's and the decode loop's compiles)
def test_training_a_draft_for_mimo_runs_and_the_loss_falls(mimo, tmp_path):
    """make_data + train on the MiMo target's features (the grouped expert dispatch and the Dv != D caches in the
    target forward); the loss falls and the trained draft decodes losslessly."""
    from pairs import train_briefly

    path, _, target = mimo
    draft, losses = train_briefly(path, target, str(tmp_path))
    assert len(losses) == 30 and np.all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), losses
    p = [[3, 5, 7, 2, 9], [4, 4, 1]]
    assert ([r.output_ids for r in S.speculative_generate(target, draft, p, max_new_tokens=16, stop_token_ids=[])]
            == [r.output_ids for r in S.generate(target, p, max_new_tokens=16, stop_token_ids=[])])


def test_scanned_layers_decode_what_unrolled_ones_do(mimo):
    """``scan_layers``: the family's repeating layers as one scan (``pairs.scanned_decodes_the_same``)."""
    from pairs import scanned_decodes_the_same

    scanned_decodes_the_same(mimo[2], [[3, 5, 7, 2, 9], [4, 4, 1], [8, 2, 6, 1, 3, 5, 7]])
