"""``dflash_jax.huge_pages`` / ``dflash_jax.launch``: when a command line re-runs itself with glibc's huge-page tunable
(first thing in its ``main()``), and that an import of the packages never re-executes or exits."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dflash_jax import huge_pages as hp

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


@pytest.mark.parametrize("main_module,argv0,cli", [
    ("infer.generate", "/repo/infer/generate.py", True), ("train.__main__", "/repo/train/__main__.py", True),
    ("infer.serve.__main__", "/repo/infer/serve/__main__.py", True), (None, "/venv/bin/dflash-generate", True),
    (None, "dflash-train", True), (None, "-c", False), ("pytest.__main__", "/usr/lib/python3/pytest/__main__.py", False),
    (None, "", False), ("run", "/home/u/run.py", False), ("inference.x", "/home/u/inference/x.py", False)])
def test_command_line(main_module, argv0, cli):
    assert hp.command_line(main_module, argv0) is cli


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


# what launch() sees in a `python -m infer.generate` launch: that module as __main__
AS_MODULE = "import importlib.machinery as m; sys.modules['__main__'].__spec__ = m.ModuleSpec('infer.generate', None); "
PROBE = ("import sys; " + AS_MODULE + "from dflash_jax.launch import launch; launch(); import os; "
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
    """On this machine (whatever its kernel and C library): a ``python -m`` launch of a CLI (whose ``main()`` calls
    ``launch``) runs with the tunable exactly where ``wanted`` says so, never with the opt-out, and keeps the user's
    other tunables; ``launch`` from a process that is no command line (a test calling ``main()``) does not
    re-execute."""
    expected = hp.wanted({}, hp.thp_mode(), hp.glibc_version())
    on = "GLIBC_TUNABLES=glibc.malloc.hugetlb=1"
    assert (_tunables_seen(PROBE) == on) is expected
    assert _tunables_seen(PROBE, DFLASH_HUGE_PAGES="0") == "GLIBC_TUNABLES=None"
    mine = _tunables_seen(PROBE, GLIBC_TUNABLES="glibc.malloc.arena_max=4")
    assert mine == ("GLIBC_TUNABLES=glibc.malloc.arena_max=4:glibc.malloc.hugetlb=1" if expected
                    else "GLIBC_TUNABLES=glibc.malloc.arena_max=4")
    assert _tunables_seen(PROBE.replace(AS_MODULE, "")) == "GLIBC_TUNABLES=None"
    script = _tunables_seen(PROBE.replace(AS_MODULE, "sys.argv[0] = '/venv/bin/dflash-generate'; "))
    assert (script == on) is expected


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc tunables are Linux-only")
@pytest.mark.parametrize("shadowed", [False, True])
def test_importing_the_packages_does_no_work(shadowed, tmp_path):
    """``import infer; import train`` as a command line's launch would see them (``sys.argv[0]`` "-m", a CLI module as
    ``__main__``) neither re-executes nor exits, not even beside a folder named dflash_jax that shadows the package
    (only a CLI's ``main()`` says so); and ``train`` imports nothing of ``infer``."""
    if shadowed:
        (tmp_path / "dflash_jax").mkdir()
    code = ("import sys; sys.argv[0] = '-m'; " + AS_MODULE + "import os, train; print('infer' in sys.modules); "
            "import infer; print('GLIBC_TUNABLES=' + str(os.environ.get('GLIBC_TUNABLES')))")
    environ = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", hp.OPT_OUT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, cwd=tmp_path,
                         timeout=120)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert out.stdout.split() == ["False", "GLIBC_TUNABLES=None"]
