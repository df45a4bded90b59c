"""Sharding: sharded == single-device, on 8 fake CPU devices (tests/conftest.py).

Inference: speculative generation on meshes (data, fsdp, tensor) = (1,1,8), (2,1,4), (8,1,1) gives exactly
the single-device output; loading with ``place=`` puts every tensor straight onto its shards; bad mesh
specs and head counts fail with messages that say what to change. Training (when ``train.step`` is
importable): a sharded step equals the single-device step; a checkpoint saved on one mesh restores on
another and training continues.
"""
from __future__ import annotations

import contextlib
import json

import jax
import numpy as np
import pytest
from flax import traverse_util
from jax.sharding import NamedSharding, PartitionSpec as P

import dflash_jax as dj
from dflash_jax import model_sharding as ms
from dflash_jax import sharding as sh
from dflash_jax import decode as S
from dflash_jax.target import save_target
from pairs import random_pair, tiny_target_config
from tolerances import EPS32, f32_rel, loss_depth

MAX_NEW = 24
MESHES = ["data=1,fsdp=1,tensor=8", "data=2,fsdp=1,tensor=4", "data=8,fsdp=1,tensor=1"]


def test_eight_devices():
    assert jax.device_count() == 8, "tests/conftest.py must fake 8 CPU devices before jax is imported"


@pytest.fixture(scope="module")
def pair():
    # 8 heads (divisible by every tensor size here), 4 KV heads: sharded on tensor=4, replicated on tensor=8.
    return random_pair(vocab=64, block_size=8, layers=2, draft_layers=1, target_layer_ids=(0, 1),
                       num_attention_heads=8, num_key_value_heads=4)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.RandomState(0)
    return [rng.randint(2, 62, n).tolist() for n in (3, 9, 1, 17, 5, 2, 11, 7)]  # 8 ragged prompts


@pytest.fixture(scope="module")
def single(pair, prompts):
    target, draft = pair
    return S.speculative_generate(target, draft, prompts, max_new_tokens=MAX_NEW, stop_token_ids=[])


def _same(a, b):
    assert [r.output_ids for r in a] == [r.output_ids for r in b]
    assert [r.acceptance_lengths for r in a] == [r.acceptance_lengths for r in b]
    assert [r.finish_reason for r in a] == [r.finish_reason for r in b]


# --- meshes ------------------------------------------------------------------------------------------


def _shape(spec, **kw):
    return {a: s for a, s in sh.make_mesh(spec, **kw).shape.items() if a != "expert" or s != 1}


def test_mesh_specs():
    assert sh.AXES == ("data", "fsdp", "expert", "tensor")
    assert _shape("data=2,fsdp=1,tensor=4") == {"data": 2, "fsdp": 1, "tensor": 4}
    assert _shape("tensor=4,data=-1") == {"data": 2, "fsdp": 1, "tensor": 4}
    assert _shape("auto") == {"data": 8, "fsdp": 1, "tensor": 1}
    assert _shape(None, auto_axis="fsdp") == {"data": 1, "fsdp": 8, "tensor": 1}
    assert _shape({"fsdp": 4, "data": 2}) == {"data": 2, "fsdp": 4, "tensor": 1}
    assert _shape((1, 1, 8)) == {"data": 1, "fsdp": 1, "tensor": 8}
    assert _shape((1, 1, 2, 4)) == {"data": 1, "fsdp": 1, "expert": 2, "tensor": 4}
    assert _shape("data=2,expert=4") == {"data": 2, "fsdp": 1, "expert": 4, "tensor": 1}
    assert _shape("expert=-1,tensor=2") == {"data": 1, "fsdp": 1, "expert": 4, "tensor": 2}
    m = sh.make_mesh("data=2,tensor=4")
    assert m.shape["expert"] == 1  # always there; dense meshes read as before
    assert sh.make_mesh(m) is m and sh.batch_multiple(m) == 2 and sh.mesh_str(m) == "data=2,fsdp=1,tensor=4"
    assert all(t == jax.sharding.AxisType.Auto for t in m.axis_types)
    assert sh.mesh_str(sh.make_mesh("data=2,expert=4")) == "data=2,fsdp=1,expert=4,tensor=1"


