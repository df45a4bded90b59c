"""``python -m infer.generate`` and ``python -m infer.benchmark`` on a tiny saved pair (in-process)."""
from __future__ import annotations

import json
import re
import types

import numpy as np
import pytest

import dflash_jax as dj
from pairs import pair_dirs as make_pair_dirs


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return make_pair_dirs(str(tmp_path_factory.mktemp("pair")))


def run(module, argv, capsys):
    code = module.main(argv)
    return code, capsys.readouterr()


@pytest.mark.parametrize("scan", [(), ("--scan-layers",)])
def test_generate_json_prompt_ids(pair_dirs, capsys, scan):
    """Adaptive verify's rows and tokens; ``--scan-layers`` (the target's layers as one scan): the same tokens."""
    from infer import generate as g

    tdir, ddir, target = pair_dirs
    code, out = run(g, ["--target", tdir, "--draft", ddir, "--prompt-ids", "5,17,3", "--prompt-ids", "9",
                        "--max-new-tokens", "12", "--temperature", "0", "--ignore-eos", "--json",
                        "--verify-lengths", "2,4,8", "--verify-threshold", "0.1", *scan], capsys)
    assert code == 0 and ("layers scanned" in out.err) == bool(scan)
    rows = [json.loads(line) for line in out.out.strip().splitlines()]
    assert len(rows) == 2
    assert all(len(r["verify_lengths"]) == len(r["acceptance_lengths"]) for r in rows)
    plain = dj.generate(target, [[5, 17, 3], [9]], max_new_tokens=12, stop_token_ids=[])
    for row, ref in zip(rows, plain):
        assert row["output_ids"] == ref.output_ids
        assert len(row["output_ids"]) == len(ref.output_ids)
        assert all(1 <= a <= 8 for a in row["acceptance_lengths"])
        assert row["tokens_per_second"] > 0
        assert row["dtype"] == "float32"  # --dtype auto: float32 on a CPU


def test_generate_text_baseline_and_stream(pair_dirs, capsys):
    from infer import generate as g

    tdir, ddir, _ = pair_dirs
    code, out = run(g, ["--target", tdir, "--draft", ddir, "--prompt", "def f(x):", "--max-new-tokens", "6",
                        "--baseline"], capsys)
    assert code == 0 and "speedup" in out.out and "identical output: yes" in out.out and "tau" in out.out
    code, out = run(g, ["--target", tdir, "--draft", ddir, "--prompt", "def f(x):", "--max-new-tokens", "6",
                        "--stream"], capsys)
    assert code == 0 and out.out.startswith("def f(x):") and "time to first token" in out.out
    code, out = run(g, ["--target", tdir, "--draft", ddir, "--prompt", "def f(x):", "--max-new-tokens", "6",
                        "--stream", "--json", "--ignore-eos"], capsys)
    row = json.loads(out.out)
    assert code == 0 and 0 < row["time_to_first_token_s"] < row["wall_time_s"]  # compile excluded, prefill not
    code, out = run(g, ["--target", tdir, "--draft", ddir, "--prompt", "def f(x):", "--max-new-tokens", "6",
                        "--baseline", "--temperature", "1"], capsys)
    assert code == 0 and "lossless means the same distribution" in out.out


def test_generate_demo_shows_plain_beside_dflash(capsys):
    """No --target (the README's first command): plain decoding runs beside DFlash on the embedded demo pair,
    with both speeds, the speedup and "identical output: yes"; --no-baseline skips it."""
    from infer import generate as g

    code, out = run(g, ["--max-new-tokens", "12"], capsys)
    assert code == 0 and "tau" in out.out
    line = next(x for x in out.out.splitlines() if x.startswith("--- plain decoding"))
    assert "speedup" in line and "identical output: yes" in line, line
    assert "exclude one-time setup" in out.err
    code, out = run(g, ["--max-new-tokens", "12", "--no-baseline"], capsys)
    assert code == 0 and "tau" in out.out and "plain decoding" not in out.out


