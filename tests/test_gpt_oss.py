"""The gpt_oss family against transformers' GptOssForCausalLM: parity, decoding, MXFP4 loading, bad input, training.

One tiny random checkpoint (transformers' own classes + save_pretrained, no network) serves every test:
sliding window 4 < the prompt lengths, 8 experts (top 2), a small SwiGLU clamp so that it bites, and
perturbed norms, biases and sinks so that a mis-mapped one shows.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import pytest
import torch
import transformers

import dflash_jax as dj
from dflash_jax import decode as S
from dflash_jax.checkpoints import iter_safetensors, save_safetensors
from dflash_jax.families.gpt_oss import GptOssConfig
from dflash_jax.layers import rope_frequencies
from dflash_jax.mxfp4 import dequantize
from dflash_jax.target import forward
from hf_models import TINY, packed_features_match, positions_for, save_tiny, torch_forward, torch_greedy
from tolerances import EPS32, assert_close, forward_depth, max_diff
from pairs import adaptive_lossless, decode_in_chunks, random_draft

V, L, D = TINY["vocab_size"], TINY["num_hidden_layers"], TINY["hidden_size"]
ALL = tuple(range(L))
CFG = dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, sliding_window=4, swiglu_limit=0.5,
           initializer_range=0.2,
           swiglu_alpha=1.5)
# gpt-oss-20b's config.json (transformers 4.55 layout, quantization_config and all), shrunk to tiny sizes
RELEASED_CONFIG = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4,
    "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
    "vocab_size": 201088}


@pytest.fixture(scope="module")
def gptoss(tmp_path_factory):
    """(checkpoint dir, torch model, loaded fp32 Target)."""
    path = str(tmp_path_factory.mktemp("gpt_oss"))
    model = save_tiny(path, "gpt_oss", **CFG)
    return path, model, dj.load_target(path)


# ----------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------

def test_config_reads_the_released_layout():
    c = GptOssConfig.from_hf(RELEASED_CONFIG)
    assert (c.num_local_experts, c.num_experts_per_tok, c.intermediate_size) == (32, 4, 2880)
    assert (c.swiglu_alpha, c.swiglu_limit, c.sliding_window, c.rms_norm_eps) == (1.702, 7.0, 128, 1e-5)
    assert c.attention_bias and c.attention_sinks and not c.qk_norm and c.head_dim == 64
    assert [c.layer_window(i) for i in range(2)] == [128, None]
    assert c.rope.theta == 150000 and c.rope.rope_type == "yarn" and c.rope.get("truncate") is False
    assert c.eos_token_id == (200002,) and c.pad_token_id == 199999
    assert GptOssConfig.from_hf(c.to_hf()) == c
    with pytest.raises(ValueError, match="missing 'num_experts_per_tok'"):
        GptOssConfig.from_hf({k: v for k, v in RELEASED_CONFIG.items()
                              if k not in ("num_experts_per_tok", "experts_per_token")})


def test_yarn_frequencies_match_transformers():
    """gpt-oss's YaRN (truncate false) as transformers computes it; truncation would change them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    ours = GptOssConfig.from_hf(RELEASED_CONFIG).rope
    hf = transformers.GptOssConfig(**{k: v for k, v in RELEASED_CONFIG.items() if k != "quantization_config"})
    inv, scale = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    got_inv, got_scale = rope_frequencies(ours, 64)
    np.testing.assert_allclose(got_inv, inv.numpy(), rtol=8 * EPS32)  # pow and YaRN's blend: a few rounded ops
    assert got_scale == pytest.approx(scale)
    truncated = dataclasses.replace(ours, params=tuple((k, True if k == "truncate" else v) for k, v in ours.params))
    assert np.max(np.abs(rope_frequencies(truncated, 64)[0] / inv.numpy() - 1)) > 1e-3


# ----------------------------------------------------------------------------------------------------
# Parity with transformers
# ----------------------------------------------------------------------------------------------------

