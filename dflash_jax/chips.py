"""TPU slices on paper: a slice's name -> its abstract devices (``jax.experimental.topologies``: libtpu compiles for
any slice on a CPU-only host) and the public figures of its chips (peak bf16 matmul rate, HBM size and bandwidth),
what ``infer.plan`` holds the compiled programs against; and "local", this host's own devices (a lent GPU: the plan
beside what the same device measures)."""
from __future__ import annotations

import dataclasses
import os
import re


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU chip's public figures (the sources say per chip; a chip of 2 TensorCores shown as 2 devices splits
    them)."""

    name: str
    device_kind: str  # jax's Device.device_kind of the topology's devices
    topology: str  # the prefix of a topology name for ``get_topology_desc``
    bf16_tflops: float
    hbm_gb: float  # 10^9 bytes of HBM a chip
    hbm_gbps: float  # 10^9 bytes/s
    dims: int  # 2: v5e / v6e (a 2D torus, an accelerator type counts chips); 3: v4 / v5p / v7x
    cores_per_chip: int  # TensorCores: the accelerator type of v4 / v5p counts these
    source: str


GIB = 2 ** 30 / 1e9  # the HBM sizes below are GiB (XLA:TPU's own limit: 31.25 GiB available of a v6e chip's 32)
CHIPS = {c.name: c for c in (
    Chip("v4", "TPU v4", "v4", 275.0, 32 * GIB, 1200.0, 3, 2, "https://cloud.google.com/tpu/docs/v4"),
    Chip("v5e", "TPU v5 lite", "v5e", 197.0, 16 * GIB, 819.0, 2, 1, "https://cloud.google.com/tpu/docs/v5e"),
    Chip("v5p", "TPU v5", "v5p", 459.0, 96 * GIB, 2765.0, 3, 2, "https://cloud.google.com/tpu/docs/v5p"),
    Chip("v6e", "TPU v6 lite", "v6e", 918.0, 32 * GIB, 1640.0, 2, 1, "https://cloud.google.com/tpu/docs/v6e"),
    Chip("v7x", "TPU7x", "tpu7x", 2307.0, 192 * GIB, 7370.0, 3, 2, "https://cloud.google.com/tpu/docs/tpu7x"),
)}

# GPUs a plan may run on as "local" (dense bf16 tensor-core peak, HBM), by jax's device_kind
GPUS = {c.device_kind: c for c in (
    Chip("H100", "NVIDIA H100 80GB HBM3", "", 989.0, 80.0, 3350.0, 0, 1,
         "https://www.nvidia.com/en-us/data-center/h100/ (SXM)"),
    Chip("H200", "NVIDIA H200", "", 989.0, 141.0, 4800.0, 0, 1, "https://www.nvidia.com/en-us/data-center/h200/"),
)}

# chips -> the slice's grid (Cloud TPU's shapes for the sizes an accelerator type names)
_GRID2 = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)}
_GRID3 = {1: (1, 1, 1), 2: (1, 1, 2), 4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4),
          128: (4, 4, 8), 256: (4, 8, 8), 512: (8, 8, 8)}


@dataclasses.dataclass(frozen=True)
class Slice:
    chip: Chip
    grid: tuple[int, ...]  # chips along each axis
    local: bool = False  # this host's own devices (``parse_slice("local")``)

    @property
    def chips(self) -> int:
        n = 1
        for g in self.grid:
            n *= g
        return n

    @property
    def name(self) -> str:
        return f"local {self.chip.name} x{self.chips}" if self.local else \
            f"{self.chip.name}:{'x'.join(map(str, self.grid))}"

    def devices(self):
        """The slice's abstract TPU devices (every host's), for meshes that compile and never run; "local": this
        host's devices."""
        if self.local:
            import jax

            return jax.devices()
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # no metadata server here: say so, quietly
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compiling only: processes need not take turns
        from jax.experimental import topologies

        kw = {"chips_per_host_bounds": (1,) * 3} if self.chips == 1 else {}
        return topologies.get_topology_desc(topology_name=f"{self.chip.topology}:{'x'.join(map(str, self.grid))}",
                                            platform="tpu", **kw).devices

    def per_device(self, n_devices: int) -> tuple[float, float, float]:
        """(peak flop/s, HBM bytes, HBM bytes/s) of one device of the slice's ``n_devices``."""
        share = self.chips / n_devices
        c = self.chip
        return c.bf16_tflops * 1e12 * share, c.hbm_gb * 1e9 * share, c.hbm_gbps * 1e9 * share


def parse_slice(text: str) -> Slice:
    """"v6e-8" (an accelerator type: chips for v5e / v6e, TensorCores for v4 / v5p / v7x) or "v6e:2x4" (the grid,
    as jax's topologies name it) -> a Slice; a ValueError that lists what is known otherwise."""
    t = text.strip().lower()
    if t == "local":
        return local_slice()
    m = re.fullmatch(r"(v4|v5e|v5p|v6e|v7x|tpu7x)[-:](.+)", t)
    if not m:
        raise ValueError(f"unknown TPU slice {text!r}: use an accelerator type (v5e-8, v6e-4, v5p-64, v7x-8) or a grid "
                         f"(v6e:2x4, v5p:4x4x4); chips: {', '.join(CHIPS)}")
    chip = CHIPS["v7x" if m.group(1) == "tpu7x" else m.group(1)]
    rest = m.group(2)
    if "x" in rest:
        grid = tuple(int(g) for g in rest.split("x"))
        if len(grid) != chip.dims or min(grid) < 1:
            raise ValueError(f"{text!r}: a {chip.name} grid has {chip.dims} axes (e.g. "
                             f"{'x'.join(['2'] * chip.dims)})")
        return Slice(chip, grid)
    count = int(rest)
    chips = count // chip.cores_per_chip if count >= chip.cores_per_chip else count
    table = _GRID2 if chip.dims == 2 else _GRID3
    if chips not in table or (chip.cores_per_chip > 1 and count % chip.cores_per_chip and count > 1):
        raise ValueError(f"{text!r}: no {chip.name} slice of that size here; sizes: "
                         f"{', '.join(f'{chip.name}-{n * chip.cores_per_chip}' for n in table)}")
    return Slice(chip, table[chips])


def local_slice() -> Slice:
    """This host's devices as a slice: a TPU's chip or a known GPU's figures by device kind (else a ValueError)."""
    import jax

    devices = jax.devices()
    kind = devices[0].device_kind
    chip = GPUS.get(kind) or next((c for c in CHIPS.values() if c.device_kind == kind), None)
    if chip is None:
        known = ", ".join([*GPUS, *(c.device_kind for c in CHIPS.values())])
        raise ValueError(f"--topology local: no figures for this host's {kind!r} devices (known: {known})")
    return Slice(chip, (len(devices),), local=True)
