"""The DSpark training objective (DeepSpec's; docs/training.md, "Training a DSpark draft"), beside the DFlash one
(``train/objective.py``), whose anchors, packing, target features and block attention it reuses.

For a sequence x[0:S) with loss mask m, anchors a as DFlash's (m[a] = m[a+1] = 1, within a document):

* block b = [x[a_b], MASK * (B-1)] at positions a_b .. a_b+B-1, embedded with the draft's OWN (frozen) embedding;
  the same block attention (context strictly before the anchor, its own block bidirectionally, never another).
* shifted labels: slot j (0..B-1) predicts y_j = x[a_b + 1 + j]; eval_mask_j = (label inside the sequence /
  document) & m[label] & (a real block), then a cumulative product along j (a contiguous prefix).
* the Markov head is teacher-forced: slot j's previous token is [x[a_b], y_0 .. y_{B-2}][j]
  (``draft.spark(..., prev=...)``); l'_j its corrected logits, p_d = softmax(l'_j), u_j the confidence logit.
* p_t: the target's own next-token distribution at position a_b + j (its prediction of y_j, temperature 1):
  its final-normed last hidden state there (the feature of layer L-1, which the target forward returns after
  the final norm) through its head, block by block, so the [S, V] logits of the whole row never exist.
* with w_j = eval_mask_j exp(-j/gamma) (gamma 4):
  L = ce_w CE(l', y) + l1_w ||p_d - p_t||_1 + conf_w BCEWithLogits(u, a),  a_j = clamp(1 - ||p_d - p_t||_1 / 2, 0, 1)
  (stop-gradient), each term sum_j w_j term_j / sum_j w_j (one shared denominator: the sums below add up
  over micro-batches exactly as the DFlash objective's).

The draft's embed_tokens / lm_head are copies of the target's and frozen (as a Gemma 4 draft's layer scalars, which
DeepSpec keeps at 1): ``loss_sums`` stops their gradient, and ``train.optim.make_optimizer(frozen=FROZEN)`` leaves
them out of the update.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.drafts import model as draft_lib
from dflash_jax import target as target_lib
from dflash_jax.drafts import DraftConfig
from train import objective
from train.optim import is_frozen

# the draft's copies of the target's embedding and head; a Gemma 4 draft's layer scalars (a buffer of ones in DeepSpec)
FROZEN = ("embed_tokens", "lm_head", "layer_scalar")


def feature_layer_ids(tcfg, dcfg: DraftConfig) -> tuple[int, ...]:
    """The target layers whose outputs a DSpark step reads: the draft's ``target_layer_ids``, then the last layer
    (its output after the final norm: what the target's head reads, for p_t)."""
    return tuple(dcfg.target_layer_ids) + (tcfg.num_hidden_layers - 1,)


def slot_weights(block_size: int, gamma: float):
    """[B] float32 exp(-j/gamma), slot j 0-based: the DFlash weights of labels 1..B after the anchor."""
    return objective.position_weights(block_size + 1, gamma)[1:]


def frozen_copies(params, dtype=None):
    """``params`` with the frozen leaves (``train.optim.is_frozen`` of ``FROZEN``) under stop_gradient (and all cast
    to ``dtype``)."""
    def stop(path, x):
        return jax.lax.stop_gradient(x) if is_frozen(path, FROZEN) else x

    return jax.tree_util.tree_map_with_path(stop, objective.cast_tree(params, dtype))


def make_dspark_blocks(input_ids, loss_mask, anchors, block_size: int, mask_token_id: int, doc_start=None):
    """-> block_ids [b, N*B], labels [b, N, B] (y_j = x[a + 1 + j]), eval_mask [b, N, B] bool (a prefix).

    ``objective.make_blocks`` over B + 1 positions gives the labels at offsets 1..B and their masks (inside the
    sequence and document, supervised, a real block); the block is its first B positions."""
    b = input_ids.shape[0]
    block, labels, label_mask = objective.make_blocks(input_ids, loss_mask, anchors, block_size + 1, mask_token_id,
                                                      doc_start)
    block = block.reshape(b, -1, block_size + 1)[..., :block_size].reshape(b, -1)
    keep = jnp.cumprod(label_mask[..., 1:].astype(jnp.int32), axis=-1) > 0
    return block, labels[..., 1:], keep


def slot_terms(tcfg, tparams, dcfg: DraftConfig, dparams, h, t_hidden, anchor, labels, chunk: int):
    """Per slot of M blocks: draft hidden h [M, B, D], the target's final-normed hidden at the same positions
    t_hidden [M, B, D], ``anchor`` [M], labels [M, B] -> (CE, L1, BCE, correct) each [M, B] (BCE 0 without a
    confidence head), ``chunk`` blocks at a time under ``jax.checkpoint`` (the [blocks, B, V] logits of draft and
    target exist one chunk at a time, recomputed in the backward pass)."""
    m, bk, d = h.shape
    c = max(1, min(chunk, m))
    pad = -m % c
    split = lambda x: jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)).reshape(-1, c, *x.shape[1:])  # noqa: E731
    xs = tuple(split(x) for x in (h, t_hidden, anchor, labels))

    @jax.checkpoint
    def one(hc, tc, ac, yc):
        base = draft_lib.logits(tcfg, tparams, dcfg, dparams, hc)  # [c, B, V] through the draft's own head
        _, scores, u = draft_lib.spark(dcfg, dparams, hc, base, ac, prev=yc[:, :-1], confidence_logits=True)
        log_pd = jax.nn.log_softmax(scores, axis=-1)
        p_t = jax.nn.softmax(target_lib.logits(tcfg, tparams, tc).astype(jnp.float32), axis=-1)
        ce = -jnp.take_along_axis(log_pd, yc[..., None], axis=-1)[..., 0]
        l1 = jnp.sum(jnp.abs(jnp.exp(log_pd) - p_t), axis=-1)
        if u is None:
            bce = jnp.zeros_like(ce)
        else:
            a = jax.lax.stop_gradient(jnp.clip(1.0 - 0.5 * l1, 0.0, 1.0))
            bce = jax.nn.softplus(u) - a * u  # BCEWithLogits(u, a)
        return ce, l1, bce, jnp.argmax(scores, axis=-1) == yc

    _, out = jax.lax.scan(lambda carry, x: (carry, one(*x)), None, xs)
    return tuple(o.reshape(-1, bk)[:m] for o in out)


