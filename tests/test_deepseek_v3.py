"""The deepseek_v3 / kimi_k25 family against transformers' DeepseekV3ForCausalLM / Kimi_K25ForConditionalGeneration.

One tiny random checkpoint (transformers' own classes + save_pretrained, no network) with every feature on: q_lora
(q_a_proj / q_a_layernorm / q_b_proj), YaRN rope with mscale != mscale_all_dim (both the cos/sin factor and the
softmax scale change), interleaved rope, a dense first layer, then MoE layers with 4 expert groups of which 2 are
kept, a non-zero e_score_correction_bias (it changes which experts are chosen) and two shared experts; norms
perturbed so that a mis-mapped one shows. A second, smaller model has the plain q_proj and neox rope.
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
import torch
import transformers
from jax.sharding import PartitionSpec as P

import dflash_jax as dj
from dflash_jax import model_sharding as ms
from dflash_jax import sharding as sh
from dflash_jax import decode as S
from dflash_jax import target as target_lib
from dflash_jax.checkpoints import iter_safetensors, save_safetensors
from dflash_jax.families.deepseek_v3 import DeepseekV3Config
from dflash_jax.layers import rope_frequencies
from dflash_jax.target import forward
from hf_models import (broken_tensors_are_named, fp8_copies, packed_features_match, positions_for,
                       ragged_parity, torch_forward, torch_greedy)
from pairs import decode_in_chunks, lossless_greedy_with_partial_acceptance, random_draft
from tolerances import EPS32, assert_close, forward_depth, max_diff

V, L, D, E = 16, 4, 32, 8
ALL = tuple(range(L))
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}
CFG = {"vocab_size": V, "hidden_size": D, "intermediate_size": 48, "moe_intermediate_size": 8, "num_hidden_layers": L,
       "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 2, "n_routed_experts": E,
       "routed_scaling_factor": 2.5, "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "v_head_dim": 12,
       "qk_nope_head_dim": 16, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
       "norm_topk_prob": True, "max_position_embeddings": 128, "rope_parameters": YARN, "rope_interleave": True,
       "eos_token_id": None, "tie_word_embeddings": False, "initializer_range": 0.2}
PLAIN = {"q_lora_rank": None, "rope_interleave": False, "num_hidden_layers": 2, "first_k_dense_replace": 1,
         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "n_shared_experts": 1,
         "norm_topk_prob": False, "n_group": 1, "topk_group": 1}
# Kimi-K2.5's config.json layout (its remote-code text config kimi_k2, the top-level tie flag), sizes shrunk
RELEASED = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
            "tie_word_embeddings": False,
            "vision_config": {"model_type": "kimi_k25_vision"}, "media_placeholder_token_id": 163605,
            "text_config": {**{k: v for k, v in CFG.items() if k not in ("rope_parameters", "tie_word_embeddings")},
                            "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"], "rope_theta": 50000.0,
                            "rope_scaling": {"type": "yarn", "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                             "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                                             "beta_slow": 1.0}, "num_nextn_predict_layers": 0, "eos_token_id": 3}}


def save_deepseek(path, seed: int = 0, **overrides):
    """A random tiny DeepseekV3ForCausalLM saved to ``path``; returns the torch model (eval, fp32)."""
    cfg = transformers.DeepseekV3Config(**{**CFG, **overrides})
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():  # norms start at 1 and the correction bias at 0: perturb them
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.3, 0.3)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """(checkpoint dir, torch model, loaded fp32 Target)."""
    path = str(tmp_path_factory.mktemp("deepseek_v3"))
    model = save_deepseek(path, seed=2)  # a seed whose greedy output varies and that a random draft partly accepts
    return path, model, dj.load_target(path)


# ----------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------

def test_config_reads_what_transformers_writes(deepseek):
    path, model, target = deepseek
    c = target.config
    assert isinstance(c, DeepseekV3Config) and c.model_type == "deepseek_v3" and not c.vision_language
    assert (c.head_dim, c.q_lora_rank, c.kv_lora_rank, c.v_head_dim, c.n_group, c.topk_group) == (24, 24, 16, 12, 4, 2)
    assert c.rope.rope_type == "yarn" and c.rope_interleave and [c.is_sparse(i) for i in ALL] == [False] + [True] * 3
    assert c.attention_scale() == pytest.approx(model.model.layers[0].self_attn.scaling, rel=1e-12)
    assert c.attention_scale() != pytest.approx(24 ** -0.5)  # mscale_all_dim changes it
    assert DeepseekV3Config.from_hf(c.to_hf()) == c
    again = transformers.DeepseekV3Config(**c.to_hf())
    for k in ("q_lora_rank", "kv_lora_rank", "n_group", "routed_scaling_factor", "rope_parameters", "qk_head_dim"):
        assert getattr(again, k) == getattr(model.config, k), k
    plain = DeepseekV3Config.from_hf(transformers.DeepseekV3Config(**{**CFG, **PLAIN}).to_dict())
    assert plain.q_lora_rank is None and not plain.rope_interleave
    assert plain.attention_scale() == pytest.approx(24 ** -0.5)


def test_yarn_rope_matches_transformers(deepseek):
    """Frequencies over qk_rope_head_dim and the cos/sin factor mscale / mscale_all_dim."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    _, model, target = deepseek
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](model.config, "cpu")
    got, got_factor = rope_frequencies(target.config.rope, target.config.qk_rope_head_dim)
    np.testing.assert_allclose(got, inv.numpy(), rtol=8 * EPS32)  # pow and YaRN's blend: a few rounded ops
    assert got_factor == pytest.approx(factor, rel=1e-12) and factor != 1.0


