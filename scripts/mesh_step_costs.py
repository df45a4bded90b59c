"""Peak memory per device and collectives of one compiled decode step on a fake 8-device CPU mesh.

    python scripts/mesh_step_costs.py [--impl interpret] [--mesh data=8 --mesh data=2,tensor=4]

The demo pair (``dflash_jax.demo``), 8 prompts; the step is ``decode.lower_step`` compiled for each
mesh. ``--impl``: the decode attention (``interpret``: the Pallas kernel in interpret mode, per shard on a
mesh; ``auto``: the jnp loop on CPU). Counts are HLO instructions of the compiled (partitioned) step.
"""
from __future__ import annotations

import argparse
import json
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

from dflash_jax import decode, hlo, load_draft, load_target  # noqa: E402
from dflash_jax import model_sharding as ms  # noqa: E402
from dflash_jax import sharding as sh  # noqa: E402
from dflash_jax.demo import DEMO_DRAFT, DEMO_TARGET  # noqa: E402


def step_costs(target, draft, prompts, mesh_spec: str, impl: str) -> dict:
    mesh = sh.make_mesh(mesh_spec)
    ts, ds = ms.shard_target(target, mesh), ms.shard_draft(draft, mesh)
    compiled = decode.lower_step(ts, ds, prompts, max_new_tokens=32, attention_impl=impl)[0].compile()
    mem = hlo.memory(compiled)
    return {"mesh": mesh_spec, "impl": impl, "peak_bytes_per_device": mem["peak_bytes"],
            "temp_bytes": mem["temp_bytes"], "argument_bytes": mem["argument_bytes"],
            **hlo.collective_counts(compiled.as_text())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impl", default="interpret", choices=["auto", "interpret", "loop"])
    p.add_argument("--mesh", action="append", default=None)
    args = p.parse_args()
    target, draft = load_target(DEMO_TARGET), load_draft(DEMO_DRAFT)
    prompts = [list(range(3, 3 + n)) for n in (5, 9, 3, 17, 7, 2, 11, 6)]
    for spec in args.mesh or ["data=8", "data=2,tensor=4"]:
        print(json.dumps(step_costs(target, draft, prompts, spec, args.impl)))


if __name__ == "__main__":
    main()
