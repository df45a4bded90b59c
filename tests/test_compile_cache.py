"""``dflash_jax.compile_cache``: the command lines keep their compiled programs on disk, so that a second run loads
them instead of compiling (a restarted server's warm-up); where the cache lives and how it is turned off. The suite
itself runs with it off (``conftest.py``): a process of these tests turns it on in a folder of its own."""
from __future__ import annotations

import os
import subprocess
import sys

from dflash_jax import compile_cache as cc
from test_huge_pages import AS_MODULE

# a `python -m infer.generate` launch (launch() as its main() calls it), then one program compiled
PROBE = ("import sys; " + AS_MODULE + "from dflash_jax.launch import launch; launch(); import jax, jax.numpy as jnp; "
         "print(float(jax.jit(lambda x: jnp.tanh(x @ x).sum())(jnp.ones((64, 64))))); "
         "print(jax.config.jax_compilation_cache_dir)")


def test_where_the_cache_lives():
    home = os.path.expanduser("~")
    assert cc.cache_dir({}) == os.path.join(home, ".cache", "dflash_jax", "xla")
    assert cc.cache_dir({"XDG_CACHE_HOME": "/c"}) == "/c/dflash_jax/xla"
    assert cc.cache_dir({cc.ENV: "~/xla"}) == os.path.join(home, "xla")
    for off in ("0", "off", "", "None"):
        assert cc.cache_dir({cc.ENV: off}) is None
    assert cc.cache_dir({"JAX_COMPILATION_CACHE_DIR": "/j"}) is None  # JAX's own setting stands
    assert cc.cache_dir({"JAX_COMPILATION_CACHE_DIR": "/j", cc.ENV: "/d"}) == "/d"


def _run(code: str, **env) -> subprocess.CompletedProcess:
    # a user's environment: neither this project's cache setting nor JAX's own (the suite sets both, conftest.py)
    environ = {k: v for k, v in os.environ.items() if k not in (cc.ENV, "JAX_COMPILATION_CACHE_DIR")}
    # the probe's program compiles in milliseconds: JAX caches only programs slower than its threshold (1 s)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**environ, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", **env})
    assert out.returncode == 0, out.stderr
    return out


def _probe(code: str, **env) -> list[str]:
    return _run(code, **env).stdout.split()


def test_a_command_line_caches_its_programs_and_a_second_run_compiles_none(tmp_path):
    """A command line's launch turns the cache on: its program is written once, a second run finds it (no entry
    added) and computes the same; off with DFLASH_COMPILATION_CACHE=0, and off for a launch that is no command line
    (a test or a notebook calling ``main()``); a folder that cannot be made is said in one line, the run goes on."""
    folder = tmp_path / "xla"
    first = _probe(PROBE, **{cc.ENV: str(folder)})
    entries = sorted(os.listdir(folder))
    assert first[1] == str(folder) and entries
    assert _probe(PROBE, **{cc.ENV: str(folder)}) == first and sorted(os.listdir(folder)) == entries
    assert _probe(PROBE, **{cc.ENV: "0"})[1] == "None"
    assert _probe(PROBE.replace(AS_MODULE, ""), **{cc.ENV: str(tmp_path / "other")})[1] == "None"
    assert not (tmp_path / "other").exists()
    (tmp_path / "file").write_text("")
    out = _run(PROBE, **{cc.ENV: str(tmp_path / "file" / "xla")})
    assert out.stdout.split()[1] == "None" and "warning: no compilation cache" in out.stderr
