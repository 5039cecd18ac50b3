"""What a run did, in numbers: failures, promotions, stalls, downtime and ETTR."""

from __future__ import annotations

import itertools
import json
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from ft_launch.errors import ExitCode
from ft_launch.events import NodeDrained

from ..controller import events as controller_events
from .runlog import commits, controller_log


@dataclass(frozen=True)
class Summary:
    replicas: int
    final_step: int
    failures: int
    nodes_drained: list[str]
    promotions: int
    full_restarts: int
    wall_s: float
    median_step_s: float
    longest_stall_s: float        # longest gap between commits of any replica that kept going
    replica_downtime_s: float     # replica-seconds without training beyond normal steps
    ettr: float                   # useful replica-time / (replicas x wall time)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def summarize(run_dir: Path) -> Summary:
    control = controller_log(run_dir)
    by_replica = commits(run_dir)
    times = sorted(e.time for events in by_replica.values() for e in events)
    if not times:
        raise ValueError(f"no committed step in {run_dir}")
    # From the first commit: start-up is the same for every strategy; failures are not.
    wall = max(times) - min(times)
    gaps = [b - a for events in by_replica.values()
            for a, b in _pairs(sorted(e.time for e in events))]
    step = statistics.median(gaps) if gaps else 0.0
    useful = sum(min(g, 2 * step) for g in gaps) + step * len(by_replica)
    replicas = max(by_replica) + 1
    exits = [e for e in control if isinstance(e, controller_events.NodeFaultDetected)
             or (isinstance(e, controller_events.ReplicaExited)
                 and e.exit_code not in (ExitCode.OK, ExitCode.RUN_FINISHED))]
    drained = sorted({e.node for e in control if isinstance(e, NodeDrained)})
    return Summary(
        replicas=replicas,
        final_step=max(e.step for events in by_replica.values() for e in events),
        failures=len(exits), nodes_drained=drained,
        promotions=sum(isinstance(e, controller_events.StandbyPromoted) for e in control),
        full_restarts=sum(isinstance(e, controller_events.FullRestartOrdered) for e in control),
        wall_s=round(wall, 3), median_step_s=round(step, 4),
        longest_stall_s=round(max(gaps, default=0.0), 3),
        replica_downtime_s=round(replicas * wall - useful, 3),
        ettr=round(min(1.0, useful / (replicas * wall)) if wall > 0 else 1.0, 4))


def _pairs(values: list[float]) -> Iterable[tuple[float, float]]:
    return itertools.pairwise(values)
