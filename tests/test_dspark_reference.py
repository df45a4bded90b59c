"""Self-checks of the NumPy DSpark reference (tests/dspark_reference.py) and its checkpoint writer, not of
dflash_jax: DeepSpec's on-disk layout (the DSpark spec's sections 1.1 / 1.3 / 9), the Markov / confidence rules of sections 3-4,
the backbone against the DFlash v1 reference, the section 7 (Gemma 4) pieces against transformers' own Gemma 4
modules, and the section 5 loop on hand-worked cases."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import safetensors.numpy

from draft_reference import _rms, numpy_draft
from dspark_reference import (confident_length, dspark_greedy_decode, load_dspark_draft, numpy_dspark, rope_theta,
                              write_dspark_draft)
from hf_models import save_tiny, torch_forward, torch_greedy

V, D, R = 96, 32, 8  # hf_models.TINY's vocabulary and width; the writer's default Markov rank
DSPARK_KEYS = {"architectures", "num_target_layers", "num_hidden_layers", "block_size", "tie_word_embeddings",
               "layer_types", "mask_token_id", "target_layer_ids", "num_anchors", "enable_confidence_head",
               "markov_rank"}
# name -> writer keywords
VARIANTS = {"vanilla": dict(), "gated": dict(markov_head_type="gated"), "rnn": dict(markov_head_type="rnn"),
            "no markov": dict(markov_rank=0, confidence_with_markov=False),
            "confidence without markov": dict(confidence_with_markov=False),
            "no confidence": dict(confidence=False),
            "no heads": dict(markov_rank=0, confidence=False)}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("dspark_target"))
    return d, save_tiny(d, "qwen3")


def _draft(target, tmp_path, **kw):
    d = str(tmp_path / "draft")
    w = write_dspark_draft(d, target[0], **kw)
    w2, cfg = load_dspark_draft(d)
    assert w2.keys() == w.keys() and all(np.array_equal(w[k], w2[k]) for k in w)
    return w, cfg


def _features(target, cfg, ids):
    return torch_forward(target[1], np.asarray(ids)[None], cfg["target_layer_ids"])[1][0].astype(np.float64)


def _context(target, cfg, seed=0, T=11):
    rng = np.random.RandomState(seed)
    return _features(target, cfg, rng.randint(0, V, T)), int(rng.randint(V))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_config_and_tensors_on_disk(target, tmp_path, name):
    kw = VARIANTS[name]
    d = str(tmp_path / "draft")
    write_dspark_draft(d, target[0], **kw)
    with open(os.path.join(target[0], "config.json")) as f:
        tcfg = json.load(f)
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    rank, conf = kw.get("markov_rank", R), kw.get("confidence", True)
    with_markov = conf and kw.get("confidence_with_markov", True)
    extra = DSPARK_KEYS | ({"confidence_head_with_markov"} if conf else set())
    extra |= {"markov_head_type"} if rank else set()
    assert set(cfg) == set(tcfg) | extra and "dflash_config" not in cfg
    kept = set(tcfg) - extra - {"dtype"}  # the target's own fields, unchanged
    assert {k: cfg[k] for k in kept} == {k: tcfg[k] for k in kept} and cfg["dtype"] == "float32"
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["num_target_layers"] == 4
    assert cfg["num_hidden_layers"] == 2 and cfg["layer_types"] == ["full_attention"] * 2 and cfg["block_size"] == 4
    assert cfg["tie_word_embeddings"] is False and cfg["mask_token_id"] == V - 1 and cfg["target_layer_ids"] == [0, 2]
    assert cfg["num_anchors"] == 512 and cfg["enable_confidence_head"] is conf and cfg["markov_rank"] == rank
    if conf:
        assert cfg["confidence_head_with_markov"] is with_markov
    if rank:
        assert cfg["markov_head_type"] == kw.get("markov_head_type", "vanilla")

    # section 1.3, written out literally: d=32, 4 heads / 2 kv heads of 8, I=64, n=2
    want = {"embed_tokens.weight": (V, D), "lm_head.weight": (V, D), "fc.weight": (D, 2 * D),
            "hidden_norm.weight": (D,), "norm.weight": (D,)}
    for i in range(2):
        want.update({f"layers.{i}.{k}": s for k, s in {
            "self_attn.q_proj.weight": (32, D), "self_attn.k_proj.weight": (16, D), "self_attn.v_proj.weight": (16, D),
            "self_attn.o_proj.weight": (D, 32), "self_attn.q_norm.weight": (8,), "self_attn.k_norm.weight": (8,),
            "mlp.gate_proj.weight": (64, D), "mlp.up_proj.weight": (64, D), "mlp.down_proj.weight": (D, 64),
            "input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,)}.items()})
    if rank:
        want.update({"markov_head.markov_w1.weight": (V, R), "markov_head.markov_w2.weight": (V, R)})
    if kw.get("markov_head_type") == "gated":
        want.update({"markov_head.gate_proj.weight": (R, D + R), "markov_head.gate_proj.bias": (R,)})
    if kw.get("markov_head_type") == "rnn":
        want.update({"markov_head.joint_proj.weight": (3 * R, 2 * R + D), "markov_head.joint_proj.bias": (3 * R,)})
    if conf:
        want.update({"confidence_head.proj.weight": (1, D + R if with_markov else D),
                     "confidence_head.proj.bias": (1,)})
    tensors = safetensors.numpy.load_file(os.path.join(d, "model.safetensors"))
    assert {k: v.shape for k, v in tensors.items()} == want
    assert all(v.dtype == np.float32 for v in tensors.values())
    src = safetensors.numpy.load_file(os.path.join(target[0], "model.safetensors"))
    assert np.array_equal(tensors["embed_tokens.weight"], src["model.embed_tokens.weight"])
    assert np.array_equal(tensors["lm_head.weight"], src["lm_head.weight"])


def test_tied_target_and_bad_options(tmp_path):
    t = str(tmp_path / "tied")
    save_tiny(t, "qwen3", tie_word_embeddings=True)
    w = write_dspark_draft(str(tmp_path / "d"), t)
    assert np.array_equal(w["lm_head.weight"], w["embed_tokens.weight"])
    with open(tmp_path / "d" / "config.json") as f:
        assert json.load(f)["tie_word_embeddings"] is False
    with pytest.raises(ValueError, match="Markov head"):
        write_dspark_draft(str(tmp_path / "e"), t, markov_rank=0)  # confidence_with_markov needs one
    with pytest.raises(ValueError, match="increasing"):
        write_dspark_draft(str(tmp_path / "e"), t, target_layer_ids=(2, 0))
    assert rope_theta({"rope_theta": 5e5}) == rope_theta({"rope_parameters": {"rope_theta": 5e5}}) == 5e5


def test_backbone_is_dflash_v1(target, tmp_path):
    """hidden / base logits = the DFlash v1 reference's (bidirectional, no window) over [anchor, mask x 3]."""
    w, cfg = _draft(target, tmp_path)
    feats, anchor = _context(target, cfg)
    out = numpy_dspark(w, cfg, feats, anchor)
    layers = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_hidden_layers=2,
                             layer_types=["full_attention"] * 2, sliding_window=None, rope=SimpleNamespace(theta=1e4))
    v1 = SimpleNamespace(layers=layers, is_causal=False, architecture="dflash", input_embedding_scale=1.0,
                         output_multiplier=1.0, final_logit_softcapping=None)
    block = [anchor] + [V - 1] * 3
    logits, hidden = numpy_draft(w, v1, feats, w["embed_tokens.weight"][block], w["lm_head.weight"], len(feats))
    np.testing.assert_allclose(out["hidden"], hidden, rtol=0, atol=1e-12)
    np.testing.assert_allclose(out["base_logits"], logits, rtol=0, atol=1e-12)
    # an offset context (ctx_len > T): the same rows later in the sequence give other logits (RoPE is relative:
    # shifting everything keeps them)
    moved = numpy_dspark(w, cfg, feats, anchor, ctx_len=len(feats) + 5)
    np.testing.assert_allclose(moved["base_logits"], out["base_logits"], rtol=0, atol=1e-9)
    assert not np.allclose(numpy_dspark(w, cfg, feats[3:], anchor, ctx_len=len(feats))["base_logits"],
                           out["base_logits"])


