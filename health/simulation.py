"""The simulated node, for machines without GPUs and for fault-injection tests: the
GPU backend ``SimulatedNvml`` and the host facts ``SimulatedHostFacts``, both
changed by the node's injected faults. This is the one place faults are injected
into the health checks; the checks themselves only read facts.

Faults live in a JSON file per node, ``<sim_fault_dir>/<node>.json``, re-read at
every snapshot, so a test can inject a fault for one node of a cluster (the
Slurm plugins on that node see it, the others do not) or while an inspection
agent runs. The file holds a list of fault records (or ``{"gpus": N, "faults":
[...]}``); each record is one fault:

* GPU: ``{"gpu": 3, "xid": 79}``, ``{"gpu": 1, "lost": true}``,
  ``{"gpu": 0, "ecc_uncorrected": 2}``, ``remap_pending``, ``remap_failed``,
  ``retired_pending`` (true), ``temperature`` (C), ``throttle`` (list of names),
  ``max_sm_clock`` (MHz), ``pcie_width``, ``pcie_gen``, ``nvlink_down`` (list of
  links), ``nvlink_errors``, ``recovery_action`` (name), ``sdc`` (true: the GPU
  computes wrong results; seen by the bit-wise alignment test and replay job).
* node: ``{"gpus_visible": 7}``, ``{"disk_free_bytes": 0, "path": "/"}``,
  ``{"readonly": "/scratch"}``, ``{"missing_mount": "/scratch"}``,
  ``{"mem_available_bytes": 1}``, ``{"swap_used_bytes": N}``,
  ``{"link_down": "eth0"}``, ``{"ib_port_down": "mlx5_0/1"}``,
  ``{"unreachable": "host:port"}``, ``{"sdc": true}``.

GPU records change the GPU snapshot, node records the host facts; ``sdc`` (of a
GPU or of the node) makes the alignment run compute wrong results.

Unknown keys are errors that list the valid ones: a typo must not look healthy.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ft_launch.errors import ConfigError

from .gpu_facts import RECOVERY_ACTIONS, THROTTLE_BITS, GpuFacts, GpuSnapshot
from .host_facts import HostFacts, IbPort

GPU_FAULTS: dict[str, type] = {
    "xid": int, "lost": bool, "ecc_uncorrected": int, "remap_pending": bool,
    "remap_failed": bool, "retired_pending": bool, "temperature": int, "throttle": list,
    "max_sm_clock": int, "pcie_width": int, "pcie_gen": int, "nvlink_down": list,
    "nvlink_errors": int, "recovery_action": str, "sdc": bool,
}
NODE_FAULTS: dict[str, type] = {
    "gpus_visible": int, "disk_free_bytes": int, "path": str, "readonly": str,
    "missing_mount": str, "mem_available_bytes": int, "swap_used_bytes": int,
    "link_down": str, "ib_port_down": str, "unreachable": str, "sdc": bool,
}
HEALTHY_MAX_SM_CLOCK = 1980
HEALTHY_NVLINKS = 18


def fault_file(fault_dir: str | Path, node: str) -> Path:
    return Path(fault_dir) / f"{node}.json"


@dataclass(frozen=True)
class SimulatedFaults:
    """The faults injected for one node (empty: a healthy node)."""

    gpus_visible: int | None = None
    gpu: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)
    disk_free_bytes: Mapping[str, int] = field(default_factory=dict)
    readonly: frozenset[str] = frozenset()
    missing_mounts: frozenset[str] = frozenset()
    mem_available_bytes: int | None = None
    swap_used_bytes: int | None = None
    links_down: frozenset[str] = frozenset()
    ib_ports_down: frozenset[str] = frozenset()
    unreachable: frozenset[str] = frozenset()
    node_sdc: bool = False

    @property
    def sdc(self) -> bool:
        return self.node_sdc or any(f.get("sdc") for f in self.gpu.values())


def load_faults(path: str | Path) -> SimulatedFaults:
    """Read a fault file; a missing file means no faults."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return SimulatedFaults()
    except (OSError, ValueError) as exc:
        raise ConfigError(f"unreadable fault file: {exc}", source=str(path)) from None
    return parse_faults(raw, str(path))


