"""Training DSpark drafts (``python -m train --draft-arch dspark``; train/dspark_objective.py): the loss of a tiny
batch against an independent NumPy statement of DeepSpec's formula (tests/dspark_reference.py's teacher-forced
block, CE / L1 / BCE and the exp(-j/4) weights written out here), the training forward's block independence
(DSpark, and DFlash2's per-block convolution), a short run (frozen embed_tokens / lm_head unchanged, the rest
trained, the loss falling) and its export reloading to bit-identical block logits."""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax.drafts import model as D
from dflash_jax import target as target_lib
from dflash_jax.target import Target, init_params, save_target
from dspark_reference import load_dspark_draft, numpy_dspark
from pairs import tiny_target_config, train_briefly
from test_dspark import make_dspark
from tolerances import assert_close, draft_depth, f32_rel, loss_depth
from train import dspark_objective as DO
from train import objective as O

VOCAB, BK, S = 16, 4, 14
IDS = (0, 1)


@pytest.fixture(scope="module")
def small():
    """A tiny random target (vocabulary 16, 2 layers) with a peaked head."""
    tcfg = tiny_target_config(VOCAB, layers=2)
    params = init_params(tcfg, 0)
    return Target(tcfg, dict(params, lm_head={"kernel": params["lm_head"]["kernel"] * 8}))


def _batch():
    """One row: a 3-token prompt, a hole in the loss mask at 8 (cuts the blocks reaching it), anchors 3 and 5
    (overlapping), 11 (runs past the end), a padding block."""
    rng = np.random.RandomState(3)
    ids = rng.randint(0, VOCAB - 1, (1, S)).astype(np.int32)
    mask = np.ones((1, S), np.int32)
    mask[0, :3] = 0
    mask[0, 8] = 0
    return ids, mask, np.array([[3, 5, 11, -1]], np.int32)


def _numpy_loss(w, cfg, ids, mask, anchors, feats, target_logits, gamma=4.0, loss_weights=(0.1, 0.9, 1.0)):
    """DeepSpec's loss (train/README.md, "Training a DSpark draft") in float64, block by block: -> (total, {ce, l1, conf})."""
    n_feat = len(IDS) * feats.shape[-1] // (len(IDS) + 1)
    num = {"ce": 0.0, "l1": 0.0, "conf": 0.0}
    den = 0.0
    for a in anchors[0]:
        if a < 0:
            continue
        labels = [int(ids[0, a + 1 + j]) if a + 1 + j < S else 0 for j in range(BK)]
        out = numpy_dspark(w, cfg, feats[0, :a, :n_feat], int(ids[0, a]), ctx_len=int(a), prev_tokens=labels[:-1])
        live = 1.0
        for j in range(BK):
            live *= float(a + 1 + j < S and mask[0, a + 1 + j] > 0)
            if not live:
                break
            wj = live * np.exp(-j / gamma)
            l = out["logits"][j] - out["logits"][j].max()
            p_d = np.exp(l) / np.exp(l).sum()
            t = target_logits[0, a + j].astype(np.float64)
            p_t = np.exp(t - t.max()) / np.exp(t - t.max()).sum()
            l1 = np.abs(p_d - p_t).sum()
            acc = np.clip(1 - 0.5 * l1, 0, 1)
            u = out["confidence_logits"][j]
            bce = -(acc * np.log(1 / (1 + np.exp(-u))) + (1 - acc) * np.log(1 - 1 / (1 + np.exp(-u))))
            num["ce"] += wj * -np.log(p_d[labels[j]])
            num["l1"] += wj * l1
            num["conf"] += wj * bce
            den += wj
    terms = {k: v / den for k, v in num.items()}
    return sum(c * terms[k] for c, k in zip(loss_weights, ("ce", "l1", "conf"))), terms


