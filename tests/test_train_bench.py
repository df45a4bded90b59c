"""``python -m train.bench``: the tiny preset's split on CPU, the analytic FLOP count by hand, one-line errors."""
from __future__ import annotations

import json

import numpy as np
import pytest

from train import bench

FAST = ["--repeats", "2", "--warmup", "0", "--json"]


def _run(argv, capsys):
    code = bench.main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


@pytest.fixture(scope="module")
def tiny():
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert bench.main(["--preset", "tiny", "--peak-tflops", "0.5"] + FAST) == 0
    return json.loads(buf.getvalue())


def test_tiny_preset_reports_the_split(tiny):
    ph, sh = tiny["phases"], tiny["shape"]
    assert set(ph) == {"features", "draft_step", "online_step"}
    tokens = sh["grad_accum"] * sh["batch_size"] * sh["seq_len"]
    assert sh["tokens_per_step"] == tokens
    for name, p in ph.items():
        assert p["time_s"] > 0 and p["compile_s"] > 0 and len(p["times_s"]) == 2, name
        assert p["time_s"] == pytest.approx(float(np.median(p["times_s"]))) and p["min_s"] <= p["time_s"]
        assert p["tokens_per_s"] == pytest.approx(tokens / p["time_s"], rel=1e-9), name
        assert p["mfu"] == pytest.approx(p["model_flops"] / p["time_s"] / 0.5e12, rel=1e-9), name
        assert p["peak_memory_mb"] > 0 and "RSS" in p["memory_kind"]  # CPU: no device memory stats
        # XLA's own count: the model FLOPs plus elementwise work and the reference's masked scores
        assert 0.9 < p["xla_over_model"] < 3, (name, p["xla_over_model"])
    assert ph["features"]["model_flops"] == tiny["model_flops"]["target_forward"]
    assert ph["draft_step"]["model_flops"] == tiny["model_flops"]["draft_step"]
    sp = tiny["split"]
    assert sp["sum_s"] == pytest.approx(sp["features_s"] + sp["draft_step_s"])
    assert tiny["peak_source"] == "--peak-tflops" and tiny["shape"]["impl"] == "reference"
    m = tiny["machine"]  # timings say where they ran and how loaded the machine was
    assert m["backend"] == "cpu" and m["cpu_count"] >= 1 and len(m["load_average"]) == 3


def test_table_output_and_no_mfu_on_cpu(capsys, tiny):
    text = bench.format_table({**tiny, "peak_tflops": None, "peak_source": None})
    assert "split: features" in text and "MFU: unavailable" in text and "draft_step" in text
    assert bench.peak_tflops("cpu") is None
    assert bench.peak_tflops("NVIDIA H200") == 989.4 and bench.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert bench.peak_tflops("TPU v5 lite") == 197.0 and bench.peak_tflops("TPU v5p") == 459.0


def test_model_flops_by_hand():
    from dflash_jax.config import TargetConfig
    from dflash_jax.target import Target
    from train.config import TrainConfig
    from train.draft_setup import build_draft_config

    # target: D 8, 2 query heads x 4, 1 kv head x 4, MLP 16, vocab 32, 4 layers; draft 1 layer, 2 features, block 4
    tcfg = TargetConfig("qwen3", 32, 8, 16, 4, 2, 1, 4)
    cfg = TrainConfig(draft_layers=1, block_size=4, num_target_features=2, target_layer_ids="1,2", seq_len=16)
    dcfg = build_draft_config(cfg, Target(tcfg, None))
    anchors = np.array([[3, 10, -1], [0, 5, 7]])  # 5 real blocks, one padding block; T = 3 * 4 = 12
    f = bench.model_flops(tcfg, dcfg, seq_len=16, anchors=anchors)
    p = 8 * 8 + 2 * 8 * 4 + 8 * 8 + 3 * 8 * 16  # q, k+v, o, gate+up+down = 576
    assert f["draft_layers"] == 3 * 2 * 12 * 1 * p * 2
    assert f["context_kv"] == 3 * 2 * 16 * 1 * 2 * 8 * 4 * 2
    assert f["fc"] == 2 * 2 * 16 * 2 * 8 * 8 * 2
    visible = sum(4 * (a + 4) for a in (3, 10, 0, 5, 7))  # each row of block a: a context keys + 4 own
    assert f["attention"] == 3 * 4 * 2 * 4 * visible
    assert f["lm_head"] == 2 * 2 * 12 * 8 * 32 * 2
    assert f["draft_step"] == sum(f[k] for k in ("draft_layers", "context_kv", "fc", "attention", "lm_head"))
    # target: layers 0..2 (the last feature layer is 2; layer 3 is dropped), causal S(S+1)/2 scores
    assert f["target_forward"] == (2 * 16 * 3 * p + 4 * 2 * 4 * (16 * 17 // 2) * 3) * 2
    assert f["online_step"] == f["draft_step"] + f["target_forward"]


@pytest.mark.parametrize("window", [None, 3])
def test_visible_keys_equal_the_attention_mask(window):
    import jax.numpy as jnp

    from dflash_jax.kernels.block_attention import block_mask

    anchors = np.array([[3, 10, -1, 0], [15, 1, 6, 2]])
    mask = block_mask(jnp.asarray(anchors, jnp.int32), 16, block_size=4, sliding_window=window)
    assert bench.visible_keys(anchors, block_size=4, sliding_window=window) == int(np.asarray(mask).sum())
    assert bench.causal_keys(16, window) == sum(min(i + 1, window or 99) for i in range(16))


def test_real_target_directory_on_a_mesh(tmp_path, capsys):
    from dflash_jax.config import TargetConfig
    from dflash_jax.layers import random_params
    from dflash_jax.target import Target, param_shapes, save_target

    tcfg = TargetConfig("qwen3", 128, 32, 64, 3, 4, 2, 8, max_position_embeddings=256)
    save_target(Target(tcfg, random_params(param_shapes(tcfg), 0)), str(tmp_path))
    r = _run(["--target", str(tmp_path), "--mesh", "data=-1,tensor=2", "--features", "offline", "--seq-len",
              "32", "--num-anchors", "4", "--batch-size", "4"] + FAST, capsys)
    assert set(r["phases"]) == {"draft_step"} and r["devices"] == 8 and "tensor=2" in r["mesh"] and r["target"] == str(tmp_path)
    assert r["shape"]["hidden_size"] == 32 and r["phases"]["draft_step"]["time_s"] > 0


@pytest.mark.parametrize("argv", [
    ["--preset", "nope"],
    ["--repeats", "0"],
    ["--peak-tflops", "-1"],
    ["--seq-len", "0"],
    ["--dtype", "float8"],
    ["--mesh", "bogus=3"],
    ["--mesh", "data=-1", "--batch-size", "3"],
    ["--target", "/nonexistent/target"],
    ["--impl", "kernel"],  # CPU
])
def test_bad_arguments_one_line_exit_2(argv, capsys):
    try:
        code = bench.main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("python -m train.bench: error: "), err
