"""All training hyperparameters as one frozen dataclass, settable from the command line.

``TrainConfig`` is printed at start, written to ``<out>/config.json`` and stored in every
checkpoint; ``parse_args`` builds the argparse parser from the fields (``--field-name``), so a new
field is a new flag with no extra code.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import types
import typing

from dflash_jax.checkpoints import DTYPES
from dflash_jax.drafts.formats import FORMATS, MARKOV_HEAD_TYPES

# --draft-causal -> DraftConfig.is_causal (auto: the newest reference's rule, sliding layers causal, full ones not)
DRAFT_CAUSAL = {"auto": None, "true": True, "false": False}

# --draft-arch: the draft's architecture and the objective it trains with
DRAFT_ARCHS = tuple(name for name, f in FORMATS.items() if f.trainable)
# DSpark's loss-weight decay (DeepSpec's loss_decay_gamma): w_j = exp(-j/4), slot j 0-based
DSPARK_GAMMA = 4.0

# Loss-weight decay gamma of the paper per block size (w_k = exp(-(k-1)/gamma)).
PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    """gamma for ``block_size``: the paper's 7/5/4 for 16/10/8; otherwise the piecewise-linear
    interpolation through those three points, extrapolated with the nearest segment's slope
    (1/2 per token below 8, 1/3 per token above 16) and never below 1. E.g. 4 -> 2, 12 -> 5.67, 32 -> 12.33."""
    if block_size in PAPER_GAMMA:
        return PAPER_GAMMA[block_size]
    pts = sorted(PAPER_GAMMA.items())
    b = float(block_size)
    if b < pts[0][0]:
        g = pts[0][1] + (b - pts[0][0]) * (pts[1][1] - pts[0][1]) / (pts[1][0] - pts[0][0])
    elif b > pts[-1][0]:
        g = pts[-1][1] + (b - pts[-1][0]) * (pts[-1][1] - pts[-2][1]) / (pts[-1][0] - pts[-2][0])
    else:
        (x0, y0), (x1, y1) = next(((p, q) for p, q in zip(pts, pts[1:]) if p[0] <= b <= q[0]))
        g = y0 + (b - x0) * (y1 - y0) / (x1 - x0)
    return max(1.0, g)


def _help(text: str, **kw):
    return dataclasses.field(metadata={"help": text}, **kw)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    # what to train on
    target: str = _help("target checkpoint directory or hub id (any supported model_type: docs/models.md)",
                        default="")
    data: str = _help("data directory written by `python -m train.make_data` (manifest.json + shards)", default="")
    allow_partial_data: bool = _help("train on a data directory whose make_data run did not finish (manifest "
                                     "\"complete\": false); refused by default", default=False)
    out: str = _help("output directory: checkpoints/, config.json, metrics.jsonl", default="")
    # the draft
    init_draft: str = _help("start from an existing draft directory (its config fixes the architecture)",
                            default="")
    draft_layers: int = _help("number of draft decoder layers", default=5)
    block_size: int = _help("block size B (tokens per draft block, anchor included)", default=16)
    num_target_features: int = _help("number of target layers whose outputs are fused (n)", default=5)
    target_layer_ids: str = _help("comma-separated target layer ids (-1: the embedding output, as DeepSpec's; "
                                  "a list that starts with it takes '=': --target-layer-ids=-1,9,17); "
                                  "default: the released formula "
                                  "round(1+i*(L-4)/(n-1)), or for targets with < 12 layers ids evenly "
                                  "spaced over 1..L-1 (the formula collapses on shallow targets)", default="")
    mask_token_id: int = _help("mask token id; -1: first unused embedding row (len(tokenizer) < vocab), "
                               "else the pad token, else vocab_size-1", default=-1)
    draft_sliding_layers: str = _help("draft layers with sliding-window attention: comma-separated layer ids, or "
                                      "'alternate' (layers 0, 2, 4, ...: sliding first, then full, as the released "
                                      "sliding drafts); empty: none (every layer full attention)", default="")
    draft_sliding_window: int = _help("the window W of the sliding draft layers (required with "
                                      "--draft-sliding-layers, an error without)", default=0)
    draft_causal: str = _help("causality inside the draft block: auto (sliding layers causal, full layers "
                              "bidirectional, as the newest reference) | true | false (every layer)", default="auto")
    draft_output_multiplier: float = _help("the draft logits' multiplier (output_multiplier)", default=1.0)
    draft_logit_softcap: float = _help("soft cap of the draft logits, cap * tanh(logits / cap) "
                                       "(final_logit_softcapping; 0: off)", default=0.0)
    draft_embedding_scale: float = _help("multiplier of the draft block's raw token embeddings "
                                         "(input_embedding_scale)", default=1.0)
    # DSpark drafts (--draft-arch dspark: DeepSpec's Qwen3DSparkModel; Gemma4DSparkModel on a Gemma 4 target)
    draft_arch: str = _help("draft architecture: dflash (DFlashDraftModel, the DFlash objective) | dspark "
                            "(Qwen3DSparkModel, Gemma4DSparkModel on a Gemma 4 target: every block slot predicts "
                            "the next token, a Markov head and a "
                            "confidence head, frozen copies of the target's embedding and lm_head, the DSpark "
                            "loss)", default="dflash")
    markov_rank: int = _help("DSpark: rank r of the Markov head (0: none)", default=256)
    markov_head_type: str = _help("DSpark: the Markov head: vanilla | gated | rnn", default="vanilla")
    confidence_head: bool = _help("DSpark: train a confidence head (per-slot acceptance estimate, fed the Markov "
                                  "embedding when there is a Markov head)", default=True)
    ce_weight: float = _help("DSpark: weight of the cross-entropy term", default=0.1)
    l1_weight: float = _help("DSpark: weight of the L1 distance between the draft's and the target's "
                             "next-token distributions", default=0.9)
    confidence_weight: float = _help("DSpark: weight of the confidence head's BCE term", default=1.0)
    # the objective
    num_anchors: int = _help("anchors (blocks) per row, re-drawn every epoch", default=512)
    gamma: float = _help("loss weight decay gamma, w_k = exp(-(k-1)/gamma) for the label k tokens after the anchor; "
                         "0: 7/5/4 for B=16/10/8, interpolated otherwise (dspark: 4)", default=0.0)
    seq_len: int = _help("row length (longer sequences are truncated, shorter padded)", default=2048)
    pack: bool = _help("pack several sequences into each --seq-len row (anchors, labels, target features and "
                       "each block's context stay within its sequence; equal to training them unpacked, with "
                       "less padding); --no-pack: one sequence per row", default=True)
    loss_chunk: int = _help("tokens per chunk of the lm_head + cross-entropy (bounds the logits memory)",
                            default=1024)
    # optimisation
    lr: float = _help("peak learning rate (AdamW)", default=6e-4)
    warmup_frac: float = _help("fraction of the steps spent in linear warmup", default=0.04)
    min_lr_frac: float = _help("final learning rate of the cosine decay, as a fraction of --lr", default=0.0)
    clip: float = _help("global gradient-norm clipping (0: off)", default=1.0)
    weight_decay: float = _help("AdamW weight decay (matrices only, not norm weights)", default=0.0)
    beta1: float = _help("AdamW beta1", default=0.9)
    beta2: float = _help("AdamW beta2", default=0.95)
    batch_size: int = _help("rows per micro-batch (one sequence each with --no-pack)", default=1)
    grad_accum: int = _help("micro-batches per optimizer step", default=1)
    steps: int = _help("optimizer steps (0: --epochs passes over the data)", default=0)
    epochs: float = _help("passes over the data when --steps is 0", default=1.0)
    seed: int = _help("seed of the draft init, the data order and the anchors", default=0)
    # precision
    dtype: str = _help("compute dtype (draft forward, target forward, features)", default="bfloat16")
    param_dtype: str = _help("master dtype of the trainable draft parameters and the optimizer", default="float32")
    impl: str = _help("draft block attention: auto (Pallas kernel on TPU/GPU, dense reference on CPU) | "
                      "kernel | reference | interpret", default="auto")
    # devices
    mesh: str = _help("device mesh, e.g. data=2,fsdp=2,tensor=2 or auto (all devices on data); empty: one "
                      "device. Rows over data*fsdp (--batch-size must divide by it), draft params and optimizer "
                      "state over fsdp and tensor, the frozen target over tensor (and fsdp)", default="")
    # features
    cache_features: bool = _help("compute the target features once, store them on disk (bf16), train from them",
                                 default=False)
    feature_dir: str = _help("where --cache-features writes / reads the features (default <out>/features)",
                             default="")
    feature_dtype: str = _help("dtype of the cached features", default="bfloat16")
    # checkpoints, logging, evaluation
    save_every: int = _help("save a checkpoint every N steps (and always at the end)", default=500)
    keep_checkpoints: int = _help("how many recent checkpoints to keep", default=3)
    resume: bool = _help("resume from the latest checkpoint in --out (default: automatic when one exists; "
                         "--no-resume starts over and refuses an out dir that has checkpoints)", default=True)
    resume_from: int = _help("resume from this checkpoint step instead of the newest intact one (-1); newer "
                             "checkpoints are moved to <out>/checkpoints.set-aside/", default=-1)
    log_every: int = _help("append metrics to metrics.jsonl every N steps", default=10)
    eval_every: int = _help("measure the real acceptance length every N steps (0: only at the end)", default=0)
    eval_prompts: str = _help("held-out prompts (text lines or JSONL with prompt / prompt_ids); default: the "
                              "prompts of the first training sequences", default="")
    eval_chat: bool = _help("apply the tokenizer's chat template to text --eval-prompts (as make_data --chat)",
                            default=False)
    eval_num_prompts: int = _help("at most this many evaluation prompts", default=8)
    eval_max_new_tokens: int = _help("tokens generated per evaluation prompt", default=64)
    progress: bool = _help("tqdm progress bar", default=True)

    def __post_init__(self):
        errors = []
        for name in ("draft_layers", "num_target_features", "num_anchors", "seq_len", "loss_chunk",
                     "batch_size", "grad_accum", "save_every", "log_every", "keep_checkpoints"):
            if getattr(self, name) < 1:
                errors.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.block_size < 2:
            errors.append(f"--block-size must be >= 2 (an anchor plus at least one predicted token), "
                          f"got {self.block_size}")
        if self.steps < 0 or self.epochs <= 0:
            errors.append("--steps must be >= 0 and --epochs > 0")
        if not 0 <= self.warmup_frac < 1:
            errors.append(f"--warmup-frac must be in [0, 1), got {self.warmup_frac}")
        if self.lr <= 0:
            errors.append(f"--lr must be > 0, got {self.lr}")
        if self.gamma < 0:
            errors.append(f"--gamma must be >= 0 (0: default), got {self.gamma}")
        if self.impl not in ("auto", "kernel", "reference", "interpret"):
            errors.append(f"--impl must be auto, kernel, reference or interpret, got {self.impl!r}")
        for name in ("dtype", "param_dtype", "feature_dtype"):
            if getattr(self, name) not in DTYPES:
                errors.append(f"--{name.replace('_', '-')} must be one of {', '.join(DTYPES)}")
        if self.resume_from < -1:
            errors.append(f"--resume-from must be a checkpoint step (or -1: the newest intact one), got {self.resume_from}")
        if self.resume_from >= 0 and not self.resume:
            errors.append("--resume-from needs --resume (it chooses the checkpoint to resume from)")
        if self.target_layer_ids:
            try:
                self.layer_ids()
            except ValueError:
                errors.append(f"--target-layer-ids must be comma-separated integers, got {self.target_layer_ids!r}")
        errors += self._draft_option_errors()
        if errors:
            raise ValueError("invalid training config:\n  " + "\n  ".join(errors))

    @property
    def gamma_value(self) -> float:
        return self.gamma_of(self.dspark)

    def gamma_of(self, dspark: bool) -> float:
        """--gamma, or its default for a DSpark draft (DeepSpec's 4) or a DFlash one (``default_gamma``); the
        draft's architecture decides (an --init-draft's may differ from --draft-arch)."""
        if self.gamma > 0:
            return self.gamma
        return DSPARK_GAMMA if dspark else default_gamma(self.block_size)

    @property
    def dspark(self) -> bool:
        return self.draft_arch == "dspark"

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.grad_accum

    def layer_ids(self) -> tuple[int, ...] | None:
        if not self.target_layer_ids:
            return None
        return tuple(int(s) for s in self.target_layer_ids.replace(" ", "").split(",") if s)

    def sliding_layer_ids(self) -> tuple[int, ...]:
        """The new draft's sliding-window layers (sorted; ``alternate``: 0, 2, 4, ... of --draft-layers)."""
        spec = self.draft_sliding_layers.replace(" ", "")
        if spec == "alternate":
            return tuple(range(0, self.draft_layers, 2))
        return tuple(sorted({int(s) for s in spec.split(",") if s}))

    def draft_options(self) -> dict:
        """``DraftConfig.for_target``'s keyword arguments for the new draft's own attention and logits."""
        sliding = self.sliding_layer_ids()
        return {"layer_types": tuple("sliding_attention" if i in sliding else "full_attention"
                                     for i in range(self.draft_layers)) if sliding else None,
                "sliding_window": self.draft_sliding_window or None,
                "is_causal": DRAFT_CAUSAL[self.draft_causal],
                "input_embedding_scale": self.draft_embedding_scale,
                "output_multiplier": self.draft_output_multiplier,
                "final_logit_softcapping": self.draft_logit_softcap or None}

    def _draft_option_errors(self) -> list[str]:
        errors = []
        try:
            sliding = self.sliding_layer_ids()
        except ValueError:
            sliding = ()
            errors.append("--draft-sliding-layers must be comma-separated layer ids or 'alternate', got "
                          f"{self.draft_sliding_layers!r}")
        bad = [i for i in sliding if not 0 <= i < self.draft_layers]
        if bad:
            errors.append(f"--draft-sliding-layers {list(sliding)}: ids {bad} are outside the draft's "
                          f"{self.draft_layers} layers (0..{self.draft_layers - 1}, --draft-layers)")
        if sliding and self.draft_sliding_window < 1:
            errors.append(f"--draft-sliding-layers needs --draft-sliding-window W >= 1, got {self.draft_sliding_window}")
        elif not sliding and self.draft_sliding_window:
            errors.append(f"--draft-sliding-window {self.draft_sliding_window} without --draft-sliding-layers: "
                          "no layer would use it")
        if self.draft_causal not in DRAFT_CAUSAL:
            errors.append(f"--draft-causal must be auto, true or false, got {self.draft_causal!r}")
        for name in ("draft_output_multiplier", "draft_embedding_scale"):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) == 0:
                errors.append(f"--{name.replace('_', '-')} must be a finite non-zero number, got {getattr(self, name)}")
        if not (math.isfinite(self.draft_logit_softcap) and self.draft_logit_softcap >= 0):
            errors.append(f"--draft-logit-softcap must be >= 0 (0: off), got {self.draft_logit_softcap}")
        return errors + self._dspark_option_errors()

    def _dspark_option_errors(self) -> list[str]:
        """--draft-arch and the DSpark flags: valid values; DSpark flags only with --draft-arch dspark; a DSpark
        draft's layers are full bidirectional attention with plain logits (DeepSpec's)."""
        errors = []
        if self.draft_arch not in DRAFT_ARCHS:
            return [f"--draft-arch must be one of {', '.join(DRAFT_ARCHS)}, got {self.draft_arch!r}"]
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            errors.append(f"--markov-head-type must be one of {', '.join(MARKOV_HEAD_TYPES)}, "
                          f"got {self.markov_head_type!r}")
        if self.markov_rank < 0:
            errors.append(f"--markov-rank must be >= 0 (0: no Markov head), got {self.markov_rank}")
        weights = ("ce_weight", "l1_weight", "confidence_weight")
        for name in weights:
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                errors.append(f"--{name.replace('_', '-')} must be a finite number >= 0, got {getattr(self, name)}")
        defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
        dspark_only = ("markov_rank", "markov_head_type", "confidence_head") + weights
        if not self.dspark:
            changed = [n for n in dspark_only if getattr(self, n) != defaults[n]]
            if changed:
                errors.append(f"{', '.join('--' + n.replace('_', '-') for n in changed)} set for a "
                              f"--draft-arch {self.draft_arch} draft: DSpark options (--draft-arch dspark)")
            return errors
        changed = [n for n in ("draft_sliding_layers", "draft_causal", "draft_output_multiplier",
                               "draft_logit_softcap", "draft_embedding_scale") if getattr(self, n) != defaults[n]]
        if changed:
            errors.append(f"{', '.join('--' + n.replace('_', '-') for n in changed)}: a DSpark draft's layers are "
                          "full bidirectional attention with plain logits (DeepSpec's); leave them at their defaults")
        return errors

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        d = {"pack": False, **d}  # written before packing existed: those runs trained unpacked
        return cls(**{k: v for k, v in d.items() if k in names})

    def replace(self, **kw) -> "TrainConfig":
        return dataclasses.replace(self, **kw)

    def pretty(self) -> str:
        return json.dumps(self.to_json(), indent=2)