def parse_faults(raw: Any, source: str = "faults") -> SimulatedFaults:
    if isinstance(raw, dict) and set(raw) - {"gpus", "faults"}:
        raise ConfigError(f"unknown keys {sorted(set(raw) - {'gpus', 'faults'})}",
                          source=source, hint="a fault file is a list of fault records "
                          "or {\"gpus\": N, \"faults\": [...]}")
    records = raw.get("faults", []) if isinstance(raw, dict) else raw
    if not isinstance(records, list):
        raise ConfigError("expected a list of fault records", source=source)
    faults = SimulatedFaults(gpus_visible=raw.get("gpus") if isinstance(raw, dict) else None)
    for record in records:
        if not isinstance(record, dict):
            raise ConfigError(f"fault record must be an object, got {record!r}", source=source)
        faults = _add_gpu(faults, record, source) if "gpu" in record \
            else _add_node(faults, record, source)
    return faults


def _checked(record: Mapping[str, Any], valid: Mapping[str, type], source: str) -> None:
    for key, value in record.items():
        if key not in valid:
            raise ConfigError(f"unknown fault {key!r} in {dict(record)}", source=source,
                              hint=f"valid: {', '.join(sorted(valid))}")
        expected = valid[key]
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise ConfigError(f"fault {key!r} must be {expected.__name__}, got {value!r}",
                              source=source)


def _add_gpu(faults: SimulatedFaults, record: Mapping[str, Any], source: str) -> SimulatedFaults:
    fields = {k: v for k, v in record.items() if k != "gpu"}
    _checked(fields, GPU_FAULTS, source)
    if not isinstance(record["gpu"], int):
        raise ConfigError(f"'gpu' must be an index, got {record['gpu']!r}", source=source)
    if "recovery_action" in fields and fields["recovery_action"] not in RECOVERY_ACTIONS.values():
        raise ConfigError(f"unknown recovery_action {fields['recovery_action']!r}", source=source,
                          hint=f"valid: {', '.join(RECOVERY_ACTIONS.values())}")
    if not set(fields.get("throttle", [])) <= set(THROTTLE_BITS):
        raise ConfigError(f"unknown throttle reason in {fields['throttle']}", source=source,
                          hint=f"valid: {', '.join(THROTTLE_BITS)}")
    merged = dict(faults.gpu.get(record["gpu"], {}))
    if "xid" in fields:  # several XIDs on one GPU accumulate
        merged["xids"] = (*merged.get("xids", ()), fields.pop("xid"))
    merged.update(fields)
    return replace(faults, gpu={**faults.gpu, record["gpu"]: merged})


def _add_node(faults: SimulatedFaults, record: Mapping[str, Any], source: str) -> SimulatedFaults:
    _checked(record, NODE_FAULTS, source)
    if "disk_free_bytes" in record:
        path = record.get("path", "/")
        return replace(faults, disk_free_bytes={**faults.disk_free_bytes,
                                                path: record["disk_free_bytes"]})
    sets = {"readonly": "readonly", "missing_mount": "missing_mounts", "link_down": "links_down",
            "ib_port_down": "ib_ports_down", "unreachable": "unreachable"}
    changes: dict[str, Any] = {}
    for key, value in record.items():
        if key in sets:
            changes[sets[key]] = getattr(faults, sets[key]) | {value}
        elif key == "sdc":
            changes["node_sdc"] = value
        elif key != "path":
            changes[key] = value
    return replace(faults, **changes)


def healthy_gpu(index: int) -> GpuFacts:
    return GpuFacts(
        index=index, uuid=f"GPU-sim-{index:04d}", pci_bus_id=f"00000000:{0x18 + index:02X}:00.0",
        ecc_uncorrected_volatile=0, ecc_uncorrected_aggregate=0, ecc_corrected_volatile=0,
        retired_pages_pending=False, remap_pending=False, remap_failed=False,
        temperature_c=38, throttle_mask=THROTTLE_BITS["gpu_idle"],
        sm_clock_mhz=345, max_sm_clock_mhz=HEALTHY_MAX_SM_CLOCK, pcie_gen=5, pcie_gen_max=5,
        pcie_width=16, pcie_width_max=16, nvlink_up=(True,) * HEALTHY_NVLINKS, nvlink_errors=0,
        recovery_action=0)


