"""Tree verification on hybrid targets (Gated DeltaNet, issue #38; docs/tree-verification.md).

Per layer: every slot of a tree verify equals a sequential run over its root-to-node path (token by token, the
recurrent form, committing each token), and compacting any node's path then committing leaves exactly the state
that run leaves (recurrent state and conv window, paths shorter than the conv width included), for chain, star,
deep, wide, padded and random trees mixed in one batch, and with decays of -1e3 (no inf / NaN). In the engine:
greedy output identical to plain decoding on qwen3_5 / qwen3_5_moe / qwen3_next with budgets 1 / 4 / 16 / 64,
ragged rows, a stop token and budgets that end inside a step, a DFlash2 draft, a data=2,tensor=2 mesh; the tree
never spends a node deeper than a row can commit. The sampled law on a hybrid target is in test_sampling.py."""
from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import decode as S
from dflash_jax import tree as tree_lib
from dflash_jax.decode import proposers
from dflash_jax.families.qwen3_5 import GatedDeltaNet, Qwen35Config, state_specs
from dflash_jax.families.qwen3_5_moe import Qwen35MoeConfig
from dflash_jax.families.qwen3_next import Qwen3NextConfig
from dflash_jax.target import Target, init_params
from pairs import random_draft
from test_draft import make_draft
from test_draft_formats import DFLASH2
from test_tree_verify import check
from tolerances import assert_close

HYBRID = dict(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=256,
              eos_token_id=1, initializer_range=0.1)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
CONFIGS = {"qwen3_5": lambda: Qwen35Config.from_hf(dict(HYBRID, model_type="qwen3_5_text")),
           "qwen3_5_moe": lambda: Qwen35MoeConfig.from_hf(dict(HYBRID, **MOE, model_type="qwen3_5_moe_text")),
           "qwen3_next": lambda: Qwen3NextConfig.from_hf(dict(HYBRID, **MOE, model_type="qwen3_next"))}
N = 12  # tree nodes per row (slots: N + 1 with the root)


def trees(rng) -> np.ndarray:
    """Parents [6, N] (node indices, -1 = the root) of six shapes: chain, star, deep (a chain with a side branch
    at every node), wide (two levels), padded (3 real nodes, the rest tree.py's padding: children of the root),
    random (each node under a random earlier one)."""
    chain = np.arange(-1, N - 1)
    star = np.full(N, -1)
    deep = np.array([-1] + [max(i - 2, -1) if i % 2 else i - 1 for i in range(1, N)])
    wide = np.array([-1, -1, -1] + [(i % 3) for i in range(3, N)])
    padded = np.array([-1, 0, 1] + [-1] * (N - 3))
    random = np.array([-1] + [rng.randint(-1, i) for i in range(1, N)])
    return np.stack([chain, star, deep, wide, padded, random]).astype(np.int32)


@functools.cache
def layer(decay_shift: float = 0.0):
    """A GatedDeltaNet layer of the tiny hybrid config (fp32) and its parameters; ``decay_shift`` added to
    A_log makes every log decay ~exp(shift) times larger."""
    cfg = CONFIGS["qwen3_5"]()
    mod = GatedDeltaNet(cfg)
    x = jnp.zeros((1, 1, cfg.hidden_size))
    params = nn.meta.unbox(mod.init(jax.random.PRNGKey(0), x, jnp.zeros((1, 1), jnp.int32), None))["params"]
    params = {"params": {**params, "A_log": params["A_log"] + decay_shift}}
    return cfg, mod, params


def start_state(cfg, rows: int, max_block: int, rng):
    """A Recurrent state with a random committed recurrent state and conv window (not zeros: the conv taps past
    the root and the decay of S_0 are what a wrong tree would get wrong)."""
    spec = state_specs(cfg)[0]
    st = spec.init(rows, 64, jnp.float32, max_block)
    value = {"conv": jnp.asarray(rng.randn(*st.value["conv"].shape), jnp.float32),
             "ssm": jnp.asarray(rng.randn(*st.value["ssm"].shape) * 0.5, jnp.float32)}
    return st.replace(value=value)


