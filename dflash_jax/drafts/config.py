"""``DraftConfig``: a draft's frozen config, read from (and written back to) its Hugging Face ``config.json`` in
any of the formats of ``dflash_jax.drafts.formats``; and the rules choosing the target layers a new draft reads."""
from __future__ import annotations

import dataclasses
import warnings
from typing import Mapping

import numpy as np

from dflash_jax.config import TargetConfig, architectures, read_config_json
from dflash_jax.drafts.formats import FORMATS, QWEN3_STACK, DraftFormat, architecture_formats, stacks
from dflash_jax.families.family import DraftStack


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
        if self.architecture not in FORMATS:
            raise ValueError(f"architecture must be one of {sorted(FORMATS)}, got {self.architecture!r}")
        for other in FORMATS.values():  # another format's settings on this draft
            stray = sorted(k for k in other.fields if k not in self.format.fields and getattr(self, k) is not None)
            if stray:
                raise ValueError(f"{stray} are {other.title} settings; this draft's architecture is {self.architecture}")
        self.format.check(self)

    @property
    def format(self) -> DraftFormat:
        """Its format's record: what its architecture changes (``dflash_jax.drafts.formats``)."""
        return FORMATS[self.architecture]

    @property
    def stack(self) -> DraftStack:
        """Its layer stack: Qwen3 layers, or those a family brings (Gemma 4's DSpark layers)."""
        return next((s for s in stacks().values() if s.model_type == self.layers.model_type), QWEN3_STACK)

    @property
    def shifted(self) -> bool:
        """Every block slot predicts the token after it, the anchor's too (DSpark): B inputs propose B tokens,
        verified as B + 1; otherwise slot k >= 1 predicts its own position (B inputs propose B - 1)."""
        return self.format.shifted

    @property
    def own_embeddings(self) -> bool:
        """The draft holds its own (frozen) ``embed_tokens`` / ``lm_head`` (DSpark) instead of using the target's."""
        return self.format.own_embeddings

    @property
    def convolves(self) -> bool:
        """DFlash2's dynamic convolutions around each sublayer and its candidate selector."""
        return self.format.convolves

    @property
    def markov(self) -> bool:
        """A DSpark Markov head: a low-rank bias from each slot's previous token on its logits."""
        return bool(self.markov_rank)

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

        known = architecture_formats()
        archs = [a for a in architectures(d) if a in known]
        unknown = [a for a in architectures(d) if ("DFlash" in a or "DSpark" in a) and a not in known]
        if unknown:
            raise ValueError(f"unsupported draft architecture {unknown[0]!r}; supported: {', '.join(known)}")
        others = [a for a in architectures(d) if a not in known]
        if others and not archs and not d.get("dflash_config"):
            raise ValueError(f"this config.json is a target model (architectures {others}), not a DFlash draft: "
                             "pass it as the target")
        fmt = known[archs[0]] if archs else FORMATS["dflash"]
        mask = key("mask_token_id")
        if mask is None:
            raise ValueError("draft config has no dflash_config.mask_token_id")
        if fmt.full_attention:  # every DSpark layer is full bidirectional attention (DeepSpec ignores other types)
            d = {**d, "layer_types": None, "use_sliding_window": False, "is_causal": None}
        layers = stacks().get(archs[0] if archs else None, QWEN3_STACK).layers(d)
        n_target = int(key("num_target_layers", 0))
        ids = key("target_layer_ids")
        if ids is None:
            if not n_target:
                raise ValueError("draft config has neither dflash_config.target_layer_ids nor num_target_layers")
            ids = default_target_layer_ids(n_target, layers.num_hidden_layers)
        target_hidden = key("target_hidden_size")
        causal = d.get("is_causal")
        softcap = key("final_logit_softcapping")
        extra = fmt.read(d, key)
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
            architecture=fmt.name,
            **extra,
        )

    def to_hf(self) -> dict:
        """The released layout; optional keys only when they differ from their defaults (older readers that
        know none of them then read the same draft)."""
        out = self.layers.to_hf()
        out["block_size"] = self.block_size
        out["num_target_layers"] = self.num_target_layers
        return self.format.write(self, out)

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
