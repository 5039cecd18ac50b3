"""Pure judgements of GPU facts. Each returns one ``CheckResult`` whose reason
names the GPU and the value (``gpu3 xid 79``); all problems stay in the evidence."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .gpu_facts import RECOVERY_ACTIONS, THROTTLE_BITS, GpuFacts, GpuSnapshot, throttle_names
from .result import CheckResult, CheckStatus, failed, from_problems, passed, warned

# Node-level XIDs (hardware or driver state, not the application's bug): see NVIDIA's
# "XID Errors" table. 13/31/43/45 are application faults and are not listed.
FATAL_XIDS = (48, 61, 62, 64, 74, 79, 94, 95, 119, 120, 140)
WARN_XIDS = (63, 92)


@dataclass(frozen=True)
class GpuCountParams:
    expected: int = 0           # 0: take the node's gpus_per_node setting


@dataclass(frozen=True)
class EccParams:
    max_uncorrected_volatile: int = 0
    max_uncorrected_aggregate: int = -1   # -1: not judged (lifetime counter)


@dataclass(frozen=True)
class XidParams:
    fatal: tuple[int, ...] = FATAL_XIDS
    warn: tuple[int, ...] = WARN_XIDS


@dataclass(frozen=True)
class ThermalParams:
    max_temperature_c: int = 90
    fail_throttle: tuple[str, ...] = ("hw_slowdown", "hw_thermal", "hw_power_brake")
    warn_throttle: tuple[str, ...] = ("sw_thermal",)

    def problems(self) -> Iterable[tuple[str, str]]:
        for key in ("fail_throttle", "warn_throttle"):
            unknown = set(getattr(self, key)) - set(THROTTLE_BITS)
            if unknown:
                yield key, f"unknown reasons {sorted(unknown)}; valid: {', '.join(THROTTLE_BITS)}"


@dataclass(frozen=True)
class ClockParams:
    min_max_sm_clock_mhz: int = 0   # 0: only compare GPUs of the node with each other


@dataclass(frozen=True)
class PcieParams:
    min_gen: int = 0                # 0: not judged (idle GPUs lower their link generation)
    check_width: bool = True        # width below the GPU's maximum is a failure


@dataclass(frozen=True)
class NvlinkParams:
    max_error_count: int = 100_000  # counters are cumulative: only a storm warns


def _each(snapshot: GpuSnapshot, judge: Callable[[GpuFacts], Iterable[str]]) -> list[str]:
    return [problem for gpu in snapshot.devices if not gpu.lost for problem in judge(gpu)]


def gpu_count(name: str, snapshot: GpuSnapshot, expected: int) -> CheckResult:
    if snapshot.error:
        return failed(name, f"gpu backend {snapshot.backend} failed: {snapshot.error}"[:120],
                      expected=expected)
    if expected and snapshot.count < expected:
        return failed(name, f"gpus {snapshot.count}/{expected} visible",
                      expected=expected, visible=snapshot.count)
    if expected and snapshot.count > expected:
        return warned(name, f"gpus {snapshot.count} visible, {expected} expected",
                      expected=expected, visible=snapshot.count)
    return passed(name, f"{snapshot.count} gpus", visible=snapshot.count)


def gpu_lost(name: str, snapshot: GpuSnapshot) -> CheckResult:
    lost = [f"gpu{g.index} lost" for g in snapshot.devices if g.lost]
    if lost:
        return from_problems(name, lost)
    errors = [f"gpu{g.index} query error: {g.query_error}" for g in snapshot.devices
              if g.query_error]
    return from_problems(name, errors, CheckStatus.WARN)


def gpu_ecc(name: str, snapshot: GpuSnapshot, params: EccParams) -> CheckResult:
    def judge(gpu: GpuFacts) -> Iterable[str]:
        volatile = gpu.ecc_uncorrected_volatile
        if volatile is not None and volatile > params.max_uncorrected_volatile:
            yield f"gpu{gpu.index} ecc uncorrectable {volatile}"
        aggregate = gpu.ecc_uncorrected_aggregate
        if params.max_uncorrected_aggregate >= 0 and aggregate is not None \
                and aggregate > params.max_uncorrected_aggregate:
            yield f"gpu{gpu.index} ecc uncorrectable lifetime {aggregate}"
    return from_problems(name, _each(snapshot, judge))


def gpu_memory_remap(name: str, snapshot: GpuSnapshot) -> CheckResult:
    """Row remapping (Ampere+) and page retirement (older GPUs)."""
    def judge(gpu: GpuFacts) -> Iterable[str]:
        if gpu.remap_failed:
            yield f"gpu{gpu.index} row remap failed"
        if gpu.remap_pending:
            yield f"gpu{gpu.index} row remap pending"
        if gpu.retired_pages_pending:
            yield f"gpu{gpu.index} page retirement pending"
    return from_problems(name, _each(snapshot, judge))


def gpu_xid(name: str, snapshot: GpuSnapshot, params: XidParams) -> CheckResult:
    fatal = [f"gpu{g.index} xid {x}" for g in snapshot.devices for x in g.xids
             if x in params.fatal]
    if fatal:
        return from_problems(name, fatal)
    warn = [f"gpu{g.index} xid {x}" for g in snapshot.devices for x in g.xids if x in params.warn]
    return from_problems(name, warn, CheckStatus.WARN)


def gpu_thermal(name: str, snapshot: GpuSnapshot, params: ThermalParams) -> CheckResult:
    def hard(gpu: GpuFacts) -> Iterable[str]:
        if gpu.temperature_c is not None and gpu.temperature_c > params.max_temperature_c:
            yield f"gpu{gpu.index} temp {gpu.temperature_c}C>{params.max_temperature_c}C"
        active = throttle_names(gpu.throttle_mask or 0)
        for reason in active:
            if reason in params.fail_throttle:
                yield f"gpu{gpu.index} throttled {reason}"

    def soft(gpu: GpuFacts) -> Iterable[str]:
        for reason in throttle_names(gpu.throttle_mask or 0):
            if reason in params.warn_throttle:
                yield f"gpu{gpu.index} throttled {reason}"
    evidence = {f"gpu{g.index}": [g.temperature_c, throttle_names(g.throttle_mask or 0)]
                for g in snapshot.devices}
    problems = _each(snapshot, hard)
    if problems:
        return from_problems(name, problems, **evidence)
    return from_problems(name, _each(snapshot, soft), CheckStatus.WARN, **evidence)


def gpu_clocks(name: str, snapshot: GpuSnapshot, params: ClockParams) -> CheckResult:
    """A GPU whose maximum SM clock is below its peers' (or the configured floor) has
    lost its clock setting or is capped: training on it would be fail-slow."""
    known = [g.max_sm_clock_mhz for g in snapshot.devices if g.max_sm_clock_mhz]
    floor = max([params.min_max_sm_clock_mhz, *known])

    def judge(gpu: GpuFacts) -> Iterable[str]:
        if gpu.max_sm_clock_mhz and gpu.max_sm_clock_mhz < floor:
            yield f"gpu{gpu.index} max sm clock {gpu.max_sm_clock_mhz}MHz<{floor}MHz"
    return from_problems(name, _each(snapshot, judge), CheckStatus.WARN,
                         max_sm_clock_mhz=known)


def gpu_pcie(name: str, snapshot: GpuSnapshot, params: PcieParams) -> CheckResult:
    def judge(gpu: GpuFacts) -> Iterable[str]:
        if params.check_width and gpu.pcie_width and gpu.pcie_width_max \
                and gpu.pcie_width < gpu.pcie_width_max:
            yield f"gpu{gpu.index} pcie x{gpu.pcie_width}<x{gpu.pcie_width_max}"
        if params.min_gen and gpu.pcie_gen and gpu.pcie_gen < params.min_gen:
            yield f"gpu{gpu.index} pcie gen{gpu.pcie_gen}<gen{params.min_gen}"
    return from_problems(name, _each(snapshot, judge))


def gpu_nvlink(name: str, snapshot: GpuSnapshot, params: NvlinkParams) -> CheckResult:
    def down(gpu: GpuFacts) -> Iterable[str]:
        for link, up in enumerate(gpu.nvlink_up):
            if not up:
                yield f"gpu{gpu.index} nvlink{link} down"

    def noisy(gpu: GpuFacts) -> Iterable[str]:
        if gpu.nvlink_errors is not None and gpu.nvlink_errors > params.max_error_count:
            yield f"gpu{gpu.index} nvlink errors {gpu.nvlink_errors}"
    problems = _each(snapshot, down)
    if problems:
        return from_problems(name, problems)
    return from_problems(name, _each(snapshot, noisy), CheckStatus.WARN)


def gpu_recovery(name: str, snapshot: GpuSnapshot) -> CheckResult:
    """NVML's own verdict (driver r550+): any action other than none means the GPU is
    unusable until someone acts."""
    def judge(gpu: GpuFacts) -> Iterable[str]:
        action = gpu.recovery_action
        if action:
            yield f"gpu{gpu.index} needs {RECOVERY_ACTIONS.get(action, f'action {action}')}"
    return from_problems(name, _each(snapshot, judge))
