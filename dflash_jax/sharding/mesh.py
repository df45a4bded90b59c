"""The device mesh: axes ``('data', 'fsdp', 'expert', 'tensor')`` (sizes may be 1), built from a spec string,
and multi-host setup (``maybe_initialize_distributed``, each process's ``process_slice`` of the data).

``expert`` splits mixture-of-experts weights over their expert dimension (expert parallelism); it is
left out of specs and messages while its size is 1, so dense-model meshes read as before."""
from __future__ import annotations

import logging
import math
import os
import re
from typing import Mapping, Sequence

import jax
from jax.sharding import Mesh

log = logging.getLogger(__name__)

AXES = ("data", "fsdp", "expert", "tensor")
BATCH_AXES = ("data", "fsdp")
_TUPLE_AXES = {3: ("data", "fsdp", "tensor"), 4: AXES}  # the axes a tuple spec of that length gives


def _shown(sizes: Mapping[str, int]) -> tuple[str, ...]:
    """The axes a spec or message spells: all but ``expert`` when it is 1."""
    return tuple(a for a in AXES if a != "expert" or sizes.get(a, 1) != 1)


def _fmt(sizes: Mapping[str, int]) -> str:
    return ",".join(f"{a}={sizes[a]}" for a in _shown(sizes))


def parse_mesh_spec(spec, num_devices: int, auto_axis: str = "data") -> dict[str, int]:
    """``spec`` -> {'data': d, 'fsdp': f, 'expert': e, 'tensor': t} with d*f*e*t == num_devices.

    Accepted: None / "" / "auto" (every device on ``auto_axis``); "data=2,fsdp=1,tensor=4" or
    "data=2,expert=4" (omitted axes are 1, one axis may be -1 = whatever is left); a dict of the same; a
    (data, fsdp, tensor) or (data, fsdp, expert, tensor) tuple.
    """
    if auto_axis not in AXES:
        raise ValueError(f"auto_axis must be one of {AXES}, got {auto_axis!r}")
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in ("", "auto")):
        return {a: (num_devices if a == auto_axis else 1) for a in AXES}
    if isinstance(spec, str):
        sizes = {}
        for part in spec.split(","):
            if not part.strip():
                continue
            m = re.fullmatch(r"\s*([a-z_]+)\s*[=:]\s*(-?\d+)\s*", part)
            if not m:
                raise ValueError(f"mesh spec {spec!r}: cannot read {part.strip()!r}; write axis=size pairs like "
                                 f"'data=2,fsdp=1,tensor=4' (axes {', '.join(AXES)}) or 'auto'")
            if m.group(1) in sizes:
                raise ValueError(f"mesh spec {spec!r} gives axis {m.group(1)!r} twice")
            sizes[m.group(1)] = int(m.group(2))
    elif isinstance(spec, Mapping):
        sizes = {str(k): int(v) for k, v in spec.items()}
    elif isinstance(spec, Sequence) and len(spec) in _TUPLE_AXES:
        sizes = dict(zip(_TUPLE_AXES[len(spec)], (int(s) for s in spec)))
    else:
        raise ValueError(f"mesh spec {spec!r}: expected 'data=2,fsdp=1,tensor=4', 'auto', a dict or a "
                         f"(data, fsdp, tensor) / (data, fsdp, expert, tensor) tuple")
    unknown = sorted(set(sizes) - set(AXES))
    if unknown:
        raise ValueError(f"mesh spec {spec!r}: unknown axes {unknown}; the axes are {', '.join(AXES)}")
    sizes = {a: sizes.get(a, 1) for a in AXES}
    fill = [a for a in AXES if sizes[a] == -1]
    bad = [a for a in AXES if sizes[a] < 1 and sizes[a] != -1]
    if bad or len(fill) > 1:
        raise ValueError(f"mesh spec {spec!r}: sizes must be >= 1 (at most one axis may be -1 = the rest)")
    if fill:
        rest = math.prod(s for a, s in sizes.items() if a != fill[0])
        if num_devices % rest:
            raise ValueError(f"mesh spec {spec!r}: the other axes use {rest} devices, which does not divide the "
                             f"{num_devices} devices; change the fixed sizes")
        sizes[fill[0]] = num_devices // rest
    product = math.prod(sizes.values())
    if product != num_devices:
        hint = ("; set one axis to -1 to take whatever is left (e.g. 'data=-1,tensor=...')"
                if num_devices % max(sizes["tensor"], 1) == 0 else "")
        shown = _shown(sizes)
        raise ValueError(
            f"mesh spec {spec!r} asks for {'*'.join(shown)} = {'*'.join(str(sizes[a]) for a in shown)} = "
            f"{product} devices, but there are {num_devices} (jax.device_count()); change the sizes so that their "
            f"product is {num_devices}, e.g. {_fmt({a: num_devices if a == 'data' else 1 for a in AXES})}{hint}")
    return sizes


