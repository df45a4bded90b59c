"""The gemma4 family against transformers' Gemma4ForCausalLM / Gemma4ForConditionalGeneration.

One tiny random checkpoint (transformers' own classes + save_pretrained, no network) with every feature but the
MoE block on: sliding window 4 < the prompt lengths, full layers with their own head dim (16 vs 8) and one KV
head through ``attention_k_eq_v`` (no v_proj), proportional rope, per-layer embeddings, the last two layers
kv-shared (one sliding, one full) with double-wide MLPs, final logit soft-capping, and perturbed norms and layer
scalars so that a mis-mapped one shows. The MoE block (router scales perturbed too) has its own parity test
(``MOE``), which keeps the engine tests' compiles small.
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import dflash_jax as dj
from dflash_jax import decode as S
from dflash_jax import target as target_lib
from dflash_jax.checkpoints import iter_safetensors
from dflash_jax.families.gemma4 import Gemma4Config
from dflash_jax.layers import rope_frequencies
from dflash_jax.target import forward
from infer.presets import RELEASED as PRESETS
from hf_models import (broken_tensors_are_named, perturb, positions_for, ragged_parity, torch_forward,
                       torch_greedy)
from pairs import decode_in_chunks, lossless_greedy_with_partial_acceptance, random_draft
from tolerances import EPS32, assert_close, forward_depth

V, L, D = 16, 5, 32
ALL = tuple(range(L))
TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"]
CFG = {"vocab_size": V, "hidden_size": D, "intermediate_size": 32, "num_hidden_layers": L, "num_attention_heads": 4,
       "num_key_value_heads": 2, "head_dim": 8, "global_head_dim": 16, "num_global_key_value_heads": 1,
       "attention_k_eq_v": True, "layer_types": TYPES, "sliding_window": 4, "max_position_embeddings": 128,
       "hidden_size_per_layer_input": 4, "vocab_size_per_layer_input": V, "num_kv_shared_layers": 2,
       "use_double_wide_mlp": True, "final_logit_softcapping": 5.0, "initializer_range": 0.1, "eos_token_id": None,
       "tie_word_embeddings": True,
       "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                           "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                              "rope_theta": 1000000.0}}}
MOE = {"num_hidden_layers": 3, "layer_types": TYPES[:2] + TYPES[-1:], "num_kv_shared_layers": 1,
       "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 8}
# gemma-4-31B-it's config.json (the VL layout, transformers 5.x), its text part shrunk to tiny sizes
RELEASED = {
    "architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "eos_token_id": [1, 106],
    "image_token_id": 258880, "tie_word_embeddings": True, "vision_config": {"model_type": "gemma4_vision"},
    "text_config": PRESETS["gemma-4-31b"].hf}  # google/gemma-4-31B-it's config.json (its text config: the preset's)


def save_gemma4(path, seed: int = 0, **overrides):
    """A random tiny Gemma4ForCausalLM saved to ``path``; returns the torch model (eval, fp32)."""
    cfg = transformers.Gemma4TextConfig(**{**CFG, **overrides})
    torch.manual_seed(seed)
    model = transformers.Gemma4ForCausalLM(cfg).eval()
    perturb(model, {"norm": 0.1, "scale": 0.1}, {"layer_scalar": (0.5, 1.5)})  # norms, scales, layer scalars: 1
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(checkpoint dir, torch model, loaded fp32 Target)."""
    path = str(tmp_path_factory.mktemp("gemma4"))
    model = save_gemma4(path)
    return path, model, dj.load_target(path)


# ----------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------

def test_config_reads_the_released_vision_language_layout():
    c = Gemma4Config.from_hf(RELEASED)
    assert c.vision_language and c.model_type == "gemma4" and c.tie_word_embeddings
    assert (c.head_dim, c.num_key_value_heads, c.global_head_dim, c.num_global_key_value_heads) == (256, 16, 512, 4)
    assert c.attention_k_eq_v and c.final_logit_softcapping == 30.0 and c.eos_token_id == (1, 106)
    assert [c.layer_window(i) for i in range(6)] == [1024] * 5 + [None]
    assert c.rope.rope_type == "default" and c.rope.theta == 10000.0
    assert c.global_rope.rope_type == "proportional" and c.global_rope.get("partial_rotary_factor") == 0.25
    assert not (c.hidden_size_per_layer_input or c.num_kv_shared_layers or c.enable_moe_block)
    assert Gemma4Config.from_hf(c.to_hf()) == c
    text = Gemma4Config.from_hf(RELEASED["text_config"])
    assert not text.vision_language and text.eos_token_id == (1,)
    assert dataclasses.replace(text, model_type="gemma4", vision_language=True, eos_token_id=(1, 106)) == c


