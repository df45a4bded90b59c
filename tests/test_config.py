"""TargetConfig / DraftConfig: both Hugging Face rope formats, round trips, DFlash draft fields, errors."""
from __future__ import annotations

import copy
import json
import warnings

import pytest
import transformers

from dflash_jax.config import RopeConfig, TargetConfig
from dflash_jax.drafts.config import (DraftConfig, choose_target_layer_ids, default_target_layer_ids,
                                      shallow_target_layer_ids)

BASE = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=96, hidden_size=32,
            intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False)

THETA = 500000.0
# rope type -> its extra keys (beyond rope_type / rope_theta)
ROPES = {
    "default": {},
    "linear": {"factor": 2.0},
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "yarn": {"factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0},
}


def v5(rope_type, **base):
    """transformers-5.x format: everything in rope_parameters."""
    return {**BASE, **base, "rope_parameters": {"rope_type": rope_type, "rope_theta": THETA, **ROPES[rope_type]}}


def v4(rope_type, key="type", **base):
    """transformers-4.x format: top-level rope_theta, rope_scaling with a ``type`` or ``rope_type`` key."""
    scaling = None if rope_type == "default" else {key: rope_type, **ROPES[rope_type]}
    return {**BASE, **base, "rope_theta": THETA, "rope_scaling": scaling}


@pytest.mark.parametrize("rope_type", list(ROPES))
def test_v4_and_v5_rope_formats_agree(rope_type):
    new = TargetConfig.from_hf(v5(rope_type))
    assert new.rope.rope_type == rope_type and new.rope.theta == THETA
    assert dict(new.rope.params) == ROPES[rope_type]
    assert TargetConfig.from_hf(v4(rope_type, key="type")) == new
    assert TargetConfig.from_hf(v4(rope_type, key="rope_type")) == new
    # transformers 5.24 reading the 4.x dict standardises it into rope_parameters: same config again.
    hf = transformers.Qwen3Config(**{k: v for k, v in v4(rope_type).items() if k not in ("model_type", "architectures")})
    assert TargetConfig.from_hf(hf.to_dict()) == new


def test_default_theta_and_original_max_positions():
    d = {**BASE}
    assert TargetConfig.from_hf(d).rope == RopeConfig(theta=10000.0, rope_type="default")
    # llama3 / yarn without original_max_position_embeddings fall back to max_position_embeddings.
    d = {**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}, "rope_theta": 1e6}
    rope = TargetConfig.from_hf(d).rope
    assert rope.get("original_max_position_embeddings") == BASE["max_position_embeddings"] and rope.theta == 1e6
    # A top-level original_max_position_embeddings (some 4.x configs) is used when the rope dict lacks it.
    d = {**BASE, "original_max_position_embeddings": 32, "rope_scaling": {"type": "yarn", "factor": 2.0}}
    assert TargetConfig.from_hf(d).rope.get("original_max_position_embeddings") == 32


