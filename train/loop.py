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
import json
import math
import os
import resource
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
from dflash_jax.config import MASK_TOKEN, DraftConfig, choose_target_layer_ids
from dflash_jax.draft import Draft, check_fits, draft_param_shapes, init_draft_params, load_draft
from dflash_jax.prompts import encode_prompt, read_prompts
from dflash_jax.target import Target, load_target
from train import objective
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
_RESUME_FIXED = ("draft_layers", "block_size", "num_target_features", "target_layer_ids",
                 "mask_token_id", "draft_sliding_layers", "draft_sliding_window", "draft_causal",
                 "draft_output_multiplier", "draft_logit_softcap", "draft_embedding_scale", "num_anchors", "gamma",
                 "seq_len", "batch_size", "grad_accum", "seed", "dtype", "param_dtype", "init_draft", "pack")
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
    """The tokenizer's ``<|MASK|>`` token when it has one; else the first embedding row the tokenizer never
    produces (Qwen3: 151669, as the released drafts), else the pad token, else the last vocabulary id."""
    v = target.config.vocab_size
    mask = tokenizer.convert_tokens_to_ids(MASK_TOKEN) if tokenizer is not None else None
    if isinstance(mask, int) and mask != getattr(tokenizer, "unk_token_id", None) and 0 <= mask < v:
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
    bad = [i for i in ids if not 0 <= i < L]
    if bad:
        raise ValueError(f"--target-layer-ids {list(ids)}: ids {bad} are outside the target's {L} layers (0..{L - 1})")
    mask_id = cfg.mask_token_id if cfg.mask_token_id >= 0 else default_mask_token_id(target, tokenizer)
    return DraftConfig.for_target(target.config, draft_layers=cfg.draft_layers, block_size=cfg.block_size,
                                  mask_token_id=mask_id, target_layer_ids=ids, **cfg.draft_options())


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
                                       ("--draft-layers", cfg.draft_layers, dcfg.layers.num_hidden_layers))
             if ours != theirs]
    ours, theirs = cfg.draft_options(), _draft_options_of(dcfg)
    return flags + [flag for k, flag in _DRAFT_OPTION_FLAGS.items() if ours[k] != theirs[k]]


def lr_at(cfg: TrainConfig, step: int, total_steps: int) -> float:
    """Learning rate of update ``step`` (0-based): linear warmup over round(warmup_frac * total) steps
    (reaching --lr at the last warmup step), then cosine decay to min_lr_frac * lr at the last step."""
    warmup = int(round(cfg.warmup_frac * total_steps))
    return warmup_cosine(step, peak=cfg.lr, warmup=warmup, cosine_steps=total_steps - warmup - 1,
                         final_frac=cfg.min_lr_frac)


_STEP_FIELDS = ("seed", "num_anchors", "block_size", "gamma", "impl", "loss_chunk", "dtype", "clip",
                "weight_decay", "beta1", "beta2", "mesh")
_step_cache: dict = {}


def cached_train_step(cfg: TrainConfig, tcfg, dcfg: DraftConfig, *, offline: bool):
    """(optimizer, step fn), reused across ``train`` calls in one process with the same settings (a resumed
    or extended run in the same process does not compile again)."""
    key = (tuple(getattr(cfg, f) for f in _STEP_FIELDS), tcfg, dcfg, offline)
    if key not in _step_cache:
        if len(_step_cache) >= 8:
            _step_cache.pop(next(iter(_step_cache)))
        optimizer = make_optimizer(cfg.clip, cfg.beta1, cfg.beta2, cfg.weight_decay)
        _step_cache[key] = (optimizer, make_train_step(cfg, tcfg, dcfg, optimizer, offline=offline))
    return _step_cache[key]


