"""Draft trees for tree verification (DDTree, arXiv 2604.12989): pure, jit-able, static-shape algorithms.

A DFlash draft gives, in one forward, marginals q_1..q_D (D = block_size - 1) over the vocabulary. Under
this factorised model the best draft tree of N nodes is the set of the N most probable prefixes
u = (u_1..u_d), 1 <= d <= D, log q(u) = log q_1(u_1) + ... + log q_d(u_d). Log probabilities are <= 0,
so no prefix scores above its ancestors and the set is closed under prefixes: a tree rooted at the
pending token (the root is not one of the N nodes).

Layout. ``Tree`` holds the N nodes in best-first order (a parent always comes before its children);
``parents`` index into the nodes, -1 is the root. A verify forward lays out N + 1 slots
[root, node_0, ..., node_{N-1}]: slot 0 is the root and node k is slot k + 1, at position
n + depths[k] for a root at position n; ``ancestor_mask`` is its attention mask, ``walk`` reads the
target's token at every slot and returns the accepted path as slots.

Padding. Where fewer than N prefixes exist (a tiny vocabulary, or a small ``max_depth``), the last nodes
are padding: depth 0, parent -1, token 0, logp -inf (``Tree.valid`` is False). ``walk`` never accepts
one; in the verify forward they are harmless extra slots that attend to the root and themselves.

Ties (equal log q) are broken deterministically, exactly as a heap keyed by (-log q, push order):
the frontier starts with the rank-0 token at depth 1; popping a node pushes its next sibling (the next
rank at its depth, same parent), then its first child (the rank-0 token at the next depth); among equal
scores the candidate pushed first wins. Within a depth, equal log q rank by lower token id
(``lax.top_k``). Any tie-break gives an exact top-N set (the multiset of log q is the same) and a tree.
"""
from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class Tree:
    """N draft nodes per row, best-first (so non-increasing ``logp``; a parent before its children)."""

    tokens: jax.Array   # [B, N] int32
    parents: jax.Array  # [B, N] int32: node index of the parent, -1 = the root
    depths: jax.Array   # [B, N] int32: 1..d_max; 0 = padding
    logp: jax.Array     # [B, N] float32: log q of the whole prefix; -inf on padding
    d_max: int = flax.struct.field(pytree_node=False)  # D: no node is deeper

    @property
    def valid(self):
        return self.depths > 0


@functools.partial(jax.jit, static_argnames=("budget", "chain"))
def build_tree(logq, budget: int, max_depth=None, chain: bool = False) -> Tree:
    """logq [B, D, V] (log q_i: log_softmax of the draft's logits) -> the ``budget`` most probable prefixes
    of depth <= max_depth ([B] int32 at runtime, default D), padded where fewer exist (module docstring).
    ``chain``: the greedy chain (the rank-0 token at every depth, as deep as the budget allows) first, then
    the most probable other prefixes: the best tree that contains what the chain would verify."""
    vals, ids = jax.lax.top_k(logq.astype(jnp.float32), min(budget, logq.shape[-1]))
    return tree_from_top_k(vals, ids, budget, max_depth, chain)


@functools.partial(jax.jit, static_argnames=("budget", "chain"))
def tree_from_top_k(vals, ids, budget: int, max_depth=None, chain: bool = False) -> Tree:
    """``build_tree`` from each depth's top-K log q, sorted descending (``lax.top_k``): vals [B, D, K]
    float32, ids [B, D, K] int32. K >= min(budget, V) keeps the result exact (a node of rank r has r
    siblings before it)."""
    b, d, _ = vals.shape
    # The barrier keeps a lax.top_k that produced vals / ids (in the same jit) XLA:CPU's TopK: with the
    # frontier's scalar reads folded into it, it becomes a sort of the whole vocabulary (~100x slower).
    vals, ids = jax.lax.optimization_barrier((vals, ids))
    max_depth = jnp.full((b,), d, jnp.int32) if max_depth is None else jnp.minimum(max_depth, d)
    nodes = jax.vmap(functools.partial(_best_first, budget=budget, chain=chain))(vals, ids, max_depth)
    return Tree(*nodes, d_max=d)


