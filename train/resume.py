"""Resuming a run: which checkpoint (the latest intact one; unreadable or newer ones set aside), what may change
between the original run and the resumed one, and the metrics log cut back to the resumed step."""
from __future__ import annotations

import dataclasses
import json
import os

import jax

from dflash_jax.drafts.config import DraftConfig
from train.orbax_checkpoints import CHECKPOINT_DIR, CheckpointError, Checkpointer
from train.config import TrainConfig
from train.data import TrainData
from train.errors import TrainingError, warn


# Config fields that must not change when resuming (they define the data order, the anchors, the
# model, the objective or its numerics: --dtype is the precision of every forward and gradient); the
# others (steps, logging, evaluation, ...) may. --impl and --loss-chunk may change too: the same
# computation by another kernel / in other chunks (speed and memory), equal up to float rounding; they
# are warned about since the resumed run is then no longer bit-exact.
RESUME_FIXED = ("draft_layers", "block_size", "num_target_features", "target_layer_ids",
                "mask_token_id", "draft_sliding_layers", "draft_sliding_window", "draft_causal",
                "draft_output_multiplier", "draft_logit_softcap", "draft_embedding_scale", "num_anchors", "gamma",
                "seq_len", "batch_size", "grad_accum", "seed", "dtype", "param_dtype", "init_draft", "pack",
                "draft_arch", "markov_rank", "markov_head_type", "confidence_head", "ce_weight", "l1_weight",
                "confidence_weight")


_RESUME_ROUNDING = ("impl", "loss_chunk")


SET_ASIDE_DIR = "checkpoints.set-aside"


def data_summary(data: TrainData) -> dict:
    return {"sequences": len(data), "tokens": data.num_tokens}


def check_resume(meta: dict, cfg: TrainConfig, data: TrainData) -> None:
    old = TrainConfig.from_json(meta["config"])
    moved = [f for f in ("target", "data") if getattr(old, f) != getattr(cfg, f)]
    if moved:
        warn(f"resuming with a different path for {moved} ({[getattr(old, f) for f in moved]} -> "
                      f"{[getattr(cfg, f) for f in moved]}); it must hold the same model / data")
    diff = [f for f in RESUME_FIXED if getattr(old, f) != getattr(cfg, f)]
    if diff:  # before the data check: a changed option (--seq-len) also changes what the data reads as
        raise TrainingError(
            "cannot resume exactly: the checkpoint was made with different " + ", ".join(
                f"--{f.replace('_', '-')} ({getattr(old, f)!r} -> {getattr(cfg, f)!r})" for f in diff)
            + "; use the original values, or a new --out to start over")
    had = meta.get("data_summary")
    if had is not None and had != data_summary(data):
        raise TrainingError(f"cannot resume exactly: the checkpoint was trained on {had['sequences']} sequences / "
                            f"{had['tokens']} tokens, {cfg.data} now holds {len(data)} / {data.num_tokens}; "
                            "use the original data or a new --out")
    changed = [f.name for f in dataclasses.fields(TrainConfig)
               if f.name in ("steps", "epochs", "lr", "warmup_frac", "min_lr_frac", "clip", "weight_decay",
                             "beta1", "beta2") and getattr(old, f.name) != getattr(cfg, f.name)]
    if changed:
        warn(f"resuming with changed {changed}: the optimizer schedule differs from the original run")
    rounding = [f for f in _RESUME_ROUNDING if getattr(old, f) != getattr(cfg, f)]
    if rounding:
        warn(f"resuming with changed {rounding}: the same computation, but the resumed run equals an "
                      "uninterrupted one only up to float rounding (not bit for bit)")


def truncate_metrics(path: str, step: int) -> int:
    """Drop the records of ``metrics.jsonl`` after ``step`` (the steps a resumed run redoes) and any line a
    kill cut short; rewritten atomically (tmp + rename). Returns how many lines were dropped."""
    if not os.path.isfile(path):
        return 0
    keep, dropped = [], 0
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                rec = None
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), (int, float)) or rec["step"] > step:
                dropped += 1
                continue
            keep.append(line if line.endswith("\n") else line + "\n")
    if dropped:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(keep)
        os.replace(tmp, path)
    return dropped