def test_logits_and_every_layer_match_transformers_on_a_ragged_batch(gptoss):
    """A batch of a 12- and a 9-token prompt (the short row padded with position -1) against transformers
    on each prompt alone: logits and every hidden_states[i], past the sliding window (4)."""
    _, model, target = gptoss
    c = target.config
    assert c.layer_types == ("sliding_attention", "full_attention") * 2 and c.sliding_window == 4
    assert (c.num_local_experts, c.num_experts_per_tok, c.swiglu_alpha, c.swiglu_limit) == (8, 2, 1.5, 0.5)
    ids = np.random.RandomState(1).randint(0, V, (2, 12)).astype(np.int32)
    lengths = [12, 9]
    logits, feats, _ = forward(c, target.params, ids, positions_for(ids, lengths), feature_layer_ids=ALL)
    logits, feats = np.asarray(logits), np.asarray(feats)
    depth = forward_depth(c, 12)  # JAX and torch round a whole forward differently
    for r, n in enumerate(lengths):
        ref_logits, ref_feats = torch_forward(model, ids[r:r + 1, :n], ALL)
        assert_close(logits[r, :n], ref_logits[0], depth, what=f"logits row {r}")
        for i in ALL:
            assert_close(feats[r, :n, i * D:(i + 1) * D], ref_feats[0, :, i * D:(i + 1) * D], depth,
                         what=f"row {r} layer {i}")


def test_sinks_window_and_clamp_all_matter(gptoss):
    """The parity above is meaningful: dropping the sinks, the window or the clamp changes the logits."""
    _, _, target = gptoss
    c, params = target.config, target.params
    ids = np.random.RandomState(1).randint(0, V, (2, 12)).astype(np.int32)
    base = np.asarray(forward(c, params, ids, positions_for(ids))[0])
    no_sinks = jax.tree_util.tree_map(np.array, params)  # writable copies
    for i in ALL:
        no_sinks[f"layers_{i}"]["self_attn"]["sinks"][:] = -1e9
    variants = [(c, no_sinks), (dataclasses.replace(c, layer_types=("full_attention",) * L), params),
                (dataclasses.replace(c, swiglu_limit=1e9), params)]
    for cfg, p in variants:
        assert max_diff(forward(cfg, p, ids, positions_for(ids))[0], base) > 1e-3


def test_incremental_decoding_equals_one_shot(gptoss):
    """Ragged rows fed 3 tokens at a time through the cache; sliding layers keep a ring of window + 3 = 7
    slots, which wraps: logits and features equal the one-shot forward."""
    _, _, target = gptoss
    c, params = target.config, target.params
    seq = 12
    ids = np.random.RandomState(2).randint(0, V, (2, seq)).astype(np.int32)
    full, full_feats, _ = forward(c, params, ids, positions_for(ids), feature_layer_ids=ALL)
    cache = target.new_cache(2, 24, max_block=3)
    assert [type(s).__name__ for s in cache.layers] == ["SlidingKV", "FullKV"] * 2
    got, got_feats, cache = decode_in_chunks(target, ids, cache, [5, 2], lambda n: 3, ALL)  # ragged prefill
    np.testing.assert_array_equal(cache.lengths, [seq, seq])
    depth = forward_depth(c, seq)  # the same forward at other shapes (cached chunks): its rounding, per scale
    assert_close(got, full, depth, what="logits")
    assert_close(got_feats, full_feats, depth, what="features")


def test_speculative_equals_plain_equals_transformers_greedy(gptoss):
    """Block 4, and adaptive verify of 2 or 4 tokens (sliding-window rings roll back after either)."""
    _, model, target = gptoss
    draft = random_draft(target.config, block_size=4, target_layer_ids=(0, 2, 3))
    prompts = [[5, 17, 3, 44, 9, 60], [7, 7, 81, 2, 30, 11, 52, 19, 64]]
    new = 20

    free = [torch_greedy(model, p, new) for p in prompts]
    generated = free[0][len(prompts[0]):]
    stop = next(t for i, t in enumerate(generated) if i >= 3 and t not in generated[:i])  # cuts row 0 short
    expected = [torch_greedy(model, p, new, stop) for p in prompts]
    assert len(expected[0]) < len(free[0])
    for stops, want in (([], free), ([stop], expected)):
        plain = S.generate(target, prompts, max_new_tokens=new, stop_token_ids=stops)
        spec = S.speculative_generate(target, draft, prompts, max_new_tokens=new, stop_token_ids=stops)
        assert [r.output_ids for r in plain] == want
        assert [r.output_ids for r in spec] == want
        adaptive_lossless(target, draft, prompts, want, (2, 4), max_new_tokens=new, stop_token_ids=stops)


