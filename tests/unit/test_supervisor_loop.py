"""The whole controller loop (``Supervisor.start`` / ``poll``) on a fake Slurm, with a
scripted clock and scripted worker event files: milliseconds per scenario.

The real-cluster tests (tests/slurm/test_run.py) stay the authority on Slurm; these
check the loop's wiring: observation -> one decision -> actions, each with its reason.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from ftcore.config import Config, HealthConfig, RecoveryConfig
from ftcore.errors import ExitCode
from ftcore.events import EventLog, NodeDrained, read_events
from ftcore.slurm.client import SlurmBackend
from launcher import lifecycle as lc
from launcher import versions as cv
from launcher.events import ActionTaken, NodeDrainRequested, NodeFaultDetected, RunFinished
from launcher.plan import LaunchPlan, ReplicaPlacement
from launcher.quorum.events import MembersLivenessChanged
from launcher.run_state import ReplicaState
from launcher.standby import activation_file
from launcher.supervisor import NODE_CHECK_INTERVAL, Supervisor
from launcher.worker.events import StepCommitted, StepDiscarded, WorkerStarted
from launcher.worker.identity import ENV_SECRET
from tests.fakes.slurm import FakeSlurm

pytestmark = pytest.mark.timeout(10)
JOB = "100"
LOST = 10.0


class Clock:
    """The loop's only time source; the test moves it."""

    def __init__(self) -> None:
        self.elapsed = 0.0

    def __call__(self) -> lc.Now:
        return lc.Now(elapsed=self.elapsed, wall=1_700_000_000.0 + self.elapsed)

    def advance(self, seconds: float) -> None:
        self.elapsed += seconds


@dataclasses.dataclass
class Loop:
    supervisor: Supervisor
    slurm: FakeSlurm
    clock: Clock
    run_dir: Path
    events: EventLog
    steps: dict[int, int] = dataclasses.field(default_factory=dict)

    def worker(self, replica_id: int, *lines: object) -> None:
        path = self.run_dir / "events" / f"replica-{replica_id}-rank-0.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as handle:
            for line in lines:
                handle.write(line.to_json() + "\n")  # type: ignore[attr-defined]

    def started(self, *replica_ids: int) -> None:
        for r in replica_ids:
            self.worker(r, WorkerStarted(replica_id=r, rank=0, next_step=self.steps.get(r, 0)))

    def commit(self, *replica_ids: int) -> None:
        for r in replica_ids:
            self.steps[r] = self.steps.get(r, 0) + 1
            self.worker(r, StepCommitted(replica_id=r, rank=0, step=self.steps[r], quorum_id=1,
                                         contributors=len(replica_ids), caught_up=False,
                                         lr_factor=1.0))

    def poll(self, seconds: float = 1.0) -> int | None:
        self.clock.advance(seconds)
        return self.supervisor.poll()

    def records(self) -> list[object]:
        self.events.close()
        return list(read_events(self.run_dir / "controller.jsonl"))

    def state(self, replica_id: int) -> ReplicaState:
        return self.supervisor.state.run.replica(replica_id).state


@pytest.fixture
def loop(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)     # the command's digest reads files relative to here

    def make(replicas: int = 3, standby: tuple[str, ...] = ("s1",), can_drain: bool = True
             ) -> Loop:
        nodes = [f"n{r}" for r in range(replicas)]
        slurm = FakeSlurm(JOB, [*nodes, *standby], can_drain=can_drain)
        backend: SlurmBackend = slurm      # the fake keeps to the Protocol
        config = Config(health=HealthConfig(inspection=False),
                        recovery=RecoveryConfig(lost_timeout=LOST, start_timeout=60.0))
        plan = LaunchPlan(job_id=JOB, replicas=tuple(ReplicaPlacement(r, (n,))
                                                     for r, n in enumerate(nodes)),
                          standby=standby, excluded=(), tasks_per_node=1,
                          command=("python", "train.py"))
        clock = Clock()
        events = EventLog(tmp_path / "controller.jsonl")
        supervisor = Supervisor(config, plan, backend, tmp_path, {ENV_SECRET: "s"}, events,
                                clock=clock)
        supervisor.start()
        return Loop(supervisor, slurm, clock, tmp_path, events)

    return make


