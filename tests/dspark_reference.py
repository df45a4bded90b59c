"""An independent NumPy statement of DeepSpec's DSpark draft (shifted prediction, Markov head, confidence head) and
its temperature-0 evaluation loop, plus a writer of tiny DSpark checkpoints in DeepSpec's on-disk layout; written
from the published rules (DeepSpec at afdfa7c: its DSpark modeling, Markov head and evaluation loop), to test dflash_jax's implementation against.

Conventions (docs/models.md, "DSpark"): a block is B slots [anchor, mask x (B-1)] at positions p..p+B-1 right
after the context (positions ..p-1); EVERY slot j produces logits and slot j predicts the token at p+j+1, so a
block gives B drafts and the target verifies B+1 tokens [anchor, y_0..y_{B-1}]. Slot j's previous token x_j is the
anchor for j = 0 and the drafted (greedy) token of slot j-1 after it.
"""
from __future__ import annotations

import copy
import json
import os

import numpy as np

from draft_reference import _rms, _rope

HEAD_TYPES = ("vanilla", "gated", "rnn")


# ----------------------------------------------------------------------------------------------- checkpoint


def _load_target_tensors(target_dir) -> dict[str, np.ndarray]:
    """Every tensor of a Hugging Face checkpoint (one model.safetensors or an index of shards) as float32 numpy
    (through torch, so a bf16 target loads too)."""
    from safetensors.torch import load_file

    index = os.path.join(target_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for name in files:
        out.update({k: v.float().numpy() for k, v in load_file(os.path.join(target_dir, name)).items()})
    return out


def _validate_target_layer_ids(ids, num_target_layers):
    """DeepSpec's rule (M/common.py:59-75): non-empty, strictly increasing, each -1 (embeddings) or in [0, L-1]."""
    ids = [int(i) for i in ids]
    if not ids:
        raise ValueError("target_layer_ids must not be empty")
    for a, b in zip(ids, ids[1:]):
        if b <= a:
            raise ValueError(f"target_layer_ids must be strictly increasing, got {ids}")
    for i in ids:
        if not (i == -1 or 0 <= i < num_target_layers):
            raise ValueError(f"target_layer_id {i} out of {{-1}} U [0, {num_target_layers - 1}]")
    return ids


def is_gemma4(cfg) -> bool:
    """A ``Gemma4DSparkModel`` draft config (section 7)."""
    return "Gemma4DSparkModel" in (cfg.get("architectures") or ())


def dims(cfg) -> dict[str, int]:
    """The sizes of section 1.3's notation from a (draft or target) config dict; a Gemma 4 draft's attention is
    the full layers' (section 7): hd = global_head_dim, KV = num_global_key_value_heads with attention_k_eq_v,
    else num_key_value_heads."""
    d, h = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    hd, kv = int(cfg.get("head_dim") or d // h), int(cfg["num_key_value_heads"])
    if is_gemma4(cfg):
        hd = int(cfg["global_head_dim"])
        kv = int(cfg["num_global_key_value_heads"]) if cfg.get("attention_k_eq_v") else kv
    return dict(V=int(cfg["vocab_size"]), d=d, H=h, KV=kv, hd=hd, I=int(cfg["intermediate_size"]),
                n=len(cfg["target_layer_ids"]), r=int(cfg.get("markov_rank", 0)), N=int(cfg["num_hidden_layers"]))


def expected_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Every tensor name of a DSpark checkpoint with this draft config -> its shape (section 1.3; [out, in]
    Linear layout, no prefix)."""
    s = dims(cfg)
    d, r, hd, q, kv = s["d"], s["r"], s["hd"], s["H"] * s["hd"], s["KV"] * s["hd"]
    out = {"embed_tokens.weight": (s["V"], d), "lm_head.weight": (s["V"], d), "fc.weight": (d, s["n"] * d),
           "hidden_norm.weight": (d,), "norm.weight": (d,)}
    for i in range(s["N"]):
        p = f"layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
                    p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
                    p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                    p + "mlp.gate_proj.weight": (s["I"], d), p + "mlp.up_proj.weight": (s["I"], d),
                    p + "mlp.down_proj.weight": (d, s["I"]),
                    p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)})
        if is_gemma4(cfg):  # sandwich norms and the layer scalar; k = v: no v_proj
            out.update({p + "pre_feedforward_layernorm.weight": (d,), p + "post_feedforward_layernorm.weight": (d,),
                        p + "layer_scalar": (1,)})
            if cfg.get("attention_k_eq_v"):
                del out[p + "self_attn.v_proj.weight"]
        if cfg.get("attention_bias"):
            out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                        p + "self_attn.o_proj.bias": (d,)})
            if p + "self_attn.v_proj.weight" in out:
                out[p + "self_attn.v_proj.bias"] = (kv,)
    if r > 0:
        out.update({"markov_head.markov_w1.weight": (s["V"], r), "markov_head.markov_w2.weight": (s["V"], r)})
        kind = str(cfg["markov_head_type"]).lower()
        if kind == "gated":
            out.update({"markov_head.gate_proj.weight": (r, d + r), "markov_head.gate_proj.bias": (r,)})
        elif kind == "rnn":
            out.update({"markov_head.joint_proj.weight": (3 * r, 2 * r + d), "markov_head.joint_proj.bias": (3 * r,)})
    if cfg.get("enable_confidence_head"):
        width = d + r if cfg.get("confidence_head_with_markov") else d
        out.update({"confidence_head.proj.weight": (1, width), "confidence_head.proj.bias": (1,)})
    return out


def gemma4_text_config(target_cfg: dict) -> dict:
    """Section 7's start of ``build_draft_config`` for Gemma 4: a copy of the target's text config (the VL layout's
    ``text_config``, or a text-only config) with ``target_model_type`` / ``target_text_model_type``, and the full
    layers' sizes as DeepSpec's pinned transformers writes them (``global_head_dim``,
    ``num_global_key_value_heads``) where a newer one wrote a ``per_layer_config``. MoE blocks and per-layer
    inputs are refused (DeepSpec's layer asserts them off)."""
    text = copy.deepcopy(target_cfg.get("text_config", target_cfg))
    text["target_model_type"] = str(target_cfg["model_type"])
    text["target_text_model_type"] = str(text.get("model_type", "gemma4_text"))
    per_layer = text.pop("per_layer_config", None)
    if per_layer:
        full = next(iter(dict(per_layer).values()))
        text["global_head_dim"] = int(full["head_dim"])
        if text.get("attention_k_eq_v"):
            text["num_global_key_value_heads"] = int(full["num_key_value_heads"])
    if text.get("enable_moe_block") or int(text.get("hidden_size_per_layer_input", 256)):
        raise ValueError("DeepSpec's Gemma 4 DSpark layers support neither MoE blocks nor per-layer inputs")
    return text


def dspark_config(target_cfg: dict, *, num_layers=2, block_size=4, target_layer_ids=(0, 2), mask_token_id=None,
                  markov_rank=8, markov_head_type="vanilla", confidence=True, confidence_with_markov=True,
                  num_anchors=512) -> dict:
    """DeepSpec's ``build_draft_config`` (M/qwen3/config.py:9-56) on a target config.json dict, as
    ``save_pretrained`` writes it (``_attn_implementation`` is not serialised)."""
    markov_rank = int(markov_rank)
    if markov_rank < 0:
        raise ValueError(f"markov_rank must be >= 0, got {markov_rank}")
    if markov_rank > 0 and str(markov_head_type).lower() not in HEAD_TYPES:
        raise ValueError(f"unsupported markov_head_type {markov_head_type!r}")
    if confidence and confidence_with_markov and markov_rank == 0:  # Qwen3DSparkModel asserts this (:259-260)
        raise ValueError("confidence_with_markov needs a Markov head (markov_rank > 0)")
    cfg, arch = copy.deepcopy(target_cfg), "Qwen3DSparkModel"
    cfg.pop("dflash_config", None)
    if str(target_cfg.get("model_type", "")).startswith("gemma4"):
        cfg, arch = gemma4_text_config(target_cfg), "Gemma4DSparkModel"
    num_target = int(cfg["num_hidden_layers"])
    cfg.update(architectures=[arch], num_target_layers=num_target, num_hidden_layers=int(num_layers),
               block_size=int(block_size), tie_word_embeddings=False, layer_types=["full_attention"] * int(num_layers),
               mask_token_id=int(target_cfg["vocab_size"] - 1 if mask_token_id is None else mask_token_id),
               target_layer_ids=_validate_target_layer_ids(target_layer_ids, num_target),
               num_anchors=int(num_anchors), enable_confidence_head=bool(confidence), markov_rank=markov_rank)
    for key in ("confidence_head_with_markov", "markov_head_type"):
        cfg.pop(key, None)
    if confidence:
        cfg["confidence_head_with_markov"] = bool(confidence_with_markov)
    if markov_rank > 0:
        cfg["markov_head_type"] = str(markov_head_type)
    for key in ("dtype", "torch_dtype"):  # the tensors written here are float32 (DeepSpec's own are bf16)
        if key in cfg:
            cfg[key] = "float32"
    return cfg


def write_dspark_draft(path, target_dir, *, num_layers=2, block_size=4, target_layer_ids=(0, 2), mask_token_id=None,
                       markov_rank=8, markov_head_type="vanilla", confidence=True, confidence_with_markov=True,
                       seed=0) -> dict[str, np.ndarray]:
    """Write a random DSpark draft of the Qwen3 or Gemma 4 target in ``target_dir`` to ``path`` as DeepSpec saves one:
    config.json (``dspark_config``: the target's config with the DSpark keys, no dflash_config) and one
    float32 model.safetensors holding exactly ``expected_shapes``' tensors (no prefix), embed_tokens / lm_head
    copied from the target (lm_head = the embedding when the target ties them). Returns the tensors as float64
    numpy arrays keyed by name.

    Scales: matrices N(0, 0.05^2) (fc 0.05 / sqrt(n)), norms 1 + N(0, 0.1^2), biases N(0, 0.02^2); the Markov
    bias W2 W1[x] has about half the base logits' spread and the confidence logit a spread of ~1.5, so both move
    argmaxes / cross thresholds in some slots but not all."""
    with open(os.path.join(target_dir, "config.json")) as f:
        target_cfg = json.load(f)
    cfg = dspark_config(target_cfg, num_layers=num_layers, block_size=block_size, target_layer_ids=target_layer_ids,
                        mask_token_id=mask_token_id, markov_rank=markov_rank, markov_head_type=markov_head_type,
                        confidence=confidence, confidence_with_markov=confidence_with_markov)
    src = _load_target_tensors(target_dir)
    embed = src[next(k for k in ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight") if k in src)]
    lm_head = embed if target_cfg.get("tie_word_embeddings") or "lm_head.weight" not in src else src["lm_head.weight"]
    # the base logits' per-token spread: how big the Markov bias must be to matter
    logit_scale = float(np.linalg.norm(lm_head, axis=1).mean())
    rng = np.random.default_rng(seed)
    s = dims(cfg)
    tensors = {}
    for name, shape in expected_shapes(cfg).items():
        if name == "embed_tokens.weight":
            t = embed
        elif name == "lm_head.weight":
            t = lm_head
        elif name.endswith("norm.weight"):
            t = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith("layer_scalar"):  # a buffer of ones in DeepSpec: drawn here, so a dropped one shows
            t = rng.uniform(0.5, 1.5, shape)
        elif name == "fc.weight":
            t = 0.05 / np.sqrt(s["n"]) * rng.standard_normal(shape)
        elif name == "markov_head.markov_w1.weight":
            t = rng.standard_normal(shape)
        elif name == "markov_head.markov_w2.weight":  # bias entries ~ logit_scale / 2 * N(0, 1)
            t = 0.5 * logit_scale / np.sqrt(s["r"]) * rng.standard_normal(shape)
        elif name.startswith("markov_head."):  # gate / joint projections: pre-activations of order 1
            t = (rng.standard_normal(shape) / np.sqrt(shape[-1] / 2) if name.endswith("weight")
                 else 0.1 * rng.standard_normal(shape))
        elif name == "confidence_head.proj.weight":
            t = 1.5 / np.sqrt(shape[1]) * rng.standard_normal(shape)
        elif name == "confidence_head.proj.bias":
            t = 0.5 + 0.2 * rng.standard_normal(shape)
        elif name.endswith("bias"):
            t = 0.02 * rng.standard_normal(shape)
        else:
            t = 0.05 * rng.standard_normal(shape)
        tensors[name] = np.ascontiguousarray(t, dtype=np.float32)
    save_dspark_draft(path, cfg, tensors)
    return {k: v.astype(np.float64) for k, v in tensors.items()}


def save_dspark_draft(path, cfg: dict, tensors: dict[str, np.ndarray]) -> None:
    """config.json (as transformers writes one: indent 2, sorted keys) + model.safetensors (float32, metadata
    format pt) in ``path``; the tensors must be exactly ``expected_shapes(cfg)``."""
    from safetensors.numpy import save_file

    want = expected_shapes(cfg)
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    if got != want:
        raise ValueError(f"tensors do not match the config: {sorted(set(got.items()) ^ set(want.items()))}")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()},
              os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def load_dspark_draft(path) -> tuple[dict[str, np.ndarray], dict]:
    """(float64 tensors, config dict) of a checkpoint ``save_dspark_draft`` wrote."""
    from safetensors.numpy import load_file

    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    return {k: v.astype(np.float64) for k, v in load_file(os.path.join(path, "model.safetensors")).items()}, cfg


# ----------------------------------------------------------------------------------------------- forward


def rope_theta(cfg) -> float:
    """``rope_theta`` (transformers 4.x) or ``rope_parameters.rope_theta`` (5.x); only the default RoPE."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise NotImplementedError(f"rope_type {kind!r}")
    theta = cfg.get("rope_theta", params.get("rope_theta"))
    if theta is None:
        raise ValueError("the config has no rope_theta")
    return float(theta)


def _linear(w, name, x):
    y = x @ w[name + ".weight"].T
    return y + w[name + ".bias"] if name + ".bias" in w else y


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _block_inputs(w, cfg, features, block_ids, ctx_len, embed_scale=1.0):
    """(ctx = hidden_norm(fc(features)), the block's embeddings x embed_scale, query positions, key positions): the
    context rows are positions ctx_len-T..ctx_len-1 (ctx_len None -> T), the block ctx_len..ctx_len+B-1."""
    features = np.asarray(features, np.float64)
    T = features.shape[0]
    ctx_len = T if ctx_len is None else int(ctx_len)
    if ctx_len < T:
        raise ValueError(f"ctx_len {ctx_len} < {T} context rows")
    ctx = _rms(features @ w["fc.weight"].T, w["hidden_norm.weight"], float(cfg["rms_norm_eps"]))
    x = w["embed_tokens.weight"][np.asarray(block_ids)] * embed_scale
    q_pos = ctx_len + np.arange(x.shape[0])
    return ctx, x, q_pos, np.concatenate([np.arange(ctx_len - T, ctx_len), q_pos])


def _attention(q, k, v, scale):
    """softmax(scale q . k) v, no mask: q [B, nh, hd], k / v [S, kv, hd] (head j uses kv head j // (nh/kv)) ->
    [B, nh*hd]."""
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    a = np.einsum("qnh,knh->nqk", q, k) * scale
    a = np.exp(a - a.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    return np.einsum("nqk,knh->qnh", a, v).reshape(q.shape[0], -1)


def backbone(w, cfg, features, block_ids, ctx_len=None) -> np.ndarray:
    """DFlash v1's backbone (section 2): block ids [B] at positions ctx_len..ctx_len+B-1 over the context
    ``features`` [T, n*d] (the rows of positions ctx_len-T..ctx_len-1) -> the final-normed hidden h [B, d].
    Every layer's keys / values are k_norm(k_proj([ctx; x])) / v_proj([ctx; x]) with ctx = hidden_norm(fc(features))
    (the same for every layer, skipping input_layernorm); queries q_norm(q_proj(x)); RoPE (neox) at the absolute
    positions; GQA; scale hd^-0.5; no mask (bidirectional over context + block)."""
    s, eps = dims(cfg), float(cfg["rms_norm_eps"])
    if cfg.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(cfg["hidden_act"])
    nh, kv, hd = s["H"], s["KV"], s["hd"]
    theta = rope_theta(cfg)
    ctx, x, q_pos, k_pos = _block_inputs(w, cfg, features, block_ids, ctx_len)
    for i in range(s["N"]):
        p = f"layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        q = _rms(_linear(w, p + "self_attn.q_proj", h).reshape(-1, nh, hd), w[p + "self_attn.q_norm.weight"], eps)
        both = np.concatenate([ctx, h])
        k = _rms(_linear(w, p + "self_attn.k_proj", both).reshape(-1, kv, hd), w[p + "self_attn.k_norm.weight"], eps)
        v = _linear(w, p + "self_attn.v_proj", both).reshape(-1, kv, hd)
        o = _attention(_rope(q, q_pos, theta), _rope(k, k_pos, theta), v, hd ** -0.5)
        x = x + _linear(w, p + "self_attn.o_proj", o)
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        g = h @ w[p + "mlp.gate_proj.weight"].T
        x = x + (g * _sigmoid(g) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return _rms(x, w["norm.weight"], eps)


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def full_rope_inv_freq(cfg) -> np.ndarray:
    """A Gemma 4 draft's inverse frequencies [hd/2] (section 7): ``rope_parameters.full_attention`` over hd =
    global_head_dim; "proportional": theta^(-2i/hd) / factor for i < floor(partial_rotary_factor * hd / 2), 0 after
    (unrotated); "default": theta^(-2i/hd) for all i."""
    rope, hd = cfg["rope_parameters"]["full_attention"], int(cfg["global_head_dim"])
    kind, theta = rope.get("rope_type", "default"), float(rope["rope_theta"])
    inv = theta ** (-np.arange(0, hd, 2) / hd)
    if kind == "proportional":
        inv[int(float(rope.get("partial_rotary_factor", 1.0)) * hd // 2):] = 0.0
        inv /= float(rope.get("factor", 1.0))
    elif kind != "default":
        raise NotImplementedError(f"rope_type {kind!r}")
    return inv


def _rope_with(x, pos, inv):
    """neox (rotate-half) RoPE of x [T, heads, hd] at positions [T] with inverse frequencies [hd/2]."""
    ang = np.concatenate([pos[:, None] * inv[None]] * 2, -1)
    h = x.shape[-1]
    rot = np.concatenate([-x[..., h // 2:], x[..., : h // 2]], -1)
    return x * np.cos(ang)[:, None] + rot * np.sin(ang)[:, None]


def gemma4_backbone(w, cfg, features, block_ids, ctx_len=None) -> np.ndarray:
    """A Gemma 4 DSpark draft's backbone (section 7), as ``backbone``'s arguments. The block's embedding times
    sqrt(d); per layer: h = input_layernorm(x); q = q_norm(q_proj(h)); over [ctx; h] kr = k_proj, K = k_norm(kr),
    V = v_norm(kr) (attention_k_eq_v) or v_norm(v_proj), v_norm without weight; RoPE (``full_rope_inv_freq``) on q
    and K; scale 1.0; x += post_attention_layernorm(o_proj(attn)); x += post_feedforward_layernorm(
    mlp(pre_feedforward_layernorm(x))) with the GeLU-tanh gate; x *= layer_scalar. Every norm w * x / rms(x)."""
    s, eps = dims(cfg), float(cfg["rms_norm_eps"])
    nh, kv, hd = s["H"], s["KV"], s["hd"]
    inv = full_rope_inv_freq(cfg)
    ctx, x, q_pos, k_pos = _block_inputs(w, cfg, features, block_ids, ctx_len, np.sqrt(s["d"]))
    for i in range(s["N"]):
        p = f"layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        q = _rms(_linear(w, p + "self_attn.q_proj", h).reshape(-1, nh, hd), w[p + "self_attn.q_norm.weight"], eps)
        both = np.concatenate([ctx, h])
        kr = _linear(w, p + "self_attn.k_proj", both).reshape(-1, kv, hd)
        vr = kr if cfg.get("attention_k_eq_v") else _linear(w, p + "self_attn.v_proj", both).reshape(-1, kv, hd)
        k, v = _rms(kr, w[p + "self_attn.k_norm.weight"], eps), _rms(vr, 1.0, eps)
        o = _attention(_rope_with(q, q_pos, inv), _rope_with(k, k_pos, inv), v, 1.0)
        x = x + _rms(_linear(w, p + "self_attn.o_proj", o), w[p + "post_attention_layernorm.weight"], eps)
        h = _rms(x, w[p + "pre_feedforward_layernorm.weight"], eps)
        m = (_gelu_tanh(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T))
        x = x + _rms(m @ w[p + "mlp.down_proj.weight"].T, w[p + "post_feedforward_layernorm.weight"], eps)
        x = x * w[p + "layer_scalar"]
    return _rms(x, w["norm.weight"], eps)


def base_logits(w, cfg, hidden) -> np.ndarray:
    """lm_head(h), then cap * tanh(logits / cap) when the config sets ``final_logit_softcapping`` (Gemma 4)."""
    out = hidden @ w["lm_head.weight"].T
    cap = cfg.get("final_logit_softcapping")
    return cap * np.tanh(out / cap) if cap else out


def markov_step(w, cfg, h, prev, state):
    """One slot's Markov bias (section 3): (bias [V] or zeros without a head, new rnn state or None).
    vanilla: W2 e; gated: W2 (sigmoid(Wg [h; e] + bg) * e); rnn: [a; c; o] = J [s; e; h] + bJ,
    s' = sigmoid(a) s + (1 - sigmoid(a)) tanh(c), bias W2 tanh(o) (o of this step, not s')."""
    r = int(cfg.get("markov_rank", 0))
    if r == 0:
        return np.zeros(w["lm_head.weight"].shape[0]), None
    e = w["markov_head.markov_w1.weight"][int(prev)]
    w2 = w["markov_head.markov_w2.weight"]
    kind = str(cfg["markov_head_type"]).lower()
    if kind == "vanilla":
        return w2 @ e, None
    if kind == "gated":
        gate = _sigmoid(_linear(w, "markov_head.gate_proj", np.concatenate([h, e])))
        return w2 @ (gate * e), None
    if kind == "rnn":
        s = np.zeros(r) if state is None else state
        a, c, o = np.split(_linear(w, "markov_head.joint_proj", np.concatenate([s, e, h])), 3)
        g = _sigmoid(a)
        return w2 @ np.tanh(o), g * s + (1.0 - g) * np.tanh(c)
    raise ValueError(f"unsupported markov_head_type {kind!r}")


def confidence_logit(w, cfg, h, prev):
    """u_j = proj([h_j; W1[x_j]]) with confidence_head_with_markov, else proj(h_j); None without the head."""
    if not cfg.get("enable_confidence_head"):
        return None
    feats = h
    if cfg.get("confidence_head_with_markov"):
        feats = np.concatenate([h, w["markov_head.markov_w1.weight"][int(prev)]])
    return float(_linear(w, "confidence_head.proj", feats)[0])


def confident_length(confidence, threshold, block_size=None) -> int:
    """Section 4's proposal length L (draft_ops.py:82-93): threshold <= 0 -> B; else the first slot j with
    c_j < threshold (per-slot, not cumulative), or B when none is. ``confidence`` None (no head) -> B
    (``block_size`` then required)."""
    if confidence is None:
        if block_size is None:
            raise ValueError("block_size is needed without a confidence head")
        return int(block_size)
    c = np.asarray(confidence, np.float64)
    if threshold <= 0.0:
        return len(c)
    below = np.nonzero(c < threshold)[0]
    return int(below[0]) if below.size else len(c)


def numpy_dspark(w, cfg, features, anchor, ctx_len=None, prev_tokens=None, threshold=None) -> dict:
    """One DSpark block in float64. ``features`` [T, n*d]: the target's hidden_states[id+1] concatenated in
    target_layer_ids order for the context (positions ctx_len-T..ctx_len-1; ctx_len None -> T, so positions
    0..T-1); ``anchor``: the block's first token; the block [anchor, mask x (B-1)] sits at positions
    ctx_len..ctx_len+B-1. ``prev_tokens`` None: greedy, x_j = argmax of slot j-1's corrected logits; else the
    B-1 tokens x_1..x_{B-1} (teacher forcing).

    Returns a dict: hidden [B, d], base_logits [B, V] (``base_logits``), logits [B, V] (corrected: base + Markov
    bias), tokens [B] (argmax of each slot's corrected logits, first index on ties), prev [B] (the x_j used),
    confidence [B] (sigmoid of the head's logit; None without the head), confidence_logits [B] (or None); with
    ``threshold`` also proposal_length (``confident_length``)."""
    B = int(cfg["block_size"])
    block = np.full(B, int(cfg["mask_token_id"]), np.int64)
    block[0] = int(anchor)
    hidden = (gemma4_backbone if is_gemma4(cfg) else backbone)(w, cfg, features, block, ctx_len)
    base = base_logits(w, cfg, hidden)
    if prev_tokens is not None:
        prev_tokens = [int(t) for t in prev_tokens]
        if len(prev_tokens) != B - 1:
            raise ValueError(f"prev_tokens must hold B-1 = {B - 1} tokens, got {len(prev_tokens)}")
    logits, tokens, prev, conf = np.empty_like(base), np.empty(B, np.int64), np.empty(B, np.int64), []
    x, state = int(anchor), None
    for j in range(B):
        prev[j] = x
        bias, state = markov_step(w, cfg, hidden[j], x, state)
        logits[j] = base[j] + bias
        tokens[j] = int(np.argmax(logits[j]))
        conf.append(confidence_logit(w, cfg, hidden[j], x))
        x = int(tokens[j]) if prev_tokens is None or j == B - 1 else prev_tokens[j]
    u = None if conf[0] is None else np.array(conf)
    out = dict(hidden=hidden, base_logits=base, logits=logits, tokens=tokens, prev=prev,
               confidence=None if u is None else _sigmoid(u), confidence_logits=u)
    if threshold is not None:
        out["proposal_length"] = confident_length(out["confidence"], threshold, B)
    return out


# ----------------------------------------------------------------------------------------------- loop


def dspark_greedy_decode(target_forward, w, cfg, prompt, max_new_tokens, stop_ids=(), threshold=0.0):
    """DeepSpec's evaluation loop (section 5; E/base_evaluator.py:307-441, E/dspark/evaluator.py) at temperature 0,
    batch 1, with a full target forward per round. ``target_forward(ids)`` -> (logits [T, V], features [T, n*d]
    of hidden_states[id+1]) for a causal target over ``ids``.

    - Prefill: the first new token is the target's argmax after the prompt; if it is a stop token, the output
      ends there with no rounds.
    - Each round (while start < prompt + max_new_tokens; start = the anchor's position): the draft proposes from
      the features of positions 0..start-1 and the anchor output[start]; L = confident_length(c, threshold);
      the target runs [anchor, y_0..y_{L-1}] at start..start+L; y_i is accepted while it equals the target's
      argmax at the previous position; n = the accepted count. A stop token among the accepted drafts cuts n to
      end at it: no bonus, the round records n, the loop ends. Otherwise the bonus is the target's argmax at
      verify row n (at T=0 also the residual's), the round records n+1, start += n+1, and a stop token among the
      new tokens ends the loop.
    - The block is never shrunk near the limit (DeepSpec's loop, not z-lab's): the output is trimmed to at most
      prompt + max_new_tokens tokens, then just past its first stop token after the prompt.

    Returns (output_ids: list[int], prompt included; acceptance_lengths: list[int], one per round). Counting:
    the LAST round's entry is DeepSpec's uncut n+1 (or n), even where the trim drops some of its tokens, so
    1 + sum(acceptance_lengths) >= the number of new tokens, with equality unless the limit cut the last round.
    The prefill's token has no entry."""
    B = int(cfg["block_size"])
    stop = {int(t) for t in stop_ids}
    out = [int(t) for t in prompt]
    P = len(out)
    max_length = P + int(max_new_tokens)
    logits, feats = target_forward(np.array(out, np.int64))
    out.append(int(np.argmax(np.asarray(logits)[-1])))
    acceptance = []
    if out[-1] in stop:
        return out, acceptance
    feats = np.asarray(feats, np.float64)  # rows = positions 0..start-1: the draft's context
    start = P
    while start < max_length:
        assert len(out) == start + 1 and feats.shape[0] == start
        d = numpy_dspark(w, cfg, feats, out[start])
        L = confident_length(d["confidence"], threshold, B)
        drafts = [int(t) for t in d["tokens"][:L]]
        logits, all_feats = target_forward(np.array(out + drafts, np.int64))
        verify = np.asarray(logits, np.float64)[start:start + L + 1]  # rows of positions start..start+L
        best = np.argmax(verify, -1)
        n = 0
        while n < L and drafts[n] == int(best[n]):
            n += 1
        hit = next((i for i in range(n) if drafts[i] in stop), None)
        if hit is not None:
            out += drafts[:hit + 1]
            acceptance.append(hit + 1)
            start += hit + 1
            break
        new = drafts[:n] + [int(best[n])]
        out += new
        acceptance.append(n + 1)
        start += n + 1
        feats = np.asarray(all_feats, np.float64)[:start]  # the anchor and the accepted drafts join the context
        if stop & set(new):
            break
    out = out[:min(start + 1, max_length)]
    for i in range(P, len(out)):
        if out[i] in stop:
            return out[:i + 1], acceptance
    return out, acceptance
