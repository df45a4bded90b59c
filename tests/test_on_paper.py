"""Programs compiled for TPU slices on this CPU host (libtpu, the ``plan`` extra): the Pallas kernels through Mosaic
(where interpret mode accepts shapes Mosaic refuses), the decode step's bytes against what it must read, and the
planner (``python -m infer.plan``)."""
from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import chips, on_paper
from dflash_jax.config import RopeConfig, TargetConfig
from dflash_jax.drafts.config import DraftConfig
from dflash_jax.kernels.block_attention import block_attention
from dflash_jax.kernels.decode_attention import decode_attention
from dflash_jax.kernels.paged_attention import paged_decode_attention
from dflash_jax.sharding.mesh import make_mesh


def _devices(name):
    try:
        return chips.parse_slice(name).devices()
    except Exception as e:  # noqa: BLE001 (no libtpu here: say why)
        pytest.skip(f"libtpu cannot compile for {name} here (pip install -e '.[plan]'): {on_paper.one_line(e)}")


@pytest.fixture(scope="module", params=["v5e-1", "v6e-1"])
def tpu_mesh(request):
    return make_mesh("tensor=1", devices=_devices(request.param))


def _compile(mesh, fn, *shapes):
    """``fn`` jitted and compiled for the mesh's TPU from ShapeDtypeStructs -> the Program."""
    args = [jax.ShapeDtypeStruct(s, d, sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
            for s, d in shapes]
    return on_paper.compile_program("kernel", lambda: jax.jit(fn).lower(*args), hbm_cost=False)


TPU = dict(backend="tpu", interpret=False)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("window,causal", [(None, False), (24, True)])
def test_block_attention_compiles_for_tpu(tpu_mesh, dtype, window, causal):
    """The draft's block attention (GQA 8 / 2 heads, blocks of 16, a window or not, causal blocks or not)."""
    b, n, bk, s, d = 1, 4, 16, 256, 128
    p = _compile(tpu_mesh, lambda q, kc, vc, kb, vb, a: block_attention(
        q, kc, vc, kb, vb, a, block_size=bk, sliding_window=window, block_causal=causal, **TPU),
        ((b, n * bk, 8, d), dtype), ((b, s, 2, d), dtype), ((b, s, 2, d), dtype), ((b, n * bk, 2, d), dtype),
        ((b, n * bk, 2, d), dtype), ((b, n), jnp.int32))
    assert p.compiled, p.error
    assert p.mosaic >= 1


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("variant", ["gqa", "window+sinks", "tree"])
def test_decode_attention_compiles_for_tpu(tpu_mesh, dtype, variant):
    """Decode / verify attention over a row cache: GQA, a window with sinks, a tree mask over the new keys."""
    b, t, s, d = 2, 16, 512, 128
    window = 128 if variant == "window+sinks" else None

    def fn(q, k, v, pos, lens, kn, vn, sinks, mask):
        return decode_attention(q, k, v, pos, lens, kn, vn, sliding_window=window,
                                sinks=sinks if variant == "window+sinks" else None,
                                new_mask=mask if variant == "tree" else None, **TPU)

    p = _compile(tpu_mesh, fn, ((b, t, 8, d), dtype), ((b, s, 2, d), dtype), ((b, s, 2, d), dtype),
                 ((b, t), jnp.int32), ((b,), jnp.int32), ((b, t, 2, d), dtype), ((b, t, 2, d), dtype),
                 ((8,), jnp.float32), ((b, t, t), jnp.bool_))
    assert p.compiled, p.error
    assert p.mosaic >= 1


@pytest.mark.parametrize("page", [16, 64, 128])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_paged_attention_compiles_for_tpu(tpu_mesh, page, dtype):
    b, t, d, pages = 2, 16, 128, 64
    cols = 1024 // page
    p = _compile(tpu_mesh, lambda q, kp, vp, tab, pos, lens, kn, vn: paged_decode_attention(
        q, kp, vp, tab, pos, lens, kn, vn, new_causal=True, **TPU),
        ((b, t, 8, d), dtype), ((pages, page, 2, d), dtype), ((pages, page, 2, d), dtype), ((b, cols), jnp.int32),
        ((b, t), jnp.int32), ((b,), jnp.int32), ((b, t, 2, d), dtype), ((b, t, 2, d), dtype))
    assert p.compiled, p.error
    assert p.mosaic >= 1


def test_a_key_tile_mosaic_refuses_fails_here_where_interpret_mode_passes_it():
    """Key tiles of 12 in the draft's block attention: a block of 12 sublanes, which Mosaic refuses (whole tiles of
    8, or the whole axis). Interpret mode runs it and matches the reference, so only a compile for a TPU catches
    it."""
    from dflash_jax.kernels.block_attention import block_attention_reference

    mesh = make_mesh("tensor=1", devices=_devices("v6e-1"))
    b, n, bk, s, d = 1, 4, 16, 96, 128
    rng = np.random.default_rng(0)
    arrays = [jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in
              ((b, n * bk, 8, d), (b, s, 2, d), (b, s, 2, d), (b, n * bk, 2, d), (b, n * bk, 2, d))]
    anchors = jnp.asarray([[10, 30, 50, 90]], jnp.int32)
    got = block_attention(*arrays, anchors, block_size=bk, k_tile=12, backend="tpu", interpret=True)
    want = block_attention_reference(*arrays, anchors, block_size=bk)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    p = _compile(mesh, lambda q, kc, vc, kb, vb, a: block_attention(q, kc, vc, kb, vb, a, block_size=bk, k_tile=12,
                                                                   **TPU),
                 *[(x.shape, x.dtype) for x in arrays], ((b, n), jnp.int32))
    assert not p.compiled and re.search(r"mosaic|pallas|tpu_custom_call", p.error, re.IGNORECASE), p.error


@pytest.mark.parametrize("d,dv", [(64, 64), (192, 128)])
def test_heads_of_any_width_compile_for_tpu(tpu_mesh, d, dv):
    """The decode kernel reads a key tile as the cache's [tk, Hkv, D] block, whole in its last two axes: heads of 64
    lanes beside another (gpt-oss) and MiMo-V2-Flash's 192 / 128 compile (a [B, S, Hkv*D] view's block of one head's
    lanes would not)."""
    b, t, s = 1, 4, 64
    p = _compile(tpu_mesh, lambda q, k, v, pos, lens: decode_attention(q, k, v, pos, lens, **TPU),
                 ((b, t, 4, d), jnp.bfloat16), ((b, s, 2, d), jnp.bfloat16), ((b, s, 2, dv), jnp.bfloat16),
                 ((b, t), jnp.int32), ((b,), jnp.int32))
    assert p.compiled, p.error


# ----------------------------------------------------------------------------------------------------- step bytes


def _step(batch: int, speculative: bool):
    """The closed batch's decode step of a 2-layer target of Qwen3-8B's layer shape (vocab 8192) and a 1-layer draft,
    compiled for one v6e chip -> (Program, weight bytes)."""
    from dflash_jax.decode import prepare, steps
    from dflash_jax.decode.options import DecodeOptions

    mesh = make_mesh("tensor=1", devices=_devices("v6e-1"))
    t = TargetConfig(model_type="qwen3", vocab_size=8192, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=4096, qk_norm=True, rope=RopeConfig(theta=1e6), eos_token_id=(1,))
    d = DraftConfig.for_target(t, draft_layers=1, block_size=16, mask_token_id=8191, target_layer_ids=(0, 1))
    target, draft = on_paper.pair(t, d if speculative else None, mesh)
    opts = DecodeOptions(max_new_tokens=100, block_size=16 if speculative else 1)
    budget = prepare.budgets([8] * batch, [opts] * batch, 4096)
    spec, inputs = prepare.engine(target, draft, opts, prepare.cache_length([8] * batch, budget, 16), greedy=True,
                                  rows=batch)
    inputs = jax.tree_util.tree_map(
        lambda x: x if isinstance(x, jax.ShapeDtypeStruct) else on_paper.abstract(np.asarray(x), mesh), inputs)
    rows = on_paper.abstract(prepare.make_rows(spec, [np.arange(8, dtype=np.int32)] * batch, budget, [opts] * batch,
                                               range(batch)), mesh)
    state = on_paper.abstract(jax.eval_shape(lambda i, r: steps.prefill_jit(spec, i, r), inputs, rows), mesh)
    program = on_paper.compile_program("step", lambda: steps.step_jit.trace(spec, inputs, state).lower())
    assert program.compiled, program.error
    return program, on_paper.device_bytes((inputs.tparams, inputs.dparams)), t


def test_the_dflash_step_reads_each_weight_once():
    """HBM bytes of one DFlash step at most 1.15x every weight once (target and draft; the LM head may be read twice,
    the 8-token rows' caches are a few MB). Before the q/k/v projections were kept out of their consumers' fusions,
    XLA:TPU transposed those weights every step (1.26x here, 1.66x at Qwen3-8B's full shape as compiled)."""
    program, weights, t = _step(1, True)
    head = t.vocab_size * t.hidden_size * 2
    assert program.hbm_bytes <= 1.15 * (weights + head), (program.hbm_bytes, weights)


def test_the_plain_step_reads_each_weight_once_and_counts_its_matmuls():
    program, weights, t = _step(1, False)
    assert program.hbm_bytes <= 1.05 * weights, (program.hbm_bytes, weights)
    params = weights / 2  # bf16
    assert program.hbm_flops <= 1.1 * 2 * params, (program.hbm_flops, params)


# ----------------------------------------------------------------------------------------------------- the planner


SMALL = {"model_type": "qwen3", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
         "max_position_embeddings": 4096, "rope_theta": 1e6, "eos_token_id": 1, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory):
    """A 2-layer Qwen3 config (heads of 128 lanes: the TPU kernels' shape) planned on one v5e chip."""
    from infer import plan

    _devices("v5e-1")
    path = tmp_path_factory.mktemp("plan") / "config.json"
    path.write_text(json.dumps(SMALL))
    return plan.plan(plan.parse_args(["--target", str(path), "--topology", "v5e-1", "--max-batch", "2",
                                      "--max-length", "256", "--prompt-lengths", "64", "--kv-cache-memory", "0.5",
                                      "--train", "--train-seq-len", "256", "--train-batch", "2"]))


def test_the_plan_compiles_every_server_program_with_its_kernels(tiny_plan):
    p = tiny_plan
    names = [r["name"] for r in p["programs"]]
    assert p["all_compiled"] and p["all_fit"], [(r["name"], r["error"]) for r in p["programs"]]
    for expected in ("dflash pool + state (2 rows)", "dflash admit prompt 64", "dflash run 1 rows",
                     "dflash run 2 rows", "dflash read 64 steps", "dflash release", "dflash take", "plain run 1 rows",
                     "closed-batch step (2 rows)"):
        assert expected in names
    run = next(r for r in p["programs"] if r["name"] == "dflash run 2 rows")
    assert run["mosaic"] >= 1 and run["hbm_bytes"] > 0 and run["roofline_s"] > 0
    # its ideal: the weights, the LM head again, two rows' pages at the max length (256 + a block, pages of 16)
    head = 4096 * 256 * 2
    ideal = p["weights_per_device_bytes"] + head + 2 * 17 * p["pool"]["page_bytes_per_device"]
    assert run["ideal_bytes"] == pytest.approx(ideal) and run["over_ideal"] == run["hbm_bytes"] / run["ideal_bytes"]
    json.dumps(p)


def test_the_plan_memory_is_the_compiled_programs_own(tiny_plan):
    """Every program's memory is XLA's analysis of it, and the paged programs hold the weights and the pool the plan
    reports (per device; one device here)."""
    p = tiny_plan
    run = next(r for r in p["programs"] if r["name"] == "dflash run 1 rows")
    m = run["memory"]
    held = p["weights_per_device_bytes"] + p["pool"]["bytes_per_device"]
    assert m["peak_bytes"] >= m["argument_bytes"] >= 0.99 * held
    assert m["argument_bytes"] < held + 50e6  # + the rows' records
    q = p["prediction"][0]
    assert q["batch"] == 1 and q["dflash_tokens_per_s"] > q["plain_tokens_per_s"] > 0


def test_the_plan_compiles_the_trainers_step(tiny_plan):
    """--train: the optimizer step of ``python -m train`` (the target's features, the draft's block attention forward
    and backward as Mosaic kernels, AdamW) compiled for the chip; it holds the target, the float32 draft and its two
    AdamW moments, and its throughput on paper is rows x tokens / its roofline."""
    from dflash_jax.drafts.model import draft_param_shapes
    from infer import presets

    p = tiny_plan
    train = next(r for r in p["programs"] if r["name"].startswith("train step (2 rows of 256 tokens"))
    assert train["compiled"] and train["fits"] and train["mosaic"] >= 2, train
    _, dcfg, _ = presets.resolve(p["target"], "auto")
    draft = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(draft_param_shapes(dcfg))) * 4
    held = train["memory"]["argument_bytes"]
    assert held >= 3 * draft + 0.99 * (p["weights_per_device_bytes"] - draft / 2), held  # the target in bf16
    assert p["train"]["rows"] == 2 and p["train"]["tokens_per_s"] == pytest.approx(2 * 256 / train["roofline_s"])