@pytest.mark.parametrize("spec,needles", [
    ("data=2,tensor=2", ["2*1*2 = 4", "there are 8", "product is 8"]),
    ("data=3,tensor=4", ["3*1*4 = 12", "there are 8"]),
    ("data=3,tensor=-1", ["does not divide the 8 devices"]),
    ("dta=8", ["unknown axes ['dta']", "data, fsdp, expert, tensor"]),
    ("expert=3,tensor=2", ["expert*tensor", "1*1*3*2 = 6", "there are 8"]),
    ("data=8,data=1", ["twice"]),
    ("data:two", ["axis=size pairs"]),
])
def test_bad_mesh_spec_says_what_to_change(spec, needles):
    with pytest.raises(ValueError) as e:
        sh.make_mesh(spec)
    assert spec in str(e.value)
    for n in needles:
        assert n in str(e.value), str(e.value)


def test_heads_not_divisible_says_what_to_change():
    cfg = tiny_target_config(64, layers=2, num_attention_heads=6, num_key_value_heads=2)
    with pytest.raises(ValueError) as e:
        ms.param_shardings(cfg, sh.make_mesh("tensor=8"))
    msg = str(e.value)
    assert "tensor=8" in msg and "num_attention_heads=6" in msg and "--mesh data=4,tensor=2" in msg, msg


def test_kv_heads_fallback_replicates(pair):
    target, draft = pair
    mesh = sh.make_mesh("tensor=8")  # 4 KV heads on 8 tensor shards: replicated
    rules = dict(sh.rules_for(mesh, target, draft))
    assert rules["kv_heads"] is None and rules["heads"] == "tensor"
    s = traverse_util.flatten_dict(ms.param_shardings(target, mesh))
    assert s[("layers_0", "self_attn", "k_proj", "kernel")].spec == P()
    assert s[("layers_0", "self_attn", "q_proj", "kernel")].spec == P(None, "tensor")
    assert sh.cache_spec(mesh, 4) == P(None, None, None, None)
    assert sh.cache_spec(sh.make_mesh("data=2,tensor=4"), 4) == P("data", None, "tensor", None)


def test_param_shardings_follow_the_rules(pair):
    target, draft = pair
    mesh = sh.make_mesh("data=2,fsdp=2,tensor=2")
    t = traverse_util.flatten_dict(ms.param_shardings(target, mesh))
    assert t[("embed_tokens", "embedding")].spec == P("tensor", "fsdp")
    assert t[("lm_head", "kernel")].spec == P("fsdp", "tensor")
    assert t[("layers_1", "self_attn", "o_proj", "kernel")].spec == P("tensor", "fsdp")
    assert t[("layers_1", "mlp", "gate_proj", "kernel")].spec == P("fsdp", "tensor")
    assert t[("layers_1", "input_layernorm", "weight")].spec == P("fsdp")
    assert t[("layers_1", "self_attn", "q_norm", "weight")].spec == P()
    d = traverse_util.flatten_dict(ms.param_shardings(draft, mesh))
    assert d[("fc", "kernel")].spec == P(None, "fsdp")
    assert set(d) == set(traverse_util.flatten_dict(draft.params))


@contextlib.contextmanager
def mesh_context(mesh, rules=sh.LOGICAL_RULES):
    """``with mesh_context(mesh):`` = ``jax.set_mesh(mesh)`` + Flax logical-axis rules, so bare
    PartitionSpecs and ``nn.with_logical_constraint`` inside traced code resolve against this mesh."""
    import flax.linen as nn

    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield mesh


def test_mesh_context_resolves_logical_constraints():
    import flax.linen as nn

    mesh = sh.make_mesh("data=2,fsdp=2,tensor=2")
    f = jax.jit(lambda x: nn.with_logical_constraint(x * 2, ("batch", "length", "heads")))
    with mesh_context(mesh):
        y = f(np.ones((8, 4, 16), np.float32))
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P(("data", "fsdp"), None, "tensor")), 3)
    assert f(np.ones((8, 4, 16), np.float32)).sharding.is_fully_replicated  # no rules outside: no-op