def test_config_reads_the_released_kimi_layout():
    c = DeepseekV3Config.from_hf(RELEASED)
    assert c.vision_language and c.model_type == "kimi_k25" and not c.tie_word_embeddings and c.eos_token_id == (3,)
    assert c.rope.rope_type == "yarn" and c.rope.get("factor") == 64.0 and c.rope.theta == 50000.0
    assert DeepseekV3Config.from_hf(c.to_hf()) == c
    written = transformers.Kimi_K25Config(**{k: v for k, v in c.to_hf().items() if k != "architectures"})
    assert written.text_config.model_type == "deepseek_v3" and written.text_config.kv_lora_rank == 16
    tied = DeepseekV3Config.from_hf({k: v for k, v in RELEASED.items() if k != "tie_word_embeddings"})
    assert tied.tie_word_embeddings  # Kimi_K25Config's default, whatever the text config says
    with pytest.raises(ValueError, match="text_config model_type 'qwen3'"):
        DeepseekV3Config.from_hf({**RELEASED, "text_config": {**RELEASED["text_config"], "model_type": "qwen3"}})


@pytest.mark.parametrize("quant,match", [
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int", "group_size": 32}}}},
     r"quantised \(quant_method 'compressed-tensors', format 'pack-quantized', 4-bit int\)"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]},
     r"quantised \(quant_method 'fp8', fmt 'e5m2', weight_block_size \[128, 128\]\)"),
], ids=["kimi_int4", "fp8_e5m2"])
def test_other_quantisations_are_refused_with_the_format_named(quant, match):
    with pytest.raises(ValueError, match=match):
        DeepseekV3Config.from_hf({**RELEASED, "quantization_config": quant})
    with pytest.raises(ValueError, match=match):
        DeepseekV3Config.from_hf({**RELEASED["text_config"], "model_type": "deepseek_v3",
                                  "quantization_config": quant})


def test_fp8_checkpoint_is_dequantised_on_load(deepseek, tmp_path):
    """DeepSeek-V3's released layout: every projection (q_a / q_b / kv_a / kv_b / o, the dense and shared MLPs,
    each expert) FP8 e4m3 with block scales (blocks 8 x 12: partial blocks in both dims), norms / router /
    embeddings not: the loaded model's logits equal transformers' model holding the dequantised weights."""
    src, model, _ = deepseek
    fp8_dir, ref_dir, scaled = fp8_copies(src, tmp_path, (8, 12))
    assert any("kv_b_proj" in n for n in scaled) and any(".experts.1.down_proj" in n for n in scaled)
    target = dj.load_target(fp8_dir)
    assert target.config.fp8_checkpoint and target.config.fp8_block_size == (8, 12)
    ref = transformers.DeepseekV3ForCausalLM.from_pretrained(ref_dir).eval()
    ids = np.random.RandomState(6).randint(0, V, (1, 10)).astype(np.int32)
    got = dj.target_logits(target, ids)
    assert_close(got, torch_forward(ref, ids)[0], forward_depth(target.config, 10), what="dequantised logits")
    assert max_diff(got, torch_forward(model, ids)[0]) > 1e-3  # the quantisation shows