@pytest.mark.parametrize("argv,match", [
    (["--prompt-ids", "1,x"], "comma-separated integers"),
    (["--prompt-ids", "1,2", "--temperature", "-1"], "temperature"),
    (["--prompt-ids", "1,2", "--block-size", "64"], "block_size"),
    (["--prompt-ids", "1,2", "--verify-lengths", "2,x"], "comma-separated integers"),
    (["--prompt-ids", "1,2", "--verify-lengths", "2,64"], "--verify-lengths must be in [1, 8]"),
    (["--prompt-ids", "1,99999"], "outside the vocabulary"),
    (["--prompts-file", "/no/such/file"], "does not exist"),
])
def test_generate_bad_input(pair_dirs, capsys, argv, match):
    from infer import generate as g

    tdir, ddir, _ = pair_dirs
    with pytest.raises(SystemExit) as e:
        g.main(["--target", tdir, "--draft", ddir, "--max-new-tokens", "4"] + argv)
    assert e.value.code == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize("cli,argv,match", [
    ("generate", ["--prompt-ids", "1,x"], "comma-separated integers"),
    ("generate", ["--prompts-file", "{bad}"], "prompt must be a string"),
    ("generate", ["--verify-lengths", "4,x"], "comma-separated integers"),
    ("benchmark", ["--prompts-file", "{bad}"], "prompt must be a string"),
    ("benchmark", ["--plot", "/nonexistent/plot.png"], "does not exist"),
    ("benchmark", ["--verify-lengths", ""], "comma-separated integers"),
    ("benchmark", ["--num-prompts", "0"], "--num-prompts must be >= 1"),
])
def test_command_line_errors_come_before_loading(cli, argv, match, tmp_path, monkeypatch, capsys):
    """What the command line alone can check is refused before any model loads (minutes for a 30B target)."""
    import importlib

    mod = importlib.import_module(f"infer.{cli}")
    monkeypatch.setattr(mod, "load_models", lambda *a: pytest.fail("models loaded before the options were checked"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": 3}\n')
    with pytest.raises(SystemExit) as e:
        mod.main([a.replace("{bad}", str(bad)) for a in argv])
    assert e.value.code == 2 and match in capsys.readouterr().err


def _config_copy(src: str, dst, **changes) -> str:
    """``dst`` holding ``src``'s config.json with ``changes`` (no weights: it must be refused before they load)."""
    dst.mkdir()
    with open(f"{src}/config.json") as f:
        (dst / "config.json").write_text(json.dumps({**json.load(f), **changes}))
    return str(dst)


@pytest.mark.parametrize("case", ["empty", "ids", "chat", "tree", "vocab", "blank", "utf8"])
def test_what_the_configs_can_check_is_refused_before_loading(case, pair_dirs, tmp_path, monkeypatch, capsys):
    """Prompts and pairings that the config.json files and tokenizer files alone rule out: one line, exit 2, before
    any weight loads (30-60 s for a large target)."""
    from infer import generate as g

    tdir, ddir, _ = pair_dirs
    for name in ("load_target", "load_draft"):
        monkeypatch.setattr(dj, name, lambda *a, **k: pytest.fail("weights loaded before the configs were checked"))
    (tmp_path / "blank.txt").write_text("def f(x):\n\nimport os\n")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\n")
    narrow = {"layer_types": ["sliding_attention"] * 4, "sliding_window": 2}
    argv, match = {
        "empty": (["--prompt", ""], "prompt 0 is empty"),
        "ids": (["--prompt-ids", "1,2", "--prompt-ids", "5,320"],
                "prompt 1 has token ids outside the vocabulary [0, 320): [320]"),
        "chat": (["--prompt", "x", "--chat"], "prompt 0 needs a chat template (--chat)"),
        "tree": (["--target", _config_copy(tdir, tmp_path / "t", **narrow), "--prompt-ids", "1,2", "--tree-budget",
                  "4"], "sliding windows >= the block size 8"),
        "vocab": (["--draft", _config_copy(ddir, tmp_path / "d", vocab_size=321), "--prompt-ids", "1,2"],
                  "draft vocab_size 321 != the target's vocab_size 320"),
        "blank": (["--prompts-file", str(tmp_path / "blank.txt")], "line 2 is blank"),
        "utf8": (["--prompts-file", str(tmp_path / "latin1.txt")], "is not UTF-8 text"),
    }[case]
    with pytest.raises(SystemExit) as e:
        g.main(["--target", tdir, "--draft", ddir, "--max-new-tokens", "4"] + argv)  # the last --target wins
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith("error: ") and "\n" not in err and match in err, err


def test_generate_interrupted_says_so_in_one_line(monkeypatch, capsys):
    """Ctrl-C anywhere in a run (here: while the models load): "interrupted" and exit code 130, no traceback."""
    from infer import generate as g

    def interrupt(*a):
        raise KeyboardInterrupt

    monkeypatch.setattr(g, "load_models", interrupt)
    assert g.main(["--prompt-ids", "1,2"]) == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_generate_missing_target(capsys, tmp_path):
    from infer import generate as g

    with pytest.raises(SystemExit):
        g.main(["--target", str(tmp_path / "nothing"), "--prompt-ids", "1"])
    assert "not a directory" in capsys.readouterr().err


def test_benchmark_json_summary(pair_dirs, capsys, tmp_path):
    from infer import benchmark as b

    tdir, ddir, _ = pair_dirs
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):"}) + "\n" + json.dumps({"prompt": "import os"}) + "\n")
    png = tmp_path / "report.png"
    code, out = run(b, ["--target", tdir, "--draft", ddir, "--prompts-file", str(prompts), "--max-new-tokens", "10",
                        "--json", "--ignore-eos", "--no-timing-split", "--repeats", "2", "--plot", str(png),
                        "--verify-lengths", "2,8", "--verify-threshold", "0.1"], capsys)
    assert code == 0 and png.read_bytes()[:4] == b"\x89PNG"
    lines = [json.loads(x) for x in out.out.strip().splitlines()]
    rows, summary = lines[:-1], lines[-1]
    assert [r["index"] for r in rows] == [0, 1] and summary["identical"] is True
    for key in ("tau", "speedup", "plain_tokens_per_s", "dflash_tokens_per_s", "acceptance_histogram"):
        assert key in summary
    assert sum(summary["acceptance_histogram"]) == sum(len(r["acceptance_lengths"]) for r in rows)
    assert np.isclose(summary["tau"], np.mean([a for r in rows for a in r["acceptance_lengths"]]))
    assert summary["plain_step_s"] > 0 and summary["dflash_step_s"] > 0
    # adaptive verify: the chosen lengths, and the fixed block side by side
    assert sum(summary["verify_length_histogram"].values()) == sum(summary["acceptance_histogram"])
    assert set(summary["verify_length_histogram"]) <= {"2", "8"} and summary["adaptive_vs_fixed"] > 0
    assert all(r["fixed_block_identical"] for r in rows)
    # per block position: among the steps that verified it (a step verifying 2 tokens says nothing of position 5)
    acc = np.array([a for r in rows for a in r["acceptance_lengths"]])
    ver = np.array([v for r in rows for v in r["verify_lengths"]])
    for k, rate in enumerate(summary["acceptance_rate_per_position"], start=1):
        seen = ver > k
        assert (rate is None) == (not seen.any()) and (rate is None or np.isclose(rate, (acc[seen] > k).mean()))
    m = summary["machine"]  # where it ran and how loaded the machine was: speedups compare at equal load only
    assert m["backend"] == "cpu" and m["cpu_count"] >= 1 and len(m["load_average"]) == 3


def test_benchmark_fastest_of_repeats():
    """An untimed warm-up run, then each method's fastest run counts; runs that disagree are an error."""
    from infer import timing

    def results(*walls, ids=(1, 2)):
        it = iter(walls)
        return lambda: types.SimpleNamespace(wall_time_s=next(it), output_ids=list(ids))

    plain, spec = timing.fastest(3, results(0.1, 3.0, 1.0, 2.0), results(0.1, 0.5, 0.7, 0.2))  # first: warm-up
    assert (plain.wall_time_s, spec.wall_time_s) == (1.0, 0.2)
    flips = iter([[1, 2], [1, 2], [1, 3]])
    odd = lambda: types.SimpleNamespace(wall_time_s=1.0, output_ids=next(flips))  # noqa: E731
    with pytest.raises(ValueError, match="DFlash decoding gave different outputs"):
        timing.fastest(2, results(1.0, 1.0, 1.0), odd)


def test_benchmark_rejects_zero_repeats(capsys):
    from infer import benchmark as b

    with pytest.raises(SystemExit):
        b.main(["--repeats", "0"])
    assert "--repeats must be >= 1" in capsys.readouterr().err


def test_benchmark_forward_timing(pair_dirs):
    """The step split's draft / verify timings: one jitted loop of dependent forwards per block size."""
    import dflash_jax as dj
    from infer import benchmark as b

    tdir, ddir, _ = pair_dirs
    target, draft = dj.load_target(tdir), dj.load_draft(ddir)
    t = b.time_forwards(target, draft, block_sizes=(2,), context=16, iters=2, repeats=1)
    assert set(t) == {"draft_forward_s_block2", "verify_forward_s_block2", "verify_forward_s_block1"}
    assert all(0 < v < 10 for v in t.values())


def test_auto_dtype_is_the_checkpoints_on_accelerators(pair_dirs, tmp_path, monkeypatch):
    import shutil

    import jax

    from dflash_jax.checkpoints import auto_dtype

    d = tmp_path / "t"
    shutil.copytree(pair_dirs[0], d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}))
    assert auto_dtype(str(d)) == "float32"  # CPU: bfloat16 would be emulated
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert auto_dtype(str(d)) == "bfloat16"
    (d / "config.json").write_text(json.dumps({**cfg, "dtype": "float16"}))
    assert auto_dtype(str(d)) == "float16"
    (d / "config.json").write_text(json.dumps(cfg))
    assert auto_dtype(str(d)) == "float32"  # nothing said: float32


