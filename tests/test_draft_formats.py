"""Draft formats of today's ecosystem: the newest DFlash v1 rules (causal sliding layers, dflash_config
precedence, embedding / logit scales) and DFlash2 drafts (convolutions, candidate selector), each against
the independent NumPy statement in ``draft_reference``; their checkpoints; the engine with them."""
from __future__ import annotations

import json

import numpy as np
import pytest
import safetensors.numpy

import dflash_jax as dj
from dflash_jax.drafts import model as D
from dflash_jax import decode as S
from dflash_jax.drafts import DraftConfig
from draft_reference import numpy_draft, numpy_select_greedy
from hf_models import save_tiny, torch_forward
from test_draft import make_draft
from tolerances import assert_close, draft_depth

DFLASH2 = dict(architecture="dflash2", conv_kernel_size=2, conv_group_size=8, selector_rank=8, selector_top_k=5,
               is_causal=False)
# name -> (make_draft keyword arguments); every one differs from the old reading of the same draft
FORMATS = {
    "sliding causal (default)": dict(sliding=3),
    "sliding bidirectional, window < block": dict(sliding=3, is_causal=False),
    "all causal": dict(is_causal=True),
    "scales and soft cap": dict(input_embedding_scale=2.5, output_multiplier=0.4, final_logit_softcapping=1.5),
    "dflash2": dict(DFLASH2),
    "dflash2 sliding, scaled": dict(DFLASH2, sliding=3, output_multiplier=0.7, final_logit_softcapping=4.0),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("target"))
    model = save_tiny(d, "qwen3")
    return dj.load_target(d), model


def _exported(draft, tmp_path):
    D.save_draft(draft, str(tmp_path), dtype="float32")
    return {k: v.astype(np.float64) for k, v in safetensors.numpy.load_file(str(tmp_path / "model.safetensors")).items()}


def _reference(tiny, draft, w, ctx, block):
    """NumPy draft logits and hidden of one row, from the torch target's features and tables."""
    _, torch_model = tiny
    _, feats = torch_forward(torch_model, ctx[None], draft.config.target_layer_ids)
    sd = {k: v.detach().double().numpy() for k, v in torch_model.state_dict().items()}
    return numpy_draft(w, draft.config, feats[0].astype(np.float64), sd["model.embed_tokens.weight"][block],
                       sd["lm_head.weight"], len(ctx))


@pytest.mark.parametrize("name", list(FORMATS))
def test_block_logits_and_tokens_match_numpy(tiny, tmp_path, name):
    target, _ = tiny
    draft = make_draft(target.config, **FORMATS[name])
    w = _exported(draft, tmp_path)
    rng = np.random.RandomState(3)
    ctx = rng.randint(0, 90, (2, 9))
    block = np.concatenate([rng.randint(0, 90, (2, 1)), np.full((2, 7), draft.config.mask_token_id)], 1)
    got = D.draft_block_logits(target, draft, ctx, block)
    toks = dj.draft_block_tokens(target, draft, ctx, block)
    assert toks.shape == (2, 7) and np.issubdtype(toks.dtype, np.integer)
    for r in range(2):
        want, hidden = _reference(tiny, draft, w, ctx[r], block[r])
        # float32 against the float64 reference: the target's forward and the draft's, per the logits' scale
        assert_close(got[r], want, draft_depth(target.config, draft.config.layers, 9, 8), what=f"{name} row {r}")
        if draft.config.architecture == "dflash2":
            walk = numpy_select_greedy(w, draft.config, hidden[1:], want[1:], block[r, 0])
            np.testing.assert_array_equal(toks[r], walk)
        else:
            np.testing.assert_array_equal(toks[r], got[r, 1:].argmax(-1))


