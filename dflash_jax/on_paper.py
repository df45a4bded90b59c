"""Programs compiled for devices this host does not have (a TPU slice's abstract devices, ``dflash_jax.chips``), from
abstract parameters and inputs: nothing is allocated, no weight read. Each compiled program reports XLA's memory
analysis (per device) and two cost counts:

- as compiled: XLA's ``cost_analysis()`` of the program that would run. On TPU it counts the copies that stage
  operands into on-chip memory (VMEM) as bytes accessed too, and a one-token matmul rewritten as a multiply and a
  reduction on the vector units as one flop per element op: a 33.5 MB weight read once by a [1, 4096] x [4096, 4096]
  matmul counts 170 MB and 84 MFLOP (``docs/tpu-on-paper.md``).
- HBM: the same lowered program compiled once more with memory-space assignment and that rewrite off
  (``HBM_COST_OPTIONS``): bytes that move through HBM and the matmuls' own flops, what a roofline holds against
  the chip's bandwidth and peak. The program that would run is the first one; this compile is only counted.
"""
from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

HBM_COST_OPTIONS = {"xla_msa_enable": "false", "xla_tpu_enable_dot_strength_reduction": "false"}
_MOSAIC = 'custom_call_target="tpu_custom_call"'


@dataclasses.dataclass
class Program:
    """One compiled program's account (per device); ``error``: why it did not compile (one line)."""

    name: str
    compiled: bool
    error: str | None = None
    mosaic: int = 0  # Mosaic (Pallas TPU) kernels inside
    memory: dict = dataclasses.field(default_factory=dict)  # ``hlo.memory``: argument / output / alias / temp / peak
    flops: float = 0.0  # XLA's count of the program as compiled
    bytes: float = 0.0
    hbm_flops: float | None = None  # the HBM cost compile's (None: not counted)
    hbm_bytes: float | None = None
    compile_s: float = 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _cost(compiled) -> dict:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return {k: float(cost.get(k, 0.0)) for k in ("flops", "bytes accessed")}


def one_line(error: BaseException) -> str:
    """An exception as one line: its type and its first non-empty line of text, cut at 300 characters."""
    text = next((ln.strip() for ln in str(error).splitlines() if ln.strip()), "")
    return f"{type(error).__name__}: {text}"[:300]


def compile_program(name: str, lowered_fn, *, hbm_cost: bool = True, tpu: bool = True) -> Program:
    """Lower and compile ``lowered_fn()`` (returns a ``jax.stages.Lowered``); ``hbm_cost``: also count HBM (on
    ``tpu`` a second compile; elsewhere nothing is staged on chip and XLA's count is HBM's). A failure (tracing,
    lowering, XLA or Mosaic) is the program's error, not an exception."""
    from dflash_jax import hlo

    start = time.perf_counter()
    try:
        lowered = lowered_fn()
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 (any refusal is the program's result)
        return Program(name, False, one_line(e), compile_s=time.perf_counter() - start)
    cost = _cost(compiled)
    out = Program(name, True, mosaic=compiled.as_text().count(_MOSAIC), memory=hlo.memory(compiled),
                  flops=cost["flops"], bytes=cost["bytes accessed"])
    if hbm_cost:
        hbm = _cost(lowered.compile(compiler_options=HBM_COST_OPTIONS)) if tpu else cost
        out.hbm_flops, out.hbm_bytes = hbm["flops"], hbm["bytes accessed"]
    out.compile_s = time.perf_counter() - start
    return out


def abstract(tree, mesh, spec_of=None):
    """Host arrays / ShapeDtypeStructs -> ShapeDtypeStructs on ``mesh``: replicated, or as ``spec_of(leaf)`` (a
    PartitionSpec) says."""
    def one(x):
        spec = P() if spec_of is None else spec_of(x)
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=NamedSharding(mesh, spec))

    return jax.tree_util.tree_map(one, tree)


def pair(tcfg, dcfg, mesh=None, dtype="bfloat16"):
    """(Target, Draft or None) with abstract parameters in ``dtype`` (floating leaves), sharded on ``mesh`` (the
    draft's rules shared with the target's), or unsharded without one."""
    import jax.numpy as jnp

    from dflash_jax import model_sharding as ms
    from dflash_jax.drafts.config import DraftConfig
    from dflash_jax.drafts.model import Draft, draft_param_shapes
    from dflash_jax.target import Target, param_shapes

    rules = None if mesh is None else ms.model_rules(mesh, tcfg, *(() if dcfg is None else (dcfg,)))

    def params(cfg):
        shapes = draft_param_shapes(cfg) if isinstance(cfg, DraftConfig) else param_shapes(cfg)
        cast = lambda s, sh=None: jax.ShapeDtypeStruct(  # noqa: E731
            s.shape, jnp.dtype(dtype) if jnp.issubdtype(s.dtype, jnp.floating) else s.dtype, sharding=sh)
        if mesh is None:
            return jax.tree_util.tree_map(cast, shapes)
        return jax.tree_util.tree_map(cast, shapes, ms.param_shardings(cfg, mesh, rules, params=shapes))

    target = Target(tcfg, params(tcfg), path="on paper")
    return target, (None if dcfg is None else Draft(dcfg, params(dcfg), path="on paper"))


def head_bytes(tparams) -> int:
    """Bytes one device holds of a target's LM head (``lm_head``, or the tied ``embed_tokens`` table)."""
    leaves = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tparams)}
    head = [x for k, x in leaves.items() if "lm_head" in k] or [x for k, x in leaves.items() if "embed_tokens" in k]
    return device_bytes(head[:1])


def device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard of each leaf)."""
    total = 0
    for x in jax.tree_util.tree_leaves(tree):
        shard = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        total += int(np.prod(shard, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total
