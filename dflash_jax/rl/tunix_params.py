"""Tunix's Qwen3 NNX parameters <-> the project's qwen3 target parameters (pure functions over nested dicts).

Tunix's ``tunix/models/qwen3/model.py`` (google-tunix 0.1.5) names and shapes its parameters (``nnx.state(model,
nnx.Param).to_pure_dict()``; D = hidden size, N / K = query / KV heads, H = head dim, F = MLP width, V = vocab):

====================================================  ===========  ==========================================
Tunix path                                            shape        the project's leaf
====================================================  ===========  ==========================================
``embedder.input_embedding``                          [V, D]       ``embed_tokens.embedding``
``layers[i].input_layernorm.w``                       [D]          ``layers_i.input_layernorm.weight``
``layers[i].attn.q_proj.w`` (``BTD,DNH->BTNH``)       [D, N, H]    ``layers_i.self_attn.q_proj.kernel`` [D, N*H]
``layers[i].attn.k_proj.w`` / ``v_proj.w``            [D, K, H]    ``k_proj`` / ``v_proj.kernel`` [D, K*H]
``layers[i].attn.o_proj.w`` (``BTNH,NHD->BTD``)       [N, H, D]    ``layers_i.self_attn.o_proj.kernel`` [N*H, D]
``layers[i].attn.q_norm.w`` / ``k_norm.w``            [H]          ``q_norm`` / ``k_norm.weight``
``layers[i].post_attention_layernorm.w``              [D]          ``layers_i.post_attention_layernorm.weight``
``layers[i].mlp.gate_proj.kernel`` / ``up_proj``      [D, F]       the same names' ``kernel``
``layers[i].mlp.down_proj.kernel``                    [F, D]       ``layers_i.mlp.down_proj.kernel``
``final_norm.w``                                      [D]          ``norm.weight``
``lm_head.w`` (``BTD,DV->BTV``)                       [D, V]       ``lm_head.kernel`` (tied: the embedding's
                                                                   transpose, not kept by the project)
====================================================  ===========  ==========================================

Both sides store a projection as the transpose of Hugging Face's ``weight`` (Tunix's ``params.py`` maps
``q_proj.weight`` by permuting (1, 0) then reshaping to [D, N, H]), so the mapping is reshapes only. Tunix's
``layers`` is a list, so its pure dict keys them by int; string keys ("0") are accepted too. Dense qwen3 only (no
MoE, no biases, RMSNorm without offset: what Tunix's Qwen3 computes)."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from dflash_jax import layer_scan
from dflash_jax.target import layer_groups

_NORMS = ("input_layernorm", "post_attention_layernorm")
_MLP = ("gate_proj", "up_proj", "down_proj")


def check_qwen3(config) -> None:
    """ValueError unless ``config`` is a dense qwen3 target with Tunix's Qwen3 layout."""
    if config.model_type != "qwen3" or config.attention_bias or config.mlp_bias or not config.qk_norm \
            or config.norm_offset:
        raise ValueError(f"Tunix's Qwen3 layout maps dense qwen3 targets (q/k norms, no biases); got "
                         f"model_type={config.model_type!r}")


def _value(x):
    """A leaf of an ``nnx.State`` (a Variable or its state, ``.value``) or a plain array."""
    return getattr(x, "value", x)


def pure_dict(state) -> dict:
    """A Tunix model state as nested dicts of arrays: an ``nnx.State`` (``to_pure_dict``) or any nested mapping
    whose leaves may be NNX variables."""
    if hasattr(state, "to_pure_dict"):
        return state.to_pure_dict()
    if isinstance(state, Mapping):
        return {k: pure_dict(v) for k, v in state.items()}
    return _value(state)


def _layer(layers, i: int):
    """Tunix's layer ``i`` (list positions are int keys in a pure dict; str keys accepted)."""
    if isinstance(layers, (list, tuple)):
        return layers[i]
    return layers[i] if i in layers else layers[str(i)]


def to_tunix_qwen3(params: Mapping[str, Any], config) -> dict:
    """The project's qwen3 target parameters (scanned or not) -> Tunix's Qwen3 NNX layout (nested dicts, int layer
    keys)."""
    check_qwen3(config)
    if config.scan_layers:
        params = layer_scan.unstack_params(params, layer_groups(config))
    n, k, h = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    layers = {}
    for i in range(config.num_hidden_layers):
        p = params[f"layers_{i}"]
        a, d = p["self_attn"], np.shape(p["self_attn"]["q_proj"]["kernel"])[0]
        layers[i] = {
            **{name: {"w": p[name]["weight"]} for name in _NORMS},
            "attn": {"q_proj": {"w": a["q_proj"]["kernel"].reshape(d, n, h)},
                     "k_proj": {"w": a["k_proj"]["kernel"].reshape(d, k, h)},
                     "v_proj": {"w": a["v_proj"]["kernel"].reshape(d, k, h)},
                     "o_proj": {"w": a["o_proj"]["kernel"].reshape(n, h, d)},
                     "q_norm": {"w": a["q_norm"]["weight"]}, "k_norm": {"w": a["k_norm"]["weight"]}},
            "mlp": {m: {"kernel": p["mlp"][m]["kernel"]} for m in _MLP}}
    emb = params["embed_tokens"]["embedding"]
    head = emb.T if config.tie_word_embeddings else params["lm_head"]["kernel"]
    return {"embedder": {"input_embedding": emb}, "layers": layers, "final_norm": {"w": params["norm"]["weight"]},
            "lm_head": {"w": head}}


def from_tunix_qwen3(state, config) -> dict:
    """Tunix's Qwen3 NNX state (``nnx.State`` or nested dicts, see the module's table) -> the project's qwen3 target
    parameters (stacked where ``config`` scans its layers). Tied embeddings: Tunix's ``lm_head.w`` is not read (the
    project computes logits with the embedding). A missing name raises KeyError naming it; a leaf of another size
    fails its reshape."""
    check_qwen3(config)
    s = pure_dict(state)
    nh, kh = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    out = {"embed_tokens": {"embedding": s["embedder"]["input_embedding"]}, "norm": {"weight": s["final_norm"]["w"]}}
    for i in range(config.num_hidden_layers):
        p = _layer(s["layers"], i)
        a = p["attn"]
        d = np.shape(a["q_proj"]["w"])[0]
        out[f"layers_{i}"] = {
            **{name: {"weight": p[name]["w"]} for name in _NORMS},
            "self_attn": {"q_proj": {"kernel": a["q_proj"]["w"].reshape(d, nh)},
                          "k_proj": {"kernel": a["k_proj"]["w"].reshape(d, kh)},
                          "v_proj": {"kernel": a["v_proj"]["w"].reshape(d, kh)},
                          "o_proj": {"kernel": a["o_proj"]["w"].reshape(nh, d)},
                          "q_norm": {"weight": a["q_norm"]["w"]}, "k_norm": {"weight": a["k_norm"]["w"]}},
            "mlp": {m: {"kernel": p["mlp"][m]["kernel"]} for m in _MLP}}
    if not config.tie_word_embeddings:
        out["lm_head"] = {"kernel": s["lm_head"]["w"]}
    return layer_scan.stack_params(out, layer_groups(config)) if config.scan_layers else out