# positional: the target's and the draft's (config, params), then the batch's arrays (every draft function's order)
def loss_sums(tcfg, tparams, dcfg: DraftConfig, dparams, input_ids, loss_mask, anchors, features, *, weights,
              loss_weights=(0.1, 0.9, 1.0), impl: str = "auto", chunk: int = 1024, dtype=None, doc_start=None) -> dict:
    """Unnormalised sums of one micro-batch, ``objective.loss_sums``'s keys (``wce``: the total weighted loss
    sum_j w_j (ce_w CE + l1_w L1 + conf_w BCE), ``weight``: sum_j w_j; ``correct_k`` / ``count_k`` [B + 1] by
    offset from the anchor, 0 at the anchor; ``accepted`` / ``blocks``: the teacher-forced greedy prefix) plus
    ``w_ce`` / ``w_l1`` / ``w_conf``, each term's weighted sum. ``features`` [b, S, (n + 1) D]: the draft's
    target features, then the target's last layer (``feature_layer_ids``); ``weights`` [B] (``slot_weights``);
    ``loss_weights`` (ce_w, l1_w, conf_w); ``chunk``: tokens per chunk of the logits."""
    bk = dcfg.block_size
    b, n = anchors.shape
    dparams = frozen_copies(dparams, dtype or features.dtype)
    block_ids, labels, keep = make_dspark_blocks(input_ids, loss_mask, anchors, bk, dcfg.mask_token_id, doc_start)
    d = features.shape[-1] // (dcfg.num_features + 1)
    h = objective.hidden_from_features(tcfg, tparams, dcfg, dparams, block_ids, anchors, features[..., :-d],
                                       impl=impl, dtype=dtype, doc_start=doc_start)
    s = features.shape[1]
    pos = jnp.clip(jnp.maximum(anchors, 0)[..., None] + jnp.arange(bk), 0, s - 1)  # [b, N, B]: p_t of y_j at a + j
    t_hidden = jnp.take_along_axis(features[..., -d:], pos.reshape(b, -1)[..., None], axis=1).astype(h.dtype)
    ce, l1, bce, correct = slot_terms(tcfg, tparams, dcfg, dparams, h.reshape(b * n, bk, -1),
                                      t_hidden.reshape(b * n, bk, -1), block_ids.reshape(b * n, bk)[:, 0],
                                      labels.reshape(b * n, bk), max(1, chunk // bk))
    ce, l1, bce, correct = (x.reshape(b, n, bk) for x in (ce, l1, bce, correct))
    maskf = keep.astype(jnp.float32)
    w = jnp.asarray(weights, jnp.float32) * maskf
    ce_w, l1_w, conf_w = loss_weights
    correct = correct & keep
    run = jnp.cumprod(correct.astype(jnp.int32), axis=-1)
    has_block = keep[..., 0]
    offset = lambda x: jnp.concatenate([jnp.zeros((1,), x.dtype), x])  # noqa: E731  (index k: label a + k)
    sums = {"w_ce": jnp.sum(w * ce), "w_l1": jnp.sum(w * l1), "w_conf": jnp.sum(w * bce)}
    return {
        "wce": ce_w * sums["w_ce"] + l1_w * sums["w_l1"] + conf_w * sums["w_conf"],
        "weight": jnp.sum(w),
        "ce": jnp.sum(maskf * ce),
        "tokens": jnp.sum(maskf),
        "correct_k": offset(jnp.sum(correct.astype(jnp.float32), axis=(0, 1))),
        "count_k": offset(jnp.sum(maskf, axis=(0, 1))),
        "accepted": jnp.sum(jnp.where(has_block[..., None], run, 0).astype(jnp.float32)),
        "blocks": jnp.sum(has_block.astype(jnp.float32)),
        **sums,
    }