# --- inference ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", MESHES)
def test_speculative_sharded_equals_single_device(pair, prompts, single, spec):
    target, draft = pair
    mesh = sh.make_mesh(spec)
    ts, ds = ms.shard_target(target, mesh), ms.shard_draft(draft, mesh)
    q = ts.params["layers_0"]["self_attn"]["q_proj"]["kernel"]
    assert q.sharding.mesh == mesh and len(q.addressable_shards) == 8
    assert q.addressable_shards[0].data.shape == (32, 64 // mesh.shape["tensor"])
    out = S.speculative_generate(ts, ds, prompts, max_new_tokens=MAX_NEW, stop_token_ids=[])
    _same(out, single)
    assert sum(len(r.acceptance_lengths) for r in out) < len(prompts) * MAX_NEW  # the draft was accepted sometimes

    # the compiled loop keeps rows over data and KV heads over tensor (4 KV heads: not on tensor=8)
    engine = S.Engine(ts, ds, S.DecodeOptions(max_new_tokens=MAX_NEW), max_batch=len(prompts), max_length=64)
    state = jax.tree_util.tree_map(lambda x: x.sharding, engine.admit(engine.empty(), [S.Request(prompts[0])])[0])
    cache = NamedSharding(mesh, sh.cache_spec(mesh, 4))
    if engine.paged:  # rows whole on every device (no data split): the pools, pages whole, KV heads as a row cache's
        pool = NamedSharding(mesh, P(None, *sh.cache_spec(mesh, 4)[1:]))
        assert state.pools[0][0][0].is_equivalent_to(pool, 4) and state.pools[1][0][1].is_equivalent_to(pool, 4)
    else:
        assert state.tcache.layers[0].k.is_equivalent_to(cache, 4)
        assert state.dcache.layers[0].v.is_equivalent_to(cache, 4)
    assert state.tokens.is_equivalent_to(sh.batch_sharding(mesh, 2), 2)

    # a batch that is not a multiple of data*fsdp is padded (extra rows finish at prefill), results unchanged
    # (padded back to 8 rows here, so the compiled loop is reused)
    n = len(prompts) - sh.batch_multiple(mesh) + 1
    if n < len(prompts):
        few = S.speculative_generate(ts, ds, prompts[:n], max_new_tokens=MAX_NEW, stop_token_ids=[])
        _same(few, single[:n])

    # adaptive verify: one verify length per step for the whole batch, its rows over data
    if spec == MESHES[1]:
        adaptive = S.speculative_generate(ts, ds, prompts, max_new_tokens=MAX_NEW, stop_token_ids=[],
                                          verify_lengths=(2, draft.config.block_size), verify_threshold=0.1)
        assert [r.output_ids for r in adaptive] == [r.output_ids for r in single]


def test_dflash2_sharded_equals_single_device(pair, prompts):
    """A DFlash2 draft (codebooks over tensor, convolutions, the selector walk) on a data x tensor mesh."""
    from test_draft import make_draft
    from test_draft_formats import DFLASH2

    target, _ = pair
    draft = make_draft(target.config, layers=1, block=8, ids=(0, 1), **DFLASH2)
    want = S.speculative_generate(target, draft, prompts, max_new_tokens=MAX_NEW, stop_token_ids=[])
    mesh = sh.make_mesh(MESHES[1])
    ds = ms.shard_draft(draft, mesh)
    assert ds.params["candidate_selector"]["successor_codebook"].sharding.mesh == mesh
    _same(S.speculative_generate(ms.shard_target(target, mesh), ds, prompts, max_new_tokens=MAX_NEW,
                                 stop_token_ids=[]), want)


def test_mixed_placement_is_an_error(pair, prompts):
    target, draft = pair
    ts = ms.shard_target(target, sh.make_mesh("data=8"))
    with pytest.raises(ValueError, match="shard both target and draft"):
        S.speculative_generate(ts, draft, prompts, max_new_tokens=4)


@pytest.fixture(scope="module")
def saved_pair(pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded_pair")
    target, draft = pair
    tdir = save_target(target, str(root / "target"))
    ddir = dj.save_draft(draft, str(root / "draft"), dtype="float32")
    return tdir, ddir


def test_load_places_each_tensor_on_its_shards(pair, saved_pair):
    tdir, ddir = saved_pair
    mesh = sh.make_mesh("data=2,tensor=4")
    seen = []
    place = ms.placer(dj.TargetConfig.from_hf(tdir), mesh)
    target = dj.load_target(tdir, place=lambda path, a: seen.append(path) or place(path, a))
    assert len(seen) == len(jax.tree_util.tree_leaves(target.params))
    draft = dj.load_draft(ddir, place=ms.placer(dj.DraftConfig.from_hf(ddir), mesh))
    expect = ms.param_shardings(target, mesh)
    for got, want, ref in zip(jax.tree_util.tree_leaves(target.params), jax.tree_util.tree_leaves(expect),
                              jax.tree_util.tree_leaves(pair[0].params)):
        assert isinstance(got.sharding, NamedSharding) and got.sharding.spec == want.spec
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    q = target.params["layers_1"]["self_attn"]["q_proj"]["kernel"]  # [32, 64] over tensor=4: 16 columns per device
    assert q.sharding.spec == P(None, "tensor") and {s.data.shape for s in q.addressable_shards} == {(32, 16)}
    assert draft.params["layers_0"]["mlp"]["down_proj"]["kernel"].sharding.spec == P("tensor")
    np.testing.assert_array_equal(np.asarray(draft.params["fc"]["kernel"]), np.asarray(pair[1].params["fc"]["kernel"]))


def test_generate_cli_mesh(saved_pair, prompts, single, capsys):
    from infer import generate as g

    tdir, ddir = saved_pair
    ref = single  # same pair, prompts and mesh as a test above: the compiled loop is reused
    argv = ["--target", tdir, "--draft", ddir, "--mesh", "data=2,tensor=4", "--max-new-tokens", str(MAX_NEW),
            "--ignore-eos", "--json"] + [a for p in prompts for a in ("--prompt-ids", ",".join(map(str, p)))]
    assert g.main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [r["output_ids"] for r in rows] == [r.output_ids for r in ref]
    assert [r["acceptance_lengths"] for r in rows] == [r.acceptance_lengths for r in ref]

    with pytest.raises(SystemExit):
        g.main(argv[:5] + ["data=3"] + argv[6:])
    assert "product is 8" in capsys.readouterr().err


# --- batches, multi-host helpers ----------------------------------------------------------------------


def test_batches_and_process_slices():
    mesh = sh.make_mesh("data=2,fsdp=2,tensor=2")
    ids = np.arange(8 * 3).reshape(8, 3)
    b = sh.shard_batch({"ids": ids, "step": np.int32(3)}, mesh)
    assert b["ids"].sharding.spec == P(("data", "fsdp"), None) and b["step"].sharding.spec == P()
    assert {s.data.shape for s in b["ids"].addressable_shards} == {(2, 3)}
    np.testing.assert_array_equal(np.asarray(b["ids"]), ids)
    acc = sh.shard_batch(ids.reshape(2, 4, 3), mesh, batch_axis=1)  # [grad_accum, batch, ...]
    assert acc.sharding.spec == P(None, ("data", "fsdp"), None)
    local = sh.shard_local_batch(ids, mesh)  # one process: its slice is everything
    np.testing.assert_array_equal(np.asarray(local), ids)
    with pytest.raises(ValueError, match="multiple of 4"):
        sh.shard_batch(np.zeros((6, 3)), mesh)
    assert sh.process_slice(10) == slice(0, 10)
    parts = [sh.process_slice(10, i, 4) for i in range(4)]
    assert [(s.start, s.stop) for s in parts] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert not sh.maybe_initialize_distributed(force=False)


def test_distributed_env_detection(monkeypatch):
    for var in ("DFLASH_DISTRIBUTED", "JAX_COORDINATOR_ADDRESS", "MEGASCALE_COORDINATOR_ADDRESS",
                "TPU_WORKER_HOSTNAMES", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert sh.mesh._wants_distributed() is None
    assert not sh.maybe_initialize_distributed()  # a single process: nothing to do
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "localhost")
    assert sh.mesh._wants_distributed() is None  # one host
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "10.0.0.1,10.0.0.2")
    assert sh.mesh._wants_distributed() == "TPU_WORKER_HOSTNAMES"
    monkeypatch.delenv("TPU_WORKER_HOSTNAMES")
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    assert sh.mesh._wants_distributed() == "JAX_COORDINATOR_ADDRESS"
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS")
    monkeypatch.setenv("DFLASH_DISTRIBUTED", "1")
    assert sh.mesh._wants_distributed() == "DFLASH_DISTRIBUTED"


# --- training (train.step's jitted step; skipped if the trainer is not importable) -------------------

TRAIN_MESH = "data=2,fsdp=2,tensor=2"
LR = 1e-2
# Adam's first steps move every weight by about lr * sign(grad); where a gradient is ~0 (|g| ~ eps) its
# fp32 rounding (summation order differs across shards) decides the step, so params match to 0.2% of lr.
PARAM_TOL = dict(rtol=1e-5, atol=2e-3 * LR)
BLOCK_TOKENS = 4 * 8  # num_anchors x block_size: the loss terms per row


def _loss_rel(tr):
    """The step's loss sums over shards in another order: the loss's rounding (``loss_depth``), relative."""
    target, draft = tr["pair"]
    return f32_rel(loss_depth(target.config, draft.config.layers, 32, BLOCK_TOKENS))


def _tree_close(a, b, **tol):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path), **tol)


