"""The DFlash draft: the independent NumPy statement (``draft_reference``), cache chunking, sliding windows, HF layout, fit checks."""
from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

import dflash_jax as dj
from dflash_jax.drafts import model as D
from dflash_jax.drafts import DraftConfig
from draft_reference import numpy_draft
from hf_models import save_tiny, torch_forward
from tolerances import assert_close, draft_depth

LAYER_IDS = (0, 2, 3)


def make_draft(tcfg, *, layers=2, block=8, sliding=None, seed=1, ids=LAYER_IDS, dflash2_scale=1.0, **fields):
    """A random draft on ``tcfg``; ``fields``: other DraftConfig fields (e.g. ``architecture="dflash2"``), whose
    convolution and selector weights are then drawn with ``dflash2_scale`` x ``_DFLASH2_STD``."""
    kw = dict(num_hidden_layers=layers, layer_types=())
    if sliding:
        kw.update(layer_types=("sliding_attention", "full_attention")[:layers], sliding_window=sliding)
    dcfg = DraftConfig(layers=dataclasses.replace(tcfg, **kw), block_size=block,
                       num_target_layers=tcfg.num_hidden_layers, mask_token_id=tcfg.vocab_size - 1,
                       target_layer_ids=ids, **fields)
    params = D.init_draft_params(dcfg, seed)
    # Norm weights start at 1: perturb them so a misplaced norm cannot hide.
    rng = np.random.RandomState(seed)
    params = _map_norms(params, lambda w: w + 0.1 * rng.randn(*w.shape).astype(np.float32))
    if dcfg.architecture == "dflash2":  # the 0.02 init would leave the convolutions and the selector inert
        params = _scale_dflash2(params, rng, dflash2_scale)
    return D.Draft(dcfg, params)


_DFLASH2_STD = {"base_kernel": 0.5, "kernel_projection": 0.3, "hidden_projection": 0.5, "predecessor_codebook": 1.0,
                "successor_codebook": 1.0}


def _scale_dflash2(tree, rng, scale, name=""):
    if isinstance(tree, dict):
        return {k: _scale_dflash2(v, rng, scale, k if k in _DFLASH2_STD else name) for k, v in tree.items()}
    return jnp.asarray(scale * _DFLASH2_STD[name] * rng.randn(*tree.shape), tree.dtype) if name else tree


def _map_norms(tree, fn, name=""):
    if isinstance(tree, dict):
        return {k: _map_norms(v, fn, k if k.endswith("norm") or k.endswith("layernorm") else name)
                for k, v in tree.items()}
    return jnp.asarray(fn(np.asarray(tree))) if name else tree


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("target"))
    model = save_tiny(d, "qwen3")
    return d, model


@pytest.fixture(scope="module")
def target(target_dir):
    return dj.load_target(target_dir[0])


@pytest.mark.parametrize("sliding", [None, 5])
def test_matches_numpy_reference(target_dir, target, tmp_path, sliding):
    path, torch_model = target_dir
    draft = make_draft(target.config, sliding=sliding)
    D.save_draft(draft, str(tmp_path), dtype="float32")
    w = {k: v.astype(np.float64) for k, v in safetensors.numpy.load_file(str(tmp_path / "model.safetensors")).items()}
    ctx = np.random.RandomState(0).randint(0, 90, (1, 11))
    block = np.array([[7] + [draft.config.mask_token_id] * 7])
    got = D.draft_block_logits(target, draft, ctx, block)[0]
    _, feats = torch_forward(torch_model, ctx, LAYER_IDS)
    sd = {k: v.detach().double().numpy() for k, v in torch_model.state_dict().items()}
    emb = sd["model.embed_tokens.weight"][block[0]]
    want, _ = numpy_draft(w, draft.config, feats[0].astype(np.float64), emb, sd["lm_head.weight"], 11)
    assert_close(got, want, draft_depth(target.config, draft.config.layers, 11, 8), what="logits")  # float32 vs float64