@functools.cache
def one_token(mod):
    """One committed token of the layer (the recurrent form), jitted once for every path."""
    def step(params, x, position, st):
        o, st = mod.apply(params, x, position, st)
        return o, st.commit(jnp.ones((1,), jnp.int32))

    return jax.jit(step)


@jax.jit
def compact_commit(st, src, dst, kept):
    return st.compact(src, dst).commit(kept)


def sequential(mod, params, x_path, st, n0):
    """The sequential run over one path: one token per forward, each committed -> (outputs [1, T, D], the state
    after the path)."""
    outs = []
    for j in range(x_path.shape[1]):
        o, st = one_token(mod)(params, x_path[:, j:j + 1], jnp.full((1, 1), n0 + j, jnp.int32), st)
        outs.append(o)
    return jnp.concatenate(outs, axis=1), st


@pytest.mark.parametrize("decay_shift", [0.0, 7.0])
def test_every_slot_and_every_commit_equals_the_sequential_run_over_its_path(decay_shift):
    cfg, mod, params = layer(decay_shift)
    rng = np.random.RandomState(int(decay_shift) + 1)
    parents = trees(rng)
    b, t = parents.shape[0], N + 1
    depths = np.zeros_like(parents)
    for r in range(b):
        for i in range(N):
            depths[r, i] = 0 if parents[r, i] < 0 and r == 4 and i >= 3 else (
                1 if parents[r, i] < 0 else depths[r, parents[r, i]] + 1)
    n0 = 5  # the root's position
    positions = n0 + np.concatenate([np.zeros((b, 1), np.int32), depths], axis=1)
    x = jnp.asarray(rng.randn(b, t, cfg.hidden_size), jnp.float32)
    st0 = start_state(cfg, b, t, rng)
    mask = tree_lib.ancestor_mask(jnp.asarray(parents))
    with jax.default_matmul_precision("highest"):
        out, st = mod.apply(params, x, jnp.asarray(positions), st0, ancestors=mask)
    assert np.isfinite(np.asarray(out)).all()
    slot_parent = np.concatenate([np.full((b, 1), -1), parents + 1], axis=1)  # over slots; the root's is -1
    for r in range(b):
        row0 = jax.tree_util.tree_map(lambda a: a[r:r + 1], st0)
        for i in range(t):
            path = [i]
            while slot_parent[r, path[-1]] >= 0:
                path.append(int(slot_parent[r, path[-1]]))
            path = path[::-1]
            with jax.default_matmul_precision("highest"):
                want_out, want_st = sequential(mod, params, x[r:r + 1, np.array(path)], row0, n0)
            # the same terms summed in other orders (a path of <= 13 tokens through dk = 16, a conv of 4, the
            # out_proj's hidden width): ulps of each quantity's scale; a sibling in a window is off by O(scale)
            depth = 4 * len(path) * (cfg.linear_key_head_dim + t) + cfg.hidden_size
            assert_close(out[r, i], want_out[0, -1], depth, what=f"row {r} slot {i} output")
            src = np.full((1, t), -1)
            src[0, :len(path)] = n0 + np.array(path)
            row = jax.tree_util.tree_map(lambda a: a[r:r + 1], st)
            got = compact_commit(row, jnp.asarray(src), jnp.asarray(n0 + np.arange(t))[None],
                                 jnp.asarray([len(path)], jnp.int32))
            for leaf in ("conv", "ssm"):
                assert_close(got.value[leaf], want_st.value[leaf], depth, what=f"row {r} slot {i} {leaf}")