def make_train_step(cfg: TrainConfig, tcfg, dcfg: DraftConfig, optimizer, *, offline: bool):
    """Jitted ``step(params, opt_state, tparams, ids, mask, idx, epoch, feats, lr, starts=None)`` ->
    (params, opt_state, sums, ok, grad_norm); ids/mask [A, B, S], idx [A, B], feats [A, B, S, F] or None,
    starts [A, B, S] (packed rows: ``TrainData.batch``'s doc_start) or None.
    params / opt_state are donated; when ``ok`` is False they come back unchanged. On ``cfg.mesh`` the
    block-attention kernel runs per shard (traced with that mesh: ``sharding.mesh_scope``)."""
    mesh = sharding.make_mesh(cfg.mesh) if cfg.mesh else None
    weights = objective.position_weights(dcfg.block_size, cfg.gamma_value)
    dtype = resolve_dtype(cfg.dtype)

    def micro(params, tparams, ids, mask, idx, epoch, feats, starts):
        anchors = objective.sample_batch_anchors(cfg.seed, epoch, idx, mask, cfg.num_anchors, starts)
        if feats is None:
            feats = objective.target_features(tcfg, tparams, ids, dcfg.target_layer_ids, starts)

        def f(p):
            s = objective.loss_sums(tcfg, tparams, dcfg, p, ids, mask, anchors, feats, weights=weights,
                                    impl=cfg.impl, chunk=cfg.loss_chunk, dtype=dtype, doc_start=starts)
            return s["wce"], s

        (_, sums), grads = jax.value_and_grad(f, has_aux=True)(params)
        return grads, sums

    def update(params, opt_state, tparams, ids, mask, idx, epoch, feats, lr, starts=None):
        first = lambda a: None if a is None else a[0]  # noqa: E731
        grads, sums = micro(params, tparams, ids[0], mask[0], idx[0], epoch, first(feats), first(starts))
        if ids.shape[0] > 1:
            def body(carry, xs):
                i, m, j, f, st = xs
                g, s = micro(params, tparams, i, m, j, epoch, f, st)
                return jax.tree_util.tree_map(jnp.add, carry, (g, s)), None

            rest = lambda a: None if a is None else a[1:]  # noqa: E731
            (grads, sums), _ = jax.lax.scan(body, (grads, sums),
                                            (ids[1:], mask[1:], idx[1:], rest(feats), rest(starts)))
        weight = jnp.maximum(sums["weight"], 1e-12)
        grads = jax.tree_util.tree_map(lambda g: g / weight, grads)
        loss = sums["wce"] / weight
        gnorm = optax.tree.norm(grads)
        updates, new_opt = optimizer.update(grads, opt_state, params)
        new_params = jax.tree_util.tree_map(lambda p, u: (p - lr * u).astype(p.dtype), params, updates)
        ok = jnp.isfinite(loss) & jnp.isfinite(gnorm)
        keep = lambda new, old: jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa: E731
        return keep(new_params, params), keep(new_opt, opt_state), sums, ok, gnorm

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
    from dflash_jax.speculative import speculative_generate

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
        warnings.warn(f"resuming with a different path for {moved} ({[getattr(old, f) for f in moved]} -> "
                      f"{[getattr(cfg, f) for f in moved]}); it must hold the same model / data", stacklevel=3)
    diff = [f for f in _RESUME_FIXED if getattr(old, f) != getattr(cfg, f)]
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
        warnings.warn(f"resuming with changed {changed}: the optimizer schedule differs from the original run",
                      stacklevel=3)
    rounding = [f for f in _RESUME_ROUNDING if getattr(old, f) != getattr(cfg, f)]
    if rounding:
        warnings.warn(f"resuming with changed {rounding}: the same computation, but the resumed run equals an "
                      "uninterrupted one only up to float rounding (not bit for bit)", stacklevel=3)


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
    """Warns once (``warn(message)``) when the loss sits at ln(vocab) -- the draft predicts the uniform
    distribution -- or the gradient norm is exactly 0 for ``COLLAPSE_STEPS`` consecutive steps."""

    def __init__(self, vocab_size: int, lr: float, warn: Callable[[str], None]):
        self.ln_v, self.lr, self.warn = math.log(vocab_size), lr, warn
        self.run, self.warned = 0, False

    def update(self, step: int, loss: float, grad_norm: float) -> None:
        flat = abs(loss - self.ln_v) <= COLLAPSE_TOL or grad_norm == 0.0
        self.run = self.run + 1 if flat else 0
        if self.run >= COLLAPSE_STEPS and not self.warned:
            self.warned = True
            self.warn(f"the draft has collapsed: for {self.run} steps in a row (steps {step - self.run + 1}..{step}) "
                      f"the loss sat at ln(vocab) = {self.ln_v:.4f} (uniform predictions) or the gradient norm was 0 "
                      f"(now: loss {loss:.4f}, gradient norm {grad_norm:.3g}); it is not learning and will not "
                      f"recover. The learning rate is probably too high: start over with a lower --lr (now "
                      f"{self.lr:g}; default 6e-4) and a new --out")

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


