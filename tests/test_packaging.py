"""Packaging: kernels/ installs as ``dflash_jax.kernels`` (never as a top-level ``kernels``, the name of
Hugging Face's kernel hub) and imports nothing from the library."""
import ast
import importlib.metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE_ROOTS = {"dflash_jax": "dflash_jax", "dflash_jax.kernels": "kernels", "infer": "infer", "train": "train"}


def _setuptools_config():
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_pyproject_lists_every_package_and_maps_kernels_under_dflash_jax():
    cfg = _setuptools_config()
    assert cfg["package-dir"] == {"dflash_jax.kernels": "kernels"}
    in_tree = {
        ".".join([name, *init.parent.relative_to(REPO / folder).parts])
        for name, folder in PACKAGE_ROOTS.items()
        for init in (REPO / folder).rglob("__init__.py")
    }
    assert sorted(cfg["packages"]) == sorted(in_tree)
    assert not any(p == "kernels" or p.startswith("kernels.") for p in cfg["packages"])


def test_installed_distribution_has_no_top_level_kernels():
    """top_level.txt is what ``packages_distributions`` (and so transformers' package probe) reads."""
    top_level = importlib.metadata.distribution("dflash_jax").read_text("top_level.txt").split()
    assert sorted(top_level) == ["dflash_jax", "infer", "train"], "stale install: rerun pip install -e ."


def test_dflash_jax_kernels_is_the_kernels_folder():
    import dflash_jax.kernels

    assert Path(dflash_jax.kernels.__file__).parent == REPO / "kernels", \
        "dflash_jax.kernels comes from elsewhere: rerun pip install -e . in this checkout"


def test_kernels_import_nothing_from_the_library():
    """Dependencies run one way (library -> kernels); inside kernels/ every import of its own is relative,
    so the package works under its installed name."""
    for path in sorted((REPO / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module]
            else:
                continue
            assert not [n for n in names if n.split(".")[0] in {"dflash_jax", "infer", "train", "kernels"}], \
                f"{path.name}:{node.lineno} imports {names}"
