"""Packed training rows (train/data.py packing, the objective's ``doc_start``): several sequences per row
train exactly as they would one per row, and never see each other."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.config import TargetConfig
from dflash_jax.drafts import DraftConfig
from dflash_jax.drafts.model import draft_param_shapes
from dflash_jax.layers import random_params
from dflash_jax.target import param_shapes
from train import objective as O
from train.data import TrainData, pack_sequences, padding_fraction
from tolerances import assert_close, assert_trees_close, forward_depth, loss_depth

BK, N, SEQ_LEN, LAYERS = 4, 4, 24, (1, 2, 3)
# (prompt, response) tokens of each sequence. Packed, sequences 3 and 1 follow others and start with a response
# token: what follows a document end is then supervised (unpacked: unsupervised padding), so a label not cut at
# the document end, or an anchor whose block starts in the next document, changes the loss.
LENS = [(3, 11), (0, 9), (4, 10), (0, 6)]
ROWS = [[0, 3], [2, 1]]  # 14 + 6 and 14 + 9 tokens


@pytest.fixture(scope="module")
def models():
    tcfg = TargetConfig("qwen3", 64, 32, 64, 4, 4, 2, 8, max_position_embeddings=128)
    layers = TargetConfig("qwen3", 64, 32, 64, 2, 4, 2, 8, max_position_embeddings=128)
    dcfg = DraftConfig(layers, BK, 4, 63, LAYERS)
    return tcfg, random_params(param_shapes(tcfg), 0), dcfg, random_params(draft_param_shapes(dcfg), 1, std=0.1)


def _data(rows):
    rng = np.random.RandomState(0)
    ids = [rng.randint(0, 60, p + r).astype(np.int32) for p, r in LENS]
    masks = [np.r_[np.zeros(p), np.ones(r)].astype(np.uint8) for p, r in LENS]
    return TrainData(ids, masks, [(0, i) for i in range(len(LENS))], SEQ_LEN, {}, rows)


def _step(models, impl):
    """jit(ids, mask, anchors, doc_start or None) -> (features, loss sums, gradients, block hidden)."""
    tcfg, tp, dcfg, dp = models
    w = O.position_weights(BK, 2.0)

    def run(ids, mask, anchors, starts):
        feats = O.target_features(tcfg, tp, ids, LAYERS, starts)

        def f(p):
            s = O.loss_sums(tcfg, tp, dcfg, p, ids, mask, anchors, feats, weights=w, impl=impl, doc_start=starts)
            return s["wce"], s

        (_, sums), grads = jax.value_and_grad(f, has_aux=True)(dp)
        blocks, _, _ = O.make_blocks(ids, mask, anchors, BK, dcfg.mask_token_id, starts)
        hidden = O.hidden_from_features(tcfg, tp, dcfg, dp, blocks, anchors, feats, impl=impl, doc_start=starts)
        return feats, sums, grads, hidden

    return jax.jit(run)


@pytest.fixture(scope="module")
def step(models):
    return _step(models, "reference")


def _offsets(data, seqs):
    """(row position, sequence index) of each sequence of a packed row."""
    at = 0
    for j in seqs:
        yield at, j
        at += len(data.ids[j])


def _packed_anchors(unpacked, data, width):
    """Each sequence's anchors moved to where the packed rows hold it (``width`` per row: room for all)."""
    out = np.full((data.num_rows, width), -1, np.int32)
    for r, seqs in enumerate(data.rows):
        a = [x + at for at, j in _offsets(data, seqs) for x in unpacked[j] if x >= 0]
        out[r, :len(a)] = a
    return out


def _sums_and_grads_close(got, want, models):
    """Loss sums within the loss's rounding (``loss_depth``), gradients within twice it (the path back), each
    relative to its own scale."""
    tcfg, _, dcfg, _ = models
    depth = loss_depth(tcfg, dcfg.layers, SEQ_LEN, N * BK)
    for key in want[0]:
        assert_close(got[0][key], want[0][key], depth, what=key)
    assert_trees_close(got[1], want[1], 2 * depth, what="grad")


def test_packed_loss_and_gradients_equal_unpacked(models, step):
    """Same sequences, every valid anchor (so blocks end at, and would cross, every document end): the anchors
    sampled on the packed rows are the unpacked ones moved, and features, loss sums and gradients are equal.
    Catches anchors crossing into the next document and labels not cut at a document end (train/objective.py)."""
    flat, packed = _data(None), _data(ROWS)
    ids_u, mask_u, starts_u = flat.batch(np.arange(4))
    assert starts_u is None
    anchors_u = np.asarray(O.sample_batch_anchors(0, 0, jnp.arange(4), jnp.asarray(mask_u), SEQ_LEN))
    assert (anchors_u >= 0).sum() == sum(r - 1 for _, r in LENS)  # all of them
    ids_p, mask_p, starts_p = packed.batch(np.arange(2))
    anchors_p = np.asarray(O.sample_batch_anchors(0, 0, jnp.arange(2), jnp.asarray(mask_p), SEQ_LEN,
                                                  jnp.asarray(starts_p)))
    np.testing.assert_array_equal(anchors_p, _packed_anchors(anchors_u, packed, SEQ_LEN))
    for r, seqs in enumerate(ROWS):  # what follows each row's first document is supervised
        assert mask_p[r, len(packed.ids[seqs[0]])] == 1 and starts_p[r, len(packed.ids[seqs[0]])] > 0
    fu, su, gu, _ = step(ids_u, mask_u, anchors_u, None)
    fp, sp, gp, _ = step(ids_p, mask_p, anchors_p, starts_p)
    tcfg = models[0]
    for r, seqs in enumerate(ROWS):
        for at, j in _offsets(packed, seqs):
            k = len(packed.ids[j])
            # features unchanged, up to the rounding of the same forward at another shape
            assert_close(fp[r, at:at + k], fu[j, :k], forward_depth(tcfg, SEQ_LEN), what=f"features {j}")
    _sums_and_grads_close((sp, gp), (su, gu), models)