@pytest.mark.parametrize("topology", ["v5e-4", "v6e-4"])
def test_the_demo_pairs_server_programs_compile_for_tpu(topology):
    """The embedded demo pair (heads of 48 lanes, 2 K/V heads) served on a tensor=4 mesh: every server program
    compiles for the slice, each run with its Mosaic kernels (per shard)."""
    from dflash_jax.demo import DEMO_DRAFT, DEMO_TARGET
    from infer import plan

    _devices(topology)
    p = plan.plan(plan.parse_args(["--target", DEMO_TARGET, "--draft", DEMO_DRAFT, "--topology", topology,
                                   "--mesh", "tensor=4", "--max-batch", "2", "--max-length", "256",
                                   "--prompt-lengths", "64", "--kv-cache-memory", "0.5", "--no-hbm-cost"]))
    assert p["all_compiled"] and p["all_fit"], [(r["name"], r["error"]) for r in p["programs"]]
    runs = [r for r in p["programs"] if " run " in r["name"]]
    assert runs and all(r["mosaic"] >= 1 for r in runs), [(r["name"], r["mosaic"]) for r in runs]


def test_a_latent_cache_is_not_copied_into_the_kernels_layout(tmp_path):
    """A DeepSeek-V3-shaped target's paged programs hold no pool-sized temporary: its latent keys (128 + 32 lanes)
    are padded to 256, where XLA:TPU laid a 160-wide pool out first-axis-minor and copied it into the kernel's
    layout and back at every run (a temporary as large as the pool; the values, c, are 128 wide as DeepSeek-V3's
    512)."""
    from infer import plan

    _devices("v5e-1")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({
        "model_type": "deepseek_v3", "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512,
        "moe_intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "n_shared_experts": 1, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
        "first_k_dense_replace": 1, "kv_lora_rank": 128, "q_lora_rank": 64, "qk_rope_head_dim": 32,
        "qk_nope_head_dim": 64, "v_head_dim": 64, "max_position_embeddings": 4096, "eos_token_id": 1}))
    p = plan.plan(plan.parse_args(["--target", str(path), "--no-draft", "--topology", "v5e-1", "--max-batch", "2",
                                   "--max-length", "256", "--prompt-lengths", "64", "--kv-cache-memory", "1",
                                   "--no-hbm-cost"]))
    assert p["all_compiled"] and p["all_fit"], [(r["name"], r["error"]) for r in p["programs"]]
    pool = p["pool"]["bytes_per_device"]
    for r in p["programs"]:
        if " run " in r["name"] or " admit " in r["name"]:
            assert r["mosaic"] >= 1 or " admit " in r["name"], r
            assert r["memory"]["temp_bytes"] < 0.05 * pool, (r["name"], r["memory"], pool)


