"""Slurm job and node states, and the one table that maps them to our error taxonomy."""

from __future__ import annotations

import enum


class Disposition(enum.Enum):
    """What a Slurm state means for ft-launch."""

    ACTIVE = "active"              # still pending or running: nothing to do
    SUCCEEDED = "succeeded"
    RECOVERABLE = "recoverable"    # relaunch / requeue may succeed
    NODE_UNHEALTHY = "node_unhealthy"  # the node is bad: evict it, go on without it
    FATAL = "fatal"                # retrying cannot help


class JobState(enum.Enum):
    PENDING = "PENDING"
    CONFIGURING = "CONFIGURING"
    RUNNING = "RUNNING"
    COMPLETING = "COMPLETING"
    SUSPENDED = "SUSPENDED"
    RESIZING = "RESIZING"
    REQUEUED = "REQUEUED"
    COMPLETED = "COMPLETED"
    CANCELLED = "CANCELLED"
    FAILED = "FAILED"
    TIMEOUT = "TIMEOUT"
    NODE_FAIL = "NODE_FAIL"
    PREEMPTED = "PREEMPTED"
    BOOT_FAIL = "BOOT_FAIL"
    DEADLINE = "DEADLINE"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    UNKNOWN = "UNKNOWN"

    @classmethod
    def parse(cls, text: str) -> JobState:
        # squeue prints e.g. "CANCELLED by 0"; 24.11 JSON gives a list of names.
        word = text.split()[0].upper() if text.strip() else "UNKNOWN"
        return cls.__members__.get(word, cls.UNKNOWN)


class NodeState(enum.Enum):
    """Base node state; flags such as DRAIN or NOT_RESPONDING are kept apart."""

    IDLE = "IDLE"
    ALLOCATED = "ALLOCATED"
    MIXED = "MIXED"
    COMPLETING = "COMPLETING"
    DOWN = "DOWN"
    FUTURE = "FUTURE"
    UNKNOWN = "UNKNOWN"

    @classmethod
    def parse(cls, text: str) -> NodeState:
        word = text.strip().upper()
        return {"ALLOC": cls.ALLOCATED, "MIX": cls.MIXED, "COMP": cls.COMPLETING}.get(
            word, cls.__members__.get(word, cls.UNKNOWN))


#: Job (or step) end states -> what to do. PREEMPTED, NODE_FAIL and TIMEOUT are not
#: the job's fault: recoverable. Preemption is never treated as a failure of ours.
JOB_DISPOSITION: dict[JobState, Disposition] = {
    JobState.PENDING: Disposition.ACTIVE,
    JobState.CONFIGURING: Disposition.ACTIVE,
    JobState.RUNNING: Disposition.ACTIVE,
    JobState.COMPLETING: Disposition.ACTIVE,
    JobState.SUSPENDED: Disposition.ACTIVE,
    JobState.RESIZING: Disposition.ACTIVE,
    JobState.REQUEUED: Disposition.ACTIVE,
    JobState.COMPLETED: Disposition.SUCCEEDED,
    JobState.PREEMPTED: Disposition.RECOVERABLE,
    JobState.TIMEOUT: Disposition.RECOVERABLE,
    JobState.NODE_FAIL: Disposition.NODE_UNHEALTHY,
    JobState.BOOT_FAIL: Disposition.NODE_UNHEALTHY,
    JobState.FAILED: Disposition.RECOVERABLE,
    JobState.OUT_OF_MEMORY: Disposition.FATAL,
    JobState.CANCELLED: Disposition.FATAL,
    JobState.DEADLINE: Disposition.FATAL,
    JobState.UNKNOWN: Disposition.RECOVERABLE,
}

#: Node flags that mean "do not place work here".
UNUSABLE_NODE_FLAGS = frozenset({"DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING",
                                 "NOT_RESPONDING", "MAINT", "REBOOT_REQUESTED",
                                 "REBOOT_ISSUED", "POWERED_DOWN", "POWERING_DOWN",
                                 "INVALID_REG", "INVALID"})


def node_disposition(state: NodeState, flags: frozenset[str]) -> Disposition:
    """A node that is down or flagged unusable is unhealthy; otherwise it is usable."""
    if state is NodeState.DOWN or flags & UNUSABLE_NODE_FLAGS:
        return Disposition.NODE_UNHEALTHY
    return Disposition.ACTIVE
