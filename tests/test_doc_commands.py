"""Every command line shown in README.md and the documentation parses with its CLI's own argument parser.

A command is a line of a fenced code block that runs ``python -m MODULE`` of this project's packages or one of
pyproject's [project.scripts] (after environment assignments, inside a shell loop or a quoted ``--command=...``);
backslash continuations are joined, and the arguments end at a shell operator (``&``, ``;``, ``|``, ``>``) or a
comment. Parsers run with abbreviations off, so a flag that was renamed or removed cannot survive as the prefix of
another. No model loads: only the parsers are built.
"""
from __future__ import annotations

import argparse
import importlib
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", REPO / "train" / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
PACKAGES = {"dflash_jax", "infer", "train"}
FENCE = re.compile(r"^\s*(```|~~~)")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
OPERATORS = set("&|;<>()")
NOT_SHELL = {"python", "py", "json", "jsonl", "yaml", "toml", "mermaid"}
PLACEHOLDER = re.compile(r"^(<.*>|\[.*\]|\.\.\.|[A-Z][A-Z_]*)$")  # <path>, [--json], ..., DIR
# Where a CLI's parser is built when its module has no build_parser / parse_args of its own.
PARSER_HOME = {"train": "train.config"}


def console_scripts() -> dict[str, str]:
    """[project.scripts] name -> the module whose CLI it is (``infer.serve.__main__:main`` -> ``infer.serve``)."""
    tomllib = pytest.importorskip("tomllib")
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    return {name: target.split(":")[0].removesuffix(".__main__") for name, target in scripts.items()}


def code_lines(text: str):
    """(line number, logical line) of every fenced code block that is not source code (shell, console or
    unlabelled), continuations joined."""
    inside, shell, pending, start = False, False, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        fence = FENCE.match(line)
        if fence:
            inside, pending = not inside, ""
            shell = line[fence.end():].strip() not in NOT_SHELL
            continue
        if not (inside and shell):
            continue
        start = start if pending else number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield start, pending + line
        pending = ""


def tokens_of(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def commands_in(line: str, scripts: dict[str, str]):
    """(module, argv) of each of our CLIs that ``line`` runs; a quoted token holding a command is searched too."""
    words = tokens_of(line)
    for i, word in enumerate(words):
        module, rest = None, None
        if word in ("python", "python3") and words[i + 1:i + 2] == ["-m"] and i + 2 < len(words):
            if words[i + 2].split(".")[0] in PACKAGES:
                module, rest = words[i + 2], words[i + 3:]
        elif word in scripts and (i == 0 or set(words[i - 1]) <= OPERATORS or ENV_ASSIGNMENT.match(words[i - 1])):
            module, rest = scripts[word], words[i + 1:]
        elif " " in word:
            yield from commands_in(word.split("=", 1)[-1] if word.startswith("--") else word, scripts)
        if module is not None:
            argv = []
            for arg in rest:
                if set(arg) <= OPERATORS:
                    break
                argv.append(arg)
            yield module, argv


def documented_commands():
    """One pytest.param(module, argv) per command; a line that names a CLI but is not valid shell yields
    ``(None, error)``, which the test reports."""
    scripts = console_scripts()
    mentions = re.compile(r"\bpython3? -m (%s)\b|(^|\s)(%s)\b" % ("|".join(PACKAGES), "|".join(map(re.escape, scripts))))
    found = []
    for page in PAGES:
        for number, line in code_lines(page.read_text()):
            if not mentions.search(line):
                continue
            where = f"{page.relative_to(REPO)}:{number}"
            try:
                found += [pytest.param(m, argv, id=f"{where}:{m}") for m, argv in commands_in(line, scripts)]
            except ValueError as e:  # shlex: an unclosed quotation
                found.append(pytest.param(None, [f"{line!r}: {e}"], id=f"{where}:unparsable"))
    return found


COMMANDS = documented_commands()


def parse_function(module: str):
    """The CLI's own parsing: ``build_parser().parse_args`` where the module has one, else its ``parse_args``."""
    name = PARSER_HOME.get(module, module)
    mod = importlib.import_module(name)
    if not (hasattr(mod, "build_parser") or hasattr(mod, "parse_args")):
        mod = importlib.import_module(name + ".__main__")  # a package CLI: python -m infer.serve, train.demo_recipe
    if hasattr(mod, "build_parser"):
        return lambda argv: mod.build_parser().parse_args(argv)
    return mod.parse_args


@pytest.fixture
def strict_parsers(monkeypatch):
    """Every ArgumentParser built from here on refuses abbreviated flags (``--max-new-token`` for
    ``--max-new-tokens``), subparsers included."""
    init = argparse.ArgumentParser.__init__

    def no_abbrev(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        init(self, *args, **kwargs)

    monkeypatch.setattr(argparse.ArgumentParser, "__init__", no_abbrev)


@pytest.mark.parametrize("module, argv", COMMANDS)
def test_documented_command_parses(module, argv, strict_parsers, capsys):
    assert module is not None, f"not a shell command line: {argv[0]}"
    placeholders = [a for a in argv if PLACEHOLDER.match(a)]
    assert not placeholders, f"give a concrete example value instead of {placeholders}"
    try:
        parse_function(module)(argv)
    except SystemExit as e:
        asked_for_help = e.code == 0 and ("--help" in argv or "-h" in argv)
        assert asked_for_help, f"python -m {module} {shlex.join(argv)}: {capsys.readouterr().err.strip()}"


def test_the_pages_show_every_cli():
    """The extraction finds the commands the pages show (an empty list would pass everything above)."""
    modules = {c.values[0] for c in COMMANDS}
    assert {"infer.generate", "infer.benchmark", "infer.serve", "infer.serve_benchmark", "train", "train.make_data",
            "train.export", "train.bench", "train.demo_recipe", "dflash_jax.kernels.bench",
            "dflash_jax.kernels.check"} <= modules, modules


@pytest.mark.parametrize("module", sorted({c.values[0] for c in COMMANDS} - {None}))
def test_a_misspelled_or_abbreviated_flag_fails(module, strict_parsers, capsys):
    """The check can fail: each CLI's parser exits on an unknown flag, and on the first documented command with
    one of its flags cut short or misspelled."""
    parse = parse_function(module)
    with pytest.raises(SystemExit) as e:
        parse(["--no-such-flag"])
    assert e.value.code != 0
    argv = next((argv for m, argv in (c.values for c in COMMANDS) if m == module and
                 any(a.startswith("--") and len(a) > 4 for a in argv)), None)
    if argv is None:
        return
    i = next(i for i, a in enumerate(argv) if a.startswith("--") and len(a) > 4)
    flag = argv[i].split("=", 1)[0]
    for wrong in (flag[:-1], flag + "x"):
        with pytest.raises(SystemExit) as e:
            parse(argv[:i] + [argv[i].replace(flag, wrong, 1)] + argv[i + 1:])
        assert e.value.code != 0, wrong
