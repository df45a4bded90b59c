"""The code-shape rules of HELPERS / issue 27, checked: ``python scripts/audit.py [DIR ...]``.

Lists every function longer than 80 lines or with more than 6 positional parameters (``self`` / ``cls`` not
counted; "reason given" when a comment right above the ``def`` or its decorators says why), and every import
of another module's private (``_underscore``) name. Exit status 0 always: it reports, the reader judges.
"""
from __future__ import annotations

import ast
import pathlib
import sys

MAX_LINES, MAX_POSITIONAL = 80, 6


def _reason(lines: list[str], node: ast.FunctionDef) -> bool:
    """A ``#`` comment on the line above the def (above its decorators)."""
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return first >= 2 and lines[first - 2].strip().startswith("#")


def audit(path: pathlib.Path) -> list[str]:
    text = path.read_text()
    lines, out = text.splitlines(), []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            params = [a.arg for a in node.args.posonlyargs + node.args.args]
            pos = len(params) - (params[:1] in (["self"], ["cls"]))
            why = " (reason given)" if _reason(lines, node) else ""
            if n > MAX_LINES:
                out.append(f"LONG {path}:{node.lineno} {node.name}: {n} lines{why}")
            if pos > MAX_POSITIONAL:
                out.append(f"ARGS {path}:{node.lineno} {node.name}: {pos} positional{why}")
        elif isinstance(node, ast.ImportFrom):
            out += [f"PRIVATE {path}:{node.lineno} from {node.module} import {a.name}" for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")]
    return out


def main(argv: list[str]) -> int:
    for root in argv or ["dflash_jax", "train", "infer"]:
        for path in sorted(pathlib.Path(root).rglob("*.py")):
            for line in audit(path):
                print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
