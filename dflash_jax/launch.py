"""What every command line (``python -m infer.*`` / ``train*``, the ``dflash-*`` scripts) does first, in its
``main()``: stop in one line when ``dflash_jax`` is a shadowing folder, re-run itself with huge pages, and turn on the
persistent compilation cache. Importing a package does none of these."""
from __future__ import annotations

import sys

import dflash_jax
from dflash_jax import compile_cache, huge_pages


def require_the_package(package=dflash_jax) -> None:
    """Exit in one line when ``dflash_jax`` imported as a folder without ``__init__.py`` (a clone named
    dflash_jax in the current directory: Python finds it before the editable install's finder), not as the package
    (which would fail later with "module 'dflash_jax' has no attribute ...")."""
    if getattr(package, "__file__", None) is None:
        where = ", ".join(getattr(package, "__path__", None) or ["?"])
        print(f"error: 'dflash_jax' imported the folder {where} (no __init__.py: a clone named dflash_jax in the "
              "current directory?) instead of the installed package; run from another directory", file=sys.stderr)
        raise SystemExit(2)


def launch() -> None:
    """The start of a CLI's ``main()``: the package check; then, where this process is one of the project's command
    lines (``huge_pages.command_line``; not a ``main()`` called from a test or a notebook), the huge-pages re-run (the
    new process starts over, before any work) and the persistent compilation cache (``compile_cache``)."""
    require_the_package()
    main_module = getattr(sys.modules.get("__main__"), "__spec__", None)
    if huge_pages.command_line(getattr(main_module, "name", None), sys.argv[0]):
        huge_pages.reexec()
        compile_cache.enable()
