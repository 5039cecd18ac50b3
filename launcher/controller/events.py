"""The controller's events (JSON lines in ``<run_dir>/controller.jsonl``), and a
reader that follows the workers' event files as they grow."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ft_launch.events import Event, event_from_json


@dataclass(frozen=True)
class ReplicaLaunched(Event):
    replica_id: int
    nodes: list[str]
    how: str            # "initial" | "retry" | "relaunch" | "promoted" | "restart"


@dataclass(frozen=True)
class ReplicaExited(Event):
    replica_id: int
    exit_code: int


@dataclass(frozen=True)
class NodeFaultDetected(Event):
    node: str
    replica_id: int | None
    reason: str


@dataclass(frozen=True)
class FailSlowDetected(Event):
    """A replica's own step time stayed an outlier against its peers' (fail-slow)."""

    replica_id: int
    nodes: list[str]
    own_s: float
    peers_s: float
    steps: int
    reason: str


@dataclass(frozen=True)
class LossSpiked(Event):
    """The job's loss spiked at ``step``: the mean over ``replicas`` replicas against the
    median of the steps before it (``recovery.spike_*``). ``action``: "rollback" (every
    replica restarts from its newest state before ``step``) or "report"."""

    step: int
    loss: float
    baseline: float
    replicas: int
    action: str
    reason: str


@dataclass(frozen=True)
class SdcReplayOrdered(Event):
    """A multi-node replica kept computing NaN/Inf: cancelled, and replayed on its nodes
    and healthy references to find which node computes them (``replay_rule``)."""

    replica_id: int
    suspects: list[str]
    references: list[str]
    steps: int                  # the NaN/Inf steps that led to it
    reason: str


@dataclass(frozen=True)
class SdcReplayReported(Event):
    """A dual-phase replay's verdict (``sdc_replay``)."""

    replica_id: int
    status: str                 # found | not_reproduced | ambiguous | failed
    suspects: list[str]         # the node found (or the candidates)
    failed_rows: list[int]
    failed_columns: list[int]
    step: int | None            # the step replayed (None: it never ran)
    summary: str
    report: str                 # path of the readable report ("" when none was written)
    duration_s: float


@dataclass(frozen=True)
class StandbyPromoted(Event):
    replica_id: int
    node: str
    how: str = "warm agent in the allocation"


@dataclass(frozen=True)
class NodeDrainRequested(Event):
    """Evicted, but not drained (no operator rights): left to the node's Epilog."""

    node: str
    reason: str


@dataclass(frozen=True)
class FullRestartOrdered(Event):
    """Most replicas lost at once: every replica restarts from the newest checkpoint."""

    placements: dict[str, list[str]]    # replica id -> nodes


@dataclass(frozen=True)
class ActionTaken(Event):
    """One action of the controller's decision, and why it was taken."""

    action: str                 # its type: "EvictNode", "PromoteStandby", ...
    replica_id: int | None
    node: str | None
    reason: str


@dataclass(frozen=True)
class ControllerWitnessChosen(Event):
    """Whether the controller votes as witness 0, at which address, and why: the
    replicas count it only if it does (``quorum.witness_service``)."""

    voting: bool
    address: str
    reason: str


@dataclass(frozen=True)
class RunFinished(Event):
    exit_code: int
    reason: str


class EventTail:
    """New complete lines of a JSON-lines file since the last call (a line still
    being written is left for the next call)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def read(self) -> list[Event]:
        try:
            with self.path.open("rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        complete = data[:data.rfind(b"\n") + 1]
        self.offset += len(complete)
        events = []
        for line in complete.decode("utf-8").splitlines():
            try:
                events.append(event_from_json(line))
            except ValueError:
                continue  # an event type this reader does not know: not ours to act on
        return events
