"""The family registry: model_type -> family, and a new family plugging in with no change elsewhere."""
from __future__ import annotations

import dataclasses

import pytest

import dflash_jax as dj
from dflash_jax import families
from dflash_jax import decode as S
from dflash_jax.config import TargetConfig, read_config_json
from dflash_jax.families import dense
from dflash_jax.target import Target, save_target
from pairs import random_pair
from tolerances import assert_close, forward_depth


def test_registry_maps_model_types_and_names_the_supported_ones():
    assert families.family_for("qwen3") is families.family_for("llama") is dense.FAMILY
    with pytest.raises(ValueError, match=r"unsupported model_type 'mixtral'; supported: qwen3, llama"):
        families.family_for("mixtral")
    with pytest.raises(ValueError, match=r"unsupported model_type None"):
        families.config_from_hf({"vocab_size": 8})


@dataclasses.dataclass(frozen=True)
class ToyConfig(TargetConfig):
    """A 'new' family's config: the dense decoder under its own model_type."""

    @classmethod
    def from_hf(cls, path_or_dict):
        d = read_config_json(path_or_dict)
        base = TargetConfig.from_hf({**d, "model_type": "qwen3"})
        return cls(**{**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)}, "model_type": "toy"})

    def to_hf(self):
        return {**super().to_hf(), "model_type": "toy", "architectures": ["ToyForCausalLM"]}


TOY = dataclasses.replace(dense.FAMILY, name="toy", config=ToyConfig)


def test_a_new_family_is_one_registry_line(tmp_path, monkeypatch):
    """Registering a family (here: a model_type whose layers all use a 4-token sliding window) is all it
    takes for loading, the draft and the decode loop to run it."""
    monkeypatch.setitem(families._REGISTRY, "toy", TOY)
    target, draft = random_pair(vocab=8, block_size=8)
    fields = {f.name: getattr(target.config, f.name) for f in dataclasses.fields(target.config)}
    toy = Target(ToyConfig(**{**fields, "model_type": "toy", "layer_types": ("sliding_attention",) * 4,
                              "sliding_window": 4}), target.params)
    loaded = dj.load_target(save_target(toy, str(tmp_path / "toy")))
    assert loaded.config == toy.config and isinstance(loaded.config, ToyConfig)
    assert [type(s).__name__ for s in loaded.new_cache(1, 128, max_block=8).layers] == ["SlidingKV"] * 4
    prompts = [[2, 3, 4], [5, 6, 2, 3, 4, 5, 6]]
    spec = S.speculative_generate(loaded, draft, prompts, max_new_tokens=20, stop_token_ids=[])
    plain = S.generate(loaded, prompts, max_new_tokens=20, stop_token_ids=[])
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    # the window (4) really applies: the same weights as a full-attention qwen3 decode differently
    full = S.generate(target, prompts, max_new_tokens=20, stop_token_ids=[])
    assert [r.output_ids for r in full] != [r.output_ids for r in plain]
    # within the window the two agree (other programs of the same forward: its rounding at most)
    assert_close(dj.target_logits(loaded, [[2, 3, 4]]), dj.target_logits(target, [[2, 3, 4]]),
                 forward_depth(target.config, 3), what="inside the window")