def test_benchmark_reports_first_mismatch_and_logit_gap(pair_dirs, capsys, tmp_path, monkeypatch):
    """A DFlash output that differs from plain decoding is reported with its first differing token and the
    target's top-2 logit gap there (one forward on the plain output up to it), in JSON and in text."""
    from dflash_jax import decode as S
    from infer import benchmark as b

    tdir, ddir, target = pair_dirs
    real = S.speculative_generate

    def flipped(target, draft, *a, **k):  # DFlash's token 3 for prompt [5, 17, 3] replaced: a forced mismatch
        out = real(target, draft, *a, **k)
        for r in out if draft is not None else ():  # (plain decoding calls this too, with no draft)
            if r.output_ids[:r.prompt_length] == [5, 17, 3]:
                r.output_ids[r.prompt_length + 3] = (r.output_ids[r.prompt_length + 3] + 1) % 300
        return out

    monkeypatch.setattr(S, "speculative_generate", flipped)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": [5, 17, 3]}) + "\n" + json.dumps({"prompt_ids": [9, 4]}) + "\n")
    argv = ["--target", tdir, "--draft", ddir, "--prompts-file", str(prompts), "--max-new-tokens", "8",
            "--ignore-eos", "--no-timing-split", "--repeats", "1"]
    code, out = run(b, argv + ["--json"], capsys)
    assert code == 0
    lines = [json.loads(x) for x in out.out.strip().splitlines()]
    (bad, good), summary = lines[:-1], lines[-1]
    assert good["identical"] and good["first_mismatch"] is None
    assert summary["identical"] is False and summary["num_identical"] == 1
    plain = dj.generate(target, [[5, 17, 3]], max_new_tokens=8, stop_token_ids=[])[0].output_ids
    logits = dj.target_logits(target, np.array([plain[:6]]))[0, -1].astype(np.float64)
    top2 = np.sort(logits)[-2:]
    m = bad["first_mismatch"]
    assert not bad["identical"] and m["position"] == 3
    assert m["plain_token"] == plain[6] == int(logits.argmax()) and m["dflash_token"] == (plain[6] + 1) % 300
    # the benchmark ran the same forward (target_logits) on the same tokens: the same rounding, the same gaps
    assert m["top2_logit_gap"] == top2[1] - top2[0] and m["top2_logit_gap"] > 0
    assert m["dflash_token_gap"] == top2[1] - logits[m["dflash_token"]]
    code, out = run(b, argv, capsys)
    assert code == 0
    assert f"prompt 0: first difference at generated token 3 (plain {plain[6]}, DFlash {(plain[6] + 1) % 300})" \
        in out.out and f"top-2 logit gap there {m['top2_logit_gap']:.4g}" in out.out
    assert "prompt 1: first difference" not in out.out


