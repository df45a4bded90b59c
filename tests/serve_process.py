"""``python -m infer.serve`` started as a user starts it, for the tests that drive it over HTTP: one place that
waits for it to come up and stops it."""
from __future__ import annotations

import contextlib
import subprocess
import sys
import time

import httpx
import pytest

from infer.serve.launch import free_port


@contextlib.contextmanager
def serve_cli(args: list[str], log_path):
    """The server with ``args`` on a free port, its output in the file ``log_path`` (a pipe nobody reads would fill
    and stall it) -> (process, base URL) once /health answers; killed at the end if it still runs."""
    port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "infer.serve", "--port", str(port), *args], stdout=log,
                                stderr=subprocess.STDOUT, text=True)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited with {proc.returncode}: {open(log_path).read()}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"the server did not come up: {open(log_path).read()}")
            time.sleep(0.5)
        try:
            yield proc, base
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