# ----------------------------------------------------------------------------------------------------
# Parity with transformers
# ----------------------------------------------------------------------------------------------------

def test_logits_and_every_layer_match_transformers_on_a_ragged_batch(deepseek):
    """A 12- and a 9-token prompt (the short row padded with position -1) against transformers on each alone:
    logits and every hidden_states[i]."""
    _, model, target = deepseek
    assert ragged_parity(model, target, [12, 9]) > 1.0  # not a comparison of near-zeros


def test_plain_q_proj_and_neox_rope_match_transformers(tmp_path):
    model = save_deepseek(str(tmp_path), **PLAIN)
    target = dj.load_target(str(tmp_path))
    assert "q_proj" in target.params["layers_0"]["self_attn"] and target.config.q_lora_rank is None
    assert ragged_parity(model, target, [10, 7]) > 1.0


def test_incremental_decoding_through_the_latent_cache_equals_one_shot(deepseek):
    """Ragged rows fed 3 tokens at a time through the cache, which holds one latent "head" per token: keys
    [c | k_rot | 0] (16 + 8, zero-padded to 128 lanes) and values c (16), not the expanded 4 heads x (24 + 12)."""
    _, _, target = deepseek
    c, params = target.config, target.params
    ids = np.random.RandomState(2).randint(0, V, (2, 12)).astype(np.int32)
    full, full_feats, _ = forward(c, params, ids, positions_for(ids), feature_layer_ids=ALL)
    cache = target.new_cache(2, 24, max_block=3)
    assert {type(s).__name__ for s in cache.layers} == {"FullKV"}
    assert cache.layers[0].k.shape[2:] == (1, 128) and cache.layers[0].v.shape[2:] == (1, 16)
    got, got_feats, cache = decode_in_chunks(target, ids, cache, [5, 2], lambda n: 3, ALL)
    depth = forward_depth(c, 12)  # the same forward at other shapes (cached chunks): its rounding, per scale
    assert_close(got, full, depth, what="logits")
    assert_close(got_feats, full_feats, depth, what="features")


def test_speculative_equals_plain_equals_transformers_greedy(deepseek):
    """Batch of 3 ragged prompts, a random block-4 draft, with and without a stop token; partial acceptance."""
    _, model, target = deepseek
    lossless_greedy_with_partial_acceptance(model, target, blocks=(4,), new=16)


@pytest.mark.slow  # ~100 s on 2 CPU cores
def test_speculative_blocks_4_and_8_equal_transformers_greedy(deepseek):
    _, model, target = deepseek
    lossless_greedy_with_partial_acceptance(model, target, blocks=(4, 8))


@pytest.mark.slow  # ~40 s on 2 CPU cores
def test_tree_verification_equals_transformers_greedy(deepseek):
    """Tree verification (8 nodes) through the latent cache: the output is transformers' greedy one."""
    _, model, target = deepseek
    draft = random_draft(target.config, block_size=4, target_layer_ids=(0, 2, 3))
    prompts = [[5, 7, 3, 4, 9, 6], [7, 7, 1, 2, 3, 11, 12, 9, 14], [2, 8, 13]]
    out = S.speculative_generate(target, draft, prompts, max_new_tokens=12, stop_token_ids=[], tree_budget=8)
    assert [r.output_ids for r in out] == [torch_greedy(model, p, 12) for p in prompts]


