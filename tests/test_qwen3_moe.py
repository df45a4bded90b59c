"""The qwen3_moe family against transformers' ``Qwen3MoeForCausalLM``: parity, routed-expert dispatch,
incremental decoding, lossless speculative decoding (also against transformers' ``generate``), both
checkpoint layouts and their bad inputs, expert-parallel meshes, and training a draft for it.

Every model is a tiny random checkpoint written with transformers' ``save_pretrained`` (no network).
"""
from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
import torch
from flax import traverse_util
from jax.sharding import PartitionSpec as P

import dflash_jax as dj
from dflash_jax import model_sharding as ms
from dflash_jax import sharding as sh
from dflash_jax import decode as S
from dflash_jax.checkpoints import iter_safetensors, save_safetensors
from dflash_jax.families.qwen3_moe import Qwen3MoeConfig
from dflash_jax.moe import Experts
from dflash_jax.target import forward, save_target
from hf_models import TINY, save_tiny
from pairs import random_draft
from test_target import decode_in_chunks, positions_for, random_ids
from tolerances import assert_close, forward_depth, max_diff

L, V, D = TINY["num_hidden_layers"], TINY["vocab_size"], TINY["hidden_size"]
ALL_LAYERS = tuple(range(L))
E, K, I = 8, 2, 16  # experts, experts per token, expert MLP width
MOE = dict(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=I)
EOS = 7
# name -> config overrides. Together: dense layers by mlp_only_layers and by decoder_sparse_step,
# norm_topk_prob both ways, every layer sliding (transformers' qwen3_moe rule for use_sliding_window).
CASES = {
    "norm_topk": dict(MOE, mlp_only_layers=[1], norm_topk_prob=True, eos_token_id=EOS),
    "step2_sliding": dict(MOE, decoder_sparse_step=2, norm_topk_prob=False, use_sliding_window=True,
                          sliding_window=4),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """case -> (checkpoint dir, torch model, loaded fp32 Target), built once per module."""
    cache = {}

    def get(name):
        if name not in cache:
            path = str(tmp_path_factory.mktemp(name))
            model = save_tiny(path, "qwen3_moe", **CASES[name])
            cache[name] = (path, model, dj.load_target(path))
        return cache[name]

    return get


def test_config_reads_what_transformers_writes(saved):
    path, _, target = saved("norm_topk")
    written = json.load(open(f"{path}/config.json"))
    assert "num_local_experts" in written  # transformers 5.x's name for num_experts
    c = target.config
    assert isinstance(c, Qwen3MoeConfig) and c.qk_norm and (c.num_experts, c.num_experts_per_tok) == (E, K)
    assert c.moe_intermediate_size == I and c.norm_topk_prob and c.mlp_only_layers == (1,)
    assert [c.is_sparse(i) for i in ALL_LAYERS] == [True, False, True, True]
    c2 = saved("step2_sliding")[2].config
    assert [c2.is_sparse(i) for i in ALL_LAYERS] == [False, True, False, True] and not c2.norm_topk_prob
    assert [c2.layer_window(i) for i in ALL_LAYERS] == [4] * L
    assert Qwen3MoeConfig.from_hf(c.to_hf()) == c and Qwen3MoeConfig.from_hf(c2.to_hf()) == c2
    # transformers 4.x names the count num_experts
    four = {k: v for k, v in written.items() if k != "num_local_experts"}
    assert Qwen3MoeConfig.from_hf({**four, "num_experts": E}) == c
    with pytest.raises(ValueError, match=r"missing \['num_experts'\]"):
        Qwen3MoeConfig.from_hf(four)
    with pytest.raises(ValueError, match="num_experts_per_tok=9 must be in 1..num_experts=8"):
        Qwen3MoeConfig.from_hf({**written, "num_experts_per_tok": 9})


# --------------------------------------------------------------------------------------------------
# Parity with transformers
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_transformers_ragged_batch(saved, case):
    """A right-padded batch (padding at position -1) gives, at every real token, transformers' logits and
    every hidden_states[i] of that row alone."""
    _, model, target = saved(case)
    ids = random_ids(2, 12, seed=1)
    lengths = [12, 7]
    pos = np.where(np.arange(12) < np.array(lengths)[:, None], np.arange(12), -1).astype(np.int32)
    logits, feats, _ = forward(target.config, target.params, ids, pos, feature_layer_ids=ALL_LAYERS)
    logits, feats = np.asarray(logits), np.asarray(feats)
    depth = forward_depth(target.config, 12)  # JAX and torch round a whole forward differently
    for r, n in enumerate(lengths):
        with torch.no_grad():
            ref = model(torch.as_tensor(ids[r:r + 1, :n], dtype=torch.long), output_hidden_states=True)
        assert_close(logits[r, :n], ref.logits[0].numpy(), depth, what=f"logits row {r}")
        for i in ALL_LAYERS:
            ours = feats[r, :n, i * D:(i + 1) * D]
            assert_close(ours, ref.hidden_states[i + 1][0].numpy(), depth, what=f"row {r} hidden_states[{i + 1}]")


def test_norm_topk_prob_matters(saved):
    """The renormalisation is really applied: the same weights without it give other logits."""
    import dataclasses

    _, _, target = saved("norm_topk")
    ids = random_ids(2, 12, seed=1)
    off = dataclasses.replace(target.config, norm_topk_prob=False)
    a = forward(target.config, target.params, ids, positions_for(ids))[0]
    b = forward(off, target.params, ids, positions_for(ids))[0]
    assert max_diff(a, b) > 1e-3


# --------------------------------------------------------------------------------------------------
# The experts layer: per-pair and grouped dispatch against a dense all-experts reference
# --------------------------------------------------------------------------------------------------

def test_experts_dispatch_paths_agree_with_dense_reference():
    t = 12
    rng = np.random.RandomState(0)
    experts = Experts(E, D, I, gate_up_layout="concat")
    params = {"gate_up_proj": rng.randn(E, D, 2 * I).astype(np.float32) * 0.3,
              "down_proj": rng.randn(E, I, D).astype(np.float32) * 0.3}
    x = rng.randn(t, D).astype(np.float32)
    index = np.stack([rng.choice(E - 1, K, replace=False) for _ in range(t)]).astype(np.int32)  # expert 7 idle
    weight = rng.rand(t, K).astype(np.float32)
    # dense reference in float64: every expert on every token, then the routing weights pick and mix them
    h = np.einsum("TD,EDF->TEF", x.astype(np.float64), params["gate_up_proj"].astype(np.float64))
    gate, up = h[..., :I], h[..., I:]
    every = np.einsum("TEI,EID->TED", gate / (1 + np.exp(-gate)) * up, params["down_proj"].astype(np.float64))
    mix = np.zeros((t, E), np.float64)
    np.add.at(mix, (np.arange(t)[:, None], index), weight)
    ref = np.einsum("TED,TE->TD", every, mix)

    v = {"params": params}
    per_pair = experts.apply(v, x, index, weight, method="_per_pair")
    grouped = experts.apply(v, x, index, weight, method="_grouped")
    depth = D + I + K  # float32 against exact: the gate_up and down reductions, then the mix of K experts
    assert_close(per_pair, ref, depth, what="per pair")
    assert_close(grouped, ref, depth, what="grouped")
    # __call__ picks the path from the shapes: a token's pairs (4 T k <= E) one by one, more tokens grouped
    assert_close(experts.apply(v, x[:1], index[:1], weight[:1]), ref[:1], depth, what="few tokens")
    assert_close(experts.apply(v, x, index, weight), ref, depth, what="many tokens")


# --------------------------------------------------------------------------------------------------
# Incremental decoding through the cache == one-shot forward
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case,chunk,starts", [("norm_topk", 1, [5]), ("norm_topk", 1, [5, 2]),
                                               ("norm_topk", 7, [5, 2]), ("step2_sliding", 7, [5, 2])])
