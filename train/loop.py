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

This module is the run itself (``TrainRun``: set up, step, log, checkpoint, finish); the draft it trains is made in
``train.draft_setup``, the jitted step in ``train.step``, resuming is ``train.resume``, evaluation
``train.evaluate``, the errors ``train.errors``.
"""
from __future__ import annotations

import json
import math
import os
import resource
import shutil
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import model_sharding, sharding
from dflash_jax.checkpoints import load_tokenizer, resolve_dtype
from dflash_jax.drafts.model import Draft, draft_param_shapes
from dflash_jax.target import Target, load_target
from train import objective
from train.config import TrainConfig
from train.draft_setup import choose_draft
from train.errors import TrainingDiverged, TrainingError, warn
from train.evaluate import evaluate, load_eval_prompts, prompts_from_data
from train.resume import ResumePoints, data_summary, truncate_metrics
from train.step import cached_train_step, device_batch, feature_layer_ids, lr_at, state_shardings
from train.data import TrainData
from dflash_jax.progress import progress_bar

# The collapse warning: this many consecutive steps with the loss within COLLAPSE_TOL nats of ln(vocab)
# (uniform predictions) or a gradient norm of exactly 0.
COLLAPSE_STEPS = 5
COLLAPSE_TOL = 1e-3


def peak_memory_mb() -> float:
    """Peak resident memory of this process (ru_maxrss: KiB on Linux, bytes on macOS)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / (1024 * 1024) if sys.platform == "darwin" else r / 1024


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
        self.cfg, self.dcfg, params = choose_draft(cfg, self.target, tokenizer, self.data, self.points)
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
            p_shard, o_shard = state_shardings(mesh, self.target.config, self.dcfg, params, opt_like)
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
        warn(msg)

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
                "config": cfg.to_json(), "draft_config": self.dcfg.to_hf(), "data_summary": data_summary(self.data),
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