def test_config_reads_what_transformers_writes():
    """transformers 5.x writes the full layers' sizes as per_layer_config; without attention_k_eq_v it ignores
    num_global_key_value_heads. Both read as transformers builds them, and to_hf says the same to it."""
    for k_eq_v in (True, False):
        hf = transformers.Gemma4TextConfig(**{**CFG, "attention_k_eq_v": k_eq_v})
        c = Gemma4Config.from_hf(hf.to_dict())
        full = hf.per_layer_config[1]
        assert (c.global_head_dim, c.num_global_key_value_heads) == (full.head_dim, full.num_key_value_heads)
        assert c.num_global_key_value_heads == (1 if k_eq_v else 2)
        again = transformers.Gemma4TextConfig(**c.to_hf()).per_layer_config[1]
        assert (again.head_dim, again.num_key_value_heads) == (full.head_dim, full.num_key_value_heads)
        assert Gemma4Config.from_hf(c.to_hf()) == c
    with pytest.raises(ValueError, match="per_layer_config"):
        Gemma4Config.from_hf({**hf.to_dict(), "per_layer_config": {"0": {"head_dim": 16}}})
    with pytest.raises(ValueError, match="no earlier full_attention layer"):
        Gemma4Config.from_hf({**hf.to_dict(), "num_kv_shared_layers": 4})


