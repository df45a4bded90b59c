"""The Python standard library as a code corpus that exists on every machine.

Files: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]``, in sorted order of their POSIX relative
path, except
  * test code: any path component ``test``, ``tests``, ``idle_test`` or starting with ``test_`` inside
    those (covers ``test/``, ``unittest/test``, ``ctypes/test``, ``lib2to3/tests``, ``idlelib/idle_test``, ...);
  * third-party and build folders: ``site-packages``, ``dist-packages``, ``__pycache__``, ``lib-dynload``,
    ``config-*``;
  * data disguised as code: ``pydoc_data/`` (one 750 kB docstring), the charmap codec tables in
    ``encodings/`` (files defining ``decoding_table``/``decoding_map``), ``_sysconfigdata_*``;
  * files that are empty or not valid UTF-8.

Held-out split (fixed, documented, independent of the Python version's file list): a module is held out
when ``int(sha1(relative_path).hexdigest(), 16) % 20 == 0`` (about 5% of the modules). The tokenizer and
the pretraining only ever see ``train_files()``; evaluation and benchmark prompts come from
``heldout_files()``.

``code_prompts`` cuts prompts out of modules: each starts at a line holding a ``def``/``class`` (including the
decorators right above it) and ends at a line boundary after a random number of characters.
"""
from __future__ import annotations

import functools
import hashlib
import os
import random
import sysconfig

HELDOUT_MODULUS = 20
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
                           "lib-dynload", "pydoc_data"})
_DATA_MARKERS = ("decoding_table = (", "decoding_map = codecs.make_identity_dict")


def stdlib_dir() -> str:
    return os.path.realpath(sysconfig.get_paths()["stdlib"])


def _excluded_path(rel: str) -> bool:
    parts = rel.split("/")
    for d in parts[:-1]:
        if d in EXCLUDED_DIRS or d.startswith("config-"):
            return True
    return parts[-1].startswith("_sysconfigdata_")


def _is_data_module(rel: str, text: str) -> bool:
    return rel.startswith("encodings/") and any(m in text for m in _DATA_MARKERS)


@functools.lru_cache(maxsize=8)
def _listing(root: str) -> tuple[str, ...]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root).replace(os.sep, "/")
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        # prune excluded folders early (and keep os.walk deterministic)
        dirnames[:] = sorted(d for d in dirnames if not _excluded_path(rel_dir + d + "/x"))
        for name in filenames:
            rel = rel_dir + name
            if not name.endswith(".py") or _excluded_path(rel):
                continue
            text = _read(os.path.join(root, rel))
            if text is None or not text.strip() or _is_data_module(rel, text):
                continue
            found.append(rel)
    return tuple(sorted(found))


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def relative_path(path: str, root: str | None = None) -> str:
    """The POSIX path of ``path`` relative to the stdlib (or ``root``)."""
    return os.path.relpath(os.path.realpath(path), root or stdlib_dir()).replace(os.sep, "/")


def is_heldout(rel: str) -> bool:
    """The fixed held-out rule: sha1 of the POSIX relative path, mod 20, equals 0."""
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % HELDOUT_MODULUS == 0


def all_files(root: str | None = None) -> list[str]:
    """Absolute paths of every corpus module, sorted by relative path."""
    root = os.path.realpath(root or stdlib_dir())
    return [os.path.join(root, rel) for rel in _listing(root)]


def train_files(root: str | None = None) -> list[str]:
    root = os.path.realpath(root or stdlib_dir())
    return [os.path.join(root, rel) for rel in _listing(root) if not is_heldout(rel)]


def heldout_files(root: str | None = None) -> list[str]:
    root = os.path.realpath(root or stdlib_dir())
    return [os.path.join(root, rel) for rel in _listing(root) if is_heldout(rel)]


def read_text(path: str) -> str:
    text = _read(path)
    if text is None:
        raise ValueError(f"{path} is not readable UTF-8")
    return text


def _starts(lines: list[str]) -> list[int]:
    """Indices of lines where a prompt may start: a def/class line, moved up over its decorators."""
    out = []
    for i, line in enumerate(lines):
        s = line.lstrip()
        if s.startswith(("def ", "async def ", "class ")):
            j = i
            indent = line[: len(line) - len(s)]
            while j > 0 and lines[j - 1].startswith(indent + "@"):
                j -= 1
            out.append(j)
    return out


def code_prompts(files, n: int, *, seed: int = 0, min_chars: int = 200, max_chars: int = 600,
                 with_source: bool = False):
    """``n`` distinct prompts cut from ``files``, deterministic for (files, n, seed, min/max chars).

    Every candidate start (a ``def``/``class`` line, or the first decorator above it) in every file is
    a candidate; ``n`` of them are sampled without replacement. A prompt runs from its start over whole
    lines until it has at least L characters, L uniform in [min_chars, max_chars] (it always ends with
    a newline; the last line may overshoot max_chars). Starts whose module ends before ``min_chars`` are
    skipped. With ``with_source`` each item is ``(prompt, relative_path, line_number)`` (1-based).
    Raises ValueError when the files hold fewer than ``n`` candidates.
    """
    if not 0 < min_chars <= max_chars:
        raise ValueError(f"need 0 < min_chars <= max_chars, got {min_chars}, {max_chars}")
    candidates = []  # (file index, start line)
    file_lines = []
    for fi, path in enumerate(files):
        lines = read_text(path).splitlines(keepends=True)
        file_lines.append(lines)
        tail = 0  # characters from each line to the end of the file
        tails = [0] * (len(lines) + 1)
        for i in range(len(lines) - 1, -1, -1):
            tail += len(lines[i])
            tails[i] = tail
        candidates.extend((fi, s) for s in sorted(set(_starts(lines))) if tails[s] >= min_chars)
    if len(candidates) < n:
        raise ValueError(f"only {len(candidates)} prompt starts in {len(files)} files, asked for {n}")
    rng = random.Random(seed)
    chosen = rng.sample(candidates, n)
    out = []
    for fi, start in chosen:
        target = rng.randint(min_chars, max_chars)
        lines, text, i = file_lines[fi], "", start
        while len(text) < target and i < len(lines):
            text += lines[i]
            i += 1
        if not text.endswith("\n"):
            text += "\n"
        out.append((text, relative_path(files[fi]), start + 1) if with_source else text)
    return out