def make_mesh(spec=None, *, devices=None, auto_axis: str = "data") -> Mesh:
    """A mesh with axes ('data', 'fsdp', 'expert', 'tensor') over all devices (of every process).

    ``spec``: see ``parse_mesh_spec``; a ``Mesh`` is returned as is (after checking its axes). "auto"
    puts every device on ``auto_axis``: 'data' (the default) suits inference of a model that fits on one
    device (params replicated, rows split); training of a large model wants ``auto_axis='fsdp'``; a
    model too big for one device needs an explicit ``tensor=`` size. Axes are ``AxisType.Auto`` (jit
    propagates shardings; no explicit-sharding mode), devices ordered by ``jax.make_mesh`` (TPU topology
    aware: the last axis, tensor, gets the fastest interconnect).
    """
    if isinstance(spec, Mesh):
        if tuple(spec.axis_names) != AXES:
            raise ValueError(f"mesh has axes {spec.axis_names}; expected {AXES} (build it with make_mesh)")
        return spec
    devices = list(devices) if devices is not None else jax.devices()
    sizes = parse_mesh_spec(spec, len(devices), auto_axis)
    shape = tuple(sizes[a] for a in AXES)
    auto = (jax.sharding.AxisType.Auto,) * len(AXES)
    return jax.make_mesh(shape, AXES, axis_types=auto, devices=devices)


def mesh_str(mesh: Mesh) -> str:
    return _fmt(dict(mesh.shape))


def batch_multiple(mesh: Mesh | None) -> int:
    """Rows of a batch must be a multiple of this (data * fsdp)."""
    return 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]


# --- multi-host ------------------------------------------------------------------------------------

_DIST_ENV = ("JAX_COORDINATOR_ADDRESS", "MEGASCALE_COORDINATOR_ADDRESS")


def _wants_distributed() -> str | None:
    if os.environ.get("DFLASH_DISTRIBUTED", "").strip().lower() in ("1", "true", "yes", "on"):
        return "DFLASH_DISTRIBUTED"
    for var in _DIST_ENV:
        if os.environ.get(var):
            return var
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    if len([h for h in hosts.split(",") if h.strip()]) > 1:
        return "TPU_WORKER_HOSTNAMES"
    for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        try:
            if int(os.environ.get(var, "1")) > 1:
                return var
        except ValueError:
            pass
    return None


def maybe_initialize_distributed(force: bool | None = None) -> bool:
    """Call ``jax.distributed.initialize()`` when this is one process of several; True if it did (or had).

    It runs when ``force`` is True, or (``force`` None) when the environment asks for it:
    ``DFLASH_DISTRIBUTED=1`` (TPU pod slices: everything else is auto-detected from the TPU metadata),
    ``JAX_COORDINATOR_ADDRESS`` (+ ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``), multi-host TPU env
    (``TPU_WORKER_HOSTNAMES`` with several hosts, ``MEGASCALE_COORDINATOR_ADDRESS``), or a multi-task
    SLURM / Open MPI launch. Must run before anything touches a device (``jax.devices()``, any array).
    """
    if jax.distributed.is_initialized():
        return True
    reason = "force" if force else (None if force is False else _wants_distributed())
    if reason is None:
        return False
    kw = {}
    if os.environ.get("JAX_NUM_PROCESSES"):
        kw["num_processes"] = int(os.environ["JAX_NUM_PROCESSES"])
    if os.environ.get("JAX_PROCESS_ID"):
        kw["process_id"] = int(os.environ["JAX_PROCESS_ID"])
    jax.distributed.initialize(**kw)
    log.info("jax.distributed initialized (%s): process %d of %d, %d devices in all", reason, jax.process_index(),
             jax.process_count(), jax.device_count())
    return True


def process_slice(n_items: int, process_index: int | None = None, process_count: int | None = None) -> slice:
    """This process's contiguous share of ``n_items`` (a global batch, a dataset): equal shares, the
    remainder goes to the first processes. Single process: everything."""
    i = jax.process_index() if process_index is None else process_index
    n = jax.process_count() if process_count is None else process_count
    base, extra = divmod(n_items, n)
    start = i * base + min(i, extra)
    return slice(start, start + base + (1 if i < extra else 0))
