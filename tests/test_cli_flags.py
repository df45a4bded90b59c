"""``dflash_jax.cli_flags``: one spelling per flag across the CLIs; the old spellings of ``train.make_data``
(``--prompts``, ``--batch-size``) still work, with one warning line naming the new flag."""
from __future__ import annotations

import argparse
import json

import pytest

from dflash_jax.cli_flags import add_dtype_arg, add_renamed


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="t")
    add_renamed(p, "--prompts-file", "--prompts", required=True)
    add_renamed(p, "--max-batch", "--batch-size", type=int, default=8)
    return p


def test_the_old_spelling_stores_the_same_value_and_warns_once(capsys):
    a = _parser().parse_args(["--prompts", "p.txt", "--batch-size", "3"])
    assert (a.prompts_file, a.max_batch) == ("p.txt", 3)
    assert capsys.readouterr().err.splitlines() == ["warning: --prompts is deprecated; use --prompts-file",
                                                    "warning: --batch-size is deprecated; use --max-batch"]


def test_the_new_spelling_is_silent_and_the_old_one_hidden(capsys):
    p = _parser()
    a = p.parse_args(["--prompts-file", "p.txt"])
    assert (a.prompts_file, a.max_batch) == ("p.txt", 8)
    assert capsys.readouterr().err == ""
    assert "--batch-size" not in p.format_help() and "--prompts " not in p.format_help()


def test_a_required_option_needs_one_spelling(capsys):
    with pytest.raises(SystemExit) as e:
        _parser().parse_args([])
    assert e.value.code == 2 and "--prompts-file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parser().parse_args(["--batch-size", "x", "--prompts-file", "p"])  # the alias keeps the type


def test_dtype_is_one_rule():
    p = argparse.ArgumentParser()
    add_dtype_arg(p)
    assert p.parse_args([]).dtype == "auto"
    with pytest.raises(SystemExit):
        p.parse_args(["--dtype", "int8"])


def test_make_data_takes_the_old_spellings_with_a_warning(tmp_path, capsys):
    """The command itself, old flags: the same run as with the new ones (the slots recorded as --max-batch)."""
    from dflash_jax.demo import DEMO_TARGET
    from train.make_data import _differences, main

    pfile = tmp_path / "p.txt"
    pfile.write_text("def add(a, b):\nimport os\n")
    out = tmp_path / "data"
    assert main(["--target", DEMO_TARGET, "--prompts", str(pfile), "--out", str(out), "--batch-size", "2",
                 "--max-new-tokens", "2", "--no-progress"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert [line for line in err if line.startswith("warning:")] == [
        "warning: --prompts is deprecated; use --prompts-file", "warning: --batch-size is deprecated; use --max-batch"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and manifest["settings"]["batch_size"] == 2
    assert _differences(manifest, dict(manifest["settings"], batch_size=4), manifest["vocab_size"]) == [
        "--max-batch 2 -> 4"]