def test_loss_equals_numpy_and_skips_frozen_copies(small, tmp_path):
    """The loss of one row (rnn Markov head: its state carried through the teacher-forced walk) == NumPy; the
    gradient reaches the backbone and both heads, never the frozen embed_tokens / lm_head."""
    draft = make_dspark(small, head="rnn", rank=6, block=BK, ids=IDS)
    ids, mask, anchors = _batch()
    layer_ids = DO.feature_layer_ids(small.config, draft.config)
    feats = np.asarray(O.target_features(small.config, small.params, jnp.asarray(ids), layer_ids))
    pos = np.arange(S, dtype=np.int32)[None]
    target_logits = np.asarray(target_lib.forward(small.config, small.params, jnp.asarray(ids), pos)[0])

    def loss(p):
        s = DO.loss_sums(small.config, small.params, draft.config, p, jnp.asarray(ids), jnp.asarray(mask),
                         jnp.asarray(anchors), jnp.asarray(feats), weights=DO.slot_weights(BK, 4.0),
                         impl="reference", chunk=5)
        return s["wce"], s

    (_, sums), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(draft.params)
    D.save_draft(draft, str(tmp_path), dtype="float32")
    w, cfg = load_dspark_draft(str(tmp_path))
    want, terms = _numpy_loss(w, cfg, ids, mask, anchors, feats, target_logits)
    weight = float(sums["weight"])
    # anchor 3: labels 4..7 all live; 5: 6, 7 (8 is unsupervised, so 9 is cut too); 11: 12, 13 (the end)
    assert weight == pytest.approx(sum(np.exp(-j / 4) for j in range(4)) + 2 * (1 + np.exp(-1 / 4)))
    # the draft's logits (``loss_depth``) then the softmaxes and the weighted sums over the vocabulary and the slots
    rel = f32_rel(loss_depth(small.config, draft.config.layers, S, anchors.size * BK) + VOCAB)
    assert float(sums["wce"]) / weight == pytest.approx(want, rel=rel)
    for k, v in terms.items():
        assert float(sums[f"w_{k}"]) / weight == pytest.approx(v, rel=rel, abs=rel), k
    summary = O.summarize(sums)
    assert summary["loss_l1"] == pytest.approx(terms["l1"], rel=rel) and len(summary["acc_k"]) == BK
    norms = {k: float(sum(jnp.sum(jnp.abs(g)) for g in jax.tree_util.tree_leaves(v))) for k, v in grads.items()}
    assert norms["embed_tokens"] == norms["lm_head"] == 0.0
    assert all(norms[k] > 0 for k in ("fc", "layers_0", "markov_head", "confidence_head")), norms


def _blocks_alone_vs_together(tcfg, tparams, draft, ids, anchors):
    """draft_hidden over every block of ``anchors`` [1, N] at once, and over each block alone."""
    dcfg = draft.config
    bk = dcfg.block_size
    feats = O.target_features(tcfg, tparams, jnp.asarray(ids), tuple(dcfg.target_layer_ids))
    pos = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]
    k, v = D.context_kv(dcfg, draft.params, feats, pos)
    block_ids = jnp.asarray(O.make_blocks(jnp.asarray(ids), jnp.ones_like(jnp.asarray(ids)), jnp.asarray(anchors),
                                          bk, dcfg.mask_token_id)[0])
    hidden = jax.jit(lambda b, a: D.draft_hidden(tcfg, tparams, dcfg, draft.params, b, a, k, v, impl="reference"))
    together = hidden(block_ids, jnp.asarray(anchors))
    alone = [hidden(block_ids[:, i * bk:(i + 1) * bk], jnp.asarray(anchors[:, i:i + 1]))
             for i in range(anchors.shape[1])]
    return np.asarray(together), np.concatenate([np.asarray(a) for a in alone], axis=1)


