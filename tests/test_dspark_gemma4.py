"""Gemma 4 DSpark drafts (DeepSpec's ``Gemma4DSparkModel``; docs/models.md, "DSpark"): the config and checkpoint
layout, block logits and greedy tokens against the independent NumPy statement (``dspark_reference``, its section-7
backbone: sandwich norms, k = v, scale 1, layer scalar, sqrt(d) embeddings, soft-capped logits, proportional rope),
the engine against DeepSpec's evaluation loop and transformers' greedy generate, and ``--draft-arch dspark`` on a
Gemma 4 target exporting a draft in the same layout.

The tiny target (transformers' Gemma4ForCausalLM, save_pretrained): sliding and full layers, full layers with their
own head dim (16 vs 8), one KV head through ``attention_k_eq_v`` (or two KV heads and a v_proj without it),
proportional rope (half the full head's frequencies), logit soft cap 5, tied embeddings, perturbed norms."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import transformers

import dflash_jax as dj
from dflash_jax.drafts import DraftConfig
from dflash_jax.families.gemma4 import Gemma4Config

V = 16
CFG = {"vocab_size": V, "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
       "num_key_value_heads": 2, "head_dim": 8, "global_head_dim": 16, "num_global_key_value_heads": 1,
       "attention_k_eq_v": True, "sliding_window": 4, "max_position_embeddings": 128,
       "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
       "hidden_size_per_layer_input": 0, "final_logit_softcapping": 5.0, "initializer_range": 0.1,
       "eos_token_id": None, "tie_word_embeddings": True,
       "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                           "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                              "rope_theta": 1000000.0}}}
_TARGETS: dict = {}


def gemma_target(tmp_path_factory, k_eq_v: bool = True):
    """(directory, torch model, loaded target) of the tiny Gemma 4 target, one per ``k_eq_v``, built once."""
    if k_eq_v not in _TARGETS:
        import torch
        from hf_models import perturb

        d = str(tmp_path_factory.mktemp(f"gemma4_dspark_{int(k_eq_v)}"))
        torch.manual_seed(0)
        model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**{**CFG, "attention_k_eq_v": k_eq_v}))
        perturb(model.eval(), {"norm": 0.1}, {"layer_scalar": (0.5, 1.5)})
        model.save_pretrained(d)
        _TARGETS[k_eq_v] = d, model, dj.load_target(d)
    return _TARGETS[k_eq_v]


def _written(target, tmp_path, **kw):
    """A DeepSpec-layout Gemma 4 DSpark draft of ``target`` (2 layers, block 4, features of layers 0 and 2):
    (float64 tensors, config dict, the loaded draft)."""
    from dspark_reference import write_dspark_draft

    d = str(tmp_path / "draft")
    w = write_dspark_draft(d, target[0], num_layers=2, block_size=4, target_layer_ids=(0, 2), mask_token_id=V - 1,
                           **kw)
    with open(f"{d}/config.json") as f:
        return w, json.load(f), dj.load_draft(d)


def test_config_reads_and_writes_deepspec_layout(tmp_path_factory, tmp_path):
    """DeepSpec's config.json (the target's text config + the DSpark keys) reads as Gemma 4 layers at the full
    layers' sizes; ``to_hf`` writes it back with every key DeepSpec's model asserts; a config a newer transformers
    wrote (``per_layer_config`` instead of ``global_head_dim``) reads the same; what DeepSpec's layer rejects is
    refused in one line."""
    target = gemma_target(tmp_path_factory)
    _, cfg, draft = _written(target, tmp_path, markov_head_type="rnn")
    c = draft.config
    assert isinstance(c.layers, Gemma4Config) and c.shifted and c.own_embeddings and c.final_logit_softcapping == 5.0
    full = c.layers.layer_attention(1)
    assert (full.head_dim, full.num_key_value_heads, full.rope.rope_type) == (16, 1, "proportional")
    assert set(c.layers.layer_types) == {"full_attention"} and not c.layers.hidden_size_per_layer_input
    hf = c.to_hf()
    assert hf["architectures"] == ["Gemma4DSparkModel"] and hf["model_type"] == "gemma4_text"
    required = ("target_layer_ids", "mask_token_id", "num_anchors", "enable_confidence_head", "markov_rank",
                "markov_head_type", "confidence_head_with_markov", "final_logit_softcapping", "rope_parameters",
                "global_head_dim", "num_global_key_value_heads", "block_size")
    assert all(hf.get(k) is not None for k in required) and "dflash_config" not in hf
    assert (hf["global_head_dim"], hf["num_global_key_value_heads"], hf["num_kv_shared_layers"]) == (16, 1, 0)
    assert DraftConfig.from_hf(hf) == c
    transformers.Gemma4TextConfig(**hf)  # DeepSpec's config class reads what we write (it refuses a null window)
    newer = transformers.Gemma4TextConfig(**{k: v for k, v in cfg.items() if k != "architectures"}).to_dict()
    assert "per_layer_config" in newer and "global_head_dim" not in newer
    assert DraftConfig.from_hf(dict(newer, architectures=["Gemma4DSparkModel"])) == c
    # without k = v DeepSpec's draft attention takes num_key_value_heads, whatever the global count says
    plain = DraftConfig.from_hf(dict(cfg, attention_k_eq_v=False, num_global_key_value_heads=4)).layers
    assert (plain.layer_attention(0).num_key_value_heads, plain.layer_attention(0).head_dim) == (2, 16)
    for bad, msg in ((dict(enable_moe_block=True), "MoE"), (dict(hidden_size_per_layer_input=4), "per-layer"),
                     (dict(use_double_wide_mlp=True, num_kv_shared_layers=1), "double_wide")):
        with pytest.raises(ValueError, match=msg):
            DraftConfig.from_hf(dict(cfg, **bad))


# (attention_k_eq_v, writer keywords): every Markov head type with the confidence head, heads off, and v_proj
CASES = {"k=v vanilla": (True, dict(markov_head_type="vanilla")), "k=v gated": (True, dict(markov_head_type="gated")),
         "k=v rnn": (True, dict(markov_head_type="rnn")),
         "v_proj rnn, confidence without markov": (False, dict(markov_head_type="rnn", confidence_with_markov=False)),
         "v_proj no heads": (False, dict(markov_rank=0, confidence=False))}


@pytest.mark.parametrize("name", list(CASES))
def test_block_logits_and_tokens_match_numpy(tmp_path_factory, tmp_path, name):
    """``draft_block_logits`` / ``draft_block_tokens`` of DeepSpec-layout Gemma 4 drafts == the float64 reference,
    batched with two context lengths (the shorter padded by the library)."""
    from test_dspark import block_logits_match_numpy

    k_eq_v, kw = CASES[name]
    _, model, target = gemma_target(tmp_path_factory, k_eq_v)
    w, cfg, draft = _written(gemma_target(tmp_path_factory, k_eq_v), tmp_path, **kw)
    assert ("layers.0.self_attn.v_proj.weight" in w) is not k_eq_v
    block_logits_match_numpy(model, target, draft, w, cfg, name)


def test_checkpoint_round_trip(tmp_path_factory, tmp_path):
    """``save_draft`` writes exactly DeepSpec's tensor names and shapes (layer scalars, sandwich norms, no v_proj
    with k = v) and a config that reads back equal; the reload gives bit-identical logits."""
    import safetensors.numpy
    from dspark_reference import expected_shapes

    target = gemma_target(tmp_path_factory)
    w, cfg, draft = _written(target, tmp_path, markov_head_type="gated")
    out = dj.save_draft(draft, str(tmp_path / "again"), dtype="float32")
    tensors = safetensors.numpy.load_file(os.path.join(out, "model.safetensors"))
    assert {k: v.shape for k, v in tensors.items()} == expected_shapes(cfg)
    assert all(np.array_equal(tensors[k], w[k].astype(np.float32)) for k in w)
    back = dj.load_draft(out)
    assert back.config == draft.config
    ctx, blk = np.array([[3, 5, 7, 2, 9]]), np.array([[4, V - 1, V - 1, V - 1]])
    np.testing.assert_array_equal(dj.draft_block_logits(target[2], back, ctx, blk),
                                  dj.draft_block_logits(target[2], draft, ctx, blk))


@pytest.mark.parametrize("threshold", [0.0, 0.6])
def test_engine_equals_deepspec_loop(tmp_path_factory, tmp_path, threshold):
    """Greedy ``speculative_generate`` (block 4: 5 tokens verified; the confidence cut at 0.6) == DeepSpec's
    evaluation loop (outputs; per-step acceptance as tests/test_dspark.py counts it) == transformers' greedy
    generate of the Gemma 4 target; some drafts are accepted."""
    from test_dspark import engine_matches_deepspec_loop

    _, model, target = gemma_target(tmp_path_factory)
    w, cfg, draft = _written(gemma_target(tmp_path_factory), tmp_path, markov_head_type="vanilla")
    engine_matches_deepspec_loop(model, target, draft, w, cfg, [[5, 1, 12, 8, 6, 3], [9, 9, 2],
                                                                [14, 7, 0, 11, 4, 13, 2, 10]], 16, threshold)


def test_train_on_gemma4_target_exports_gemma4_dspark(tmp_path_factory, tmp_path):
    """``--draft-arch dspark`` on a Gemma 4 target trains a ``Gemma4DSparkModel`` (the target's text settings, full
    layers, its soft cap): the loss falls, the frozen copies stay the target's, and ``train.export`` writes
    DeepSpec's tensor names whose block logits, by the NumPy statement, equal the trained draft's."""
    from dspark_reference import expected_shapes, load_dspark_draft, numpy_dspark
    from hf_models import torch_forward
    from pairs import train_briefly
    from tolerances import assert_close, draft_depth
    from train.export import export

    path, model, target = gemma_target(tmp_path_factory)
    root = str(tmp_path)
    draft, losses = train_briefly(path, target, root, steps=16, draft_arch="dspark", markov_rank=8,
                                  markov_head_type="rnn", pack=False)
    assert isinstance(draft.config.layers, Gemma4Config) and draft.config.final_logit_softcapping == 5.0
    assert np.mean(losses[-4:]) < 0.8 * np.mean(losses[:4]), losses
    table = np.asarray(target.params["embed_tokens"]["embedding"])  # tied: the head is the table
    np.testing.assert_array_equal(np.asarray(draft.params["embed_tokens"]["embedding"]), table)
    np.testing.assert_array_equal(np.asarray(draft.params["lm_head"]["kernel"]), table.T)
    # DeepSpec's layer scalar is a buffer of ones: it starts at 1 and is never trained
    assert float(draft.params["layers_0"]["layer_scalar"][0]) == 1.0
    out = export(os.path.join(root, "run"), str(tmp_path / "export"), dtype="float32")
    w, cfg = load_dspark_draft(out)
    assert cfg["architectures"] == ["Gemma4DSparkModel"]
    transformers.Gemma4TextConfig(**cfg)  # what DeepSpec's Gemma4DSparkModel reads its config with
    assert {k: v.shape for k, v in w.items()} == expected_shapes(cfg)
    ctx, blk = np.array([[3, 5, 7, 2, 9, 1, 4]]), np.array([[4, V - 1, V - 1, V - 1]])
    feats = torch_forward(model, ctx, cfg["target_layer_ids"])[1][0].astype(np.float64)
    assert_close(dj.draft_block_logits(target, draft, ctx, blk)[0], numpy_dspark(w, cfg, feats, 4)["logits"],
                 draft_depth(target.config, draft.config.layers, 7, 4), what="trained draft vs its export")


def test_default_mask_token_is_the_tokenizers_own():
    """A new draft's mask token: ``<|MASK|>`` when the tokenizer has it, else the tokenizer's mask token (Gemma 4's
    ``<mask>``, 4: DeepSpec's Gemma 4 draft), else the first row the tokenizer never produces, else the pad token."""
    from types import SimpleNamespace

    from train.draft_setup import default_mask_token_id

    class Tok:
        def __init__(self, n, vocab_ids, mask=None, unk=3):
            self.n, self.ids, self.mask_token_id, self.unk_token_id = n, vocab_ids, mask, unk

        def __len__(self):
            return self.n

        def convert_tokens_to_ids(self, t):
            return self.ids.get(t, self.unk_token_id)

    target = SimpleNamespace(config=SimpleNamespace(vocab_size=V, pad_token_id=0))
    assert default_mask_token_id(target, Tok(V, {"<|MASK|>": 9}, mask=4)) == 9
    assert default_mask_token_id(target, Tok(V, {}, mask=4)) == 4  # Gemma 4: <mask>
    assert default_mask_token_id(target, Tok(V - 2, {})) == V - 2  # Qwen3: the first row past the tokenizer
    assert default_mask_token_id(target, Tok(V, {})) == 0  # the pad token
