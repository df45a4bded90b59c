"""The qwen3_next family (Qwen3-Next / Qwen3-Coder-Next) against transformers' Qwen3NextForCausalLM: the
config, parity of logits and every layer on a ragged batch (fused in_proj_qkvz / in_proj_ba split on
load; routed + shared experts, a dense layer, top-k not renormalised), speculative == plain ==
transformers' greedy, and a fused projection of the wrong shape.

One tiny random checkpoint (transformers' own classes + save_pretrained, no network): the qwen3_5 test's
hybrid, but value heads of 8 (dk != dv, 2 value heads per key head: the interleaving shows), 8 experts,
top 2, layer 1 dense (``mlp_only_layers``).
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax.checkpoints import iter_safetensors, save_safetensors
from dflash_jax.families.qwen3_next import Qwen3NextConfig
from hf_models import ragged_parity
from pairs import lossless_greedy_with_partial_acceptance
from test_qwen3_5 import CFG as HYBRID

V, L, D = 16, 4, 32
ALL = tuple(range(L))
CFG = dict(HYBRID, linear_value_head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
           shared_expert_intermediate_size=24, norm_topk_prob=False, mlp_only_layers=[1],
           rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})


@pytest.fixture(scope="module")
def qwen(tiny_hf):
    """(checkpoint dir, torch model, loaded fp32 Target)."""
    path, model = tiny_hf("qwen3_next", "qwen3_next", **CFG)
    return path, model, dj.load_target(path)


def test_config_reads_what_transformers_writes(qwen):
    path, _, target = qwen
    c = target.config
    assert isinstance(c, Qwen3NextConfig) and c.model_type == "qwen3_next" and not c.vision_language
    assert not c.norm_topk_prob and c.mlp_only_layers == (1,) and [c.is_sparse(i) for i in ALL] == [
        True, False, True, True]
    assert c.intermediate_size == 64 and c.shared_expert_intermediate_size == 24 and c.linear_value_head_dim == 8
    assert c.rope.partial_rotary_factor == 0.25 and c.norm_offset and c.attn_output_gate
    assert Qwen3NextConfig.from_hf(c.to_hf()) == c
    written = json.load(open(f"{path}/config.json"))
    defaults = Qwen3NextConfig.from_hf({k: v for k, v in written.items()
                                        if k not in ("norm_topk_prob", "intermediate_size", "mlp_only_layers")})
    assert defaults.norm_topk_prob and defaults.intermediate_size == 5632 and defaults.mlp_only_layers == ()


def test_logits_and_every_layer_match_transformers_on_a_ragged_batch(qwen):
    """Rows of 70 (two delta-rule chunks), 45 and 9 tokens, padded with position -1, against transformers
    on each prompt alone: logits and every hidden_states[i]."""
    _, model, target = qwen
    assert ragged_parity(model, target, [70, 45, 9]) > 0.5  # the comparison is not between near-zero activations


@pytest.mark.slow  # ~20-25 s on 2 CPU cores (8 compiled decode loops + transformers generate)
def test_speculative_equals_plain_equals_transformers_greedy(qwen):
    _, model, target = qwen
    lossless_greedy_with_partial_acceptance(model, target)


def test_fused_projection_of_the_wrong_shape_names_the_tensor(qwen, tmp_path):
    path = qwen[0]
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    name = "model.layers.2.linear_attn.in_proj_ba.weight"
    tensors = {n: np.array(a) for n, a in iter_safetensors(f"{path}/model.safetensors")}
    tensors[name] = tensors[name][:-2]
    save_safetensors(str(bad / "model.safetensors"), tensors)
    with pytest.raises(ValueError, match=r"tensor model\.layers\.2\.linear_attn\.in_proj_ba\.weight has shape "
                                         r"\[6, 32\] but the config implies \[8, 32\]"):
        dj.load_target(str(bad))


def test_scanned_layers_decode_what_unrolled_ones_do(tiny_hf):
    """``scan_layers``: the family's repeating layers as one scan (``pairs.scanned_decodes_the_same``); 8 layers
    with every MLP sparse: (3 linear-attention layers, a full one) twice, scanned as one pattern."""
    from dflash_jax.target import load_target, layer_groups, scanned
    from pairs import scanned_decodes_the_same

    path, _ = tiny_hf("qwen3_next_8", "qwen3_next", **{**CFG, "mlp_only_layers": [], "num_hidden_layers": 8})
    target = load_target(path)
    assert layer_groups(scanned(target).config) == ((0, 2, 4),)
    scanned_decodes_the_same(target, [[3, 5, 7, 2, 9], [4, 4, 1], [8, 2, 6, 1, 3, 5, 7]])