class ResumePoints:
    """The run's checkpoints and which one it resumes from: the newest readable one (or --resume-from's); a
    corrupt one is skipped with a warning (an error when --resume-from chose it) and set aside later."""

    def __init__(self, cfg: TrainConfig, log):
        self.cfg, self.log = cfg, log
        self.ckpt = Checkpointer(os.path.join(cfg.out, CHECKPOINT_DIR), keep=cfg.keep_checkpoints)
        self.steps = sorted(self.ckpt.all_steps(), reverse=True)
        self.latest = self.steps[0] if self.steps else None
        if self.latest is not None and not cfg.resume:
            raise TrainingError(f"{cfg.out} already has checkpoints (latest step {self.latest}); resume (the "
                                "default) or choose a new --out")
        if cfg.resume_from >= 0 and cfg.resume_from not in self.steps:
            raise TrainingError(f"--resume-from {cfg.resume_from}: {self.ckpt.directory} has no checkpoint of that "
                                f"step (steps there: {sorted(self.steps) or 'none'})")
        self.candidates = [cfg.resume_from] if cfg.resume_from >= 0 else self.steps
        self.unreadable: list[int] = []

    def skip(self, step: int, err: CheckpointError) -> None:
        """A corrupt checkpoint: an error if --resume-from chose it, else a warning and the previous one."""
        if self.cfg.resume_from >= 0:
            raise TrainingError(f"{err}; choose another --resume-from (steps: {sorted(self.steps)})")
        self.unreadable.append(step)
        msg = (f"{err}; skipping it and resuming from the newest intact checkpoint before it (the unreadable one "
               f"is moved to {os.path.join(self.cfg.out, SET_ASIDE_DIR)})")
        self.log(f"warning: {msg}")
        warn(msg)

    def readable_meta(self, before: int | None = None) -> tuple[int, dict]:
        """(step, meta) of the newest readable candidate (older than ``before`` when given)."""
        for s in self.candidates:
            if s not in self.unreadable and (before is None or s < before):
                try:
                    return s, self.ckpt.meta(s)
                except CheckpointError as e:
                    self.skip(s, e)
        raise TrainingError(f"no intact checkpoint in {self.ckpt.directory}: steps {self.unreadable} are "
                            "unreadable; move them away to start over, or choose a new --out")

    def restore(self, cfg: TrainConfig, data: TrainData, dcfg: DraftConfig, params_like, opt_like):
        """(params, opt_state, meta) of the newest checkpoint that restores, falling back past corrupt ones."""
        while True:
            try:
                return self.ckpt.restore(self.latest, params_like, opt_like)
            except CheckpointError as e:
                self.skip(self.latest, e)
                self.latest, meta = self.readable_meta(before=self.latest)
                check_resume(meta, cfg, data)
                if DraftConfig.from_hf(meta["draft_config"]) != dcfg:
                    raise TrainingError(f"checkpoint {self.ckpt.step_dir(self.latest)} holds another draft "
                                        "architecture than the newer (unreadable) ones; resume it with "
                                        f"--resume-from {self.latest}") from None

    def set_aside_newer(self, primary: bool) -> None:
        """Move the checkpoints after the resumed one away (unreadable ones, or newer than --resume-from): this
        run writes those steps again."""
        newer = [s for s in self.ckpt.all_steps() if s > self.latest]
        if not newer:
            return
        if primary:
            for s in newer:
                dest = self.ckpt.set_aside(s, os.path.join(self.cfg.out, SET_ASIDE_DIR))
                self.log(f"moved the {'unreadable' if s in self.unreadable else 'newer'} checkpoint of step {s} "
                         f"to {dest}")
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("dflash_set_aside_checkpoints")
        self.ckpt.reload()