@pytest.mark.parametrize("name", ["no markov", "zero w2", "gated zero w1", "rnn zero joint", "rnn zero output chunk"])
def test_no_markov_bias(target, tmp_path, name):
    kw = {"no markov": VARIANTS["no markov"], "zero w2": {}, "gated zero w1": dict(markov_head_type="gated"),
          "rnn zero joint": dict(markov_head_type="rnn"), "rnn zero output chunk": dict(markov_head_type="rnn")}[name]
    w, cfg = _draft(target, tmp_path, **kw)
    if name == "zero w2":
        w["markov_head.markov_w2.weight"][:] = 0
    if name == "gated zero w1":  # W2 (g * 0) = 0 (the confidence head still sees W1[x] = 0)
        w["markov_head.markov_w1.weight"][:] = 0
    if name == "rnn zero joint":  # W2 tanh(0) = 0 whatever the state
        w["markov_head.joint_proj.weight"][:] = 0
        w["markov_head.joint_proj.bias"][:] = 0
    if name == "rnn zero output chunk":  # rows [gate; candidate; output]: the bias reads o only, not the state
        w["markov_head.joint_proj.weight"][2 * R:] = 0
        w["markov_head.joint_proj.bias"][2 * R:] = 0
    for seed in range(3):
        out = numpy_dspark(w, cfg, *_context(target, cfg, seed))
        assert np.array_equal(out["logits"], out["base_logits"])
        assert np.array_equal(out["tokens"], out["base_logits"].argmax(-1))


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_greedy_slots_and_heads(target, tmp_path, kind):
    w, cfg = _draft(target, tmp_path, markov_head_type=kind)
    changed, confidences = 0, []
    for seed in range(6):
        feats, anchor = _context(target, cfg, seed)
        out = numpy_dspark(w, cfg, feats, anchor)
        tokens = out["tokens"]
        assert np.array_equal(tokens, out["logits"].argmax(-1))  # greedy on the CORRECTED logits
        assert list(out["prev"]) == [anchor] + list(tokens[:-1])  # x_0 anchor, x_j the greedy token of slot j-1
        forced = numpy_dspark(w, cfg, feats, anchor, prev_tokens=tokens[:-1])  # teacher forcing on its own tokens
        for k in ("logits", "tokens", "prev", "confidence"):
            np.testing.assert_array_equal(forced[k], out[k])
        changed += int((tokens != out["base_logits"].argmax(-1)).sum())
        confidences += list(out["confidence"])
        # the Markov bias of a slot, restated from section 3 (vanilla / gated: this slot's x only)
        e = w["markov_head.markov_w1.weight"][anchor]
        if kind == "vanilla":
            np.testing.assert_allclose(out["logits"][0] - out["base_logits"][0], w["markov_head.markov_w2.weight"] @ e)
        z = np.concatenate([out["hidden"][0], e]) @ w["confidence_head.proj.weight"][0]
        z += w["confidence_head.proj.bias"][0]
        np.testing.assert_allclose(out["confidence"][0], 1 / (1 + np.exp(-z)))
        # slot 0 restated (the rnn state starts at 0): gated [h; e] -> gate on e; rnn columns [s; e; h], rows [a; c; o]
        h0, w2 = out["hidden"][0], w["markov_head.markov_w2.weight"]
        if kind == "gated":
            g = w["markov_head.gate_proj.weight"] @ np.concatenate([h0, e]) + w["markov_head.gate_proj.bias"]
            g = 1 / (1 + np.exp(-g))
            np.testing.assert_allclose(out["logits"][0] - out["base_logits"][0], w2 @ (g * e))
        if kind == "rnn":
            o = (w["markov_head.joint_proj.weight"][2 * R:] @ np.concatenate([np.zeros(R), e, h0])
                 + w["markov_head.joint_proj.bias"][2 * R:])
            np.testing.assert_allclose(out["logits"][0] - out["base_logits"][0], w2 @ np.tanh(o))
        # other previous tokens: hidden and base logits do not move; slot 0 (x_0 = the anchor) does not either
        other = numpy_dspark(w, cfg, feats, anchor, prev_tokens=(tokens[:-1] + 1) % V)
        np.testing.assert_array_equal(other["base_logits"], out["base_logits"])
        np.testing.assert_array_equal(other["logits"][0], out["logits"][0])
        assert not np.allclose(other["logits"][1:], out["logits"][1:])
        # memory: with x_2 fixed, changing x_1 moves slot 2's bias only for the rnn head
        a = numpy_dspark(w, cfg, feats, anchor, prev_tokens=[5, 7, 9])
        b = numpy_dspark(w, cfg, feats, anchor, prev_tokens=[6, 7, 9])
        same = np.allclose(a["logits"][2] - a["base_logits"][2], b["logits"][2] - b["base_logits"][2],
                           rtol=0, atol=1e-12)
        assert same == (kind != "rnn")
    if kind == "rnn":  # no memory when the state is not read (columns :r) or stays 0 (candidate rows r:2r zero)
        for rows, cols in ((slice(None), slice(0, R)), (slice(R, 2 * R), slice(None))):
            cut = dict(w)
            cut["markov_head.joint_proj.weight"] = w["markov_head.joint_proj.weight"].copy()
            cut["markov_head.joint_proj.bias"] = w["markov_head.joint_proj.bias"].copy()
            cut["markov_head.joint_proj.weight"][rows, cols] = 0
            if cols == slice(None):
                cut["markov_head.joint_proj.bias"][rows] = 0
            a = numpy_dspark(cut, cfg, feats, anchor, prev_tokens=[5, 7, 9])
            b = numpy_dspark(cut, cfg, feats, anchor, prev_tokens=[6, 7, 9])
            np.testing.assert_allclose(a["logits"][2] - a["base_logits"][2], b["logits"][2] - b["base_logits"][2],
                                       rtol=0, atol=1e-12)
    assert 0 < changed < 24  # the Markov head moves some argmaxes, not all
    assert min(confidences) < 0.5 < max(confidences)