def test_generate_streams_a_prompts_file_through_slots(pair_dirs, capsys, tmp_path):
    """The outside check of continuous batching: a prompts file with per-row budgets (and a row with its own
    sampling settings) through ``--max-batch 2``: lines in input order with their index, every greedy row equal to
    plain decoding of its prompt alone and its acceptance lengths those of its prompt decoded alone (same block)."""
    from infer import generate as g

    tdir, ddir, target = pair_dirs
    draft = dj.load_draft(ddir)
    rows = [([5, 17, 3], 9), ([9], 2), ([4, 4, 8, 1], 14), ([7, 2], 5), ([3, 3], 11)]
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt_ids": p, "max_new_tokens": n}) + "\n" for p, n in rows)
                 + json.dumps({"prompt_ids": [6, 1], "max_new_tokens": 4, "temperature": 0.8, "top_k": 5,
                               "seed": 3}) + "\n")
    code, out = run(g, ["--target", tdir, "--draft", ddir, "--prompts-file", str(f), "--max-batch", "2",
                        "--block-size", "4", "--ignore-eos", "--json", "--no-baseline"], capsys)
    assert code == 0
    lines = [json.loads(x) for x in out.out.strip().splitlines()]
    assert [r["index"] for r in lines] == list(range(len(rows) + 1))
    for row, (p, n) in zip(lines, rows):
        alone = dj.generate(target, [p], max_new_tokens=n, stop_token_ids=[])[0]
        spec = dj.speculative_generate(target, draft, [p], max_new_tokens=n, block_size=4, stop_token_ids=[])[0]
        assert row["output_ids"] == alone.output_ids and row["num_generated"] == n
        assert row["acceptance_lengths"] == spec.acceptance_lengths
        assert row["queue_time_s"] >= 0 and row["wall_time_s"] > 0
    sampled = lines[-1]
    assert sampled["num_generated"] == 4  # its own budget; its tokens: test_continuous (the seed's own stream)
    assert "2 slots" in out.err and "programs compiled" in out.err
    # each row's speed is its own (its tokens over its admission-to-last-token time), not the run's wall time (a
    # queued row's queue + own time fits in the run's); the run's throughput is said once
    run_wall = float(re.search(r"slots in ([\d.]+) s", out.err).group(1))
    for row in lines:
        assert row["tokens_per_second"] == pytest.approx(row["num_generated"] / row["wall_time_s"])
        assert row["queue_time_s"] + row["wall_time_s"] <= run_wall + 0.01
    assert lines[-1]["queue_time_s"] > 0
    total = sum(r["num_generated"] for r in lines)
    assert f"{total} tokens: " in out.err and "tokens/s overall" in out.err


