"""Float32 comparison bounds derived from the compared quantity's scale and the computation's depth (#39 item 1).

Two float32 computations of one value that round in other orders (another reduction order or vector width, i.e.
another CPU or XLA flag; a chunked or cached form against a one-shot one; JAX against PyTorch) differ by rounding
that grows with the number of rounded accumulations on the longest path through the computation (``depth``: per
layer its widest reduction, and so on). A reordered n-term sum moves by at most (n - 1) eps/2 x sum|terms|
(Higham) and typically by ~sqrt(n) eps/2 of its result; so every float32 comparison here is bounded by
``depth x eps32 x max|reference|`` (``depth`` ulps of the quantity's scale), with a one-line reason for the depth
at the assertion. Measured on two CPU paths (the default AVX-512 one and XLA_FLAGS=--xla_cpu_max_isa=SSE4_2, issue
#39) every difference stays under a quarter of its bound (the closest: 45 ulps of gemma4's parity at depth 192;
most under 10 ulps, against depths of 7-1184), yet a real bug (a wrong sign, a missing layer or term, an off-by-one
position) moves the result by O(scale), thousands of times more.

Set ``DFLASH_TOL_LOG=FILE`` to append each comparison's measured difference and bound (one JSON line per
comparison) to FILE: the margins a run had, for comparing two CPUs / flag sets.
"""
from __future__ import annotations

import json
import os

import numpy as np

EPS32 = float(np.finfo(np.float32).eps)  # 2^-23 ~ 1.19e-7: one ulp of 1.0 in float32


def max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


def scale_of(x) -> float:
    return float(np.max(np.abs(np.asarray(x, np.float64))))


def f32_rel(depth: float) -> float:
    """``depth`` float32 ulps, relative: ``pytest.approx(..., rel=f32_rel(depth))`` for a scalar."""
    return depth * EPS32


def forward_depth(config, seq: int) -> int:
    """Rounded accumulations on the longest path through a decoder forward over ``seq`` tokens: per layer, and
    for the LM head, one reduction of the widest width (hidden, MLP or the attended sequence)."""
    return (config.num_hidden_layers + 1) * max(config.hidden_size, config.intermediate_size, seq)


def draft_depth(target_config, draft_layers, ctx: int, block: int) -> int:
    """A draft's block logits: the target's forward over the ``ctx`` context tokens (its features), then the
    draft's layers (``draft_layers``: its layer stack's config) over the context and the ``block`` tokens."""
    return forward_depth(target_config, ctx) + forward_depth(draft_layers, ctx + block)


def loss_depth(target_config, draft_layers, seq: int, block_tokens: int) -> int:
    """A draft's training loss: its logits (``draft_depth``), then the cross-entropy's reductions: the
    vocabulary's logsumexp and the weighted sum over the ``block_tokens``. Gradients run it back: 2x."""
    return draft_depth(target_config, draft_layers, seq, block_tokens) + target_config.vocab_size + block_tokens


def assert_close(got, want, depth: float, scale: float | None = None, what: str = "") -> None:
    """max |got - want| <= ``depth`` float32 ulps of ``scale`` (default: max |want|)."""
    diff = max_diff(got, want)
    scale = scale_of(want) if scale is None else scale
    bound = f32_rel(depth) * scale
    log = os.environ.get("DFLASH_TOL_LOG")
    if log:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" (")[0]
        with open(log, "a") as f:
            f.write(json.dumps({"test": test, "what": str(what), "diff": diff, "bound": bound, "scale": scale,
                                "depth": float(depth)}) + "\n")
    assert diff <= bound, (f"{what}: max |diff| {diff:.3g} > bound {bound:.3g} = depth {depth} x eps32 x scale "
                           f"{scale:.3g} ({diff / (EPS32 * max(scale, 1e-30)):.0f} ulps of the scale)")


def assert_trees_close(got, want, depth: float, what: str = "") -> None:
    """``assert_close`` leaf by leaf (two pytrees of one structure, e.g. gradients), each against its own scale."""
    import jax

    leaves = jax.tree_util.tree_leaves_with_path(want)
    assert len(leaves) == len(jax.tree_util.tree_leaves(got))
    for (path, w), g in zip(leaves, jax.tree_util.tree_leaves(got)):
        assert_close(g, w, depth, what=f"{what}{jax.tree_util.keystr(path)}")
