"""Execute ``notebooks/colab_quickstart.ipynb`` top to bottom on CPU (nbclient), offline.

The notebook's network cells skip themselves (``DFLASH_OFFLINE=1``). Two runs:
- ``tiny`` (fast suite, ~45 s here): a tiny random pair written here and passed to the notebook through its
  test hook (``DFLASH_DEMO_TARGET`` / ``DFLASH_DEMO_DRAFT``), so every cell runs on every CI pass;
- ``demo`` (slow): the embedded demo pair exactly as a user gets it, when
  ``dflash_jax/demo/draft/config.json`` exists (skipped otherwise).
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import nbclient
import nbformat
import pytest

from pairs import pair_dirs

REPO = Path(__file__).resolve().parents[1]

NOTEBOOK = REPO / "notebooks" / "colab_quickstart.ipynb"
DEMO_DRAFT_CONFIG = REPO / "dflash_jax" / "demo" / "draft" / "config.json"
def kernel_manager(spec_root: Path, env: dict):
    """A kernel manager for a kernelspec that runs THIS interpreter (no user-level kernel install needed)."""
    from jupyter_client import KernelManager
    from jupyter_client.kernelspec import KernelSpecManager

    name = "dflash-test-python"
    (spec_root / name).mkdir(parents=True)
    (spec_root / name / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "dflash_jax test kernel", "language": "python", "env": env,
    }))
    return KernelManager(kernel_name=name, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(spec_root)]))


def cell_text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        elif "data" in out:
            parts.append(out["data"].get("text/plain", ""))
    return "".join(parts)


@pytest.mark.parametrize("pair", ["tiny", pytest.param("demo", marks=pytest.mark.slow)])
def test_notebook_runs_offline_on_cpu(tmp_path, pair):
    if pair == "demo" and not DEMO_DRAFT_CONFIG.is_file():
        pytest.skip(f"the embedded demo pair is not there yet ({DEMO_DRAFT_CONFIG})")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit the notebook without outputs"
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    # no placeholder URL to install from: the user sets DFLASH_JAX_REPO (or runs inside a checkout)
    assert "OWNER" not in code and not re.search(r"=\s*[\"']https?://", code)
    assert "subprocess.Popen" not in code and '"-m", module' not in code  # no CLI in a subprocess (TPU is per process)

    env = {
        "DFLASH_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_llvm_disable_expensive_passes=true",  # one CPU device (not conftest's 8 fakes)
        "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
        "DFLASH_DEMO_TARGET": "", "DFLASH_DEMO_DRAFT": "",
    }
    if pair == "tiny":
        env["DFLASH_DEMO_TARGET"], env["DFLASH_DEMO_DRAFT"] = pair_dirs(str(tmp_path / "pair"))[:2]

    km = kernel_manager(tmp_path / "kernels", env)
    client = nbclient.NotebookClient(nb, km=km, timeout=300, allow_errors=False,
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})  # Jupyter starts in the notebook folder
    client.execute()  # raises CellExecutionError (with the traceback) if a cell fails
    if os.environ.get("DFLASH_NOTEBOOK_OUT"):  # debugging aid: keep the executed notebook
        nbformat.write(nb, os.environ["DFLASH_NOTEBOOK_OUT"])

    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    text = "\n".join(cell_text(c) for c in nb.cells if c.cell_type == "code")
    assert "dependencies are installed" in text and "skipping install" in text  # the installed checkout
    assert "backend: cpu" in text and "devices: [CpuDevice" in text
    assert "skipping the Hugging Face example: no network (DFLASH_OFFLINE=1 is set)" in text
    assert "speedup" in text and "tau" in text
    assert "identical outputs: True" in text and "identical: True" in text
    for step in ("demo", "benchmark"):  # each step really ran on the kernel's own backend
        assert f"[{step}] ran on: cpu (kernel backend: cpu)" in text, step
    assert any("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", [])), "no plot"