def test_confidence_without_markov(target, tmp_path):
    w, cfg = _draft(target, tmp_path, confidence_with_markov=False)
    out = numpy_dspark(w, cfg, *_context(target, cfg))
    z = out["hidden"] @ w["confidence_head.proj.weight"][0] + w["confidence_head.proj.bias"][0]
    np.testing.assert_allclose(out["confidence"], 1 / (1 + np.exp(-z)))
    w, cfg = _draft(target, tmp_path, confidence=False)
    out = numpy_dspark(w, cfg, *_context(target, cfg), threshold=0.9)
    assert out["confidence"] is None and out["proposal_length"] == 4


def test_confident_length():
    c = [0.9, 0.7, 0.4, 0.95]
    assert confident_length(c, 0.0) == confident_length(c, -1.0) == 4
    assert confident_length(c, 0.5) == 2  # the first slot below: per-slot, not the product
    assert confident_length(c, 0.95) == 0 and confident_length(c, 0.3) == 4
    assert confident_length(c, 0.7) == 2  # c < threshold, strictly
    assert confident_length(None, 0.5, block_size=7) == 7


# ---------------------------------------------------------------- the loop


def _counting_target(skip_after=None):
    """A causal toy target: after token t the argmax is t+1 (t+2 after ``skip_after``); features a fixed table."""
    table = np.random.RandomState(0).randn(V, 2 * D)

    def forward(ids):
        ids = np.asarray(ids)
        nxt = (ids + np.where(ids == skip_after, 2, 1)) % V
        return 10.0 * np.eye(V)[nxt], table[ids]

    return forward


