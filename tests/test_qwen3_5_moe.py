"""The qwen3_5_moe family (Qwen3.5-35B-A3B / 122B-A10B, Qwen3.6-35B-A3B) against transformers'
Qwen3_5MoeForCausalLM and Qwen3_5MoeForConditionalGeneration: the released config, parity of logits and
every layer on a ragged batch, incremental decoding, speculative == plain == transformers' greedy (the
recurrent rollback and the routed + shared experts together), the VL checkpoint layout, both expert
layouts, and a missing expert.

One tiny random checkpoint (transformers' own classes + save_pretrained, no network): the qwen3_5 test's
hybrid (3 Gated DeltaNet layers + 1 gated full attention, vocabulary 16) with 8 experts, top 2, expert
width 16 and a shared expert of width 24 in every layer.
"""
from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax.checkpoints import iter_safetensors, save_safetensors
from dflash_jax.families import family_of
from dflash_jax.families.qwen3_5_moe import Qwen35MoeConfig
from dflash_jax.target import forward
from hf_models import positions_for, ragged_parity, vision_language_loads
from pairs import decode_in_chunks, lossless_greedy_with_partial_acceptance
from test_qwen3_5 import CFG as HYBRID
from test_qwen3_5 import RELEASED_TEXT as DENSE_TEXT
from tolerances import assert_close, forward_depth

V, L, D = 16, 4, 32
ALL = tuple(range(L))
E, K = 8, 2
CFG = dict(HYBRID, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=16, shared_expert_intermediate_size=24)
# Qwen3.6-35B-A3B's config.json (the VL layout), text part as released: the dense one's hybrid settings
# with the MoE sizes and no intermediate_size
RELEASED_TEXT = {**{k: v for k, v in DENSE_TEXT.items() if k != "intermediate_size"},
                 "model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40,
                 "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 10,
                 "num_attention_heads": 16, "num_key_value_heads": 2, "eos_token_id": 248046, "num_experts": 256,
                 "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                 "router_aux_loss_coef": 0.001, "output_router_logits": False}
RELEASED = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "image_token_id": 248056, "text_config": RELEASED_TEXT, "tie_word_embeddings": False,
            "vision_config": {"depth": 27}}


@pytest.fixture(scope="module")
def qwen(tiny_hf):
    """(checkpoint dir, torch model, loaded fp32 Target)."""
    path, model = tiny_hf("qwen3_5_moe", "qwen3_5_moe", **CFG)
    return path, model, dj.load_target(path)