def _copy(tree):
    return jax.tree_util.tree_map(lambda x: jax.numpy.array(x, copy=True), tree)  # the step donates its state


@pytest.fixture(scope="module")
def trainer(pair):
    loop = pytest.importorskip("train.step")
    from train.config import TrainConfig

    target, draft = pair
    cfg = TrainConfig(block_size=8, draft_layers=1, num_anchors=4, seq_len=32, loss_chunk=64, batch_size=8,
                      dtype="float32", param_dtype="float32", warmup_frac=0.0, lr=LR)
    optimizer, step = loop.cached_train_step(cfg, target.config, draft.config, offline=False)
    rng = np.random.RandomState(1)
    batches = []
    for s in range(2):  # [grad_accum=1, batch=8, seq=32]; the first few tokens of each row are the prompt
        ids = rng.randint(2, 62, (1, 8, 32)).astype(np.int32)
        mask = (np.arange(32) >= rng.randint(1, 8, (1, 8, 1))).astype(np.int32)
        batches.append((ids, mask, np.arange(8 * s, 8 * s + 8, dtype=np.int32)[None]))

    def run(params, opt_state, tparams, batch, mesh=None):
        batch = sh.shard_batch(batch, mesh, batch_axis=1) if mesh is not None else tuple(map(jax.numpy.asarray, batch))
        return step(_copy(params), _copy(opt_state), tparams, *batch, jax.numpy.int32(0), None,
                    jax.numpy.float32(cfg.lr))

    # single device: two steps
    p0 = draft.params
    o0 = optimizer.init(p0)
    p1, o1, sums1, ok1, _ = run(p0, o0, target.params, batches[0])
    p2, o2, sums2, ok2, _ = run(p1, o1, target.params, batches[1])
    assert bool(ok1) and bool(ok2)
    return dict(pair=pair, optimizer=optimizer, run=run, batches=batches, states=[(p0, o0), (p1, o1), (p2, o2)],
                sums=[sums1, sums2])


