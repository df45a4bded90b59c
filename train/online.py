"""Online draft training: the draft follows a moving target (an RL policy) by a few optimizer steps on its rollouts.

``OnlineDraftTrainer(target, draft)`` holds the draft's float32 master parameters and AdamW state (both persist
across updates); ``update(sequences, prompt_lengths, target=...)`` trains them for ``steps_per_update`` optimizer
steps on the rollouts just generated (prompt + completion token ids, the loss on the completion tokens only) with
the trainer's own step (``train.step.cached_train_step``: the DFlash objective of ``train.objective``, the
optimizer of ``train.optim``), and ``.draft`` is the current draft in the dtype it came in, ready for
``Engine.update_params(target_params, trainer.draft.params)``.

Target features: recomputed, by one batched forward of the current target over the rollouts per update (not one
per optimizer step: the steps reuse them), not kept from the engine's verify forwards. The verify forwards do
compute them, but (1) they cover the drafted block, and a rejected token's features are discarded while the
committed ones are written to the draft's context cache as K/V projections, not kept as features: keeping them
would cost ``n_layers * hidden`` floats per committed token per row of device memory for the whole rollout, and an
output path through every verify program; (2) they are the features of the policy that sampled the rollouts, while
the draft must learn the policy it will draft for next, the target after the policy update (pass it as
``target=``); (3) one batched causal forward over the rollouts costs about as much as the prefill of their
verify passes, small next to decoding them token block by token block.

Shapes: rows are padded to a power of two, sequences to ``scoring.padded``'s length buckets (powers of two from
32), so the step compiles once per (rows, length) bucket. DFlash (v1) drafts only: a DSpark draft holds its own
frozen copies of the target's embedding and lm_head, which a policy update moves (they would have to follow it),
and DFlash2's candidate selector has no public training recipe; both are refused.
"""
from __future__ import annotations

import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.checkpoints import resolve_dtype
from dflash_jax.drafts.model import Draft, check_pair
from dflash_jax.scoring import padded
from dflash_jax.target import Target
from train.config import TrainConfig
from train.features import _features_fn
from train.step import cached_train_step, feature_layer_ids
from train.objective import cast_tree


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


