"""Frozen model configs read from (and written back to) Hugging Face ``config.json``.

``TargetConfig`` describes a dense Qwen3 / LLaMA-3.x decoder (the ``dense`` target family, and the layer stack of
the DFlash drafts; a draft's own config is ``dflash_jax.drafts.DraftConfig``). It accepts the transformers-4.x rope
format (``rope_theta`` + ``rope_scaling``) and the 5.x one (``rope_parameters``). Configs are hashable: they are
static arguments of jitted functions. This module imports no family and no draft code (they build on it).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping


DENSE_MODEL_TYPES = ("qwen3", "llama")  # what TargetConfig describes; all families: dflash_jax.families
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
LAYER_TYPES = ("full_attention", "sliding_attention")


def architectures(d: Mapping) -> tuple[str, ...]:
    """A config's ``architectures`` list (absent: empty), checked."""
    archs = d.get("architectures")
    if archs is None:
        return ()
    if not isinstance(archs, (list, tuple)):
        raise ValueError(f"config.json architectures must be a list of class names, got {archs!r}")
    return tuple(str(a) for a in archs)


def read_config_json(path_or_dict) -> dict:
    """A config dict from a dict, a config.json path or a model directory."""
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict)
    path = os.fspath(path_or_dict)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json at {path}")
    with open(path) as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path} must hold a JSON object, not a {type(d).__name__}")
    return d


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings; ``params`` holds the type's extra keys as sorted (key, value) pairs."""

    theta: float = 10000.0
    rope_type: str = "default"
    params: tuple[tuple[str, Any], ...] = ()
    partial_rotary_factor: float = 1.0  # rotary on the first int(head_dim * factor) dims only (a family sets it)

    def get(self, key, default=None):
        return dict(self.params).get(key, default)

    @classmethod
    def from_hf(cls, d: Mapping, max_position_embeddings: int) -> "RopeConfig":
        rp = d.get("rope_parameters")
        if isinstance(rp, Mapping) and rp and all(isinstance(v, Mapping) for v in rp.values()):
            # Per-layer-type rope (5.x nested form): all our layer types must agree.
            kinds = {json.dumps(v, sort_keys=True) for v in rp.values() if v}
            if len(kinds) > 1:
                raise ValueError(f"different rope settings per layer type are not supported: {rp}")
            rp = next(v for v in rp.values() if v)
        scaling = dict(rp) if isinstance(rp, Mapping) and rp else dict(d.get("rope_scaling") or {})
        theta = scaling.pop("rope_theta", None) or d.get("rope_theta") or 10000.0
        rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
        scaling.pop("type", None)
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
        if rope_type in ("llama3", "yarn"):
            scaling.setdefault("original_max_position_embeddings",
                               d.get("original_max_position_embeddings") or max_position_embeddings)
        if "partial_rotary_factor" in d and "partial_rotary_factor" not in scaling:
            scaling["partial_rotary_factor"] = d["partial_rotary_factor"]
        if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("partial_rotary_factor != 1 is not supported")
        scaling.pop("partial_rotary_factor", None)
        required = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
                    "yarn": ("factor",)}.get(rope_type, ())
        missing = [k for k in required if scaling.get(k) is None]
        if missing:
            raise ValueError(f"rope type {rope_type!r} needs {missing} in rope_scaling / rope_parameters")
        return cls(theta=float(theta), rope_type=rope_type, params=tuple(sorted(scaling.items())))

    def to_hf(self) -> dict:
        """Both formats: 4.x ``rope_theta`` + ``rope_scaling`` and 5.x ``rope_parameters``."""
        extra = dict(self.params)
        if self.partial_rotary_factor != 1.0:
            extra["partial_rotary_factor"] = self.partial_rotary_factor
        out: dict[str, Any] = {"rope_theta": self.theta,
                               "rope_parameters": {"rope_type": self.rope_type, "rope_theta": self.theta, **extra}}
        out["rope_scaling"] = None if self.rope_type == "default" else {"rope_type": self.rope_type, **extra}
        return out