def test_prompts_file_settings_are_checked_before_loading(tmp_path, monkeypatch, capsys):
    from infer import generate as g

    monkeypatch.setattr(g, "load_models", lambda *a: pytest.fail("models loaded before the options were checked"))
    for row, match in (({"prompt": "x", "max_new_tokens": "9"}, "max_new_tokens must be an integer"),
                       ({"prompt": "x", "top_p": 1.5}, "prompt 0: top_p must be in (0, 1]"),
                       ({"prompt": "x", "max_new_tokens": 0}, "prompt 0: max_new_tokens must be >= 1")):
        f = tmp_path / "p.jsonl"
        f.write_text(json.dumps(row) + "\n")
        with pytest.raises(SystemExit):
            g.main(["--prompts-file", str(f)])
        assert match in capsys.readouterr().err
    with pytest.raises(SystemExit):
        g.main(["--prompt", "x", "--max-batch", "0"])
    assert "--max-batch must be >= 1" in capsys.readouterr().err


def test_benchmark_compares_continuous_static_and_one_at_a_time(pair_dirs, capsys, tmp_path):
    """``--max-batch``: six runs (three ways x plain / DFlash) of one workload, identical outputs, and the ratios."""
    from infer import benchmark as b

    tdir, ddir, _ = pair_dirs
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt_ids": [i + 1, 5, 7]}) + "\n" for i in range(5)))
    code, out = run(b, ["--target", tdir, "--draft", ddir, "--prompts-file", str(f), "--max-batch", "2",
                        "--mixed-budgets", "2,12", "--ignore-eos", "--block-size", "4", "--json"], capsys)
    assert code == 0
    lines = [json.loads(x) for x in out.out.strip().splitlines()]
    rows, summary = lines[:-1], lines[-1]
    assert {(r["way"], r["method"]) for r in rows} == {(w, m) for w in ("continuous", "static", "one_at_a_time")
                                                       for m in ("plain", "dflash")}
    assert summary["identical"] is True and summary["num_prompts"] == 5 and 2 <= summary["budgets"]["min"]
    assert summary["budgets"]["max"] <= 12 and summary["tau"] >= 1 and summary["speedup"] > 0
    assert set(summary["continuous_vs_static"]) == {"plain", "dflash"}
    for r in rows:
        assert r["tokens"] == rows[0]["tokens"] and 0 < r["occupancy"] <= 1 and r["p90_request_s"] > 0
        assert r["slots"] == (1 if r["way"] == "one_at_a_time" else 2)


