"""DSpark drafts (DeepSpec's ``Qwen3DSparkModel``; docs/models.md, "Draft formats"): their config and checkpoint
layout, block logits and greedy tokens against the independent NumPy statement (``dspark_reference``), and the
engine with them: greedy output identical to plain decoding (batched, ragged, stop tokens, budgets that end inside a
block, the confidence cut), per-step acceptance equal to DeepSpec's evaluation loop. Sampling's exact law is in
tests/test_sampling.py."""
from __future__ import annotations

import json
import re

import jax
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax import decode as S
from dflash_jax.drafts import model as D
from dflash_jax.drafts import DraftConfig
from pairs import tiny_target_config
from dflash_jax.target import Target, init_params

HEADS = ("vanilla", "gated", "rnn")
VOCAB = 16
# weight scales that make each head move the drafts (the 0.02 init would leave them inert)
_STD = {"markov_w1": 1.0, "markov_w2": 0.7, "gate_proj": 0.5, "joint_proj": 0.5, "proj": 1.0}


def dspark_config(tcfg, *, head="vanilla", rank=6, confidence=True, with_markov=True, block=4, layers=1,
                  ids=(0, 1)) -> DraftConfig:
    """A DSpark draft config of ``tcfg``'s shape as DeepSpec's build_draft_config writes it (``head`` None: rank 0)."""
    d = dict(tcfg.to_hf(), architectures=["Qwen3DSparkModel"], num_hidden_layers=layers, block_size=block,
             mask_token_id=tcfg.vocab_size - 1, target_layer_ids=list(ids), num_target_layers=tcfg.num_hidden_layers,
             markov_rank=rank if head else 0, enable_confidence_head=confidence, num_anchors=512,
             tie_word_embeddings=False, layer_types=["full_attention"] * layers)
    if head:
        d["markov_head_type"] = head
    if confidence:
        d["confidence_head_with_markov"] = with_markov
    return DraftConfig.from_hf(d)


def make_dspark(target: Target, seed: int = 1, **kw) -> D.Draft:
    """A random DSpark draft of ``target`` (``dspark_config``'s keywords) whose embedding and head are the
    target's, as DeepSpec copies them; its Markov and confidence weights drawn large enough to matter."""
    cfg = dspark_config(target.config, **kw)
    rng = np.random.RandomState(seed)

    def draw(path, x):
        name = next((p.key for p in reversed(path) if getattr(p, "key", None) in _STD), None)
        return x if name is None else np.asarray(_STD[name] * rng.randn(*x.shape), x.dtype)

    params = jax.tree_util.tree_map_with_path(draw, D.init_draft_params(cfg, seed))
    tp = target.params
    head = tp["lm_head"]["kernel"] if "lm_head" in tp else tp["embed_tokens"]["embedding"].T
    params = dict(params, embed_tokens={"embedding": tp["embed_tokens"]["embedding"]}, lm_head={"kernel": head})
    return D.Draft(cfg, params)


@pytest.fixture(scope="module")
def small():
    """A tiny random target with a small vocabulary (16), so that random drafts are sometimes right."""
    tcfg = tiny_target_config(16, layers=2)
    params = init_params(tcfg, 0)
    params = dict(params, lm_head={"kernel": params["lm_head"]["kernel"] * 8})  # peaked: greedy runs repeat
    return Target(tcfg, params)