def test_another_topological_order_of_the_same_tree_gives_the_same_slots():
    """The random tree of ``trees`` relabelled breadth-first (another order with every parent before its
    children): each node's output is the same, within rounding (its path is the same; the solve runs in another
    order)."""
    cfg, mod, params = layer()
    rng = np.random.RandomState(5)
    parents = trees(rng)[5]
    depth = np.zeros(N, int)
    for i in range(N):
        depth[i] = 1 if parents[i] < 0 else depth[parents[i]] + 1
    order = np.argsort(depth, kind="stable")  # new node j is old node order[j]
    new_of = np.argsort(order)
    relabelled = np.array([-1 if parents[o] < 0 else new_of[parents[o]] for o in order], np.int32)
    assert (relabelled < np.arange(N)).all() and not (order == np.arange(N)).all()
    x = jnp.asarray(rng.randn(1, N + 1, cfg.hidden_size), jnp.float32)
    slots = np.concatenate([[0], order + 1])  # the root stays slot 0
    st0 = start_state(cfg, 1, N + 1, rng)
    outs = []
    for p, xs, d in ((parents, x, depth), (relabelled, x[:, slots], depth[order])):
        positions = jnp.asarray(5 + np.concatenate([[0], d]))[None].astype(jnp.int32)
        with jax.default_matmul_precision("highest"):
            mask = tree_lib.ancestor_mask(jnp.asarray(p)[None])
            outs.append(mod.apply(params, xs, positions, st0, ancestors=mask)[0])
    assert_close(outs[1], outs[0][:, slots], 4 * (N + 1) * (cfg.linear_key_head_dim + N + 1) + cfg.hidden_size,
                 what="relabelled outputs")


def test_a_chain_shaped_tree_matches_the_chain_verify():
    """The chain is one tree: a chain-shaped tree's outputs and commits equal the chain path's (causal conv and
    chunked form without a mask) within the chunked form's rounding (the path sums of the log decay are an
    einsum where the chain takes a cumsum)."""
    cfg, mod, params = layer()
    rng = np.random.RandomState(3)
    b, t = 2, N + 1
    x = jnp.asarray(rng.randn(b, t, cfg.hidden_size), jnp.float32)
    st0 = start_state(cfg, b, t, rng)
    positions = jnp.broadcast_to(5 + jnp.arange(t, dtype=jnp.int32), (b, t))
    mask = tree_lib.ancestor_mask(jnp.broadcast_to(jnp.arange(-1, N - 1, dtype=jnp.int32), (b, N)))
    tree_out, tree_st = mod.apply(params, x, positions, st0, ancestors=mask)
    chain_out, chain_st = mod.apply(params, x, positions, st0)
    depth = 4 * t * (cfg.linear_key_head_dim + t)
    assert_close(tree_out, chain_out, depth, what="outputs")
    for kept in (1, 2, 7, t):
        k = jnp.full((b,), kept, jnp.int32)
        for leaf in ("conv", "ssm"):
            assert_close(tree_st.commit(k).value[leaf], chain_st.commit(k).value[leaf], depth, what=f"{kept} {leaf}")


def test_a_stashed_forward_longer_than_a_chunk_folds_to_the_direct_state():
    """A forward of 70 tokens (two chunks of the chunked form) with ragged rows (70 and 67 real tokens, padding at
    the end) into a cache whose max_block (80) stashes it: committing any prefix (10, 64, 65, 66, all) leaves the
    state that a forward of exactly that prefix writes directly (max_block below its length)."""
    cfg, mod, params = layer()
    rng = np.random.RandomState(4)
    t, lens = 70, np.array([70, 67])
    x = jnp.asarray(rng.randn(2, t, cfg.hidden_size), jnp.float32)
    positions = jnp.asarray(np.where(np.arange(t) < lens[:, None], 3 + np.arange(t), -1), jnp.int32)
    st0 = start_state(cfg, 2, 80, rng)
    _, pending = mod.apply(params, x, positions, st0)
    for kept in (10, 64, 65, 66, 70):
        k = np.minimum(kept, lens)
        got = pending.commit(jnp.asarray(k, jnp.int32))
        direct = start_state(cfg, 2, 4, np.random.RandomState(4)).replace(value=st0.value)  # max_block 4: written
        cut = jnp.asarray(np.where(np.arange(t) < k[:, None], np.asarray(positions), -1), jnp.int32)
        _, want = mod.apply(params, x, cut, direct)
        # the same delta rule summed in other orders over up to 70 tokens of width 16
        for leaf in ("conv", "ssm"):
            assert_close(got.value[leaf], want.value[leaf], 4 * t * (cfg.linear_key_head_dim + 64),
                         what=f"{kept} {leaf}")


