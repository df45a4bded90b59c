"""The DFlash training objective: random anchors, masked blocks, weighted block cross-entropy.

For a sequence x[0:S) with loss mask m (1 on the response):

* anchors: N positions a with m[a] = m[a+1] = 1, drawn without replacement from a PRNG key derived
  from (seed, epoch, example index) -- re-drawn every epoch, reproducible on resume. Fewer valid
  positions than N: the rest are padding blocks (anchor -1, every label masked).
* block b = [x[a_b], MASK * (B-1)] at positions a_b .. a_b+B-1, embedded with the target's frozen
  embedding. The draft sees the context K/V of the target features F[0:S) (``context_kv`` at
  positions 0..S-1) through ``block_attention``: block b sees context positions < a_b only (never
  the anchor's own feature, never anything later; that is what makes the task the inference task)
  and its own block bidirectionally, never another block (blocks may overlap in position).
* labels: block position k (1..B-1) predicts x[a_b + k] -- same position, no shift. A label is
  masked when a_b + k >= S or m[a_b + k] = 0 (blocks may run past the response end).
* loss = sum_k w_k CE_k / sum of the weights of the unmasked labels, w_k = exp(-(k-1)/gamma):
  early block positions matter most (a miss at k ends the accepted prefix).
* packed rows (``doc_start`` [B, S]: where each token's document starts in the row; None: one
  sequence per row) hold several documents: anchors and labels stay inside a document, the target
  runs causally within each one (positions restarting at 0), and a block sees only the context of its
  own document, doc_start <= p < anchor. The same sequences with the same anchors give the same loss
  sums packed or not (the draft's RoPE is relative, so its packed-row positions change nothing).

Logits go through the target's frozen lm_head (or tied embedding) in chunks of ``chunk`` tokens
under ``jax.checkpoint``, so the [tokens, vocab] logits never exist whole (N*B*vocab floats per
sequence would be 5 GB for Qwen3 with N=512, B=16).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.drafts import model as draft_lib
from dflash_jax import target as target_lib
from dflash_jax.drafts import DraftConfig


# --- anchors, blocks, labels ------------------------------------------------------------------------


def anchor_key(seed: int, epoch, example_index):
    """The PRNG key of one example's anchors in one epoch (traceable in epoch / example_index)."""
    key = jax.random.PRNGKey(seed)
    return jax.random.fold_in(jax.random.fold_in(key, epoch), example_index)


def _next(x, fill):
    """x[..., a + 1] at a (``fill`` past the end)."""
    return jnp.concatenate([x[..., 1:], jnp.full_like(x[..., :1], fill)], axis=-1)


def valid_anchor_positions(loss_mask, doc_start=None):
    """[..., S] -> bool [..., S]: m[a] and m[a+1], a+1 in a's document (the last position never qualifies)."""
    m = loss_mask.astype(bool)
    valid = m & _next(m, False)
    return valid if doc_start is None else valid & (_next(doc_start, -1) == doc_start)


def sample_anchors(key, loss_mask, num_anchors: int, doc_start=None):
    """One row: loss_mask [S] (doc_start [S] or None) -> anchors [N] int32, sorted, distinct, valid ones
    first, -1 padding; the N anchors of a packed row are shared by its documents."""
    s = loss_mask.shape[-1]
    valid = valid_anchor_positions(loss_mask, doc_start)
    score = jnp.where(valid, jax.random.uniform(key, (s,)), -1.0)
    k = min(num_anchors, s)
    top, idx = jax.lax.top_k(score, k)
    anchors = jnp.where(top >= 0, idx, s)  # invalid -> s, sorts last
    anchors = jnp.sort(anchors)
    anchors = jnp.where(anchors >= s, -1, anchors).astype(jnp.int32)
    if num_anchors > k:
        anchors = jnp.concatenate([anchors, jnp.full((num_anchors - k,), -1, jnp.int32)])
    return anchors


def sample_batch_anchors(seed: int, epoch, example_indices, loss_mask, num_anchors: int, doc_start=None):
    """[B] example indices, [B, S] loss masks (and doc starts) -> anchors [B, N] (keys from (seed, epoch, index))."""
    keys = jax.vmap(lambda i: anchor_key(seed, epoch, i))(example_indices)
    return jax.vmap(lambda k, m, d: sample_anchors(k, m, num_anchors, d))(keys, loss_mask, doc_start)


