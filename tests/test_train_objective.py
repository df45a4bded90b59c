"""The DFlash training objective (train/objective.py): anchors, blocks, labels, weights, and the mask.

The mask tests are the ones public trainers have got wrong: a block must
never see its own anchor's target feature or any later context, nor another block (blocks overlap
in position). They perturb the inputs and check which blocks' logits move.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.config import TargetConfig
from dflash_jax.drafts import DraftConfig
from dflash_jax.drafts.model import draft_param_shapes
from dflash_jax import target as target_lib
from dflash_jax.layers import random_params
from dflash_jax.target import param_shapes
from train import objective as O
from train.config import TrainConfig, default_gamma
from tolerances import EPS32, f32_rel, loss_depth

MASK = 63
BK = 4


@pytest.fixture(scope="module")
def models():
    tcfg = TargetConfig("qwen3", 64, 32, 64, 4, 4, 2, 8, max_position_embeddings=128)
    layers = TargetConfig("qwen3", 64, 32, 64, 2, 4, 2, 8, max_position_embeddings=128)
    dcfg = DraftConfig(layers, BK, 4, MASK, (1, 2, 3))
    # numpy-drawn parameters: Flax's eager init compiles every op (seconds on a busy 2-core CPU)
    return tcfg, random_params(param_shapes(tcfg), 0), dcfg, random_params(draft_param_shapes(dcfg), 1, std=0.1)


# --- anchors, blocks, labels, weights (hand-worked) ---------------------------------------------------


def test_valid_anchor_positions():
    m = jnp.array([0, 0, 1, 1, 1, 0, 1, 1])
    # a qualifies iff m[a] and m[a+1]; the last position never does
    assert O.valid_anchor_positions(m).tolist() == [0, 0, 1, 1, 0, 0, 1, 0]


def test_sample_anchors_valid_distinct_sorted_padded():
    m = jnp.array([0, 0, 1, 1, 1, 0, 1, 1])
    key = jax.random.PRNGKey(0)
    assert O.sample_anchors(key, m, 6).tolist() == [2, 3, 6, -1, -1, -1]  # fewer valid than N: pad
    assert O.sample_anchors(key, m, 12).tolist() == [2, 3, 6] + [-1] * 9  # N > S
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(20))
    draws = {tuple(d) for d in jax.jit(jax.vmap(lambda k: O.sample_anchors(k, m, 2)))(keys).tolist()}
    assert all(len(set(d)) == 2 and set(d) <= {2, 3, 6} and list(d) == sorted(d) for d in draws)
    assert len(draws) > 1  # random subsets
    assert O.sample_anchors(jnp.zeros(2, jnp.uint32), jnp.zeros(8, jnp.int32), 3).tolist() == [-1, -1, -1]


def test_anchors_reproducible_per_seed_epoch_example():
    mask = jnp.ones((3, 64), jnp.int32)
    idx = jnp.array([5, 6, 7])
    draw = jax.jit(O.sample_batch_anchors, static_argnums=(0, 4))
    a = draw(0, 0, idx, mask, 8)
    assert (a == draw(0, 0, idx, mask, 8)).all()  # resume-exact
    assert not (a == draw(0, 1, idx, mask, 8)).all()  # re-drawn every epoch
    assert not (a == draw(1, 0, idx, mask, 8)).all()  # seed
    # an example's anchors do not depend on its batch neighbours
    assert (draw(0, 0, idx[::-1], mask, 8) == a[::-1]).all()


def test_make_blocks_hand_worked():
    ids = jnp.arange(10, 20)[None]  # x[p] = 10 + p, S = 10
    mask = jnp.array([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1]])  # 3 prompt tokens
    # anchor at 0 (prompt), overlapping blocks at 3 and 5, near the end at 8, a padding block
    anchors = jnp.array([[0, 3, 5, 8, -1]])
    block, labels, lm = O.make_blocks(ids, mask, anchors, BK, MASK)
    M = MASK
    assert block.tolist() == [[10, M, M, M, 13, M, M, M, 15, M, M, M, 18, M, M, M, M, M, M, M]]
    assert labels[0].tolist() == [[10, 11, 12, 13], [13, 14, 15, 16], [15, 16, 17, 18], [18, 19, 0, 0],
                                  [0, 0, 0, 0]]
    assert lm[0].astype(int).tolist() == [
        [0, 0, 0, 1],  # anchor 0: labels x1, x2 are prompt tokens (masked), x3 is supervised
        [0, 1, 1, 1],  # k = 0 is never a label (the anchor is given)
        [0, 1, 1, 1],
        [0, 1, 0, 0],  # runs past the end of the sequence
        [0, 0, 0, 0]]  # padding block
    mask_end = mask.at[0, 7:].set(0)  # response ends at 6, padding after: labels past it masked
    _, _, lm2 = O.make_blocks(ids, mask_end, anchors, BK, MASK)
    assert lm2[0, 2].astype(int).tolist() == [0, 1, 0, 0]


def test_position_weights_and_gamma():
    w = O.position_weights(4, 2.0)
    np.testing.assert_allclose(w, [0.0, 1.0, math.exp(-0.5), math.exp(-1.0)], rtol=8 * EPS32)  # one float32 exp
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)
    assert default_gamma(4) == 2.0 and default_gamma(2) == 1.0 and abs(default_gamma(32) - 37 / 3) < 1e-9
    assert default_gamma(9) == 4.5 and abs(default_gamma(12) - 17 / 3) < 1e-9
    assert TrainConfig(block_size=16).gamma_value == 7.0 and TrainConfig(block_size=8, gamma=2.5).gamma_value == 2.5


# --- the mask: what each block can see ------------------------------------------------------------------


S = 12
ANCHORS = [0, 3, 5, 8]  # anchor 0 sees no context; blocks 3..6 and 5..8 overlap


@pytest.fixture(scope="module")
def logits_fn(models):
    tcfg, tp, dcfg, dp = models
    fn = jax.jit(lambda ids, anchors, feats: draft_logits(tcfg, tp, dcfg, dp, ids, anchors, feats))
    rng = np.random.RandomState(0)
    ids = jnp.asarray(rng.randint(0, 60, (1, S)), jnp.int32)
    feats = jnp.asarray(rng.randn(1, S, 3 * 32), jnp.float32)
    anchors = jnp.array([ANCHORS], jnp.int32)
    return fn, ids, feats, anchors, fn(ids, anchors, feats)


def draft_logits(tcfg, tp, dcfg, dp, ids, anchors, feats):
    """Full logits [B, N, Bk, V] of every block (the training forward, through the target head)."""
    block_ids, _, _ = O.make_blocks(ids, jnp.ones_like(ids), anchors, dcfg.block_size, dcfg.mask_token_id)
    h = O.hidden_from_features(tcfg, tp, dcfg, dp, block_ids, anchors, feats, impl="reference")
    return target_lib.head(tcfg, tp, h).reshape(*anchors.shape, dcfg.block_size, -1)


def draft_loss(tcfg, tp, dcfg, dp, ids, mask, anchors, feats, *, weights, impl="auto", chunk=1024, dtype=None):
    """The weighted loss of one micro-batch, normalised by its total weight (the trainer's normalisation
    when there is one micro-batch)."""
    sums = O.loss_sums(tcfg, tp, dcfg, dp, ids, mask, anchors, feats, weights=weights, impl=impl, chunk=chunk,
                       dtype=dtype)
    return sums["wce"] / jnp.maximum(sums["weight"], 1e-12), sums


def _changed(base, new):
    """Per block: did any logit move at all? (The same program on the same visible inputs rounds identically.)"""
    return [bool(np.any(np.asarray(new[0, b]) != np.asarray(base[0, b]))) for b in range(len(ANCHORS))]


@pytest.mark.parametrize("pos", range(S))
def test_block_sees_only_context_before_its_anchor(logits_fn, pos):
    """Perturbing the target feature at ``pos`` moves exactly the blocks with anchor > pos: a block never
    sees its own anchor's feature (that would leak x[a+1]) nor anything later."""
    fn, ids, feats, anchors, base = logits_fn
    new = fn(ids, anchors, feats.at[0, pos].add(3.0))
    assert _changed(base, new) == [a > pos for a in ANCHORS]


