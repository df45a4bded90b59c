"""One Gated DeltaNet layer's verify at a real model's linear-attention shape (default Qwen3.5-4B's: hidden 2560,
16 key / 32 value heads of 128, conv 4), batch 1, float32, on this machine: the chain verify of a block of 16 and
tree verifies of 16 and 64 nodes (random trees), each forward plus its commit (``LayerStates.commit``), jitted,
median of repeats; and the rollback memory per row and layer (``RecurrentSpec``'s stash against a state per
token). ``python scripts/gdn_verify_cost.py [--repeats N]`` prints one JSON line."""
from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import tree as tree_lib
from dflash_jax.families.qwen3_5 import GatedDeltaNet, Qwen35Config, stash_bytes, state_specs


def layer_config(hidden=2560, key_heads=16, value_heads=32, head_dim=128) -> Qwen35Config:
    return Qwen35Config.from_hf(dict(model_type="qwen3_5_text", vocab_size=16, hidden_size=hidden,
                                     intermediate_size=16, num_hidden_layers=1, layer_types=["linear_attention"],
                                     num_attention_heads=16, num_key_value_heads=4, head_dim=256,
                                     linear_num_key_heads=key_heads, linear_num_value_heads=value_heads,
                                     linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
                                     max_position_embeddings=4096, eos_token_id=1))


def measure(cfg, slots: int, parents, repeats: int, max_block: int) -> float:
    """Median seconds of one forward over ``slots`` tokens (a chain, or the tree of ``parents``) plus commit."""
    mod = GatedDeltaNet(cfg)
    rng = np.random.RandomState(0)
    x = jnp.asarray(rng.randn(1, slots, cfg.hidden_size) * 0.1, jnp.float32)
    params = mod.init(jax.random.PRNGKey(0), x[:, :1], jnp.zeros((1, 1), jnp.int32), None)
    st = state_specs(cfg)[0].init(1, 4096, jnp.float32, max_block)
    mask = None if parents is None else tree_lib.ancestor_mask(jnp.asarray(parents)[None])
    positions = jnp.arange(100, 100 + slots, dtype=jnp.int32)[None]

    @jax.jit
    def step(params, x, st):
        _, st = mod.apply(params, x, positions, st, ancestors=mask)
        return st.commit(jnp.full((1,), min(slots, 5), jnp.int32))

    jax.block_until_ready(step(params, x, st))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        st = jax.block_until_ready(step(params, x, st))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=20, help="timed runs of each program (the median is reported)")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    cfg = layer_config()
    rng = np.random.RandomState(1)
    out = {"shape": "Qwen3.5-4B linear attention (hidden 2560, 16 / 32 heads of 128)", "load_1min": os.getloadavg()[0]}
    out["chain_16_s"] = measure(cfg, 16, None, args.repeats, 16)
    for n in (16, 64):
        parents = np.array([-1] + [rng.randint(-1, i) for i in range(1, n)], np.int32)
        out[f"tree_{n}_s"] = measure(cfg, n + 1, parents, args.repeats, n + 1)
    hv, d, c = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.conv_dim
    per_token_state = hv * d * d * 4 + c * 3 * 2  # the scheme the fold replaced: a state (and window) per token
    for n in (16, 65):  # one linear layer, a bf16 cache
        out[f"rollback_bytes_{n}_tokens"] = {"stash": stash_bytes(cfg, n), "state_per_token": (n + 1) * per_token_state}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
