"""What both Pallas kernels share: the online-softmax step, the tile config's backend / lane layout, the
platform and GPU compute-capability probe, and the cost estimate handed to each ``pallas_call``.

The kernels' per-row statistics (running max, denominator, logsumexp) are lane-broadcast to 128 lanes on
TPU ([.., rows, 128] float32, the layout Mosaic handles natively) and [.., rows, 1] on GPU (``lanes``).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

MASK = -1e30  # finite: exp(MASK - m) underflows to 0 without inf - inf
NT = (((1,), (1,)), ((), ()))  # dot_general dimension numbers of a @ b.T


# ----------------------------------------------------------------------------- platform and tiles


def platform(mesh=None) -> str:
    """The platform a program runs on: "gpu" for CUDA / ROCm, else "tpu" / "cpu". ``mesh`` (a Mesh or AbstractMesh)
    given, its devices'; else, inside a trace with a mesh (``jax.sharding.use_abstract_mesh``, as every engine
    program is traced), that mesh's; else the default backend's. So a CPU host compiling for a TPU slice
    (``dflash_jax.chips``) picks the TPU formulations, page size and kernels a TPU host would."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else getattr(mesh, "abstract_mesh", mesh)
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    p = device.platform if device is not None else jax.default_backend()
    return "gpu" if p in ("gpu", "cuda", "rocm") else p


def resolve_backend(backend: str | None, interpret: bool | None) -> tuple[str, bool]:
    """(kernel formulation, interpret): the default backend's formulation ("gpu" on GPU, the TPU one
    elsewhere, CPU included) and interpret mode on CPU, unless given."""
    p = platform()
    return backend or ("gpu" if p == "gpu" else "tpu"), p == "cpu" if interpret is None else bool(interpret)


def gpu_capable() -> bool:
    """Whether the default device is a GPU of compute capability >= 8.0 (what the Triton kernels need);
    False for other names (e.g. ROCm gfx)."""
    try:
        cc = float(getattr(jax.devices()[0], "compute_capability", "0"))
    except ValueError:
        return False
    return cc >= 8.0


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """The part of a kernel's static config both kernels have: which formulation and how it runs."""

    backend: str       # "tpu" | "gpu": which kernel formulation
    interpret: bool

    @property
    def lanes(self) -> int:
        """Lanes of the per-row statistics: 128 on TPU, 1 on GPU."""
        return 128 if self.backend == "tpu" else 1


def row_stats(ref):
    """Per-row values ([rows, lanes] on TPU, [rows] / [rows, 1] on GPU) -> [rows, 1]."""
    x = ref[...]
    return x[:, None] if x.ndim == 1 else x[:, :1]


# ----------------------------------------------------------------------------- online softmax


def online_step(s, v, vis, carry):
    """One online-softmax step over a key tile: logits s [.., R, K] (float32, scaled), values v [.., K, D];
    carry (running max, denominator, accumulator)."""
    m, l, acc = carry
    s = jnp.where(vis, s, MASK)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(vis, jnp.exp(s - m_new), 0.0)
    l = alpha * l + jnp.sum(p, axis=-1, keepdims=True)
    acc = alpha * acc + jnp.matmul(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_new, l, acc


def fwd_step(q, k, v, vis, carry, scale):
    """``online_step`` of one query tile q [R, D] against a key tile k, v [K, D]."""
    return online_step(lax.dot_general(q, k, NT, preferred_element_type=jnp.float32) * scale, v, vis, carry)


def empty_carry(n_rows: int, d: int):
    """The online softmax's starting (max, denominator, accumulator) for n_rows rows of width d."""
    return (jnp.full((n_rows, 1), MASK, jnp.float32), jnp.zeros((n_rows, 1), jnp.float32),
            jnp.zeros((n_rows, d), jnp.float32))


# ----------------------------------------------------------------------------- cost estimate


def cost_estimate(*, flops: int, transcendentals: int, operands=(), outputs=()) -> pl.CostEstimate:
    """A ``pl.CostEstimate`` from static counts and the bytes of the operands and outputs (arrays or
    ShapeDtypeStructs), each read or written once: what XLA schedules the custom call around."""
    nbytes = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in (*operands, *outputs))
    return pl.CostEstimate(flops=int(flops), transcendentals=int(transcendentals), bytes_accessed=int(nbytes))


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, int(x) - 1).bit_length()


def round_up(x, m):
    """x rounded up to a multiple of m."""
    return -(-x // m) * m
