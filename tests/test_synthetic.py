"""``python -m infer.benchmark --synthetic``: presets at real shapes, the replay draft, the report."""
from __future__ import annotations

import dataclasses
import json
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import synthetic as syn
from dflash_jax.decode import generate, speculative_generate
from dflash_jax.synthetic import ReplayProposer
from pairs import random_pair


@pytest.fixture(scope="module")
def pair():
    return random_pair(block_size=8)


PROMPTS = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16]]  # ragged rows


def _replayed(pair, probs, max_new_tokens=40, prompts=PROMPTS, **kw):
    target, draft = pair
    plain = generate(target, prompts, max_new_tokens=max_new_tokens, stop_token_ids=[])
    spec = speculative_generate(target, draft, prompts, max_new_tokens=max_new_tokens, stop_token_ids=[],
                                proposer=ReplayProposer(reference=[r.output_ids for r in plain], probs=probs), **kw)
    return plain, spec


@pytest.mark.parametrize("probs,length", [(np.eye(8)[0], 1), (np.eye(8)[2], 3), (np.eye(8)[7], 8), (None, None)])
def test_replay_equals_plain_decoding_at_the_drawn_lengths(pair, probs, length):
    """The replayed block is the reference up to the drawn length, then wrong tokens: every step commits exactly
    that many tokens (only the row's last step is cut by the budget) and the output is plain decoding's."""
    plain, spec = _replayed(pair, syn.geometric_probs(3.5, 8) if probs is None else probs)
    for p, s in zip(plain, spec):
        assert s.output_ids == p.output_ids
        assert s.num_generated == 1 + sum(s.acceptance_lengths)
        if length is not None:
            assert set(s.acceptance_lengths[:-1]) == {length} and s.acceptance_lengths[-1] <= length


def test_replay_block_smaller_than_trained(pair):
    plain, spec = _replayed(pair, syn.geometric_probs(2.5, 4), block_size=4)
    assert [s.output_ids for s in spec] == [p.output_ids for p in plain]
    assert max(a for s in spec for a in s.acceptance_lengths) <= 4


def test_realised_tau_is_the_requested_one(pair):
    """Mean acceptance length over the steps that the budget did not cut (each row's last) is within 4 standard
    errors of the requested tau: the lengths are i.i.d. draws from the distribution, so the error of their mean
    is sd / sqrt(n); at 4 of them a correct engine fails with probability ~6e-5 for a random seed (and this
    seed is fixed, so the test is deterministic)."""
    probs = syn.geometric_probs(4.0, 8)
    _, spec = _replayed(pair, probs, max_new_tokens=160, prompts=PROMPTS + [[20, 21], [30]])
    acc = np.array([a for s in spec for a in s.acceptance_lengths[:-1]])
    sd = np.sqrt((probs * (np.arange(1, 9) - 4.0) ** 2).sum())
    assert len(acc) > 100
    assert abs(acc.mean() - 4.0) < 4 * sd / np.sqrt(len(acc)), (acc.mean(), sd, len(acc))


