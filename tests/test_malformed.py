"""Nothing malformed loads silently: broken safetensors files and impossible configs are ValueErrors that
name the file (and the tensor), and the CLIs turn them into one line and exit status 2."""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import struct

import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax.checkpoints import iter_safetensors, save_safetensors
from dflash_jax.drafts import DraftConfig
from dflash_jax.families import config_from_hf
from pairs import pair_dirs as make_pair_dirs
from test_deepseek_v3 import CFG as DEEPSEEK_V3
from test_gpt_oss import CFG as GPT_OSS
from test_qwen3_5 import CFG as QWEN3_5
from test_qwen3_5_moe import CFG as QWEN3_5_MOE
from test_qwen3_moe import MOE as QWEN3_MOE
from test_qwen3_next import CFG as QWEN3_NEXT


def _write(path, header, body: bytes):
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + body)


def _good(tmp_path):
    path = str(tmp_path / "good.safetensors")
    save_safetensors(path, {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, np.float32)})
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__")
    return header, raw[8 + n:]


def _set(header, name, key, value):
    h = json.loads(json.dumps(header))
    h[name][key] = value
    return h


@pytest.mark.parametrize("case,match", [
    ("overlap", r"tensor b: .*invalid offset for tensor `b`"),  # b's bytes point into a's: wrong logits before
    ("length", r"tensor b: .*invalid shape"),  # 5 floats declared over 4 floats of bytes
    ("truncated", r"tensor b: .*not fully covered"),
    ("huge_header", r"header too large"),
    ("short_file", r"header too small"),
    ("list_header", r"invalid JSON in header"),
    ("missing_key", r"missing field `dtype`"),
])
def test_malformed_safetensors_is_a_value_error_naming_file_and_tensor(tmp_path, case, match):
    header, body = _good(tmp_path)
    path = str(tmp_path / "bad.safetensors")
    if case == "overlap":
        _write(path, _set(header, "b", "data_offsets", [8, 24]), body[:24])
    elif case == "length":
        _write(path, _set(header, "b", "shape", [5]), body)
    elif case == "truncated":
        _write(path, header, body[:30])
    elif case == "huge_header":
        open(path, "wb").write(struct.pack("<Q", 2 ** 62) + b"{}")
    elif case == "short_file":
        open(path, "wb").write(b"abc")
    elif case == "list_header":
        _write(path, [1, 2], body)
    else:
        h = json.loads(json.dumps(header))
        del h["a"]["dtype"]
        _write(path, h, body)
    with pytest.raises(ValueError, match=match) as e:
        list(iter_safetensors(path))
    assert path in str(e.value)


IMPOSSIBLE = [
    ({"vocab_size": -1}, r"vocab_size must be >= 1"),
    ({"rms_norm_eps": 0.0}, r"rms_norm_eps must be > 0"),
    ({"rms_norm_eps": -1e-6}, r"rms_norm_eps must be > 0"),
    ({"num_attention_heads": 0}, r"num_attention_heads must be >= 1"),
    ({"num_key_value_heads": 3}, r"not a multiple"),
    ({"hidden_size": None}, r"wrong type"),
    ({"rope_theta": -5.0}, r"rope_theta must be > 0"),
]


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return make_pair_dirs(str(tmp_path_factory.mktemp("pair")))


@pytest.mark.parametrize("edit,match", IMPOSSIBLE)
def test_impossible_target_config_values_are_errors(pair_dirs, edit, match):
    d = json.load(open(os.path.join(pair_dirs[0], "config.json")))
    d.update(edit)
    d.pop("rope_parameters") if "rope_theta" in edit else None
    with pytest.raises(ValueError, match=match):
        config_from_hf(d)


