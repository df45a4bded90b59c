"""Two processes on localhost (``jax.distributed`` over gloo CPU collectives, one CPU device each) run the
CLIs as the README documents a multi-host launch, and give one process's results:
``python -m infer.generate --mesh data=2`` (process 0 prints the results, which equal plain decoding; it
crashed before: the dtype probe touched the backend before ``jax.distributed.initialize``) and
``python -m train --mesh fsdp=2`` with a checkpoint save and a resume (the same metrics and export as one
process over two devices; each process writes its part of the checkpoint, only process 0 logs)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

import dflash_jax as dj
from pairs import pair_dirs

PROMPTS = [[5, 17, 3], [9, 4]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(argv, *, n_procs: int, devices_each: int) -> list[subprocess.Popen]:
    """``argv`` in ``n_procs`` processes (one jax.distributed job over gloo when more than one)."""
    port, procs = _free_port(), []
    for i in range(n_procs):
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_each} "
                             "--xla_llvm_disable_expensive_passes=true")
        if n_procs > 1:
            env.update(JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                       JAX_NUM_PROCESSES=str(n_procs), JAX_PROCESS_ID=str(i))
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def _finish(procs) -> list[tuple[str, str]]:
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return outs


def test_two_processes_generate_equals_one(tmp_path):
    tdir, ddir, target = pair_dirs(str(tmp_path / "pair"))
    argv = [sys.executable, "-m", "infer.generate", "--target", tdir, "--draft", ddir, "--max-new-tokens", "12",
            "--ignore-eos", "--json", "--mesh", "data=2"] + [a for p in PROMPTS for a in ("--prompt-ids",
                                                                                       ",".join(map(str, p)))]
    outs = _finish(_launch(argv, n_procs=2, devices_each=1))
    rows = [json.loads(line) for line in outs[0][0].splitlines() if line.startswith("{")]
    plain = dj.generate(target, PROMPTS, max_new_tokens=12, stop_token_ids=[])
    assert [r["output_ids"] for r in rows] == [r.output_ids for r in plain]
    assert not [line for line in outs[1][0].splitlines() if line.startswith("{")]  # only process 0 prints


# --- training -------------------------------------------------------------------------------------------

TRAIN_FLAGS = ["--draft-layers", "1", "--block-size", "4", "--num-target-features", "2", "--num-anchors", "8",
               "--seq-len", "32", "--batch-size", "2", "--lr", "1e-2", "--dtype", "float32", "--log-every", "1",
               "--save-every", "2", "--eval-num-prompts", "2", "--eval-max-new-tokens", "6", "--no-progress",
               "--mesh", "fsdp=2"]
TIMING = ("tokens_per_s", "step_time_s", "compile_s", "peak_memory_mb", "elapsed_s", "tokens_per_second")


def _train_inputs(root) -> tuple[str, str]:
    """A tiny saved target and a data directory of random sequences (no generation: fast)."""
    from dflash_jax.config import TargetConfig
    from dflash_jax.layers import random_params
    from dflash_jax.target import Target, param_shapes, save_target
    from train.data import write_manifest, write_shard

    tcfg = TargetConfig("qwen3", 96, 32, 64, 4, 4, 2, 8, max_position_embeddings=128, eos_token_id=(95,))
    tdir, data = str(root / "target"), str(root / "data")
    save_target(Target(tcfg, random_params(param_shapes(tcfg), 0)), tdir)
    rng = np.random.default_rng(0)
    seqs = []
    for _ in range(8):
        n, p = int(rng.integers(12, 30)), int(rng.integers(2, 6))
        seqs.append((rng.integers(0, 90, n).astype(np.int32), np.asarray([0] * p + [1] * (n - p), np.uint8)))
    os.makedirs(data)
    entry = write_shard(os.path.join(data, "shard_00000.npz"), seqs)
    write_manifest(data, {"format": "dflash-jax-train-data", "version": 1, "vocab_size": 96, "shards": [entry]})
    return tdir, data


def _metrics(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in f]


@pytest.mark.slow  # two CLI runs of four processes in all, each compiling the step: 86 s on 2 loaded CPU cores
def test_two_processes_train_save_resume_equal_one(tmp_path):
    """``python -m train --mesh fsdp=2``: 3 steps, then resumed from the step-3 checkpoint to 5 steps, in two
    processes (one CPU device each) and in one process over two devices: the same metrics (losses, gradient
    norms, acceptance lengths) and the same exported draft, bit for bit. Each process writes its own part of
    the checkpoint (the draft params are split over fsdp); only process 0 logs and writes metrics."""
    tdir, data = _train_inputs(tmp_path)
    outs = {}
    for phase, steps in enumerate(("3", "5")):
        runs = {}
        for name, n_procs, devices in (("two", 2, 1), ("one", 1, 2)):
            argv = [sys.executable, "-m", "train", "--target", tdir, "--data", data, "--out",
                    str(tmp_path / name), "--steps", steps, *TRAIN_FLAGS]
            runs[name] = _launch(argv, n_procs=n_procs, devices_each=devices)
        outs[phase] = {name: _finish(procs) for name, procs in runs.items()}
    two, one = str(tmp_path / "two"), str(tmp_path / "one")
    log0 = outs[1]["two"][0][0]
    assert "resumed from" in log0 and "(step 3, epoch" in log0 and "over 2 devices, 2 process(es)" in log0
    for out1, _ in (outs[0]["two"][1], outs[1]["two"][1]):  # process 1 logs nothing (gloo's own line aside)
        assert [line for line in out1.splitlines() if not line.startswith("[Gloo]")] == []
    got, want = _metrics(two), _metrics(one)
    assert [r["step"] for r in got if not r.get("eval")] == [1, 2, 3, 4, 5]
    assert any(r.get("eval") for r in got)
    assert got == want
    for step in (3, 4, 5):  # (--keep-checkpoints 3)
        files = os.listdir(os.path.join(two, "checkpoints", str(step), "params"))
        assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(files), files
    from train.export import export

    a, b = export(two, str(tmp_path / "export_two")), export(one, str(tmp_path / "export_one"))
    with open(os.path.join(a, "model.safetensors"), "rb") as fa, open(os.path.join(b, "model.safetensors"), "rb") as fb:
        assert fa.read() == fb.read()
