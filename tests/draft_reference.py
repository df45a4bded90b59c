"""An independent NumPy statement of the DFlash draft forward (v1 under the newest rules, and DFlash2),
written from the published layout and formulas (README, "Draft formats"), over the exported checkpoint tensors."""
from __future__ import annotations

import numpy as np


def _rms(x, w, eps=1e-6):
    return w * x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def _rope(x, pos, theta):
    h = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, h, 2) / h)
    ang = pos[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    rot = np.concatenate([-x[..., h // 2:], x[..., : h // 2]], -1)
    return x * cos[:, None] + rot * sin[:, None]


def _conv(x, dyn, base, group_size):
    """conv(x, d, b)[t, c] = sum_o (b[o, c] + d[t, o, c // gs]) x[t - o, c]; x before position 0 is 0."""
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for o in range(base.shape[0]):
            if t - o >= 0:
                out[t] += (base[o] + np.repeat(dyn[t, o], group_size)) * x[t - o]
    return out


def _conv_prepare(w, name, x, cfg):
    k, gs = cfg.conv_kernel_size, cfg.conv_group_size
    dyn = (x @ w[f"{name}.kernel_projection.weight"].T).reshape(x.shape[0], 2, k, -1)
    base = w[f"{name}.base_kernel"]
    return _conv(x, dyn[:, 0], base[0], gs), lambda z: _conv(z, dyn[:, 1], base[1], gs)


def visible(cfg, i, q_pos, k_pos):
    """The newest reference's mask of draft layer i: all; causal adds j <= p; a window p - j < W (and
    j - p < W when not causal)."""
    vis = np.ones((len(q_pos), len(k_pos)), bool)
    causal = cfg.is_causal if cfg.is_causal is not None else cfg.layers.layer_types[i] == "sliding_attention"
    if causal:
        vis &= k_pos[None] <= q_pos[:, None]
    if cfg.layers.layer_types[i] == "sliding_attention":
        w = cfg.layers.sliding_window
        vis &= q_pos[:, None] - k_pos[None] < w
        if not causal:
            vis &= k_pos[None] - q_pos[:, None] < w
    return vis


def numpy_draft(w, cfg, features, raw_emb, lm_head, ctx_len):
    """features [T, n*D] (target hidden_states[id+1]), raw_emb [L, D] the target's table rows of the block
    -> (draft logits [L, V] after multiplier / soft cap, final-normed hidden [L, D])."""
    c = cfg.layers
    nh, kv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    ctx = _rms(features @ w["fc.weight"].T, w["hidden_norm.weight"])
    x = raw_emb.astype(np.float64) * cfg.input_embedding_scale
    L = x.shape[0]
    q_pos = ctx_len + np.arange(L)
    k_pos = np.concatenate([np.arange(ctx_len), q_pos])
    two = cfg.architecture == "dflash2"
    for i in range(c.num_hidden_layers):
        p = lambda n: w[f"layers.{i}.{n}"]  # noqa: E731
        h = _rms(x, p("input_layernorm.weight"))
        if two:
            h, finish = _conv_prepare(w, f"layers.{i}.attention_conv", h, cfg)
        q = _rms((h @ p("self_attn.q_proj.weight").T).reshape(L, nh, hd), p("self_attn.q_norm.weight"))
        both = np.concatenate([ctx, h])  # the context skips input_layernorm (and the convolution)
        k = _rms((both @ p("self_attn.k_proj.weight").T).reshape(-1, kv, hd), p("self_attn.k_norm.weight"))
        v = (both @ p("self_attn.v_proj.weight").T).reshape(-1, kv, hd)
        q, k = _rope(q, q_pos, c.rope.theta), _rope(k, k_pos, c.rope.theta)
        k, v = np.repeat(k, nh // kv, axis=1), np.repeat(v, nh // kv, axis=1)
        s = np.einsum("qnh,knh->nqk", q, k) / np.sqrt(hd)
        s = np.where(visible(cfg, i, q_pos, k_pos)[None], s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        o = np.einsum("nqk,knh->qnh", a, v).reshape(L, nh * hd) @ p("self_attn.o_proj.weight").T
        x = x + (finish(o) if two else o)
        h = _rms(x, p("post_attention_layernorm.weight"))
        if two:
            h, finish = _conv_prepare(w, f"layers.{i}.mlp_conv", h, cfg)
        g, u = h @ p("mlp.gate_proj.weight").T, h @ p("mlp.up_proj.weight").T
        m = (g / (1 + np.exp(-g)) * u) @ p("mlp.down_proj.weight").T
        x = x + (finish(m) if two else m)
    hidden = _rms(x, w["norm.weight"])
    logits = hidden @ lm_head.T * cfg.output_multiplier
    if cfg.final_logit_softcapping:
        logits = cfg.final_logit_softcapping * np.tanh(logits / cfg.final_logit_softcapping)
    return logits, hidden


def numpy_select_scores(w, cfg, hidden, logits, pred, t):
    """Walk scores at block position t (rows of hidden / logits: positions 1..) after token ``pred``:
    (candidates [k], scores [k])."""
    cand = np.argsort(-logits[t], kind="stable")[:cfg.selector_top_k]
    u = w["candidate_selector.hidden_projection.weight"] @ hidden[t]
    a = w["candidate_selector.predecessor_codebook"][pred]
    return cand, logits[t, cand] + (w["candidate_selector.successor_codebook"][cand] * (a * u)).sum(-1)


def numpy_select_greedy(w, cfg, hidden, logits, anchor):
    """The greedy candidate-selector walk from ``anchor`` over positions 1.. -> token per position."""
    out, pred = [], anchor
    for t in range(hidden.shape[0]):
        cand, s = numpy_select_scores(w, cfg, hidden, logits, pred, t)
        pred = int(cand[np.argmax(s)])
        out.append(pred)
    return np.array(out)