def test_config_json_that_is_not_an_object(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        dj.load_target(str(tmp_path))
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(ValueError, match="not valid JSON"):
        dj.load_target(str(tmp_path))


def test_draft_block_size_zero_is_an_error_not_16(pair_dirs):
    d = json.load(open(os.path.join(pair_dirs[1], "config.json")))
    assert DraftConfig.from_hf(d).block_size == 8
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        DraftConfig.from_hf({**d, "block_size": 0})
    with pytest.raises(ValueError, match="must be >= 0"):
        DraftConfig.from_hf({**d, "dflash_config": {**d["dflash_config"], "mask_token_id": -3}})


@pytest.mark.parametrize("argv,match", [
    (["--stop-token-ids", "a,b"], "--stop-token-ids 'a,b': expected comma-separated integers"),
    (["--seed", str(10 ** 23)], "--seed must be an integer in"),
])
def test_cli_bad_options_are_one_line_errors(pair_dirs, capsys, argv, match):
    from infer import generate as g

    with pytest.raises(SystemExit) as e:
        g.main(["--target", pair_dirs[0], "--draft", pair_dirs[1], "--prompt-ids", "5,6", "--max-new-tokens", "3",
                *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and match in err and "Traceback" not in err


def test_cli_corrupt_checkpoint_is_one_line_error(pair_dirs, tmp_path, capsys):
    from infer import generate as g

    bad = str(tmp_path / "target")
    shutil.copytree(pair_dirs[0], bad)
    weights = os.path.join(bad, "model.safetensors")
    raw = open(weights, "rb").read()
    open(weights, "wb").write(raw[:len(raw) // 2])  # truncated mid-tensor
    with pytest.raises(SystemExit) as e:
        g.main(["--target", bad, "--draft", pair_dirs[1], "--prompt-ids", "5,6", "--max-new-tokens", "3"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and weights in err and "not fully covered" in err


def test_fuzzed_headers_and_configs_give_only_value_errors(pair_dirs, tmp_path):
    """Hundreds of random corruptions of a real checkpoint's header and config: each either loads or is
    a ValueError (never an IndexError, OverflowError, MemoryError, KeyError, ...)."""
    rng = random.Random(0)
    raw = open(os.path.join(pair_dirs[0], "model.safetensors"), "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    path = str(tmp_path / "fuzz.safetensors")
    outcomes = {"ok": 0, "ValueError": 0}
    for _ in range(300):
        blob = bytearray(raw[:8 + n + 64])  # the header and the start of the data
        kind = rng.randrange(3)
        if kind == 0:  # flip bytes inside the header
            for _ in range(rng.randint(1, 4)):
                blob[rng.randrange(8, 8 + n)] = rng.randrange(256)
        elif kind == 1:  # a wrong declared header length
            blob[:8] = struct.pack("<Q", rng.choice([0, 1, n - 1, n + 8, 2 ** rng.randint(10, 63)]))
        else:  # cut the file anywhere
            blob = blob[:rng.randrange(len(blob))]
        open(path, "wb").write(bytes(blob))
        try:
            list(iter_safetensors(path))
            outcomes["ok"] += 1
        except ValueError:
            outcomes["ValueError"] += 1
    cfg = json.load(open(os.path.join(pair_dirs[0], "config.json")))
    keys = sorted(cfg)
    for _ in range(300):
        d = dict(cfg)
        for _ in range(rng.randint(1, 3)):
            d[rng.choice(keys)] = rng.choice([None, -1, 0, 1.5, "x", [], {}, [1, "a"], 10 ** 30, True])
        try:
            config_from_hf(d)
            outcomes["ok"] += 1
        except ValueError:
            outcomes["ValueError"] += 1
    assert outcomes["ValueError"] > 300  # most corruptions are caught, and nothing else escaped


@pytest.mark.parametrize("argv,match", [
    (["--block-size", "9"], "--block-size must be in [1, 8]"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--stop-token-ids", "99999"], "outside the target vocabulary"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--chat"], "--chat applies to text prompts"),
    # the library's own rules (``DecodeOptions``), named by their flags
    (["--confidence-threshold", "0.5"], "--confidence-threshold needs a DSpark draft with a confidence head"),
    (["--confidence-threshold", "0.5", "--tree-budget", "4"],
     "--confidence-threshold cuts a chain's proposal; it cannot be combined with --tree-budget"),
    (["--tree-budget", "-1"], "--tree-budget must be an integer >= 0"),
    (["--verify-lengths", "2,9"], "--verify-lengths must be in [1, 8]"),
])
def test_cli_options_are_checked_before_any_weight_is_read(pair_dirs, capsys, monkeypatch, argv, match):
    from infer import generate as g

    def no_loading(*a, **k):
        raise AssertionError("weights were read before the options were checked")

    monkeypatch.setattr(dj, "load_target", no_loading)
    monkeypatch.setattr(dj, "load_draft", no_loading)
    with pytest.raises(SystemExit) as e:
        g.main(["--target", pair_dirs[0], "--draft", pair_dirs[1], "--prompt-ids", "5,6", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and match in err


# family -> (config overrides, tensors to save transposed one at a time: a dense weight, and for MoE families a
# stacked expert tensor in transformers' fused layout -- a name absent from save_pretrained's files is taken from
# the model's state_dict -- and per-expert / fused-projection tensors the family's rewrite reads). All non-square.
TRANSPOSED = {
    "qwen3": ({}, ["model.layers.1.mlp.down_proj.weight"]),
    "llama": ({}, ["model.layers.1.mlp.down_proj.weight"]),
    "qwen3_moe": (QWEN3_MOE, ["model.layers.1.self_attn.k_proj.weight", "model.layers.1.mlp.experts.down_proj",
                              "model.layers.1.mlp.experts.2.down_proj.weight"]),
    "gpt_oss": (GPT_OSS, ["model.layers.1.self_attn.k_proj.weight", "model.layers.1.mlp.experts.gate_up_proj"]),
    "qwen3_5": (QWEN3_5, ["model.layers.1.mlp.down_proj.weight", "model.layers.3.self_attn.o_proj.weight"]),
    "qwen3_5_moe": (QWEN3_5_MOE, ["model.layers.1.mlp.shared_expert.down_proj.weight",
                                  "model.layers.1.mlp.experts.down_proj", "model.layers.2.mlp.experts.5.up_proj.weight"]),
    "qwen3_next": (QWEN3_NEXT, ["model.layers.1.mlp.down_proj.weight", "model.layers.2.mlp.experts.down_proj",
                                "model.layers.0.linear_attn.in_proj_qkvz.weight"]),
    "deepseek_v3": (DEEPSEEK_V3, ["model.layers.1.self_attn.kv_b_proj.weight", "model.layers.1.mlp.experts.down_proj",
                                  "model.layers.2.mlp.experts.2.down_proj.weight"]),
}


def _refused_transposed(directory, tensors, name, load):
    """Save ``tensors`` into ``directory`` with ``name`` transposed (last two axes); ``load(directory)`` must raise
    the loader's shape error naming it, with both shapes."""
    shape = list(tensors[name].shape)
    assert shape[-1] != shape[-2], name  # a square weight's transpose is undetectable by shape
    bad = {**tensors, name: np.swapaxes(tensors[name], -1, -2)}
    save_safetensors(os.path.join(directory, "model.safetensors"), bad)
    flipped = shape[:-2] + shape[:-3:-1]
    with pytest.raises(ValueError, match=rf"tensor {re.escape(name)} has shape {re.escape(str(flipped))} but the "
                                         rf"config implies {re.escape(str(shape))}"):
        load(directory)


@pytest.mark.parametrize("family", sorted(TRANSPOSED))
def test_transposed_weights_are_refused(family, tiny_hf, tmp_path):
    """A non-square weight saved transposed ([in, out]) is a shape error naming it, never swapped back silently:
    a dense weight and a stacked expert tensor on every family's loader path (catches a loader taught to "fix"
    a shape by swapping the last two axes)."""
    overrides, names = TRANSPOSED[family]
    path, model = tiny_hf(family, family, **overrides)  # the family modules' own checkpoints (same configs)
    saved = {n: np.array(a) for n, a in iter_safetensors(os.path.join(path, "model.safetensors"))}
    fused = {k: v.numpy() for k, v in model.state_dict().items()}
    shutil.copy(os.path.join(path, "config.json"), tmp_path)
    for name in names:
        _refused_transposed(str(tmp_path), saved if name in saved else fused, name, dj.load_target)
    save_safetensors(str(tmp_path / "model.safetensors"), saved)
    dj.load_target(str(tmp_path))  # the untouched tensors load: the refusals were the transposes'


@pytest.mark.parametrize("name", ["fc.weight", "layers.1.mlp.down_proj.weight"])
def test_transposed_draft_weight_is_refused(pair_dirs, tmp_path, name):
    """The DFlash draft's loader refuses a transposed fc / layer weight the same way."""
    shutil.copy(os.path.join(pair_dirs[1], "config.json"), tmp_path)
    tensors = {n: np.array(a) for n, a in iter_safetensors(os.path.join(pair_dirs[1], "model.safetensors"))}
    _refused_transposed(str(tmp_path), tensors, name, dj.load_draft)


@pytest.mark.parametrize("family,overrides,drop", [
    ("qwen3", {"attention_bias": True}, "model.layers.1.self_attn.o_proj.bias"),
    ("llama", {"attention_bias": True, "mlp_bias": True}, "model.layers.2.self_attn.k_proj.bias"),
    ("llama", {"attention_bias": True, "mlp_bias": True}, "model.layers.0.mlp.down_proj.bias"),
], ids=["qwen3_attention", "llama_attention", "llama_mlp"])
def test_a_missing_bias_is_an_error_naming_it(family, overrides, drop, tiny_hf, tmp_path):
    """attention_bias / mlp_bias checkpoints load with their biases; one bias deleted is an error naming it,
    never a zero-filled bias."""
    path, _ = tiny_hf(f"{family}_" + "_".join(sorted(overrides)), family, **overrides)
    tensors = {n: np.array(a) for n, a in iter_safetensors(os.path.join(path, "model.safetensors"))}
    assert drop in tensors
    params = dj.load_target(path).params
    layer, module, proj = drop.split(".")[2:5]
    assert params[f"layers_{layer}"][module][proj]["bias"].shape == tensors[drop].shape
    shutil.copy(os.path.join(path, "config.json"), tmp_path)
    save_safetensors(str(tmp_path / "model.safetensors"), {n: a for n, a in tensors.items() if n != drop})
    with pytest.raises(ValueError, match=rf"lacks 1 tensors the config needs, e\.g\. \['{re.escape(drop)}'\]"):
        dj.load_target(str(tmp_path))