def test_replay_through_continuous_batching(pair):
    """Through decode.Engine's slots (2 slots, 5 requests of mixed budgets, so slots are refilled mid-run): each
    request replays its own reference (``ReplayProposer.admitted`` moves it into the slot it takes), its output is
    plain decoding's, and its acceptance lengths are those of the same prompt as row i of a closed batch (the
    draws come from the key of (seed, stream i) wherever the request runs)."""
    from dflash_jax.decode import Request, continuous_generate

    target, draft = pair
    prompts = PROMPTS + [[20, 21], [30, 31, 32, 33, 34]]
    budgets = [30, 9, 22, 5, 17]
    plain = [generate(target, [p], max_new_tokens=n, stop_token_ids=[])[0] for p, n in zip(prompts, budgets)]
    replay = ReplayProposer(reference=[r.output_ids for r in plain], probs=syn.geometric_probs(3.0, 8))
    closed = speculative_generate(target, draft, prompts, max_new_tokens=max(budgets), stop_token_ids=[],
                                  proposer=replay)
    requests = [Request(p, max_new_tokens=n, stream=i) for i, (p, n) in enumerate(zip(prompts, budgets))]
    out = continuous_generate(target, draft, requests, max_batch=2, stop_token_ids=(), proposer=replay)
    assert [r.output_ids for r in out] == [r.output_ids for r in plain]
    for c, s, n in zip(out, closed, budgets):  # the closed row runs to the longest budget: compare its first steps
        assert c.acceptance_lengths[:-1] == s.acceptance_lengths[:len(c.acceptance_lengths) - 1]
    with pytest.raises(ValueError, match="5 reference rows; request stream 7"):
        continuous_generate(target, draft, [Request([3, 4], stream=7)], max_batch=2, max_new_tokens=4,
                            stop_token_ids=(), proposer=replay)


def test_replay_on_a_mesh(pair):
    """Rows over data (3 prompts padded to 4 rows), weights over tensor: the reference rows travel with them."""
    from dflash_jax import model_sharding, sharding

    target, draft = pair
    mesh = sharding.make_mesh("data=-1,tensor=2")
    sharded = (model_sharding.shard_target(target, mesh), model_sharding.shard_draft(draft, mesh))
    plain, spec = _replayed(sharded, np.eye(8)[3], max_new_tokens=20)
    assert [s.output_ids for s in spec] == [p.output_ids for p in plain]
    assert all(set(s.acceptance_lengths[:-1]) == {4} for s in spec)


def test_replay_rejects_bad_input(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="8 probabilities"):
        speculative_generate(target, draft, [[3, 4]], max_new_tokens=4, proposer=ReplayProposer(reference=[[3, 4, 5]], probs=[0.5, 0.5]))
    with pytest.raises(ValueError, match="greedy"):
        speculative_generate(target, draft, [[3, 4]], max_new_tokens=4, temperature=1.0,
                             proposer=ReplayProposer(reference=[[3, 4, 5]], probs=np.eye(8)[0]))
    with pytest.raises(ValueError, match="verify_lengths cannot be combined with replay"):
        speculative_generate(target, draft, [[3, 4]], max_new_tokens=4, verify_lengths=(2, 8),
                             proposer=ReplayProposer(reference=[[3, 4, 5]], probs=np.eye(8)[0]))


def test_replay_distributions(tmp_path):
    for tau in (1.0, 2.5, 6.5, 15.0, 16.0):
        p = syn.geometric_probs(tau, 16)
        assert p.shape == (16,) and np.isclose(p.sum(), 1) and (p >= 0).all() and np.isclose(syn.probs_mean(p), tau)
    r = syn.geometric_probs(6.5, 16)
    assert np.allclose(r[1:-1] / r[:-2], r[1] / r[0])  # constant per-position acceptance (until the block's end)
    with pytest.raises(ValueError, match="replay tau"):
        syn.geometric_probs(17, 16)
    assert np.allclose(syn.histogram_probs([1, 0, 3], 4), [0.25, 0, 0.75, 0])
    with pytest.raises(ValueError, match="non-negative counts"):
        syn.histogram_probs([1] * 5, 4)
    (tmp_path / "a.json").write_text(json.dumps({"summary": True, "acceptance_histogram": [2, 1]}))
    (tmp_path / "b.txt").write_text("2, 1\n")
    assert syn.read_histogram(str(tmp_path / "a.json")) == syn.read_histogram(str(tmp_path / "b.txt")) == [2, 1]


