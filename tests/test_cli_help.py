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


@pytest.mark.parametrize("module", ["generate", "benchmark"])
def test_infer_options_all_have_help(module, monkeypatch, capsys):
    import importlib

    m = importlib.import_module(f"infer.{module}")
    with pytest.raises(SystemExit):
        m.parse_args(["--help"])
    out = re.sub(r"\s+", " ", capsys.readouterr().out)
    for flag in ("--max-new-tokens", "--top-p", "--seed", "--temperature", "--block-size"):
        assert re.search(re.escape(flag) + r" \S+ [a-z0-9(]", out), flag  # the flag is followed by a help text
