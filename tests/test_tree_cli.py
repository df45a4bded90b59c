"""``--tree-budget N`` in ``python -m infer.generate`` and ``python -m infer.benchmark`` (in-process, the tiny
saved pair of test_infer_cli.py): lossless, verify lengths N + 1, the benchmark's tau is the tree's."""
from __future__ import annotations

import json

import numpy as np
import pytest

import dflash_jax as dj
from pairs import pair_dirs as make_pair_dirs


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return make_pair_dirs(str(tmp_path_factory.mktemp("pair")))


def test_generate_tree_budget_json(pair_dirs, capsys):
    from infer import generate as g

    tdir, ddir, target = pair_dirs
    argv = ["--target", tdir, "--draft", ddir, "--prompt-ids", "5,17,3", "--prompt-ids", "9", "--max-new-tokens",
            "12", "--ignore-eos", "--tree-budget", "6"]
    assert g.main(argv + ["--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    plain = dj.generate(target, [[5, 17, 3], [9]], max_new_tokens=12, stop_token_ids=[])
    assert [r["output_ids"] for r in rows] == [p.output_ids for p in plain]
    assert all(set(r["verify_lengths"]) == {7} and len(r["acceptance_lengths"]) == len(r["verify_lengths"])
               for r in rows)
    assert g.main(argv) == 0 and "tree verify: 6 nodes, 7 tokens verified per step" in capsys.readouterr().out


def test_generate_tree_budget_refused(pair_dirs, capsys):
    from infer import generate as g

    tdir, ddir, _ = pair_dirs
    for extra, match in ((["--tree-budget", "-2"], "--tree-budget must be an integer"),
                         (["--tree-budget", "4", "--verify-lengths", "2,4"],
                          "--tree-budget cannot be combined with --verify-lengths")):
        with pytest.raises(SystemExit) as e:
            g.main(["--target", tdir, "--draft", ddir, "--prompt-ids", "1,2", "--max-new-tokens", "4"] + extra)
        assert e.value.code == 2 and match in capsys.readouterr().err


def test_benchmark_tree_summary(pair_dirs, capsys, tmp_path):
    from infer import benchmark as b

    tdir, ddir, _ = pair_dirs
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):"}) + "\n" + json.dumps({"prompt_ids": [9, 4]}) + "\n")
    argv = ["--target", tdir, "--draft", ddir, "--prompts-file", str(prompts), "--max-new-tokens", "10",
            "--ignore-eos", "--no-timing-split", "--repeats", "1", "--tree-budget", "6"]
    assert b.main(argv + ["--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    rows, summary = lines[:-1], lines[-1]
    assert summary["identical"] is True and summary["tree_budget"] == 6 and summary["verified_tokens_per_step"] == 7
    assert np.isclose(summary["tau"], np.mean([a for r in rows for a in r["acceptance_lengths"]]))
    assert sum(summary["acceptance_histogram"]) == sum(len(r["acceptance_lengths"]) for r in rows)
    assert b.main(argv) == 0 and "tree verify: 6 nodes, 7 tokens verified per step" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        b.main(["--synthetic", "tiny", "--tree-budget", "4"])
    assert "--tree-budget does not apply to --synthetic" in capsys.readouterr().err