def _sharded(target, *drafts):
    """``target`` (and ``drafts``) on an expert=2 mesh (with data=2, tensor=2): the routed experts split in two."""
    mesh = sh.make_mesh("data=2,expert=2,tensor=2")
    rules = ms.model_rules(mesh, target, *drafts)
    starget = ms.shard_target(target, mesh, rules)
    w = starget.params["layers_1"]["mlp"]["experts"]["gate_up_proj"]
    assert w.sharding.spec == P("expert", None, "tensor") and w.addressable_shards[0].data.shape[0] == E // 2
    return starget, [ms.shard_draft(d, mesh, rules) for d in drafts]


def test_expert_parallel_forward_equals_one_device(deepseek):
    """Logits and every layer's features of a ragged batch (the grouped dispatch; the gathered one runs in
    ``test_expert_parallel_speculative_equals_one_device``)."""
    _, _, target = deepseek
    starget, _ = _sharded(target)
    ids = np.random.RandomState(3).randint(0, V, (2, 12)).astype(np.int32)
    pos = positions_for(ids, [12, 9])
    want = forward(target.config, target.params, ids, pos, feature_layer_ids=ALL)[:2]
    got = forward(starget.config, starget.params, ids, pos, feature_layer_ids=ALL)[:2]
    depth = forward_depth(target.config, 12)  # experts summed across devices in another order: a forward's rounding
    assert_close(got[0], want[0], depth, what="logits")
    assert_close(got[1], want[1], depth, what="features")


@pytest.mark.slow  # ~60 s on 2 CPU cores (the sharded engine's compiles)
def test_expert_parallel_speculative_equals_one_device(deepseek):
    """Greedy speculative output and acceptance on the expert=2 mesh equal the single-device run's."""
    _, _, target = deepseek
    draft = random_draft(target.config, block_size=4, target_layer_ids=(0, 2, 3))
    prompts = [[5, 7, 3, 4, 9, 6], [7, 7, 1, 2, 3, 11, 12, 9, 14]]
    single = S.speculative_generate(target, draft, prompts, max_new_tokens=12, stop_token_ids=[])
    starget, (sdraft,) = _sharded(target, draft)
    out = S.speculative_generate(starget, sdraft, prompts, max_new_tokens=12, stop_token_ids=[])
    assert [r.output_ids for r in out] == [r.output_ids for r in single]
    assert [r.acceptance_lengths for r in out] == [r.acceptance_lengths for r in single]


def test_packed_documents_keep_their_features(deepseek):
    """Two documents packed in one row (latent attention, routed experts): each one's features equal its own
    unpacked forward's (the trainer's target features)."""
    packed_features_match(deepseek[2], ALL)


@pytest.mark.slow  # ~70 s on 2 CPU cores
def test_training_a_draft_runs_and_the_loss_falls(deepseek, tmp_path):
    from pairs import train_briefly

    path, _, target = deepseek
    draft, losses = train_briefly(path, target, str(tmp_path))
    assert draft.config.layers.hidden_size == D and draft.config.layers.head_dim == target.config.head_dim
    assert len(losses) == 30 and np.all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), losses


# ----------------------------------------------------------------------------------------------------
# Checkpoints: the Kimi-K2.5 VL layout, export, bad input
# ----------------------------------------------------------------------------------------------------

def save_kimi(path, text_model):
    """A Kimi_K25ForConditionalGeneration checkpoint (tiny random vision tower) whose language model is
    ``text_model``, written by transformers' save_pretrained. Returns the VL model."""
    vision = {"patch_size": 2, "pos_emb_height": 4, "pos_emb_width": 4, "pos_emb_time": 1, "num_attention_heads": 2,
              "num_hidden_layers": 1, "hidden_size": 16, "intermediate_size": 32, "merge_kernel_size": [2, 2]}
    cfg = transformers.Kimi_K25Config(text_config=text_model.config.to_dict(), vision_config=vision,
                                      projection_hidden_size=16, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Kimi_K25ForConditionalGeneration(cfg).eval()
    own = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
           for k, v in text_model.state_dict().items()}
    missing, unexpected = model.load_state_dict(own, strict=False)
    assert not unexpected and all(k.startswith(("model.vision_tower.", "model.mm_projector.")) for k in missing)
    model.save_pretrained(path)
    return model


