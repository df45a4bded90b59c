"""Kimi-K2.5's latent decode cache: bytes per token against an expanded K/V cache (from the family's state specs),
and one decode step's attention on this machine, absorbed (over the latent) against expanded per step.

    python scripts/mla_cache.py [--heads 16] [--context 2048] [--queries 4]

The timing uses Kimi-K2.5's per-head sizes (kv_lora_rank 512, qk_rope 64, qk_nope 128, v 128) with fewer heads
(CPU); the absorbed step attends MQA over [c | k_rot] and expands the result, the expanded one first runs
kv_b_proj over every cached token (the cost the latent cache trades for its size).
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.attention import decode_attention
from dflash_jax.families.deepseek_v3 import DeepseekV3Config, state_specs
from dflash_jax.state import LayerStates, KVSpec

KIMI = {"model_type": "deepseek_v3", "vocab_size": 163840, "hidden_size": 7168, "num_hidden_layers": 61,
        "num_attention_heads": 64, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
        "v_head_dim": 128, "q_lora_rank": 1536, "n_routed_experts": 384, "num_experts_per_tok": 8, "n_group": 1,
        "topk_group": 1}


def bytes_per_token(specs, dtype=jnp.bfloat16) -> int:
    """A one-slot, one-row cache's bytes (shapes only: nothing is allocated)."""
    cache = jax.eval_shape(lambda: LayerStates.create(specs, 1, 1, dtype, max_block=1))
    return sum(x.size * x.dtype.itemsize for s in cache.layers for x in jax.tree_util.tree_leaves(s))


def timed(fn, *args, repeat: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--queries", type=int, default=4, help="tokens per step (a verify block)")
    a = ap.parse_args()
    c = DeepseekV3Config.from_hf(KIMI)
    latent = bytes_per_token(state_specs(c))
    full = KVSpec(c.num_attention_heads, c.head_dim, v_head_dim=c.v_head_dim)  # every head's k_nope | k_rot and v
    expanded = bytes_per_token((full,) * c.num_hidden_layers)
    print(f"Kimi-K2.5 bf16 cache per token: latent {latent:,} B, expanded K/V {expanded:,} B "
          f"({expanded / latent:.1f}x)")

    n, s, t = a.heads, a.context, a.queries
    r, rope, nope, dv = c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim
    rng = np.random.default_rng(0)

    def arr(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32) * 0.1)

    q, w = arr(1, t, n, nope + rope), arr(r, n, nope + dv)
    keys, q_pos = arr(1, s, 1, r + rope), jnp.arange(s - t, s, dtype=jnp.int32)[None]
    lengths, scale = jnp.array([s], jnp.int32), (nope + rope) ** -0.5

    @jax.jit
    def absorbed(q, keys, w):
        q_lat = jnp.einsum("BTNP,RNP->BTNR", q[..., :nope], w[..., :nope])
        o = decode_attention(jnp.concatenate([q_lat, q[..., nope:]], -1), keys, keys[..., :r], q_pos, lengths,
                             scale=scale, impl="loop")
        return jnp.einsum("BTNR,RNV->BTNV", o, w[..., nope:])

    @jax.jit
    def expand(q, keys, w):
        kv = jnp.einsum("BSR,RNF->BSNF", keys[:, :, 0, :r], w)
        k = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(keys[..., r:], (1, s, n, rope))], -1)
        return decode_attention(q, k, kv[..., nope:], q_pos, lengths, scale=scale, impl="loop")

    np.testing.assert_allclose(absorbed(q, keys, w), expand(q, keys, w), rtol=1e-3, atol=1e-4)
    ta, te = timed(absorbed, q, keys, w), timed(expand, q, keys, w)
    print(f"{jax.default_backend()}: one step, {n} heads, {s} cached tokens, {t} queries: absorbed {ta * 1e3:.2f} ms, "
          f"expanded per step {te * 1e3:.2f} ms ({te / ta:.1f}x)")


if __name__ == "__main__":
    main()