def _layer_types(d: Mapping, n_layers: int) -> tuple[str, ...]:
    types = d.get("layer_types")
    if types is None:
        if d.get("use_sliding_window") and d.get("sliding_window"):
            start = d.get("max_window_layers", n_layers)
            types = ["sliding_attention" if i >= start else "full_attention" for i in range(n_layers)]
        else:
            types = ["full_attention"] * n_layers
    types = tuple(types)
    if len(types) != n_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {n_layers} layers")
    bad = sorted(set(types) - set(LAYER_TYPES))
    if bad:
        raise ValueError(f"unsupported layer_types {bad}; supported: {LAYER_TYPES}")
    return types


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """A dense Qwen3 / LLaMA-3.x decoder (the ``dense`` family's config; also a DFlash draft's layer stack)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = True
    attention_sinks: bool = False  # a learned per-head logit joins each softmax (gpt-oss)
    attn_output_gate: bool = False  # q_proj also yields a per-head gate: output * sigmoid(gate) (Qwen3.5)
    norm_offset: bool = False  # zero-centred RMSNorm weights: (1 + w) * x_hat (Qwen3.5 / Qwen3-Next)
    rope: RopeConfig = RopeConfig()
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # not a Hugging Face field: repeating layers compiled as one scan, their parameters stacked
    # (``dflash_jax.layer_scan``; ``target.scanned``)
    scan_layers: bool = False

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.rms_norm_eps > 0:  # 0 divides by zero on a zero row; < 0 takes a NaN square root
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not self.rope.theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope.theta}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_hidden_layers)
        self._check_layer_types()

    def _check_layer_types(self) -> None:
        """The layer types this config's family accepts (a family with other kinds of layers overrides it)."""
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")

    def layer_window(self, i: int) -> int | None:
        """The sliding window of layer i, or None for full attention."""
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    def layer_attention(self, i: int) -> "TargetConfig":
        """Layer i's attention sizes as a config (head_dim, num_key_value_heads, rope); one for every layer here,
        a family whose layers differ overrides it."""
        return self

    @classmethod
    def from_hf(cls, path_or_dict) -> "TargetConfig":
        d = read_config_json(path_or_dict)
        model_type = d.get("model_type")
        if model_type not in DENSE_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(DENSE_MODEL_TYPES)}")
        return cls._from_dict(d, model_type)

    @classmethod
    def _from_dict(cls, d: Mapping, model_type: str) -> "TargetConfig":
        try:
            return cls._read(d, model_type)
        except KeyError as e:
            raise ValueError(f"config.json is missing {e.args[0]!r}") from None
        except TypeError as e:  # e.g. a null or a list where a number belongs
            raise ValueError(f"config.json has a value of the wrong type ({e})") from None

    @classmethod
    def _read(cls, d: Mapping, model_type: str) -> "TargetConfig":
        hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
        n_layers = int(d["num_hidden_layers"])
        vocab, inter = int(d["vocab_size"]), int(d["intermediate_size"])
        max_pos = int(d.get("max_position_embeddings", 32768))
        eos = d.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        layer_types = _layer_types(d, n_layers)
        return cls(
            model_type=model_type,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or (hidden // heads if heads > 0 else 0)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            rope=RopeConfig.from_hf(d, max_pos),
            layer_types=layer_types,
            sliding_window=(int(d["sliding_window"]) if d.get("sliding_window") and
                            "sliding_attention" in layer_types else None),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
            pad_token_id=d.get("pad_token_id"),
        )

    def to_hf(self) -> dict:
        # another family's config (a subclass) writes its own architectures over this
        arch = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}.get(self.model_type)
        eos = list(self.eos_token_id)
        out = {
            "architectures": [arch] if arch else [],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "layer_types": list(self.layer_types),
            "sliding_window": self.sliding_window,
            "use_sliding_window": "sliding_attention" in self.layer_types,
            "max_window_layers": self.num_hidden_layers,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
            "pad_token_id": self.pad_token_id,
            **self.rope.to_hf(),
        }
        if self.model_type == "llama":
            out["mlp_bias"] = self.mlp_bias
        return out