@pytest.mark.parametrize("spec", ["data=2,expert=4", "expert=2,tensor=2,data=2"])
def test_expert_parallel_mesh_equals_one_device(gptoss, spec):
    """Experts split over the mesh's expert axis (sinks, biases and all): the same tokens as one device."""
    from dflash_jax import model_sharding as ms
    from dflash_jax import sharding as sh

    _, _, target = gptoss
    draft = random_draft(target.config, block_size=4, target_layer_ids=(0, 2, 3))
    prompts = [[5, 17, 3, 44, 9, 60], [7, 7, 81, 2, 30, 11, 52, 19, 64]]
    want = S.speculative_generate(target, draft, prompts, max_new_tokens=12, stop_token_ids=[])
    mesh = sh.make_mesh(spec)
    ts, ds = ms.shard_target(target, mesh), ms.shard_draft(draft, mesh)
    experts = ts.params["layers_0"]["mlp"]["experts"]["gate_up_proj"]
    assert experts.addressable_shards[0].data.shape[0] == experts.shape[0] // mesh.shape["expert"]
    got = S.speculative_generate(ts, ds, prompts, max_new_tokens=12, stop_token_ids=[])
    assert [r.output_ids for r in got] == [r.output_ids for r in want]


# ----------------------------------------------------------------------------------------------------
# MXFP4
# ----------------------------------------------------------------------------------------------------

FP4_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # e2m1 codes 0..7; bit 3 is the sign


def quantize_mxfp4(w):
    """[E, in, out] float -> (blocks uint8 [E, out, in/32, 16], scales uint8 [E, out, in/32]) as released
    gpt-oss checkpoints store them: groups of 32 along ``in``, the even element in the low nibble."""
    e, n_in, n_out = w.shape
    groups = np.swapaxes(w, 1, 2).reshape(e, n_out, n_in // 32, 32)
    amax = np.abs(groups).max(-1)
    scales = np.clip(np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)) + 127, 0, 254).astype(np.uint8)
    q = groups / np.ldexp(1.0, scales.astype(np.int64) - 127)[..., None]
    codes = np.abs(np.abs(q)[..., None] - FP4_MAGNITUDES).argmin(-1) + 8 * (q < 0)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), scales


def hf_dequantize(blocks, scales):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)


def test_mxfp4_dequantization_equals_transformers():
    rng = np.random.RandomState(0)
    w = rng.standard_normal((3, 64, 40)).astype(np.float32) * np.exp(rng.uniform(-6, 2, (3, 1, 40)))
    blocks, scales = quantize_mxfp4(w)
    ours = dequantize("x", blocks, scales)
    assert str(ours.dtype) == "bfloat16" and ours.shape == w.shape
    ref = hf_dequantize(blocks, scales).numpy()
    np.testing.assert_array_equal(ours.astype(np.float32), ref)  # bit-exact
    # and it is a quantization of w (not of some transpose of it): within half the widest FP4 step
    step = np.ldexp(1.0, np.repeat(scales.astype(np.int64) - 127, 32, axis=-1)).transpose(0, 2, 1)
    assert np.all(np.abs(ref - w) <= step + 1e-12)


def write_mxfp4_checkpoint(src, dst, edit=None):
    """``src``'s checkpoint with every expert matrix in MXFP4, as two shards (all scales in the first, so
    scales arrive before their blocks); returns {name: transformers-dequantized tensor}. ``edit(tensors)``
    may break the tensors before they are written."""
    os.makedirs(dst, exist_ok=True)
    tensors = dict(iter_safetensors(os.path.join(src, "model.safetensors")))
    dequantized = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(np.asarray(tensors.pop(name), np.float32))
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        dequantized[name] = hf_dequantize(blocks, scales)
    if edit:
        edit(tensors)
    shards = {"model-00001-of-00002.safetensors": {n: a for n, a in tensors.items() if n.endswith("_scales")},
              "model-00002-of-00002.safetensors": {n: a for n, a in tensors.items() if not n.endswith("_scales")}}
    for file, part in shards.items():
        save_safetensors(os.path.join(dst, file), {n: np.asarray(a) for n, a in part.items()})
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {n: file for file, part in shards.items() for n in part}}, f)
    config = json.load(open(os.path.join(src, "config.json")))
    config["quantization_config"] = RELEASED_CONFIG["quantization_config"]
    json.dump(config, open(os.path.join(dst, "config.json"), "w"))
    return dequantized


def test_mxfp4_checkpoint_loads_like_transformers_dequantized(gptoss, tmp_path):
    path, model, _ = gptoss
    dequantized = write_mxfp4_checkpoint(path, str(tmp_path))
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for name, value in dequantized.items():
            reference.get_parameter(name).copy_(value)
    target = dj.load_target(str(tmp_path))
    got = np.asarray(target.params["layers_1"]["mlp"]["experts"]["down_proj"])
    np.testing.assert_array_equal(got, dequantized["model.layers.1.mlp.experts.down_proj"].numpy())
    ids = np.random.RandomState(3).randint(0, V, (2, 12)).astype(np.int32)
    ref_logits, _ = torch_forward(reference, ids)
    assert_close(dj.target_logits(target, ids), ref_logits, forward_depth(target.config, 12), what="logits")
    assert max_diff(ref_logits, torch_forward(model, ids)[0]) > 1e-4  # quantization did change the model
    bf16 = dj.load_target(str(tmp_path), dtype="bfloat16")  # dequantized values are exact in bf16
    np.testing.assert_array_equal(np.asarray(bf16.params["layers_1"]["mlp"]["experts"]["down_proj"], np.float32), got)


