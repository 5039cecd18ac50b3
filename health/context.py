"""What a check may look at: the node, the job (if any), the GPU backend and the
host's facts (``HostFacts``: /proc, /sys, filesystems, network)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .gpu_facts import GpuBackend, GpuSnapshot, NoGpuBackend
from .host_facts import HostFacts


@dataclass(frozen=True)
class JobFacts:
    """The Slurm job a hook runs for. ``ended``: the epilog (its processes should be gone)."""

    job_id: str
    uid: int | None = None
    user: str = ""
    ended: bool = False


@dataclass
class CheckContext:
    """Everything one profile run judges. ``host`` and ``gpu_backend`` are where facts
    come from (the settings choose the real ones or the simulated ones together)."""

    node: str
    gpu_backend: GpuBackend = field(default_factory=NoGpuBackend)
    expected_gpus: int = 0
    host: HostFacts = field(default_factory=HostFacts)
    job: JobFacts | None = None
    _snapshot: GpuSnapshot | None = field(default=None, init=False, repr=False)

    def gpu_snapshot(self) -> GpuSnapshot:
        """One snapshot per context: every GPU check of a profile judges the same moment."""
        if self._snapshot is None:
            self._snapshot = self.gpu_backend.snapshot()
        return self._snapshot