def test_blocks_independent_dspark_and_dflash2(small):
    """Many anchored blocks in one training forward == each block run alone: for a DSpark draft, and for DFlash2,
    whose dynamic convolution pads each block (one padding the whole row would let a block's first position read
    the previous block's last)."""
    from test_draft import make_draft
    from test_draft_formats import DFLASH2

    ids, _, _ = _batch()
    anchors = np.array([[2, 5, 6, 10]], np.int32)  # overlapping and adjacent blocks
    drafts = {"dspark": make_dspark(small, head="rnn", rank=6, block=BK, ids=IDS),
              "dflash2": make_draft(small.config, layers=1, block=BK, ids=IDS, **DFLASH2)}
    for name, draft in drafts.items():
        together, alone = _blocks_alone_vs_together(small.config, small.params, draft, ids, anchors)
        depth = draft_depth(small.config, draft.config.layers, S, BK)
        assert_close(together, alone, depth, what=f"{name}: blocks together vs alone")


@pytest.fixture(scope="module")
def trained(small, tmp_path_factory):
    """A DSpark draft trained 24 steps on the target's own answers (train_briefly's recipe)."""
    root = str(tmp_path_factory.mktemp("dspark_train"))
    path = save_target(small, os.path.join(root, "target"))
    # unpacked: the 16-token vocabulary's answers stop early, and packed they would fill fewer rows than a batch
    draft, losses = train_briefly(path, small, root, steps=24, draft_arch="dspark", markov_rank=8,
                                  markov_head_type="gated", pack=False)
    return root, draft, losses


def test_short_run_trains_heads_keeps_copies_frozen(small, trained):
    root, draft, losses = trained
    assert draft.config.shifted and draft.config.markov_rank == 8 and draft.config.confidence_head
    tp = small.params
    np.testing.assert_array_equal(np.asarray(draft.params["embed_tokens"]["embedding"]),
                                  np.asarray(tp["embed_tokens"]["embedding"]))
    np.testing.assert_array_equal(np.asarray(draft.params["lm_head"]["kernel"]), np.asarray(tp["lm_head"]["kernel"]))
    init = D.init_draft_params(draft.config, 0)
    for name in ("fc", "layers_0", "markov_head", "confidence_head"):
        moved = [np.max(np.abs(np.asarray(a) - np.asarray(b))) for a, b in
                 zip(jax.tree_util.tree_leaves(draft.params[name]), jax.tree_util.tree_leaves(init[name]))]
        assert min(moved) > 0, name
    assert np.mean(losses[-4:]) < 0.8 * np.mean(losses[:4]), losses
    with open(os.path.join(root, "run", "metrics.jsonl")) as f:
        rec = [json.loads(line) for line in f][-1]
    assert {"loss_ce", "loss_l1", "loss_conf"} <= set(rec)
    assert rec["loss"] == pytest.approx(0.1 * rec["loss_ce"] + 0.9 * rec["loss_l1"] + rec["loss_conf"], rel=1e-5)


def test_export_reloads_bit_identical(small, trained, tmp_path):
    from train.export import export

    root, draft, _ = trained
    out = export(os.path.join(root, "run"), str(tmp_path / "export"), dtype="float32")
    with open(os.path.join(out, "config.json")) as f:
        hf = json.load(f)
    assert hf["architectures"] == ["Qwen3DSparkModel"] and "dflash_config" not in hf
    assert (hf["markov_rank"], hf["markov_head_type"], hf["enable_confidence_head"],
            hf["confidence_head_with_markov"], hf["num_anchors"]) == (8, "gated", True, True, 8)
    back = dj.load_draft(out)
    assert back.config == draft.config
    ctx, blk = np.array([[3, 5, 7, 2, 9]]), np.array([[4, VOCAB - 1, VOCAB - 1, VOCAB - 1]])
    np.testing.assert_array_equal(dj.draft_block_logits(small, back, ctx, blk),
                                  dj.draft_block_logits(small, draft, ctx, blk))
    export(os.path.join(root, "run"), out, dtype="float32")  # a previous export of the same run: overwritten
