"""Where a measurement ran: backend, device, CPU count and load average, recorded beside every speed number
(speedups are only comparable at equal load: load slows plain decoding's many small steps more than DFlash's
few), and a warning when the machine is busy."""
from __future__ import annotations

import os
import sys


def machine() -> dict:
    import jax

    load = os.getloadavg()
    return {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind, "num_devices": jax.device_count(),
            "cpu_count": os.cpu_count(), "load_average": [round(x, 2) for x in load],
            "glibc_tunables": os.environ.get("GLIBC_TUNABLES")}  # huge pages for malloc or not (dflash_jax.huge_pages)


def warn_if_busy(where: dict) -> None:
    if where["backend"] == "cpu" and where["load_average"][0] > 0.5 * (where["cpu_count"] or 1):
        print(f"warning: the machine is busy (load average {where['load_average'][0]} on {where['cpu_count']} CPUs): "
              "timings and speedups are only comparable at equal load", file=sys.stderr)
