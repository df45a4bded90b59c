"""Transparent huge pages for the command lines' heap (``python -m infer.*`` / ``train*``, the ``dflash-*`` scripts).

XLA's CPU runtime allocates each device call's temporary buffer with malloc; above glibc's mmap threshold (at most
32 MiB) that is a fresh mapping, freed after the call, so every call faults its pages in again, 4 KiB at a time:
33k faults per call (about 110 ms on the project's 2-core VM) for a continuous-batching step of the qwen3-0.6b
preset at batch 8, which calls the device once per step or two (docs/benchmarks.md). With the kernel's huge pages
in ``madvise`` mode, glibc (2.35 or newer) advises them for its mappings only when ``GLIBC_TUNABLES`` holds
``glibc.malloc.hugetlb=1``, a setting read at process start: so a command line re-runs itself once with it set
(``reexec``, from ``dflash_jax.launch``, first thing in each CLI's ``main()``; a few hundred faults per call then).
``DFLASH_HUGE_PAGES=0`` keeps the process as it is. An import never re-executes anything, nor does a ``main()``
called as a library (``command_line``).
"""
from __future__ import annotations

import os
import re
import sys

TUNABLE = "glibc.malloc.hugetlb"
OPT_OUT = "DFLASH_HUGE_PAGES"
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def wanted(environ, thp_mode: str | None, glibc: tuple[int, int] | None) -> bool:
    """Whether to re-run with the tunable: not set yet (nor any value of it), not opted out, glibc >= 2.35 (the
    tunable's first release), and huge pages in ``madvise`` mode (``always``: every mapping gets them already;
    ``never``: none can)."""
    if environ.get(OPT_OUT) == "0" or TUNABLE in environ.get("GLIBC_TUNABLES", ""):
        return False
    return thp_mode == "madvise" and glibc is not None and glibc >= (2, 35)


def thp_mode(path: str = THP_ENABLED) -> str | None:
    """The kernel's transparent huge page mode (the bracketed word of ``path``), None where it cannot be read."""
    try:
        with open(path) as f:
            found = re.search(r"\[(\w+)\]", f.read())
    except OSError:
        return None
    return found.group(1) if found else None


def glibc_version() -> tuple[int, int] | None:
    """(major, minor) of the C library when it is glibc, else None (musl, macOS, Windows)."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (AttributeError, ValueError, OSError):
        return None


def tunables(environ) -> str:
    """``GLIBC_TUNABLES`` with the huge-page tunable added to whatever it held."""
    held = environ.get("GLIBC_TUNABLES")
    return f"{held}:{TUNABLE}=1" if held else f"{TUNABLE}=1"


def command_line(main_module: str | None, argv0: str) -> bool:
    """Whether this process is one of the project's command lines: ``python -m infer.*`` / ``python -m train*``
    (``main_module``: the module Python runs as ``__main__``) or a ``dflash-*`` script of pyproject.toml; not a
    ``main()`` called from a test, a notebook or the user's own program."""
    return (main_module or "").split(".")[0] in ("infer", "train") or os.path.basename(argv0).startswith("dflash-")


def reexec() -> None:
    """Replace this process by its own command line (``sys.orig_argv``) with the tunable set, where ``wanted``;
    otherwise return. The new process sees the tunable set, so it never re-executes again."""
    if sys.platform.startswith("linux") and wanted(os.environ, thp_mode(), glibc_version()):
        os.execve(sys.executable, sys.orig_argv, dict(os.environ, GLIBC_TUNABLES=tunables(os.environ)))

