"""Packaging: the Pallas kernels are ``dflash_jax.kernels`` (never a top-level ``kernels``, the name of Hugging
Face's kernel hub, which transformers imports) and import nothing from the rest of the library."""
import ast
import importlib.metadata
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE_ROOTS = ("dflash_jax", "infer", "train")


def _setuptools_config():
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_pyproject_lists_every_package_of_the_tree():
    cfg = _setuptools_config()
    assert "package-dir" not in cfg  # every package is the folder of its name
    in_tree = {".".join(init.parent.relative_to(REPO).parts)
               for root in PACKAGE_ROOTS for init in (REPO / root).rglob("__init__.py")}
    assert sorted(cfg["packages"]) == sorted(in_tree)
    assert not any(p == "kernels" or p.startswith("kernels.") for p in cfg["packages"])


def test_installed_distribution_has_no_top_level_kernels():
    """top_level.txt is what ``packages_distributions`` (and so transformers' package probe) reads."""
    top_level = importlib.metadata.distribution("dflash_jax").read_text("top_level.txt").split()
    assert sorted(top_level) == ["dflash_jax", "infer", "train"], "stale install: rerun pip install -e ."


def _not_own(folder: Path) -> bool:
    """A folder inside a checkout that holds none of its own files: a virtual environment (``python3 -m venv .venv``,
    as README says: it has a pyvenv.cfg) or .git."""
    return folder.name == ".git" or (folder / "pyvenv.cfg").is_file()


def in_own_tree(root: Path, path: Path) -> bool:
    """Whether ``path`` is one of the checkout ``root``'s own files: under it, and in no folder that ``_not_own``."""
    root, path = root.resolve(), path.resolve()
    return path.is_relative_to(root) and not any(_not_own(d) for d in path.parents if d.is_relative_to(root) and d != root)


def kernel_hub_shadows(root: Path) -> list[Path]:
    """The ``kernels`` folders and ``kernels.py`` files of the checkout ``root``'s own tree that Python would import as
    the top-level ``kernels`` wherever their folder is on sys.path (it is no package: no __init__.py), virtual
    environments and .git inside it skipped (their ``kernels`` is the real one)."""
    found = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if not _not_own(Path(folder, d)))
        if "__init__.py" not in files:
            found += [Path(folder, n) for n in ("kernels", "kernels.py") if n in subfolders or n in files]
    return found


def test_the_shadow_scan_skips_virtual_environments(tmp_path):
    """A venv made inside the checkout holds Hugging Face's ``kernels`` in its site-packages: not a shadow; a
    top-level ``kernels/`` (or one in a plain folder such as scripts/) is, a subpackage ``kernels`` is not."""
    site = tmp_path / ".venv" / "lib" / "python3.11" / "site-packages" / "kernels"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("")
    (tmp_path / ".venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (tmp_path / "pkg" / "kernels").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    assert kernel_hub_shadows(tmp_path) == []
    assert not in_own_tree(tmp_path, site / "__init__.py") and in_own_tree(tmp_path, tmp_path / "pkg" / "kernels")
    (tmp_path / "kernels").mkdir()
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "kernels.py").write_text("")
    assert kernel_hub_shadows(tmp_path) == [tmp_path / "kernels", tmp_path / "scripts" / "kernels.py"]


def test_the_checkout_root_does_not_shadow_the_kernel_hub():
    """Python puts the folder it runs from first on sys.path (``python -m pytest``, ``python -m infer.generate`` from
    the checkout): a ``kernels`` there shadowed Hugging Face's ``kernels``, which transformers 5.25 imports with its
    PyTorch models (``ImportError: cannot import name 'CUDAProperties' from 'kernels'``). Found from the checkout,
    ``kernels`` is none of its own files (the real one may lie in a venv inside it, as README's install makes)."""
    import subprocess
    import sys

    probe = "import importlib.util as u; s = u.find_spec('kernels'); print(s.origin if s else '-')"
    r = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    found = r.stdout.strip()
    assert found == "-" or not in_own_tree(REPO, Path(found)), found
    assert kernel_hub_shadows(REPO) == []