def _mesh_state(tr, mesh, params, opt_state):
    target, draft = tr["pair"]
    ps = ms.param_shardings(draft, mesh)
    os_ = sh.opt_state_shardings(opt_state, ps, mesh, params)
    tparams = sh.shard_params(target.params, ms.param_shardings(target, mesh))
    return ps, os_, tparams


def test_sharded_train_step_equals_single_device(trainer):
    mesh = sh.make_mesh(TRAIN_MESH)
    (p0, o0), (p1, o1) = trainer["states"][:2]
    ps, os_, tparams = _mesh_state(trainer, mesh, p0, o0)
    P0, O0 = sh.shard_params(p0, ps), sh.shard_params(o0, os_)
    assert P0["layers_0"]["mlp"]["up_proj"]["kernel"].sharding.spec == P("fsdp", "tensor")
    assert O0[1].mu["layers_0"]["mlp"]["up_proj"]["kernel"].sharding.spec == P("fsdp", "tensor")  # Adam moments
    assert O0[1].count.sharding.spec == P()
    P1, O1, sums, ok, _ = trainer["run"](P0, O0, tparams, trainer["batches"][0], mesh)
    assert bool(ok)
    ref = trainer["sums"][0]
    # the weight: n = 8 x BLOCK_TOKENS positive terms summed in two orders, each within (n - 1) eps / 2 of exact
    assert float(sums["weight"]) == pytest.approx(float(ref["weight"]), rel=(8 * BLOCK_TOKENS - 1) * EPS32)
    loss, ref_loss = float(sums["wce"]) / float(sums["weight"]), float(ref["wce"]) / float(ref["weight"])
    assert loss == pytest.approx(ref_loss, rel=_loss_rel(trainer))
    _tree_close(P1, p1, **PARAM_TOL)
    # Adam's moments of gradients that ran the loss's path back (2x its depth), relative; a gradient that is
    # rounding noise (|g| ~ 1e-7) has moments below 1e-8
    _tree_close(O1, o1, rtol=2 * _loss_rel(trainer), atol=1e-8)
    assert P1["layers_0"]["mlp"]["up_proj"]["kernel"].sharding.spec == P("fsdp", "tensor")  # stays sharded