def test_config_reads_the_released_vision_language_layout():
    c = Qwen35MoeConfig.from_hf(RELEASED)
    assert c.model_type == "qwen3_5_moe" and c.vision_language and family_of(c).name == "qwen3_5_moe"
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.shared_expert_intermediate_size) == (
        256, 8, 512, 512)
    assert c.norm_topk_prob and all(c.is_sparse(i) for i in range(40))  # transformers always renormalises
    assert c.intermediate_size == 512  # no dense MLP: a draft's MLP width defaults to the experts'
    assert [c.is_linear(i) for i in range(4)] == [True, True, True, False] and c.conv_dim == 2 * 16 * 128 + 32 * 128
    assert c.rope.theta == 1e7 and c.rope.partial_rotary_factor == 0.25 and c.eos_token_id == (248046,)
    assert c.qk_norm and c.attn_output_gate and c.norm_offset
    assert Qwen35MoeConfig.from_hf(c.to_hf()) == c
    assert c.to_hf()["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    text = Qwen35MoeConfig.from_hf(RELEASED_TEXT)  # a text-only config
    assert text == dataclasses.replace(c, model_type="qwen3_5_moe_text", vision_language=False)
    assert Qwen35MoeConfig.from_hf(text.to_hf()) == text
    wide = Qwen35MoeConfig.from_hf({**RELEASED_TEXT, "intermediate_size": 6144})
    assert wide.intermediate_size == 6144 and Qwen35MoeConfig.from_hf(wide.to_hf()) == wide
    with pytest.raises(ValueError, match=r"missing \['shared_expert_intermediate_size'\]"):
        Qwen35MoeConfig.from_hf({k: v for k, v in RELEASED_TEXT.items() if k != "shared_expert_intermediate_size"})
    with pytest.raises(ValueError, match="num_experts_per_tok=300 must be in 1..num_experts=256"):
        Qwen35MoeConfig.from_hf({**RELEASED_TEXT, "num_experts_per_tok": 300})
    with pytest.raises(ValueError, match="expected 'qwen3_5_moe' or 'qwen3_5_moe_text'"):
        Qwen35MoeConfig.from_hf({**RELEASED_TEXT, "model_type": "qwen3_5_text"})


def test_logits_and_every_layer_match_transformers_on_a_ragged_batch(qwen):
    """Rows of 70 (two delta-rule chunks; the grouped expert dispatch), 45 and 9 tokens, padded with
    position -1, against transformers on each prompt alone: logits and every hidden_states[i]."""
    _, model, target = qwen
    assert ragged_parity(model, target, [70, 45, 9]) > 0.5  # the comparison is not between near-zero activations


def test_incremental_decoding_equals_one_shot(qwen):
    """A ragged prefill (9 and 3 tokens), 7-token chunks, then single tokens (the recurrent form and the
    gathered expert dispatch): logits and features equal the one-shot forward."""
    _, _, target = qwen
    seq = 24
    ids = np.random.RandomState(2).randint(0, V, (2, seq)).astype(np.int32)
    full, full_feats, _ = forward(target.config, target.params, ids, positions_for(ids), feature_layer_ids=ALL)
    cache = target.new_cache(2, 32, max_block=7)
    got, got_feats, _ = decode_in_chunks(target, ids, cache, [9, 3], lambda n: 7 if n < 18 else 1, ALL)
    depth = forward_depth(target.config, seq)  # the same forward at other shapes (chunks, the recurrent form)
    assert_close(got, full, depth, what="logits")
    assert_close(got_feats, full_feats, depth, what="features")


@pytest.mark.slow  # ~20-25 s on 2 CPU cores (8 compiled decode loops + transformers generate)
def test_speculative_equals_plain_equals_transformers_greedy(qwen):
    """Batch of 3 ragged prompts, random drafts of blocks 4 and 8, with and without a stop token;
    partial acceptance must occur (the recurrent rollback under the MoE layers)."""
    _, model, target = qwen
    lossless_greedy_with_partial_acceptance(model, target)


def test_vision_language_checkpoint_loads(qwen, tmp_path, capfd):
    """Qwen3_5MoeForConditionalGeneration's layout (per-expert tensors under model.language_model., a
    vision tower, mtp.*) loads the language model alone, equal to the VL model on text."""
    target = vision_language_loads(str(tmp_path), qwen[1], capfd)
    names = {n for n, _ in iter_safetensors(str(tmp_path / "model.safetensors"))}
    assert "model.language_model.layers.0.mlp.experts.7.down_proj.weight" in names
    assert "model.language_model.layers.0.mlp.shared_expert_gate.weight" in names
    assert target.config.num_experts == E


def _same_params(a, b):
    import jax

    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    assert all(jax.tree_util.tree_leaves(jax.tree_util.tree_map(lambda x, y: bool(np.array_equal(x, y)), a, b)))


def test_fused_expert_layout_loads_identically(qwen, tmp_path):
    """transformers' in-memory layout (``mlp.experts.gate_up_proj`` [E, 2I, D], ``down_proj``) gives the
    parameters the per-expert tensors save_pretrained writes give."""
    path, model, target = qwen
    names = {n for n, _ in iter_safetensors(f"{path}/model.safetensors")}
    assert "model.layers.3.mlp.experts.5.gate_proj.weight" in names
    fused = tmp_path / "fused"
    shutil.copytree(path, fused)
    save_safetensors(str(fused / "model.safetensors"), {k: v.numpy() for k, v in model.state_dict().items()})
    _same_params(dj.load_target(str(fused)).params, target.params)


@pytest.mark.parametrize("drop,match", [
    ("model.layers.2.mlp.experts.5.up_proj.weight", r"lacks tensor model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"),
    ("model.layers.1.mlp.shared_expert.down_proj.weight", r"model\.layers\.1\.mlp\.shared_expert\.down_proj\.weight"),
], ids=["routed_expert", "shared_expert"])
def test_a_missing_expert_names_the_tensor(qwen, tmp_path, drop, match):
    path = qwen[0]
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    tensors = {n: np.array(a) for n, a in iter_safetensors(f"{path}/model.safetensors") if n != drop}
    save_safetensors(str(bad / "model.safetensors"), tensors)
    assert json.loads((bad / "config.json").read_text())["model_type"] == "qwen3_5_moe_text"
    with pytest.raises(ValueError, match=match):
        dj.load_target(str(bad))


def test_scanned_layers_decode_what_unrolled_ones_do(qwen):
    """``scan_layers``: the family's repeating layers as one scan (``pairs.scanned_decodes_the_same``)."""
    from pairs import scanned_decodes_the_same

    scanned_decodes_the_same(qwen[2], [[3, 5, 7, 2, 9], [4, 4, 1], [8, 2, 6, 1, 3, 5, 7]])
