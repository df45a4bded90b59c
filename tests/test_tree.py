"""Draft trees (dflash_jax.tree) against Python references on tiny vocabularies.

References: brute force (every prefix of depth <= max_depth, float32 log q summed left to right as the
module does, sorted), a heapq best-first keyed (-log q, push order) for the tie-break, a parent-chain
walk for ancestor_mask and the walk from the root for ``walk``.
"""
from __future__ import annotations

import heapq
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import tree as T


def random_logq(rng, b, d, v, scale=2.0):
    return np.asarray(jax.nn.log_softmax(jnp.asarray(scale * rng.standard_normal((b, d, v)), jnp.float32)))


def all_prefixes(logq, max_depth):
    """logq [D, V] -> {token tuple: float32 log q} for every prefix of depth 1..max_depth."""
    out = {}
    for d in range(1, max_depth + 1):
        for u in itertools.product(range(logq.shape[1]), repeat=d):
            out[u] = out[u[:-1]] + logq[d - 1, u[-1]] if d > 1 else np.float32(logq[0, u[0]])
    return out


def prefixes_of(tree, row):
    """-> {token tuple: logp} of the row's valid nodes (each prefix read off the parent chain)."""
    tokens, parents, depths, logp = (np.asarray(x[row]) for x in (tree.tokens, tree.parents, tree.depths, tree.logp))
    out = {}
    for i in np.flatnonzero(depths > 0):
        u, j = [], i
        while j >= 0:
            u.append(int(tokens[j]))
            j = parents[j]
        out[tuple(reversed(u))] = logp[i]
    return out


def heap_reference(logq, budget, max_depth):
    """The module docstring's rule on one row logq [D, V]: -> [(token, parent, depth, logp)] in pop order."""
    order = np.argsort(-logq, axis=1, kind="stable")  # lax.top_k: equal values, lower id first
    push = itertools.count()
    heap = [(-logq[0, order[0, 0]], next(push), 1, 0, -1, np.float32(0))] if max_depth >= 1 else []
    nodes = []
    while heap and len(nodes) < budget:
        neg, _, d, r, p, up = heapq.heappop(heap)
        nodes.append((int(order[d - 1, r]), p, d, -neg))
        if r + 1 < logq.shape[1]:
            heapq.heappush(heap, (-(up + logq[d - 1, order[d - 1, r + 1]]), next(push), d, r + 1, p, up))
        if d < max_depth:
            heapq.heappush(heap, (-(-neg + logq[d, order[d, 0]]), next(push), d + 1, 0, len(nodes) - 1, -neg))
    return nodes


def check_structure(tree, logq):
    tokens, parents, depths, logp = (np.asarray(x) for x in (tree.tokens, tree.parents, tree.depths, tree.logp))
    for row in range(tokens.shape[0]):
        valid = depths[row] > 0
        n_valid = valid.sum()
        assert valid[:n_valid].all(), "padding only at the end"
        assert (parents[row, ~valid] == -1).all() and (tokens[row, ~valid] == 0).all()
        assert np.isneginf(logp[row, ~valid]).all()
        assert (logp[row, 1:][valid[1:]] <= logp[row, :-1][valid[1:]]).all(), "best-first order"
        siblings = set()
        for i in range(n_valid):
            p = parents[row, i]
            assert -1 <= p < i, "a parent before its children"
            up_depth, up_logp = (0, np.float32(0)) if p < 0 else (depths[row, p], logp[row, p])
            assert depths[row, i] == up_depth + 1
            assert logp[row, i] == up_logp + logq[row, depths[row, i] - 1, tokens[row, i]]
            assert (p, tokens[row, i]) not in siblings, "siblings carry distinct tokens"
            siblings.add((p, tokens[row, i]))


@pytest.mark.parametrize("v,d", [(5, 3), (7, 3), (4, 4)])
def test_top_n_equals_brute_force(v, d):
    """Continuous random log q (no ties): the exact top-N set and its log q, for budgets up to more than
    every prefix, one row per max_depth (0..D) in one batch."""
    rng = np.random.default_rng(v * 10 + d)
    max_depth = np.arange(d + 1, dtype=np.int32)
    logq = random_logq(rng, len(max_depth), d, v)
    total = sum(v ** k for k in range(1, d + 1))
    for budget in (3, 40, total + 5):
        tree = T.build_tree(jnp.asarray(logq), budget, jnp.asarray(max_depth))
        assert tree.tokens.shape == (len(max_depth), budget) and tree.d_max == d
        check_structure(tree, logq)
        for row, md in enumerate(max_depth):
            ref = sorted(all_prefixes(logq[row], md).items(), key=lambda kv: -kv[1])[:budget]
            assert prefixes_of(tree, row) == dict(ref)
            assert int(tree.valid[row].sum()) == len(ref)


