"""What a run did, read back from its directory: the status view and the summary."""

from __future__ import annotations

import itertools
import json
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from ftcore.events import Event, NodeDrained, read_events
from launcher.worker import events as worker_events

from . import events as controller_events
from . import versions  # noqa: F401  (registers the code-version events it logs)


def _events(path: Path) -> list[Event]:
    try:
        return list(read_events(path))
    except (FileNotFoundError, ValueError):
        return []


def controller_log(run_dir: Path) -> list[Event]:
    return _events(run_dir / "controller.jsonl")


def commits(run_dir: Path) -> dict[int, list[worker_events.StepCommitted]]:
    found: dict[int, list[worker_events.StepCommitted]] = {}
    for path in sorted((run_dir / "events").glob("replica-*-rank-0.jsonl")):
        replica_id = int(path.name.split("-")[1])
        found[replica_id] = [e for e in _events(path)
                             if isinstance(e, worker_events.StepCommitted)]
    return found


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
             or (isinstance(e, controller_events.ReplicaExited) and e.exit_code != 0)]
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


def status_text(run_dir: Path, recent: int = 8) -> str:
    control = controller_log(run_dir)
    by_replica = commits(run_dir)
    launches: dict[int, controller_events.ReplicaLaunched] = {}
    for event in control:
        if isinstance(event, controller_events.ReplicaLaunched):
            launches[event.replica_id] = event
    lines = [f"run {run_dir}"]
    lines.append("  replica  nodes        how        last step  contributors")
    for replica_id in sorted(set(launches) | set(by_replica)):
        launch = launches.get(replica_id)
        last = by_replica.get(replica_id, [])
        lines.append(f"  {replica_id:<7d}  {','.join(launch.nodes) if launch else '?':<11s}  "
                     f"{launch.how if launch else '?':<9s}  "
                     f"{last[-1].step if last else '-':>9}  "
                     f"{last[-1].contributors if last else '-':>12}")
    ready = sorted(p.stem for p in (run_dir / "standby").glob("*.ready"))
    used = sorted(p.stem for p in (run_dir / "standby").glob("*.activate"))
    lines.append(f"  standby warm: {', '.join(n for n in ready if n not in used) or '-'}"
                 f"   promoted: {', '.join(used) or '-'}")
    lines.append("recent events:")
    for event in control[-recent:]:
        fields = {k: v for k, v in asdict(event).items() if k != "time"}
        lines.append(f"  {type(event).__name__} {fields}")
    return "\n".join(lines) + "\n"