def _field_type(f: dataclasses.Field):
    t = f.type
    if isinstance(t, str):
        t = {"str": str, "int": int, "float": float, "bool": bool}.get(t, t)
    if isinstance(t, (types.UnionType,)) or typing.get_origin(t) is typing.Union:
        t = next(a for a in typing.get_args(t) if a is not type(None))
    return t


_REQUIRED = ("target", "data", "out")


def _choices(name: str):
    if name in ("dtype", "param_dtype", "feature_dtype"):
        return list(DTYPES)
    if name == "draft_causal":
        return list(DRAFT_CAUSAL)
    if name == "draft_arch":
        return list(DRAFT_ARCHS)
    if name == "markov_head_type":
        return list(MARKOV_HEAD_TYPES)
    return ["auto", "kernel", "reference", "interpret"] if name == "impl" else None


def build_parser(prog: str = "python -m train") -> argparse.ArgumentParser:
    """One flag per TrainConfig field: required ones marked, choices listed, each default said once."""
    p = argparse.ArgumentParser(prog=prog, description="Train a DFlash draft for a target model.")
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        t, text = _field_type(f), f.metadata.get("help", "")
        if t is bool:  # BooleanOptionalAction appends its own "(default: ...)"
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default, help=text)
        elif f.name in _REQUIRED:
            p.add_argument(flag, dest=f.name, type=t, required=True, help=text + " (required)")
        else:
            shown = f" (default: {f.default})" if f.default not in ("", None) and "default" not in text else ""
            p.add_argument(flag, dest=f.name, type=t, default=f.default, choices=_choices(f.name),
                           help=text + shown)
    return p


def parse_args(argv=None) -> TrainConfig:
    args = build_parser().parse_args(argv)
    try:
        return TrainConfig(**vars(args))
    except ValueError as e:
        build_parser().error(str(e))