def test_incremental_decoding_equals_full_forward(saved, case, chunk, starts):
    """Ragged rows; one row of chunk 1 routes through the per-pair dispatch (4 x 1 token x 2 experts <= 8), two rows
    or chunk 7 the grouped one."""
    _, _, target = saved(case)
    seqs = random_ids(len(starts), 12, seed=2)
    full, full_feats, _ = forward(target.config, target.params, seqs, positions_for(seqs),
                                  feature_layer_ids=ALL_LAYERS)
    got, got_feats, _ = decode_in_chunks(target, seqs, starts, chunk)
    depth = forward_depth(target.config, 12)  # the same forward at other shapes (cached chunks): its rounding
    assert_close(got, full, depth, what="logits")
    assert_close(got_feats, full_feats, depth, what="features")


# --------------------------------------------------------------------------------------------------
# Lossless speculative decoding, also against transformers' greedy generate
# --------------------------------------------------------------------------------------------------

PROMPTS = [[3, 17, 5], [9, 40, 2, 88, 61, 12, 30], [50], [21, 22, 23, 24]]
MAX_NEW = 16


@pytest.fixture(scope="module")
def pair(saved):
    _, model, target = saved("norm_topk")
    return model, target, random_draft(target.config, block_size=8, target_layer_ids=(0, 2, 3))


