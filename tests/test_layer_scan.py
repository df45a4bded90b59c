"""Scanned layers (``TargetConfig.scan_layers``, ``dflash_jax.layer_scan``): runs of identical layers as one scan,
their parameters stacked, their caches read and written in place through the scan's carry. The scanned target
computes what the unrolled one does (logits, features, every cache kind of the dense family: full, paged, sliding
rings), decodes the same greedy tokens through every engine path (closed batch, paged engine, tree verification, a
mesh), and reads / writes the same per-layer checkpoints."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from dflash_jax import decode, layer_scan
from dflash_jax import model_sharding as ms
from dflash_jax import sharding as sh
from dflash_jax import target as T
from dflash_jax.decode import Request
from pairs import random_pair, tight_pool

# full, full, then (sliding, full) three times, then sliding: a run of one kind, a repeating pattern, a lone layer
TYPES = ("full_attention",) * 2 + ("sliding_attention", "full_attention") * 3 + ("sliding_attention",)
NEW = 20


@pytest.fixture(scope="module")
def pair():
    target, draft = random_pair(layers=9, target_layer_ids=(0, 5, 8), layer_types=TYPES, sliding_window=6)
    return target, T.scanned(target), draft


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(2, 90, n).tolist() for n in (5, 9, 13, 3)]


@pytest.fixture(scope="module")
def plain(pair, prompts):
    return [r.output_ids for r in decode.speculative_generate(pair[0], None, prompts, max_new_tokens=NEW,
                                                              stop_token_ids=[])]


def test_runs_group_equal_neighbours_and_parameters_stack_back(pair):
    target, scanned, _ = pair
    assert layer_scan.groups("aabba") == ((0, 2, 1), (2, 2, 1), (4, 1, 1))
    assert layer_scan.groups("abc") == ((0, 1, 1), (1, 1, 1), (2, 1, 1))
    # a repeating pattern scans by its period (the longest cover wins, then the shortest period)
    assert layer_scan.groups("aaabaaabaaabcc") == ((0, 3, 4), (12, 2, 1))
    assert layer_scan.groups("ababab") == ((0, 3, 2),)
    assert T.layer_groups(scanned.config) == ((0, 2, 1), (2, 3, 2), (8, 1, 1))
    assert sorted(k for k in scanned.params if k.startswith("layers_")) == ["layers_0_1", "layers_2_7", "layers_8"]
    q = scanned.params["layers_2_7"]["layer_1"]["self_attn"]["q_proj"]["kernel"]  # layers 3, 5, 7
    np.testing.assert_array_equal(q[1], target.params["layers_5"]["self_attn"]["q_proj"]["kernel"])
    # the scanned decoder's own parameter shapes are the stacked ones (random init, sharding rules read them)
    shapes = traverse_util.flatten_dict(T.param_shapes(scanned.config))
    assert {k: v.shape for k, v in shapes.items()} == {
        k: v.shape for k, v in traverse_util.flatten_dict(scanned.params).items()}
    back = T.scanned(scanned, False)
    assert not back.config.scan_layers
    jax.tree_util.tree_map(np.testing.assert_array_equal, back.params, target.params)


def test_scanned_forward_equals_unrolled_with_and_without_a_cache(pair):
    """Logits and features (the embedding, layers inside runs, a lone last layer) of a full forward, a prefill and
    two verify-sized forwards: equal to float rounding (the unrolled and scanned programs may order a sum
    differently; 1e-5 on logits of size ~1)."""
    target, scanned, _ = pair
    ids = np.random.default_rng(1).integers(0, 96, (2, 11)).astype(np.int32)
    pos = np.broadcast_to(np.arange(11, dtype=np.int32), ids.shape)
    fid = (-1, 1, 4, 5, 8)
    close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)  # noqa: E731
    a = T.forward(target.config, target.params, ids, pos, None, fid)
    b = T.forward(scanned.config, scanned.params, ids, pos, None, fid)
    close(a[0], b[0]), close(a[1], b[1])
    caches = [T.new_cache(m.config, 2, 32, jnp.float32, 4) for m in (target, scanned)]
    assert [type(s).__name__ for s in caches[1].layers] == ["Stacked"] * 3 + ["SlidingKV"]
    assert caches[1].layers[1].inner.k.shape[:2] == (2, 3)  # rows first, then the pattern's 3 sliding layers
    for start, end in ((0, 7), (7, 9), (9, 11)):
        outs = []
        for i, m in enumerate((target, scanned)):
            logits, feats, cache = T.forward(m.config, m.params, ids[:, start:end], pos[:, start:end], caches[i], fid)
            caches[i] = cache.commit(jnp.full((2,), end - start))
            outs.append((logits, feats))
        close(outs[0][0], outs[1][0]), close(outs[0][1], outs[1][1])
        close(outs[1][0], a[0][:, start:end])


def test_scanned_target_decodes_the_same_greedy_tokens_on_every_path(pair, prompts, plain):
    """Speculative greedy output with a scanned target equals the unrolled target's plain greedy output: the closed
    batch (its full caches read as pages of the stack), tree verification (``compact`` of stacked states), the
    paged engine (stacked pools, a layer-offset block table) with a pool small enough to preempt rows."""
    _, scanned, draft = pair
    same = lambda out: [r.output_ids for r in out] == plain  # noqa: E731
    assert same(decode.speculative_generate(scanned, None, prompts, max_new_tokens=NEW, stop_token_ids=[]))
    assert same(decode.speculative_generate(scanned, draft, prompts, max_new_tokens=NEW, stop_token_ids=[],
                                            block_size=4))
    assert same(decode.speculative_generate(scanned, draft, prompts, max_new_tokens=NEW, stop_token_ids=[],
                                            block_size=4, tree_budget=6))
    requests = [Request(p, max_new_tokens=NEW) for p in prompts]
    assert same(decode.continuous_generate(scanned, draft, requests, max_batch=2, stop_token_ids=[], warm=False))
    engine = decode.Engine(scanned, draft, decode.DecodeOptions(max_new_tokens=NEW), max_batch=3, max_length=48)
    pools = engine.empty().pools[0]
    assert [k.shape[:2] for k, _ in pools] == [(2, engine.pool.pages), (3, engine.pool.pages)]  # stacked
    stats = decode.RunStats()
    tight = decode.continuous_generate(scanned, draft, requests, max_batch=3, stop_token_ids=[], stats=stats,
                                       kv_cache_memory=tight_pool(scanned, draft, requests, 3), warm=False)
    assert same(tight) and stats.preemptions >= 1, stats


def test_scanned_target_on_a_mesh_decodes_what_one_device_does(pair, prompts, plain):
    _, scanned, draft = pair
    mesh = sh.make_mesh("data=2,fsdp=1,tensor=4")
    ts, ds = ms.shard_target(scanned, mesh), ms.shard_draft(draft, mesh)
    q = ts.params["layers_0_1"]["layer_0"]["self_attn"]["q_proj"]["kernel"]  # [layers, embed, heads]
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, None, "tensor")
    out = decode.speculative_generate(ts, ds, prompts, max_new_tokens=NEW, stop_token_ids=[], block_size=4)
    assert [r.output_ids for r in out] == plain
    requests = [Request(p, max_new_tokens=NEW) for p in prompts]
    out = decode.continuous_generate(ts, ds, requests, max_batch=2, stop_token_ids=[], warm=False)
    assert [r.output_ids for r in out] == plain


def test_a_scanned_load_reads_and_writes_per_layer_checkpoints(tiny_hf, tmp_path):
    path, _ = tiny_hf("qwen3_scan", "qwen3", num_hidden_layers=3)
    unrolled = T.load_target(path)
    scanned = T.load_target(path, scan_layers=True)
    assert scanned.config.scan_layers and list(scanned.params) != list(unrolled.params)
    ids = np.arange(2, 12, dtype=np.int32)[None]
    np.testing.assert_allclose(T.target_logits(scanned, ids), T.target_logits(unrolled, ids), atol=1e-5)
    again = T.load_target(T.save_target(scanned, str(tmp_path / "saved")))  # written per layer
    assert not again.config.scan_layers
    jax.tree_util.tree_map(np.testing.assert_array_equal, again.params, unrolled.params)



def test_a_family_without_layer_kinds_is_refused_before_reading(pair, monkeypatch, tiny_hf):
    """A family that declares no ``layer_kinds`` cannot scan: ``scanned`` and ``load_target(scan_layers=True)`` say
    so, naming the family, before any tensor is read."""
    import dataclasses

    from dflash_jax import families
    from dflash_jax.families import dense

    monkeypatch.setitem(families._REGISTRY, "qwen3", dataclasses.replace(dense.FAMILY, layer_kinds=None))
    with pytest.raises(ValueError, match="scanned layers are not built for the dense family"):
        T.scanned(pair[0])
    path, _ = tiny_hf("qwen3_scan", "qwen3", num_hidden_layers=3)
    monkeypatch.setattr(T, "load_params", lambda *a, **k: pytest.fail("read the checkpoint"))
    with pytest.raises(ValueError, match="scanned layers are not built for the dense family"):
        T.load_target(path, scan_layers=True)