def test_config_reads_and_writes_deepspec_layout(small):
    cfg = dspark_config(small.config, head="rnn", rank=6, block=7)
    assert (cfg.architecture, cfg.markov_rank, cfg.markov_head_type, cfg.confidence_head,
            cfg.confidence_with_markov, cfg.num_anchors, cfg.block_size) == ("dspark", 6, "rnn", True, True, 512, 7)
    assert cfg.shifted and cfg.own_embeddings and cfg.markov and not cfg.convolves
    assert cfg.verify_length(7) == 8 and not any(cfg.layer_causal(i) for i in range(cfg.layers.num_hidden_layers))
    hf = cfg.to_hf()
    assert "dflash_config" not in hf and hf["architectures"] == ["Qwen3DSparkModel"]
    assert {hf[k] for k in ("mask_token_id", "markov_rank", "markov_head_type", "enable_confidence_head",
                            "confidence_head_with_markov", "num_anchors")} == {15, 6, "rnn", True, 512}
    assert hf["target_layer_ids"] == [0, 1] and hf["tie_word_embeddings"] is False
    assert DraftConfig.from_hf(hf) == cfg
    assert DraftConfig.from_hf(dict(hf, markov_head_type="RNN")) == cfg  # DeepSpec lower-cases the head type
    no_anchors = {k: v for k, v in hf.items() if k != "num_anchors"}
    assert DraftConfig.from_hf(no_anchors).to_hf()["num_anchors"] == 512  # DeepSpec's model requires the key
    # no Markov head: no head type, a confidence head reading h alone; no confidence head: no input key
    bare = dspark_config(small.config, head=None, confidence=True)
    assert (bare.markov_rank, bare.markov_head_type, bare.confidence_with_markov, bare.markov) == (0, None, False, False)
    assert "markov_head_type" not in bare.to_hf()
    off = dspark_config(small.config, confidence=False)
    assert off.confidence_head is False and "confidence_head_with_markov" not in off.to_hf()


def test_config_refusals(small):
    base = dspark_config(small.config).to_hf()
    for bad, msg in ((dict(markov_head_type="lstm"), "markov_head_type"),
                     (dict(target_layer_ids=[-2, 1]), "must be >= -1"),
                     (dict(architectures=["Gemma4DSparkModel"]), "model_type gemma4_text"),
                     (dict(architectures=["Qwen9DSparkModel"]), "unsupported draft architecture")):
        with pytest.raises(ValueError, match=msg):
            DraftConfig.from_hf(dict(base, **bad))
    dflash = DraftConfig.for_target(small.config, draft_layers=1, block_size=4, mask_token_id=15,
                                    target_layer_ids=(0, 1))
    with pytest.raises(ValueError, match="DSpark settings"):
        DraftConfig(**{**dflash.__dict__, "markov_rank": 4})


def test_checkpoint_round_trip(small, tmp_path):
    """save_draft writes DeepSpec's tensor names and shapes; load_draft reads them back to bit-identical logits."""
    draft = make_dspark(small, head="gated", rank=6)
    D.save_draft(draft, str(tmp_path), dtype="float32")
    import safetensors.numpy

    tensors = safetensors.numpy.load_file(str(tmp_path / "model.safetensors"))
    v, d, r = 16, small.config.hidden_size, 6
    assert {k: tensors[k].shape for k in tensors if not k.startswith("layers.")} == {
        "embed_tokens.weight": (v, d), "lm_head.weight": (v, d), "fc.weight": (d, 2 * d), "hidden_norm.weight": (d,),
        "norm.weight": (d,), "markov_head.markov_w1.weight": (v, r), "markov_head.markov_w2.weight": (v, r),
        "markov_head.gate_proj.weight": (r, d + r), "markov_head.gate_proj.bias": (r,),
        "confidence_head.proj.weight": (1, d + r), "confidence_head.proj.bias": (1,)}
    back = dj.load_draft(str(tmp_path))
    assert back.config == draft.config
    ctx, blk = np.array([[3, 5, 7, 2, 9]]), np.array([[4, 15, 15, 15]])
    np.testing.assert_array_equal(dj.draft_block_logits(small, back, ctx, blk),
                                  dj.draft_block_logits(small, draft, ctx, blk))
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["architectures"] == ["Qwen3DSparkModel"]


def test_vocabulary_of_its_own_tables_is_checked(small):
    draft = make_dspark(small)
    short = dict(draft.params, lm_head={"kernel": draft.params["lm_head"]["kernel"][:, :12]})
    with pytest.raises(ValueError, match="lm_head has 12 rows"):
        dj.draft_block_tokens(small, D.Draft(draft.config, short), np.array([[3, 4]]), np.array([[4, 15]]))