@pytest.mark.parametrize("name,params,tied,layers,ids,dparams", [
    ("qwen3-0.6b", 0.596e9, True, 28, (1, 7, 13, 19, 25), 0.084e9),
    ("qwen3-1.7b", 1.721e9, True, 28, (1, 7, 13, 19, 25), 0.273e9),
    ("qwen3-4b", 4.022e9, True, 36, (1, 9, 17, 25, 33), None),
    ("qwen3-8b", 8.191e9, False, 36, (1, 9, 17, 25, 33), None),
    ("llama3.1-8b", 8.030e9, False, 32, (1, 8, 15, 22, 29), None),
])
def test_presets_have_the_released_shapes(name, params, tied, layers, ids, dparams):
    """Shapes only (``jax.eval_shape``: nothing allocated): the published parameter counts, the draft's 5 layers
    of the target's width, block 16, its target layers, and it fits the target."""
    from dflash_jax.drafts.model import draft_param_shapes
    from dflash_jax.target import param_shapes

    p = syn.preset(name)
    shapes, dshapes = param_shapes(p.target), draft_param_shapes(p.draft)
    assert abs(syn.num_params(shapes) - params) < 0.001e9
    assert ("lm_head" in shapes) is not tied and p.target.num_hidden_layers == layers
    d = p.draft
    assert (d.block_size, d.target_layer_ids, d.layers.num_hidden_layers) == (16, ids, 5)
    assert dshapes["fc"]["kernel"].shape == (5 * p.target.hidden_size, p.target.hidden_size)
    if dparams is None:  # the released 4B / 8B drafts: 0.5B - 1.2B
        assert 0.5e9 < syn.num_params(dshapes) < 1.2e9
    else:
        assert abs(syn.num_params(dshapes) - dparams) < 0.001e9
    d.check_fits(p.target)
    with pytest.raises(ValueError, match="unknown synthetic preset"):
        syn.preset("qwen3-9000b")


def test_synthetic_pair_on_a_mesh():
    """Weights drawn on the devices in the requested dtype, each leaf on its tensor-parallel sharding."""
    import jax

    from dflash_jax import model_sharding, sharding

    mesh = sharding.make_mesh("data=-1,tensor=2")
    target, draft = syn.synthetic_pair("tiny", "bfloat16", mesh)
    want = model_sharding.param_shardings(target, mesh)
    for leaf, sh in zip(jax.tree_util.tree_leaves(target.params), jax.tree_util.tree_leaves(want)):
        assert leaf.dtype == jax.numpy.bfloat16 and leaf.sharding.is_equivalent_to(sh, leaf.ndim)
    q = target.params["layers_0"]["self_attn"]["q_proj"]["kernel"]
    assert 0.015 < float(jax.numpy.std(q.astype(np.float32))) < 0.025
    assert float(target.params["norm"]["weight"].astype(np.float32).min()) == 1.0
    assert jax.tree_util.tree_leaves(draft.params)[0].dtype == jax.numpy.bfloat16


