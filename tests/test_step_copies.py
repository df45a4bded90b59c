"""The compiled decode step updates its caches in place: no copy of a cache buffer, and temporary memory a small
fraction of the caches, for every state kind (full, sliding ring, recurrent, latent, kv-shared), on one device and
on a data=2,tensor=2 mesh, unrolled and scanned (``scan_layers``). Read from the optimized HLO and XLA's memory analysis (deterministic), not from timings:
a cache copied every step costs on every device and would eat the speculative speedup (issue #34)."""
from __future__ import annotations

import functools
import math

import jax
import pytest
from hf_models import hf_config
from pairs import random_draft, tiny_target_config

from dflash_jax import decode, hlo, state
from dflash_jax import model_sharding as ms
from dflash_jax import sharding as sh
from dflash_jax.families import config_from_hf
from dflash_jax.target import Target, init_params, scanned

MAX_LEN = 8192  # long caches: the step's own temporaries (one layer's attention tiles, logits) stay far below them
NEW = 7000
QWEN35 = dict(vocab_size=96, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
DEEPSEEK = {"hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 8, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 4,
            "kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 8, "v_head_dim": 12, "qk_nope_head_dim": 16,
            "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "tie_word_embeddings": False}
GEMMA4 = dict(vocab_size=96, hidden_size=32, intermediate_size=32, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
              attention_k_eq_v=True, layer_types=["full_attention"] * 6, sliding_window=8, num_kv_shared_layers=3,
              hidden_size_per_layer_input=4, vocab_size_per_layer_input=96, tie_word_embeddings=True,
              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})


def gemma4_config():
    """Gemma 4: layers 3-5 read layer 2's keys / values (kv-shared)."""
    import transformers

    return config_from_hf(transformers.Gemma4TextConfig(max_position_embeddings=MAX_LEN, **GEMMA4).to_dict())


KINDS = {
    "full": lambda: tiny_target_config(max_position_embeddings=MAX_LEN),
    "sliding": lambda: tiny_target_config(max_position_embeddings=MAX_LEN, sliding_window=8,
                                          layer_types=("sliding_attention", "full_attention") * 2),
    "recurrent": lambda: config_from_hf(hf_config("qwen3_5", max_position_embeddings=MAX_LEN, **QWEN35).to_dict()),
    "latent": lambda: config_from_hf(hf_config("deepseek_v3", max_position_embeddings=MAX_LEN, **DEEPSEEK).to_dict()),
    "shared": gemma4_config,
}
KIND_OF = {"full": state.FullKV, "sliding": state.SlidingKV, "recurrent": state.Recurrent, "latent": state.FullKV,
           "shared": state.SharedKV}


@functools.cache
def pair(kind: str, scan: bool = False):
    """(target, draft) of a cache ``kind``; ``scan``: the target's layers scanned (``target.scanned``)."""
    cfg = KINDS[kind]()
    n = cfg.num_hidden_layers
    target = scanned(Target(cfg, init_params(cfg, 0)), scan)
    return target, random_draft(cfg, target_layer_ids=tuple(sorted({0, n // 2, n - 1})))


def layer_states(cache) -> list:
    """Every layer's state, a scanned group's (``state.Stacked``) as its one inner state of stacked leaves."""
    return [s.inner if isinstance(s, state.Stacked) else s for s in cache.layers]


def carried_buffers(cache) -> list:
    """The buffers a step must update in place: K / V of attention layers (full, ring, latent) and the per-token
    stash of recurrent ones. A recurrent layer's state itself is recomputed by the commit's fold every step, so a
    copy of it is the recurrence's own work, not a cache copy."""
    out = []
    for layer in layer_states(cache) if cache is not None else ():  # no draft: no draft cache
        if isinstance(layer, (state.FullKV, state.SlidingKV)):
            out += [layer.k, layer.v]
        elif isinstance(layer, state.Recurrent):
            out += jax.tree_util.tree_leaves(layer.stash)
    return out


def step_audit(kind: str, mesh_spec: str | None, scan: bool = False, rows: int = 4, plain: bool = False):
    """(cache-shaped copies in the compiled step of ``rows`` rows (``plain``: no draft), its temp bytes, the cache
    bytes per device, the state). Scanned: one layer's slice of a stacked buffer (rows first, then layers) counts
    as a copy too."""
    target, draft = pair(kind, scan)
    if mesh_spec:
        mesh = sh.make_mesh(mesh_spec, devices=jax.devices()[:4])
        target, draft = ms.shard_target(target, mesh), ms.shard_draft(draft, mesh)
    prompts = [[3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14], [5, 6]][:rows]
    lowered, st = decode.lower_step(target, None if plain else draft, prompts, max_new_tokens=NEW)
    compiled = lowered.compile()
    buffers = carried_buffers(st.tcache) + carried_buffers(st.dcache)
    shapes = {b.sharding.shard_shape(b.shape) for b in buffers}
    shapes |= {s[:1] + s[2:] for s in shapes if scan and len(s) > 3}
    per_device = sum(math.prod(b.sharding.shard_shape(b.shape)) * b.dtype.itemsize for b in buffers)
    return hlo.copies_of(compiled.as_text(), shapes), hlo.memory(compiled)["temp_bytes"], per_device, st


SCANNED = ("full", "sliding", "recurrent")  # tiny targets that scan (the latent one: dense, sparse; shared: none)
ON_MESH = ("full", "sliding", "recurrent", "latent")  # a Gemma 4 draft's context cache is copied on a mesh: not yet


@pytest.mark.parametrize("kind,mesh_spec,scan", [(k, None, False) for k in KINDS]
                         + [(k, "data=2,tensor=2", False) for k in ON_MESH]
                         + [(k, m, True) for k in SCANNED for m in (None, "data=2,tensor=2")])
def test_step_updates_caches_in_place(kind, mesh_spec, scan):
    """Unrolled, and scanned (``scan_layers``: stacked caches read and written through the scan's carry)."""
    copies, temp, cache_bytes, st = step_audit(kind, mesh_spec, scan)
    assert any(isinstance(s, KIND_OF[kind]) for s in layer_states(st.tcache))  # the kind under test is really there
    assert not scan or any(isinstance(s, state.Stacked) for s in st.tcache.layers)
    assert copies == [], f"the step copies cache buffers: {copies}"
    # 0.25: one layer's attention tiles and the block's logits are what a step keeps live beside its caches; a
    # cache copied per step (or a fresh output cache instead of the donated one) is 1.0 or more.
    assert temp <= 0.25 * cache_bytes, f"step temp {temp} bytes vs caches {cache_bytes} bytes"


@pytest.mark.parametrize("scan", [False, True])
def test_a_plain_step_of_one_row_updates_caches_in_place(scan):
    """One row, one token a step: a cache write of one update, which XLA makes a dynamic-update-slice (in a scan it
    then copied the whole stack at every layer, until such writes became two updates: ``state.two_at_least``)."""
    copies, *_ = step_audit("full", None, scan, rows=1, plain=True)
    assert copies == [], f"the step copies cache buffers: {copies}"


def test_the_audit_sees_a_cache_copy(monkeypatch):
    """Put back the read-beside-write ring update (attend to [old ring | new tokens], write the ring beside it):
    XLA then copies the carried ring every step, and the audit must say so."""
    update = state.SlidingKV.update

    def read_beside_write(self, k_new, v_new, positions):
        new, *rest = update(self.replace(window=self.k.shape[1]), k_new, v_new, positions)  # the prefill's path
        return (new.replace(window=self.window), *rest)

    monkeypatch.setattr(state.SlidingKV, "update", read_beside_write)
    jax.clear_caches()  # the step traced with the in-place update must not be reused
    copies, *_ = step_audit("sliding", None)
    jax.clear_caches()
    assert copies, "a ring read beside its own write should be copied by XLA"


def pool_shapes(pools) -> set:
    """The shapes a copy of a pool would have: whole, flattened to pages (a scanned group's: every layer's pages,
    a layer's alone)."""
    return ({p.shape for p in pools} | {(p.shape[0] * p.shape[1],) + p.shape[2:] for p in pools}
            | {p.shape[1:] for p in pools if p.ndim > len(state.PAGE_AXES)})


def paged_audit(kind: str, bucket: int, scan: bool = False):
    """(pool-shaped copies in the compiled paged run over ``bucket`` live rows, its temp bytes, the pools' bytes,
    the engine)."""
    import numpy as np

    from dflash_jax.decode import steps

    target, draft = pair(kind, scan)
    engine = decode.Engine(target, draft, decode.DecodeOptions(max_new_tokens=NEW), max_batch=4, max_length=MAX_LEN)
    st = engine.empty()
    at, n = np.arange(bucket, dtype=np.int32), np.int32(1)
    compiled = engine._compiled("run_rows", steps.run_rows_jit, st, at, n)
    pools = jax.tree_util.tree_leaves(st.pools)
    return (hlo.copies_of(compiled.as_text(), pool_shapes(pools)), hlo.memory(compiled)["temp_bytes"],
            sum(p.size * p.dtype.itemsize for p in pools), engine)


@pytest.mark.parametrize("kind,bucket,scan", [(k, 1, False) for k in KINDS] + [("full", 4, False)]
                         + [(k, 1, True) for k in SCANNED])
def test_paged_run_updates_pools_in_place(kind, bucket, scan):
    """The paged engine's run (live rows gathered, pools read and written in place): no copy of a pool, for every
    cache kind beside the pages, for two row buckets (a bucket change gathers rows, never pages) and with scanned
    layers (stacked pools read through a layer-offset table)."""
    copies, temp, pool_bytes, engine = paged_audit(kind, bucket, scan)
    assert engine.paged and pool_bytes > 0
    assert copies == [], f"the paged run copies pools: {copies}"
    # 0.5: the reference attention gathers one layer's pages per live row (measured 0.11 of the pools at 1 live row
    # of 4, 0.42 at 4, 0.19 with recurrent stashes); a copied pool (or a fresh one beside the donated) is 1.0 or more
    assert temp <= 0.5 * pool_bytes, f"run temp {temp} bytes vs pools {pool_bytes} bytes"


def admit_audit(kind: str, scan: bool = False):
    """(pool-shaped copies in the compiled paged admission of one prompt, the engine): its prefill writes the
    prompt's pages in place."""
    import numpy as np

    from dflash_jax.decode import prepare, steps

    target, draft = pair(kind, scan)
    engine = decode.Engine(target, draft, decode.DecodeOptions(max_new_tokens=NEW), max_batch=4, max_length=MAX_LEN)
    st = engine.empty()
    requests = [decode.Request(list(range(3, 60)))]  # a prefill past the decode kernels' query count
    settings = engine.check(requests)
    budget = prepare.budgets([57], settings, engine.max_length)
    engine.pool.grow(0, 57)
    args = (st, engine._rows(requests, settings, budget, pad_to=1), np.zeros((1,), np.int32), engine.pool.table[:1])
    compiled = engine._compiled("admit", steps.admit_jit, *args)
    pools = jax.tree_util.tree_leaves(st.pools)
    return hlo.copies_of(compiled.as_text(), pool_shapes(pools)), engine


@pytest.mark.parametrize("kind,scan", [(k, False) for k in KINDS] + [("full", True)])
def test_paged_admission_writes_pools_in_place(kind, scan):
    """A prefill into pages writes them in place: its attention reads the cache below its first position after
    the write (reading the pool beside its own write made XLA copy every pool at every admission: 10x the
    prefill's time at 64 rows)."""
    copies, engine = admit_audit(kind, scan)
    assert engine.paged
    assert copies == [], f"the paged admission copies pools: {copies}"
