"""Facts about the current allocation, read from the documented ``SLURM_*`` variables."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import UsageError
from .hostlist import expand
from .parse import JobInfo


@dataclass(frozen=True)
class Allocation:
    job_id: str
    nodes: tuple[str, ...]
    cpus_per_node: tuple[int, ...]
    batch_host: str | None
    job_name: str | None
    partition: str | None
    submit_dir: str | None

    @staticmethod
    def from_env(env: Mapping[str, str]) -> Allocation:
        """Read the allocation of the job this process runs in.

        Raises ``UsageError`` outside an allocation (no ``SLURM_JOB_ID``).
        """
        job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not job_id or not nodelist:
            raise UsageError("not inside a Slurm allocation (SLURM_JOB_ID / "
                             "SLURM_JOB_NODELIST unset)",
                             hint="run under sbatch/salloc, or pass --nodelist for a plan")
        nodes = tuple(expand(nodelist))
        cpus = env.get("SLURM_JOB_CPUS_PER_NODE", "")
        return Allocation(
            job_id=job_id,
            nodes=nodes,
            cpus_per_node=tuple(expand_counts(cpus)) if cpus else (),
            # In the batch script slurmd sets SLURMD_NODENAME to the batch host.
            batch_host=env.get("SLURMD_NODENAME"),
            job_name=env.get("SLURM_JOB_NAME"),
            partition=env.get("SLURM_JOB_PARTITION"),
            submit_dir=env.get("SLURM_SUBMIT_DIR"),
        )


def allocation_of_job(info: JobInfo) -> Allocation:
    """An allocation driven from outside it (``salloc --no-shell``, then ``srun
    --jobid``): no batch script, so no batch host that can take the job down."""
    if info.state.value != "RUNNING" or not info.nodes:
        raise UsageError(f"job {info.job_id} is {info.state.value}, not a running allocation",
                         hint="allocate first: salloc --no-shell --no-kill -N NODES")
    return Allocation(job_id=info.job_id, nodes=info.nodes, cpus_per_node=(),
                      batch_host=None, job_name=info.name, partition=None, submit_dir=None)


def expand_counts(text: str) -> list[int]:
    """Expand Slurm's repeated-count syntax: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            raise UsageError(f"bad Slurm count list {text!r}", hint="expected e.g. 2(x3),1")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts
