"""Two processes on localhost (``jax.distributed`` over gloo CPU collectives, one CPU device each) run
``python -m infer.generate --mesh data=2`` as the README documents a multi-host launch; process 0 prints the
results, which equal one process's plain decoding. (It crashed before: the dtype probe touched the backend
before ``jax.distributed.initialize``.)"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import dflash_jax as dj
from pairs import pair_dirs

PROMPTS = [[5, 17, 3], [9, 4]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_generate_equals_one(tmp_path):
    tdir, ddir, target = pair_dirs(str(tmp_path / "pair"))
    port = _free_port()
    argv = [sys.executable, "-m", "infer.generate", "--target", tdir, "--draft", ddir, "--max-new-tokens", "12",
            "--ignore-eos", "--json", "--mesh", "data=2"] + [a for p in PROMPTS for a in ("--prompt-ids",
                                                                                       ",".join(map(str, p)))]
    procs = []
    for i in range(2):
        env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
                   XLA_FLAGS="--xla_force_host_platform_device_count=1 --xla_llvm_disable_expensive_passes=true",
                   JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i))
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    rows = [json.loads(line) for line in outs[0][0].splitlines() if line.startswith("{")]
    plain = dj.generate(target, PROMPTS, max_new_tokens=12, stop_token_ids=[])
    assert [r["output_ids"] for r in rows] == [r.output_ids for r in plain]
    assert not [line for line in outs[1][0].splitlines() if line.startswith("{")]  # only process 0 prints