def test_cli_synthetic_tiny_prints_the_step_split(capsys, monkeypatch):
    """The CPU preset through the CLI, in-process: one JSON row per configuration, acceptance marked simulated,
    output identical to plain decoding, the step split, a progress bar on a terminal's stderr; then the same row as
    text."""
    from infer import benchmark
    from infer import synthetic_benchmark

    argv = ["--synthetic", "tiny", "--replay-tau", "4", "--context", "48", "--batch-size", "2", "--max-new-tokens",
            "24", "--repeats", "1", "--continuous-requests", "3", "--json"]
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # JSON to a pipe, the bar to a terminal
    assert benchmark.main(argv) == 0
    out = capsys.readouterr()
    (row,) = [json.loads(x) for x in out.out.strip().splitlines()]
    assert "SIMULATED" in out.err
    # 3 closed-batch parts + the timed forwards + 3 requests through each of the 2 continuous runs
    assert synthetic_benchmark.stages(benchmark.parse_args(argv)) == 10
    assert "synthetic benchmark" in out.err and "10/10" in out.err
    assert "batch 2, context 48: continuous batching, DFlash" in out.err
    assert row["acceptance"] == "simulated" and row["synthetic"] == "tiny" and row["identical"] is True
    assert (row["batch_size"], row["context"], row["block_size"]) == (2, 48, 16)
    assert row["replay"]["distribution"] == "truncated geometric" and np.isclose(row["replay"]["requested_tau"], 4)
    assert 1 <= row["tau"] <= 16 and sum(row["acceptance_histogram"]) > 0
    split = row["step_split_s"]
    assert set(split) == {"draft", "verify", "rest", "acceptance", "cache_writes", "commit", "step_loop", "other",
                          "runs"}
    assert split["draft"] > 0 and split["verify"] > 0
    assert all(split[p] > 0 for p in ("acceptance", "cache_writes", "commit"))  # each part timed, not a placeholder
    # the whole step timed alone holds its forwards (the tiny preset's rest is noise-sized, so only that much)
    assert split["step_loop"] > max(split["draft"], split["verify"])
    named = split["acceptance"] + split["cache_writes"] + split["commit"]
    assert np.isclose(split["other"], split["step_loop"] - split["draft"] - split["verify"] - named)
    assert np.isclose(split["runs"], split["rest"] - named - split["other"])  # the parts sum to the step
    assert np.isclose(row["speedup_limit"], row["tau"] * row["plain_step_s"] / (split["draft"] + split["verify"]))
    assert np.isclose(row["efficiency_vs_limit"], row["decode_speedup"] / row["speedup_limit"])
    assert np.isclose(row["efficiency_vs_limit"], row["lockstep"] * row["step_efficiency"])  # its two factors
    assert np.isclose(row["lockstep"], row["plain_loop_steps"] / (row["dflash_loop_steps"] * row["tau"]))
    assert row["verify_forward_s_block1"] > 0 and row["plain_step_s"] > 0 and row["dflash_step_s"] > 0
    assert np.isclose(row["engine_efficiency"], row["decode_speedup"] / row["tau"])
    c = row["continuous"]  # 3 requests through the 2 slots: the third takes the first slot that frees
    assert (c["requests"], c["slots"], c["identical"], c["plain_loop_steps"]) == (3, 2, True, 2 * 23)
    assert 0 < c["occupancy"] <= 1 and 1 <= c["tau"] <= 16 and c["dflash_loop_steps"] >= 23 / 16
    assert np.isclose(c["speedup_limit"], c["tau"] * c["plain_step_s"] / (split["draft"] + split["verify"]))
    assert np.isclose(c["efficiency_vs_limit"], c["lockstep"] * c["step_efficiency"])
    assert np.isclose(c["decode_speedup"], c["plain_decode_s"] / c["dflash_decode_s"])
    assert np.isclose(c["runs_s"], c["dflash_step_s"] - split["step_loop"])
    assert row["machine"]["backend"] == "cpu" and row["dtype"] == "float32"
    args = benchmark.parse_args(argv[:-1])
    synthetic_benchmark.print_text([row], args, row["replay"], row["dtype"], row["machine"])
    text = capsys.readouterr().out
    assert "acceptance is SIMULATED" in text and "= draft" in text and "+ verify" in text and "+ rest" in text
    assert "load average" in text and "continuous batching, batch 2, context 48: 3 requests through 2 slots" in text


@pytest.mark.slow  # 23 s of end-to-end sweep; the synthetic CLI's report and identities stay in the fast suite
def test_context_sweep_reports_each_context_and_attention(capsys):
    """``python -m infer.context_sweep``: one row per (context, attention) at one fixed bucket."""
    from infer import context_sweep

    argv = ["--context", "32,96", "--bucket", "256", "--block-size", "4", "--iters", "1", "--repeats", "1", "--json"]
    assert context_sweep.main(argv) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [(r["context"], r["attention"]) for r in rows] == [(32, "auto"), (32, "reference"), (96, "auto"),
                                                              (96, "reference")]
    assert all(r["bucket"] == 256 and r["plain_step_s"] > 0 and r["draft_s"] > 0 and r["verify_s"] > 0 for r in rows)
    with pytest.raises(SystemExit):
        context_sweep.main(["--context", "300", "--bucket", "256"])
    assert "too small" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        context_sweep.main(["--context", "32", "--block-size", "32"])
    assert "--block-size must be in [2, 16]" in capsys.readouterr().err