def test_packed_loss_through_the_kernel(models, step):
    """The Pallas kernel (interpret mode) with the documents' context starts gives the reference's packed
    loss sums and gradients."""
    packed = _data(ROWS)
    ids, mask, starts = packed.batch(np.arange(2))
    anchors = np.asarray(O.sample_batch_anchors(0, 0, jnp.arange(2), jnp.asarray(mask), 2 * N, jnp.asarray(starts)))
    _, s_ref, g_ref, _ = step(ids, mask, anchors, starts)
    _, s_ker, g_ker, _ = _step(models, "interpret")(ids, mask, anchors, starts)
    _sums_and_grads_close((s_ker, g_ker), (s_ref, g_ref), models)


def test_perturbing_one_document_changes_nothing_in_the_others(step):
    packed = _data(ROWS)
    ids, mask, starts = packed.batch(np.arange(2))
    anchors = np.asarray(O.sample_batch_anchors(0, 0, jnp.arange(2), jnp.asarray(mask), 2 * N, jnp.asarray(starts)))
    f0, s0, _, h0 = step(ids, mask, anchors, starts)
    lo, hi = 16, 22  # sequence 3, the second of row 0
    bumped = ids.copy()
    bumped[0, lo:hi] = (bumped[0, lo:hi] + 1) % 60
    f1, s1, _, h1 = step(bumped, mask, anchors, starts)
    assert np.abs(f1[0, lo:hi] - f0[0, lo:hi]).max() > 1e-3
    np.testing.assert_array_equal(f1[0, :lo], f0[0, :lo])
    np.testing.assert_array_equal(f1[1], f0[1])
    inside = (anchors[0] >= lo) & (anchors[0] < hi)
    assert inside.any() and (~inside & (anchors[0] >= 0)).any()
    h0, h1 = (np.asarray(h).reshape(2, 2 * N, BK, -1) for h in (h0, h1))
    np.testing.assert_array_equal(h1[0][~inside], h0[0][~inside])
    np.testing.assert_array_equal(h1[1], h0[1])


def test_anchors_and_labels_stay_inside_their_document():
    mask = jnp.array([0, 1, 1, 1, 1, 1, 1, 0])
    starts = jnp.array([0, 0, 0, 0, 4, 4, 4, 7])  # documents 0..3, 4..6, padding 7
    # 3 would need x[4] of the next document; 6 is its document's last token
    assert O.valid_anchor_positions(mask, starts).astype(int).tolist() == [0, 1, 1, 0, 1, 1, 0, 0]
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(10))
    drawn = np.asarray(jax.vmap(lambda k: O.sample_anchors(k, mask, 3, starts))(keys))
    assert set(drawn.ravel()) <= {1, 2, 4, 5}
    ids = jnp.arange(10, 18)[None]
    _, _, lm = O.make_blocks(ids, mask[None], jnp.array([[2, 4]]), 3, 63, starts[None])
    assert lm[0].astype(int).tolist() == [[0, 1, 0], [0, 1, 1]]  # block at 2 stops at its document's end
    assert O.block_ctx_start(jnp.array([[2, 5, -1]]), starts[None]).tolist() == [[0, 4, 0]]


def test_pack_sequences_fits_every_sequence_once_and_is_deterministic():
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(5.5, 0.9, 500).astype(int) + 4, 1024).tolist()
    rows = pack_sequences(lengths, 1024)
    assert sorted(i for r in rows for i in r) == list(range(500))
    assert all(sum(lengths[i] for i in r) <= 1024 for r in rows)
    assert rows == pack_sequences(lengths, 1024)
    before, after = padding_fraction(sum(lengths), 500, 1024), padding_fraction(sum(lengths), len(rows), 1024)
    assert after < 0.05 < 0.5 < before


def test_packed_batches_rows_and_summary():
    data = _data(ROWS)
    ids, mask, starts = data.batch(np.array([[1], [0]]))
    assert ids.shape == mask.shape == starts.shape == (2, 1, SEQ_LEN)
    assert starts[0, 0].tolist() == [0] * 14 + [14] * 9 + [23]
    np.testing.assert_array_equal(ids[0, 0, 14:23], data.ids[1])
    assert data.tokens([0, 1]) == sum(p + r for p, r in LENS)
    assert data.packing_summary() == "packed 4 sequences into 2 rows of 24: padding 55% -> 10%"
