"""The built-in profiles, cheapest to deepest (names of catalog checks, in order).

* ``inspection``: every few seconds while training runs (sub-second).
* ``prolog`` / ``gate``: before a job or a promoted replica uses the node (seconds).
* ``healthcheck``: Slurm's periodic HealthCheckProgram.
* ``epilog``: after a job ended well; ``epilog_failure``: after it failed (deeper).
* ``diagnosis``: stop-time diagnosis of a crashed replica's nodes (deepest:
  includes the bit-wise alignment test).

An admin config may replace any of them or add new ones (``[profiles.NAME]``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class ProfileSpec:
    checks: tuple[str, ...]
    budget: float
    warn_only: tuple[str, ...] = ()

    def problems(self) -> Iterable[tuple[str, str]]:
        if self.budget <= 0:
            yield "budget", "must be a positive number of seconds"
        if not self.checks:
            yield "checks", "must name at least one check"


GPU_QUICK = ("gpu_count", "gpu_lost", "gpu_xid", "gpu_ecc", "gpu_remap", "gpu_recovery")
HOST_QUICK = ("disk", "writable", "shm", "mounts", "memory")
GPU_DEEP = ("gpu_thermal", "gpu_clocks", "gpu_pcie", "gpu_nvlink")
NETWORK = ("links", "infiniband")

BUILTIN: dict[str, ProfileSpec] = {
    "inspection": ProfileSpec(("gpu_lost", "gpu_xid", "gpu_ecc", "gpu_recovery", "gpu_thermal",
                               "disk", "shm", "memory", *NETWORK), budget=2.0),
    "prolog": ProfileSpec((*GPU_QUICK, *HOST_QUICK), budget=5.0),
    "gate": ProfileSpec((*GPU_QUICK, "gpu_thermal", "gpu_nvlink", *HOST_QUICK, *NETWORK,
                         "leftover_processes"), budget=10.0),
    "healthcheck": ProfileSpec((*GPU_QUICK, *GPU_DEEP, *HOST_QUICK, *NETWORK, "zombies"),
                               budget=10.0),
    "epilog": ProfileSpec((*GPU_QUICK, *HOST_QUICK, "leftover_processes"), budget=10.0),
    "epilog_failure": ProfileSpec((*GPU_QUICK, *GPU_DEEP, *HOST_QUICK, *NETWORK,
                                   "leftover_processes", "zombies", "load", "clock", "peers"),
                                  budget=60.0, warn_only=("load",)),
    "diagnosis": ProfileSpec((*GPU_QUICK, *GPU_DEEP, *HOST_QUICK, *NETWORK, "zombies", "clock",
                              "peers", "alignment"), budget=600.0),
}