def test_each_rule_changes_the_logits(tiny):
    """The new readings are not no-ops on these drafts: the old one (bidirectional, unscaled) differs."""
    target, _ = tiny
    rng = np.random.RandomState(4)
    ctx, block = rng.randint(0, 90, (1, 9)), np.array([[5] + [95] * 7])
    for name in ("sliding causal (default)", "sliding bidirectional, window < block", "all causal",
                 "scales and soft cap"):
        new = make_draft(target.config, **FORMATS[name])
        old = D.Draft(DraftConfig(**{**new.config.__dict__, "is_causal": False, "input_embedding_scale": 1.0,
                                     "output_multiplier": 1.0, "final_logit_softcapping": None}), new.params)
        if name == "sliding bidirectional, window < block":  # vs no window at all
            old = D.Draft(DraftConfig(**{**old.config.__dict__, "layers": target.config.__class__(
                **{**new.config.layers.__dict__, "layer_types": ("full_attention",) * 2, "sliding_window": None})}),
                new.params)
        diff = np.abs(D.draft_block_logits(target, new, ctx, block) - D.draft_block_logits(target, old, ctx, block))
        assert diff.max() > 1e-3, name


def test_dflash2_selector_is_not_the_argmax(tiny):
    """The selector's pairwise terms move the proposal off the plain argmax somewhere (else the walk is untested)."""
    target, _ = tiny
    draft = make_draft(target.config, **DFLASH2)
    rng = np.random.RandomState(5)
    ctx = rng.randint(0, 90, (4, 9))
    block = np.concatenate([rng.randint(0, 90, (4, 1)), np.full((4, 7), 95)], 1)
    logits = D.draft_block_logits(target, draft, ctx, block)
    assert (dj.draft_block_tokens(target, draft, ctx, block) != logits[:, 1:].argmax(-1)).any()


# --- configs ------------------------------------------------------------------------------------------------


def _hf(**over):
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
           "vocab_size": 96, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 128,
           "num_target_layers": 4, "dflash_config": {"mask_token_id": 95, "target_layer_ids": [1, 3]}}
    for k, v in over.items():
        if k == "dflash_config":
            cfg[k] = {**cfg[k], **v}
        else:
            cfg[k] = v
    return cfg


def test_dflash_config_keys_win():
    c = DraftConfig.from_hf(_hf(block_size=16, dflash_config={"block_size": 8}, target_layer_ids=[0, 1]))
    assert c.block_size == 8 and c.target_layer_ids == (1, 3)
    assert DraftConfig.from_hf(_hf(dflash_config={"block_size": 10})).block_size == 10  # only in dflash_config
    assert DraftConfig.from_hf(_hf()).block_size == 16
    c = DraftConfig.from_hf(_hf(output_multiplier=3.0, dflash_config={"output_multiplier": 0.5,
                                                                       "input_embedding_scale": 2.0,
                                                                       "final_logit_softcapping": 20.0}))
    assert (c.output_multiplier, c.input_embedding_scale, c.final_logit_softcapping) == (0.5, 2.0, 20.0)
    assert DraftConfig.from_hf(_hf(final_logit_softcapping=0.0)).final_logit_softcapping is None  # 0: off


def test_causality_per_layer():
    types = ["sliding_attention", "full_attention"]
    c = DraftConfig.from_hf(_hf(layer_types=types, sliding_window=4))
    assert [c.layer_causal(i) for i in range(2)] == [True, False]
    assert [c.layers.layer_window(i) for i in range(2)] == [4, None]
    c = DraftConfig.from_hf(_hf(layer_types=types, sliding_window=4, is_causal=False))
    assert [c.layer_causal(i) for i in range(2)] == [False, False]
    assert [DraftConfig.from_hf(_hf(is_causal=True)).layer_causal(i) for i in range(2)] == [True, True]
    assert not DraftConfig.from_hf(_hf()).layer_causal(0)


def test_target_and_draft_mixed_up():
    with pytest.raises(ValueError, match=r"is a target model \(architectures \['Qwen3ForCausalLM'\]\), not a DFlash"):
        DraftConfig.from_hf({**_hf(architectures=["Qwen3ForCausalLM"]), "dflash_config": None})
    from dflash_jax.families import config_from_hf

    from dflash_jax.drafts.formats import architecture_formats

    for arch in architecture_formats():  # every draft format's, and the DSpark stacks families bring
        with pytest.raises(ValueError, match="is a DFlash / DSpark draft .* not a target model"):
            config_from_hf(_hf(architectures=[arch]))


