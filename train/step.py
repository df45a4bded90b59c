"""The jitted optimizer step (``make_train_step``: ``grad_accum`` micro-batches scanned, clipping, AdamW, a
non-finite step left undone), cached per settings in one process; the learning-rate schedule; a batch on the mesh."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dflash_jax import model_sharding, sharding
from dflash_jax.checkpoints import resolve_dtype
from dflash_jax.drafts.config import DraftConfig
from train import dspark_objective, objective
from train.config import TrainConfig
from train.data import TrainData
from train.optim import make_optimizer, warmup_cosine


def feature_layer_ids(tcfg, dcfg: DraftConfig) -> tuple[int, ...]:
    """The target layers whose outputs a training step reads (a DSpark draft's also the last one, for p_t)."""
    return dspark_objective.feature_layer_ids(tcfg, dcfg) if dcfg.shifted else tuple(dcfg.target_layer_ids)


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
        optimizer = draft_optimizer(cfg, dcfg)
        _step_cache[key] = (optimizer, make_train_step(cfg, tcfg, dcfg, optimizer, offline=offline))
    return _step_cache[key]


def draft_optimizer(cfg: TrainConfig, dcfg: DraftConfig):
    """AdamW with clipping for the draft (a DSpark draft's own embeddings frozen)."""
    frozen = dspark_objective.FROZEN if dcfg.own_embeddings else ()
    return make_optimizer(cfg.clip, cfg.beta1, cfg.beta2, cfg.weight_decay, frozen)


def state_shardings(mesh, tcfg, dcfg: DraftConfig, params, opt_state):
    """(param shardings, optimizer-state shardings) of the draft's training state on ``mesh``: the draft over
    fsdp / tensor by the rules shared with its target; ``params`` / ``opt_state`` may be abstract."""
    rules = model_sharding.model_rules(mesh, tcfg, dcfg)
    p_shard = model_sharding.param_shardings(dcfg, mesh, rules, params)
    return p_shard, sharding.opt_state_shardings(opt_state, p_shard, mesh, params)


def make_train_step(cfg: TrainConfig, tcfg, dcfg: DraftConfig, optimizer, *, offline: bool, mesh=None):
    """Jitted ``step(params, opt_state, tparams, ids, mask, idx, epoch, feats, lr, starts=None)`` ->
    (params, opt_state, sums, ok, grad_norm); ids/mask [A, B, S], idx [A, B], feats [A, B, S, F] or None,
    starts [A, B, S] (packed rows: ``TrainData.batch``'s doc_start) or None.
    params / opt_state are donated; when ``ok`` is False they come back unchanged. On ``cfg.mesh`` the
    block-attention kernel runs per shard (traced with that mesh: ``sharding.mesh_scope``); ``mesh``: that mesh
    built already (``infer.plan --train``: a TPU slice's abstract devices)."""
    if mesh is None and cfg.mesh:
        mesh = sharding.make_mesh(cfg.mesh)
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