def test_nested_per_layer_type_rope_parameters():
    same = {"rope_type": "default", "rope_theta": THETA}
    d = {**BASE, "rope_parameters": {"full_attention": same, "sliding_attention": dict(same)}}
    assert TargetConfig.from_hf(d).rope == RopeConfig(theta=THETA)
    d["rope_parameters"]["sliding_attention"] = {"rope_type": "default", "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="different rope settings per layer type"):
        TargetConfig.from_hf(d)


@pytest.mark.parametrize("name,config", [
    ("qwen3 untied llama3", v5("llama3")),
    ("qwen3 tied yarn bias", v5("yarn", tie_word_embeddings=True, attention_bias=True, eos_token_id=[3, 5],
                                bos_token_id=1, pad_token_id=0)),
    ("qwen3 sliding", v4("linear", use_sliding_window=True, sliding_window=4, eos_token_id=2,
                         layer_types=["full_attention", "sliding_attention"] * 2)),
    ("llama", {**v4("llama3", key="rope_type"), "model_type": "llama", "mlp_bias": True, "attention_bias": True}),
])
def test_to_hf_from_hf_round_trip(name, config):
    cfg = TargetConfig.from_hf(config)
    out = cfg.to_hf()
    json.dumps(out)  # plain JSON
    assert TargetConfig.from_hf(out) == cfg
    # Each half of the output stands alone: 4.x readers use rope_theta + rope_scaling, 5.x rope_parameters.
    only_v4 = {k: v for k, v in out.items() if k != "rope_parameters"}
    only_v5 = {k: v for k, v in out.items() if k not in ("rope_theta", "rope_scaling")}
    assert TargetConfig.from_hf(only_v4) == cfg
    assert TargetConfig.from_hf(only_v5) == cfg
    # transformers 5.24 accepts what we write, and reads it back the same.
    cls = {"qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig}[cfg.model_type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = cls(**{k: v for k, v in out.items() if k not in ("model_type", "architectures")})
    assert TargetConfig.from_hf(hf.to_dict()) == cfg


def test_config_fields_and_hashing(tmp_path):
    d = v5("default", eos_token_id=[3, 5], tie_word_embeddings=True)
    d.pop("head_dim")
    d.pop("num_key_value_heads")
    cfg = TargetConfig.from_hf(d)
    assert cfg.head_dim == 32 // 4 and cfg.num_key_value_heads == 4 and cfg.eos_token_id == (3, 5)
    assert cfg.qk_norm and not TargetConfig.from_hf({**d, "model_type": "llama"}).qk_norm
    assert cfg.layer_types == ("full_attention",) * 4 and cfg.layer_window(0) is None
    # Hashable and equal by value: configs are static arguments of jitted functions.
    assert hash(cfg) == hash(TargetConfig.from_hf(copy.deepcopy(d))) and {cfg: 1}[TargetConfig.from_hf(d)] == 1
    # From a directory or a config.json path, like from a dict.
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert TargetConfig.from_hf(tmp_path) == cfg == TargetConfig.from_hf(str(tmp_path / "config.json"))


def test_sliding_layers_from_use_sliding_window():
    """No layer_types: transformers' rule, layers >= max_window_layers slide when use_sliding_window."""
    d = {**BASE, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2}
    cfg = TargetConfig.from_hf(d)
    assert cfg.layer_types == ("full_attention",) * 2 + ("sliding_attention",) * 2
    assert [cfg.layer_window(i) for i in range(4)] == [None, None, 4, 4]
    hf = transformers.Qwen3Config(**{k: v for k, v in d.items() if k not in ("model_type", "architectures")})
    assert tuple(hf.layer_types) == cfg.layer_types
    assert TargetConfig.from_hf({**d, "use_sliding_window": False}).layer_types == ("full_attention",) * 4


@pytest.mark.parametrize("change,message", [
    (dict(model_type="gpt2"), r"unsupported model_type 'gpt2'; supported: qwen3, llama"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), r"unsupported rope type 'dynamic'"),
    (dict(rope_parameters={"rope_type": "linear"}), r"'linear' needs \['factor'\]"),
    (dict(rope_scaling={"type": "llama3", "factor": 8.0}), r"'llama3' needs \['low_freq_factor', 'high_freq_factor'\]"),
    (dict(rope_parameters={"rope_type": "yarn", "original_max_position_embeddings": 16}), r"'yarn' needs \['factor'\]"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(num_key_value_heads=3), "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    (dict(layer_types=["full_attention"] * 3), "layer_types has 3 entries for 4 layers"),
    (dict(layer_types=["full_attention"] * 3 + ["chunked_attention"]), "unsupported layer_types"),
    (dict(layer_types=["sliding_attention"] * 4, sliding_window=None), "sliding_window is not set"),
    (dict(hidden_size=None), None),
])
def test_bad_configs_are_named(change, message):
    d = {**BASE, **change}
    if message is None:  # a required key missing
        d.pop("hidden_size")
        message = "config.json is missing 'hidden_size'"
    with pytest.raises(ValueError, match=message):
        TargetConfig.from_hf(d)


def test_missing_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        TargetConfig.from_hf(tmp_path)


# ----------------------------------------------------------------------------------------------------
# DraftConfig
# ----------------------------------------------------------------------------------------------------

# Shaped like the released z-lab drafts' config.json (a Qwen3 config plus the DFlash fields), shrunk.
ZLAB_LIKE = {
    "architectures": ["DFlashDraftModel"],
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "block_size": 16,
    "bos_token_id": 151643,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "dtype": "bfloat16",
    "eos_token_id": 151645,
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "layer_types": ["full_attention"] * 5,
    "max_position_embeddings": 40960,
    "max_window_layers": 5,
    "num_attention_heads": 4,
    "num_hidden_layers": 5,
    "num_key_value_heads": 2,
    "num_target_layers": 36,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def target_config(**changes):
    d = {**ZLAB_LIKE, "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 36,
         "layer_types": ["full_attention"] * 36, **changes}
    for k in ("block_size", "dflash_config", "num_target_layers", "auto_map"):
        d.pop(k)
    return TargetConfig.from_hf(d)


def test_draft_config_like_released():
    cfg = DraftConfig.from_hf(ZLAB_LIKE)
    assert cfg.block_size == 16 and cfg.num_target_layers == 36 and cfg.mask_token_id == 151669
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33) and cfg.num_features == 5
    assert cfg.layers.num_hidden_layers == 5 and cfg.layers.qk_norm and cfg.layers.rope.theta == 1e6
    assert cfg.layers.hidden_size == 64 and cfg.layers.vocab_size == 151936
    cfg.check_fits(target_config())  # fits its 36-layer target
    # Round trip through our own config.json.
    out = cfg.to_hf()
    assert out["architectures"] == ["DFlashDraftModel"] and out["dflash_config"]["mask_token_id"] == 151669
    assert DraftConfig.from_hf(json.loads(json.dumps(out))) == cfg


@pytest.mark.parametrize("num_target_layers,n,expected", [
    (36, 5, (1, 9, 17, 25, 33)),  # the released Qwen3-8B drafts: 1 + i * 32 / 4
    (28, 5, (1, 7, 13, 19, 25)),  # 1 + i * 24 / 4
    (36, 3, (1, 17, 33)),
    (36, 2, (1, 33)),
    (36, 1, (18,)),  # one feature: [L // 2]
    (4, 1, (2,)),
])
def test_default_target_layer_ids(num_target_layers, n, expected):
    assert default_target_layer_ids(num_target_layers, n) == expected


def test_shallow_target_layer_ids():
    assert shallow_target_layer_ids(4, 5) == (1, 2, 3)  # at most L-1 distinct ids, ending at the last layer
    assert shallow_target_layer_ids(8, 5) == (1, 3, 4, 6, 7)
    assert shallow_target_layer_ids(6, 1) == (5,)
    assert choose_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # the released formula for deep targets
    assert choose_target_layer_ids(4, 3) == (1, 2, 3)


def test_draft_config_without_target_layer_ids_uses_default():
    d = copy.deepcopy(ZLAB_LIKE)
    del d["dflash_config"]["target_layer_ids"]
    assert DraftConfig.from_hf(d).target_layer_ids == (1, 9, 17, 25, 33)  # n = the draft's 5 layers
    d.update(num_hidden_layers=1, layer_types=["full_attention"])
    assert DraftConfig.from_hf(d).target_layer_ids == (18,)


def test_draft_config_errors():
    d = copy.deepcopy(ZLAB_LIKE)
    del d["dflash_config"]["mask_token_id"]
    with pytest.raises(ValueError, match="mask_token_id"):
        DraftConfig.from_hf(d)
    d = copy.deepcopy(ZLAB_LIKE)
    del d["dflash_config"]["target_layer_ids"]
    del d["num_target_layers"]
    with pytest.raises(ValueError, match="neither dflash_config.target_layer_ids nor num_target_layers"):
        DraftConfig.from_hf(d)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        DraftConfig(DraftConfig.from_hf(ZLAB_LIKE).layers, 0, 36, 5, (1,))


def test_check_fits_names_both_sides():
    draft = DraftConfig.from_hf(ZLAB_LIKE)
    with pytest.raises(ValueError, match=r"\[1, 9, 17, 25, 33\] has ids \[25, 33\] outside the target's 24 layers"):
        draft.check_fits(target_config(num_hidden_layers=24, layer_types=["full_attention"] * 24))
    with pytest.raises(ValueError, match="draft hidden_size 64 != target hidden_size 128"):
        draft.check_fits(target_config(hidden_size=128))
    with pytest.raises(ValueError, match=r"mask_token_id 151669 is outside the target vocabulary \(vocab_size 151000\)"):
        draft.check_fits(target_config(vocab_size=151000))
    with pytest.raises(ValueError, match="draft vocab_size 151936 != the target's vocab_size 152064"):
        draft.check_fits(target_config(vocab_size=152064))  # the mask id fits: still another tokenizer
    with pytest.warns(UserWarning, match="num_target_layers=36, target has 40 layers"):
        draft.check_fits(target_config(num_hidden_layers=40, layer_types=["full_attention"] * 40))


def test_draft_target_hidden_size_is_read_and_checked():
    d = {**ZLAB_LIKE, "target_hidden_size": ZLAB_LIKE["hidden_size"]}
    draft = DraftConfig.from_hf(d)
    assert draft.target_hidden_size == ZLAB_LIKE["hidden_size"]
    assert DraftConfig.from_hf(draft.to_hf()) == draft
    target = target_config()
    draft.check_fits(target)
    other = DraftConfig.from_hf({**d, "target_hidden_size": 2 * ZLAB_LIKE["hidden_size"]})
    with pytest.raises(ValueError, match="target_hidden_size .* the target's hidden_size"):
        other.check_fits(target)