def test_blocks_do_not_see_each_other(logits_fn):
    """Changing block 2's anchor token (x[5], also inside block 1's span 3..6) moves block 2 only."""
    fn, ids, feats, anchors, base = logits_fn
    new = fn(ids.at[0, 5].set((ids[0, 5] + 1) % 60), anchors, feats)
    assert _changed(base, new) == [False, False, True, False]


def test_blocks_do_not_depend_on_other_anchors(logits_fn):
    """Moving block 3's anchor does not change blocks 0..2 (visibility is by position, per block)."""
    fn, ids, feats, anchors, base = logits_fn
    new = fn(ids, anchors.at[0, 3].set(10), feats)
    assert _changed(base, new)[:3] == [False, False, False]


# --- the loss ------------------------------------------------------------------------------------------


def test_loss_is_weighted_ce_normalised_by_total_weight(models, logits_fn):
    tcfg, tp, dcfg, dp = models
    fn, ids, feats, anchors, logits = logits_fn
    mask = jnp.array([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0]])  # prompt 0..1, response 2..9, padding after
    w = O.position_weights(BK, 2.0)
    padded = jnp.concatenate([anchors, jnp.full((1, 3), -1, jnp.int32)], axis=1)

    @jax.jit
    def variants(ids, mask, anchors, padded, feats):
        run = lambda a, chunk: draft_loss(tcfg, tp, dcfg, dp, ids, mask, a, feats, weights=w, chunk=chunk,  # noqa
                                            impl="reference")
        return run(anchors, 5), run(anchors, 1024)[0], run(padded, 5)

    (loss, sums), loss2, (loss3, s3) = variants(ids, mask, anchors, padded, feats)
    lp = jax.nn.log_softmax(np.asarray(logits), -1)[0]
    num = den = 0.0
    for b, a in enumerate(ANCHORS):
        for k in range(1, BK):
            p = a + k
            if p < S and mask[0, p]:
                num += w[k] * -float(lp[b, k, int(ids[0, p])])
                den += w[k]
    n = len(ANCHORS) * (BK - 1)  # loss terms
    # the loss's own forward against the logits' (other programs): the loss's rounding, relative
    rel = f32_rel(loss_depth(tcfg, dcfg.layers, S, n))
    assert float(loss) == pytest.approx(float(num / den), rel=rel)
    # n positive weights summed in two orders: each within (n - 1) eps / 2 of the exact sum
    assert float(sums["weight"]) == pytest.approx(float(den), rel=(n - 1) * EPS32)
    # chunking the lm_head / cross-entropy reorders the head's reduction, the logsumexp and the sum over tokens
    assert float(loss2) == pytest.approx(float(loss), rel=f32_rel(tcfg.hidden_size + tcfg.vocab_size + n))
    # padding blocks add nothing (the forward at another shape: its rounding)
    assert float(loss3) == pytest.approx(float(loss), rel=rel)
    assert float(s3["weight"]) == pytest.approx(float(den), rel=(n - 1) * EPS32)
    m = O.summarize(sums)
    assert len(m["acc_k"]) == BK - 1 and 0 <= m["acc"] <= 1 and m["tau_proxy"] >= 1


def test_gradient_reaches_only_draft_params_and_respects_mask(models):
    """Loss gradients flow into fc / hidden_norm / layers / norm; the loss of block b does not depend on
    features at positions >= a_b (gradient exactly zero there)."""
    tcfg, tp, dcfg, dp = models
    rng = np.random.RandomState(1)
    ids = jnp.asarray(rng.randint(0, 60, (1, S)), jnp.int32)
    feats = jnp.asarray(rng.randn(1, S, 96), jnp.float32)
    anchors = jnp.array([[4]], jnp.int32)
    w = O.position_weights(BK, 2.0)

    def f(p, x):
        return draft_loss(tcfg, tp, dcfg, p, ids, jnp.ones_like(ids), anchors, x, weights=w, impl="reference")[0]

    gp, gx = jax.jit(jax.grad(f, argnums=(0, 1)))(dp, feats)
    assert set(gp) == {"fc", "hidden_norm", "layers_0", "layers_1", "norm"}
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree_util.tree_leaves(gp))
    gx = np.abs(np.asarray(gx[0])).max(-1)
    assert (gx[:4] > 0).all() and (gx[4:] == 0).all()
