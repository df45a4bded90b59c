"""The Pallas kernels per shard (``sharding.per_shard``) on 8 fake CPU devices (tests/conftest.py).

Decode attention (target decode with sinks, verify, the draft's block with its own keys, a tree mask) and a
training step with the block-attention kernel, in interpret mode inside ``shard_map`` on data, tensor,
data x tensor and data x expert meshes, equal the single-device result. The compiled programs have no
collective around the kernel when rows and heads split; the kernels' TPU custom calls, lowered here for
TPU, see per-shard operand shapes.
"""
from __future__ import annotations

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from dflash_jax import attention as A
from dflash_jax import model_sharding as ms
from dflash_jax import sharding as sh
from dflash_jax.sharding.rules import logical_to_mesh
from pairs import random_pair
from tolerances import assert_trees_close, f32_rel, loss_depth

B, T, HQ, HKV, D, S = 8, 4, 8, 4, 16, 32
# rows over data, heads over tensor; tensor=8 > 4 KV heads (heads unsplit); expert: attention replicated on it
MESHES = ["data=8", "data=2,tensor=4", "tensor=8", "data=2,expert=4"]
SPLIT = {"data=8": (8, 1), "data=2,tensor=4": (2, 4), "tensor=8": (1, 1), "data=2,expert=4": (2, 1)}
COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")
QUERIES = ("cache_batch", "cache_len", "cache_heads", "cache_head_dim")
CACHE = ("cache_batch", "cache_len", "cache_kv_heads", "cache_head_dim")


def _inputs():
    rng = np.random.RandomState(0)
    lengths = np.array([5, 17, S - T, 9, 1, 12, 0, 20], np.int32)
    q_pos = lengths[:, None] + np.arange(T, dtype=np.int32)
    q_pos[6, 2:] = -1  # padding queries
    tree = np.tril(np.ones((T, T), bool))[None].repeat(B, 0)
    tree[:, 2, 1] = False  # node 2 hangs off the root, beside node 1
    return dict(q=rng.randn(B, T, HQ, D).astype(np.float32), k=rng.randn(B, S, HKV, D).astype(np.float32),
                v=rng.randn(B, S, HKV, D).astype(np.float32), q_pos=q_pos, lengths=lengths,
                kn=rng.randn(B, T, HKV, D).astype(np.float32), vn=rng.randn(B, T, HKV, D).astype(np.float32),
                sinks=rng.randn(HQ).astype(np.float32), tree=tree)


def _attention(x):
    """The decode-attention calls of a decode step: target decode (1 query, sinks), verify (T queries on the
    cache), the draft's block (own keys, window) and a tree verify (own keys under a mask)."""
    one = dict(impl="interpret")
    return (A.decode_attention(x["q"][:, :1], x["k"], x["v"], x["q_pos"][:, :1], x["lengths"] + 1,
                               sinks=x["sinks"], **one),
            A.decode_attention(x["q"], x["k"], x["v"], x["q_pos"], x["lengths"] + T, **one),
            A.decode_attention(x["q"], x["k"], x["v"], x["q_pos"], x["lengths"], x["kn"], x["vn"], sliding_window=8,
                               **one),
            A.decode_attention(x["q"], x["k"], x["v"], x["q_pos"], x["lengths"], x["kn"], x["vn"], new_mask=x["tree"],
                               **one))


_attention_jit = jax.jit(_attention)


def _placed(x, mesh):
    """The inputs on ``mesh`` as the logical rules lay them out (what the engine's caches and queries have)."""
    names = dict(q=QUERIES, k=CACHE, v=CACHE, q_pos=("cache_batch",), lengths=("cache_batch",), kn=CACHE, vn=CACHE,
                 sinks=("cache_heads",), tree=("cache_batch",))
    return {n: jax.device_put(a, NamedSharding(mesh, logical_to_mesh(names[n], a.shape, mesh))) for n, a in x.items()}


@pytest.fixture(scope="module")
def single():
    x = _inputs()
    return x, jax.device_get(_attention_jit(x))


def _collectives(hlo: str) -> dict:
    return {op: len(re.findall(rf"\b{op}(?:-start)?\(", hlo)) for op in COLLECTIVES}


