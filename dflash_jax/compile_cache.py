"""XLA's persistent compilation cache for the command lines: every program compiled once is kept on disk, so the
next run of a CLI (a restarted server's warm-up, a second ``infer.generate``) loads it instead of compiling again.

On by default for the project's command lines (``dflash_jax.launch``), in ``$XDG_CACHE_HOME/dflash_jax/xla``
(``~/.cache/dflash_jax/xla``). ``DFLASH_COMPILATION_CACHE=DIR`` moves it, ``DFLASH_COMPILATION_CACHE=0`` turns it off;
JAX's own ``JAX_COMPILATION_CACHE_DIR``, where set, is left to JAX. JAX keys each entry by the program, the compile
options and flags (``XLA_FLAGS``), the backend and the jax / jaxlib versions, and stores programs that took at least
``jax_persistent_cache_min_compile_time_secs`` (1 s by default; ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS``) to
compile. A program of your own process is cached only where you turn the cache on yourself (``enable``).
"""
from __future__ import annotations

import os
import sys

ENV = "DFLASH_COMPILATION_CACHE"
OFF = ("", "0", "off", "false", "no", "none")


def cache_dir(environ) -> str | None:
    """Where the cache lives by ``environ`` (None: off, or JAX's own setting stands)."""
    value = environ.get(ENV)
    if value is not None:
        return None if value.strip().lower() in OFF else os.path.expanduser(value)
    if environ.get("JAX_COMPILATION_CACHE_DIR"):
        return None
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dflash_jax", "xla")


def enable(environ=None) -> str | None:
    """Turn the cache on in this process, before its first compile -> the folder (None: off). A folder that cannot
    be made leaves it off, saying so in one line on stderr."""
    import jax

    path = cache_dir(os.environ if environ is None else environ)
    if path is None:
        return None
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        print(f"warning: no compilation cache ({ENV}={path}: {e.strerror}); every program compiles afresh",
              file=sys.stderr)
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    return path