def test_a_plan_that_does_not_fit_says_so_in_one_line(capsys):
    from infer import plan

    _devices("v5e-1")
    code = plan.main(["--target", "tiny", "--topology", "v5e-1", "--max-batch", "1", "--max-length", "256",
                      "--prompt-lengths", "64", "--kv-cache-memory", "20", "--no-hbm-cost", "--no-draft"])
    out = capsys.readouterr().out
    assert code == 3
    line = next(ln for ln in out.splitlines() if ln.startswith("does not fit: plain run 1 rows"))
    assert "of 17.2 GB" in line or "exceeds available HBM (15.75G)" in line, line


# ----------------------------------------------------------------------------------------------------- names


def test_slices_by_accelerator_type_and_grid():
    """Cloud TPU's names: v5e / v6e count chips, v4 / v5p / v7x TensorCores (2 a chip); grids as jax names them."""
    assert chips.parse_slice("v6e-8").grid == (2, 4) and chips.parse_slice("v5e-4").grid == (2, 2)
    assert chips.parse_slice("v5p-64").chips == 32 and chips.parse_slice("v5p:4x4x4").chips == 64
    assert chips.parse_slice("v7x-8").grid == (2, 2, 1) and chips.parse_slice("v6e-1").chips == 1
    for bad in ("v6e-3", "v5p:2x2", "h100-8", "v6e"):
        with pytest.raises(ValueError, match="v6e|v5p"):
            chips.parse_slice(bad)
    with pytest.raises(ValueError, match="no figures for this host's"):
        chips.parse_slice("local")  # a CPU: nothing to predict against