@pytest.mark.parametrize("head", HEADS)
def test_greedy_equals_plain_decoding(small, head):
    """Batched, ragged prompts; with and without a stop token that cuts a row short; budgets that end inside a
    step; DSpark drafts of every Markov head, and with the confidence cut: identical to plain decoding, and
    drafts are partly accepted (the rollback and the shifted commit are exercised)."""
    prompts = [[5, 7, 3, 4, 9, 6], [7, 7, 1, 2, 3, 11, 12, 9, 14], [2, 8, 13]]
    draft = make_dspark(small, head=head, seed=HEADS.index(head) + 2)
    partial = []
    free = S.generate(small, prompts, max_new_tokens=21, stop_token_ids=[])
    row0 = free[0].generated_ids
    stop = next(t for i, t in enumerate(row0) if i >= 3 and t not in row0[:i])
    for stops in ([], [stop]):
        want = [r.output_ids for r in S.generate(small, prompts, max_new_tokens=21, stop_token_ids=stops)]
        for kw in ({}, dict(confidence_threshold=0.5)):
            out = S.speculative_generate(small, draft, prompts, max_new_tokens=21, stop_token_ids=stops, **kw)
            assert [r.output_ids for r in out] == want, (stops, kw)
            assert all(sum(r.acceptance_lengths) + 1 == r.num_generated for r in out)
            # 4 slots propose 4: 5 verified; a cut proposal counts the drafts it kept (+ the pending token)
            verified = [v for r in out for v in r.verify_lengths]
            assert all(a <= v for r in out for a, v in zip(r.acceptance_lengths, r.verify_lengths))
            assert set(verified) == {5} if not kw else (min(verified) < 5 and max(verified) <= 5), (kw, verified)
            partial += [a for r in out for a in r.acceptance_lengths if 1 < a]
    assert partial, "no draft was ever accepted"


# --- against the independent NumPy statement, on checkpoints written in DeepSpec's layout -----------------------


@pytest.fixture(scope="module")
def hf_target(tmp_path_factory):
    """A tiny Hugging Face Qwen3 target of 16 tokens with a peaked head (random drafts are then sometimes right):
    (directory, torch model, loaded target)."""
    from hf_models import perturb, save_tiny

    d = str(tmp_path_factory.mktemp("dspark_target"))
    model = perturb(save_tiny(d, "qwen3", vocab_size=VOCAB), {"lm_head": 0.6})
    model.save_pretrained(d)
    return d, model, dj.load_target(d)


# name -> write_dspark_draft keywords (every head type, the confidence head on; and the heads off)
WRITTEN = {"vanilla": dict(markov_head_type="vanilla"), "gated": dict(markov_head_type="gated"),
           "rnn": dict(markov_head_type="rnn"), "confidence without markov": dict(confidence_with_markov=False),
           "no heads": dict(markov_rank=0, confidence=False),
           # DeepSpec's id -1: the embedding output (hidden_states[0]) fused beside a layer's
           "embedding feature": dict(markov_head_type="vanilla", target_layer_ids=(-1, 2))}


def _written(hf_target, tmp_path, **kw):
    from dspark_reference import write_dspark_draft

    d = str(tmp_path / "draft")
    w = write_dspark_draft(d, hf_target[0], num_layers=2, block_size=4, **kw)
    with open(f"{d}/config.json") as f:
        return w, json.load(f), dj.load_draft(d)


@pytest.mark.parametrize("name", list(WRITTEN))
def test_block_logits_and_tokens_match_numpy(hf_target, tmp_path, name):
    """``draft_block_logits`` (Markov-corrected, given the greedy previous tokens) and ``draft_block_tokens`` (the
    greedy walk: B tokens for B slots) of DeepSpec-layout checkpoints equal the float64 reference, batched with two
    contexts of different lengths (the shorter one padded by the library)."""
    _, model, target = hf_target
    w, cfg, draft = _written(hf_target, tmp_path, **WRITTEN[name])
    block_logits_match_numpy(model, target, draft, w, cfg, name)


