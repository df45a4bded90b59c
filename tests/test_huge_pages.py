"""``infer.huge_pages``: when a command line re-runs itself with glibc's huge-page tunable, and that only a
``python -m`` launch of the packages does (a library import never re-executes)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from infer import huge_pages as hp

CLEAN = {"PATH": "/usr/bin"}


@pytest.mark.parametrize("environ,thp,glibc,want", [
    (CLEAN, "madvise", (2, 36), True),
    (CLEAN, "madvise", (2, 35), True),
    (CLEAN, "madvise", (2, 34), False),  # no such tunable before 2.35
    (CLEAN, "madvise", None, False),  # not glibc
    (CLEAN, "always", (2, 36), False),  # every mapping gets huge pages already
    (CLEAN, "never", (2, 36), False),
    (CLEAN, None, (2, 36), False),  # no transparent huge pages at all
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, "madvise", (2, 36), False),  # set: the re-run process
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "madvise", (2, 36), False),  # the user's own value stays
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "madvise", (2, 36), True),
    ({"DFLASH_HUGE_PAGES": "0"}, "madvise", (2, 36), False),  # opted out
    ({"DFLASH_HUGE_PAGES": "1"}, "madvise", (2, 36), True),
])
def test_wanted(environ, thp, glibc, want):
    assert hp.wanted(environ, thp, glibc) is want


@pytest.mark.parametrize("argv0,cli", [("-m", True), ("/venv/bin/dflash-generate", True), ("dflash-train", True),
                                       ("-c", False), ("/usr/lib/python3/pytest/__main__.py", False), ("", False),
                                       ("/home/u/run.py", False)])
def test_command_line(argv0, cli):
    assert hp.command_line(argv0) is cli


def test_tunables_keep_the_users():
    assert hp.tunables({}) == "glibc.malloc.hugetlb=1"
    assert hp.tunables({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"


def test_thp_mode_reads_the_bracketed_word(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert hp.thp_mode(str(f)) == "madvise"
    f.write_text("[always] madvise never\n")
    assert hp.thp_mode(str(f)) == "always"
    assert hp.thp_mode(str(tmp_path / "missing")) is None


PROBE = ("import sys; sys.argv[0] = '-m'; import os, infer; "  # what infer's import sees in a `python -m` launch
         "print('GLIBC_TUNABLES=' + str(os.environ.get('GLIBC_TUNABLES')))")


def _tunables_seen(code, **env):
    """GLIBC_TUNABLES as the process that ran ``code`` (``python -c``) last saw it (after any re-execution)."""
    environ = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", hp.OPT_OUT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**environ, **env},
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc tunables are Linux-only")
def test_a_python_m_launch_reruns_itself_where_wanted():
    """On this machine (whatever its kernel and C library): a process that imports ``infer`` as a ``python -m``
    launch does runs with the tunable exactly where ``wanted`` says so, never with the opt-out, and keeps the
    user's other tunables; a plain import of the package does not re-execute."""
    expected = hp.wanted({}, hp.thp_mode(), hp.glibc_version())
    on = "GLIBC_TUNABLES=glibc.malloc.hugetlb=1"
    assert (_tunables_seen(PROBE) == on) is expected
    assert _tunables_seen(PROBE, DFLASH_HUGE_PAGES="0") == "GLIBC_TUNABLES=None"
    mine = _tunables_seen(PROBE, GLIBC_TUNABLES="glibc.malloc.arena_max=4")
    assert mine == ("GLIBC_TUNABLES=glibc.malloc.arena_max=4:glibc.malloc.hugetlb=1" if expected
                    else "GLIBC_TUNABLES=glibc.malloc.arena_max=4")
    assert _tunables_seen(PROBE.replace("sys.argv[0] = '-m'; ", "")) == "GLIBC_TUNABLES=None"
    script = _tunables_seen(PROBE.replace("sys.argv[0] = '-m'", "sys.argv[0] = '/venv/bin/dflash-generate'"))
    assert (script == on) is expected
