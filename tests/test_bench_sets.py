"""``infer.benchmark --dataset NAME`` (infer/bench_sets.py): each set's user turn as the paper's benchmark builds it,
a small local copy read through the same ``datasets.load_dataset`` call as the hub set (no network: conftest keeps
the hub offline), the target's chat template applied with thinking off, and one-line refusals."""
from __future__ import annotations

import json
import shutil

import pytest

from infer import bench_sets
from pairs import pair_dirs as make_pair_dirs

REASON = "\nPlease reason step by step, and put your final answer within \\boxed{}."
QUESTIONS = ["Natalia sold 48 clips. How many?", "Weng earns $12 an hour. How much?", "Betty needs $100. How?"]
# A Qwen3-style switch: enable_thinking=False pre-fills an empty think block after the opened assistant turn.
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}"
            "<|assistant|>\n{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
            "{% endif %}{% endif %}")


@pytest.mark.parametrize("name, row, turn", [
    ("gsm8k", {"question": "2 + 2?"}, "2 + 2?" + REASON),
    ("math500", {"problem": "Find x."}, "Find x." + REASON),
    ("humaneval", {"prompt": "def f(x):\n"}, "Write a solution to the following problem and make sure that it "
                                             "passes the tests:\n```python\ndef f(x):\n\n```"),
    ("mbpp", {"prompt": "Write a function to add.", "test_list": ["assert add(1, 2) == 3"]}, "Write a function to add."),
    ("mt-bench", {"prompt": ["First turn.", "Second turn."]}, "First turn."),
    ("alpaca", {"instruction": "Translate.", "input": "Bonjour"}, "Translate.\n\nInput:\nBonjour"),
    ("alpaca", {"instruction": "Name a color.", "input": ""}, "Name a color."),
])
def test_each_sets_user_turn(name, row, turn):
    assert bench_sets.SETS[name].turn(row) == turn


def test_the_sets_the_paper_and_deepspec_evaluate():
    assert list(bench_sets.SETS) == ["gsm8k", "math500", "humaneval", "mbpp", "mt-bench", "alpaca"]
    assert bench_sets.SETS["gsm8k"].load_call() == "datasets.load_dataset('openai/gsm8k', 'main', split='test')"
    assert bench_sets.SETS["mt-bench"].load_call() == \
        "datasets.load_dataset('HuggingFaceH4/mt_bench_prompts', split='train')"


@pytest.fixture
def local_copies(tmp_path, monkeypatch):
    """gsm8k laid out as its hub repository (a README whose configs name config main's test files) and an alpaca
    copy of one train file (the split named by the file), the datasets cache in a temporary folder."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    gsm8k = tmp_path / "gsm8k"
    (gsm8k / "main").mkdir(parents=True)
    (gsm8k / "README.md").write_text("---\nconfigs:\n- config_name: main\n  data_files:\n  - split: test\n"
                                     "    path: main/test-*\n---\n")
    (gsm8k / "main" / "test-00000-of-00001.jsonl").write_text(
        "".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n" for q in QUESTIONS))
    alpaca = tmp_path / "alpaca"
    alpaca.mkdir()
    (alpaca / "train.jsonl").write_text(
        json.dumps({"instruction": "Translate.", "input": "Bonjour", "output": "Hello"}) + "\n"
        + json.dumps({"instruction": "Name a color.", "input": "", "output": "Red"}) + "\n")
    return {"gsm8k": str(gsm8k), "alpaca": str(alpaca)}


def test_a_local_copy_reads_as_the_hub_set(local_copies):
    got = bench_sets.records("gsm8k", 2, local_copies["gsm8k"])  # the first N rows, in order
    assert got == [{"messages": [{"role": "user", "content": q + REASON}]} for q in QUESTIONS[:2]]
    assert [r["messages"][0]["content"] for r in bench_sets.records("alpaca", 16, local_copies["alpaca"])] == \
        ["Translate.\n\nInput:\nBonjour", "Name a color."]  # fewer rows than asked: all of them


def test_a_copy_of_another_set_is_refused_in_one_line(local_copies):
    with pytest.raises(bench_sets.BenchSetError, match="has no column 'prompt'"):
        bench_sets.records("mt-bench", 2, local_copies["alpaca"])  # the same split, train
    with pytest.raises(bench_sets.BenchSetError, match=r"split='test'\) failed \(Unknown split \"test\""):
        bench_sets.records("math500", 2, local_copies["alpaca"])


@pytest.fixture(scope="module")
def chat_pair(tmp_path_factory):
    """The tiny saved pair, its target's tokenizer given a chat template."""
    from dflash_jax.checkpoints import load_tokenizer

    root = tmp_path_factory.mktemp("chat_pair")
    tdir, ddir, _ = make_pair_dirs(str(root / "pair"))
    chat_tdir = str(root / "target")
    shutil.copytree(tdir, chat_tdir)
    tok = load_tokenizer(chat_tdir)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(chat_tdir)
    return chat_tdir, ddir