@functools.cache
def pair(family: str):
    cfg = CONFIGS[family]()
    return Target(cfg, init_params(cfg, 0)), random_draft(cfg, block_size=16)


PROMPTS = [[3, 4, 5], [2, 6, 3, 5, 4, 2, 6, 3, 5], [4], [5, 2, 6, 6, 3, 2, 4, 5, 3, 6, 2, 4, 5, 3, 2, 6, 4]]


@pytest.mark.parametrize("family,budget", [("qwen3_5", 4), ("qwen3_5", 64), ("qwen3_5_moe", 16), ("qwen3_next", 16),
                                           pytest.param("qwen3_5", 1, marks=pytest.mark.slow),
                                           pytest.param("qwen3_5", 16, marks=pytest.mark.slow),
                                           pytest.param("qwen3_5_moe", 64, marks=pytest.mark.slow),
                                           pytest.param("qwen3_next", 64, marks=pytest.mark.slow)])
def test_greedy_tree_equals_plain_decoding(family, budget):
    """Ragged rows, 40 tokens; the trees accept partly (asserted: some step keeps more than the bonus and fewer
    than the deepest node)."""
    target, draft = pair(family)
    want = S.generate(target, PROMPTS, max_new_tokens=40, stop_token_ids=[])
    got = S.speculative_generate(target, draft, PROMPTS, max_new_tokens=40, stop_token_ids=[], tree_budget=budget)
    check(got, want, budget)
    if budget > 1:
        assert any(1 < a < 16 for r in got for a in r.acceptance_lengths)


def test_stop_tokens_and_budgets_that_end_inside_a_step():
    target, draft = pair("qwen3_5")
    for stop, new in (([4], 40), ([], 7), ([], 13)):
        want = S.generate(target, PROMPTS, max_new_tokens=new, stop_token_ids=stop)
        check(S.speculative_generate(target, draft, PROMPTS, max_new_tokens=new, stop_token_ids=stop, tree_budget=16),
              want, 16)
        if stop:
            assert any(r.output_ids[-1] == 4 for r in want)  # a row stopped on it


def test_dflash2_draft_on_a_hybrid_target():
    target, _ = pair("qwen3_5")
    draft = make_draft(target.config, layers=1, block=8, ids=(0, 2, 3), seed=3, **DFLASH2)
    want = S.generate(target, PROMPTS, max_new_tokens=24, stop_token_ids=[])
    check(S.speculative_generate(target, draft, PROMPTS, max_new_tokens=24, stop_token_ids=[], tree_budget=8),
          want, 8, block=8)


def test_the_tree_is_never_deeper_than_a_row_can_commit(monkeypatch):
    """Every built tree's deepest node <= the row's remaining tokens - 1 (the bonus token takes the last one), on
    a hybrid and a dense target, with budgets that end inside a step."""
    from pairs import random_pair

    seen = []
    base = proposers.PROPOSERS["dflash"]

    @dataclasses.dataclass(frozen=True)
    class Recording(base):
        def propose_tree(self, spec, view, max_depth):
            tree = super().propose_tree(spec, view, max_depth)
            jax.debug.callback(lambda d, n: seen.append((np.asarray(d), np.asarray(n))),
                               jnp.max(tree.depths, axis=1), view.block_len - 1)
            return tree

    monkeypatch.setitem(proposers.PROPOSERS, "dflash", Recording)
    dense = random_pair(vocab=8, block_size=16)
    for target, draft in (pair("qwen3_5"), dense):
        for new in (5, 11):
            seen.clear()
            S.speculative_generate(target, draft, PROMPTS, max_new_tokens=new, stop_token_ids=[], tree_budget=64)
            assert seen
            for deepest, remaining in seen:  # block_len - 1 = min(remaining, K - 1) tokens after the pending one
                assert (deepest <= np.maximum(remaining - 1, 0)).all(), (deepest, remaining)
            assert any((d == np.maximum(n - 1, 0)).any() for d, n in seen)  # the cap is reached, not just respected