def make_blocks(input_ids, loss_mask, anchors, block_size: int, mask_token_id: int, doc_start=None):
    """-> block_ids [B, N*Bk] ([x[a], MASK...] per block), labels [B, N, Bk], label_mask [B, N, Bk] (bool).

    labels[b, n, k] = x[a_n + k]; the mask is off at k = 0 (the anchor is given), for padding
    blocks, past the sequence (document) end and where the loss mask is 0.
    """
    b, s = input_ids.shape
    k = jnp.arange(block_size, dtype=jnp.int32)
    pos = anchors[..., None] + k  # [B, N, Bk]
    inside = (anchors[..., None] >= 0) & (pos < s)
    safe = jnp.clip(pos, 0, s - 1)
    rows = jnp.arange(b)[:, None, None]
    if doc_start is not None:
        inside &= doc_start[rows, safe] == doc_start[rows, jnp.maximum(anchors, 0)[..., None]]
    tokens = input_ids[rows, safe]
    labels = jnp.where(inside, tokens, 0)
    label_mask = inside & (loss_mask[rows, safe] > 0) & (k >= 1)
    first = jnp.where(anchors >= 0, tokens[..., 0], mask_token_id)
    block = jnp.where(k == 0, first[..., None], jnp.int32(mask_token_id)).astype(jnp.int32)
    return block.reshape(b, -1), labels, label_mask


def position_weights(block_size: int, gamma: float) -> np.ndarray:
    """[Bk] float32: 0 for the anchor (k = 0), exp(-(k-1)/gamma) for k >= 1."""
    w = [0.0] + [math.exp(-(k - 1) / gamma) for k in range(1, block_size)]
    return np.asarray(w, np.float32)


# --- forward pieces -------------------------------------------------------------------------------------


def target_features(tcfg, tparams, input_ids, layer_ids: tuple[int, ...], doc_start=None):
    """Frozen target forward: [B, S] ids -> features [B, S, n*D] (outputs of ``layer_ids``), no gradient;
    with ``doc_start`` causal within each document, at positions counted from its start.

    Logits are taken at one position only (the features are all we need)."""
    b, s = input_ids.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    if doc_start is not None:
        positions = positions - doc_start
    _, feats, _ = target_lib.forward(tcfg, tparams, input_ids, positions, None, tuple(layer_ids),
                                     jnp.zeros((b,), jnp.int32), segment_ids=doc_start)
    return jax.lax.stop_gradient(feats)


def cast_tree(tree, dtype):
    if dtype is None:
        return tree
    return jax.tree_util.tree_map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def block_ctx_start(anchors, doc_start):
    """[B, N] start of each block's document (0 for padding blocks): its context lower bound."""
    return jnp.where(anchors >= 0, jnp.take_along_axis(doc_start, jnp.maximum(anchors, 0), axis=1), 0)


# positional: the target's and the draft's (config, params), then the batch's arrays (every draft function's order)
def hidden_from_features(tcfg, tparams, dcfg: DraftConfig, dparams, block_ids, anchors, features, *, impl: str = "auto",
                         dtype=None, doc_start=None):
    """``dflash_jax.drafts.model.draft_hidden`` in the compute ``dtype`` (default: the features'), the context K/V
    computed from ``features`` [B, S, n*D] at positions 0..S-1; with ``doc_start`` each block sees only
    its own document's context."""
    dtype = dtype or features.dtype
    dparams = cast_tree(dparams, dtype)
    features = features.astype(dtype)
    b, s = features.shape[:2]
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    k_ctx, v_ctx = draft_lib.context_kv(dcfg, dparams, features, positions)
    ctx_start = None if doc_start is None else block_ctx_start(anchors, doc_start)
    return draft_lib.draft_hidden(tcfg, tparams, dcfg, dparams, block_ids, anchors, k_ctx, v_ctx, impl=impl,
                                  ctx_start=ctx_start)