@pytest.fixture(scope="module")
def single(pair):
    _, target, draft = pair
    return S.speculative_generate(target, draft, PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=[EOS])


def test_speculative_equals_plain_and_transformers_generate(pair, single):
    model, target, _ = pair
    plain = S.generate(target, PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=[EOS])
    assert [r.output_ids for r in single] == [r.output_ids for r in plain]
    stopped = 0
    for prompt, r in zip(PROMPTS, single):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False,
                                 eos_token_id=EOS, pad_token_id=0)
        assert r.output_ids == ref[0].tolist()
        stopped += r.finish_reason == "stop"
        assert r.finish_reason == ("stop" if r.output_ids[-1] == EOS else "length")
    assert 0 < stopped < len(PROMPTS)  # the stop token ends some rows early, not all


# --------------------------------------------------------------------------------------------------
# Expert-parallel meshes == one device
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["data=2,expert=4", "data=2,expert=2,tensor=2"])
def test_expert_parallel_equals_one_device(pair, single, spec):
    _, target, draft = pair
    mesh = sh.make_mesh(spec)
    rules = ms.model_rules(mesh, target, draft)
    starget = ms.shard_target(target, mesh, rules)
    sdraft = ms.shard_draft(draft, mesh, rules)
    w = starget.params["layers_0"]["mlp"]["experts"]["gate_up_proj"]
    assert w.sharding.spec == (P("expert", None, "tensor") if mesh.shape["tensor"] > 1 else P("expert"))
    assert w.addressable_shards[0].data.shape[0] == E // mesh.shape["expert"]
    out = S.speculative_generate(starget, sdraft, PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=[EOS])
    assert [r.output_ids for r in out] == [r.output_ids for r in single]
    assert [r.acceptance_lengths for r in out] == [r.acceptance_lengths for r in single]


def test_expert_rule_is_the_moe_familys_own(pair):
    """Dense families and drafts see no expert rule; a mesh without expert parallelism replicates experts."""
    _, target, draft = pair
    mesh = sh.make_mesh("data=2,tensor=4")
    assert "expert" not in dict(ms.model_rules(mesh, draft))
    s = traverse_util.flatten_dict(ms.param_shardings(target, mesh))
    assert s[("layers_0", "mlp", "experts", "down_proj")].spec == P(None, "tensor")
    assert s[("layers_0", "mlp", "gate", "kernel")].spec == P()


# --------------------------------------------------------------------------------------------------
# Checkpoint layouts and bad checkpoints
# --------------------------------------------------------------------------------------------------