def test_kimi_vision_language_checkpoint_loads(deepseek, tmp_path, capfd):
    """transformers' Kimi-K2.5 checkpoint (text under language_model.model., its layers written as .blocks.N, a
    vision tower and projector) and the released layout (.layers.N, text config kimi_k2) both load the language
    model alone, say what they skipped, and give the VL model's logits on text; our export reloads to the same."""
    vl = save_kimi(str(tmp_path / "hf"), deepseek[1])
    tensors = {n: np.array(a) for n, a in iter_safetensors(str(tmp_path / "hf" / "model.safetensors"))}
    assert "language_model.lm_head.weight" in tensors and any(n.startswith("vision_tower.") for n in tensors)
    assert any(n.startswith("language_model.model.blocks.1.mlp.experts.") for n in tensors)
    released = tmp_path / "released"
    released.mkdir()
    save_safetensors(str(released / "model.safetensors"),
                     {n.replace(".model.blocks.", ".model.layers."): a for n, a in tensors.items()})
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["text_config"]["model_type"] = "kimi_k2"
    (released / "config.json").write_text(json.dumps(config))
    ids = np.random.RandomState(4).randint(0, V, (1, 14)).astype(np.int32)
    with torch.no_grad():
        want = vl(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    for path in (tmp_path / "hf", released):
        target = dj.load_target(str(path))
        err = capfd.readouterr().err
        assert "kimi_k25: loaded the language model only" in err and "vision tower" in err
        assert target.config.vision_language and target.config.model_type == "kimi_k25"
        assert dataclasses.replace(target.config, vision_language=False, model_type="deepseek_v3") == deepseek[2].config
        assert_close(dj.target_logits(target, ids), want, forward_depth(target.config, 14), what=str(path))
    again = dj.load_target(target_lib.save_target(target, str(tmp_path / "again")))
    assert again.config == target.config
    assert_close(dj.target_logits(again, ids), want, forward_depth(target.config, 14), what="re-exported")


def test_save_target_reloads_in_transformers_and_mtp_layers_are_skipped(deepseek, tmp_path, capfd):
    _, model, target = deepseek
    out = target_lib.save_target(target, str(tmp_path / "saved"))
    again = transformers.DeepseekV3ForCausalLM.from_pretrained(out).eval()
    ids = np.random.RandomState(4).randint(0, V, (1, 10)).astype(np.int32)
    # the export is exact: every tensor transformers reads back is the original's, bit for bit (a forward of the
    # reloaded model is not: the same weights in other buffers take other vector paths, 1.2e-6 apart on one CPU)
    mine, theirs = again.state_dict(), model.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in theirs)
    tensors = {n: np.array(a) for n, a in iter_safetensors(os.path.join(out, "model.safetensors"))}
    tensors[f"model.layers.{L}.eh_proj.weight"] = np.zeros((D, 2 * D), np.float32)  # a DeepSeek-V3 MTP layer
    save_safetensors(os.path.join(out, "model.safetensors"), tensors)
    assert_close(dj.target_logits(dj.load_target(out), ids), torch_forward(model, ids)[0],
                 forward_depth(target.config, 10), what="MTP skipped")  # a float32 forward against transformers
    assert "1 multi-token prediction tensors" in capfd.readouterr().err


def test_missing_or_misshaped_tensor_is_named(deepseek, tmp_path):
    broken_tensors_are_named(deepseek[0], tmp_path, (
        ("model.layers.2.self_attn.kv_b_proj.weight", None),
        ("model.layers.1.mlp.gate.e_score_correction_bias", lambda a: np.zeros(E - 1, a.dtype)),
        ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", lambda a: a[:-1])))
    jax.clear_caches()


def test_scanned_layers_decode_what_unrolled_ones_do(deepseek):
    """``scan_layers``: the family's repeating layers as one scan (``pairs.scanned_decodes_the_same``)."""
    from pairs import scanned_decodes_the_same

    scanned_decodes_the_same(deepseek[2], [[3, 5, 7, 2, 9], [4, 4, 1], [8, 2, 6, 1, 3, 5, 7]])
