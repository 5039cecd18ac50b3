"""What a GPU backend reports about a node's GPUs: plain facts, no judgement.

Backends (real NVML, ``SimulatedNvml``) fill these in; the pure checks in
``gpu_checks`` judge them. ``None`` means "this GPU or driver does not report
it", which the checks treat as nothing to judge, never as healthy proof.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

#: NVML clock-event (throttle) reason bits, by the names used in configs and reasons.
THROTTLE_BITS: dict[str, int] = {
    "gpu_idle": 0x1,
    "app_clocks": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal": 0x20,
    "hw_thermal": 0x40,
    "hw_power_brake": 0x80,
    "display_clocks": 0x100,
}

#: NVML_FI_DEV_GET_GPU_RECOVERY_ACTION values (nvml.h ``nvmlDeviceGpuRecoveryAction_t``).
RECOVERY_ACTIONS: dict[int, str] = {
    0: "none",
    1: "gpu_reset",
    2: "node_reboot",
    3: "drain_p2p",
    4: "drain_and_reset",
}


def throttle_names(mask: int) -> list[str]:
    return [name for name, bit in THROTTLE_BITS.items() if mask & bit]


@dataclass(frozen=True)
class GpuFacts:
    """One GPU as the backend saw it."""

    index: int
    uuid: str = ""
    pci_bus_id: str = ""
    lost: bool = False                      # NVML_ERROR_GPU_IS_LOST / fallen off the bus
    query_error: str = ""                   # another NVML error while reading this GPU
    ecc_uncorrected_volatile: int | None = None
    ecc_uncorrected_aggregate: int | None = None
    ecc_corrected_volatile: int | None = None
    retired_pages_pending: bool | None = None
    remap_pending: bool | None = None
    remap_failed: bool | None = None
    xids: tuple[int, ...] = ()              # XID events seen recently (kernel log / events)
    temperature_c: int | None = None
    throttle_mask: int | None = None
    sm_clock_mhz: int | None = None
    max_sm_clock_mhz: int | None = None
    pcie_gen: int | None = None
    pcie_gen_max: int | None = None
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    nvlink_up: tuple[bool, ...] = ()        # one entry per link the GPU has
    nvlink_errors: int | None = None        # replay + recovery + CRC counters, all links
    recovery_action: int | None = None


@dataclass(frozen=True)
class GpuSnapshot:
    """All GPUs of the node at one moment. ``error`` set: the backend itself failed."""

    backend: str
    devices: tuple[GpuFacts, ...] = ()
    driver_version: str = ""
    error: str = ""
    details: dict[str, str] = field(default_factory=dict)

    @property
    def count(self) -> int:
        return len(self.devices)


class GpuBackend(Protocol):
    """Extension point: where GPU facts come from (NVML, simulation, none)."""

    name: str

    def snapshot(self) -> GpuSnapshot: ...

    def close(self) -> None: ...


class NoGpuBackend:
    """For nodes without GPUs (``backend = "none"``): every GPU check is skipped."""

    name = "none"

    def snapshot(self) -> GpuSnapshot:
        return GpuSnapshot(backend=self.name)

    def close(self) -> None:
        return None
