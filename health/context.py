"""What a check may look at: the node, the job (if any), the GPU backend, the
simulated faults, and the roots of /proc and /sys (tests point them elsewhere)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .gpu_facts import GpuBackend, GpuSnapshot, NoGpuBackend
from .simulation import SimulatedFaults


@dataclass(frozen=True)
class JobFacts:
    """The Slurm job a hook runs for. ``ended``: the epilog (its processes should be gone)."""

    job_id: str
    uid: int | None = None
    user: str = ""
    ended: bool = False


@dataclass
class CheckContext:
    node: str
    gpu_backend: GpuBackend = field(default_factory=NoGpuBackend)
    expected_gpus: int = 0
    faults: SimulatedFaults = field(default_factory=SimulatedFaults)
    job: JobFacts | None = None
    proc_root: Path = Path("/proc")
    sys_root: Path = Path("/sys")
    _snapshot: GpuSnapshot | None = field(default=None, init=False, repr=False)

    def gpu_snapshot(self) -> GpuSnapshot:
        """One snapshot per context: every GPU check of a profile judges the same moment."""
        if self._snapshot is None:
            self._snapshot = self.gpu_backend.snapshot()
        return self._snapshot