def faulty_gpu(index: int, fault: Mapping[str, Any]) -> GpuFacts:
    gpu = healthy_gpu(index)
    if fault.get("lost"):
        return GpuFacts(index=index, uuid=gpu.uuid, pci_bus_id=gpu.pci_bus_id, lost=True)
    mask = sum(THROTTLE_BITS[name] for name in fault.get("throttle", []))
    down = set(fault.get("nvlink_down", []))
    action = {name: code for code, name in RECOVERY_ACTIONS.items()}
    return replace(
        gpu,
        xids=tuple(fault.get("xids", ())),
        ecc_uncorrected_volatile=fault.get("ecc_uncorrected", 0),
        ecc_uncorrected_aggregate=fault.get("ecc_uncorrected", 0),
        remap_pending=fault.get("remap_pending", False),
        remap_failed=fault.get("remap_failed", False),
        retired_pages_pending=fault.get("retired_pending", False),
        temperature_c=fault.get("temperature", gpu.temperature_c),
        throttle_mask=mask or gpu.throttle_mask,
        max_sm_clock_mhz=fault.get("max_sm_clock", gpu.max_sm_clock_mhz),
        pcie_width=fault.get("pcie_width", gpu.pcie_width),
        pcie_gen=fault.get("pcie_gen", gpu.pcie_gen),
        nvlink_up=tuple(link not in down for link in range(HEALTHY_NVLINKS)),
        nvlink_errors=fault.get("nvlink_errors", 0),
        recovery_action=action[fault.get("recovery_action", "none")])


class SimulatedNvml:
    """The GPU backend used by tests and by the lab cluster: ``gpus`` healthy GPUs,
    changed by whatever the node's fault file says at the time of the snapshot."""

    name = "simulated"

    def __init__(self, gpus: int, fault_path: str | Path | None) -> None:
        self.gpus = gpus
        self.fault_path = Path(fault_path) if fault_path else None

    def faults(self) -> SimulatedFaults:
        return load_faults(self.fault_path) if self.fault_path else SimulatedFaults()

    def snapshot(self) -> GpuSnapshot:
        faults = self.faults()
        visible = self.gpus if faults.gpus_visible is None else faults.gpus_visible
        devices = tuple(faulty_gpu(i, faults.gpu[i]) if i in faults.gpu else healthy_gpu(i)
                        for i in range(visible))
        return GpuSnapshot(backend=self.name, devices=devices, driver_version="sim")

    def close(self) -> None:
        return None


@dataclass(frozen=True)
class SimulatedHostFacts(HostFacts):
    """The real host's facts, except where the node's injected ``faults`` say
    otherwise. The settings read the fault file into ``faults`` once per check
    context, so one profile run judges one set of faults."""

    faults: SimulatedFaults = field(default_factory=SimulatedFaults)

    def mem_available_bytes(self) -> int:
        if self.faults.mem_available_bytes is not None:
            return self.faults.mem_available_bytes
        return super().mem_available_bytes()

    def swap_used_bytes(self) -> int:
        if self.faults.swap_used_bytes is not None:
            return self.faults.swap_used_bytes
        return super().swap_used_bytes()

    def disk_free_bytes(self, path: str) -> int:
        if path in self.faults.disk_free_bytes:
            return self.faults.disk_free_bytes[path]
        return super().disk_free_bytes(path)

    # An injected read-only path is answered before the real one is looked at, so
    # it is read-only even where the real path is missing.
    def readonly(self, path: str) -> bool:
        return path in self.faults.readonly or super().readonly(path)

    def writable(self, path: str) -> bool:
        return path not in self.faults.readonly and super().writable(path)

    def is_mount(self, path: str) -> bool:
        return path not in self.faults.missing_mounts and super().is_mount(path)

    def link_up(self, iface: str) -> bool:
        return iface not in self.faults.links_down and super().link_up(iface)

    def ib_ports(self) -> list[IbPort]:
        # A port taken down keeps its name and rate; its physical state is not simulated.
        return [replace(port, state="1: DOWN", phys_state="")
                if port.name in self.faults.ib_ports_down else port
                for port in super().ib_ports()]

    def reachable(self, target: str, timeout: float) -> str | None:
        if target in self.faults.unreachable:
            return "simulated"
        return super().reachable(target, timeout)

    def computes_wrong(self) -> bool:
        return self.faults.sdc