def test_every_preset_is_a_pair_that_fits():
    """Every named target builds with its draft (the draft reads target layers that exist, shares its vocabulary)."""
    from infer import presets

    for name in presets.names():
        tcfg, dcfg, source = presets.resolve(name, "auto")
        dcfg.check_fits(tcfg)
        assert source and max(dcfg.target_layer_ids) < tcfg.num_hidden_layers, name


def test_a_scanned_plan_makes_no_roofline(tmp_path, capsys):
    """XLA counts a loop's body once, so a scanned target's bytes are one layer's: the plan says so and predicts
    nothing rather than a time 1/L of the real one."""
    from infer import plan

    _devices("v5e-1")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(SMALL))
    code = plan.main(["--target", str(path), "--topology", "v5e-1", "--max-batch", "1", "--max-length", "256",
                      "--prompt-lengths", "64", "--kv-cache-memory", "0.2", "--no-draft", "--scan-layers"])
    out = capsys.readouterr().out
    assert code == 0 and "layers scanned" in out and "no roofline or prediction with --scan-layers" in out
    assert "predicted output tokens/s" not in out


def test_bad_plans_are_refused_with_one_line(capsys):
    """An unknown target, a slice that does not exist and a batch of no rows: exit 2, one line saying what."""
    from infer import plan

    assert plan.main(["--target", "no-such/model", "--topology", "v6e-1"]) == 2
    assert "'no-such/model' is not a local directory nor in the Hugging Face cache" in capsys.readouterr().err
    assert plan.main(["--target", "qwen3-8b", "--topology", "v6e-3"]) == 2
    assert "no v6e slice of that size here; sizes: v6e-1, v6e-4" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        plan.main(["--target", "qwen3-8b", "--topology", "v6e-1", "--max-batch", "0"])
    assert stop.value.code == 2 and "--max-batch must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        plan.main(["--target", "qwen3-8b", "--topology", "v6e-1", "--train-only", "--no-draft"])
    assert stop.value.code == 2 and "--train plans the draft's training: drop --no-draft" in capsys.readouterr().err
    assert plan.main(["--target", "qwen3-8b", "--topology", "v6e-8", "--train-only", "--train-batch", "12"]) == 2
    assert "--train-batch has 12 rows, not a multiple of data*fsdp = 8" in capsys.readouterr().err