def test_mxfp4_missing_scales_names_the_tensor(gptoss, tmp_path):
    name = "model.layers.1.mlp.experts.down_proj"
    write_mxfp4_checkpoint(gptoss[0], str(tmp_path), edit=lambda t: t.pop(name + "_scales"))
    with pytest.raises(ValueError, match=rf"{name}_blocks has no {name}_scales"):
        dj.load_target(str(tmp_path))


def test_mxfp4_wrong_scale_shape_names_the_tensor(gptoss, tmp_path):
    name = "model.layers.2.mlp.experts.gate_up_proj"

    def edit(t):
        t[name + "_scales"] = t[name + "_scales"][:, :-1]

    write_mxfp4_checkpoint(gptoss[0], str(tmp_path), edit=edit)
    with pytest.raises(ValueError, match=rf"{name}_scales has uint8 \[8, 63, 1\] but {name}_blocks"):
        dj.load_target(str(tmp_path))


# ----------------------------------------------------------------------------------------------------
# Bad input, export
# ----------------------------------------------------------------------------------------------------

def test_checkpoint_missing_an_expert_tensor(gptoss, tmp_path):
    src = gptoss[0]
    tensors = dict(iter_safetensors(os.path.join(src, "model.safetensors")))
    del tensors["model.layers.2.mlp.experts.gate_up_proj_bias"]
    save_safetensors(str(tmp_path / "model.safetensors"), tensors)
    shutil.copy(os.path.join(src, "config.json"), tmp_path)
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*model\.layers\.2\.mlp\.experts\.gate_up_proj_bias"):
        dj.load_target(str(tmp_path))


def test_expert_count_disagrees_with_config(gptoss, tmp_path):
    shutil.copytree(gptoss[0], tmp_path / "c")
    config = json.loads((tmp_path / "c" / "config.json").read_text())
    (tmp_path / "c" / "config.json").write_text(json.dumps({**config, "num_local_experts": 4}))
    with pytest.raises(ValueError, match=r"mlp\.(router\.\w+|experts\.\w+) has shape \[8.*config implies \[4"):
        dj.load_target(str(tmp_path / "c"))


def test_save_target_reloads_in_transformers(gptoss, tmp_path):
    """Our export (config.json + tensors) is a checkpoint transformers reads back into the same model."""
    _, model, target = gptoss
    out = dj.target.save_target(target, str(tmp_path / "saved"))
    again = transformers.GptOssForCausalLM.from_pretrained(out).eval()
    ids = np.random.RandomState(4).randint(0, V, (1, 10)).astype(np.int32)
    assert_close(torch_forward(again, ids)[0], torch_forward(model, ids)[0], forward_depth(target.config, 10),
                 what="reloaded torch logits")
    assert dj.load_target(out).config == target.config


# ----------------------------------------------------------------------------------------------------
# Draft training on a gpt-oss target
# ----------------------------------------------------------------------------------------------------

@pytest.mark.slow  # ~25 s on 2 CPU cores
def test_training_a_draft_for_gpt_oss_runs_and_the_loss_falls(gptoss, tmp_path):
    from pairs import train_briefly

    path, _, target = gptoss
    draft, losses = train_briefly(path, target, str(tmp_path))
    assert draft.config.layers.hidden_size == D and draft.config.layers.rope == target.config.rope
    assert len(losses) == 30 and np.all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), losses


def test_packed_documents_keep_their_features(gptoss):
    """Two documents packed in one row (sliding window, sinks, experts): each one's features equal its own
    unpacked forward's, since attention stays inside the document and positions restart at 0."""
    _, _, target = gptoss
    packed_features_match(target, ALL)


def test_scanned_layers_decode_what_unrolled_ones_do(gptoss):
    """``scan_layers``: the family's repeating layers as one scan (``pairs.scanned_decodes_the_same``)."""
    from pairs import scanned_decodes_the_same

    scanned_decodes_the_same(gptoss[2], [[3, 5, 7, 2, 9], [4, 4, 1], [8, 2, 6, 1, 3, 5, 7]])