def taken(records: list[object]) -> list[tuple[str, int | None, str | None]]:
    return [(r.action, r.replica_id, r.node) for r in records if isinstance(r, ActionTaken)]


def test_a_lost_node_is_drained_with_the_sanitised_reason_and_the_standby_promoted(loop):
    run = loop()
    assert [s.spec.name for s in run.slurm.live_steps()] == [
        "replica-0", "replica-1", "replica-2", "standby-s1"]
    run.started(0, 1, 2)
    run.commit(0, 1, 2)
    assert run.poll() is None
    assert run.state(1) is ReplicaState.RUNNING
    run.slurm.fail_node("n1")
    assert run.poll(NODE_CHECK_INTERVAL + 1) is None
    drains = [c for c in run.slurm.calls if c[0] == "set_node_state"]
    assert drains == [("set_node_state", "n1", "drain", "ft: Slurm reports DOWN+NOT_RESPONDING")]
    assert not run.slurm.step_named("replica-1").running    # cancelled
    assert run.slurm.step_named("standby-s1").running       # its agent is the replica now
    order = json.loads(activation_file(run.run_dir, "s1").read_text())
    assert order["command"] == ["python", "train.py"]
    assert run.state(1) is ReplicaState.RECOVERING
    # the promoted agent's process starts and commits: the replica is back
    run.started(1)
    run.commit(0, 1, 2)
    run.poll()
    assert run.state(1) is ReplicaState.RUNNING
    for name in ("replica-0", "replica-2", "standby-s1"):
        run.slurm.step_named(name).exit(0)
    assert run.poll() == ExitCode.OK
    records = run.records()
    assert taken(records)[:3] == [("StartReplica", 0, None), ("StartReplica", 1, None),
                                  ("StartReplica", 2, None)]
    assert ("EvictNode", None, "n1") in taken(records)
    assert ("PromoteStandby", 1, "s1") in taken(records)
    reasons = {r.action: r.reason for r in records if isinstance(r, ActionTaken)}
    assert "n1" in reasons["PromoteStandby"] and "s1" in reasons["PromoteStandby"]
    assert [r.reason for r in records if isinstance(r, NodeDrained)] == [
        "ft: Slurm reports DOWN+NOT_RESPONDING"]
    assert [r.exit_code for r in records if isinstance(r, RunFinished)] == [0]


def test_a_crash_is_retried_in_place_then_its_node_evicted(loop):
    run = loop()
    run.started(0, 1, 2)
    run.commit(0, 1, 2)
    run.poll()
    run.slurm.step_named("replica-2").exit(1)
    run.poll()
    retry = run.slurm.step_named("replica-2")
    assert retry.running and retry.spec.nodes == ("n2",)
    assert "slurm_plugins.gate" in retry.spec.command      # stop-time diagnosis first
    assert not any(c[0] == "set_node_state" for c in run.slurm.calls)
    retry.exit(1)                                           # again, no step in between
    run.poll()
    assert ("set_node_state", "n2", "drain",
            "ft: replica 2 failed 2 times in a row (last exit code 1)") in run.slurm.calls
    assert run.supervisor.state.run.replica(2).nodes == ("s1",)


def test_a_silent_replica_among_moving_ones_is_evicted_after_the_lost_timeout(loop):
    run = loop()
    run.started(0, 1, 2)
    for _ in range(int(LOST) + 4):                          # replica 2 never commits
        run.commit(0, 1)
        assert run.poll() is None
    faults = [r for r in run.records() if isinstance(r, NodeFaultDetected)]
    assert [(f.node, f.replica_id) for f in faults] == [("n2", 2)]
    assert "made no progress" in faults[0].reason