def test_default_max_depth_is_d():
    logq = jnp.asarray(random_logq(np.random.default_rng(0), 2, 3, 5))
    full, limited = T.build_tree(logq, 20), T.build_tree(logq, 20, jnp.array([3, 9], jnp.int32))
    for a, b in zip(jax.tree_util.tree_leaves(full), jax.tree_util.tree_leaves(limited)):
        np.testing.assert_array_equal(a, b)


def test_ties_are_deterministic_and_exact():
    """Integer logits (exact ties within and across depths), zero probabilities (-inf) and a token of
    probability 1 (log q = 0: a child ties with its parent): equal to the heapq reference node for node,
    the multiset of log q equals the brute-force top N, closed under prefixes, batch == row by row
    (N = 40)."""
    rng = np.random.default_rng(1)
    v, d = 6, 4
    logits = rng.integers(0, 3, (5, d, v)).astype(np.float32)
    logits[1, :, 3:] = -np.inf
    logits[2, 1, 1:] = -np.inf  # depth 2 of row 2: token 0 with probability 1
    logits[3] = 0.0  # uniform
    logq = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    max_depth = np.array([4, 4, 3, 4, 2], np.int32)
    for budget in (1, 40, 400):
        tree = T.build_tree(jnp.asarray(logq), budget, jnp.asarray(max_depth))
        check_structure(tree, logq)
        for row in range(len(logq)):
            got = list(zip(*(np.asarray(x[row]).tolist() for x in (tree.tokens, tree.parents, tree.depths, tree.logp))))
            ref = heap_reference(logq[row], budget, max_depth[row])
            assert got[:len(ref)] == ref and all(node[2] == 0 for node in got[len(ref):])
            brute = sorted(all_prefixes(logq[row], max_depth[row]).values(), reverse=True)[:budget]
            np.testing.assert_array_equal(np.asarray(tree.logp[row, :len(brute)]), brute)
            held = prefixes_of(tree, row)
            assert all(u[:-1] in held for u in held if len(u) > 1)
            if budget == 40:
                one = T.build_tree(jnp.asarray(logq[row:row + 1]), budget, jnp.asarray(max_depth[row:row + 1]))
                for a, b in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(one)):
                    np.testing.assert_array_equal(np.asarray(a)[row], np.asarray(b)[0])


def test_greedy_chain():
    """The argmax chain to depth k is in the tree iff fewer than N prefixes score above its depth-k node
    (the exact top N need not hold the whole chain when N >= D); a peaked draft holds it with N = D."""
    rng = np.random.default_rng(2)
    v, d = 6, 4
    logq = random_logq(rng, 6, d, v, scale=1.5)
    depth_held = []
    for budget in (4, 30):
        tree = T.build_tree(jnp.asarray(logq), budget)
        for row in range(len(logq)):
            prefixes = all_prefixes(logq[row], d)
            scores = np.array(list(prefixes.values()))
            chain = tuple(np.argmax(logq[row], axis=1).tolist())
            held = prefixes_of(tree, row)
            for k in range(1, d + 1):
                assert (chain[:k] in held) == ((scores > prefixes[chain[:k]]).sum() < budget)
            depth_held.append(max(k for k in range(d + 1) if chain[:k] in held or k == 0))
    assert min(depth_held) < d and max(depth_held) == d  # both cases occur, N >= D throughout
    peaked = np.asarray(jax.nn.log_softmax(jnp.asarray(rng.standard_normal((3, 15, 50)) + 10 * np.eye(50)[:15]), -1))
    tree = T.build_tree(jnp.asarray(peaked, jnp.float32), 15)
    np.testing.assert_array_equal(tree.tokens, np.broadcast_to(np.arange(15), (3, 15)))
    np.testing.assert_array_equal(tree.parents, np.broadcast_to(np.arange(-1, 14), (3, 15)))


def random_trees(rng, b, n, v, d, max_depth=None):
    return T.build_tree(jnp.asarray(random_logq(rng, b, d, v)), n, None if max_depth is None else jnp.asarray(max_depth))


def test_ancestor_mask():
    rng = np.random.default_rng(3)
    tree = random_trees(rng, 4, 30, 3, 4, max_depth=np.array([4, 2, 1, 0], np.int32))  # rows 2, 3 padded
    parents = np.asarray(tree.parents)
    # plus a row of random parents: any parent < own index (a chain included), no depth bound given
    extra = np.array([[-1] + [int(rng.integers(-1, i)) for i in range(1, 29)] + [28]], np.int32)
    for par, d_max in ((parents, 4), (extra, None)):
        mask = np.asarray(T.ancestor_mask(jnp.asarray(par), d_max))
        assert mask.shape == (len(par), par.shape[1] + 1, par.shape[1] + 1)
        for row in range(len(par)):
            ref = np.eye(par.shape[1] + 1, dtype=bool)
            ref[:, 0] = True
            for i in range(par.shape[1]):
                j = par[row, i]
                while j >= 0:
                    ref[i + 1, j + 1] = True
                    j = par[row, j]
            np.testing.assert_array_equal(mask[row], ref)