def test_dflash2_config_and_errors():
    c = DraftConfig.from_hf(_hf(architectures=["DFlash2DraftModel"], dflash_config={"selector_rank": 16}))
    assert (c.architecture, c.conv_kernel_size, c.conv_group_size, c.selector_rank, c.selector_top_k) == \
        ("dflash2", 2, 16, 16, 16)
    with pytest.raises(ValueError, match="unsupported draft architecture 'DFlash3DraftModel'"):
        DraftConfig.from_hf(_hf(architectures=["DFlash3DraftModel"]))
    with pytest.raises(ValueError, match="conv_group_size 5 does not divide hidden_size 32"):
        DraftConfig.from_hf(_hf(architectures=["DFlash2DraftModel"], dflash_config={"conv_group_size": 5}))
    with pytest.raises(ValueError, match="DFlash2 settings"):
        DraftConfig(**{**DraftConfig.from_hf(_hf()).__dict__, "selector_rank": 4})
    with pytest.raises(ValueError, match="output_multiplier must be a finite non-zero"):
        DraftConfig.from_hf(_hf(dflash_config={"output_multiplier": 0}))


@pytest.mark.parametrize("name", ["scales and soft cap", "dflash2 sliding, scaled"])
def test_checkpoint_round_trip(tiny, tmp_path, name):
    target, _ = tiny
    draft = make_draft(target.config, **FORMATS[name])
    w = _exported(draft, tmp_path)
    cfg = json.load(open(tmp_path / "config.json"))
    dflash = cfg["dflash_config"]
    assert dflash["output_multiplier"] == draft.config.output_multiplier
    assert dflash["final_logit_softcapping"] == draft.config.final_logit_softcapping
    if draft.config.architecture == "dflash2":
        assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["is_causal"] is False
        assert {dflash[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")} == {2, 8, 5}
        assert "candidate_selector.predecessor_codebook" in w and "layers.1.mlp_conv.base_kernel" in w
        assert w["layers.0.attention_conv.kernel_projection.weight"].shape == (2 * 2 * 4, 32)  # [2*K*G, H]
        assert not any(k.endswith("codebook.weight") for k in w)
    again = dj.load_draft(str(tmp_path))
    assert again.config == draft.config
    ctx, block = np.array([[4, 8, 15, 16, 23]]), np.array([[42] + [95] * 7])
    np.testing.assert_array_equal(D.draft_block_logits(target, again, ctx, block),
                                  D.draft_block_logits(target, draft, ctx, block))
    if draft.config.architecture == "dflash2":  # codebooks written with a ".weight" suffix load the same
        renamed = {(k + ".weight" if k.endswith("codebook") else k): v.astype(np.float32) for k, v in w.items()}
        safetensors.numpy.save_file(renamed, str(tmp_path / "model.safetensors"))
        np.testing.assert_array_equal(D.draft_block_tokens(target, dj.load_draft(str(tmp_path)), ctx, block),
                                      D.draft_block_tokens(target, draft, ctx, block))


def test_dflash2_codebooks_must_cover_the_vocabulary(tiny):
    target, _ = tiny
    draft = make_draft(target.config, **DFLASH2)
    small = dict(draft.params)
    small["candidate_selector"] = {**small["candidate_selector"],
                                   "successor_codebook": small["candidate_selector"]["successor_codebook"][:50]}
    with pytest.raises(ValueError, match="codebooks have 50 rows for a target vocabulary of 96"):
        D.check_pair(target, D.Draft(draft.config, small))


def test_draft_block_tokens_rejects_a_lone_anchor(tiny):
    target, _ = tiny
    with pytest.raises(ValueError, match="at least 2 positions"):
        dj.draft_block_tokens(target, make_draft(target.config), [[1, 2]], [[3]])


# --- the engine ---------------------------------------------------------------------------------------------


def reference_loop(target, draft, prompt, max_new_tokens, stop=()):
    """The reference's greedy loop, step by step through the public API: the block shrinks to the tokens
    left (verify_size = min(B, max_length - start)); returns (output ids, acceptance lengths)."""
    out = list(prompt)
    out.append(int(dj.target_logits(target, [out])[0, -1].argmax()))
    max_length, acc = len(prompt) + max_new_tokens, []
    while len(out) < max_length and out[-1] not in stop:
        start = len(out) - 1
        size = min(draft.config.block_size, max_length - start)
        block = [out[start]]
        if size > 1:
            block += dj.draft_block_tokens(target, draft, [out[:start]],
                                           [[out[start]] + [draft.config.mask_token_id] * (size - 1)])[0].tolist()
        ids = out[:start] + block  # padded on the right to a multiple of 32: causal, so the same logits, one compile
        post = dj.target_logits(target, [ids + [0] * (-len(ids) % 32)])[0, start:len(ids)].argmax(-1)
        a = 0
        while a < size - 1 and block[a + 1] == post[a]:
            a += 1
        produced = min(a + 1, max_length - start - 1)
        new = block[1:a + 1] + [int(post[a])]
        for i, t in enumerate(new[:produced]):
            if t in stop:
                produced = i + 1
                break
        out = out[:start + 1] + new[:produced]
        acc.append(produced)
    return out, acc


@pytest.mark.parametrize("name", ["sliding causal (default)",
                                  pytest.param("dflash2 sliding, scaled", marks=pytest.mark.slow)])
def test_engine_equals_reference_loop(tiny, name):
    """Outputs AND per-step acceptance lengths equal the reference loop's, with a budget that ends inside a
    block (where the reference drafts a shorter block) and a stop token, batched and ragged."""
    target, _ = tiny
    draft = make_draft(target.config, **FORMATS[name])
    rng = np.random.RandomState(6)
    prompts = [rng.randint(0, 90, n).tolist() for n in (5, 9)]
    for new, stop in ((10, (int(rng.randint(0, 90)),)),):
        got = S.speculative_generate(target, draft, prompts, max_new_tokens=new, stop_token_ids=list(stop))
        plain = S.generate(target, prompts, max_new_tokens=new, stop_token_ids=list(stop))
        for g, p, prompt in zip(got, plain, prompts):
            out, acc = reference_loop(target, draft, prompt, new, stop)
            assert g.output_ids == p.output_ids == out
            assert g.acceptance_lengths == acc


def test_generate_cli_with_a_dflash2_draft(tiny, tmp_path, capsys):
    """``python -m infer.generate --json --ignore-eos`` on a saved DFlash2 draft: the reference loop's
    outputs and per-step acceptance lengths."""
    from infer import generate as g

    target, _ = tiny
    draft = make_draft(target.config, **FORMATS["dflash2 sliding, scaled"])
    D.save_draft(draft, str(tmp_path / "draft"), dtype="float32")
    assert g.main(["--target", target.path, "--draft", str(tmp_path / "draft"), "--prompt-ids", "5,17,3",
                   "--max-new-tokens", "7", "--temperature", "0", "--ignore-eos", "--json"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    out, acc = reference_loop(target, dj.load_draft(str(tmp_path / "draft")), [5, 17, 3], 7)
    assert row["output_ids"] == out and row["acceptance_lengths"] == acc


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_5"])
def test_dflash2_on_other_families(tmp_path, family):
    """A DFlash2 draft on a gpt-oss target (sinks, sliding ring, experts) and a Qwen3.5 hybrid (recurrent
    rollback): lossless against plain decoding, with the whole block and with adaptive verify."""
    import dataclasses

    from test_gpt_oss import CFG as GPT_OSS
    from test_qwen3_5 import CFG as QWEN3_5

    save_tiny(str(tmp_path), family, **{"gpt_oss": GPT_OSS, "qwen3_5": QWEN3_5}[family])
    target = dj.load_target(str(tmp_path))
    tcfg = target.config
    dcfg = DraftConfig.for_target(tcfg, draft_layers=1, block_size=4, mask_token_id=tcfg.vocab_size - 1,
                                  target_layer_ids=(0, 2))
    dcfg = dataclasses.replace(dcfg, **{k: v for k, v in DFLASH2.items()})
    from test_draft import _scale_dflash2

    draft = D.Draft(dcfg, _scale_dflash2(D.init_draft_params(dcfg, 1), np.random.RandomState(1), 1.0))
    rng = np.random.RandomState(7)
    prompts = [rng.randint(0, tcfg.vocab_size - 1, n).tolist() for n in (6, 11, 2)]
    plain = [r.output_ids for r in S.generate(target, prompts, max_new_tokens=10, stop_token_ids=[])]
    for kw in ({}, {"verify_lengths": (2, 4), "verify_threshold": 0.05}):
        got = S.speculative_generate(target, draft, prompts, max_new_tokens=10, stop_token_ids=[], **kw)
        assert [r.output_ids for r in got] == plain, kw
