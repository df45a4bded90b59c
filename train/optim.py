"""The optimizer and the learning-rate schedule of every training loop here (the draft trainer, the demo
target's pretraining): global-norm clipping + AdamW, linear warmup + cosine decay."""
from __future__ import annotations

import math

import jax
import optax


def decay_mask(params):
    """True on the Linear ``kernel`` matrices: weight decay shrinks those, never RMSNorm weights, biases
    or embeddings (decaying a norm's scale or a token's embedding only pulls it towards zero)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: getattr(path[-1], "key", None) == "kernel", params)


def is_frozen(path, frozen: tuple[str, ...]) -> bool:
    """Whether a parameter's tree path has a key of ``frozen`` on it (a top-level group, or a leaf name such as every
    layer's ``layer_scalar``)."""
    return any(getattr(p, "key", None) in frozen for p in path)


def frozen_labels(params, frozen: tuple[str, ...]):
    """"frozen" on the leaves ``is_frozen`` names, "trained" elsewhere."""
    return jax.tree_util.tree_map_with_path(lambda path, _: "frozen" if is_frozen(path, frozen) else "trained",
                                            params)


def make_optimizer(clip: float, b1: float, b2: float, weight_decay: float,
                   frozen: tuple[str, ...] = ()) -> optax.GradientTransformation:
    """Global-norm clipping (``clip`` > 0) -> Adam moments -> decoupled weight decay on ``decay_mask``
    (``weight_decay`` > 0). The learning rate is not inside: the step applies ``-lr * update`` (i.e.
    AdamW) with ``lr`` passed in per step, so a compiled step does not depend on the schedule.
    ``frozen``: parameter names (a DSpark draft's embed_tokens / lm_head groups, its layers' layer_scalar) whose
    leaves get a zero update and no optimizer state (their gradient is stopped in the loss, so the clipping norm
    never sees them)."""
    parts = [optax.clip_by_global_norm(clip)] if clip > 0 else []
    parts.append(optax.scale_by_adam(b1=b1, b2=b2, eps=1e-8))
    if weight_decay > 0:
        parts.append(optax.add_decayed_weights(weight_decay, mask=decay_mask))
    chain = optax.chain(*parts)
    if not frozen:
        return chain
    return optax.multi_transform({"trained": chain, "frozen": optax.set_to_zero()},
                                 lambda params: frozen_labels(params, frozen))


def warmup_cosine(step: int, *, peak: float, warmup: int, cosine_steps: int, final_frac: float) -> float:
    """Learning rate of update ``step`` (0-based): linear warmup reaching ``peak`` at step ``warmup - 1``,
    then a cosine from ``peak`` down to ``final_frac * peak`` over ``cosine_steps`` steps, held after."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, cosine_steps))
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * progress)))
