"""One real ``ft-launch run`` on the lab cluster with one fault on one node, timed
from what the run wrote (root; the cluster up). The harness of
``detection_bench.py``'s product figures and of ``hang_diagnosis.py``.

``etc/examples/train.sbatch`` on four pinned nodes: the batch host (the standby)
first, then replicas 0, 1, 2 of two FSDP2 ranks each. The fault goes to replica 1's
node:

* ``hang``: its rank 1 deadlocks before step STEP's commit vote (``hang@before_commit``);
* ``sdc``: its rank 1 puts a NaN into its gradients from step STEP on (``nan@gradients``,
  a GPU computing garbage);
* ``slow``: once every replica passed step STEP, its training processes are throttled
  (``labcluster.throttle_node``, SIGSTOP/SIGCONT bursts) until it is drained;
* ``kill``: once every replica passed step STEP, the node crashes (``labcluster.kill_node``).

Timed, from the fault (the rank's own ``injecting fault`` log line for an injected
fault; the injector's clock for ``slow`` and ``kill``: the lab cluster's nodes share
this machine's clock): the controller's detection event, the node drained (the
controller's ``NodeDrained``, with the fault's reason), and the replica back (the
promoted incarnation's first commit).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ft_launch.events import Event, NodeDrained
from ft_launch.launcher.controller.diagnosis import HangDiagnosisReported
from ft_launch.launcher.controller.events import (
    EventTail,
    FailSlowDetected,
    NodeDrainRequested,
    NodeFaultDetected,
    ReplicaLaunched,
    StandbyPromoted,
)
from ft_launch.launcher.reporting.runlog import commits, controller_log
from ft_launch.launcher.worker.events import StepCommitted, WorkerStarted
from tests.cluster import labcluster
from tests.faults import lab_env
from tests.waiting import wait_until

#: The replica whose node gets the fault (replica 0 shares its CPUs' rhythm with the
#: batch host's controller; any other would do as well).
FAULTY_REPLICA = 1
REPLICAS = 3
#: Detection settings of every run (recorded with the results): the stall rule after
#: 4 s without a commit; no persistent checkpoints in the way of the timings.
DETECTION = {"FTL_RECOVERY_LOST_TIMEOUT": "4", "FTL_RECOVERY_START_TIMEOUT": "60",
             "FTL_QUORUM_JOIN_TIMEOUT": "1", "FTL_CKPT_PERSIST_EVERY": "100000"}
#: How the rank's log says a scripted fault fired (``tests/faults/injector.py``).
FAULT_LINE = "injecting fault: {action} "
LOG_STAMP = "%Y-%m-%d %H:%M:%S,%f"          # ft_launch.logs.FORMAT's asctime


@dataclass(frozen=True)
class FaultKind:
    """How a fault is injected and how the controller's answer to it reads."""

    inject: str | None          # FTL_WORKER_INJECT template ({step}, {node}); None: from outside
    detected: Callable[[Event, str, int], bool]     # (event, node, replica_id)
    drain_reason: str           # what the drain's reason holds ("": any)

    @property
    def action(self) -> str | None:
        """The injected action, as its rank logs it."""
        return self.inject.split("@", 1)[0] if self.inject else None


FAULTS: dict[str, FaultKind] = {
    "hang": FaultKind("hang@before_commit:{step}/1@{node}",
                      lambda e, node, rid: isinstance(e, HangDiagnosisReported)
                      and e.replica_id == rid, "hang:"),
    "sdc": FaultKind("nan@gradients:{step}+/1@{node}",
                     lambda e, node, rid: isinstance(e, NodeFaultDetected)
                     and e.node == node and e.reason.startswith("sdc:"), "sdc:"),
    "slow": FaultKind(None, lambda e, node, rid: isinstance(e, FailSlowDetected)
                      and e.replica_id == rid and node in e.nodes, "fail-slow:"),
    "kill": FaultKind(None, lambda e, node, rid: isinstance(e, NodeFaultDetected)
                      and e.node == node, ""),
}


# =========================================================================== the timings (pure)


@dataclass(frozen=True)
class FaultTimings:
    """What a run with one fault wrote, as times since the epoch (None: not there)."""

    fault: str
    node: str
    replica_id: int
    fault_at: float | None
    fault_source: str                   # "rank log" | "injector"
    event: Event | None                 # the controller's detection event
    drained: Event | None               # NodeDrained (NodeDrainRequested without rights)
    back_at: float | None               # the promoted replica's first commit

    def figures(self) -> dict[str, Any]:
        """Seconds from the fault to each answer, rounded to the millisecond."""
        def since(at: float | None) -> float | None:
            if at is None or self.fault_at is None:
                return None
            return round(at - self.fault_at, 3)
        return {"fault_to_event_s": since(self.event.time if self.event else None),
                "fault_to_drained_s": since(self.drained.time if self.drained else None),
                "fault_to_back_s": since(self.back_at),
                "event": type(self.event).__name__ if self.event else None,
                "drain_reason": getattr(self.drained, "reason", None),
                "node": self.node, "fault_source": self.fault_source}

    @property
    def complete(self) -> bool:
        return None not in (self.fault_at, self.event, self.drained, self.back_at)


def logged_fault_time(logs: Path, replica_id: int, action: str) -> float | None:
    """When a rank of ``replica_id`` first logged that ``action`` fired (in its
    ``logs/replica-R.K.log``)."""
    marker = FAULT_LINE.format(action=action)
    found = []
    for path in logs.glob(f"replica-{replica_id}.*.log"):
        for line in path.read_text(errors="replace").splitlines():
            if marker in line:
                found.append(datetime.strptime(line[:23], LOG_STAMP).timestamp())
                break
    return min(found, default=None)


