"""The training loop: ``train(TrainConfig) -> Draft`` (``python -m train`` is a thin CLI over it).

One optimizer step = ``grad_accum`` micro-batches of ``batch_size`` sequences, scanned inside one
jitted function: per micro-batch, anchors from (seed, epoch, example index), target features
(online: a frozen forward under stop_gradient; offline: read from the feature cache), the weighted
block loss's gradient (unnormalised sums, so the step's loss is normalised by the total weight of
the whole global batch). Then global-norm clipping + AdamW (warmup + cosine); only the draft's own
parameters (fc, hidden_norm, layers, norm) are trained: the target's embedding and lm_head are
inputs of the step, never differentiated. A non-finite loss or gradient leaves the state unchanged
and stops the run with the last good state saved.

Sequences are packed several to a row by default (``--no-pack``: one per row, padded): anchors,
labels, the target's features (attention, and the conv window and recurrent state of Gated
DeltaNet layers) and each block's context stay within a document, so a packed row trains exactly as
its sequences would unpacked, with far less padding.

Data order and anchors depend only on (seed, step), and checkpoints hold the params, the optimizer
state (with its step count) and the data position, so a resumed run continues bit-for-bit.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import math
import os
import resource
import shutil
import sys
import time
import warnings
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dflash_jax import model_sharding, sharding
from dflash_jax.checkpoints import load_tokenizer, resolve_dtype
from dflash_jax.drafts.config import MASK_TOKEN, DraftConfig, choose_target_layer_ids
from dflash_jax.draft import Draft, check_fits, draft_param_shapes, init_draft_params, load_draft
from dflash_jax.families import gemma4
from dflash_jax.prompts import encode_prompt, read_prompts
from dflash_jax.target import Target, load_target
from train import dspark_objective, objective
from train.checkpoint import CHECKPOINT_DIR, CheckpointError, Checkpointer
from train.config import TrainConfig
from train.data import TrainData
from train.optim import make_optimizer, warmup_cosine
from dflash_jax.progress import progress_bar

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
# The collapse warning: this many consecutive steps with the loss within COLLAPSE_TOL nats of ln(vocab)
# (uniform predictions) or a gradient norm of exactly 0.
COLLAPSE_STEPS = 5
COLLAPSE_TOL = 1e-3
SET_ASIDE_DIR = "checkpoints.set-aside"


class TrainingDiverged(RuntimeError):
    """The run itself failed (a non-finite loss): not bad input; ``python -m train`` exits 1."""


class TrainingError(RuntimeError):
    """The run cannot start or resume as asked (inconsistent resume, unreadable checkpoints, ...); the message
    says what to do."""


# --- model setup --------------------------------------------------------------------------------------


def default_mask_token_id(target: Target, tokenizer=None) -> int:
    """The tokenizer's ``<|MASK|>`` token when it has one, else its own mask token (Gemma 4's ``<mask>``, 4, as
    DeepSpec's Gemma 4 draft); else the first embedding row the tokenizer never produces (Qwen3: 151669, as the
    released drafts), else the pad token, else the last vocabulary id."""
    v = target.config.vocab_size
    if tokenizer is not None:
        unk = getattr(tokenizer, "unk_token_id", None)
        for mask in (tokenizer.convert_tokens_to_ids(MASK_TOKEN), getattr(tokenizer, "mask_token_id", None)):
            if isinstance(mask, int) and mask != unk and 0 <= mask < v:
                return mask
    if tokenizer is not None and len(tokenizer) < v:
        return len(tokenizer)
    if target.config.pad_token_id is not None and 0 <= target.config.pad_token_id < v:
        return int(target.config.pad_token_id)
    return v - 1


def build_draft_config(cfg: TrainConfig, target: Target, tokenizer=None) -> DraftConfig:
    """The draft ``python -m train`` makes for ``target`` (``DraftConfig.for_target``) from the flags: its
    layers, block size, target layer ids (chosen when not given), mask token, and its own attention and
    logits (``TrainConfig.draft_options``)."""
    L = target.config.num_hidden_layers
    ids = cfg.layer_ids() or choose_target_layer_ids(L, cfg.num_target_features)
    bad = [i for i in ids if not -1 <= i < L]
    if bad:
        raise ValueError(f"--target-layer-ids {list(ids)}: ids {bad} are outside the target's {L} layers "
                         f"(-1..{L - 1}, -1 the embedding output)")
    mask_id = cfg.mask_token_id if cfg.mask_token_id >= 0 else default_mask_token_id(target, tokenizer)
    dcfg = DraftConfig.for_target(target.config, draft_layers=cfg.draft_layers, block_size=cfg.block_size,
                                  mask_token_id=mask_id, target_layer_ids=ids, **cfg.draft_options())
    return dspark_config(cfg, dcfg, target.config) if cfg.dspark else dcfg


def dspark_config(cfg: TrainConfig, dcfg: DraftConfig, tcfg) -> DraftConfig:
    """The DSpark draft of the DFlash draft ``dcfg`` made from the same flags (the same layer stack, block, target
    layers and mask token; full bidirectional layers, which the flags' checks keep): its Markov and confidence
    heads from the flags, the confidence head reading the Markov embedding when there is one (DeepSpec's default),
    ``num_anchors`` kept for the export as DeepSpec writes it. A Gemma 4 target gets DeepSpec's
    ``Gemma4DSparkModel`` instead of Qwen3 layers: ``gemma4.dspark_stack`` and the target's logit soft cap.
    DraftConfig checks the result."""
    if isinstance(tcfg, gemma4.Gemma4Config):
        dcfg = dataclasses.replace(dcfg, layers=gemma4.dspark_stack(tcfg, dcfg.layers.num_hidden_layers),
                                   final_logit_softcapping=tcfg.final_logit_softcapping)
    return dataclasses.replace(dcfg, architecture="dspark", markov_rank=cfg.markov_rank,
                               markov_head_type=cfg.markov_head_type if cfg.markov_rank else None,
                               confidence_head=cfg.confidence_head,
                               confidence_with_markov=cfg.markov_rank > 0 if cfg.confidence_head else None,
                               num_anchors=cfg.num_anchors)


def with_target_copies(params, target: Target, dtype):
    """A new DSpark draft's params with ``embed_tokens`` / ``lm_head`` copied from the target (a tied target's head
    is its embedding, transposed), as DeepSpec initialises them; they stay frozen."""
    tp = target.params
    if "embed_tokens" not in tp:
        raise TrainingError(f"the target ({target.config.model_type}) keeps no plain embed_tokens table for a DSpark "
                            "draft to copy")
    emb = tp["embed_tokens"]["embedding"]
    head = tp["lm_head"]["kernel"] if "lm_head" in tp else emb.T
    # copies, not views: the step donates the draft's buffers, and the target's must survive it
    return dict(params, embed_tokens={"embedding": jnp.array(emb, dtype, copy=True)},
                lm_head={"kernel": jnp.array(head, dtype, copy=True)})


def feature_layer_ids(tcfg, dcfg: DraftConfig) -> tuple[int, ...]:
    """The target layers whose outputs a training step reads (a DSpark draft's also the last one, for p_t)."""
    return dspark_objective.feature_layer_ids(tcfg, dcfg) if dcfg.shifted else tuple(dcfg.target_layer_ids)


# The flags of TrainConfig.draft_options, by DraftConfig.for_target keyword
_DRAFT_OPTION_FLAGS = {"layer_types": "--draft-sliding-layers", "sliding_window": "--draft-sliding-window",
                       "is_causal": "--draft-causal", "input_embedding_scale": "--draft-embedding-scale",
                       "output_multiplier": "--draft-output-multiplier",
                       "final_logit_softcapping": "--draft-logit-softcap"}


def _draft_options_of(dcfg: DraftConfig) -> dict:
    """An existing draft's values of ``TrainConfig.draft_options`` (what an --init-draft fixes)."""
    layers = dcfg.layers
    return {"layer_types": layers.layer_types if "sliding_attention" in layers.layer_types else None,
            "sliding_window": layers.sliding_window, "is_causal": dcfg.is_causal,
            "input_embedding_scale": dcfg.input_embedding_scale, "output_multiplier": dcfg.output_multiplier,
            "final_logit_softcapping": dcfg.final_logit_softcapping}


def _ignored_draft_flags(cfg: TrainConfig, dcfg: DraftConfig) -> list[str]:
    """The draft-architecture flags whose values ``dcfg`` (an --init-draft's config, which wins) does not have."""
    flags = [f for f, ours, theirs in (("--block-size", cfg.block_size, dcfg.block_size),
                                       ("--draft-layers", cfg.draft_layers, dcfg.layers.num_hidden_layers),
                                       ("--draft-arch", cfg.draft_arch, dcfg.architecture))
             if ours != theirs]
    if dcfg.shifted:
        theirs = {"markov_rank": dcfg.markov_rank, "confidence_head": dcfg.confidence_head}
        if dcfg.markov:
            theirs["markov_head_type"] = dcfg.markov_head_type
        flags += [f"--{k.replace('_', '-')}" for k, v in theirs.items() if getattr(cfg, k) != v]
    ours, theirs = cfg.draft_options(), _draft_options_of(dcfg)
    return flags + [flag for k, flag in _DRAFT_OPTION_FLAGS.items() if ours[k] != theirs[k]]


def lr_at(cfg: TrainConfig, step: int, total_steps: int) -> float:
    """Learning rate of update ``step`` (0-based): linear warmup over round(warmup_frac * total) steps
    (reaching --lr at the last warmup step), then cosine decay to min_lr_frac * lr at the last step."""
    warmup = int(round(cfg.warmup_frac * total_steps))
    return warmup_cosine(step, peak=cfg.lr, warmup=warmup, cosine_steps=total_steps - warmup - 1,
                         final_frac=cfg.min_lr_frac)


_STEP_FIELDS = ("seed", "num_anchors", "block_size", "gamma", "impl", "loss_chunk", "dtype", "clip",
                "weight_decay", "beta1", "beta2", "mesh", "draft_arch", "ce_weight", "l1_weight", "confidence_weight")
_step_cache: dict = {}


def cached_train_step(cfg: TrainConfig, tcfg, dcfg: DraftConfig, *, offline: bool):
    """(optimizer, step fn), reused across ``train`` calls in one process with the same settings (a resumed
    or extended run in the same process does not compile again)."""
    key = (tuple(getattr(cfg, f) for f in _STEP_FIELDS), tcfg, dcfg, offline)
    if key not in _step_cache:
        if len(_step_cache) >= 8:
            _step_cache.pop(next(iter(_step_cache)))
        frozen = dspark_objective.FROZEN if dcfg.own_embeddings else ()
        optimizer = make_optimizer(cfg.clip, cfg.beta1, cfg.beta2, cfg.weight_decay, frozen)
        _step_cache[key] = (optimizer, make_train_step(cfg, tcfg, dcfg, optimizer, offline=offline))
    return _step_cache[key]


def make_train_step(cfg: TrainConfig, tcfg, dcfg: DraftConfig, optimizer, *, offline: bool):
    """Jitted ``step(params, opt_state, tparams, ids, mask, idx, epoch, feats, lr, starts=None)`` ->
    (params, opt_state, sums, ok, grad_norm); ids/mask [A, B, S], idx [A, B], feats [A, B, S, F] or None,
    starts [A, B, S] (packed rows: ``TrainData.batch``'s doc_start) or None.
    params / opt_state are donated; when ``ok`` is False they come back unchanged. On ``cfg.mesh`` the
    block-attention kernel runs per shard (traced with that mesh: ``sharding.mesh_scope``)."""
    mesh = sharding.make_mesh(cfg.mesh) if cfg.mesh else None
    dtype = resolve_dtype(cfg.dtype)
    if dcfg.shifted:  # DSpark: shifted labels, the Markov / confidence heads, the three-term loss
        weights = dspark_objective.slot_weights(dcfg.block_size, cfg.gamma_of(True))
        loss_sums = functools.partial(dspark_objective.loss_sums,
                                      loss_weights=(cfg.ce_weight, cfg.l1_weight, cfg.confidence_weight))
    else:
        weights = objective.position_weights(dcfg.block_size, cfg.gamma_of(False))
        loss_sums = objective.loss_sums
    layer_ids = feature_layer_ids(tcfg, dcfg)

    def micro(params, tparams, batch, epoch):
        """(grads, sums) of one micro-batch ``batch`` = (ids, mask, idx, feats or None, starts or None)."""
        ids, mask, idx, feats, starts = batch
        anchors = objective.sample_batch_anchors(cfg.seed, epoch, idx, mask, cfg.num_anchors, starts)
        if feats is None:
            feats = objective.target_features(tcfg, tparams, ids, layer_ids, starts)

        def f(p):
            s = loss_sums(tcfg, tparams, dcfg, p, ids, mask, anchors, feats, weights=weights,
                          impl=cfg.impl, chunk=cfg.loss_chunk, dtype=dtype, doc_start=starts)
            return s["wce"], s

        (_, sums), grads = jax.value_and_grad(f, has_aux=True)(params)
        return grads, sums

    # positional: the jitted step's operands (params / opt_state donated by position)
    def update(params, opt_state, tparams, ids, mask, idx, epoch, feats, lr, starts=None):
        batch = (ids, mask, idx, feats, starts)
        first = jax.tree_util.tree_map(lambda a: a[0], batch)  # None leaves (no feats / starts) stay None
        grads, sums = micro(params, tparams, first, epoch)
        if ids.shape[0] > 1:
            def body(carry, xs):
                return jax.tree_util.tree_map(jnp.add, carry, micro(params, tparams, xs, epoch)), None

            rest = jax.tree_util.tree_map(lambda a: a[1:], batch)
            (grads, sums), _ = jax.lax.scan(body, (grads, sums), rest)
        weight = jnp.maximum(sums["weight"], 1e-12)
        grads = jax.tree_util.tree_map(lambda g: g / weight, grads)
        loss = sums["wce"] / weight
        gnorm = optax.tree.norm(grads)
        updates, new_opt = optimizer.update(grads, opt_state, params)
        new_params = jax.tree_util.tree_map(lambda p, u: (p - lr * u).astype(p.dtype), params, updates)
        ok = jnp.isfinite(loss) & jnp.isfinite(gnorm)
        keep = lambda new, old: jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa: E731
        return keep(new_params, params), keep(new_opt, opt_state), sums, ok, gnorm

    # positional: as update's (the jitted operands)
    def step(params, opt_state, tparams, ids, mask, idx, epoch, feats, lr, starts=None):
        with sharding.mesh_scope(mesh):
            return update(params, opt_state, tparams, ids, mask, idx, epoch, feats, lr, starts)

    return jax.jit(step, donate_argnums=(0, 1))


# --- evaluation ---------------------------------------------------------------------------------------


def prompts_from_data(data: TrainData, n: int) -> list[list[int]]:
    """The prompt (everything before the first supervised token) of the first ``n`` training sequences."""
    out = []
    for ids, mask in zip(data.ids[:n], data.masks[:n]):
        first = int(np.argmax(mask > 0)) if mask.any() else len(ids)
        out.append(ids[:max(first, 1)].tolist())
    return out


def load_eval_prompts(path: str, tokenizer, n: int, chat: bool = False) -> list[list[int]]:
    """The first ``n`` prompts of a prompts file, encoded as ``infer.generate`` encodes them."""
    return [encode_prompt(r, tokenizer, chat) for r in read_prompts(path)[:n]]


def evaluate(target: Target, draft: Draft, prompts: list[list[int]], *, max_new_tokens: int,
             stop_token_ids=None) -> dict:
    """Real acceptance length: greedy speculative decoding of ``prompts``; tau = mean over all verify steps
    of (accepted drafts + 1), as in the paper."""
    from dflash_jax.decode import speculative_generate

    dtype = jax.tree_util.tree_leaves(target.params)[0].dtype
    d = Draft(draft.config, objective.cast_tree(draft.params, dtype), draft.path)
    res = speculative_generate(target, d, prompts, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids)
    acc = [a for r in res for a in r.acceptance_lengths]
    gen = sum(r.num_generated for r in res)
    wall = max(r.wall_time_s for r in res) if res else 0.0
    return {"tau": float(np.mean(acc)) if acc else 0.0,
            "tau_per_prompt": [round(r.mean_acceptance_length, 3) for r in res],
            "verify_steps": len(acc), "generated": gen,
            "tokens_per_second": gen / wall if wall > 0 else 0.0}


# --- the loop -------------------------------------------------------------------------------------------


def _warn(msg: str) -> None:
    """``warnings.warn`` attributed to the first caller outside this module (``train``'s caller)."""
    frame, level = inspect.currentframe().f_back, 2  # level 1 is this function
    while frame is not None and frame.f_code.co_filename == __file__:
        frame, level = frame.f_back, level + 1
    warnings.warn(msg, stacklevel=level)


def peak_memory_mb() -> float:
    """Peak resident memory of this process (ru_maxrss: KiB on Linux, bytes on macOS)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / (1024 * 1024) if sys.platform == "darwin" else r / 1024


def _data_summary(data: TrainData) -> dict:
    return {"sequences": len(data), "tokens": data.num_tokens}


def _check_resume(meta: dict, cfg: TrainConfig, data: TrainData) -> None:
    old = TrainConfig.from_json(meta["config"])
    moved = [f for f in ("target", "data") if getattr(old, f) != getattr(cfg, f)]
    if moved:
        _warn(f"resuming with a different path for {moved} ({[getattr(old, f) for f in moved]} -> "
                      f"{[getattr(cfg, f) for f in moved]}); it must hold the same model / data")
    diff = [f for f in RESUME_FIXED if getattr(old, f) != getattr(cfg, f)]
    if diff:  # before the data check: a changed option (--seq-len) also changes what the data reads as
        raise TrainingError(
            "cannot resume exactly: the checkpoint was made with different " + ", ".join(
                f"--{f.replace('_', '-')} ({getattr(old, f)!r} -> {getattr(cfg, f)!r})" for f in diff)
            + "; use the original values, or a new --out to start over")
    had = meta.get("data_summary")
    if had is not None and had != _data_summary(data):
        raise TrainingError(f"cannot resume exactly: the checkpoint was trained on {had['sequences']} sequences / "
                            f"{had['tokens']} tokens, {cfg.data} now holds {len(data)} / {data.num_tokens}; "
                            "use the original data or a new --out")
    changed = [f.name for f in dataclasses.fields(TrainConfig)
               if f.name in ("steps", "epochs", "lr", "warmup_frac", "min_lr_frac", "clip", "weight_decay",
                             "beta1", "beta2") and getattr(old, f.name) != getattr(cfg, f.name)]
    if changed:
        _warn(f"resuming with changed {changed}: the optimizer schedule differs from the original run")
    rounding = [f for f in _RESUME_ROUNDING if getattr(old, f) != getattr(cfg, f)]
    if rounding:
        _warn(f"resuming with changed {rounding}: the same computation, but the resumed run equals an "
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


class CollapseDetector:
    """Warns once (``warn(message)``) when the cross-entropy sits at ln(vocab) -- the draft predicts the uniform
    distribution -- or the gradient norm is exactly 0 for ``COLLAPSE_STEPS`` consecutive steps (the cross-entropy,
    not the loss: a DSpark loss adds other terms)."""

    def __init__(self, vocab_size: int, lr: float, warn: Callable[[str], None]):
        self.ln_v, self.lr, self.warn = math.log(vocab_size), lr, warn
        self.run, self.warned = 0, False

    def update(self, step: int, loss: float, grad_norm: float) -> None:  # loss: the cross-entropy
        flat = abs(loss - self.ln_v) <= COLLAPSE_TOL or grad_norm == 0.0
        self.run = self.run + 1 if flat else 0
        if self.run >= COLLAPSE_STEPS and not self.warned:
            self.warned = True
            self.warn(f"the draft has collapsed: for {self.run} steps in a row (steps {step - self.run + 1}..{step}) "
                      f"the cross-entropy sat at ln(vocab) = {self.ln_v:.4f} (uniform predictions) or the gradient "
                      f"norm was 0 (now: cross-entropy {loss:.4f}, gradient norm {grad_norm:.3g}); it is not learning "
                      f"and will not recover. The learning rate is probably too high: start over with a lower --lr "
                      f"(now {self.lr:g}; default 6e-4) and a new --out")

def device_batch(data: TrainData, store, idx, mesh, dtype):
    """(ids, mask, idx, feats or None, doc starts or None) of the global step ``idx`` [A, B] on the device(s).
    On a mesh each process reads only its ``process_slice`` of the B rows and the rows are split over
    data*fsdp. Cached features travel in their storage dtype and are cast on the device (one compiled step
    for any cache dtype)."""
    if mesh is not None:
        idx = idx[:, sharding.process_slice(idx.shape[1])]
    ids, mask, starts = data.batch(idx)
    feats = None if store is None else store.batch(idx)
    if mesh is None:
        put = lambda x: None if x is None else jnp.asarray(x)  # noqa: E731
    else:
        put = lambda x: None if x is None else sharding.shard_local_batch(x, mesh, batch_axis=1)  # noqa: E731
    feats = put(feats)
    return (put(ids), put(mask), put(np.asarray(idx, np.int32)), None if feats is None else feats.astype(dtype),
            put(starts))


def _load_inputs(cfg: TrainConfig, target: Target | None, log) -> tuple:
    """(mesh or None, target (cast to --dtype, on the mesh), tokenizer, data) of a run."""
    mesh = sharding.make_mesh(cfg.mesh) if cfg.mesh else None
    if mesh is not None:
        sharding.check_batch_rows(cfg.batch_size, mesh, "--batch-size (rows of a micro-batch)")
        if cfg.cache_features and jax.process_count() > 1:
            raise TrainingError("--cache-features with several processes is not supported (each process would "
                                "need every feature row); train with online features on a multi-host mesh")
        log(f"mesh: {sharding.mesh_str(mesh)} over {mesh.size} devices, {jax.process_count()} process(es)")
    if target is None:
        if not cfg.target:
            raise ValueError("TrainConfig.target is required")
        if mesh is None:
            target = load_target(cfg.target, dtype=cfg.dtype)
        else:  # each tensor straight onto its shards
            target, _ = model_sharding.load_sharded(cfg.target, None, mesh, cfg.dtype)
    else:
        target = Target(target.config, objective.cast_tree(target.params, resolve_dtype(cfg.dtype)), target.path)
        if mesh is not None:
            target = model_sharding.shard_target(target, mesh)
    tokenizer = load_tokenizer(target.path)
    data = TrainData.load(cfg.data, seq_len=cfg.seq_len, block_size=cfg.block_size,
                          vocab_size=target.config.vocab_size, allow_partial=cfg.allow_partial_data, pack=cfg.pack)
    if cfg.pack:
        log(data.packing_summary())
    return mesh, target, tokenizer, data


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
        _warn(msg)

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
                _check_resume(meta, cfg, data)
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


def _init_draft(cfg: TrainConfig) -> Draft:
    """The --init-draft to start from (DFlash v1 or DSpark); warns about the architecture flags it overrides."""
    init = load_draft(cfg.init_draft, dtype=cfg.param_dtype)
    dcfg = init.config
    if dcfg.convolves:
        raise TrainingError(f"--init-draft {cfg.init_draft} is a DFlash2 draft (DFlash2DraftModel): DFlash2 "
                            "drafts can be loaded and served but not trained here, because the training recipe "
                            "of their candidate selector is not public; start from a DFlash (DFlashDraftModel) "
                            "draft or train a new one")
    ignored = _ignored_draft_flags(cfg, dcfg)
    if ignored:
        sliding = [i for i, t in enumerate(dcfg.layers.layer_types) if t == "sliding_attention"]
        _warn(f"--init-draft {cfg.init_draft} fixes the architecture: block_size {dcfg.block_size}, "
                      f"{dcfg.layers.num_hidden_layers} layers, target_layer_ids {list(dcfg.target_layer_ids)}, "
                      f"sliding layers {sliding} (window {dcfg.layers.sliding_window}), is_causal "
                      f"{dcfg.is_causal}, input_embedding_scale {dcfg.input_embedding_scale}, output_multiplier "
                      f"{dcfg.output_multiplier}, final_logit_softcapping {dcfg.final_logit_softcapping} "
                      f"(the {' / '.join(ignored)} given are ignored)")
    return init


def _choose_draft(cfg: TrainConfig, target: Target, tokenizer, data: TrainData, points: ResumePoints):
    """(cfg, draft config, initial params or None when resuming): the checkpoint's draft, --init-draft's, or a
    new one from the flags; checked against the target."""
    param_dtype = resolve_dtype(cfg.param_dtype)
    params = None
    if points.latest is not None:
        points.latest, meta = points.readable_meta()
        _check_resume(meta, cfg, data)
        dcfg = DraftConfig.from_hf(meta["draft_config"])
        dcfg.check_fits(target.config)
    else:
        if cfg.init_draft:
            init = _init_draft(cfg)
            dcfg, params = init.config, init.params
        else:
            dcfg = build_draft_config(cfg, target, tokenizer)
            params = init_draft_params(dcfg, cfg.seed, param_dtype)
            if dcfg.own_embeddings:
                params = with_target_copies(params, target, param_dtype)
        check_fits(target, Draft(dcfg, params))
    if dcfg.block_size != cfg.block_size:
        cfg = cfg.replace(block_size=dcfg.block_size)
    return cfg, dcfg, params


class _Window:
    """The steps since the last metrics record (the first step, which compiles, is left out)."""

    def __init__(self):
        self.sums, self.tokens, self.time, self.steps = None, 0, 0.0, 0

    def add(self, sums, tokens: int, dt: float) -> None:
        self.sums = sums if self.sums is None else jax.tree_util.tree_map(np.add, self.sums, sums)
        self.tokens += tokens
        self.time += dt
        self.steps += 1


class TrainRun:
    """One ``train`` call as steps: ``__init__`` sets up (model, data, draft, optimizer state fresh or resumed,
    feature cache, evaluation prompts), ``run`` does the optimizer steps, ``finish`` saves and evaluates."""

    def __init__(self, cfg: TrainConfig, target: Target | None, log):
        self.primary = jax.process_index() == 0  # on several processes only the first logs and writes files
        self.log = log if self.primary else (lambda *a, **k: None)
        self.log(f"training config:\n{cfg.pretty()}")
        self.mesh, self.target, tokenizer, self.data = _load_inputs(cfg, target, self.log)
        self.points = ResumePoints(cfg, self.log)
        self.ckpt = self.points.ckpt
        self.cfg, self.dcfg, params = _choose_draft(cfg, self.target, tokenizer, self.data, self.points)
        cfg = self.cfg
        self.spe = self.data.steps_per_epoch(cfg.global_batch)
        self.total = cfg.steps or max(1, int(math.ceil(cfg.epochs * self.spe)))
        self.optimizer, self.step_fn = cached_train_step(cfg, self.target.config, self.dcfg,
                                                         offline=cfg.cache_features)
        self.params, self.opt_state, self.start = self._initial_state(params)
        self._log_setup()
        self.store = self._feature_store()
        self.eval_prompts = (load_eval_prompts(cfg.eval_prompts, tokenizer, cfg.eval_num_prompts, cfg.eval_chat)
                             if cfg.eval_prompts else prompts_from_data(self.data, cfg.eval_num_prompts))
        self.stop_ids = list(self.target.config.eos_token_id) or None
        self.metrics_path = os.path.join(cfg.out, "metrics.jsonl")
        if self.primary:  # the records of steps this run does (again): a resumed run redoes the steps after start
            dropped = truncate_metrics(self.metrics_path, self.start)
            if dropped:
                self.log(f"{self.metrics_path}: dropped {dropped} records after step {self.start} (this run "
                         "redoes those steps)")
        self.collapse = CollapseDetector(self.target.config.vocab_size, cfg.lr, self._warn_collapse)
        self.step, self.tokens_total, self.last = self.start, 0, {}

    # --- setup -------------------------------------------------------------------------------------------

    def _initial_state(self, params) -> tuple:
        """(params, opt_state, start step): restored from the resumed checkpoint, or fresh; on the mesh."""
        cfg, mesh, points = self.cfg, self.mesh, self.points
        if points.latest is not None:
            param_dtype = resolve_dtype(cfg.param_dtype)
            params = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, param_dtype),
                                            draft_param_shapes(self.dcfg))
        opt_like = jax.eval_shape(self.optimizer.init, params)
        if mesh is not None:  # draft params and optimizer state over fsdp / tensor (any checkpoint restores onto it)
            rules = model_sharding.model_rules(mesh, self.target.config, self.dcfg)
            p_shard = model_sharding.param_shardings(self.dcfg, mesh, rules, params)
            o_shard = sharding.opt_state_shardings(opt_like, p_shard, mesh, params)
        if points.latest is None:
            if mesh is not None:
                params = sharding.shard_params(params, p_shard)
            opt_state = self.optimizer.init(params)
            if mesh is not None:
                opt_state = sharding.shard_params(opt_state, o_shard)
            return params, opt_state, 0
        if mesh is not None:
            params, opt_like = sharding.abstract_like(params, p_shard), sharding.abstract_like(opt_like, o_shard)
        params, opt_state, meta = points.restore(cfg, self.data, self.dcfg, params, opt_like)
        if mesh is None:
            # orbax returns arrays committed to a device; fresh ones are uncommitted, and jit keys its cache on
            # that: re-create them uncommitted so a resumed run reuses the compiled step
            params, opt_state = jax.tree_util.tree_map(lambda x: jnp.asarray(np.asarray(x)), (params, opt_state))
        start = int(meta["step"])
        points.set_aside_newer(self.primary)
        self.log(f"resumed from {self.ckpt.directory}/{points.latest} (step {start}, epoch {meta['epoch']})")
        return params, opt_state, start

    def _log_setup(self) -> None:
        """Say what is trained on what, and write config.json (process 0)."""
        cfg, target, dcfg, data = self.cfg, self.target, self.dcfg, self.data
        n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(self.params))
        self.log(f"target: {target.path} ({target.config.num_hidden_layers} layers, hidden "
                 f"{target.config.hidden_size}, vocab {target.config.vocab_size}); draft: "
                 f"{dcfg.layers.num_hidden_layers} layers, {n_params / 1e6:.2f}M params, block {dcfg.block_size}, "
                 f"target_layer_ids {list(dcfg.target_layer_ids)}, mask id {dcfg.mask_token_id}, gamma "
                 f"{cfg.gamma_of(dcfg.shifted):.3g}" + (f"; DSpark (Markov rank {dcfg.markov_rank}, confidence head "
                                                        f"{dcfg.confidence_head}; embed_tokens / lm_head frozen)"
                                                        if dcfg.shifted else ""))
        self.log(f"data: {len(data)} sequences, {data.num_tokens} tokens; {self.spe} steps/epoch of "
                 f"{cfg.global_batch} {'rows' if cfg.pack else 'sequences'}; {self.total} steps")
        if self.primary:
            with open(os.path.join(cfg.out, "config.json"), "w") as f:
                json.dump({"train_config": cfg.to_json(), "draft_config": dcfg.to_hf(), "total_steps": self.total,
                           "steps_per_epoch": self.spe}, f, indent=2)

    def _feature_store(self):
        """The cached target features (--cache-features), built once on disk; None for online features."""
        cfg = self.cfg
        if not cfg.cache_features:
            return None
        from train.features import build_feature_store

        store = build_feature_store(self.target, feature_layer_ids(self.target.config, self.dcfg), self.data,
                                    cfg.feature_dir or os.path.join(cfg.out, "features"),
                                    batch_size=cfg.batch_size, dtype=cfg.feature_dtype, progress=cfg.progress,
                                    log=self.log)
        self.log(f"features: {store.nbytes / 2**20:.1f} MiB on disk ({cfg.feature_dtype}) in {store.directory}")
        return store

    # --- records -----------------------------------------------------------------------------------------

    def _warn_collapse(self, msg: str) -> None:
        self.log(f"warning: {msg}")
        _warn(msg)

    def write_metrics(self, rec: dict) -> None:
        if self.primary:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(rec) + "\n")

    def meta_for(self, step: int) -> dict:
        """The meta saved with the checkpoint of ``step``: data position, config, the last step's metrics."""
        cfg, spe = self.cfg, self.spe
        epoch, pos = divmod(step, spe)
        return {"step": step, "epoch": epoch, "step_in_epoch": pos, "steps_per_epoch": spe, "total_steps": self.total,
                "examples_seen": step * cfg.global_batch, "seed": cfg.seed,
                "rng": [int(x) for x in np.asarray(jax.random.key_data(jax.random.PRNGKey(cfg.seed)))],
                "config": cfg.to_json(), "draft_config": self.dcfg.to_hf(), "data_summary": _data_summary(self.data),
                "metrics": self.last}

    def save(self, step: int) -> None:
        self.ckpt.save(step, self.params, self.opt_state, self.meta_for(step))

    def run_eval(self, step: int) -> dict:
        """Measure the real acceptance length on the evaluation prompts; one metrics record."""
        r = evaluate(self.target, Draft(self.dcfg, self.params), self.eval_prompts,
                     max_new_tokens=self.cfg.eval_max_new_tokens, stop_token_ids=self.stop_ids)
        rec = {"step": step, "eval": True, "prompts": "held-out" if self.cfg.eval_prompts else "training", **r}
        self.write_metrics(rec)
        self.log(f"step {step}: acceptance length tau = {r['tau']:.3f} on {len(self.eval_prompts)} "
                 f"{rec['prompts']} prompts")
        return r

    def log_window(self, window: _Window, cur: dict, compile_s, t_run: float) -> None:
        """One metrics record (and, without a progress bar, one log line) for the steps of ``window``."""
        rec = {"step": self.step, "epoch": cur["epoch"], "lr": cur["lr"], "grad_norm": cur["grad_norm"],
               **(objective.summarize(window.sums) if window.sums is not None else cur),
               "tokens_per_s": window.tokens / window.time if window.time > 0 else None,
               "step_time_s": window.time / window.steps if window.steps else None,
               "compile_s": compile_s, "peak_memory_mb": round(peak_memory_mb(), 1),
               "features": "offline" if self.store is not None else "online",
               "elapsed_s": time.perf_counter() - t_run}
        rec.pop("step", None)
        self.write_metrics({"step": self.step, **rec})
        if not self.cfg.progress:  # no bar to show the loss: one line per --log-every steps
            speed = f", {rec['tokens_per_s']:.0f} tokens/s" if rec["tokens_per_s"] else ""
            self.log(f"step {self.step}/{self.total}: loss {rec['loss']:.4f}, acc {rec['acc']:.3f}, lr "
                     f"{cur['lr']:.2e}{speed}")

    # --- steps -------------------------------------------------------------------------------------------

    def one_step(self) -> tuple:
        """One optimizer step from ``self.step``: (sums, grad norm, epoch, lr, seconds, sequence tokens). A
        non-finite loss saves the last good state and raises ``TrainingDiverged``."""
        cfg, data = self.cfg, self.data
        epoch, idx = data.step_indices(self.step, seed=cfg.seed, grad_accum=cfg.grad_accum, batch_size=cfg.batch_size)
        lr = lr_at(cfg, self.step, self.total)
        t0 = time.perf_counter()
        ids, mask, idx_d, feats, starts = device_batch(data, self.store, idx, self.mesh, cfg.dtype)
        self.params, self.opt_state, sums, ok, gnorm = self.step_fn(
            self.params, self.opt_state, self.target.params, ids, mask, idx_d, jnp.int32(epoch), feats,
            jnp.float32(lr), starts)
        sums, ok, gnorm = jax.device_get((sums, ok, gnorm))
        dt = time.perf_counter() - t0
        if not ok:
            loss = float(sums["wce"]) / max(float(sums["weight"]), 1e-12)
            if self.step > 0:  # the state after `step` good steps (this update was not applied)
                self.save(self.step)
            self.ckpt.wait()
            good = self.ckpt.latest_step()
            where = (f"the last good checkpoint is step {good} in {self.ckpt.directory}" if good is not None
                     else "no checkpoint was saved (it failed before the first step)")
            raise TrainingDiverged(
                f"non-finite loss at step {self.step + 1} (loss {loss}, gradient norm {float(gnorm)}; epoch {epoch}, "
                f"sequences {[j for i in idx.reshape(-1) for j in data.row(i)]}): training stopped without "
                f"applying that update; {where}. Check the data / cached features for NaN, lower --lr, or use "
                "--dtype float32.")
        return sums, gnorm, epoch, lr, dt, data.tokens(idx)

    def run(self, on_step=None) -> None:
        """The optimizer steps from ``start`` to ``total``, with metrics, checkpoints and evaluations; on
        Ctrl-C the state is saved (when intact) before the interrupt goes on."""
        cfg, total = self.cfg, self.total
        bar = progress_bar(total, "train", "step", cfg.progress and self.primary, initial=self.start)
        window, t_run, compile_s = _Window(), time.perf_counter(), None
        try:
            while self.step < total:
                sums, gnorm, epoch, lr, dt, n_tok = self.one_step()
                self.step += 1
                self.tokens_total += n_tok
                if self.step == self.start + 1:
                    compile_s = dt  # the first step includes compilation
                else:
                    window.add(sums, n_tok, dt)
                cur = objective.summarize(sums)
                cur.update(step=self.step, epoch=epoch, lr=lr, grad_norm=float(gnorm))
                self.collapse.update(self.step, cur["ce"], cur["grad_norm"])
                if window.time > 0:
                    cur["tokens_per_s"] = window.tokens / window.time
                self.last = cur
                bar.update(1)
                bar.set_postfix(loss=f"{cur['loss']:.3f}", acc=f"{cur['acc']:.3f}",
                                tok_s=f"{cur.get('tokens_per_s', 0):.0f}")
                if self.step % cfg.log_every == 0 or self.step == total:
                    self.log_window(window, cur, compile_s, t_run)
                    window = _Window()
                if self.step % cfg.save_every == 0 and self.step < total:
                    self.save(self.step)
                if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < total:
                    self.last["tau"] = self.run_eval(self.step)["tau"]
                if on_step is not None:
                    on_step(self.step, cur)
        except KeyboardInterrupt:
            self._interrupted()
            raise
        finally:
            bar.close()
            self.ckpt.wait()

    def _interrupted(self) -> None:
        """Ctrl-C: save the state reached (unless the interrupt hit inside the step, which owns the donated
        buffers) and say how to resume."""
        saved = self.ckpt.latest_step()
        intact = not any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree_util.tree_leaves(self.params))
        if self.step > self.start and intact:
            self.save(self.step)
            saved = self.step
        self.ckpt.close()
        self.log(f"interrupted at step {self.step}; latest checkpoint: step {saved} in {self.ckpt.directory}; rerun "
                 "the same command to resume")

    def finish(self) -> Draft:
        """The final checkpoint (unless it exists already) and evaluation; the trained draft."""
        total = self.total
        if self.start < total or total not in self.ckpt.all_steps():
            self.save(total)
        self.ckpt.wait()
        if self.eval_prompts and self.start < total:
            self.run_eval(total)
        self.ckpt.close()
        self.log(f"done: {total} steps ({self.tokens_total} sequence tokens this run), checkpoint "
                 f"{self.ckpt.directory}/{total}; peak memory {peak_memory_mb():.0f} MiB")
        return Draft(self.dcfg, self.params)


def _outermost_missing(path: str) -> str | None:
    """The outermost folder of ``path`` that does not exist yet (what ``os.makedirs(path)`` creates), or None."""
    path, missing = os.path.abspath(path), None
    while not os.path.exists(path):
        missing, path = path, os.path.dirname(path)
    return missing


def train(cfg: TrainConfig, *, target: Target | None = None, on_step: Callable[[int, dict], None] | None = None,
          log: Callable[[str], None] = print) -> Draft:
    """Train (or resume training) a DFlash draft as configured; returns the trained draft (float32 master
    params). ``target`` may be passed pre-loaded (its path must match ``cfg.target`` for the checkpoint to
    make sense); ``on_step(step, metrics)`` is called after every optimizer step."""
    if not cfg.out:
        raise ValueError("TrainConfig.out (the output directory) is required")
    created = _outermost_missing(cfg.out)
    os.makedirs(cfg.out, exist_ok=True)
    try:
        run = TrainRun(cfg, target, log)
    except Exception:  # a run that could not start (bad data, target, options) leaves no folder of its own behind
        if created:
            shutil.rmtree(created, ignore_errors=True)
        raise
    run.run(on_step)
    return run.finish()
