"""``--block-size auto``: the per-position acceptance estimate, the expected tau, the choice by tokens per second,
and a CLI run that probes, says what it chose, and stays lossless."""
from __future__ import annotations

import json

import numpy as np
import pytest

from dflash_jax.decode import load_policy as lp
from infer import auto_block as ab
from pairs import pair_dirs as make_pair_dirs


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return make_pair_dirs(str(tmp_path_factory.mktemp("pair")))


def test_position_acceptance_counts_censored_steps():
    """Block 4: a length-2 step accepts token 1 and rejects token 2; a length-4 step (the whole block) accepts
    1..3; a block-2 run says nothing past token 1."""
    p = ab.position_acceptance([([2, 4], 4), ([2, 2], 2)], 4)
    prior = lp.PRIOR * lp.PRIOR_WEIGHT
    assert p[0] == pytest.approx((4 + prior) / (4 + lp.PRIOR_WEIGHT))  # all 4 steps accepted token 1
    assert p[1] == pytest.approx((1 + prior) / (2 + lp.PRIOR_WEIGHT))  # 2 judged (block-4 run), 1 accepted
    assert p[2] == pytest.approx((1 + prior) / (1 + lp.PRIOR_WEIGHT))  # judged once, accepted
    assert ab.position_acceptance([], 3) == [lp.PRIOR, lp.PRIOR]  # no data: the prior


def test_expected_tau_and_choice():
    p = [0.9] * 15
    assert ab.expected_tau(p, 1) == 1.0
    assert ab.expected_tau(p, 4) == pytest.approx(1 + 0.9 + 0.81 + 0.729)
    tau = {k: ab.expected_tau(p, k) for k in (4, 8, 16)}
    # a verify that costs the same at every block: the whole block; one whose cost grows with it: a short one
    assert ab.choose({4: 1.0, 8: 1.0, 16: 1.0}, tau) == 16
    assert ab.choose({4: 1.0, 8: 2.0, 16: 4.0}, tau) == 4
    assert ab.choose({4: 1.0, 8: 1.0, 16: 1.0}, {4: 1.0, 8: 1.0, 16: 1.0}) == 4  # ties: the shorter block
    assert ab.candidates(16) == (4, 8, 16) and ab.candidates(10) == (4, 8, 10) and ab.candidates(3) == (3,)
    # probed only with a choice to make and a run long enough to pay for the probes
    assert ab.worth_probing(16, ab.MIN_PROBED_TOKENS) and not ab.worth_probing(16, ab.MIN_PROBED_TOKENS - 1)
    assert not ab.worth_probing(4, 1000)


def test_probes_decode_a_bounded_spread_subset(monkeypatch):
    """200 prompts: every probe decodes PROBE_ROWS of them, spread from the first to the last, not the whole batch."""
    import types

    from dflash_jax import decode

    assert ab.probe_prompts(list(range(10)), 4) == [0, 3, 6, 9] and ab.probe_prompts([1, 2], 4) == [1, 2]
    seen = []

    def probe(target, draft, prompts, max_new_tokens, **kw):
        seen.append(prompts)
        return [types.SimpleNamespace(wall_time_s=1e-3 * max_new_tokens, acceptance_lengths=[2] * 8)] * len(prompts)

    monkeypatch.setattr(decode, "speculative_generate", probe)
    prompts = [[i, 1, 2] for i in range(200)]
    config = types.SimpleNamespace(block_size=8, verify_length=lambda k: k)
    choice = ab.choose_block_size(None, types.SimpleNamespace(config=config), prompts, {"max_new_tokens": 128})
    assert seen and all(p == ab.probe_prompts(prompts) for p in seen) and len(seen[0]) == ab.PROBE_ROWS
    assert seen[0][0] == prompts[0] and seen[0][-1] == prompts[-1]
    assert choice.probe_rows == ab.PROBE_ROWS and f"probe of {ab.PROBE_ROWS} prompts" in choice.describe()