def first_commit_after(events: list[Event], since: float) -> float | None:
    """The first commit of the incarnation started after ``since`` (an older one may
    still commit a step while the controller promotes the standby)."""
    started = next((e.time for e in events if isinstance(e, WorkerStarted) and e.time > since),
                   None)
    if started is None:
        return None
    return next((e.time for e in events if isinstance(e, StepCommitted) and e.time > started),
                None)


def fault_timings(run_dir: Path, fault: str, node: str, replica_id: int,
                  injected_at: float | None = None) -> FaultTimings:
    """The timings of ``fault`` on ``node`` (of ``replica_id``) in ``run_dir``; its
    time from ``injected_at`` when it came from outside, else from the rank's log.
    Only the controller's answers after the fault count."""
    kind = FAULTS[fault]
    if kind.action is not None:
        fault_at, source = logged_fault_time(run_dir / "logs", replica_id, kind.action), "rank log"
    else:
        fault_at, source = injected_at, "injector"
    after = [e for e in controller_log(run_dir) if fault_at is None or e.time >= fault_at]
    event = next((e for e in after if kind.detected(e, node, replica_id)), None)
    drained = next((e for e in after if isinstance(e, (NodeDrained, NodeDrainRequested))
                    and e.node == node and kind.drain_reason in e.reason), None)
    promoted = next((e for e in after if isinstance(e, StandbyPromoted)
                     and e.replica_id == replica_id), None)
    rank0 = EventTail(run_dir / "events" / f"replica-{replica_id}-rank-0.jsonl").read()
    back_at = first_commit_after(rank0, promoted.time) if promoted else None
    return FaultTimings(fault, node, replica_id, fault_at, source, event, drained, back_at)


# =========================================================================== the run (effects)


@dataclass(frozen=True)
class ProductRun:
    job_id: str
    run_dir: Path
    timings: FaultTimings
    error: str | None           # why a figure is missing (a wait that timed out)

    def figures(self) -> dict[str, Any]:
        return {**self.timings.figures(), "job_id": self.job_id, "run_dir": str(self.run_dir),
                "error": self.error}


def why_unavailable() -> str | None:
    """Why no real run can be made here, or None."""
    if os.geteuid() != 0:
        return "not root: the lab cluster's faults need root"
    if labcluster.current_state() is None:
        return "the lab cluster is not up (tests/cluster/slurm-cluster up)"
    return None


def run_with_fault(fault: str, step: int = 60, steps: int = 400,
                   timeout: float = 180) -> ProductRun:
    """Submit the example, inject ``fault`` into replica 1's node at ``step``, wait
    (``timeout`` s per stage, stretched by the load) until the replica is back on the
    standby, cancel the job and heal the node."""
    kind = FAULTS[fault]
    nodes = labcluster.require_state().nodes[:REPLICAS + 1]
    node = nodes[1 + FAULTY_REPLICA]            # the batch host, the standby, is first
    runs = Path(tempfile.mkdtemp(prefix=f"ftl-{fault}-bench-")) / "runs"
    settings = {"PYTHON": sys.executable, "STEPS": str(steps), "SIZE": "small",
                "TASKS_PER_NODE": "2", "FTL_RUN_LOG_DIR": str(runs), **DETECTION}
    if kind.inject:     # the workers' step observer injects it
        settings["FTL_WORKER_INJECT"] = kind.inject.format(step=step, node=node)
        settings.update(lab_env())
    job_id = labcluster.ctl_run(
        ["sbatch", "--parsable", f"--chdir={REPO}", f"--nodelist={','.join(nodes)}",
         f"--output={runs.parent}/job.out",
         "--export=" + ",".join(["ALL", *(f"{k}={v}" for k, v in settings.items())]),
         str(REPO / "etc" / "examples" / "train.sbatch")]).stdout.strip().split(";")[0]
    run_dir = runs / job_id
    injected_at, error = None, None
    try:
        placed = wait_until(lambda: replica_node(run_dir, FAULTY_REPLICA), timeout,
                            f"job {job_id} to launch replica {FAULTY_REPLICA}", interval=0.2)
        if placed != node:
            raise AssertionError(f"replica {FAULTY_REPLICA} runs on {placed}, not {node}")
        if kind.inject is None:
            wait_until(lambda: trained_past(run_dir, step), timeout,
                       f"every replica to pass step {step}", interval=0.2)
            if fault == "kill":
                labcluster.kill_node(node)
            injected_at = time.time()
        with labcluster.throttle_node(node) if fault == "slow" else nullcontext():
            wait_until(lambda: fault_timings(run_dir, fault, node, FAULTY_REPLICA,
                                             injected_at).drained, timeout,
                       f"{node} to be drained", interval=0.2)
        wait_until(lambda: fault_timings(run_dir, fault, node, FAULTY_REPLICA,
                                         injected_at).complete, timeout,
                   f"replica {FAULTY_REPLICA} back on the standby", interval=0.2)
    except AssertionError as failure:
        error = str(failure)
    finally:
        labcluster.ctl_run(["scancel", job_id], check=False)
        labcluster.heal_node(node)
    return ProductRun(job_id, run_dir, fault_timings(run_dir, fault, node, FAULTY_REPLICA,
                                                     injected_at), error)


def replica_node(run_dir: Path, replica_id: int) -> str | None:
    launched = [e for e in controller_log(run_dir)
                if isinstance(e, ReplicaLaunched) and e.replica_id == replica_id]
    return launched[0].nodes[0] if launched else None


def trained_past(run_dir: Path, step: int) -> bool:
    found = commits(run_dir)
    return len(found) == REPLICAS and all(
        events and events[-1].step >= step for events in found.values())
