"""XLA's own account of one compiled closed-batch decode program (prefill + the step's while loop): flops, bytes
accessed, instructions per opcode, and copies by shape. Deterministic, unlike timings, so two commits can be
compared on a loaded machine (issue #34's A/B: run this file from each checkout and diff the JSON).

    python scripts/program_costs.py [--synthetic qwen3-0.6b] [--batch-size 1] [--context 256] \
        [--max-new-tokens 48] [--block-size 16] [--out costs.json]

Random float32 weights of the preset; the draft proposes by replaying plain decoding's output
(``synthetic.ReplayProposer``), as ``infer.benchmark --synthetic`` does.
"""
from __future__ import annotations

import argparse
import collections
import json

import numpy as np

from dflash_jax import hlo
from dflash_jax import synthetic as syn
from dflash_jax.decode import batch as batch_lib
from dflash_jax.decode import generate, steps
from dflash_jax.decode.options import DecodeOptions


def program_costs(name: str, batch: int, context: int, max_new_tokens: int, block: int) -> dict:
    target, draft = syn.synthetic_pair(name, "float32")
    prompts = np.random.default_rng(0).integers(0, target.config.vocab_size, (batch, context)).tolist()
    plain = generate(target, prompts, max_new_tokens=max_new_tokens, stop_token_ids=[])
    replay = syn.ReplayProposer(reference=[r.output_ids for r in plain], probs=syn.geometric_probs(6.5, block))
    b = batch_lib.build(target, draft, prompts, DecodeOptions(max_new_tokens=max_new_tokens, stop_token_ids=[],
                                                              block_size=block, proposer=replay))
    compiled = steps.decode_loop_jit.lower(b.spec, b.inputs, b.rows).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    ops = hlo.instructions(compiled.as_text())
    copies = collections.Counter(f"{i.dtype}{list(i.shape)}" for i in ops if i.opcode == "copy")
    return {"preset": name, "batch": batch, "context": context, "block": block,
            **{k: float(cost[k]) for k in ("flops", "bytes accessed", "transcendentals") if k in cost},
            "memory": hlo.memory(compiled),
            "opcodes": dict(collections.Counter(i.opcode for i in ops).most_common()), "copies": dict(copies)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--synthetic", default="qwen3-0.6b", help="preset (dflash_jax.synthetic)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--out", help="write the JSON here as well")
    a = p.parse_args()
    costs = program_costs(a.synthetic, a.batch_size, a.context, a.max_new_tokens, a.block_size)
    text = json.dumps(costs, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