def block_logits_match_numpy(model, target, draft, w, cfg, name):
    """``draft_block_logits`` / ``draft_block_tokens`` == ``numpy_dspark`` over the torch ``model``'s features, for
    two random batched contexts of 7 and 12 tokens and block-4 blocks."""
    from dspark_reference import numpy_dspark
    from hf_models import torch_forward
    from tolerances import assert_close, draft_depth

    v = target.config.vocab_size
    rng = np.random.RandomState(5)
    for t in (7, 12):
        ctx = rng.randint(0, v, (2, t))
        blk = np.concatenate([rng.randint(0, v, (2, 1)), np.full((2, 3), cfg["mask_token_id"])], axis=1)
        logits = dj.draft_block_logits(target, draft, ctx, blk)
        tokens = dj.draft_block_tokens(target, draft, ctx, blk)
        assert logits.shape == (2, 4, v) and tokens.shape == (2, 4)
        for row in range(2):
            feats = torch_forward(model, ctx[row][None], cfg["target_layer_ids"])[1][0].astype(np.float64)
            ref = numpy_dspark(w, cfg, feats, int(blk[row, 0]))
            assert_close(logits[row], ref["logits"], draft_depth(target.config, draft.config.layers, t, 4),
                         what=f"{name}, context {t}, row {row}")
            assert tokens[row].tolist() == ref["tokens"].tolist()


@pytest.mark.parametrize("name,threshold", [("vanilla", 0.0), ("rnn", 0.0), ("gated", 0.6)])
def test_engine_equals_deepspec_loop(hf_target, tmp_path, name, threshold):
    """``speculative_generate`` (greedy, block 4: 5 tokens verified) gives DeepSpec's evaluation loop's output and
    per-step acceptance lengths, with the confidence cut too; both equal transformers' greedy generate. DeepSpec's
    loop runs while its pending token is inside the budget and trims after, so it may take one step more than the
    engine (which stops once the budget's tokens are committed) and counts its last steps uncut: the engine's
    steps equal its first ones, the last one at most its count."""
    _, model, target = hf_target
    w, cfg, draft = _written(hf_target, tmp_path, **WRITTEN[name])
    engine_matches_deepspec_loop(model, target, draft, w, cfg, [[5, 1, 12, 8, 6, 3], [9, 9, 2],
                                                                [14, 7, 0, 11, 4, 13, 2, 10], [3]], 20, threshold)


def engine_matches_deepspec_loop(model, target, draft, w, cfg, prompts, new, threshold):
    """Greedy ``speculative_generate`` of ``prompts`` == DeepSpec's loop (``dspark_reference``, over the torch
    ``model``) == transformers' greedy generate; acceptance counted as ``test_engine_equals_deepspec_loop`` says;
    some drafts accepted."""
    from dspark_reference import dspark_greedy_decode
    from hf_models import torch_forward, torch_greedy

    def forward(ids):
        logits, feats = torch_forward(model, np.asarray(ids)[None], cfg["target_layer_ids"])
        return logits[0].astype(np.float64), feats[0].astype(np.float64)

    outs = S.speculative_generate(target, draft, prompts, max_new_tokens=new, stop_token_ids=[],
                                  confidence_threshold=threshold)
    accepted = []
    for prompt, out in zip(prompts, outs):
        ref_out, ref_acc = dspark_greedy_decode(forward, w, cfg, prompt, new, threshold=threshold)
        assert out.output_ids == ref_out == torch_greedy(model, prompt, new)
        acc, n = out.acceptance_lengths, len(out.acceptance_lengths)
        assert n <= len(ref_acc) <= n + 1 and acc[:-1] == ref_acc[:n - 1] and acc[-1] <= ref_acc[n - 1], (acc, ref_acc)
        accepted += [a for a in acc if a > 1]
    assert accepted, "no draft was accepted: the comparison would hold for any draft"