@pytest.mark.parametrize("family", ["qwen3_5"])
def test_sharded_tree_equals_one_device(family):
    from dflash_jax import model_sharding as ms
    from dflash_jax import sharding as sh

    target, draft = pair(family)
    want = S.speculative_generate(target, draft, PROMPTS, max_new_tokens=24, stop_token_ids=[], tree_budget=16)
    mesh = sh.make_mesh("data=2,tensor=2", devices=jax.devices()[:4])
    got = S.speculative_generate(ms.shard_target(target, mesh), ms.shard_draft(draft, mesh), PROMPTS,
                                 max_new_tokens=24, stop_token_ids=[], tree_budget=16)
    assert [r.output_ids for r in got] == [w.output_ids for w in want]
    assert [r.acceptance_lengths for r in got] == [w.acceptance_lengths for w in want]


@pytest.mark.slow  # a quality claim: trains a draft for a hybrid target (~2 min); losslessness stays in the fast suite
def test_tree_tau_above_chain_with_a_trained_draft(tmp_path):
    """A draft trained by the project's trainer for a tiny qwen3_5 target with a peaked head: tau of trees of 16
    and 64 nodes above the chain's on the same prompts, every output identical to plain decoding."""
    from pairs import trained_pair

    cfg = Qwen35Config.from_hf(dict(HYBRID, vocab_size=64, eos_token_id=62, tie_word_embeddings=False,
                                    model_type="qwen3_5_text"))
    target, draft, prompts = trained_pair(str(tmp_path), tcfg=cfg)
    rows = prompts[:8]
    plain = S.generate(target, rows, max_new_tokens=40, stop_token_ids=[])
    chain = S.speculative_generate(target, draft, rows, max_new_tokens=40, stop_token_ids=[])
    assert [r.output_ids for r in chain] == [w.output_ids for w in plain]
    tau = {"chain": np.mean([a for r in chain for a in r.acceptance_lengths])}
    for budget in (16, 64):
        tree = S.speculative_generate(target, draft, rows, max_new_tokens=40, stop_token_ids=[], tree_budget=budget)
        check(tree, plain, budget)
        tau[budget] = np.mean([a for r in tree for a in r.acceptance_lengths])
    print("tau", {k: round(float(v), 3) for k, v in tau.items()})
    assert tau[64] >= tau[16] > tau["chain"] > 1.2


@pytest.mark.slow  # 30 s; the fast suite keeps its parts: qwen3_5 trees of 64 (test_greedy_tree_equals_plain_decoding),
# the tree CLI (tests/test_tree_cli.py), saved hybrid checkpoints (tests/test_qwen3_5.py)
def test_generate_cli_tree_budget_64_on_a_saved_hybrid_pair(tmp_path, capsys):
    """``python -m infer.generate --tree-budget 64`` on a qwen3_5 checkpoint and draft written in the Hugging Face
    layouts: every output equals plain decoding, 65 tokens verified per step."""
    import json

    import dflash_jax as dj
    from dflash_jax.drafts.model import save_draft
    from dflash_jax.target import save_target
    from infer import generate as g

    target, draft = pair("qwen3_5")
    tdir, ddir = save_target(target, str(tmp_path / "target")), str(tmp_path / "draft")
    save_draft(draft, ddir, dtype="float32")
    argv = ["--target", tdir, "--draft", ddir, "--max-new-tokens", "20", "--ignore-eos", "--tree-budget", "64",
            "--json"] + [a for p in PROMPTS[:3] for a in ("--prompt-ids", ",".join(map(str, p)))]
    assert g.main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    plain = S.generate(dj.load_target(tdir), PROMPTS[:3], max_new_tokens=20, stop_token_ids=[])
    assert [r["output_ids"] for r in rows] == [p.output_ids for p in plain]
    assert all(set(r["verify_lengths"]) == {65} for r in rows)
