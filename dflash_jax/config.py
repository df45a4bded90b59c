"""Frozen model configs read from (and written back to) Hugging Face ``config.json``.

``TargetConfig`` describes a dense Qwen3 / LLaMA-3.x decoder (the ``dense`` target family, and the
layer stack of every draft); ``DraftConfig`` a DFlash draft (a Qwen3
layer stack plus the DFlash fields). Both accept the transformers-4.x rope format (``rope_theta`` +
``rope_scaling``) and the 5.x one (``rope_parameters``). Configs are hashable: they are static
arguments of jitted functions.
"""
from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Any, Mapping

import numpy as np

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


def default_target_layer_ids(num_target_layers: int, num_features: int) -> tuple[int, ...]:
    """The released drafts' default: ``round(1 + i*(L-4)/(n-1))``, or ``[L//2]`` for one feature."""
    if num_features == 1:
        return (num_target_layers // 2,)
    return tuple(int(round(1 + i * (num_target_layers - 4) / (num_features - 1))) for i in range(num_features))


def shallow_target_layer_ids(num_target_layers: int, num_features: int) -> tuple[int, ...]:
    """Evenly spaced layer ids from 1 to L-1 (both included), at most L-1 distinct ids.

    The released formula ``round(1 + i*(L-4)/(n-1))`` was designed for deep targets (e.g. 1..33 of
    36 layers): it skips the last three layers, whose outputs are already close to the logits. On a
    shallow target (< 12 layers) it collapses (L=4 gives layer 1 five times) and misses the layers
    that carry most of the next-token information, so there we span the whole depth instead.
    """
    L, n = num_target_layers, num_features
    if L < 2:
        return (0,)
    n = max(1, min(n, L - 1))
    if n == 1:
        return (L - 1,)
    ids = []
    for i in range(n):
        v = int(1 + (i * (L - 2) + (n - 1) // 2) // (n - 1))  # round half up, exact in integers
        if v not in ids:
            ids.append(v)
    return tuple(ids)


def choose_target_layer_ids(num_target_layers: int, num_features: int) -> tuple[int, ...]:
    """The target layers a new draft reads: the released default for targets with >= 12 layers,
    ``shallow_target_layer_ids`` below."""
    if num_target_layers < 12:
        return shallow_target_layer_ids(num_target_layers, num_features)
    return default_target_layer_ids(num_target_layers, num_features)


# The mask token's name in a tokenizer that has one (the demo's; a new draft's default mask id, see train.loop).
MASK_TOKEN = "<|MASK|>"


def _first(*values):
    """The first value that is set (not None): an explicit 0 stays 0 and is then rejected, never replaced."""
    return next((v for v in values if v is not None), None)


DRAFT_ARCHITECTURES = {"DFlashDraftModel": "dflash", "DFlash2DraftModel": "dflash2", "Qwen3DSparkModel": "dspark",
                       "Gemma4DSparkModel": "dspark"}
# DeepSpec's DSpark architectures -> the model_type of their layer stack (Qwen3 layers; Gemma 4's sandwich-norm ones)
DSPARK_STACKS = {"Qwen3DSparkModel": "qwen3", "Gemma4DSparkModel": "gemma4_text"}
# transformers' MuseGlimmerAssistantConfig: a DFlash draft with a flat config (no dflash_config), non-causal, its
# layers sliding by default; its defaults (vocab_size, absent there: Muse-Glimmer's, which check_fits then requires)
ASSISTANT_MODEL_TYPE = "muse_glimmer_assistant"
_ASSISTANT_DEFAULTS = {"vocab_size": 202048, "hidden_size": 6656, "intermediate_size": 19968, "num_hidden_layers": 5,
                       "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5,
                       "max_position_embeddings": 131072, "sliding_window": 2048, "rope_theta": 500000.0,
                       "bos_token_id": 200000, "eos_token_id": 200001, "pad_token_id": 200018, "block_size": 16,
                       "mask_token_id": 201818, "target_layer_ids": [1, 13, 25, 37, 49]}


def _assistant_as_dflash(d: Mapping) -> dict:
    """A ``muse_glimmer_assistant`` config.json as the DFlash layout it is (``MuseGlimmerAssistantModel``)."""
    d = {**_ASSISTANT_DEFAULTS, **{k: v for k, v in d.items() if v is not None}}
    d.setdefault("layer_types", ["sliding_attention"] * int(d["num_hidden_layers"]))
    # its window is inclusive (transformers' bidirectional sliding mask: |q - k| <= W); the DFlash rule is
    # |q - k| < W, so the same draft in the DFlash layout has a window of W + 1
    d["sliding_window"] = int(d["sliding_window"]) + 1
    return {**d, "model_type": "qwen3", "architectures": ["DFlashDraftModel"], "is_causal": False,
            "dflash_config": {k: d[k] for k in ("mask_token_id", "target_layer_ids", "block_size")}}
# DFlash2 keys of ``dflash_config`` -> their defaults (docs/models.md, "Draft formats")
DFLASH2_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")  # DSpark's Markov heads (dflash_jax/dspark.py)
# DSpark's top-level config keys (DeepSpec's build_draft_config) -> the DraftConfig fields they fill
DSPARK_KEYS = {"markov_rank": "markov_rank", "markov_head_type": "markov_head_type",
               "enable_confidence_head": "confidence_head", "confidence_head_with_markov": "confidence_with_markov",
               "num_anchors": "num_anchors"}


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """A DFlash draft: its own Qwen3 layer stack (``layers``) plus the block-diffusion settings.

    ``architecture`` "dflash" (``DFlashDraftModel``), "dflash2" (``DFlash2DraftModel``: grouped dynamic
    causal convolutions around each sublayer and a candidate selector; its ``conv_*`` / ``selector_*`` fields) or
    "dspark" (DeepSpec's ``Qwen3DSparkModel``, or ``Gemma4DSparkModel`` with Gemma 4 ``layers``: every block slot
    predicts the next position, the anchor's too; its own frozen embedding and head; a Markov head of
    ``markov_rank`` (0: none) and an optional confidence head).
    ``is_causal`` None: sliding layers are causal inside the block, full layers bidirectional (the newest
    reference and vLLM); True / False: every layer. ``input_embedding_scale`` multiplies the block's raw
    embeddings; ``output_multiplier`` then ``final_logit_softcapping`` (> 0) shape the draft logits."""

    layers: TargetConfig
    block_size: int
    num_target_layers: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    target_hidden_size: int | None = None  # servers' optional field: fc input = n * target_hidden_size
    is_causal: bool | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    architecture: str = "dflash"
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    markov_rank: int | None = None
    markov_head_type: str | None = None
    confidence_head: bool | None = None
    confidence_with_markov: bool | None = None
    num_anchors: int | None = None  # DeepSpec's training setting, kept so an export writes it back

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty")
        if min(self.target_layer_ids) < -1:
            raise ValueError(f"target_layer_ids {list(self.target_layer_ids)} must be >= -1 (-1: the embedding output)")
        if self.mask_token_id < 0 or self.num_target_layers < 0:
            raise ValueError(f"mask_token_id {self.mask_token_id} and num_target_layers {self.num_target_layers} must "
                             "be >= 0")
        for name in ("input_embedding_scale", "output_multiplier"):
            if not np.isfinite(getattr(self, name)) or getattr(self, name) == 0:
                raise ValueError(f"{name} must be a finite non-zero number, got {getattr(self, name)}")
        if self.final_logit_softcapping is not None and not self.final_logit_softcapping > 0:
            object.__setattr__(self, "final_logit_softcapping", None)  # <= 0 means off, as in the reference
        if self.architecture not in DRAFT_ARCHITECTURES.values():
            raise ValueError(f"architecture must be one of {sorted(DRAFT_ARCHITECTURES.values())}, "
                             f"got {self.architecture!r}")
        dflash2 = {k: getattr(self, k) for k in DFLASH2_DEFAULTS}
        if self.architecture == "dflash2":
            bad = {k: v for k, v in dflash2.items() if v is None or v < 1}
            if bad:
                raise ValueError(f"a DFlash2 draft needs {', '.join(bad)} >= 1, got {bad}")
            if self.layers.hidden_size % self.conv_group_size:
                raise ValueError(f"conv_group_size {self.conv_group_size} does not divide hidden_size "
                                 f"{self.layers.hidden_size}")
        elif any(v is not None for v in dflash2.values()):
            raise ValueError(f"{sorted(k for k, v in dflash2.items() if v is not None)} are DFlash2 settings; "
                             f"this draft's architecture is {self.architecture}")
        self._check_dspark()

    def _check_dspark(self):
        dspark = {f: getattr(self, f) for f in DSPARK_KEYS.values()}
        if self.architecture != "dspark":
            if any(v is not None for v in dspark.values()):
                raise ValueError(f"{sorted(k for k, v in dspark.items() if v is not None)} are DSpark settings; "
                                 f"this draft's architecture is {self.architecture}")
            return
        if self.markov_rank is None or self.markov_rank < 0:
            raise ValueError(f"a DSpark draft needs markov_rank >= 0, got {self.markov_rank!r}")
        if self.markov_rank and self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"markov_head_type must be one of {', '.join(MARKOV_HEAD_TYPES)}, "
                             f"got {self.markov_head_type!r}")
        if self.confidence_head is None:
            raise ValueError("a DSpark draft needs enable_confidence_head (true or false)")
        if self.confidence_with_markov and not self.markov_rank:
            raise ValueError("confidence_head_with_markov needs a Markov head (markov_rank > 0)")
        n = self.layers.num_hidden_layers
        if any(self.layer_causal(i) or self.layers.layer_window(i) for i in range(n)):
            raise ValueError("DSpark draft layers are full, bidirectional attention (no causal or sliding layers)")
        if self.layers.model_type not in DSPARK_STACKS.values():
            raise ValueError(f"a DSpark draft's layers are one of {sorted(DSPARK_STACKS.values())}, "
                             f"got {self.layers.model_type!r}")

    @property
    def shifted(self) -> bool:
        """Every block slot predicts the token after it, the anchor's too (DSpark): B inputs propose B tokens,
        verified as B + 1; otherwise slot k >= 1 predicts its own position (B inputs propose B - 1)."""
        return self.architecture == "dspark"

    @property
    def own_embeddings(self) -> bool:
        """The draft holds its own (frozen) ``embed_tokens`` / ``lm_head`` (DSpark) instead of using the target's."""
        return self.architecture == "dspark"

    @property
    def convolves(self) -> bool:
        """DFlash2's dynamic convolutions around each sublayer and its candidate selector."""
        return self.architecture == "dflash2"

    @property
    def markov(self) -> bool:
        """A DSpark Markov head: a low-rank bias from each slot's previous token on its logits."""
        return self.architecture == "dspark" and self.markov_rank > 0

    def verify_length(self, block: int) -> int:
        """Tokens the target verifies for ``block`` draft input slots (the pending token + the proposal)."""
        return block + 1 if self.shifted else block

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    def layer_causal(self, i: int) -> bool:
        """Whether draft layer i's block queries see only block keys at or before their own position."""
        if self.is_causal is not None:
            return self.is_causal
        return self.layers.layer_types[i] == "sliding_attention"

    @classmethod
    def from_hf(cls, path_or_dict) -> "DraftConfig":
        d = read_config_json(path_or_dict)
        try:
            return cls._read(d)
        except TypeError as e:  # e.g. a number where the layer-id list belongs
            raise ValueError(f"draft config.json has a value of the wrong type ({e})") from None

    @classmethod
    def _read(cls, d: Mapping) -> "DraftConfig":
        if d.get("model_type") == ASSISTANT_MODEL_TYPE:
            d = _assistant_as_dflash(d)
        dflash = d.get("dflash_config") or {}
        if not isinstance(dflash, Mapping):
            raise ValueError(f"dflash_config must be a JSON object, got {type(dflash).__name__}")

        def key(name, default=None):  # a key in dflash_config wins over the same top-level key
            return _first(dflash.get(name), d.get(name), default)

        archs = [a for a in architectures(d) if a in DRAFT_ARCHITECTURES]
        unknown = [a for a in architectures(d) if ("DFlash" in a or "DSpark" in a) and a not in DRAFT_ARCHITECTURES]
        if unknown:
            raise ValueError(f"unsupported draft architecture {unknown[0]!r}; supported: "
                             f"{', '.join(DRAFT_ARCHITECTURES)}")
        others = [a for a in architectures(d) if a not in DRAFT_ARCHITECTURES]
        if others and not archs and not d.get("dflash_config"):
            raise ValueError(f"this config.json is a target model (architectures {others}), not a DFlash draft: "
                             "pass it as the target")
        arch = DRAFT_ARCHITECTURES[archs[0]] if archs else "dflash"
        mask = key("mask_token_id")
        if mask is None:
            raise ValueError("draft config has no dflash_config.mask_token_id")
        if arch == "dspark":  # every DSpark layer is full bidirectional attention (DeepSpec ignores other types)
            d = {**d, "layer_types": None, "use_sliding_window": False, "is_causal": None}
        if archs and DSPARK_STACKS.get(archs[0]) == "gemma4_text":
            from dflash_jax.families import gemma4  # the family imports this module

            layers = gemma4.dspark_layers(d)
        else:
            layers = TargetConfig._from_dict(d, "qwen3")
        n_target = int(key("num_target_layers", 0))
        ids = key("target_layer_ids")
        if ids is None:
            if not n_target:
                raise ValueError("draft config has neither dflash_config.target_layer_ids nor num_target_layers")
            ids = default_target_layer_ids(n_target, layers.num_hidden_layers)
        target_hidden = key("target_hidden_size")
        causal = d.get("is_causal")
        softcap = key("final_logit_softcapping")
        extra = {k: int(key(k, v)) for k, v in DFLASH2_DEFAULTS.items()} if arch == "dflash2" else {}
        if arch == "dspark":  # DeepSpec writes its keys at the top level
            extra = {field: d.get(k) for k, field in DSPARK_KEYS.items()}
            extra["markov_rank"] = int(extra["markov_rank"] or 0)
            extra["confidence_head"] = bool(extra["confidence_head"])
            # the head reads [h; W1[x]]: without a Markov head (rank 0) W1[x] is empty and it reads h alone
            with_markov = extra["confidence_with_markov"]
            extra["confidence_with_markov"] = (None if not extra["confidence_head"] else
                                               bool(extra["markov_rank"]) and (with_markov is None or bool(with_markov)))
            if not extra["markov_rank"]:
                extra["markov_head_type"] = None
            elif extra["markov_head_type"] is None:
                extra["markov_head_type"] = "vanilla"
            else:  # DeepSpec lower-cases it
                extra["markov_head_type"] = str(extra["markov_head_type"]).lower()
            if extra["num_anchors"] is not None:
                extra["num_anchors"] = int(extra["num_anchors"])
        return cls(
            layers=layers,
            block_size=int(key("block_size", 16)),
            num_target_layers=n_target,
            mask_token_id=int(mask),
            target_layer_ids=tuple(int(i) for i in ids),
            target_hidden_size=None if target_hidden is None else int(target_hidden),
            is_causal=None if causal is None else bool(causal),
            input_embedding_scale=float(key("input_embedding_scale", 1.0)),
            output_multiplier=float(key("output_multiplier", 1.0)),
            final_logit_softcapping=None if softcap is None else float(softcap),
            architecture=arch,
            **extra,
        )

    def to_hf(self) -> dict:
        """The released layout; optional keys only when they differ from their defaults (older readers that
        know none of them then read the same draft)."""
        out = self.layers.to_hf()
        out["block_size"] = self.block_size
        out["num_target_layers"] = self.num_target_layers
        if self.architecture == "dspark":
            return self._dspark_hf(out)
        arch = {v: k for k, v in DRAFT_ARCHITECTURES.items()}[self.architecture]
        out["architectures"] = [arch]
        out["model_type"] = "qwen3"
        dflash = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)}
        if self.input_embedding_scale != 1.0:
            dflash["input_embedding_scale"] = self.input_embedding_scale
        if self.output_multiplier != 1.0:
            dflash["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping is not None:
            dflash["final_logit_softcapping"] = self.final_logit_softcapping
        if self.architecture == "dflash2":
            dflash.update({k: getattr(self, k) for k in DFLASH2_DEFAULTS})
        out["dflash_config"] = dflash
        if self.is_causal is not None:
            out["is_causal"] = self.is_causal
        if self.target_hidden_size is not None:
            out["target_hidden_size"] = self.target_hidden_size
        out["auto_map"] = {"AutoModel": f"dflash.{arch}"}
        return out

    def _dspark_hf(self, out: dict) -> dict:
        """DeepSpec's layout (``build_draft_config``): its keys at the top level, no ``dflash_config``; the
        optional ones only where DeepSpec writes them (the head type with a Markov head, the confidence head's
        input with that head); a Gemma 4 stack also names the target's model types and keeps its logit soft cap."""
        arch = {v: k for k, v in DSPARK_STACKS.items()}[self.layers.model_type]
        out.update(architectures=[arch], model_type=self.layers.model_type)
        if arch == "Gemma4DSparkModel":
            out.update(target_model_type="gemma4", target_text_model_type="gemma4_text",
                       final_logit_softcapping=self.final_logit_softcapping)
        out.update(tie_word_embeddings=False, mask_token_id=self.mask_token_id,
                   target_layer_ids=list(self.target_layer_ids), markov_rank=self.markov_rank,
                   enable_confidence_head=self.confidence_head)
        if self.markov_rank:
            out["markov_head_type"] = self.markov_head_type
        if self.confidence_head:
            out["confidence_head_with_markov"] = self.confidence_with_markov
        out["num_anchors"] = 512 if self.num_anchors is None else self.num_anchors  # DeepSpec's model requires it
        return out

    @classmethod
    def for_target(cls, target: TargetConfig, *, draft_layers: int, block_size: int, mask_token_id: int,
                   target_layer_ids, layer_types=None, sliding_window: int | None = None,
                   is_causal: bool | None = None, input_embedding_scale: float = 1.0,
                   output_multiplier: float = 1.0, final_logit_softcapping: float | None = None) -> "DraftConfig":
        """A new draft shaped as the released ones: a Qwen3 stack of ``draft_layers`` layers with the target's
        widths, heads, norm eps, special tokens and rope (rotating the whole head: a hybrid target rotates part
        of it in its own attention only). The MLP width is the target's ``intermediate_size`` (a mixture-of-
        experts target's dense width, as the released drafts have) or, without one, its ``moe_intermediate_size``.
        ``layer_types`` / ``sliding_window`` / ``is_causal``: the draft's own attention (default: every layer full
        and bidirectional); ``input_embedding_scale`` / ``output_multiplier`` / ``final_logit_softcapping``: its
        input and logits (default: neither scaled nor capped). Built through ``from_hf``, so it equals what
        ``load_draft`` reads back from its export."""
        t = target
        d = {"model_type": "qwen3", "vocab_size": t.vocab_size, "hidden_size": t.hidden_size,
             "intermediate_size": getattr(t, "intermediate_size", None) or t.moe_intermediate_size,
             "num_hidden_layers": draft_layers, "num_attention_heads": t.num_attention_heads,
             "num_key_value_heads": t.num_key_value_heads, "head_dim": t.head_dim, "rms_norm_eps": t.rms_norm_eps,
             "max_position_embeddings": t.max_position_embeddings, "tie_word_embeddings": False,
             "bos_token_id": t.bos_token_id, "eos_token_id": list(t.eos_token_id) or None,
             "pad_token_id": t.pad_token_id, **dataclasses.replace(t.rope, partial_rotary_factor=1.0).to_hf(),
             "block_size": block_size, "num_target_layers": t.num_hidden_layers,
             "dflash_config": {"mask_token_id": int(mask_token_id),
                               "target_layer_ids": [int(i) for i in target_layer_ids]}}
        if layer_types is not None:
            d.update(layer_types=list(layer_types), sliding_window=sliding_window)
        if is_causal is not None:
            d["is_causal"] = bool(is_causal)
        d["dflash_config"].update(input_embedding_scale=input_embedding_scale, output_multiplier=output_multiplier,
                                  final_logit_softcapping=final_logit_softcapping)
        draft = cls.from_hf(d)
        draft.check_fits(target)
        return draft

    def check_fits(self, target: TargetConfig) -> None:
        """Raise (before any compute) when this draft cannot run on ``target``; name both sides."""
        n = target.num_hidden_layers
        bad = [i for i in self.target_layer_ids if not -1 <= i < n]
        if bad:
            raise ValueError(f"draft target_layer_ids {list(self.target_layer_ids)} has ids {bad} outside the "
                             f"target's {n} layers (valid -1..{n - 1}, -1 the embedding output)")
        if self.num_target_layers and self.num_target_layers != n:
            warnings.warn(f"draft was trained for num_target_layers={self.num_target_layers}, "
                          f"target has {n} layers", stacklevel=2)
        if self.target_hidden_size is not None and self.target_hidden_size != target.hidden_size:
            raise ValueError(f"draft target_hidden_size {self.target_hidden_size} != the target's hidden_size "
                             f"{target.hidden_size} (the draft was made for another target)")
        if self.layers.hidden_size != target.hidden_size:
            raise ValueError(f"draft hidden_size {self.layers.hidden_size} != target hidden_size "
                             f"{target.hidden_size} (the draft uses the target's embedding and lm_head)")
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise ValueError(f"draft mask_token_id {self.mask_token_id} is outside the target vocabulary "
                             f"(vocab_size {target.vocab_size})")
        if self.layers.vocab_size != target.vocab_size:  # trained on another tokenizer: its tokens mean others
            raise ValueError(f"draft vocab_size {self.layers.vocab_size} != the target's vocab_size "
                             f"{target.vocab_size} (the draft was made for another target)")
