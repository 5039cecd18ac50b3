"""Every check by name, with its parameter type: what profiles are built from.

GPU checks read one snapshot per context; they are skipped on nodes without a
GPU backend and, when the backend itself failed, leave the report to
``gpu_count`` (one precise reason instead of ten vague ones).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import gpu_checks, host_checks, network_checks
from .alignment import judge_run, run_in_subprocess
from .context import CheckContext
from .gpu_facts import GpuSnapshot
from .result import CheckResult, failed, from_problems, passed, skipped, warned

RunFn = Callable[[str, CheckContext, Any], CheckResult]


@dataclass(frozen=True)
class CheckSpec:
    params: type | None
    run: RunFn
    gpu: bool = False


@dataclass(frozen=True)
class AlignmentParams:
    devices: tuple[str, ...] = ()            # empty: every GPU (NVML) or the CPU
    repeats: int = 2
    timeout: float = 300.0
    #: platform key -> digest of a known-good machine (``python -m ft_launch.health.alignment``)
    references: dict[str, str] = field(default_factory=dict)


def _on_gpus(judge: Callable[[str, GpuSnapshot, Any], CheckResult]) -> RunFn:
    def run(name: str, ctx: CheckContext, params: Any) -> CheckResult:
        snapshot = ctx.gpu_snapshot()
        if snapshot.backend == "none":
            return skipped(name, "no gpu backend")
        if snapshot.error:
            return skipped(name, "gpu backend failed (see gpu_count)")
        return judge(name, snapshot, params)
    return run


def _gpu_count(name: str, ctx: CheckContext, params: gpu_checks.GpuCountParams) -> CheckResult:
    snapshot = ctx.gpu_snapshot()
    expected = params.expected or ctx.expected_gpus
    if snapshot.backend == "none":
        return skipped(name, "no gpu backend")
    return gpu_checks.gpu_count(name, snapshot, expected)


def _alignment(name: str, ctx: CheckContext, params: AlignmentParams) -> CheckResult:
    snapshot = ctx.gpu_snapshot()
    corrupt = ctx.host.computes_wrong()
    devices = params.devices or (("all",) if snapshot.backend == "nvml" and snapshot.count
                                 else ("cpu",))
    try:
        runs = run_in_subprocess(devices, params.repeats, corrupt, params.timeout)
    except subprocess.TimeoutExpired:
        return failed(name, f"alignment test hung >{params.timeout:g}s")
    except (RuntimeError, OSError, ValueError) as exc:
        return warned(name, f"alignment not run: {exc}"[:120])
    evidence = {run.device: {"platform": run.platform, "digest": run.digests[0]} for run in runs}
    problems = [reason for run in runs if (reason := judge_run(run, params.references))]
    if problems:
        return from_problems(name, problems, **evidence)
    unpinned = [run.platform for run in runs if run.platform not in params.references]
    if unpinned:
        return warned(name, f"alignment: no reference for {unpinned[0]}", **evidence)
    return passed(name, **evidence)


CATALOG: dict[str, CheckSpec] = {
    # GPU
    "gpu_count": CheckSpec(gpu_checks.GpuCountParams, _gpu_count, gpu=True),
    "gpu_lost": CheckSpec(None, _on_gpus(lambda n, s, p: gpu_checks.gpu_lost(n, s)), gpu=True),
    "gpu_xid": CheckSpec(gpu_checks.XidParams, _on_gpus(gpu_checks.gpu_xid), gpu=True),
    "gpu_ecc": CheckSpec(gpu_checks.EccParams, _on_gpus(gpu_checks.gpu_ecc), gpu=True),
    "gpu_remap": CheckSpec(None, _on_gpus(lambda n, s, p: gpu_checks.gpu_memory_remap(n, s)),
                           gpu=True),
    "gpu_recovery": CheckSpec(None, _on_gpus(lambda n, s, p: gpu_checks.gpu_recovery(n, s)),
                              gpu=True),
    "gpu_thermal": CheckSpec(gpu_checks.ThermalParams, _on_gpus(gpu_checks.gpu_thermal),
                             gpu=True),
    "gpu_clocks": CheckSpec(gpu_checks.ClockParams, _on_gpus(gpu_checks.gpu_clocks), gpu=True),
    "gpu_pcie": CheckSpec(gpu_checks.PcieParams, _on_gpus(gpu_checks.gpu_pcie), gpu=True),
    "gpu_nvlink": CheckSpec(gpu_checks.NvlinkParams, _on_gpus(gpu_checks.gpu_nvlink), gpu=True),
    "alignment": CheckSpec(AlignmentParams, _alignment, gpu=True),
    # host
    "memory": CheckSpec(host_checks.MemoryParams, host_checks.memory),
    "disk": CheckSpec(host_checks.DiskParams, host_checks.disk),
    "writable": CheckSpec(host_checks.WritableParams, host_checks.writable),
    "shm": CheckSpec(host_checks.ShmParams, host_checks.shm),
    "mounts": CheckSpec(host_checks.MountParams, host_checks.mounts),
    "load": CheckSpec(host_checks.LoadParams, host_checks.load),
    "leftover_processes": CheckSpec(host_checks.LeftoverParams, host_checks.leftover_processes),
    "zombies": CheckSpec(host_checks.ZombieParams, host_checks.zombies),
    "clock": CheckSpec(host_checks.ClockParams, host_checks.clock),
    # network
    "links": CheckSpec(network_checks.LinkParams, network_checks.links),
    "infiniband": CheckSpec(network_checks.IbParams, network_checks.infiniband),
    "peers": CheckSpec(network_checks.PeerParams, network_checks.peers),
}


def default_params(name: str) -> Any:
    spec = CATALOG[name]
    return spec.params() if spec.params is not None else None


def bind(name: str, params: Any) -> Callable[[CheckContext], CheckResult]:
    spec = CATALOG[name]
    return lambda ctx: spec.run(name, ctx, params)