@pytest.mark.parametrize("spec", MESHES)
def test_decode_attention_per_shard_equals_single_device(single, spec, caplog):
    x, want = single
    mesh = sh.make_mesh(spec)
    placed = _placed(x, mesh)
    with jax.set_mesh(mesh), caplog.at_level(logging.WARNING, "dflash_jax.sharding.per_shard"):
        got = _attention_jit(placed)
        hlo = _attention_jit.lower(placed).compile().as_text()
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), w)  # each shard runs the same kernel on its own rows / heads
    rows, heads = SPLIT[spec]
    assert got[1].sharding.shard_shape(got[1].shape) == (B // rows, T, HQ // heads, D)
    counts = _collectives(hlo)
    if spec == "tensor=8":  # 4 KV heads cannot split 8 ways: queries gathered, every device runs all heads
        assert counts["all-gather"] > 0 and "do not split alike" in caplog.text
    else:
        assert sum(counts.values()) == 0, counts


def _tpu_custom_call_shapes(fn, *args) -> list[str]:
    """The operand types of every Mosaic custom call of ``fn`` lowered for TPU (no TPU needed to lower)."""
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    calls = [line for line in text.splitlines() if "tpu_custom_call" in line]
    assert calls, "no Mosaic kernel in the lowered module"
    return [re.search(r":\s*\((.*)\)\s*->", c).group(1) for c in calls]


def test_tpu_kernels_see_per_shard_shapes():
    """Lowered for TPU on data=2 x tensor=4: the decode kernel reads its shard's cache as it is held, [B/2, S, D] (one
    K/V head a shard: without its unit axis), and the block kernel's heads-major queries [B/2, Hq/4, rows, D];
    without a mesh, the global shapes ([B, S, Hkv, D])."""
    mesh = sh.make_mesh("data=2,tensor=4")
    d, s, bs = 128, 64, 8  # the TPU decode kernel wants whole 128-lane heads
    sd = jax.ShapeDtypeStruct
    dec = (sd((B, 1, HQ, d), jnp.bfloat16), sd((B, s, HKV, d), jnp.bfloat16), sd((B, s, HKV, d), jnp.bfloat16),
           sd((B, 1), jnp.int32), sd((B,), jnp.int32))
    decode = lambda q, k, v, p, n: A.decode_attention(q, k, v, p, n, impl="kernel")  # noqa: E731
    with jax.set_mesh(mesh):
        sharded = _tpu_custom_call_shapes(decode, *dec)
    whole = _tpu_custom_call_shapes(decode, *dec)
    assert HKV // 4 == 1 and f"tensor<{B // 2}x{s}x{d}xbf16>" in sharded[0] and f"tensor<{B}x" not in sharded[0]
    assert f"tensor<{B}x{s}x{HKV}x{d}xbf16>" in whole[0]

    n = 2  # blocks per row
    blk = (sd((B, n * bs, HQ, d), jnp.bfloat16), sd((B, s, HKV, d), jnp.bfloat16), sd((B, s, HKV, d), jnp.bfloat16),
           sd((B, n * bs, HKV, d), jnp.bfloat16), sd((B, n * bs, HKV, d), jnp.bfloat16), sd((B, n), jnp.int32))
    block = lambda *a: A.block_attention(*a, block_size=bs, impl="kernel")  # noqa: E731
    with jax.set_mesh(mesh):
        sharded = _tpu_custom_call_shapes(block, *blk)
    assert re.search(rf"tensor<{B // 2}x{HQ // 4}x\d+x{d}xbf16>", sharded[0]), sharded[0]
    assert f"tensor<{B}x" not in sharded[0]


def test_cache_layouts_follow_the_logical_rules():
    """Every state kind's leaves take the layout their ``LOGICAL_AXES`` give through the rules table: change a
    rule and the cache follows."""
    from jax.sharding import PartitionSpec as P

    from dflash_jax.state import LayerStates, KVSpec, RecurrentSpec, SharedKVSpec

    mesh = sh.make_mesh("data=2,tensor=4")
    specs = (KVSpec(4, 16), KVSpec(4, 16, window=4), RecurrentSpec((("conv", (3, 8), None),), (("x", (3,), None),), None), SharedKVSpec())
    cache = LayerStates.create(specs, 8, 32, jnp.float32, max_block=4)

    def layouts(rules):
        out = jax.jit(lambda c: sh.constrain_cache(c, mesh, rules))(cache)
        full, ring, rec, _ = out.layers
        return {"full.k": full.k, "ring.v": ring.v, "ring.pos": ring.pos, "rec.value": rec.value["conv"],
                "rec.stash": rec.stash["x"], "rec.count": rec.count, "lengths": out.lengths}

    want = {"full.k": P("data", None, "tensor"), "ring.v": P("data", None, "tensor"), "ring.pos": P("data"),
            "rec.value": P("data"), "rec.stash": P("data"), "rec.count": P("data"), "lengths": P("data")}
    for name, x in layouts(sh.LOGICAL_RULES).items():
        assert x.sharding.is_equivalent_to(NamedSharding(mesh, want[name]), x.ndim), name
    moved = tuple((k, {"cache_batch": None, "cache_len": "data"}.get(k, v)) for k, v in sh.LOGICAL_RULES)
    got = layouts(moved)
    assert got["full.k"].sharding.is_equivalent_to(NamedSharding(mesh, P(None, "data", "tensor")), 4)
    assert got["lengths"].sharding.is_fully_replicated


# --- training: loss and gradients with the block-attention kernel ----------------------------------------------


@pytest.fixture(scope="module")
def train_case():
    pytest.importorskip("train.objective")
    from train import objective

    target, draft = random_pair(vocab=64, block_size=4, layers=2, draft_layers=1, target_layer_ids=(0, 1),
                                num_attention_heads=8, num_key_value_heads=4)
    rng = np.random.RandomState(2)
    ids = rng.randint(2, 62, (8, 16)).astype(np.int32)
    mask = (np.arange(16) >= rng.randint(1, 4, (8, 1))).astype(np.int32)
    anchors = objective.sample_batch_anchors(0, 0, np.arange(8), mask, 2)
    weights = objective.position_weights(4, 7.0)

    @jax.jit
    def loss_and_grads(dparams, tparams, ids, mask, anchors):
        feats = objective.target_features(target.config, tparams, ids, draft.config.target_layer_ids)

        def f(p):
            s = objective.loss_sums(target.config, tparams, draft.config, p, ids, mask, anchors, feats,
                                    weights=weights, impl="interpret", chunk=64)
            return s["wce"] / s["weight"], s

        return jax.value_and_grad(f, has_aux=True)(dparams)

    args = (ids, mask, anchors)
    want = jax.device_get(loss_and_grads(draft.params, target.params, *args))
    return target, draft, loss_and_grads, args, want


def test_train_step_traces_its_kernel_per_shard_on_its_mesh():
    """``train.step``'s step on ``--mesh`` traces with that mesh: its block-attention kernel (forward and backward)
    sits in shard_map bodies; without a mesh there are none."""
    loop = pytest.importorskip("train.step")
    from train.config import TrainConfig

    target, draft = random_pair(vocab=64, block_size=4, layers=2, draft_layers=1, target_layer_ids=(0, 1),
                                num_attention_heads=8, num_key_value_heads=4)
    ids = np.random.RandomState(3).randint(2, 62, (1, 8, 16)).astype(np.int32)
    mask = np.ones_like(ids)
    for mesh, least in (("data=2,fsdp=2,tensor=2", 2), ("", 0)):
        cfg = TrainConfig(block_size=4, draft_layers=1, num_anchors=2, seq_len=16, loss_chunk=64, batch_size=8,
                          dtype="float32", param_dtype="float32", impl="interpret", mesh=mesh)
        optimizer, step = loop.cached_train_step(cfg, target.config, draft.config, offline=False)
        text = step.lower(draft.params, optimizer.init(draft.params), target.params, ids, mask,
                          np.arange(8, dtype=np.int32)[None], jnp.int32(0), None, jnp.float32(1e-3)).as_text()
        n = text.count("sdy.manual_computation")
        assert n >= least and (least or n == 0), (mesh, n)


@pytest.mark.slow  # two interpret-mode compiles of the kernel's forward and backward inside the loss (~40 s)
@pytest.mark.parametrize("spec", ["data=2,fsdp=2,tensor=2", "tensor=8"])
def test_training_loss_and_grads_per_shard_equal_single_device(train_case, spec):
    target, draft, fn, args, ((want_loss, _), want_grads) = train_case
    mesh = sh.make_mesh(spec)
    dparams = sh.shard_params(draft.params, ms.param_shardings(draft, mesh))
    tparams = sh.shard_params(target.params, ms.param_shardings(target, mesh))
    batch = sh.shard_batch(args, mesh)
    with jax.set_mesh(mesh):
        (loss, _), grads = fn(dparams, tparams, *batch)
        lowered = fn.lower(dparams, tparams, *batch).as_text()
    assert lowered.count("sdy.manual_computation") >= 2  # the kernel's forward and backward, per shard
    # fp32 sums over other shard orders (the data-parallel gradient all-reduce): not bitwise; the loss within
    # its rounding (``loss_depth``), each gradient leaf within twice it (the path back), relative to its scale
    depth = loss_depth(target.config, draft.config.layers, 16, 2 * 4)
    assert float(loss) == pytest.approx(float(want_loss), rel=f32_rel(depth))
    assert_trees_close(grads, want_grads, 2 * depth, what="grad")


# --- the engine: speculative decoding with the kernel per shard -----------------------------------------------


@pytest.mark.slow  # the whole decode loop with interpret-mode kernels, compiled twice (~60 s)
def test_speculative_with_kernel_per_shard_equals_single_device():
    from dflash_jax import decode as S

    target, draft = random_pair(vocab=64, block_size=8, layers=2, draft_layers=1, target_layer_ids=(0, 1),
                                num_attention_heads=8, num_key_value_heads=4)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(2, 62, n).tolist() for n in (3, 9, 1, 17)]
    want = S.speculative_generate(target, draft, prompts, max_new_tokens=12, stop_token_ids=[])
    mesh = sh.make_mesh("data=2,tensor=4")
    ts, ds = ms.shard_target(target, mesh), ms.shard_draft(draft, mesh)
    got = S.speculative_generate(ts, ds, prompts, max_new_tokens=12, stop_token_ids=[], attention_impl="interpret")
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert [r.acceptance_lengths for r in got] == [r.acceptance_lengths for r in want]