def test_proportional_rope_matches_transformers():
    """Frequencies over the full head dim, the first partial_rotary_factor of them non-zero."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.Gemma4TextConfig(**CFG)
    inv, scale = ROPE_INIT_FUNCTIONS["proportional"](hf, "cpu", layer_type="full_attention")
    ours = Gemma4Config.from_hf(hf.to_dict())
    got, got_scale = rope_frequencies(ours.global_rope, ours.global_head_dim)
    np.testing.assert_array_equal(got, inv.numpy())
    assert got_scale == scale and np.count_nonzero(got) == 4


# ----------------------------------------------------------------------------------------------------
# Parity with transformers
# ----------------------------------------------------------------------------------------------------

def test_logits_and_every_layer_match_transformers_on_a_ragged_batch(gemma):
    """A 12- and a 9-token prompt (the short row padded with position -1) against transformers on each alone:
    logits and every hidden_states[i], past the sliding window (4)."""
    _, model, target = gemma
    assert [target.config.kv_source(i) for i in ALL] == [None] * 3 + [2, 1]
    assert ragged_parity(model, target, [12, 9]) > 1.0  # not a comparison of near-zeros


def test_moe_block_matches_transformers(tmp_path):
    """The MoE variant (experts beside the dense MLP, router scales): logits and every layer, ragged; 2 x 12
    token copies > 4 experts routes through the grouped dispatch, one token (decode) through the gathered one."""
    model = save_gemma4(str(tmp_path), **MOE)
    target = dj.load_target(str(tmp_path))
    assert target.config.enable_moe_block and target.config.num_experts == 4
    assert ragged_parity(model, target, [12, 9]) > 1.0
    ids = np.random.RandomState(5).randint(0, V, (1, 1)).astype(np.int32)
    assert_close(dj.target_logits(target, ids), torch_forward(model, ids)[0], forward_depth(target.config, 1),
                 what="one-token logits")


def test_incremental_decoding_equals_one_shot(gemma):
    """Ragged rows fed 3 tokens at a time through the cache; sliding layers keep a ring of window + 3 = 7 slots,
    which wraps; kv-shared layers keep nothing: logits and features equal the one-shot forward."""
    _, _, target = gemma
    c, params = target.config, target.params
    ids = np.random.RandomState(2).randint(0, V, (2, 12)).astype(np.int32)
    full, full_feats, _ = forward(c, params, ids, positions_for(ids), feature_layer_ids=ALL)
    cache = target.new_cache(2, 24, max_block=3)
    assert [type(s).__name__ for s in cache.layers] == ["SlidingKV", "FullKV", "SlidingKV", "SharedKV", "SharedKV"]
    assert cache.layers[1].k.shape[2:] == (1, 16) and cache.layers[0].k.shape[2:] == (2, 8)
    got, got_feats, cache = decode_in_chunks(target, ids, cache, [5, 2], lambda n: 3, ALL)
    depth = forward_depth(c, 12)  # the same forward at other shapes (cached chunks): its rounding, per scale
    assert_close(got, full, depth, what="logits")
    assert_close(got_feats, full_feats, depth, what="features")


def test_speculative_equals_plain_equals_transformers_greedy(gemma):
    """Batch of 3 ragged prompts, a random block-4 draft, with and without a stop token; partial acceptance
    must occur (the sliding rings and the kv-shared layers roll back)."""
    _, model, target = gemma
    lossless_greedy_with_partial_acceptance(model, target, blocks=(4,), new=16)


@pytest.mark.slow  # ~100 s on 2 CPU cores
def test_speculative_blocks_4_and_8_equal_transformers_greedy(gemma):
    _, model, target = gemma
    lossless_greedy_with_partial_acceptance(model, target, blocks=(4, 8))


def test_draft_sees_the_raw_embedding_and_the_uncapped_head(gemma):
    """The draft embeds its block with the RAW table (the target scales by sqrt(hidden) inside) and predicts
    through the uncapped lm_head; the target's own logits are soft-capped."""
    _, model, target = gemma
    c, params = target.config, target.params
    ids = np.arange(6, dtype=np.int32)[None]
    table = model.model.embed_tokens.weight.detach().numpy()
    np.testing.assert_array_equal(np.asarray(target_lib.embed(c, params, ids)), table[ids])
    with torch.no_grad():
        hidden = model(torch.as_tensor(ids, dtype=torch.long), output_hidden_states=True).hidden_states
    # one product by a rounded sqrt(D): 2 ulps relative, x2 for torch's own rounding of the scale
    np.testing.assert_allclose(hidden[0].numpy(), table[ids] * np.float32(D ** 0.5), rtol=4 * EPS32)
    logits, _, _ = forward(c, params, ids, positions_for(ids))
    h = hidden[-1].numpy().astype(np.float64)
    # JAX's forward against torch's hidden states and an exact head: a forward's rounding
    assert_close(logits, 5.0 * np.tanh(h @ table.T / 5.0), forward_depth(c, 6), what="capped logits")
    big = 20 * h  # final-normed hidden states whose raw logits pass the cap
    raw = np.asarray(target_lib.head(c, params, jnp.asarray(big, jnp.float32)))
    assert np.abs(raw).max() > 10.0
    assert_close(raw, big @ table.T, D, what="raw head")  # one float32 reduction over D against exact


# ----------------------------------------------------------------------------------------------------
# Checkpoints: the VL layout, export, bad input
# ----------------------------------------------------------------------------------------------------