def test_generate_cli(hf_target, tmp_path, capsys):
    """``python -m infer.generate --json`` with a DeepSpec-layout DSpark draft, a prompts file through 2 slots and the
    confidence cut: DeepSpec's loop's outputs and acceptance lengths; options DSpark cannot take are refused before
    loading, in one line."""
    from dspark_reference import dspark_greedy_decode
    from hf_models import torch_forward
    from infer import generate as g

    d, model, target = hf_target
    w, cfg, _ = _written(hf_target, tmp_path, markov_head_type="vanilla")
    prompts = [[5, 1, 12, 8, 6, 3], [14, 7, 0, 11]]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    base = ["--target", d, "--draft", str(tmp_path / "draft"), "--max-new-tokens", "12", "--ignore-eos", "--json",
            "--block-size", "4"]
    assert g.main(base + ["--prompts-file", str(path), "--max-batch", "2", "--confidence-threshold", "0.6"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]

    def forward(ids):
        logits, feats = torch_forward(model, np.asarray(ids)[None], cfg["target_layer_ids"])
        return logits[0].astype(np.float64), feats[0].astype(np.float64)

    for row, prompt in zip(rows, prompts):
        out, acc = dspark_greedy_decode(forward, w, cfg, prompt, 12, threshold=0.6)
        n = len(row["acceptance_lengths"])
        assert row["output_ids"] == out and row["acceptance_lengths"][:-1] == acc[:n - 1]
    for extra, msg in ((["--tree-budget", "8", "--confidence-threshold", "0.6"], "cannot be combined"),
                       (["--verify-lengths", "2,5"], "not supported for DSpark"),
                       (["--confidence-threshold", "1.5"], r"\[0, 1\)")):
        with pytest.raises(SystemExit) as e:
            g.main(base + ["--prompt-ids", "5,1,12"] + extra)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and re.search(msg, err), err


def test_mesh_equals_one_device(small):
    """Params over tensor=2 (the draft's own tables and Markov head over the vocabulary), rows and caches over
    data=2: outputs and acceptance lengths equal one device's (greedy, with the confidence cut: the per-row cut
    and the confidence head run on the mesh too)."""
    from dflash_jax import model_sharding as ms
    from dflash_jax import sharding as sh

    draft = make_dspark(small, head="rnn", seed=3)
    prompts = [[5, 7, 3, 4, 9, 6], [7, 7, 1, 2, 3, 11, 12, 9, 14], [2, 8, 13], [4, 4]]
    mesh = sh.make_mesh("data=2,tensor=2", devices=jax.devices()[:4])
    ts, ds = ms.shard_target(small, mesh), ms.shard_draft(draft, mesh)
    kw = dict(max_new_tokens=12, stop_token_ids=[], confidence_threshold=0.5)
    single = S.speculative_generate(small, draft, prompts, **kw)
    out = S.speculative_generate(ts, ds, prompts, **kw)
    assert [r.output_ids for r in out] == [r.output_ids for r in single]
    assert [r.acceptance_lengths for r in out] == [r.acceptance_lengths for r in single]


def test_benchmark_tree_summary(hf_target, tmp_path, capsys):
    """``infer.benchmark --tree-budget`` with a DSpark draft (block 4: 4 slots draft 4, 5 verified; a tree reaches
    depth 4): identical outputs, and the per-position acceptance and both histograms cover all 4 depths."""
    from infer import benchmark as b

    d = hf_target[0]
    _written(hf_target, tmp_path, markov_head_type="vanilla")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in ([5, 1, 12, 8], [9, 9, 2])))
    assert b.main(["--target", d, "--draft", str(tmp_path / "draft"), "--prompts-file", str(prompts), "--json",
                   "--max-new-tokens", "16", "--ignore-eos", "--no-timing-split", "--repeats", "1",
                   "--block-size", "4", "--tree-budget", "8"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["identical"] is True and summary["verified_tokens_per_step"] == 9
    assert len(summary["acceptance_rate_per_position"]) == 4 and None not in summary["acceptance_rate_per_position"]
    assert len(summary["acceptance_histogram"]) == 5 and len(summary["chain_acceptance_histogram"]) == 5