def test_each_block_is_judged_by_its_own_probes(monkeypatch):
    """A draft trained at 8 that accepts whole blocks at 8 and one token at 4 (its acceptance depends on the block
    it drafts): pooled over the probes, block 4's steps would say block 8's second token is rejected; each block's
    own probes choose 8 at equal costs."""
    import types

    from dflash_jax import decode

    def probe(target, draft, prompts, max_new_tokens, block_size, **kw):
        return [types.SimpleNamespace(wall_time_s=1e-3 * max_new_tokens,
                                      acceptance_lengths=[8 if block_size == 8 else 2] * 12)] * len(prompts)

    monkeypatch.setattr(decode, "speculative_generate", probe)
    config = types.SimpleNamespace(block_size=8, verify_length=lambda k: k)
    choice = ab.choose_block_size(None, types.SimpleNamespace(config=config), [[1, 2, 3]], {"max_new_tokens": 128})
    assert choice.block_size == 8 and choice.expected_tau[8] > 7 and choice.expected_tau[4] < 2.1


def test_a_dspark_block_verifies_one_more_token(monkeypatch):
    """A DSpark block of k slots verifies k + 1 tokens: probes accepting everything (acceptance k + 1) give an
    expected tau above k for every block (counting k verified tokens would cap it at k)."""
    import types

    from dflash_jax import decode

    def probe(target, draft, prompts, max_new_tokens, block_size, **kw):
        return [types.SimpleNamespace(wall_time_s=1e-3 * max_new_tokens, acceptance_lengths=[block_size + 1] * 8)
                ] * len(prompts)

    monkeypatch.setattr(decode, "speculative_generate", probe)
    config = types.SimpleNamespace(block_size=8, verify_length=lambda k: k + 1)
    choice = ab.choose_block_size(None, types.SimpleNamespace(config=config), [[1, 2, 3]], {"max_new_tokens": 128})
    assert all(tau > k for k, tau in choice.expected_tau.items()), choice.expected_tau


def test_generate_block_size_auto_follows_the_load_and_stays_lossless(pair_dirs, capsys):
    from infer import generate as g

    tdir, ddir, _ = pair_dirs
    code = g.main(["--target", tdir, "--draft", ddir, "--prompt-ids", "5,17,3", "--max-new-tokens",
                   str(ab.MIN_PROBED_TOKENS), "--ignore-eos", "--baseline", "--json"])  # auto: the default
    out = capsys.readouterr()
    row = json.loads(out.out)
    assert code == 0 and row["identical_to_baseline"]
    # the engine's block policy (one row: bucket 1, one block for the whole run; 1 = plain steps)
    line = next(x for x in out.err.splitlines() if x.startswith("--block-size auto: block per bucket"))
    assert line.endswith(f"1 rows: {line.split()[-1]}") and "--block-size auto chose" not in out.err
    assert len(set(row["verify_lengths"])) == 1 and row["verify_lengths"][0] in lp.candidates(8)  # the draft: 8
    code = g.main(["--target", tdir, "--draft", ddir, "--prompt-ids", "5,17,3", "--max-new-tokens",
                   str(ab.MIN_PROBED_TOKENS - 1), "--ignore-eos", "--json"])
    out = capsys.readouterr()
    assert code == 0 and "--block-size auto chose" not in out.err  # too short to probe: the trained block
    assert max(json.loads(out.out)["verify_lengths"]) == 8
    with pytest.raises(SystemExit):
        g.parse_args(["--block-size", "big"])
    assert "expected an integer or auto" in capsys.readouterr().err


def test_benchmark_json_reports_the_choice(pair_dirs, capsys, tmp_path):
    from infer import benchmark as b

    tdir, ddir, _ = pair_dirs
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": [5, 17, 3]}) + "\n")
    code = b.main(["--target", tdir, "--draft", ddir, "--prompts-file", str(prompts), "--max-new-tokens",
                   str(ab.MIN_PROBED_TOKENS), "--json", "--ignore-eos", "--no-timing-split", "--repeats", "1"])
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    choice = summary["block_choice"]
    assert code == 0 and summary["identical"] and summary["block_size"] == choice["chosen"]
    rates = {int(k): v for k, v in choice["expected_tokens_per_s"].items()}
    assert choice["chosen"] == max(sorted(rates), key=rates.get)
    assert all(len(p) == int(k) - 1 and np.all(np.asarray(p) <= 1.0) for k, p in choice["position_acceptance"].items())