def test_benchmark_compares_paged_and_slots_at_one_memory_budget(pair_dirs, capsys, tmp_path):
    """``--kv-cache-memory``: every run pages in that pool and a fourth way, ``slots``, holds as many unpaged
    max-length rows as the same memory fits; all eight outputs identical, rows in flight reported."""
    from infer import benchmark as b

    tdir, ddir, _ = pair_dirs
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt_ids": [i + 1, 5, 7]}) + "\n" for i in range(5)))
    code, out = run(b, ["--target", tdir, "--draft", ddir, "--prompts-file", str(f), "--max-batch", "3",
                        "--mixed-budgets", "2,40", "--ignore-eos", "--block-size", "4", "--kv-cache-memory", "200KB",
                        "--json"], capsys)
    assert code == 0, out.err
    lines = [json.loads(x) for x in out.out.strip().splitlines()]
    rows, summary = lines[:-1], lines[-1]
    assert {r["way"] for r in rows} == {"continuous", "static", "one_at_a_time", "slots"}
    assert summary["identical"] is True
    slots = {r["method"]: r for r in rows if r["way"] == "slots"}
    assert all(r["slots"] >= 1 and 0 < r["rows_in_flight"] <= r["slots"] for r in slots.values())
    assert set(summary["paged_vs_slots"]) == {"plain", "dflash"}


def test_cache_memory_and_page_flags(capsys):
    """``--kv-cache-memory``: bytes with a unit or a fraction of the free device memory (which a CPU does not
    report: a clear error); ``--page-size`` below 0 refused (the serving benchmark's too, and its ``--turn-ms`` of 0),
    left out: the platform's."""
    import argparse

    from infer.flags import memory_arg, paging_kwargs

    assert memory_arg("2GiB") == ("bytes", 2 * 2 ** 30) and memory_arg("512MB") == ("bytes", 512e6)
    assert memory_arg("3e9") == ("bytes", 3e9) and memory_arg("0.9") == ("fraction", 0.9)
    for bad in ("lots", "-1GB", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            memory_arg(bad)
    args = argparse.Namespace(page_size=16, kv_cache_memory=("bytes", 1e6))
    assert paging_kwargs(args) == {"page": 16, "kv_cache_memory": 1000000, "prefix_cache": True}
    args = argparse.Namespace(page_size=16, kv_cache_memory=None, no_prefix_cache=True)
    assert paging_kwargs(args) == {"page": 16, "prefix_cache": False}
    import jax

    fraction = argparse.Namespace(page_size=16, kv_cache_memory=("fraction", 0.9))
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:  # a TPU / GPU: 0.9 of what is free
        assert 0 < paging_kwargs(fraction)["kv_cache_memory"] <= 0.9 * stats["bytes_limit"]
    else:
        with pytest.raises(SystemExit):
            paging_kwargs(fraction)
        assert "needs a device that reports its memory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        paging_kwargs(argparse.Namespace(page_size=-1, kv_cache_memory=None))
    assert "--page-size must be >= 0" in capsys.readouterr().err
    assert paging_kwargs(argparse.Namespace(kv_cache_memory=None))["page"] is None  # the engine's platform default
    from infer import serve_benchmark

    with pytest.raises(SystemExit):  # refused before any model loads
        serve_benchmark.main(["--page-size", "-1"])
    assert "--page-size must be >= 0, got -1" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # its servers' turn, as infer.serve's
        serve_benchmark.main(["--turn-ms", "0"])
    assert "--turn-ms must be > 0, got 0.0" in capsys.readouterr().err
