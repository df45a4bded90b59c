"""Help texts: every option explained, required ones marked, each default said once."""
from __future__ import annotations

import re

import pytest


def _help(parser) -> str:
    return re.sub(r"\s+", " ", parser.format_help())


def test_train_help_marks_required_flags_and_says_defaults_once():
    from train.config import build_parser

    parser = build_parser()
    text = _help(parser)
    actions = {a.dest: a for a in parser._actions}
    for dest in ("target", "data", "out"):
        assert actions[dest].required and actions[dest].help.endswith("(required)"), dest
    assert "(default: )" not in text
    for a in parser._actions:  # (BooleanOptionalAction writes its own "(default: ...)" into a.help)
        assert (a.help or "").count("default:") <= 1, a.dest
    assert "{float32,bfloat16,float16}" in text and "{auto,kernel,reference,interpret}" in text


@pytest.mark.parametrize("module", ["generate", "benchmark", "serve.__main__", "serve_benchmark", "structured_benchmark"])
def test_infer_options_all_have_help(module, monkeypatch, capsys):
    import importlib

    m = importlib.import_module(f"infer.{module}")
    with pytest.raises(SystemExit):
        m.parse_args(["--help"])
    out = re.sub(r"\s+", " ", capsys.readouterr().out)
    for flag in ("--max-new-tokens", "--top-p", "--seed", "--temperature", "--block-size"):
        assert re.search(re.escape(flag) + r" \S+ [a-z0-9(]", out), flag  # the flag is followed by a help text


def test_gpu_script_commands_parse():
    """scripts/gpu_benchmarks.sh (run on a device, not here): every command's options parse, presets exist."""
    import os
    import shlex

    from dflash_jax.synthetic import PRESETS
    from infer import benchmark, cache_plan, context_sweep, group_benchmark, plan, serve_benchmark, structured_benchmark
    from train import bench

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "gpu_benchmarks.sh")
    text = open(path).read().replace("\\\n", " ")
    commands = [shlex.split(line)[3:] for line in text.splitlines() if line.startswith("step ")]
    parse = {"infer.benchmark": benchmark.parse_args, "infer.context_sweep": context_sweep.parse_args,
             "train.bench": bench.build_parser().parse_args, "infer.serve_benchmark": serve_benchmark.parse_args,
             "infer.cache_plan": cache_plan.parse_args, "infer.group_benchmark": group_benchmark.parse_args,
             "infer.structured_benchmark": structured_benchmark.parse_args, "infer.plan": plan.parse_args}
    seen = set()
    for cmd in commands:
        if cmd[1].startswith(("scripts/", "examples/")):  # a script of this repository: its own parser
            import importlib.util

            spec = importlib.util.spec_from_file_location("script", os.path.join(os.path.dirname(path), "..", cmd[1]))
            script = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(script)
            script.build_parser().parse_args(cmd[2:])
            seen.add(cmd[1])
            continue
        assert cmd[:2] == ["python", "-m"], cmd
        if cmd[2] in parse:
            args = parse[cmd[2]](cmd[3:])
            assert getattr(args, "synthetic", None) in (None, *PRESETS), cmd
            seen.add(cmd[2])
    assert seen == set(parse) | {"scripts/gdn_verify_cost.py", "scripts/compile_time.py", "examples/grpo.py"} \
        and len(commands) == 25
    # every step runs by default and is described in the header (prefix and group once were in neither)
    names = [line.split()[1] for line in text.splitlines() if line.startswith("step ")]
    default = re.search(r"STEPS=\$\{\*:-([^}]*)\}", text).group(1).split()
    header = [line for line in text.splitlines() if re.match(r"#   \w", line)]
    described = {n for line in header for n in re.findall(r"(?:^#   |, )(\w+)", line)}
    assert default == names and set(names) <= described, (default, names, described)


def _demo_stage(stage: str):
    from train.demo_recipe.__main__ import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "stage")
    return sub.choices[stage]


@pytest.mark.parametrize("stage", ["target", "draft"])
def test_demo_options_all_have_help_and_say_each_default_once(stage):
    parser = _demo_stage(stage)
    formatter = parser._get_formatter()
    for a in parser._actions:
        assert a.help, a.dest
        assert formatter._expand_help(a).count("(default") <= 1, a.dest
    assert "(default: None)" not in _help(parser)


def test_demo_draft_defaults_are_the_documented_first_run():
    """The docs give the embedded draft's first run as ``python -m train.demo_recipe draft --num-prompts N --steps S``:
    the bare command is that run (its --help shows those numbers)."""
    import shlex
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    line = next(x for p in pages if p.is_file() for x in p.read_text().splitlines()
                if x.startswith("python -m train.demo_recipe draft --num-prompts"))
    parser = _demo_stage("draft")
    assert vars(parser.parse_args(shlex.split(line.split("#")[0])[4:])) == vars(parser.parse_args([]))