def test_the_benchmark_applies_the_chat_template_without_thinking(local_copies, chat_pair, capsys):
    from dflash_jax.checkpoints import load_tokenizer
    from infer import benchmark
    from infer.prompt_input import encode

    tdir, ddir = chat_pair
    tok = load_tokenizer(tdir)
    argv = ["--target", tdir, "--draft", ddir, "--dataset", "gsm8k", "--dataset-path", local_copies["gsm8k"],
            "--num-prompts", "2"]
    ids = encode(tok, benchmark.prompt_records(benchmark.parse_args(argv)), chat_kwargs=bench_sets.CHAT_KWARGS)
    assert [tok.decode(i) for i in ids] == [f"<|user|>\n{q}{REASON}\n<|assistant|>\n<think>\n\n</think>\n\n"
                                           for q in QUESTIONS[:2]]
    code = benchmark.main(argv + ["--max-new-tokens", "4", "--block-size", "4", "--repeats", "1", "--json",
                                  "--ignore-eos", "--no-timing-split"])
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert code == 0 and lines[-1]["num_prompts"] == 2
    assert [r["prompt_tokens"] for r in lines[:-1]] == [len(i) for i in ids]


def _one_line_error(argv, capsys) -> str:
    from infer import benchmark

    with pytest.raises(SystemExit) as e:
        benchmark.main(argv)
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert e.value.code == 2 and len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def test_an_unknown_set_is_refused_naming_the_known_ones(capsys):
    line = _one_line_error(["--dataset", "gsm8", "--num-prompts", "2"], capsys)
    assert "'gsm8'" in line and "gsm8k, math500, humaneval, mbpp, mt-bench, alpaca" in line


@pytest.mark.parametrize("argv, message", [
    (["--dataset", "gsm8k", "--prompts-file", "p.jsonl"], "drop --prompts-file"),
    (["--dataset", "gsm8k", "--synthetic", "tiny"], "drop --synthetic"),
    (["--dataset-path", "."], "--dataset-path needs --dataset NAME"),
    (["--dataset", "gsm8k", "--dataset-path", "no/such/dir"], "no/such/dir is not a directory"),
])
def test_dataset_options_are_checked_in_one_line(argv, message, capsys):
    assert message in _one_line_error(argv, capsys)


def test_a_set_missing_from_the_cache_says_how_to_fetch_it(tmp_path, monkeypatch, capsys):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # as HF_DATASETS_OFFLINE=1 (conftest: the hub's)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "empty"))
    line = _one_line_error(["--dataset", "gsm8k"], capsys)
    assert "openai/gsm8k is not in the datasets cache" in line
    assert "python -c \"import datasets; datasets.load_dataset('openai/gsm8k', 'main', split='test')\"" in line


def test_without_the_datasets_library_the_extra_is_named(monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)  # import datasets -> ImportError
    line = _one_line_error(["--dataset", "mbpp"], capsys)
    assert line == "error: --dataset needs the datasets library: pip install 'dflash_jax[bench]'"