def test_kernels_import_nothing_from_the_library():
    """Dependencies run one way (library -> kernels): inside dflash_jax/kernels/ every import of its own is relative
    to the folder itself (``from .tiling``), never to the library above it (``from ..``)."""
    paths = sorted((REPO / "dflash_jax" / "kernels").glob("*.py"))
    assert len(paths) >= 5, paths
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level > 1:
                names = ["dflash_jax (" + "." * node.level + (node.module or "") + ")"]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module]
            else:
                continue
            assert not [n for n in names if n.split(".")[0] in {"dflash_jax", "infer", "train"}], \
                f"{path.name}:{node.lineno} imports {names}"


INSTALL_STEPS = ("python3 -m venv", "pip install")


def _install_block() -> list[str]:
    """The venv and pip commands of README's first code block under "## Install" (the CPU install)."""
    text = (REPO / "README.md").read_text().split("## Install", 1)[1]
    block = text.split("```bash", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip().startswith(INSTALL_STEPS)]


def test_ci_installs_exactly_as_the_readme_says():
    """.ci/run runs README's CPU install commands, in the same order (quiet flags aside), before the test suite,
    its virtual environment made in the clone as README's (what it installs after the tests, the docs extra for
    mkdocs, is its own)."""
    readme = _install_block()
    before_tests = (REPO / ".ci" / "run").read_text().split("python -m pytest", 1)[0]
    ci = [line.strip().replace(" --quiet", "") for line in before_tests.splitlines()
          if line.strip().startswith(INSTALL_STEPS)]
    assert readme and readme == ci, (readme, ci)
    assert readme[0] == "python3 -m venv .venv && source .venv/bin/activate"  # in the clone, as a newcomer's
    assert any("torch==2.13.0" in c and "whl/cpu" in c for c in readme)  # the CPU torch before the test extra
    assert readme[-2:] == ['pip install -e ".[test]"', 'pip install -e ".[plan]"']  # the planner's libtpu last


def test_ci_runs_the_readmes_fast_suite_command():
    """.ci/run's test command is README's fast-suite line, word for word (the worker count included)."""
    readme = (REPO / "README.md").read_text().split("## Test", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    fast = [line.split("#", 1)[0].strip() for line in readme.splitlines() if "not slow" in line]
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line.strip().startswith("python -m pytest")]
    assert len(fast) == 1 and ci == fast, (fast, ci)


def test_console_scripts_are_the_clis():
    """Every [project.scripts] entry names a module's ``main`` that exists (the same CLI as ``python -m``)."""
    import importlib
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert {"dflash-generate", "dflash-benchmark", "dflash-train", "dflash-serve"} <= set(scripts)
    for name, target in scripts.items():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func)), name


def test_console_script_runs_from_a_folder_that_shadows_the_packages(tmp_path):
    """``dflash-generate`` from a research folder with its own ``infer/`` and ``train.py`` runs our CLI."""
    import subprocess
    import sys

    exe = Path(sys.executable).parent / "dflash-generate"
    assert exe.is_file(), f"{exe} missing: reinstall with pip install -e ."
    (tmp_path / "infer").mkdir()
    (tmp_path / "infer" / "__init__.py").write_text("raise SystemExit('the local infer/ was imported')\n")
    (tmp_path / "train.py").write_text("raise SystemExit('the local train.py was imported')\n")
    r = subprocess.run([str(exe), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--tree-budget" in r.stdout, r.stderr


@pytest.mark.parametrize("module", ["infer.generate", "train.demo_recipe", "train"])
def test_a_clone_folder_named_dflash_jax_is_named_as_the_cause(module, tmp_path):
    """From the folder holding a clone named ``dflash_jax`` (here: an empty ``dflash_jax/``), Python imports that
    folder as a namespace package before the editable install's finder: the CLIs say so in one line, exit 2."""
    import subprocess
    import sys

    (tmp_path / "dflash_jax").mkdir()
    r = subprocess.run([sys.executable, "-m", module, "--help"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    err = r.stderr.strip()
    assert r.returncode == 2 and "\n" not in err and "Traceback" not in err, err
    assert err.startswith("error: 'dflash_jax' imported the folder") and str(tmp_path / "dflash_jax") in err, err


def test_test_extra_holds_the_serve_extra():
    """The server's tests run from the test extra alone: it repeats every requirement of the serve extra."""
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"fastapi", "uvicorn", "sse-starlette", "prometheus_client", "openai"} <= {
        r.split(">")[0].split("=")[0] for r in extras["serve"]}
    assert set(extras["serve"]) <= set(extras["test"])
