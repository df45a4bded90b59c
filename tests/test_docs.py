"""The module layout is documented once, in the module docstrings and docs/design/architecture.md: the page's module
list must name exactly the package's modules (every .py file under the installed packages' folders)."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ARCHITECTURE = REPO / "docs" / "design" / "architecture.md"
PACKAGE_FOLDERS = ("dflash_jax", "infer", "train")
ROW = re.compile(r"^\| `([\w/]+\.py)` \|", re.M)  # a module-list row: | `path/to/module.py` | role |


def package_modules() -> set[str]:
    return {p.relative_to(REPO).as_posix() for folder in PACKAGE_FOLDERS for p in (REPO / folder).rglob("*.py")}


def documented_modules() -> list[str]:
    return ROW.findall(ARCHITECTURE.read_text())


def test_architecture_page_lists_every_module_once():
    documented = documented_modules()
    assert len(documented) == len(set(documented)), sorted(m for m in documented if documented.count(m) > 1)
    missing = sorted(package_modules() - set(documented))
    stale = sorted(set(documented) - package_modules())
    assert not missing and not stale, (
        f"docs/design/architecture.md's module list is out of date: add {missing}, remove {stale}")


def test_the_row_pattern_reads_the_page():
    """The check above is only as good as its parser: the page's tables hold the library's core modules."""
    assert {"dflash_jax/drafts/model.py", "dflash_jax/decode/steps.py", "dflash_jax/kernels/block_attention.py",
            "infer/serve/app.py", "train/loop.py"} <= set(documented_modules())