def walk_reference(tree, row, targets):
    tokens, parents, valid = (np.asarray(x[row]) for x in (tree.tokens, tree.parents, tree.valid))
    path, node = [0], -1
    while True:
        child = [i for i in np.flatnonzero(valid & (parents == node)) if tokens[i] == targets[node + 1]]
        assert len(child) <= 1
        if not child:
            break
        node = int(child[0])
        path.append(node + 1)
    return path, targets[path[-1]]


def check_walk(tree, targets):
    path, a, bonus = (np.asarray(x) for x in T.walk(tree, jnp.asarray(targets, jnp.int32)))
    assert path.shape == (len(targets), tree.d_max + 1)
    for row in range(len(targets)):
        ref_path, ref_bonus = walk_reference(tree, row, targets[row])
        assert a[row] == len(ref_path) - 1 and bonus[row] == ref_bonus
        np.testing.assert_array_equal(path[row], ref_path + [-1] * (tree.d_max + 1 - len(ref_path)))
    return a


def test_walk_random_targets():
    """Random targets over a 3-token vocabulary (frequent partial matches), trees with padding (rows whose
    max_depth leaves fewer than N prefixes: padded nodes carry token 0 under the root and must never
    match), then row by row equals batched."""
    rng = np.random.default_rng(4)
    b, n, v, d = 8, 24, 3, 4
    tree = random_trees(rng, b, n, v, d, max_depth=np.array([4, 4, 4, 4, 2, 2, 1, 0], np.int32))
    assert not tree.valid[4:].all()
    accepted = []
    for _ in range(20):
        targets = rng.integers(0, v, (b, n + 1))
        accepted.append(check_walk(tree, targets))
        batched = T.walk(tree, jnp.asarray(targets, jnp.int32))
        one = T.walk(jax.tree_util.tree_map(lambda x: x[3:4], tree), jnp.asarray(targets[3:4], jnp.int32))
        for x, y in zip(batched, one):
            np.testing.assert_array_equal(np.asarray(x)[3:4], y)
    accepted = np.concatenate(accepted)
    assert set(accepted.tolist()) >= {0, 1, 2, 3}


def test_walk_full_chain_and_nothing():
    """Targets that follow a chosen deepest node all the way (accept its whole path; the bonus is the
    target's token there), and targets that match no child of the root (accept nothing)."""
    rng = np.random.default_rng(5)
    b, n, v, d = 4, 40, 5, 4
    tree = random_trees(rng, b, n, v, d)
    tokens, parents, depths = (np.asarray(x) for x in (tree.tokens, tree.parents, tree.depths))
    full = rng.integers(0, v, (b, n + 1))
    for row in range(b):
        j = int(np.argmax(depths[row]))
        while j >= 0:
            full[row, parents[row, j] + 1] = tokens[row, j]
            j = parents[row, j]
    a = check_walk(tree, full)
    np.testing.assert_array_equal(a, depths.max(1))
    nothing = rng.integers(0, v, (b, n + 1))
    for row in range(b):
        nothing[row, 0] = next(t for t in range(v) if t not in tokens[row][parents[row] == -1]) \
            if (parents[row] == -1).sum() < v else v  # every token is a root child: an impossible target
    np.testing.assert_array_equal(check_walk(tree, nothing), 0)


@pytest.mark.parametrize("v,d", [(5, 3), (4, 4)])
def test_chain_first_equals_brute_force(v, d):
    """``chain=True``: the greedy chain (as deep as budget and max_depth allow), then the most probable other
    prefixes; a tree (parents first) that contains the chain's nodes, best-first among the rest."""
    rng = np.random.default_rng(11)
    logq = random_logq(rng, d + 1, d, v, scale=1.0)  # flat: the exact top-N often drops deep chain nodes
    max_depth = np.arange(d + 1, dtype=np.int32)
    dropped = 0
    for budget in (2, d, 3 * d, v ** d + 3):
        tree = T.build_tree(jnp.asarray(logq), budget, jnp.asarray(max_depth), chain=True)
        plain = T.build_tree(jnp.asarray(logq), budget, jnp.asarray(max_depth))
        for row in range(d + 1):
            greedy = tuple(int(t) for t in logq[row].argmax(-1))
            m = min(budget, max_depth[row])
            chain = {greedy[:k] for k in range(1, m + 1)}
            rest = sorted(((p, u) for u, p in all_prefixes(logq[row], max_depth[row]).items() if u not in chain),
                          key=lambda x: -x[0])[:budget - m]
            got = prefixes_of(tree, row)
            assert set(got) == chain | {u for _, u in rest}
            assert not chain - set(prefixes_of(plain, row)) or len(got) == len(prefixes_of(plain, row))
            dropped += bool(chain - set(prefixes_of(plain, row)))
            depths = np.asarray(tree.depths[row])
            parents = np.asarray(tree.parents[row])
            assert all(-1 <= parents[i] < i for i in np.flatnonzero(depths > 0)), "a parent before its children"
    assert dropped  # the case that makes the option matter occurred