def test_cli_synthetic_rejects_bad_options(capsys):
    from infer import benchmark

    for argv, msg in ((["--replay-tau", "4", "--replay-histogram", "x"], "not both"),
                      (["--replay-tau", "20"], "replay tau must be in"),
                      (["--batch-size", "0"], "positive integers"),
                      (["--temperature", "0.7"], "--temperature 0"),
                      (["--target", "x"], "builds its own target"),
                      (["--verify-lengths", "4,8,16"], "--verify-lengths does not apply"),
                      (["--block-size", "17"], "--block-size must be in"),
                      (["--batch-size", "1,4", "--continuous-requests", "4"], "more requests than --batch-size 4"),
                      (["--continuous-requests", "8", "--no-timing-split"], "drop --no-timing-split")):
        with pytest.raises(SystemExit):
            benchmark.main(["--synthetic", "tiny", *argv])
        assert msg in capsys.readouterr().err, argv
    with pytest.raises(SystemExit):
        benchmark.main(["--synthetic", "nope"])
    assert "unknown synthetic preset" in capsys.readouterr().err


def test_synthetic_options_need_synthetic(capsys):
    from infer import benchmark

    with pytest.raises(SystemExit):
        benchmark.main(["--replay-tau", "4", "--context", "64", "--continuous-requests", "8"])
    assert "--replay-tau, --context, --continuous-requests only apply to the synthetic benchmark" in capsys.readouterr().err


def test_a_mismatch_is_a_bug_only_where_the_choice_was_clear(capsys, monkeypatch):
    """A replayed output that differs from plain decoding: an error (exit 1) where the target's top-2 logit gap was
    clear, a warning at a tie to rounding (float32 too: random logits over a large vocabulary tie to the last bit),
    in the continuous run as in the closed one (the gap is measured there too)."""
    from dflash_jax import decode
    from infer import benchmark
    from infer import synthetic_benchmark

    def weights(dtype):  # a target whose parameters are in ``dtype``
        return types.SimpleNamespace(params={"w": np.zeros(1, dtype)})

    synthetic_benchmark._report_mismatch("m", 0.0, weights(np.float32))
    assert "warning: m: a near-tie" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        synthetic_benchmark._report_mismatch("m", 0.5, weights(np.float32))
    assert "error: m: a bug" in capsys.readouterr().err
    synthetic_benchmark._report_mismatch("m", 0.5, weights(jnp.bfloat16))
    assert "warning" in capsys.readouterr().err
    real = decode.continuous_generate

    def flipped(target, draft, *a, **k):  # the replayed run's request 1 gets another 5th token: a clear mismatch
        rows = real(target, draft, *a, **k)
        if draft is not None:
            ids = list(rows[1].output_ids)
            j = rows[1].prompt_length + 4
            ids[j] = (ids[j] + 1) % target.config.vocab_size
            rows[1] = dataclasses.replace(rows[1], output_ids=ids)
        return rows

    monkeypatch.setattr(decode, "continuous_generate", flipped)
    argv = ["--synthetic", "tiny", "--replay-tau", "4", "--context", "48", "--batch-size", "2", "--max-new-tokens",
            "12", "--repeats", "1", "--continuous-requests", "3", "--json"]
    with pytest.raises(SystemExit):
        benchmark.main(argv)
    err = capsys.readouterr().err
    assert "first request 1, generated token 4 (target's top-2 logit gap" in err and "error:" in err, err