def test_sliding_window_sees_only_last_positions(target):
    window, ctx_len = 4, 12
    draft = make_draft(target.config, layers=1, sliding=window)
    rng = np.random.RandomState(1)
    ctx = rng.randint(0, 90, (1, ctx_len))
    block = np.array([[5] + [draft.config.mask_token_id] * 3])
    base = D.draft_block_logits(target, draft, ctx, block)
    # The target is causal, so changing an early context token changes features at and after it; the
    # only features the window (query positions 12..15, keys > 12-4) can see are positions 9..11.
    far = ctx.copy()
    far[0, 11] = (far[0, 11] + 1) % 90  # inside the window: must matter
    assert np.abs(D.draft_block_logits(target, draft, far, block) - base).max() > 1e-4
    # Direct check on the attention mask: context K/V outside the window are never read.
    tcfg, dcfg = target.config, draft.config
    from dflash_jax.target import forward
    pos = np.arange(ctx_len)[None]
    _, feats, _ = forward(tcfg, target.params, ctx, pos, feature_layer_ids=dcfg.target_layer_ids)
    k, v = D.context_kv(dcfg, draft.params, feats, pos)
    garbage = tuple(x.at[:, : ctx_len - window + 1].set(1e3) for x in k)  # positions <= 8 are outside
    anchors = jnp.full((1, 1), ctx_len)
    ref = D.block_logits(tcfg, target.params, dcfg, draft.params, block, anchors, k, v)
    out = D.block_logits(tcfg, target.params, dcfg, draft.params, block, anchors, garbage, v)
    np.testing.assert_array_equal(out, ref)  # the same program on the same visible keys: no rounding to differ
    inside = tuple(x.at[:, ctx_len - 2].set(1e3) for x in k)
    assert np.abs(D.block_logits(tcfg, target.params, dcfg, draft.params, block, anchors, inside, v) - ref).max() > 1e-3


def test_cached_chunks_equal_one_pass(target):
    """Materialising the context in chunks into the draft cache, then predicting, equals one pass."""
    from dflash_jax.target import forward

    draft = make_draft(target.config)
    tcfg, dcfg = target.config, draft.config
    rng = np.random.RandomState(2)
    ctx = rng.randint(0, 90, (2, 13))
    block = np.concatenate([rng.randint(0, 90, (2, 1)), np.full((2, 7), dcfg.mask_token_id)], 1)
    want = D.draft_block_logits(target, draft, ctx, block)
    _, feats, _ = forward(tcfg, target.params, ctx, np.broadcast_to(np.arange(13), (2, 13)),
                          feature_layer_ids=dcfg.target_layer_ids)
    cache = draft.new_cache(2, 32)
    materialize = jax.jit(functools.partial(D.materialize, dcfg))  # eager Flax would compile op by op
    for lo, hi in [(0, 5), (5, 6), (6, 13)]:
        pos = np.broadcast_to(np.arange(lo, hi), (2, hi - lo))
        cache = materialize(draft.params, cache, feats[:, lo:hi], pos)
    logits = jax.jit(lambda tp, dp, ids, a, k, v: D.block_logits(tcfg, tp, dcfg, dp, ids, a, k, v))
    got = logits(target.params, draft.params, block, jnp.full((2, 1), 13), *D.cache_kv(cache))
    # the same forwards at other shapes (context in chunks): their rounding, relative to the logits' scale
    assert_close(got, want, draft_depth(tcfg, dcfg.layers, 13, 8), what="logits")
    # the engine's proposals: argmax of the same logits at positions 1.. (lm_head skips the anchor row)
    propose = jax.jit(lambda tp, dp, ids, a, k, v: D.propose(tcfg, tp, dcfg, dp, ids, a, k, v))
    tokens = propose(target.params, draft.params, block, jnp.full((2, 1), 13), *D.cache_kv(cache))
    np.testing.assert_array_equal(np.asarray(tokens), want[:, 1:].argmax(-1))


def test_hf_layout_round_trip(target, tmp_path):
    draft = make_draft(target.config, sliding=6)
    D.save_draft(draft, str(tmp_path), dtype="float32")
    cfg = json.load(open(tmp_path / "config.json"))
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"mask_token_id": 95, "target_layer_ids": list(LAYER_IDS)}
    names = set(safetensors.numpy.load_file(str(tmp_path / "model.safetensors")))
    assert "fc.weight" in names and "layers.0.self_attn.q_proj.weight" in names
    assert not any(n.startswith("model.") or "embed" in n or "lm_head" in n for n in names)
    fc = safetensors.numpy.load_file(str(tmp_path / "model.safetensors"))["fc.weight"]
    assert fc.shape == (32, 3 * 32)  # PyTorch [out, in]
    again = dj.load_draft(str(tmp_path))
    assert again.config == draft.config
    for a, b in zip(jax_leaves(again.params), jax_leaves(draft.params)):
        np.testing.assert_array_equal(a, b)
    # bf16 export loads back within bf16 rounding.
    D.save_draft(draft, str(tmp_path / "bf16"))
    b16 = dj.load_draft(str(tmp_path / "bf16"))
    for a, b in zip(jax_leaves(b16.params), jax_leaves(draft.params)):
        np.testing.assert_allclose(a, b, rtol=2.0 ** -8, atol=0)  # bf16 keeps 8 bits: rounding <= 2^-9 relative