def _best_first(vals, ids, max_depth, *, budget, chain=False):
    """One row: ``budget`` pops of a frontier of 2 * budget + 1 slots, argmax-popped. Pop i pushes the
    popped node's next sibling into slot 2i + 1 and its first child into slot 2i + 2, so slot order is
    push order and the first maximum is the tie-break of the module docstring. A candidate is its parent
    node, depth, rank at that depth, the parent's log q and its score (the parent's plus its own, so a
    node's log q is the left-to-right float32 sum along its path). ``chain``: the one candidate on the
    greedy chain (rank 0 under a chain node) is popped before any other."""
    n_depth, k = vals.shape
    slots = 2 * budget + 1
    frontier = (jnp.zeros(slots, jnp.int32).at[0].set(jnp.where(max_depth >= 1, 1, 0)),  # depth, 0 = empty
                jnp.zeros(slots, jnp.int32),                                           # rank
                jnp.full(slots, -1, jnp.int32),                                        # parent node
                jnp.zeros(slots, jnp.float32),                                         # parent's log q
                jnp.zeros(slots, jnp.float32).at[0].set(vals[0, 0]),                   # score
                jnp.zeros(slots, bool).at[0].set(chain))                               # on the chain

    def pop(frontier, i):
        depth, rank, parent, base, score, on_chain = frontier
        live = depth > 0
        key = jnp.where(live, score, -jnp.inf)
        first = live & on_chain
        best = jnp.where(first.any(), first, live & (key == key.max()))  # == rather than argmax: scores may be -inf
        s = jnp.argmax(best)
        ok, d, r, p, up, sc, c = live[s], depth[s], rank[s], parent[s], base[s], score[s], on_chain[s]
        node = (jnp.where(ok, ids[d - 1, r], 0), jnp.where(ok, p, -1), jnp.where(ok, d, 0),
                jnp.where(ok, sc, -jnp.inf))
        sib, child = jnp.minimum(r + 1, k - 1), jnp.minimum(d, n_depth - 1)
        pushed = ((jnp.where(ok & (r + 1 < k), d, 0), jnp.where(ok & (d < max_depth), d + 1, 0)),
                  (r + 1, 0), (p, i), (up, sc), (up + vals[d - 1, sib], sc + vals[child, 0]), (False, c))
        depth = depth.at[s].set(0)
        frontier = tuple(jax.lax.dynamic_update_slice(a, jnp.stack(v).astype(a.dtype), (2 * i + 1,))
                         for a, v in zip((depth, rank, parent, base, score, on_chain), pushed))
        return frontier, node

    return jax.lax.scan(pop, frontier, jnp.arange(budget, dtype=jnp.int32))[1]


def _jump_rounds(n: int) -> int:
    """Pointer-jumping rounds after which a jump covers every distance < 2^rounds, i.e. <= n."""
    return n.bit_length()


@functools.partial(jax.jit, static_argnames="d_max")
def ancestor_mask(parents, d_max: int | None = None):
    """parents [B, N] (-1 = root) -> [B, N + 1, N + 1] bool over slots [root, nodes]: (i, j) is True iff
    slot j is slot i or one of its ancestors (the root is everyone's). d_max (static): the deepest node,
    default N; pointer jumping takes bit_length(d_max) rounds."""
    b, n = parents.shape
    jump = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), parents + 1], axis=1)  # parent slot; root -> root
    mask = jnp.broadcast_to(jnp.eye(n + 1, dtype=bool), (b, n + 1, n + 1))  # distance 0
    rows = jax.vmap(lambda a, j: a[j])
    for _ in range(_jump_rounds(n if d_max is None else d_max)):
        mask = mask | rows(mask, jump)  # distances < 2^r from slot i, then from its 2^r-th ancestor
        jump = rows(jump, jump)
    return mask


@jax.jit
def walk(tree: Tree, target_tokens):
    """Accept the tree's longest path that the target agrees with.

    target_tokens [B, N + 1]: the target's token at each slot [root, nodes] (the token it would emit next
    after that slot's prefix). From the root, the walk moves to the child whose token is the target's
    token at the current slot (siblings carry distinct tokens: at most one), until no child matches.
    Returns (path [B, D + 1] int32: the accepted slots root first, 0 then the nodes at depths 1..a, -1
    after; a [B] int32: accepted nodes; bonus [B] int32: the target's token at the last accepted slot).
    The caller gathers K/V / features of slots path[:, :a + 1] into contiguous slots n..n + a.

    Greedy decoding passes the target's argmax. Sampling passes a token drawn from the target's processed
    distribution at every slot independently: every committed token is the target's draw at its parent's
    slot, and the tree is fixed before the target samples, so the output is distributed exactly as the
    target's own sampling. Static shape: a node matches when its token is the target's
    token at its parent; a prefix-AND of matches up its ancestors by pointer jumping (bit_length(D - 1)
    rounds) leaves at most one fully matched node per depth.
    """
    b, n = tree.tokens.shape
    parent_slot = tree.parents + 1
    match = tree.valid & (tree.tokens == jnp.take_along_axis(target_tokens, parent_slot, axis=1))
    ok = jnp.concatenate([jnp.ones((b, 1), bool), match], axis=1)  # per slot; the root is accepted
    jump = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), parent_slot], axis=1)
    for _ in range(_jump_rounds(tree.d_max - 1)):
        ok = ok & jnp.take_along_axis(ok, jump, axis=1)
        jump = jnp.take_along_axis(jump, jump, axis=1)
    depth = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), tree.depths], axis=1)
    at = ok[:, None, :] & (depth[:, None, :] == jnp.arange(tree.d_max + 1)[None, :, None])  # [B, D + 1, N + 1]
    found = at.any(-1)
    path = jnp.where(found, jnp.argmax(at, axis=-1), -1).astype(jnp.int32)
    a = found[:, 1:].sum(-1).astype(jnp.int32)
    last = jnp.take_along_axis(path, a[:, None], axis=1)
    return path, a, jnp.take_along_axis(target_tokens, last, axis=1)[:, 0]
