"""The target decoder against transformers' PyTorch models; incremental decoding; loading; bad input.

Every model is a tiny random Hugging Face checkpoint written with ``save_pretrained`` (no network).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import dflash_jax as dj
from dflash_jax.target import check_token_ids, forward
from hf_models import TINY, save_tiny
from tolerances import assert_close, forward_depth, max_diff

L = TINY["num_hidden_layers"]
V = TINY["vocab_size"]
ALL_LAYERS = tuple(range(L))
SLIDING_TYPES = ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]

# name -> (model_type, config overrides, sequence length). Together they cover: tied and untied
# embeddings, default / linear / llama3 / yarn rope, sequences past original_max_position_embeddings
# (16 here), GQA with 2 and 4 query heads per KV head, attention (and mlp) biases, sliding-window layers.
CASES = {
    "qwen3": ("qwen3", {}, 12),
    "qwen3_tied_yarn_bias": ("qwen3", dict(
        tie_word_embeddings=True, attention_bias=True,
        rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, rope_theta=10000.0)),
        24),
    # transformers 5.24 honours layer_types only together with use_sliding_window=True (otherwise it sets
    # config.sliding_window = None and then refuses to build the sliding mask); its mask is
    # causal & (q - k < sliding_window), which is what we implement.
    "qwen3_sliding": ("qwen3", dict(use_sliding_window=True, sliding_window=4, layer_types=SLIDING_TYPES,
                                    num_key_value_heads=1), 12),
    "llama_llama3": ("llama", dict(
        num_key_value_heads=1,
        rope_parameters=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=16, rope_theta=500000.0)),
        24),
    "llama_tied_linear_bias": ("llama", dict(
        tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
        rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=10000.0)), 12),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """case name -> (checkpoint dir, torch model, loaded fp32 Target); each built once per module."""
    cache = {}

    def get(name):
        if name not in cache:
            model_type, overrides, _ = CASES[name]
            path = str(tmp_path_factory.mktemp(name))
            model = save_tiny(path, model_type, **overrides)
            cache[name] = (path, model, dj.load_target(path))
        return cache[name]

    return get


def random_ids(batch, length, seed=0):
    return np.random.RandomState(seed).randint(0, V, (batch, length)).astype(np.int32)


def positions_for(ids):
    return np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)


def torch_reference(model, ids):
    """(logits, [output of decoder layer i for each i], hidden_states) from the PyTorch model, fp32."""
    outs = {}

    def hook(i):
        def fn(module, args, output):
            outs[i] = output[0] if isinstance(output, tuple) else output
        return fn

    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            res = model(torch.as_tensor(ids, dtype=torch.long), output_hidden_states=True, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    layer_outputs = [outs[i] for i in range(len(model.model.layers))]
    return res.logits.numpy(), layer_outputs, res.hidden_states


# ----------------------------------------------------------------------------------------------------
# Parity with transformers
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_transformers(saved, case):
    path, model, target = saved(case)
    length = CASES[case][2]
    ids = random_ids(2, length, seed=1)
    # feature id -1: the embedding output (hidden_states[0]), then every layer's
    logits, feats, _ = forward(target.config, target.params, ids, positions_for(ids),
                               feature_layer_ids=(-1,) + ALL_LAYERS)
    logits, feats = np.asarray(logits), np.asarray(feats)  # index numpy, not jax (no per-slice compiles)
    ref_logits, ref_layers, hidden_states = torch_reference(model, ids)

    assert logits.dtype == jnp.float32 and logits.shape == (2, length, V)
    depth = forward_depth(target.config, length)  # JAX and torch round a whole forward differently
    assert_close(logits, ref_logits, depth, what="logits")
    d = TINY["hidden_size"]
    assert feats.shape == (2, length, (L + 1) * d)
    assert_close(feats[..., :d], hidden_states[0].numpy(), depth, what="hidden_states[0] (feature id -1)")
    for i in ALL_LAYERS:
        ours = feats[..., (i + 1) * d:(i + 2) * d]
        assert_close(ours, hidden_states[i + 1].numpy(), depth, what=f"hidden_states[{i + 1}]")
        # hidden_states[i + 1] is the output of decoder layer i (checked with a forward hook), except
        # the last: transformers ties hidden_states[-1] to the final-normed last_hidden_state.
        with torch.no_grad():
            layer_out = (model.model.norm(ref_layers[i]) if i == L - 1 else ref_layers[i]).numpy()
        assert_close(ours, layer_out, depth, what=f"layer {i}")


def test_feature_layer_ids_select_and_order(saved):
    _, _, target = saved("qwen3")
    ids = random_ids(2, CASES["qwen3"][2], seed=1)
    _, feats, _ = forward(target.config, target.params, ids, positions_for(ids), feature_layer_ids=ALL_LAYERS)
    _, sub, _ = forward(target.config, target.params, ids, positions_for(ids), feature_layer_ids=(2, 0))
    feats, sub = np.asarray(feats), np.asarray(sub)
    d = TINY["hidden_size"]
    want = np.concatenate([feats[..., 2 * d:3 * d], feats[..., :d]], -1)
    # another compiled program of the same forward may fuse (round) differently; a wrong layer is off by O(scale)
    assert_close(sub, want, forward_depth(target.config, ids.shape[1]), what="selected features")
    for bad in ((-2,), (0, L)):  # a Python index would wrap (-2: the last layer) or fail unnamed
        with pytest.raises(ValueError, match=rf"outside -1\.\.{L - 1}"):
            forward(target.config, target.params, ids, positions_for(ids), feature_layer_ids=bad)


def test_case_configs_are_what_they_claim(saved):
    """Guard the parity cases: each loaded config really has the feature it is there to test."""
    c = saved("qwen3_tied_yarn_bias")[2].config
    assert c.tie_word_embeddings and c.attention_bias and c.rope.rope_type == "yarn"
    assert CASES["qwen3_tied_yarn_bias"][2] > c.rope.get("original_max_position_embeddings")
    assert "lm_head" not in saved("qwen3_tied_yarn_bias")[2].params
    c = saved("llama_llama3")[2].config
    assert c.model_type == "llama" and not c.qk_norm and c.rope.rope_type == "llama3"
    assert c.num_attention_heads // c.num_key_value_heads == 4
    assert CASES["llama_llama3"][2] > c.rope.get("original_max_position_embeddings")
    c = saved("llama_tied_linear_bias")[2].config
    assert c.tie_word_embeddings and c.attention_bias and c.mlp_bias and c.rope.rope_type == "linear"
    c = saved("qwen3")[2].config
    assert not c.tie_word_embeddings and c.num_attention_heads // c.num_key_value_heads == 2
    c = saved("qwen3_sliding")[2].config
    assert c.layer_types == tuple(SLIDING_TYPES) and c.sliding_window == 4
    assert CASES["qwen3_sliding"][2] > c.sliding_window


def test_sliding_window_changes_the_output(saved):
    """The sliding case is meaningful: the same weights with full attention give different logits."""
    _, _, target = saved("qwen3_sliding")
    ids = random_ids(2, CASES["qwen3_sliding"][2], seed=1)
    full_cfg = dataclasses.replace(target.config, layer_types=("full_attention",) * L, sliding_window=None)
    windowed, _, _ = forward(target.config, target.params, ids, positions_for(ids), feature_layer_ids=ALL_LAYERS)
    full, _, _ = forward(full_cfg, target.params, ids, positions_for(ids), feature_layer_ids=ALL_LAYERS)
    assert max_diff(windowed, full) > 1e-3


def test_target_logits_api(saved):
    _, model, target = saved("qwen3")
    ids = random_ids(2, 12, seed=1)
    logits = dj.target_logits(target, ids)
    assert isinstance(logits, np.ndarray) and logits.shape == (2, 12, V) and logits.dtype == np.float32
    assert_close(logits, torch_reference(model, ids)[0], forward_depth(target.config, 12), what="logits")
    np.testing.assert_array_equal(dj.target_logits(target, ids.tolist()), logits)  # nested lists: same program
    # A 1-D sequence is one row.
    np.testing.assert_array_equal(check_token_ids(list(ids[0]), V), ids[:1])


def test_logits_index_keeps_one_position_per_row(saved):
    _, _, target = saved("qwen3")
    ids = random_ids(2, 12, seed=1)
    full = dj.target_logits(target, ids)
    index = jnp.array([11, 4], jnp.int32)
    some, _, _ = forward(target.config, target.params, ids, positions_for(ids), logits_index=index)
    assert some.shape == (2, 1, V)
    # another compiled program (the head at one position) of the same forward: its rounding at most
    assert_close(np.asarray(some)[:, 0], full[[0, 1], [11, 4]], forward_depth(target.config, 12), what="indexed")


# ----------------------------------------------------------------------------------------------------
# Incremental decoding through the KV cache == one-shot forward
# ----------------------------------------------------------------------------------------------------

# SEQ and batch 2 match the parity cases' shapes, so the one-shot reference reuses their compilation.
SEQ, MAX_LEN, PREFILL = 12, 24, 5


def decode_in_chunks(target, seqs, start_lengths, chunk, max_block=16):
    """Prefill each row's first ``start_lengths[r]`` tokens, then feed the rest ``chunk`` at a time.

    All rows go through one call per step, each at its own offset (positions = lengths[:, None] +
    arange(chunk)). Prefill is one [B, PREFILL] call: a row with a shorter start gets junk tokens past
    its length, which later calls must overwrite before any query can see them. Returns the logits
    and features (all layers) of every position 0..SEQ-1, gathered from the calls that computed them.
    """
    cfg, params = target.config, target.params
    b = seqs.shape[0]
    lengths = np.asarray(start_lengths, np.int32)
    out = np.full((b, SEQ, V), np.nan, np.float32)
    out_feats = np.full((b, SEQ, L * TINY["hidden_size"]), np.nan, np.float32)
    cache = target.new_cache(b, MAX_LEN, max_block=max_block)
    assert not np.asarray(cache.lengths).any() and cache.max_len == MAX_LEN

    ids = seqs[:, :PREFILL].copy()
    for r in range(b):
        ids[r, lengths[r]:] = (seqs[r, lengths[r]:PREFILL] + 17) % V  # junk, != the real tokens
    logits, feats, cache = forward(cfg, params, ids, positions_for(ids), cache, feature_layer_ids=ALL_LAYERS)
    logits, feats = np.asarray(logits), np.asarray(feats)
    for r in range(b):
        out[r, :lengths[r]] = logits[r, :lengths[r]]
        out_feats[r, :lengths[r]] = feats[r, :lengths[r]]
    np.testing.assert_array_equal(cache.lengths, 0)  # forward writes K/V, it does not advance lengths
    cache = cache.replace(lengths=jnp.asarray(lengths))

    steps = 0
    while lengths.min() < SEQ:
        pos = lengths[:, None] + np.arange(chunk, dtype=np.int32)
        tok = np.where(pos < SEQ, np.take_along_axis(seqs, np.minimum(pos, SEQ - 1), 1), 0).astype(np.int32)
        logits, feats, cache = forward(cfg, params, tok, pos, cache, feature_layer_ids=ALL_LAYERS)
        logits, feats = np.asarray(logits), np.asarray(feats)
        for r in range(b):
            valid = pos[r] < SEQ
            out[r, pos[r, valid]] = logits[r, valid]
            out_feats[r, pos[r, valid]] = feats[r, valid]
        lengths = np.minimum(lengths + chunk, SEQ).astype(np.int32)
        cache = cache.replace(lengths=jnp.asarray(lengths))
        steps += 1
    assert not np.isnan(out).any() and not np.isnan(out_feats).any()
    return out, out_feats, steps


@pytest.mark.parametrize("case,starts,chunk,max_block", [
    ("qwen3", [PREFILL], 1, 16),
    ("qwen3", [PREFILL], 7, 16),
    ("qwen3", [PREFILL, 2], 1, 16),  # ragged: the rows sit at different offsets in every call
    ("qwen3", [PREFILL, 2], 7, 16),
    ("qwen3_sliding", [PREFILL, 2], 7, 16),  # window 4 < chunk 7: the window applies inside a chunk too
    ("qwen3_sliding", [PREFILL, 2], 7, 1),  # ring of window + 1 = 5 slots: chunks longer than the ring wrap it
])
def test_incremental_decoding_equals_full_forward(saved, case, starts, chunk, max_block):
    assert CASES[case][2] == SEQ
    _, _, target = saved(case)
    seqs = random_ids(2, SEQ, seed=2)
    full, full_feats, _ = forward(target.config, target.params, seqs, positions_for(seqs),
                                  feature_layer_ids=ALL_LAYERS)
    full, full_feats = np.asarray(full), np.asarray(full_feats)
    b = len(starts)
    kinds = [type(s).__name__ for s in target.new_cache(b, MAX_LEN, max_block=max_block).layers]
    cfg = target.config
    assert kinds == ["SlidingKV" if cfg.layer_window(i) else "FullKV" for i in range(cfg.num_hidden_layers)]
    got, got_feats, steps = decode_in_chunks(target, seqs[:b], starts, chunk, max_block)
    assert steps == -(-(SEQ - min(starts)) // chunk)
    # cached chunks and the one-shot forward are the same forward at other shapes: its rounding, per scale
    depth = forward_depth(cfg, SEQ)
    assert_close(got, full[:b], depth, what="logits")
    assert_close(got_feats, full_feats[:b], depth, what="features")


# ----------------------------------------------------------------------------------------------------
# Loading: dtypes, sharded and bf16 checkpoints
# ----------------------------------------------------------------------------------------------------

def test_bf16_load(saved):
    path, _, target32 = saved("qwen3")
    target16 = dj.load_target(path, dtype="bfloat16")
    dtypes = {x.dtype for x in jax.tree_util.tree_leaves(target16.params)}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}
    assert target16.new_cache(1, 8).layers[0].k.dtype == jnp.bfloat16
    ids = random_ids(2, 12, seed=1)
    l32 = dj.target_logits(target32, ids)
    l16 = dj.target_logits(target16, ids)
    assert l16.dtype == np.float32  # logits are float32 whatever the parameter dtype
    # bf16 keeps 8 significant bits (relative rounding ~2^-9 = 0.2%) in every weight and activation;
    # through 4 layers and a 96-way head the error stays a few percent of the logit scale.
    scale = float(np.abs(l32).max())
    assert max_diff(l16, l32) <= 0.05 * scale, (max_diff(l16, l32), scale)
    assert max_diff(l16, l32) > 0  # really computed in bf16


def test_sharded_checkpoint_loads_identically(saved, tmp_path):
    path, model, target = saved("qwen3")
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    index = sharded / "model.safetensors.index.json"
    assert index.is_file() and not (sharded / "model.safetensors").exists()
    assert len(set(json.loads(index.read_text())["weight_map"].values())) > 1
    loaded = dj.load_target(str(sharded))
    assert loaded.config == target.config
    same = jax.tree_util.tree_map(lambda a, b: bool(np.array_equal(a, b)), loaded.params, target.params)
    assert all(jax.tree_util.tree_leaves(same))
    assert jax.tree_util.tree_structure(loaded.params) == jax.tree_util.tree_structure(target.params)


def test_bf16_torch_checkpoint_loads(tmp_path):
    model = save_tiny(tmp_path, "qwen3", seed=5, dtype=torch.bfloat16)  # returns the bf16-rounded weights in fp32
    from dflash_jax.checkpoints import iter_safetensors
    stored = dict(iter_safetensors(str(tmp_path / "model.safetensors")))
    assert str(stored["model.embed_tokens.weight"].dtype) == "bfloat16"
    target = dj.load_target(str(tmp_path))  # upcast to fp32 on load
    assert jax.tree_util.tree_leaves(target.params)[0].dtype == jnp.float32
    ids = random_ids(2, 12, seed=1)
    assert_close(dj.target_logits(target, ids), torch_reference(model, ids)[0], forward_depth(target.config, 12),
                 what="logits")
    target16 = dj.load_target(str(tmp_path), dtype="bfloat16")  # kept bit-exact
    np.testing.assert_array_equal(np.asarray(target16.params["embed_tokens"]["embedding"]).view(np.uint16),
                                  stored["model.embed_tokens.weight"].view(np.uint16))


# ----------------------------------------------------------------------------------------------------
# Bad input: clear errors
# ----------------------------------------------------------------------------------------------------

@pytest.fixture
def copy_of(saved, tmp_path):
    def make(case="qwen3"):
        dst = tmp_path / "copy"
        shutil.copytree(saved(case)[0], dst)
        return dst
    return make


def edit_config(directory, **changes):
    cfg_path = directory / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(changes)
    cfg_path.write_text(json.dumps(cfg))


def test_unsupported_model_type(copy_of):
    d = copy_of()
    edit_config(d, model_type="gpt2")
    with pytest.raises(ValueError, match=r"unsupported model_type 'gpt2'.*qwen3.*llama"):
        dj.load_target(str(d))


def test_missing_weights_file(copy_of):
    d = copy_of()
    os.remove(d / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        dj.load_target(str(d))


def test_missing_shard(saved, tmp_path):
    _, model, _ = saved("qwen3")
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[-1]
    os.remove(tmp_path / victim)
    with pytest.raises(FileNotFoundError, match=victim):
        dj.load_target(str(tmp_path))


def test_missing_config(copy_of):
    d = copy_of()
    os.remove(d / "config.json")
    with pytest.raises(FileNotFoundError, match="config.json"):
        dj.load_target(str(d))


def test_shape_disagrees_with_config(copy_of):
    d = copy_of()
    edit_config(d, intermediate_size=48)  # the checkpoint has 64
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight has shape \[\d+, \d+\] but the config implies"):
        dj.load_target(str(d))


def test_checkpoint_of_another_layout(copy_of):
    """A qwen3 checkpoint read as llama has q_norm/k_norm tensors llama does not use: named, not ignored."""
    d = copy_of()
    edit_config(d, model_type="llama")
    with pytest.raises(ValueError, match=r"tensors this model does not use.*q_norm"):
        dj.load_target(str(d))


def test_bad_token_ids(saved):
    target = saved("qwen3")[2]
    with pytest.raises(ValueError, match=rf"outside the vocabulary \[0, {V}\).*max {V}"):
        dj.target_logits(target, [[1, 2, V]])
    with pytest.raises(ValueError, match="outside the vocabulary.*min -1"):
        dj.target_logits(target, [[-1, 2]])
    with pytest.raises(ValueError, match="non-empty"):
        dj.target_logits(target, np.zeros((1, 0), np.int32))
    with pytest.raises(ValueError, match="non-empty"):
        dj.target_logits(target, [])
    with pytest.raises(ValueError, match="integer token ids"):
        dj.target_logits(target, [[1.5, 2.0]])


def test_nonexistent_local_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        dj.load_target(str(tmp_path / "no" / "such" / "dir"))
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        dj.load_target("./relative-missing-dir")


def test_hub_id_offline_fails_fast_without_network(monkeypatch):
    """HF_HUB_OFFLINE set at call time (after huggingface_hub was imported) is honoured: no network."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # Simulate a process that imported huggingface_hub while online: its constant says "online".
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    lookups = []

    def no_network(*args, **kwargs):
        lookups.append(args)
        raise OSError("network used in an offline test")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    start = time.monotonic()
    with pytest.raises(FileNotFoundError, match=r"no-such-org/no-such-model.*offline"):
        dj.load_target("no-such-org/no-such-model")
    assert time.monotonic() - start < 10
    assert not lookups