class OnlineDraftTrainer:
    """Trains ``draft`` on rollouts of ``target`` (the policy), between policy updates.

    ``learning_rate``: AdamW's (constant: the policy keeps moving, there is no end to decay towards);
    ``steps_per_update``: optimizer steps per ``update`` call, each on every row (fresh anchors each step);
    ``num_anchors``: blocks per row; ``dtype``: the compute dtype (default: the target's parameters');
    ``clip`` / ``weight_decay`` / ``beta1`` / ``beta2`` / ``gamma``: as ``python -m train``'s flags; ``seed``:
    the anchors' (drawn from (seed, step, row))."""

    def __init__(self, target: Target, draft: Draft, *, learning_rate: float = 1e-3, steps_per_update: int = 4,
                 num_anchors: int = 64, dtype: str | None = None, clip: float = 1.0, weight_decay: float = 0.0,
                 beta1: float = 0.9, beta2: float = 0.95, gamma: float = 0.0, seed: int = 0):
        dcfg = draft.config
        if dcfg.architecture != "dflash":
            why = ("it holds its own frozen copies of the target's embedding and lm_head, which a policy update "
                   "moves" if dcfg.own_embeddings else "the training recipe of its candidate selector is not public")
            raise ValueError(f"OnlineDraftTrainer trains DFlash (v1) drafts only, not a {dcfg.architecture} draft: "
                             f"{why}")
        if steps_per_update < 1:
            raise ValueError(f"steps_per_update must be >= 1, got {steps_per_update}")
        check_pair(target, draft)
        self.target = target
        self.draft_dtype = jax.tree_util.tree_leaves(draft.params)[0].dtype
        dtype = dtype or str(jnp.dtype(jax.tree_util.tree_leaves(target.params)[0].dtype))
        self.cfg = TrainConfig(block_size=dcfg.block_size, num_anchors=num_anchors, gamma=gamma, lr=learning_rate,
                               clip=clip, weight_decay=weight_decay, beta1=beta1, beta2=beta2, dtype=dtype,
                               seed=seed, pack=False)
        self.dcfg, self.learning_rate, self.steps_per_update = dcfg, float(learning_rate), int(steps_per_update)
        self.optimizer, self.step_fn = cached_train_step(self.cfg, target.config, dcfg, offline=True)
        self.params = cast_tree(draft.params, jnp.float32)
        self.params = jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), self.params)  # donated by the step
        self.opt_state = self.optimizer.init(self.params)
        self.layer_ids = feature_layer_ids(target.config, dcfg)
        self.steps = 0  # optimizer steps so far (the anchors' epoch)
        self.updates = 0

    @property
    def draft(self) -> Draft:
        """The current draft, its parameters in the dtype the trainer was given (``Engine.update_params`` keeps
        dtypes)."""
        # copies: the next step donates the master params, the engine must keep its own
        return Draft(self.dcfg, jax.tree_util.tree_map(lambda x: jnp.array(x, self.draft_dtype, copy=True),
                                                       self.params))

    def batch(self, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int]):
        """(ids [1, R, L], loss mask [1, R, L], row indices [1, R]) int32: one sequence per row, R rows padded to a
        power of two (empty rows train nothing), L ``scoring.padded``'s bucket; the mask is 1 on the completion."""
        if len(sequences) != len(prompt_lengths) or not len(sequences):
            raise ValueError(f"update needs as many prompt lengths as sequences (at least one), got "
                             f"{len(sequences)} sequences and {len(prompt_lengths)} prompt lengths")
        rows = _pow2(len(sequences))
        seqs = [list(map(int, s)) for s in sequences] + [[0]] * (rows - len(sequences))
        ids = padded(self.target.config, seqs)
        mask = np.zeros_like(ids)
        for r, (s, p) in enumerate(zip(sequences, prompt_lengths)):
            if not 0 < p <= len(s):
                raise ValueError(f"sequence {r}: prompt length {p} outside 1..{len(s)}")
            mask[r, p:len(s)] = 1
        return ids[None], mask[None], np.arange(rows, dtype=np.int32)[None]

    def update(self, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int],
               target: Target | None = None) -> dict:
        """Train for ``steps_per_update`` optimizer steps on ``sequences`` (prompt + completion ids; the first
        ``prompt_lengths[i]`` tokens of each are its prompt). ``target``: the policy to follow from now on (its
        features, embedding and lm_head; default: the last one given). -> {"loss", "acc", "tau_proxy" (the last
        step's), "steps", "skipped" (non-finite steps, not applied), "seconds"}."""
        from train.objective import summarize

        t0 = time.perf_counter()
        if target is not None:
            self.target = target
        ids, mask, idx = self.batch(sequences, prompt_lengths)
        ids, mask, idx = jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(idx)
        tparams = self.target.params
        feats = _features_fn(self.target.config, tuple(self.layer_ids))(tparams, ids[0])[None]
        feats = feats.astype(resolve_dtype(self.cfg.dtype))
        skipped, sums = 0, None
        for _ in range(self.steps_per_update):
            self.params, self.opt_state, sums, ok, _ = self.step_fn(
                self.params, self.opt_state, tparams, ids, mask, idx, jnp.int32(self.steps), feats,
                jnp.float32(self.learning_rate))
            skipped += int(not bool(ok))
            self.steps += 1
        self.updates += 1
        s = summarize(sums)
        return {"loss": s["loss"], "acc": s["acc"], "tau_proxy": s["tau_proxy"], "steps": self.steps_per_update,
                "skipped": skipped, "seconds": time.perf_counter() - t0}