def train(cfg: TrainConfig, *, target: Target | None = None, on_step: Callable[[int, dict], None] | None = None,
          log: Callable[[str], None] = print) -> Draft:
    """Train (or resume training) a DFlash draft as configured; returns the trained draft (float32 master
    params). ``target`` may be passed pre-loaded (its path must match ``cfg.target`` for the checkpoint to
    make sense); ``on_step(step, metrics)`` is called after every optimizer step."""
    if not cfg.out:
        raise ValueError("TrainConfig.out (the output directory) is required")
    os.makedirs(cfg.out, exist_ok=True)
    primary = jax.process_index() == 0  # on several processes only the first logs and writes metrics
    if not primary:
        log = lambda *a, **k: None  # noqa: E731
    log(f"training config:\n{cfg.pretty()}")

    mesh = sharding.make_mesh(cfg.mesh) if cfg.mesh else None
    if mesh is not None:
        sharding.check_batch_rows(cfg.batch_size, mesh, "--batch-size (rows of a micro-batch)")
        if cfg.cache_features and jax.process_count() > 1:
            raise TrainingError("--cache-features with several processes is not supported (each process would "
                                "need every feature row); train with online features on a multi-host mesh")
        log(f"mesh: {sharding.mesh_str(mesh)} over {mesh.size} devices, {jax.process_count()} process(es)")

    # target, tokenizer, data
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

    # checkpoints
    ckpt = Checkpointer(os.path.join(cfg.out, CHECKPOINT_DIR), keep=cfg.keep_checkpoints)
    steps = sorted(ckpt.all_steps(), reverse=True)
    latest = steps[0] if steps else None
    if latest is not None and not cfg.resume:
        raise TrainingError(f"{cfg.out} already has checkpoints (latest step {latest}); resume (the default) "
                            "or choose a new --out")
    if cfg.resume_from >= 0 and cfg.resume_from not in steps:
        raise TrainingError(f"--resume-from {cfg.resume_from}: {ckpt.directory} has no checkpoint of that step "
                            f"(steps there: {sorted(steps) or 'none'})")
    candidates = [cfg.resume_from] if cfg.resume_from >= 0 else steps
    unreadable: list[int] = []

    def skip(step: int, err: CheckpointError) -> None:
        """A corrupt checkpoint: an error if --resume-from chose it, else a warning and the previous one."""
        if cfg.resume_from >= 0:
            raise TrainingError(f"{err}; choose another --resume-from (steps: {sorted(steps)})")
        unreadable.append(step)
        msg = (f"{err}; skipping it and resuming from the newest intact checkpoint before it (the unreadable one "
               f"is moved to {os.path.join(cfg.out, SET_ASIDE_DIR)})")
        log(f"warning: {msg}")
        warnings.warn(msg, stacklevel=3)

    def readable_meta(before: int | None = None) -> tuple[int, dict]:
        for s in candidates:
            if s not in unreadable and (before is None or s < before):
                try:
                    return s, ckpt.meta(s)
                except CheckpointError as e:
                    skip(s, e)
        raise TrainingError(f"no intact checkpoint in {ckpt.directory}: steps {unreadable} are unreadable; move "
                            "them away to start over, or choose a new --out")

    # the draft
    param_dtype = resolve_dtype(cfg.param_dtype)
    if latest is not None:
        latest, meta = readable_meta()
        _check_resume(meta, cfg, data)
        dcfg = DraftConfig.from_hf(meta["draft_config"])
        params_like = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, param_dtype),
                                             draft_param_shapes(dcfg))
    elif cfg.init_draft:
        init = load_draft(cfg.init_draft, dtype=cfg.param_dtype)
        dcfg = init.config
        if dcfg.architecture == "dflash2":
            raise TrainingError(f"--init-draft {cfg.init_draft} is a DFlash2 draft (DFlash2DraftModel): DFlash2 "
                                "drafts can be loaded and served but not trained here, because the training recipe "
                                "of their candidate selector is not public; start from a DFlash (DFlashDraftModel) "
                                "draft or train a new one")
        ignored = _ignored_draft_flags(cfg, dcfg)
        if ignored:
            sliding = [i for i, t in enumerate(dcfg.layers.layer_types) if t == "sliding_attention"]
            warnings.warn(f"--init-draft {cfg.init_draft} fixes the architecture: block_size {dcfg.block_size}, "
                          f"{dcfg.layers.num_hidden_layers} layers, target_layer_ids {list(dcfg.target_layer_ids)}, "
                          f"sliding layers {sliding} (window {dcfg.layers.sliding_window}), is_causal "
                          f"{dcfg.is_causal}, input_embedding_scale {dcfg.input_embedding_scale}, output_multiplier "
                          f"{dcfg.output_multiplier}, final_logit_softcapping {dcfg.final_logit_softcapping} "
                          f"(the {' / '.join(ignored)} given are ignored)", stacklevel=2)
        params = init.params
    else:
        dcfg = build_draft_config(cfg, target, tokenizer)
        params = init_draft_params(dcfg, cfg.seed, param_dtype)
    if latest is None:
        check_fits(target, Draft(dcfg, params))
    else:
        dcfg.check_fits(target.config)
    if dcfg.block_size != cfg.block_size:
        cfg = cfg.replace(block_size=dcfg.block_size)

    spe = data.steps_per_epoch(cfg.global_batch)
    total = cfg.steps or max(1, int(math.ceil(cfg.epochs * spe)))
    optimizer, step_fn = cached_train_step(cfg, target.config, dcfg, offline=cfg.cache_features)
    start = 0
    like = params_like if latest is not None else params
    opt_like = jax.eval_shape(optimizer.init, like)
    if mesh is not None:  # draft params and optimizer state over fsdp / tensor (any checkpoint restores onto it)
        rules = model_sharding.model_rules(mesh, target.config, dcfg)
        p_shard = model_sharding.param_shardings(dcfg, mesh, rules, like)
        o_shard = sharding.opt_state_shardings(opt_like, p_shard, mesh, like)
    if latest is not None:
        if mesh is not None:
            params_like, opt_like = sharding.abstract_like(params_like, p_shard), sharding.abstract_like(opt_like, o_shard)
        while True:
            try:
                params, opt_state, meta = ckpt.restore(latest, params_like, opt_like)
                break
            except CheckpointError as e:
                skip(latest, e)
                latest, meta = readable_meta(before=latest)
                _check_resume(meta, cfg, data)
                if DraftConfig.from_hf(meta["draft_config"]) != dcfg:
                    raise TrainingError(f"checkpoint {ckpt.step_dir(latest)} holds another draft architecture than "
                                        "the newer (unreadable) ones; resume it with --resume-from "
                                        f"{latest}") from None
        if mesh is None:
            # orbax returns arrays committed to a device; fresh ones are uncommitted, and jit keys its cache on
            # that: re-create them uncommitted so a resumed run reuses the compiled step
            params, opt_state = jax.tree_util.tree_map(lambda x: jnp.asarray(np.asarray(x)), (params, opt_state))
        start = int(meta["step"])
        newer = [s for s in ckpt.all_steps() if s > latest]
        if newer:  # unreadable ones, or newer than --resume-from: this run writes those steps again
            if primary:
                for s in newer:
                    dest = ckpt.set_aside(s, os.path.join(cfg.out, SET_ASIDE_DIR))
                    log(f"moved the {'unreadable' if s in unreadable else 'newer'} checkpoint of step {s} to {dest}")
            if jax.process_count() > 1:
                from jax.experimental import multihost_utils

                multihost_utils.sync_global_devices("dflash_set_aside_checkpoints")
            ckpt.reload()
        log(f"resumed from {ckpt.directory}/{latest} (step {start}, epoch {meta['epoch']})")
    else:
        if mesh is not None:
            params = sharding.shard_params(params, p_shard)
        opt_state = optimizer.init(params)
        if mesh is not None:
            opt_state = sharding.shard_params(opt_state, o_shard)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
    log(f"target: {target.path} ({target.config.num_hidden_layers} layers, hidden {target.config.hidden_size}, "
        f"vocab {target.config.vocab_size}); draft: {dcfg.layers.num_hidden_layers} layers, {n_params / 1e6:.2f}M "
        f"params, block {dcfg.block_size}, target_layer_ids {list(dcfg.target_layer_ids)}, mask id "
        f"{dcfg.mask_token_id}, gamma {cfg.gamma_value:.3g}")
    log(f"data: {len(data)} sequences, {data.num_tokens} tokens; {spe} steps/epoch of {cfg.global_batch} "
        f"{'rows' if cfg.pack else 'sequences'}; {total} steps")
    with open(os.path.join(cfg.out, "config.json") if primary else os.devnull, "w") as f:
        json.dump({"train_config": cfg.to_json(), "draft_config": dcfg.to_hf(), "total_steps": total,
                   "steps_per_epoch": spe}, f, indent=2)

    # features
    store = None
    if cfg.cache_features:
        from train.features import build_feature_store

        store = build_feature_store(target, dcfg.target_layer_ids, data,
                                    cfg.feature_dir or os.path.join(cfg.out, "features"),
                                    batch_size=cfg.batch_size, dtype=cfg.feature_dtype, progress=cfg.progress,
                                    log=log)
        log(f"features: {store.nbytes / 2**20:.1f} MiB on disk ({cfg.feature_dtype}) in {store.directory}")

    # evaluation prompts
    eval_prompts = (load_eval_prompts(cfg.eval_prompts, tokenizer, cfg.eval_num_prompts, cfg.eval_chat) if cfg.eval_prompts
                    else prompts_from_data(data, cfg.eval_num_prompts))
    stop_ids = list(target.config.eos_token_id) or None

    metrics_path = os.path.join(cfg.out, "metrics.jsonl")
    if primary:  # the records of steps this run does (again): a resumed run redoes the steps after `start`
        dropped = truncate_metrics(metrics_path, start)
        if dropped:
            log(f"{metrics_path}: dropped {dropped} records after step {start} (this run redoes those steps)")

    def warn_collapse(msg: str) -> None:
        log(f"warning: {msg}")
        warnings.warn(msg, stacklevel=4)

    collapse = CollapseDetector(target.config.vocab_size, cfg.lr, warn_collapse)

    def write_metrics(rec):
        if not primary:
            return
        with open(metrics_path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def meta_for(step, last):
        epoch, pos = divmod(step, spe)
        return {"step": step, "epoch": epoch, "step_in_epoch": pos, "steps_per_epoch": spe, "total_steps": total,
                "examples_seen": step * cfg.global_batch, "seed": cfg.seed,
                "rng": [int(x) for x in np.asarray(jax.random.key_data(jax.random.PRNGKey(cfg.seed)))],
                "config": cfg.to_json(), "draft_config": dcfg.to_hf(), "data_summary": _data_summary(data),
                "metrics": last}

    def run_eval(step):
        r = evaluate(target, Draft(dcfg, params), eval_prompts, max_new_tokens=cfg.eval_max_new_tokens,
                     stop_token_ids=stop_ids)
        rec = {"step": step, "eval": True, "prompts": "held-out" if cfg.eval_prompts else "training", **r}
        write_metrics(rec)
        log(f"step {step}: acceptance length tau = {r['tau']:.3f} on {len(eval_prompts)} "
            f"{rec['prompts']} prompts")
        return r

    bar = progress_bar(total, "train", "step", cfg.progress and primary, initial=start)
    window, win_tokens, win_time, win_steps, last = None, 0, 0.0, 0, {}
    step, tokens_total, t_run, compile_s = start, 0, time.perf_counter(), None
    try:
        while step < total:
            epoch, idx = data.step_indices(step, seed=cfg.seed, grad_accum=cfg.grad_accum, batch_size=cfg.batch_size)
            lr = lr_at(cfg, step, total)
            t0 = time.perf_counter()
            ids, mask, idx_d, feats, starts = device_batch(data, store, idx, mesh, cfg.dtype)
            params, opt_state, sums, ok, gnorm = step_fn(params, opt_state, target.params, ids, mask, idx_d,
                                                         jnp.int32(epoch), feats, jnp.float32(lr), starts)
            sums, ok, gnorm = jax.device_get((sums, ok, gnorm))
            dt = time.perf_counter() - t0
            if not ok:
                loss = float(sums["wce"]) / max(float(sums["weight"]), 1e-12)
                if step > 0:  # the state after `step` good steps (this update was not applied)
                    ckpt.save(step, params, opt_state, meta_for(step, last))
                ckpt.wait()
                good = ckpt.latest_step()
                where = (f"the last good checkpoint is step {good} in {ckpt.directory}" if good is not None
                         else "no checkpoint was saved (it failed before the first step)")
                raise TrainingDiverged(
                    f"non-finite loss at step {step + 1} (loss {loss}, gradient norm {float(gnorm)}; epoch {epoch}, "
                    f"sequences {[j for i in idx.reshape(-1) for j in data.row(i)]}): training stopped without "
                    f"applying that update; {where}. Check the data / cached features for NaN, lower --lr, or use --dtype float32.")
            step += 1
            n_tok = data.tokens(idx)
            tokens_total += n_tok
            if step == start + 1:
                compile_s = dt  # the first step includes compilation
                window = None
            else:
                window = sums if window is None else jax.tree_util.tree_map(np.add, window, sums)
                win_tokens += n_tok
                win_time += dt
                win_steps += 1
            cur = objective.summarize(sums)
            cur.update(step=step, epoch=epoch, lr=lr, grad_norm=float(gnorm))
            collapse.update(step, cur["loss"], cur["grad_norm"])
            if win_time > 0:
                cur["tokens_per_s"] = win_tokens / win_time
            last = cur
            bar.update(1)
            bar.set_postfix(loss=f"{cur['loss']:.3f}", acc=f"{cur['acc']:.3f}",
                            tok_s=f"{cur.get('tokens_per_s', 0):.0f}")
            if step % cfg.log_every == 0 or step == total:
                rec = {"step": step, "epoch": epoch, "lr": cur["lr"], "grad_norm": cur["grad_norm"],
                       **(objective.summarize(window) if window is not None else cur),
                       "tokens_per_s": win_tokens / win_time if win_time > 0 else None,
                       "step_time_s": win_time / win_steps if win_steps else None,
                       "compile_s": compile_s, "peak_memory_mb": round(peak_memory_mb(), 1),
                       "features": "offline" if store is not None else "online",
                       "elapsed_s": time.perf_counter() - t_run}
                rec.pop("step", None)
                write_metrics({"step": step, **rec})
                if not cfg.progress:  # no bar to show the loss: one line per --log-every steps
                    speed = f", {rec['tokens_per_s']:.0f} tokens/s" if rec["tokens_per_s"] else ""
                    log(f"step {step}/{total}: loss {rec['loss']:.4f}, acc {rec['acc']:.3f}, lr {lr:.2e}{speed}")
                window, win_tokens, win_time, win_steps = None, 0, 0.0, 0
            if step % cfg.save_every == 0 and step < total:
                ckpt.save(step, params, opt_state, meta_for(step, last))
            if cfg.eval_every and step % cfg.eval_every == 0 and step < total:
                last["tau"] = run_eval(step)["tau"]
            if on_step is not None:
                on_step(step, cur)
    except KeyboardInterrupt:
        saved = ckpt.latest_step()
        # params / opt_state are donated to the step: valid unless the interrupt hit inside the step call
        intact = not any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree_util.tree_leaves(params))
        if step > start and intact:
            ckpt.save(step, params, opt_state, meta_for(step, last))
            saved = step
        ckpt.close()
        log(f"interrupted at step {step}; latest checkpoint: step {saved} in {ckpt.directory}; rerun the same "
            "command to resume")
        raise
    finally:
        bar.close()
        ckpt.wait()
    if start < total or total not in ckpt.all_steps():
        ckpt.save(total, params, opt_state, meta_for(total, last))
    ckpt.wait()
    if eval_prompts and start < total:
        run_eval(total)
    ckpt.close()
    log(f"done: {total} steps ({tokens_total} sequence tokens this run), checkpoint {ckpt.directory}/{total}; "
        f"peak memory {peak_memory_mb():.0f} MiB")
    return Draft(dcfg, params)