def save_vision_language(path, text_model):
    """A Gemma4ForConditionalGeneration checkpoint (tiny random vision and audio towers) whose language model is
    ``text_model``: the released layout. Returns the VL model."""
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 2, "head_dim": 8, "patch_size": 2, "position_embedding_size": 16,
              "pooling_kernel_size": 1}
    audio = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "subsampling_conv_channels": [4, 4],
             "output_proj_dims": 16, "conv_kernel_size": 3}
    cfg = transformers.Gemma4Config(text_config=text_model.config.to_dict(), vision_config=vision,
                                    audio_config=audio, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Gemma4ForConditionalGeneration(cfg).eval()
    own = {k.replace("model.", "model.language_model.", 1): v for k, v in text_model.state_dict().items()
           if k.startswith("model.")}
    missing, unexpected = model.load_state_dict(own, strict=False)
    towers = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
    assert not unexpected and all(k.startswith(towers) or k == "lm_head.weight" for k in missing), (missing, unexpected)
    model.save_pretrained(path)
    return model


def test_vision_language_checkpoint_loads(gemma, tmp_path, capfd):
    """The released layout (text under model.language_model., vision and audio towers): loads the language
    model alone, says what it skipped, and its logits equal the VL model's on text; our own VL export reloads
    to the same."""
    vl = save_vision_language(str(tmp_path), gemma[1])
    tensors = dict(iter_safetensors(os.path.join(tmp_path, "model.safetensors")))
    assert any(n.startswith("model.vision_tower.") for n in tensors) and any("audio_tower" in n for n in tensors)
    target = dj.load_target(str(tmp_path))
    err = capfd.readouterr().err
    assert "gemma4: loaded the language model only" in err and "vision tower" in err and "audio tower" in err
    assert target.config.vision_language and target.config.model_type == "gemma4"
    assert dataclasses.replace(target.config, vision_language=False, model_type="gemma4_text") == gemma[2].config
    ids = np.random.RandomState(4).randint(0, V, (1, 14)).astype(np.int32)
    with torch.no_grad():
        want = vl(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    depth = forward_depth(target.config, 14)  # JAX against torch: a forward's rounding each
    assert_close(dj.target_logits(target, ids), want, depth, what="VL logits")
    again = dj.load_target(target_lib.save_target(target, str(tmp_path / "again")))
    assert again.config == target.config
    assert_close(dj.target_logits(again, ids), want, depth, what="re-exported VL logits")


def test_save_target_reloads_in_transformers(gemma, tmp_path):
    """Our export (config.json + tensors) is a checkpoint transformers reads back into the same model."""
    _, model, target = gemma
    out = target_lib.save_target(target, str(tmp_path / "saved"))
    again = transformers.Gemma4ForCausalLM.from_pretrained(out).eval()
    ids = np.random.RandomState(4).randint(0, V, (1, 10)).astype(np.int32)
    assert_close(torch_forward(again, ids)[0], torch_forward(model, ids)[0], forward_depth(target.config, 10),
                 what="reloaded torch")
    assert dj.load_target(out).config == target.config


def test_missing_or_misshaped_tensor_is_named(gemma, tmp_path):
    src = gemma[0]
    broken_tensors_are_named(src, tmp_path, (("model.layers.1.self_attn.k_proj.weight", None),
                                             ("model.layers.3.layer_scalar", lambda a: np.ones(2, a.dtype))))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        Gemma4Config.from_hf({**config, "use_bidirectional_attention": "all"})
    jax.clear_caches()


@pytest.mark.slow  # ~30 s on 2 CPU cores
def test_tree_verification_equals_transformers_greedy(gemma):
    """Tree verification (8 nodes): kv-shared layers attend to their source layer's cache and the tree's own
    keys as it does; the output is transformers' greedy one."""
    _, model, target = gemma
    draft = random_draft(target.config, block_size=4, target_layer_ids=(0, 2, 3))
    prompts = [[5, 7, 3, 4, 9, 6], [7, 7, 1, 2, 3, 11, 12, 9, 14], [2, 8, 13]]
    out = S.speculative_generate(target, draft, prompts, max_new_tokens=12, stop_token_ids=[], tree_budget=8)
    assert [r.output_ids for r in out] == [torch_greedy(model, p, 12) for p in prompts]


def test_scanned_layers_decode_what_unrolled_ones_do(tmp_path):
    """``scan_layers`` on 6 layers, (sliding, sliding, full) x 2, no kv-shared ones: one pattern of period 3 with
    its per-layer inputs (``pairs.scanned_decodes_the_same``); with kv-shared layers (this module's target) no
    layer scans."""
    from dflash_jax.target import layer_groups, scanned
    from pairs import scanned_decodes_the_same

    save_gemma4(str(tmp_path), num_hidden_layers=6, num_kv_shared_layers=0,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2)
    target = dj.load_target(str(tmp_path))
    assert layer_groups(scanned(target).config) == ((0, 2, 3),)
    scanned_decodes_the_same(target, [[3, 5, 7, 2, 9], [4, 4, 1], [8, 2, 6, 1, 3, 5, 7]])


def test_kv_shared_layers_are_not_scanned(gemma):
    """A target with kv-shared layers: ``scan_layers`` leaves every layer alone (``gemma4.layer_kinds``)."""
    from dflash_jax.target import layer_groups, scanned

    assert all(repeats == 1 for _, repeats, _ in layer_groups(scanned(gemma[2]).config))
