"""Test-session setup shared by every test module.

Runs before any test module imports jax or huggingface_hub:
- 8 fake CPU devices (sharded == unsharded tests need a mesh), unless XLA_FLAGS already
  chooses a device count; single-device code still runs on device 0.
- XLA's CPU backend skips its expensive LLVM passes and compiles at LLVM's lowest optimisation level: compiling
  dominates these tiny tests (about 3x faster to compile, then another ~12% off the suite; numerics unchanged: no
  fast-math, so no pass may reorder floating-point arithmetic).
- PyTorch (the reference models) uses one thread: on a shared 2-core machine its default thread pool
  spins, and a tiny forward takes ~1 s instead of ~3 ms.
- The Hugging Face hub is offline: no test may touch the network (CI has none).
- XLA's persistent compilation cache is on for the session, in one temporary folder for all its processes
  (``DFLASH_COMPILATION_CACHE`` for the command lines the tests run as processes, ``JAX_COMPILATION_CACHE_DIR`` in
  this one and in pytest-xdist's workers), every program kept however fast it compiled: a program another module
  or worker compiled loads instead of compiling again. Nothing is written into the user's own cache
  (``tests/test_compile_cache.py`` runs its command lines in folders of their own); the tests that assert a warmed
  engine compiles nothing count the cache's loads as compiles (``pairs.backend_compiles``).
- After each module its compiled programs are released (``_release_compiled_programs``).
- Engines built in this process page by 16 tokens on CPU too (``_pages_of_16``): the CPU default of 128 would hold
  each of these tiny tests' rows in one page, and no test would cross a page. The command lines run as processes
  of their own (the server of ``tests/test_serve.py``) keep the real default.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
if "xla_llvm_disable_expensive_passes" not in _flags:
    _flags += " --xla_llvm_disable_expensive_passes=true"
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = _flags.strip()
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # with libtpu installed (the plan extra) no worker probes for a TPU
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "DFLASH_TESTS_XLA_CACHE" not in os.environ:  # the session's first process: pytest-xdist's workers inherit it
    os.environ["DFLASH_TESTS_XLA_CACHE"] = tempfile.mkdtemp(prefix="dflash_jax_tests_xla_")
    atexit.register(shutil.rmtree, os.environ["DFLASH_TESTS_XLA_CACHE"], ignore_errors=True)
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["DFLASH_COMPILATION_CACHE"] = os.environ["DFLASH_TESTS_XLA_CACHE"]
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """Factory: ``tiny_hf(name, model_type, **config_overrides) -> (dir, torch model)``.

    Saves a random tiny Hugging Face model once per session per ``name`` (see ``hf_models.save_tiny``),
    so test modules can share checkpoints instead of re-creating them.
    """
    from hf_models import save_tiny

    saved = {}

    def make(name: str, model_type: str = "qwen3", **overrides):
        if name not in saved:
            path = tmp_path_factory.mktemp(f"hf_{name}")
            saved[name] = (str(path), save_tiny(path, model_type, **overrides))
        return saved[name]

    return make


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """``pairs.trained_pair`` at its defaults, trained once per session (its callers only read it)."""
    from pairs import trained_pair

    return trained_pair(str(tmp_path_factory.mktemp("trained")))


@pytest.fixture(scope="session", autouse=True)
def _pages_of_16():
    """``decode.slots.default_page()`` is 16 on every platform while the suite runs (module docstring)."""
    from dflash_jax.decode import slots

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(slots, "CPU_PAGE", slots.PAGE)
        yield


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """After each test module, drop the compiled programs it left in this process (jax's caches and the
    engine's AOT table): a whole-suite process otherwise holds hundreds of XLA executables."""
    yield
    import jax

    from dflash_jax.decode import batch

    batch.PROGRAMS.clear()
    jax.clear_caches()