def _counting_draft(target, tmp_path, low_confidence_after=None):
    """A draft whose vanilla Markov head (rank V, W1 = I, W2 = 100 x shift) drafts x+1 after x; the confidence is
    ~1 except after token ``low_confidence_after`` (~0)."""
    w, cfg = _draft(target, tmp_path, markov_rank=V)
    w["markov_head.markov_w1.weight"] = np.eye(V)
    w["markov_head.markov_w2.weight"] = 100.0 * np.roll(np.eye(V), 1, axis=0)  # row x+1 <- column x
    proj = np.zeros((1, D + V))
    proj[0, D:] = 10.0
    if low_confidence_after is not None:
        proj[0, D + low_confidence_after] = -10.0
    w["confidence_head.proj.weight"], w["confidence_head.proj.bias"] = proj, np.zeros(1)
    return w, cfg


def _plain_greedy(forward, prompt, new, stop=()):
    out = list(prompt)
    while len(out) < len(prompt) + new and not (set(out[len(prompt):]) & set(stop)):
        out.append(int(np.argmax(forward(out)[0][-1])))
    return out


# name -> (target skip, low-confidence token, threshold, max_new, stop ids, expected new tokens, acceptance)
CASES = {
    "full blocks, limit cuts the last": (None, None, 0.0, 12, (), list(range(3, 15)), [5, 5, 5]),
    "stop inside drafts": (None, None, 0.0, 20, (11,), list(range(3, 12)), [5, 3]),
    "stop as bonus": (None, None, 0.0, 20, (8,), list(range(3, 9)), [5]),
    "stop as first token": (None, None, 0.0, 20, (3,), [3], []),
    "confidence truncates": (None, 10, 0.5, 12, (), list(range(3, 15)), [5, 3, 5]),
    "confidence off by threshold 0": (None, 10, 0.0, 12, (), list(range(3, 15)), [5, 5, 5]),
    "rejection": (9, None, 0.0, 12, (), [3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 14, 15], [5, 2, 5]),
    "every proposal empty": (None, None, 1.0, 4, (), [3, 4, 5, 6], [1, 1, 1, 1]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_loop_hand_worked(target, tmp_path, name):
    """Prompt [0, 1, 2], B = 4: each round proposes 4 (or L) drafts, the target checks 5."""
    skip, low, threshold, new, stop, want, acceptance = CASES[name]
    forward = _counting_target(skip)
    w, cfg = _counting_draft(target, tmp_path, low)
    out, acc = dspark_greedy_decode(forward, w, cfg, [0, 1, 2], new, stop_ids=stop, threshold=threshold)
    assert out == [0, 1, 2] + want and acc == acceptance
    assert out == _plain_greedy(forward, [0, 1, 2], new, stop)


@pytest.mark.parametrize("kind", ["vanilla", "rnn"])
def test_loop_is_lossless(target, tmp_path, kind):
    """With the tiny random target: the target's own greedy output, whatever the draft proposes."""
    w, cfg = _draft(target, tmp_path, markov_head_type=kind)
    model = target[1]

    def forward(ids):
        logits, feats = torch_forward(model, np.asarray(ids)[None], cfg["target_layer_ids"])
        return logits[0].astype(np.float64), feats[0]

    prompt = [5, 17, 42, 8, 60]
    want = torch_greedy(model, prompt, 10)
    for threshold in (0.0, 0.6):
        out, acc = dspark_greedy_decode(forward, w, cfg, prompt, 10, threshold=threshold)
        assert out == want and all(1 <= a <= 5 for a in acc) and 1 + sum(acc) >= 10
    stop = want[9]  # a token the output reaches: it ends there
    out, _ = dspark_greedy_decode(forward, w, cfg, prompt, 10, stop_ids=(stop,))
    assert out == want[:want.index(stop, len(prompt)) + 1]


def test_gemma4_pieces_match_transformers():
    """The Gemma 4 statement's pieces (section 7) against transformers' Gemma 4 modules: the full layers' rope
    frequencies (proportional: half of them zero here) and their rotate-half application, RMSNorm with a weight and
    without one (the value norm), and the GeLU-tanh MLP."""
    import torch
    import transformers
    from transformers.models.gemma4 import modeling_gemma4 as G

    from dspark_reference import _gelu_tanh, _rope_with, full_rope_inv_freq

    cfg = {"vocab_size": 16, "hidden_size": 32, "intermediate_size": 24, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "global_head_dim": 16,
           "hidden_size_per_layer_input": 0, "layer_types": ["full_attention"] * 2, "rms_norm_eps": 1e-6,
           "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                                  "rope_theta": 1000000.0}}}
    for factor in (1.0, 4.0):
        scaled = {**cfg, "rope_parameters": {**cfg["rope_parameters"], "full_attention": {
            **cfg["rope_parameters"]["full_attention"], "factor": factor}}}
        want = G.Gemma4TextRotaryEmbedding(transformers.Gemma4TextConfig(**scaled)).full_attention_inv_freq
        np.testing.assert_allclose(full_rope_inv_freq(scaled), want.double().numpy(), rtol=1e-6)
    hf = transformers.Gemma4TextConfig(**cfg)
    rng = np.random.default_rng(0)
    rotary = G.Gemma4TextRotaryEmbedding(hf)
    inv = full_rope_inv_freq(cfg)
    np.testing.assert_allclose(inv, rotary.full_attention_inv_freq.double().numpy(), rtol=1e-6)
    assert np.count_nonzero(inv) == 4
    x, pos = rng.standard_normal((5, 3, 16)), np.arange(7, 12)
    cos, sin = rotary(torch.zeros(1, 5, 16), torch.tensor(pos)[None], "full_attention")
    want = G.apply_rotary_pos_emb(torch.tensor(x, dtype=torch.float32)[None], cos, sin, unsqueeze_dim=2)[0]
    np.testing.assert_allclose(_rope_with(x, pos, inv), want.double().numpy(), atol=1e-5)
    h = rng.standard_normal((3, 32))
    for with_scale in (True, False):
        norm = G.Gemma4RMSNorm(32, eps=1e-6, with_scale=with_scale)
        w = 1.0 + 0.1 * rng.standard_normal(32) if with_scale else 1.0
        if with_scale:
            norm.weight.data = torch.tensor(w, dtype=torch.float32)
        want = norm(torch.tensor(h, dtype=torch.float32)).double().detach().numpy()
        np.testing.assert_allclose(_rms(h, w, 1e-6), want, atol=1e-5)
    mlp = G.Gemma4TextMLP(hf, 0)
    mats = {n: rng.standard_normal(tuple(getattr(mlp, n).weight.shape)) / 4 for n in ("gate_proj", "up_proj",
                                                                                      "down_proj")}
    for n, m in mats.items():
        getattr(mlp, n).weight.data = torch.tensor(m, dtype=torch.float32)
    want = mlp(torch.tensor(h, dtype=torch.float32)).double().detach().numpy()
    got = (_gelu_tanh(h @ mats["gate_proj"].T) * (h @ mats["up_proj"].T)) @ mats["down_proj"].T
    np.testing.assert_allclose(got, want, atol=1e-5)
