"""The muse_glimmer family against transformers' MuseGlimmerForConditionalGeneration (its MuseGlimmerTextModel
inside), and the muse_glimmer_assistant draft against MuseGlimmerAssistantModel: parity, decoding through
the sliding rings, speculative == plain == transformers' greedy, the checkpoint layouts.

One tiny random VL checkpoint (transformers' own classes + save_pretrained, no network): 4 layers (3 sliding
with rope, window 4 < the prompts; the last full attention and NoPE), a vocabulary of 16 (so that a random
draft is sometimes right), image / video placeholder ids 5 / 6 inside it (embedded as token 0), qk scale,
output multiplier and soft cap away from 1 so that they bite, weights at std 0.2 and perturbed norms so that
a mis-mapped tensor shows.
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

import dflash_jax as dj
from dflash_jax.drafts import model as D
from dflash_jax import decode as S
from dflash_jax.checkpoints import iter_safetensors, save_safetensors
from dflash_jax.drafts import DraftConfig
from dflash_jax.families.muse_glimmer import MuseGlimmerConfig
from dflash_jax.target import decoder, forward, save_target
from hf_models import positions_for, ragged_parity, torch_greedy
from pairs import decode_in_chunks, lossless_greedy_with_partial_acceptance
from tolerances import assert_close, draft_depth, forward_depth, max_diff

V, L, H = 16, 4, 32
ALL = tuple(range(L))
TEXT = dict(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=L, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, sliding_window=4, max_position_embeddings=128, eos_token_id=1,
            bos_token_id=2, pad_token_id=0, initializer_range=0.2, qk_scale_factor=2.5, output_multiplier=0.7,
            final_logit_softcapping=3.0, post_norm_eps=1e-6)
VISION = dict(patch_size=2, num_attention_heads=2, num_hidden_layers=1, hidden_size=16, intermediate_size=32,
              pos_emb_height=4, pos_emb_width=4)
MM = dict(image_token_id=5, video_token_id=6)


def save_muse(path, seed: int = 0, **text):
    """A random tiny MuseGlimmerForConditionalGeneration saved to ``path`` (the released VL layout); returns it
    (eval, fp32)."""
    cfg = transformers.MuseGlimmerConfig(text_config={**TEXT, **text}, vision_config=VISION, out_hidden_size=64,
                                         projector_hidden_size=16, **MM)
    torch.manual_seed(seed)
    model = transformers.MuseGlimmerForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # (1 + w) norms start at 0, the final norm at 1: perturb them so a mis-mapped one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def muse(tmp_path_factory):
    """(checkpoint dir, torch model, loaded fp32 Target)."""
    path = str(tmp_path_factory.mktemp("muse_glimmer"))
    model = save_muse(path)
    return path, model, dj.load_target(path)


# ----------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------

def test_config_reads_the_released_layout():
    """transformers' default MuseGlimmerConfig is Muse-Glimmer-30B's: 52 layers, every 4th from the last full
    attention and NoPE, the others sliding (2048) with rope; ours round-trips and transformers reads it back."""
    released = transformers.MuseGlimmerConfig().to_dict()
    c = MuseGlimmerConfig.from_hf(released)
    full = [i for i in range(52) if c.layer_types[i] == "full_attention"]
    assert full == list(range(3, 52, 4)) == [i for i in range(52) if not c.rotary(i)]
    assert c.sliding_window == 2048 and c.layer_window(0) == 2048 and c.layer_window(3) is None
    assert (c.hidden_size, c.num_key_value_heads, c.head_dim, c.vocab_size) == (6656, 2, 128, 202048)
    assert (c.qk_scale_factor, c.final_logit_softcapping, c.rms_norm_eps, c.post_norm_eps) == (3.87, 20.0, 1e-5, 1e-8)
    assert c.output_multiplier == pytest.approx(26 ** -0.5) and c.multimodal_token_ids == (200092, 200091)
    assert c.vision_language and not c.tie_word_embeddings and not c.qk_norm and not c.norm_offset
    assert c.eos_token_id == (200001,) and c.bos_token_id == 200000 and c.rope.theta == 10000.0
    assert MuseGlimmerConfig.from_hf(c.to_hf()) == c
    text = MuseGlimmerConfig.from_hf(released["text_config"])  # a text-only config
    assert text == dataclasses.replace(c, model_type="muse_glimmer_text", vision_language=False,
                                       multimodal_token_ids=())
    assert MuseGlimmerConfig.from_hf(text.to_hf()) == text
    back = transformers.MuseGlimmerConfig(**c.to_hf()).text_config  # transformers reads what we write
    assert (back.layer_types, back.layer_rope_theta) == (list(c.layer_types), list(c.layer_rope_theta))
    assert (back.qk_scale_factor, back.post_norm_eps, back.sliding_window) == (3.87, 1e-8, 2048)
    with pytest.raises(ValueError, match="needs a text_config"):
        MuseGlimmerConfig.from_hf({"model_type": "muse_glimmer"})
    with pytest.raises(ValueError, match="hidden_activation 'gelu' is not supported"):
        MuseGlimmerConfig.from_hf({**released["text_config"], "hidden_activation": "gelu"})


# ----------------------------------------------------------------------------------------------------
# Parity with transformers
# ----------------------------------------------------------------------------------------------------

def test_logits_and_every_layer_match_transformers_on_a_ragged_batch(muse):
    """Rows of 14 and 9 tokens (past the window of 4; placeholders 5 / 6 among them), padded with position -1,
    against transformers on each prompt alone: logits and every hidden_states[i], the normed embedding
    hidden_states[0] included."""
    _, model, target = muse
    c = target.config
    assert c.layer_types == ("sliding_attention",) * 3 + ("full_attention",) and c.sliding_window == 4
    assert c.layer_rope_theta == (10000.0,) * 3 + (0.0,) and c.multimodal_token_ids == (5, 6)
    assert ragged_parity(model, target, [14, 9]) > 1.0  # the comparison is not between near-zero activations
    ids = np.random.RandomState(1).randint(0, V, (1, 14)).astype(np.int32)
    ids[0, 3], ids[0, 8] = 5, 6  # both placeholders
    emb = decoder(c).apply({"params": target.params}, ids, method="embed_inputs")
    with torch.no_grad():
        want = model(torch.as_tensor(ids, dtype=torch.long), output_hidden_states=True).hidden_states[0]
    assert_close(emb, want, c.hidden_size, what="normed embedding")  # one RMSNorm: a reduction over hidden


def test_each_muse_feature_matters(muse):
    """The parity above is meaningful: with rope on the NoPE layer or without the qk scale the logits change
    (the placeholder mapping shows in hidden_states[0]; the soft cap, at 3 over logits up to ~2.3, bends every
    one of them; the window of 4 cuts rows of 14)."""
    _, _, target = muse
    c = target.config
    ids = np.random.RandomState(1).randint(0, V, (2, 14)).astype(np.int32)
    run = lambda cfg: forward(cfg, target.params, ids, positions_for(ids), feature_layer_ids=ALL)[0]  # noqa: E731
    base = np.asarray(run(c))  # (the parity test's program)
    assert 1.5 < np.abs(base).max() < c.final_logit_softcapping
    for change in (dict(layer_rope_theta=(1e4,) * L), dict(qk_scale_factor=1.0)):
        assert max_diff(run(dataclasses.replace(c, **change)), base) > 1e-3, change


def test_incremental_decoding_equals_one_shot(muse):
    """A ragged prefill (3 and 2 tokens), then 3 tokens per forward through the cache (one program): the
    sliding layers' rings (window 4 + 3 slots) wrap, the NoPE layer keeps a full cache; logits and features
    equal one shot."""
    _, _, target = muse
    c, params = target.config, target.params
    seq = 16
    ids = np.random.RandomState(2).randint(0, V, (2, seq)).astype(np.int32)
    full, full_feats, _ = forward(c, params, ids, positions_for(ids), feature_layer_ids=ALL)
    cache = target.new_cache(2, 32, max_block=3)
    assert [type(s).__name__ for s in cache.layers] == ["SlidingKV"] * 3 + ["FullKV"]
    got, got_feats, cache = decode_in_chunks(target, ids, cache, [3, 2], lambda n: 3, ALL)
    np.testing.assert_array_equal(cache.lengths, [seq, seq])
    depth = forward_depth(c, seq)  # the same forward at other shapes (cached chunks): its rounding, per scale
    assert_close(got, full, depth, what="logits")
    assert_close(got_feats, full_feats, depth, what="features")


@pytest.mark.slow  # ~40 s on 2 CPU cores (8 compiled decode loops + transformers generate)
def test_speculative_equals_plain_equals_transformers_greedy(muse):
    """Batch of 3 ragged prompts (longer than the window by the end), random drafts of blocks 4 and 8, with and
    without a stop token; partial acceptance occurs (the sliding rings roll back)."""
    _, model, target = muse
    lossless_greedy_with_partial_acceptance(model, target, new=16)


# ----------------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------------

def test_vision_language_checkpoint_loads_and_exports(muse, tmp_path, capfd):
    """The released layout (text under model.language_model., a vision tower, adapter and projection) loads
    the language model alone and says what it skipped; our VL export reloads to the same and transformers
    reads it (its vision tower then freshly initialised); the text-only export (model.) reloads too."""
    path, model, _ = muse
    target = dj.load_target(path)
    err = capfd.readouterr().err
    assert "muse_glimmer: loaded the language model only" in err and "vision tower" in err
    assert "vision adapter / projection" in err
    ids = np.random.RandomState(4).randint(0, V, (1, 12)).astype(np.int32)
    with torch.no_grad():
        want = model(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    again = dj.load_target(save_target(target, str(tmp_path / "vl")))
    depth = forward_depth(target.config, 12)  # JAX against torch (or torch in another model class): a forward's
    assert again.config == target.config
    assert_close(dj.target_logits(again, ids), want, depth, what="re-exported VL logits")
    written = json.loads((tmp_path / "vl" / "config.json").read_text())
    assert "vision_config" not in written  # our export has no vision tower; give transformers a tiny one to build
    (tmp_path / "vl" / "config.json").write_text(json.dumps({**written, "vision_config": VISION}))
    hf = transformers.MuseGlimmerForConditionalGeneration.from_pretrained(str(tmp_path / "vl")).eval()
    with torch.no_grad():
        assert_close(hf(torch.as_tensor(ids, dtype=torch.long)).logits, want, depth, what="transformers reads ours")
    text = _text_only(target)
    reloaded = dj.load_target(save_target(text, str(tmp_path / "text")))
    names = {n for n, _ in iter_safetensors(str(tmp_path / "text" / "model.safetensors"))}
    assert "model.layers.0.self_attn.gate_proj.weight" in names and "model.embed_tokens.weight" in names
    ids_plain = np.where(np.isin(ids, (5, 6)), 0, ids)  # a text-only model has no placeholders to map
    assert reloaded.config == text.config
    assert_close(dj.target_logits(reloaded, ids_plain), want, depth, what="text-only export")


def _text_only(target):
    return dataclasses.replace(target, config=dataclasses.replace(
        target.config, model_type="muse_glimmer_text", vision_language=False, multimodal_token_ids=()))


def test_missing_or_misshaped_tensors_are_named(muse, tmp_path):
    path, _, _ = muse
    tensors = {n: np.array(a) for n, a in iter_safetensors(os.path.join(path, "model.safetensors"))}
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    gate = "model.language_model.layers.1.self_attn.gate_proj.weight"
    for name, edit, match in (("missing", lambda t: t.pop(gate), "lacks 1 tensors .*gate_proj"),
                              ("shape", lambda t: t.__setitem__(gate, t[gate][:, :-1]),
                               r"gate_proj.weight has shape \[32, 31\] but the config implies \[32, 32\]")):
        d = tmp_path / name
        d.mkdir()
        broken = dict(tensors)
        edit(broken)
        save_safetensors(str(d / "model.safetensors"), broken)
        (d / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=match):
            dj.load_target(str(d))


# ----------------------------------------------------------------------------------------------------
# Drafts: muse_glimmer_assistant, DFlash2
# ----------------------------------------------------------------------------------------------------

ASSISTANT = dict(hidden_size=H, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, sliding_window=64, block_size=4, mask_token_id=V - 1,
                 target_layer_ids=[0, 2], initializer_range=0.2, vocab_size=V)  # (absent: Muse-Glimmer's 202048)


@pytest.fixture(scope="module")
def assistant(tmp_path_factory):
    """(checkpoint dir, torch MuseGlimmerAssistantModel) with perturbed norms."""
    path = str(tmp_path_factory.mktemp("muse_assistant"))
    torch.manual_seed(3)
    model = transformers.MuseGlimmerAssistantModel(transformers.MuseGlimmerAssistantConfig(**ASSISTANT)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(path)
    return path, model


def test_assistant_draft_loads_and_matches_transformers(muse, assistant):
    """The flat muse_glimmer_assistant config reads as a non-causal sliding DFlash draft (rope theta 500000,
    transformers' default); encoder.fc / encoder.output_norm_enc load as fc / hidden_norm; its block logits
    on the target's features equal MuseGlimmerAssistantModel's through the target's plain lm_head, the
    block embedded with the raw table (no embedding norm)."""
    _, model, target = muse
    path, torch_draft = assistant
    names = {n for n, _ in iter_safetensors(os.path.join(path, "model.safetensors"))}
    assert {"encoder.fc.weight", "encoder.output_norm_enc.weight"} <= names and "fc.weight" not in names
    draft = dj.load_draft(path)
    c = draft.config
    assert (c.block_size, c.mask_token_id, c.target_layer_ids, c.is_causal) == (4, V - 1, (0, 2), False)
    # the assistant's window is inclusive (|q - k| <= 64): the DFlash rule's (< W) window of 65
    assert c.layers.layer_types == ("sliding_attention",) * 2 and c.layers.sliding_window == 65
    assert c.layers.rope.theta == 500000.0 and c.layers.qk_norm and c.architecture == "dflash"
    assert c.output_multiplier == 1.0 and c.final_logit_softcapping is None
    assert DraftConfig.from_hf(c.to_hf()) == c
    _assert_block_logits_match(model, target, draft, torch_draft)


def _assert_block_logits_match(model, target, draft, torch_draft):
    """Block logits of ``draft`` on 11 context tokens == MuseGlimmerAssistantModel's through the target's head, the
    assistant called as transformers' generation calls it (a ``DFlashCache`` told the 11 accepted tokens, so its
    mask places the block's queries at positions 11..14)."""
    from transformers.cache_utils import DFlashCache

    c = draft.config
    rng = np.random.RandomState(5)
    ctx = rng.randint(0, V, (2, 11)).astype(np.int32)
    block = np.concatenate([ctx[:, -1:], np.full((2, 3), V - 1, np.int32)], axis=1)
    got = dj.draft_block_logits(target, draft, ctx, block)
    depth = draft_depth(target.config, c.layers, 11, 4)
    table = model.model.language_model.embed_tokens.weight
    for r in range(2):
        cache = DFlashCache(config=torch_draft.config)
        cache.set_previous_accepted_tokens(11)
        with torch.no_grad():
            hs = model(torch.as_tensor(ctx[r:r + 1], dtype=torch.long), output_hidden_states=True).hidden_states
            feats = torch.cat([hs[i + 1] for i in c.target_layer_ids], -1)
            h = torch_draft(noise_embeds=table[torch.as_tensor(block[r:r + 1], dtype=torch.long)],
                            context_hidden_states=feats, position_ids=torch.arange(11 + 4)[None], cache=cache,
                            use_cache=True).last_hidden_state
            want = model.lm_head(h).numpy()
        assert_close(got[r], want[0], depth, what=f"row {r}")


def test_assistant_window_is_inclusive_at_its_boundary(muse, tmp_path):
    """A window of 5 over 11 context + 4 block positions: transformers' assistant lets a query see the key exactly
    5 positions away (|q - k| <= W, its bidirectional sliding mask), so it loads as the DFlash rule's (< W) window
    of 6 and matches; read with the DFlash rule's window of 5 (the boundary key dropped), it does not. (A DFlash
    draft keeps |q - k| < W: test_draft.py::test_sliding_window_sees_only_last_positions holds the key exactly W
    back unread.)"""
    _, model, target = muse
    torch.manual_seed(4)
    torch_draft = transformers.MuseGlimmerAssistantModel(
        transformers.MuseGlimmerAssistantConfig(**{**ASSISTANT, "sliding_window": 5})).eval()
    torch_draft.save_pretrained(str(tmp_path))
    draft = dj.load_draft(str(tmp_path))
    assert draft.config.layers.sliding_window == 6
    _assert_block_logits_match(model, target, draft, torch_draft)
    exclusive = dataclasses.replace(draft.config, layers=dataclasses.replace(draft.config.layers, sliding_window=5))
    with pytest.raises(AssertionError, match="row 0"):
        _assert_block_logits_match(model, target, D.Draft(exclusive, draft.params), torch_draft)


PROMPTS = [[5, 7, 3, 4, 9, 6], [7, 7, 1, 2, 3, 11, 12, 9, 14], [2, 8, 13]]


def test_assistant_draft_is_lossless(muse, assistant):
    """Speculative greedy with the (untrained) assistant draft == transformers' greedy generate."""
    _, model, target = muse
    got = S.speculative_generate(target, dj.load_draft(assistant[0]), PROMPTS, max_new_tokens=12, stop_token_ids=[])
    assert [r.output_ids for r in got] == [torch_greedy(model, p, 12) for p in PROMPTS]


@pytest.mark.slow  # ~20 s on 2 CPU cores (a DFlash2 decode loop and the plain one)
def test_dflash2_draft_is_lossless(muse):
    """A DFlash2 draft (convolutions, candidate selector; the target's output multiplier and soft cap, as the
    released incoai/Muse-Glimmer-30B-DFlash2 sets them) on this target: speculative greedy == plain ==
    transformers' greedy generate, with the whole block and with adaptive verify."""
    from test_draft import _scale_dflash2

    _, model, target = muse
    c = target.config
    dcfg = DraftConfig.for_target(c, draft_layers=1, block_size=4, mask_token_id=V - 1, target_layer_ids=(0, 2),
                                  layer_types=("sliding_attention",), sliding_window=4, is_causal=False,
                                  output_multiplier=c.output_multiplier, final_logit_softcapping=c.final_logit_softcapping)
    dcfg = dataclasses.replace(dcfg, architecture="dflash2", conv_kernel_size=2, conv_group_size=8, selector_rank=8,
                               selector_top_k=5)
    draft = D.Draft(dcfg, _scale_dflash2(D.init_draft_params(dcfg, 1), np.random.RandomState(1), 1.0))
    want = [torch_greedy(model, p, 12) for p in PROMPTS]
    assert [r.output_ids for r in S.generate(target, PROMPTS, max_new_tokens=12, stop_token_ids=[])] == want
    for kw in ({}, {"verify_lengths": (2, 4), "verify_threshold": 0.05}):
        got = S.speculative_generate(target, draft, PROMPTS, max_new_tokens=12, stop_token_ids=[], **kw)
        assert [r.output_ids for r in got] == want, kw
    jax.clear_caches()


def test_scanned_layers_decode_what_unrolled_ones_do(muse):
    """``scan_layers``: the family's repeating layers as one scan (``pairs.scanned_decodes_the_same``)."""
    from pairs import scanned_decodes_the_same

    scanned_decodes_the_same(muse[2], [[3, 5, 7, 2, 9], [4, 4, 1], [8, 2, 6, 1, 3, 5, 7]])