def chunked_cross_entropy(tcfg, tparams, dcfg: DraftConfig, hidden, labels, chunk: int):
    """hidden [M, D], labels [M] -> (CE [M] float32, correct [M] bool) through the draft's logits (the target
    head, then the draft's multiplier / soft cap), ``chunk`` rows at a time; the chunk's logits are
    recomputed in the backward pass."""
    m, d = hidden.shape
    c = max(1, min(chunk, m))
    pad = -m % c
    h = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(-1, c, d)
    y = jnp.pad(labels, (0, pad)).reshape(-1, c)
    @jax.checkpoint
    def one(hc, yc):
        logits = draft_lib.logits(tcfg, tparams, dcfg, None, hc)  # the target head: DFlash v1 drafts only
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, yc[:, None], axis=-1)[:, 0]
        return lse - picked, jnp.argmax(logits, axis=-1) == yc

    _, (ce, correct) = jax.lax.scan(lambda carry, xs: (carry, one(*xs)), None, (h, y))
    return ce.reshape(-1)[:m], correct.reshape(-1)[:m]


# --- the loss ------------------------------------------------------------------------------------------


# positional: the target's and the draft's (config, params), then the batch's arrays (every draft function's order)
def loss_sums(tcfg, tparams, dcfg: DraftConfig, dparams, input_ids, loss_mask, anchors, features,
              *, weights, impl: str = "auto", chunk: int = 1024, dtype=None, doc_start=None) -> dict:
    """Unnormalised sums of one micro-batch (so micro-batches add up exactly; ``doc_start``: packed rows):

    ``wce`` sum of w_k CE over unmasked labels, ``weight`` sum of their w_k, ``ce``/``tokens`` plain
    CE sum and label count, ``correct_k``/``count_k`` [Bk] per-position hits and labels,
    ``accepted``/``blocks``: leading correct predictions summed over blocks whose k=1 label exists
    (a training-time proxy of the acceptance length: tau ~ 1 + accepted / blocks).
    """
    bk = dcfg.block_size
    block_ids, labels, label_mask = make_blocks(input_ids, loss_mask, anchors, bk, dcfg.mask_token_id, doc_start)
    h = hidden_from_features(tcfg, tparams, dcfg, dparams, block_ids, anchors, features, impl=impl, dtype=dtype,
                             doc_start=doc_start)
    ce, correct = chunked_cross_entropy(tcfg, tparams, dcfg, h.reshape(-1, h.shape[-1]), labels.reshape(-1), chunk)
    ce = ce.reshape(labels.shape)
    correct = correct.reshape(labels.shape) & label_mask
    maskf = label_mask.astype(jnp.float32)
    w = jnp.asarray(weights, jnp.float32) * maskf
    run = jnp.cumprod(correct[..., 1:].astype(jnp.int32), axis=-1)  # leading hits from k = 1
    has_block = label_mask[..., 1]
    return {
        "wce": jnp.sum(w * ce),
        "weight": jnp.sum(w),
        "ce": jnp.sum(maskf * ce),
        "tokens": jnp.sum(maskf),
        "correct_k": jnp.sum(correct.astype(jnp.float32), axis=(0, 1)),
        "count_k": jnp.sum(maskf, axis=(0, 1)),
        "accepted": jnp.sum(jnp.where(has_block[..., None], run, 0).astype(jnp.float32)),
        "blocks": jnp.sum(has_block.astype(jnp.float32)),
    }


def summarize(sums: dict) -> dict:
    """Sums (possibly added over micro-batches) -> loss and readable metrics (host floats); ``acc_k[i]``: the
    accuracy on labels i + 1 tokens after the anchor."""
    s = jax.device_get(sums)
    weight = max(float(s["weight"]), 1e-12)
    count = np.maximum(np.asarray(s["count_k"]), 1)
    acc = (np.asarray(s["correct_k"]) / count)[1:]
    blocks = max(float(s["blocks"]), 1.0)
    # a DSpark objective's terms (train/dspark_objective.py), each weighted as the loss
    terms = {f"loss_{k}": float(s[f"w_{k}"]) / weight for k in ("ce", "l1", "conf") if f"w_{k}" in s}
    return {"loss": float(s["wce"]) / weight, **terms, "ce": float(s["ce"]) / max(float(s["tokens"]), 1.0),
            "acc": float(np.asarray(s["correct_k"])[1:].sum() / max(float(s["tokens"]), 1.0)),
            "acc_k": [round(float(a), 4) for a in acc],
            "tau_proxy": 1.0 + float(s["accepted"]) / blocks,
            "label_tokens": int(s["tokens"])}