def _same_params(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    assert all(jax.tree_util.tree_leaves(jax.tree_util.tree_map(lambda x, y: bool(np.array_equal(x, y)), a, b)))


def test_both_layouts_load_identically(saved, tmp_path):
    """Per-expert tensors (what transformers 5.24's save_pretrained writes, as the released checkpoints;
    also sharded over files) and the fused 5.x in-memory layout (its state_dict) give the same parameters;
    ``save_target`` writes the fused one, which we and transformers read back."""
    path, model, target = saved("norm_topk")
    names = {n for n, _ in iter_safetensors(f"{path}/model.safetensors")}
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in names
    assert not any(n.endswith("experts.gate_up_proj") for n in names)

    fused = tmp_path / "fused"
    shutil.copytree(path, fused)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (E, 2 * I, D)
    save_safetensors(str(fused / "model.safetensors"), state)
    _same_params(dj.load_target(str(fused)).params, target.params)

    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="8KB")
    assert len(set(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"].values())) > 2
    _same_params(dj.load_target(str(sharded)).params, target.params)

    ours = save_target(target, str(tmp_path / "ours"))
    _same_params(dj.load_target(ours).params, target.params)
    import transformers

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(ours)  # transformers 5.x reads ours too
    ids = torch.as_tensor(random_ids(2, 12), dtype=torch.long)
    with torch.no_grad():
        assert_close(reloaded(ids).logits, model(ids).logits, forward_depth(target.config, 12), what="reloaded torch")


def _rewrite_checkpoint(src, dst, drop=(), **config_changes):
    shutil.copytree(src, dst)
    tensors = {n: np.array(a) for n, a in iter_safetensors(f"{src}/model.safetensors") if n not in drop}
    save_safetensors(str(dst / "model.safetensors"), tensors)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(config_changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


@pytest.mark.parametrize("drop,changes,match", [
    (["model.layers.2.mlp.experts.5.up_proj.weight"], {},
     r"lacks tensor model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"),
    ([], {"num_local_experts": 6},
     r"tensor model\.layers\.0\.mlp\.experts\.6\.\w+\.weight is expert 6, but the config has num_experts=6"),
    ([], {"num_local_experts": 10}, r"model\.layers\.0\.mlp\.gate\.weight has shape \[8, 32\] but the config "
                                    r"implies \[10, 32\]"),
    ([], {"moe_intermediate_size": 12},
     r"tensor model\.layers\.0\.mlp\.experts\.0\.\w+\.weight has shape \[\d+, \d+\] but the config implies"),
], ids=["missing_expert", "fewer_experts_in_config", "more_experts_in_config", "expert_width"])
def test_bad_expert_checkpoints_name_the_tensor(saved, tmp_path, drop, changes, match):
    path = _rewrite_checkpoint(saved("norm_topk")[0], tmp_path / "bad", drop, **changes)
    with pytest.raises(ValueError, match=match):
        dj.load_target(path)


def test_fused_layout_with_wrong_expert_count_names_the_tensor(saved, tmp_path):
    path, model, _ = saved("norm_topk")
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    state["model.layers.3.mlp.experts.down_proj"] = state["model.layers.3.mlp.experts.down_proj"][:5]
    save_safetensors(str(bad / "model.safetensors"), state)
    with pytest.raises(ValueError, match=r"model\.layers\.3\.mlp\.experts\.down_proj has shape \[5, 32, 16\]"):
        dj.load_target(str(bad))


# --------------------------------------------------------------------------------------------------
# Training a draft for a qwen3_moe target
# --------------------------------------------------------------------------------------------------

@pytest.mark.slow  # ~40 s on 2 CPU cores (data generation, the train step's and the decode loop's compiles)
def test_training_a_draft_runs_and_the_loss_falls(saved, tmp_path):
    from train.config import TrainConfig
    from train.loop import train
    from train.make_data import make_data

    def quiet(*a, **k):
        pass

    path, _, target = saved("norm_topk")
    rng = np.random.RandomState(0)
    pfile = tmp_path / "prompts.jsonl"
    pfile.write_text("".join(json.dumps({"prompt_ids": rng.randint(8, 90, rng.randint(3, 8)).tolist()}) + "\n"
                             for _ in range(8)))
    data = str(tmp_path / "data")
    make_data(target, str(pfile), data, max_new_tokens=24, batch_size=8, shard_size=8, progress=False, log=quiet)
    cfg = TrainConfig(target=path, data=data, out=str(tmp_path / "run"), draft_layers=1, block_size=4,
                      num_target_features=2, num_anchors=8, seq_len=32, batch_size=4, steps=12, lr=1e-2,
                      warmup_frac=0.1, dtype="float32", save_every=12, log_every=12, progress=False,
                      eval_num_prompts=0)
    losses = []
    draft = train(cfg, target=target, on_step=lambda s, m: losses.append(m["loss"]), log=quiet)
    assert draft.config.layers.intermediate_size == TINY["intermediate_size"]  # the target's dense MLP width
    assert len(losses) == 12 and np.isfinite(losses).all()
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.1, losses
    (r,) = S.speculative_generate(target, draft, [PROMPTS[1]], max_new_tokens=MAX_NEW, stop_token_ids=[EOS])
    (p,) = S.generate(target, [PROMPTS[1]], max_new_tokens=MAX_NEW, stop_token_ids=[EOS])
    assert r.output_ids == p.output_ids


def test_scanned_layers_decode_what_unrolled_ones_do(saved):
    """``scan_layers``: the family's repeating layers as one scan (``pairs.scanned_decodes_the_same``)."""
    from pairs import scanned_decodes_the_same

    scanned_decodes_the_same(saved("step2_sliding")[2], [[3, 5, 7, 2, 9], [4, 4, 1], [8, 2, 6, 1, 3, 5, 7]])