def test_a_node_whose_ranks_keep_computing_nan_is_drained_and_replaced(loop):
    """Each replica discards a step with a NaN average; only the replica whose own
    ranks computed it names their node. The third such step drains that node."""
    run = loop()
    run.started(0, 1, 2)
    for step in (5, 9, 14):
        run.commit(0, 1, 2)
        for r in range(3):
            run.worker(r, StepDiscarded(replica_id=r, rank=0, step=step, quorum_id=1,
                                        reason="NaN", nonfinite_nodes=["n1"] if r == 1 else []))
        assert run.poll() is None
    drains = [c for c in run.slurm.calls if c[0] == "set_node_state"]
    assert drains == [("set_node_state", "n1", "drain",
                       "ft: sdc: gradients computed on n1 held NaN/Inf in 3 steps (replica 1)")]
    assert not run.slurm.step_named("replica-1").running
    assert run.supervisor.state.run.replica(1).nodes == ("s1",)


def test_a_replica_the_quorum_lost_is_replaced_before_the_lost_timeout(loop):
    run = loop()
    run.started(0, 1, 2)
    run.commit(0, 1, 2)
    run.poll()
    run.worker(0, MembersLivenessChanged(replica_id=0, lost=[2], recovered=[]))
    run.commit(0, 1)                   # the survivors go on without it
    assert run.poll(0.2) is None       # well inside LOST
    drains = [c for c in run.slurm.calls if c[0] == "set_node_state"]
    reason = "ft: the quorum of replica 0 lost replica 2, and replica 0 trained on without it"
    assert drains == [("set_node_state", "n2", "drain", reason)]
    assert run.supervisor.state.run.replica(2).nodes == ("s1",)


def test_replicas_stalled_together_are_not_blamed(loop):
    run = loop()
    run.started(0, 1, 2)
    run.commit(0, 1, 2)
    run.poll()
    for _ in range(5):              # the quorum re-forms: nobody commits for a while
        assert run.poll(LOST) is None
    assert not any(isinstance(r, NodeFaultDetected) for r in run.records())


def test_without_drain_rights_the_epilog_is_asked_with_the_same_reason(loop):
    run = loop(can_drain=False)
    run.started(0, 1, 2)
    run.commit(0, 1, 2)
    run.poll()
    run.slurm.fail_node("n0")
    run.poll(NODE_CHECK_INTERVAL + 1)
    request = json.loads((run.run_dir / "drain-requests" / "n0.json").read_text())
    assert request == {"job_id": JOB, "node": "n0",
                       "reason": "Slurm reports DOWN+NOT_RESPONDING"}
    assert run.slurm.comments[JOB].startswith("ft-launch-run=")
    assert [r.node for r in run.records() if isinstance(r, NodeDrainRequested)] == ["n0"]


def test_a_gate_reason_is_sanitised_before_it_reaches_scontrol(loop):
    run = loop()
    run.started(0, 1, 2)
    run.commit(0, 1, 2)
    run.poll()
    unhealthy = run.run_dir / "standby" / "n0.unhealthy"
    unhealthy.parent.mkdir(parents=True, exist_ok=True)
    unhealthy.write_text('gpu3 "xid" 79\n$(reboot)')
    run.slurm.step_named("replica-0").exit(ExitCode.NODE_UNHEALTHY)
    run.poll()
    (drain,) = [c for c in run.slurm.calls if c[0] == "set_node_state"]
    assert drain == ("set_node_state", "n0", "drain", "ft: gpu3 xid 79 (reboot)")


def test_a_broken_update_is_rolled_back_without_evicting_a_node(loop):
    run = loop(replicas=2)
    run.started(0, 1)
    run.commit(0, 1)
    run.poll()
    cv.write_update_request(run.run_dir, ["python", "train_v2.py"], urgent=True,
                            window_s=None, note="v2", now=0.0)
    run.poll()
    first = run.slurm.step_named("replica-0")
    assert first.spec.command[-1] == "train_v2.py"          # restarted onto v2 at once
    for _ in range(2):                                      # v2 crashes before a step
        run.started(0)
        run.slurm.step_named("replica-0").exit(1)
        run.poll()
    assert run.supervisor.state.run.current == 1 and run.supervisor.state.run.bad == (2,)
    assert run.slurm.step_named("replica-0").spec.command[-1] == "train.py"
    assert not any(c[0] == "set_node_state" for c in run.slurm.calls)