def test_checkpoint_restores_onto_another_mesh_and_training_continues(trainer, tmp_path):
    from train.orbax_checkpoints import Checkpointer

    (p0, o0), (p1, o1), (p2, o2) = trainer["states"]
    # saved from a mesh with one layout (fsdp=8: every hidden dim split 8 ways) ...
    save_mesh = sh.make_mesh("fsdp=8")
    ps8 = ms.param_shardings(trainer["pair"][1], save_mesh)
    ckpt = Checkpointer(str(tmp_path / "ckpt"))
    ckpt.save(1, sh.shard_params(p1, ps8), sh.shard_params(o1, sh.opt_state_shardings(o1, ps8, save_mesh)),
              {"step": 1})
    ckpt.wait()
    # ... restored onto another (data=2,fsdp=2,tensor=2): each array comes back with the new layout
    mesh = sh.make_mesh(TRAIN_MESH)
    ps, os_, tparams = _mesh_state(trainer, mesh, p1, o1)
    params, opt_state, meta = ckpt.restore(1, sh.abstract_like(p1, ps), sh.abstract_like(o1, os_))
    ckpt.close()
    assert meta["step"] == 1
    for x, s in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(ps)):
        assert x.sharding.is_equivalent_to(s, x.ndim)
    _tree_close(params, p1, rtol=0, atol=0)
    _tree_close(opt_state, o1, rtol=0, atol=0)
    # and training continues exactly as it does on one device
    P2, O2, sums, ok, _ = trainer["run"](params, opt_state, tparams, trainer["batches"][1], mesh)
    assert bool(ok)
    ref = trainer["sums"][1]
    assert float(sums["wce"]) / float(sums["weight"]) == pytest.approx(float(ref["wce"]) / float(ref["weight"]),
                                                                       rel=_loss_rel(trainer))
    _tree_close(P2, p2, **PARAM_TOL)