def jax_leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def test_transformers_4x_config_loads_same(target, tmp_path):
    draft = make_draft(target.config)
    D.save_draft(draft, str(tmp_path), dtype="float32")
    cfg = json.load(open(tmp_path / "config.json"))
    cfg.pop("rope_parameters")
    cfg["rope_scaling"] = None
    cfg.pop("layer_types")
    json.dump(cfg, open(tmp_path / "config.json", "w"))
    assert dj.load_draft(str(tmp_path)).config == draft.config


def test_fit_checks_name_both_sides(target):
    draft = make_draft(target.config)
    bad_ids = D.Draft(dataclasses.replace(draft.config, target_layer_ids=(0, 2, 9)), draft.params)
    with pytest.raises(ValueError, match=r"\[9\].*4 layers"):
        D.check_pair(target, bad_ids)
    bad_mask = D.Draft(dataclasses.replace(draft.config, mask_token_id=500), draft.params)
    with pytest.raises(ValueError, match="mask_token_id 500.*vocab_size 96"):
        D.check_pair(target, bad_mask)
    two = make_draft(target.config, ids=(1, 3))
    wide = D.Draft(draft.config.__class__(**{**draft.config.__dict__, "target_layer_ids": (1, 3)}), draft.params)
    with pytest.raises(ValueError, match="fc takes 96 input features.*2 target layers.*64"):
        D.check_pair(target, wide)
    D.check_pair(target, two)  # a consistent 2-feature draft passes
    with pytest.warns(UserWarning, match="num_target_layers=36"):
        D.check_pair(target, D.Draft(dataclasses.replace(draft.config, num_target_layers=36), draft.params))
    with pytest.raises(ValueError, match="hidden_size"):
        other = dataclasses.replace(draft.config, layers=dataclasses.replace(draft.config.layers, hidden_size=64))
        D.check_pair(target, D.Draft(other, draft.params))


def test_released_layout_loads_from_disk(tmp_path):
    """A hand-written released-style config.json (4.x format, default target_layer_ids) + weights load."""
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
           "vocab_size": 96, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None,
           "max_position_embeddings": 40960, "block_size": 16, "num_target_layers": 8,
           "dflash_config": {"mask_token_id": 95}, "tie_word_embeddings": False}
    os.makedirs(tmp_path, exist_ok=True)
    json.dump(cfg, open(tmp_path / "config.json", "w"))
    dcfg = DraftConfig.from_hf(cfg)
    assert dcfg.target_layer_ids == (4,)  # one feature layer: L // 2
    draft = D.Draft(dcfg, D.init_draft_params(dcfg))
    from dflash_jax.checkpoints import export_params

    safetensors.numpy.save_file({k: np.asarray(v, np.float32) for k, v in export_params(draft.params, D.CHECKPOINT).items()},
                                str(tmp_path / "model.safetensors"))
    loaded = dj.load_draft(str(tmp_path))
    assert loaded.config.block_size == 16 and loaded.config.layers.rope.theta == 1e6


@pytest.mark.parametrize("impl", ["reference", "interpret"])
def test_training_forward_equals_per_block_inference(target, impl):
    """Many anchored blocks in one forward (the kernel's training layout) == each block run alone with
    its own context through the inference path (draft cache holding exactly positions < anchor)."""
    from dflash_jax.target import forward

    draft = make_draft(target.config, block=4, sliding=6)
    tcfg, dcfg = target.config, draft.config
    rng = np.random.RandomState(4)
    ids = rng.randint(0, 90, (1, 20))
    pos = np.arange(20)[None]
    _, feats, _ = forward(tcfg, target.params, ids, pos, feature_layer_ids=dcfg.target_layer_ids)
    k, v = D.context_kv(dcfg, draft.params, feats, pos)
    anchors = np.array([[0, 5, 5, 12, 19]], np.int32)  # at 0, repeated, overlapping, at S-1
    blocks = np.concatenate([[ids[0, a]] + [dcfg.mask_token_id] * 3 for a in anchors[0]])[None]
    together = np.asarray(D.block_logits(tcfg, target.params, dcfg, draft.params, blocks, jnp.asarray(anchors), k, v,
                                         impl=impl))
    for b, a in enumerate(anchors[0]):
        cache = draft.new_cache(1, 32)
        if a:
            cache = D.materialize(dcfg, draft.params, cache, feats[:, :a], pos[:, :a])
        alone = D.block_logits(tcfg, target.params, dcfg, draft.params, blocks[:, 4 * b:4 * b + 4],
                               jnp.full((1, 1), a), *D.cache_kv(cache))
        # one program over every block against each alone: the same forwards at other shapes, their rounding
        assert_close(together[:, 4 * b:4 * b + 4], alone, draft_depth(tcfg, dcfg.layers, 20, 4), what=f"block at {a}")
