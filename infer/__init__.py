"""Command-line inference: ``python -m infer.generate`` and ``python -m infer.benchmark``."""
import sys

from infer import huge_pages

if huge_pages.command_line(sys.argv[0]):  # before the heavy imports below
    huge_pages.reexec()

import dflash_jax  # noqa: E402


def require_the_package(package=dflash_jax) -> None:
    """Exit in one line when ``dflash_jax`` imported as a folder without ``__init__.py`` (a clone named
    dflash_jax in the current directory: Python finds it before the editable install's finder), not as the package
    (which would fail later with "module 'dflash_jax' has no attribute ...")."""
    if getattr(package, "__file__", None) is None:
        where = ", ".join(getattr(package, "__path__", None) or ["?"])
        print(f"error: 'dflash_jax' imported the folder {where} (no __init__.py: a clone named dflash_jax in the "
              "current directory?) instead of the installed package; run from another directory", file=sys.stderr)
        raise SystemExit(2)


require_the_package()
