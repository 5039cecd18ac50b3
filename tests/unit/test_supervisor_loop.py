"""The whole controller loop (``Supervisor.start`` / ``poll``) on a fake Slurm, with a
scripted clock and scripted worker event files: milliseconds per scenario.

The real-cluster tests (tests/slurm/test_run.py) stay the authority on Slurm; these
check the loop's wiring: observation -> one decision -> actions, each with its reason.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from ft_launch.config import (
    Config,
    HealthConfig,
    JobConfig,
    PromotionPath,
    RecoveryConfig,
    SlowPolicy,
    StandbyMode,
)
from ft_launch.errors import ExitCode
from ft_launch.events import EventLog, NodeDrained, read_events
from ft_launch.launcher.controller import lifecycle, versions
from ft_launch.launcher.controller.diagnosis import HangDiagnosisReported
from ft_launch.launcher.controller.events import (
    ActionTaken,
    FailSlowDetected,
    LossSpiked,
    NodeDrainRequested,
    NodeFaultDetected,
    RunFinished,
)
from ft_launch.launcher.controller.plan import LaunchPlan, ReplicaPlacement
from ft_launch.launcher.controller.pool import GROW_RETRY_FIRST_S
from ft_launch.launcher.controller.run_state import ReplicaState
from ft_launch.launcher.controller.standby import activation_file
from ft_launch.launcher.controller.supervisor import NODE_CHECK_INTERVAL, Supervisor
from ft_launch.launcher.quorum.events import MembersLivenessChanged
from ft_launch.launcher.worker.events import StepCommitted, StepDiscarded, WorkerStarted
from ft_launch.launcher.worker.identity import ENV_SECRET, WorkerIdentity
from ft_launch.launcher.worker.pids import write_rank_pid
from ft_launch.slurm.client import SlurmBackend
from tests.fakes.slurm import FakeSlurm
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(10)
JOB = "100"
LOST = 10.0


class Clock:
    """The loop's only time source; the test moves it."""

    def __init__(self) -> None:
        self.elapsed = 0.0

    def __call__(self) -> lifecycle.Now:
        return lifecycle.Now(elapsed=self.elapsed, wall=1_700_000_000.0 + self.elapsed)

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

    def make(replicas: int = 3, standby: tuple[str, ...] = ("s1",), can_drain: bool = True,
             job: JobConfig | None = None, grants: tuple[tuple[str, ...] | str, ...] = (),
             **recovery: object) -> Loop:
        """``job``/``grants``: a reservation pool's config and Slurm's answers to its
        allocations."""
        nodes = [f"n{r}" for r in range(replicas)]
        slurm = FakeSlurm(JOB, [*nodes, *standby], can_drain=can_drain)
        slurm.script_allocations(*grants)
        backend: SlurmBackend = slurm      # the fake keeps to the Protocol
        config = Config(job=job or JobConfig(), health=HealthConfig(inspection=False),
                        recovery=RecoveryConfig(lost_timeout=LOST, start_timeout=60.0,
                                                **recovery))  # type: ignore[arg-type]
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


def test_a_reservation_pool_short_after_a_promotion_keeps_trying_to_grow(loop):
    """The reservation had no free node when the promotion used the pool's one: the
    controller tries again after a backoff, not once, and refills the pool when
    Slurm grants a node."""
    refused = "salloc: error: Unable to allocate resources: Requested nodes are busy"
    run = loop(standby=(), job=JobConfig(replicas=3, standby=1,
                                         standby_mode=StandbyMode.RESERVATION,
                                         reservation="pool",
                                         promote_by=PromotionPath.STANDBY_JOB),
               grants=(("r1",), refused, refused, ("r2",)))
    assert run.slurm.step_named("standby-r1").running
    run.started(0, 1, 2)
    run.commit(0, 1, 2)
    run.poll()
    run.slurm.fail_node("n1")
    run.poll(NODE_CHECK_INTERVAL + 1)
    assert run.supervisor.state.run.replica(1).nodes == ("r1",)

    def tries() -> int:
        return sum(c[0] == "allocate" for c in run.slurm.calls)

    assert tries() == 2                               # the pool, then its first refill
    run.poll(GROW_RETRY_FIRST_S / 2)
    assert tries() == 2                               # not before the backoff
    run.poll(GROW_RETRY_FIRST_S / 2)
    assert tries() == 3                               # refused again: the wait doubles
    run.poll(GROW_RETRY_FIRST_S * 1.5)
    assert tries() == 3
    run.poll(GROW_RETRY_FIRST_S / 2)
    assert tries() == 4
    assert run.slurm.step_named("standby-r2").running
    assert run.supervisor.state.run.standby == ("r2",)
    run.poll(GROW_RETRY_FIRST_S * 100)
    assert tries() == 4                               # the pool is whole: no more tries


def test_a_promotion_slurm_refuses_costs_the_node_not_the_run(loop):
    """Expansion path: the standby job is cancelled, but the expansion's salloc times
    out (a busy slurmctld, the node slow to end its standby job). The controller lives
    on: the node is evicted with why, and with no standby left the replica is lost
    while the others train on."""
    timed_out = ("'salloc ... --dependency=expand:42 --immediate=30' did not answer within "
                 "60 s")
    run = loop(standby=(), job=JobConfig(replicas=3, standby=1,
                                         standby_mode=StandbyMode.RESERVATION,
                                         reservation="pool", promote_by=PromotionPath.EXPANSION),
               grants=(("r1",), timed_out))
    run.started(0, 1, 2)
    run.commit(0, 1, 2)
    run.poll()
    run.slurm.fail_node("n1")
    assert run.poll(NODE_CHECK_INTERVAL + 1) is None
    drains = [c[1:] for c in run.slurm.calls if c[0] == "set_node_state"]
    assert drains[0] == ("n1", "drain", "ft: Slurm reports DOWN+NOT_RESPONDING")
    ((node, state, reason),) = drains[1:]
    assert (node, state) == ("r1", "drain") and "promotion failed" in reason
    assert ("cancel_job", "101") in run.slurm.calls       # its standby job, given back
    assert run.state(1) is ReplicaState.FAILED
    assert all(run.slurm.step_named(f"replica-{r}").running for r in (0, 2))
    assert run.poll() is None


def test_a_crash_is_retried_in_place_then_its_node_evicted(loop):
    run = loop()
    run.started(0, 1, 2)
    run.commit(0, 1, 2)
    run.poll()
    run.slurm.step_named("replica-2").exit(1)
    run.poll()
    retry = run.slurm.step_named("replica-2")
    assert retry.running and retry.spec.nodes == ("n2",)
    assert "ft_launch.slurm_plugins.gate" in retry.spec.command      # stop-time diagnosis first
    assert not any(c[0] == "set_node_state" for c in run.slurm.calls)
    retry.exit(1)                                           # again, no step in between
    run.poll()
    assert ("set_node_state", "n2", "drain",
            "ft: replica 2 failed 2 times in a row (last exit code 1)") in run.slurm.calls
    assert run.supervisor.state.run.replica(2).nodes == ("s1",)


def test_a_silent_replica_among_moving_ones_is_evicted_after_the_lost_timeout(loop):
    """Its stacks are asked for first; with no pid file to go by (its ranks never
    started their manager) every rank is suspect: its node goes."""
    run = loop()
    run.started(0, 1, 2)
    for _ in range(int(LOST) + 4):                          # replica 2 never commits
        run.commit(0, 1)
        assert run.poll() is None
    wait_until(lambda: run.poll(0.0) is None and faults_of(run), 10,
               "the diagnosis to come back and evict")
    faults = faults_of(run)
    assert [(f.node, f.replica_id) for f in faults] == [("n2", 2)]
    assert "no pid file" in faults[0].reason and "made no progress" in faults[0].reason


def faults_of(run: Loop) -> list[NodeFaultDetected]:
    return [e for e in read_events(run.run_dir / "controller.jsonl")
            if isinstance(e, NodeFaultDetected)]


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


def paced_commits(run: Loop, own: dict[int, float], steps: int, wait: float = 0.05) -> None:
    """Commits whose own time (step_s - wait_s) is ``own[r]``; one poll per step."""
    for _ in range(steps):
        slowest = max(own.values())
        for r, mine in own.items():
            run.steps[r] = run.steps.get(r, 0) + 1
            waited = wait + slowest - mine    # the faster ones wait for the slowest
            run.worker(r, StepCommitted(replica_id=r, rank=0, step=run.steps[r], quorum_id=1,
                                        contributors=len(own), caught_up=False, lr_factor=1.0,
                                        step_s=mine + waited, wait_s=waited))
        run.poll(slowest + wait)


def test_a_fail_slow_replica_is_named_drained_and_replaced(loop):
    """Every replica's step takes as long as the slowest's; replica 2's own part of it
    is 3x the others': after recovery.slow_window steps its node goes."""
    run = loop(slow_window=10)
    run.started(0, 1, 2)
    paced_commits(run, {0: 0.1, 1: 0.1, 2: 0.3}, steps=9)
    assert not any(c[0] == "set_node_state" for c in run.slurm.calls)
    paced_commits(run, {0: 0.1, 1: 0.1, 2: 0.3}, steps=1)
    (drain,) = [c for c in run.slurm.calls if c[0] == "set_node_state"]
    assert drain[1] == "n2" and drain[3].startswith("ft: fail-slow: replica 2 took 3.0x as "
                                                    "long as its peers"), drain
    assert run.supervisor.state.run.replica(2).nodes == ("s1",)
    (found,) = [e for e in run.records() if isinstance(e, FailSlowDetected)]
    assert (found.replica_id, found.nodes, found.steps) == (2, ["n2"], 10)


def test_equal_replicas_and_the_report_policy_evict_nothing(loop):
    run = loop(slow_window=10)
    run.started(0, 1, 2)
    paced_commits(run, {0: 0.1, 1: 0.12, 2: 0.15}, steps=40)      # within the factor
    assert not any(c[0] == "set_node_state" for c in run.slurm.calls)
    reported = loop(slow_window=10, slow_policy=SlowPolicy.REPORT)
    reported.started(0, 1, 2)
    paced_commits(reported, {0: 0.1, 1: 0.1, 2: 0.5}, steps=10)
    assert not any(c[0] == "set_node_state" for c in reported.slurm.calls)
    assert reported.state(2) is ReplicaState.RUNNING
    assert [e.replica_id for e in reported.records() if isinstance(e, FailSlowDetected)] == [2]


MEMBER_TIMEOUT = 3.0                  # the default quorum.member_timeout


def test_a_replica_the_quorum_lost_is_replaced_before_the_lost_timeout(loop):
    run = loop()
    run.started(0, 1, 2)
    run.commit(0, 1, 2)
    run.poll()
    for _ in range(int(MEMBER_TIMEOUT)):   # replica 2 is gone; the quorum waits for it
        run.commit(0, 1)
        run.poll(1.0)
    run.worker(0, MembersLivenessChanged(replica_id=0, lost=[2], recovered=[]))
    run.commit(0, 1)                   # the survivors go on without it
    assert run.poll(0.2) is None       # well inside LOST
    drains = [c for c in run.slurm.calls if c[0] == "set_node_state"]
    reason = "ft: the quorum of replica 0 lost replica 2, and replica 0 trained on without it"
    assert drains == [("set_node_state", "n2", "drain", reason)]
    assert run.supervisor.state.run.replica(2).nodes == ("s1",)


def test_a_member_reported_lost_while_it_still_commits_is_kept_until_it_falls_silent(loop):
    """A new leader (or one starved of CPU) may report a live member lost: the report
    counts only once the member's own event file has been silent that long too."""
    run = loop()
    run.started(0, 1, 2)
    run.commit(0, 1, 2)
    run.poll(0.5)
    run.worker(0, MembersLivenessChanged(replica_id=0, lost=[2], recovered=[]))
    run.commit(0, 1)
    run.poll(0.5)                      # replica 2 committed 0.5 s ago: not silent
    assert not any(c[0] == "set_node_state" for c in run.slurm.calls)
    run.commit(2)                      # it goes on: the report is withdrawn
    run.poll(0.5)
    for _ in range(int(MEMBER_TIMEOUT) + 1):
        run.commit(0, 1)
        run.poll(1.0)
    assert not any(c[0] == "set_node_state" for c in run.slurm.calls)
    run.worker(0, MembersLivenessChanged(replica_id=0, lost=[2], recovered=[]))
    run.commit(0, 1)                   # reported again, silent long enough now
    run.poll(0.2)
    assert [c[1] for c in run.slurm.calls if c[0] == "set_node_state"] == ["n2"]


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
    versions.write_update_request(run.run_dir, ["python", "train_v2.py"], urgent=True,
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


# --------------------------------------------------------------------------- hang diagnosis

@pytest.mark.skipif(shutil.which("py-spy") is None, reason="py-spy not installed")
@pytest.mark.timeout(90)
def test_a_hung_replica_is_diagnosed_from_its_ranks_stacks_and_only_the_bad_node_evicted(
        tmp_path, monkeypatch, stack_workers):
    """Replicas of two nodes, one rank each. Replica 2 stops committing: its rank 1 (on
    n2b) is SIGSTOPped, its rank 0 (on n2a) waits. The controller runs the stack capture
    on each node (the fake Slurm's step commands are run here, as srun would run them
    there), names rank 1 and n2b, drains n2b only, and relaunches the replica on n2a and
    the standby. The report is in the run directory, its summary in the event log."""
    monkeypatch.chdir(tmp_path)
    nodes = {r: (f"n{r}a", f"n{r}b") for r in range(3)}
    slurm = FakeSlurm(JOB, [n for pair in nodes.values() for n in pair] + ["s1"])
    config = Config(health=HealthConfig(inspection=False),
                    recovery=RecoveryConfig(lost_timeout=LOST, start_timeout=60.0,
                                            diagnosis_timeout=30.0))
    plan = LaunchPlan(job_id=JOB, replicas=tuple(ReplicaPlacement(r, n) for r, n in
                                                 nodes.items()),
                      standby=("s1",), excluded=(), tasks_per_node=1,
                      command=("python", "train.py"))
    clock = Clock()
    events = EventLog(tmp_path / "controller.jsonl")
    supervisor = Supervisor(config, plan, slurm, tmp_path, {ENV_SECRET: "s"}, events,
                            clock=clock)
    supervisor.start()
    run = Loop(supervisor, slurm, clock, tmp_path, events)
    waiting, stopped = stack_workers("wait_collective"), stack_workers("wait_collective")
    os.kill(stopped.pid, signal.SIGSTOP)
    for rank, (proc, node) in enumerate(((waiting, "n2a"), (stopped, "n2b"))):
        write_rank_pid(WorkerIdentity(JOB, 2, 3, rank, 2, "127.0.0.1", tmp_path, "s",
                                      node=node), pid=proc.pid)
    run.started(0, 1, 2)
    for _ in range(int(LOST) + 4):                          # replica 2 never commits
        run.commit(0, 1)
        assert run.poll() is None
    assert run.slurm.step_named("replica-2").running       # nothing cancelled yet
    for node in ("n2a", "n2b"):
        step = wait_until(lambda node=node: run.slurm.live_steps(f"ftl-diagnose-2-{node}"),
                          10, f"the stack capture on {node}")[0]
        assert step.spec.overlap and step.spec.nodes == (node,)
        done = subprocess.run(step.spec.command, timeout=60, check=False)
        step.exit(done.returncode)
    wait_until(lambda: run.poll(0.0) is None and faults_of(run), 30,
               "the diagnosis to come back and evict")
    drains = [c for c in run.slurm.calls if c[0] == "set_node_state"]
    assert [c[1] for c in drains] == ["n2b"]
    assert drains[0][3].startswith("ft: hang: rank 1 on n2b, pid ") and "stopped" in drains[0][3]
    relaunch = run.slurm.step_named("replica-2")
    assert relaunch.running and relaunch.spec.nodes == ("n2a", "s1")
    (reported,) = [e for e in read_events(tmp_path / "controller.jsonl")
                   if isinstance(e, HangDiagnosisReported)]
    assert (reported.suspects, reported.outliers) == (["n2b"], [1])
    report = Path(reported.report).read_text()
    assert "stopped (SIGSTOP)" in report and "wait_collective" in report
    assert json.loads((Path(reported.report).parent / "report.json").read_text())[
        "suspects"] == ["n2b"]


def loss_commits(run: Loop, losses: dict[int, float], steps: int, history: int = 0) -> None:
    """Each replica commits ``steps`` steps with loss ``losses[r]``; one poll per step."""
    for _ in range(steps):
        for r, loss in losses.items():
            run.steps[r] = run.steps.get(r, 0) + 1
            run.worker(r, StepCommitted(replica_id=r, rank=0, step=run.steps[r], quorum_id=1,
                                        contributors=len(losses), caught_up=False,
                                        lr_factor=1.0, loss=loss, history=history))
        run.poll(0.1)


def written(run: Loop) -> list[object]:
    """The controller's records so far (each line is flushed: the log stays open)."""
    return list(read_events(run.run_dir / "controller.jsonl"))


def test_a_spike_read_with_the_steps_after_it_is_judged_on_every_replica(loop):
    """A poll that finds several steps of every replica (a busy controller): the
    spiking step is judged on the losses of all three, not on the first replica's
    file read before the others' reach it."""
    run = loop(spike_window=10)
    run.started(0, 1, 2)
    loss_commits(run, {0: 2.0, 1: 2.1, 2: 1.9}, steps=20)
    for r, loss in {0: 40.0, 1: 2.0, 2: 2.0}.items():
        for step in range(21, 26):
            run.worker(r, StepCommitted(replica_id=r, rank=0, step=step, quorum_id=1,
                                        contributors=3, caught_up=False, lr_factor=1.0,
                                        loss=loss if step == 21 else 2.0))
    run.poll(0.1)
    spiked = [e for e in written(run) if isinstance(e, LossSpiked)]
    assert [(e.step, e.replicas) for e in spiked] == [(21, 3)]
    assert spiked[0].loss == pytest.approx(44.0 / 3)


def test_a_loss_spike_rolls_every_replica_back_without_a_failure(loop):
    """Every replica's loss jumps 20x at one step: the controller records LossSpiked and
    restarts each replica in place, every launch from then on carrying the rollback; no
    node drained, no standby used. The cancelled processes' late lines (the old history)
    raise nothing more."""
    run = loop(spike_window=10)
    run.started(0, 1, 2)
    loss_commits(run, {0: 2.0, 1: 2.1, 2: 1.9}, steps=20)
    first = {r: run.slurm.step_named(f"replica-{r}") for r in range(3)}
    assert all(s.env["FTL_WORKER_ROLLBACKS"] == "" for s in first.values())
    loss_commits(run, {0: 40.0, 1: 42.0, 2: 38.0}, steps=1)
    spiked = [e for e in written(run) if isinstance(e, LossSpiked)]
    assert [(e.step, e.action, e.replicas) for e in spiked] == [(21, "rollback", 3)]
    assert spiked[0].loss == pytest.approx(40.0) and spiked[0].baseline == pytest.approx(2.0)
    relaunched = {r: run.slurm.step_named(f"replica-{r}") for r in range(3)}
    assert all(first[r].cancelled and relaunched[r] is not first[r] for r in range(3))
    assert all(s.env["FTL_WORKER_ROLLBACKS"] == "21" for s in relaunched.values())
    assert not any(c[0] == "set_node_state" for c in run.slurm.calls)
    assert [s.spec.name for s in run.slurm.live_steps()].count("standby-s1") == 1
    actions = [a for a in taken(written(run)) if a[0] in ("CancelReplica", "RelaunchReplica")]
    assert actions == [("CancelReplica", r, None) for r in range(3)] + [
        ("RelaunchReplica", r, None) for r in range(3)]
    loss_commits(run, {0: 40.0, 1: 40.0, 2: 40.0}, steps=3)       # late lines: history 0
    run.started(0, 1, 2)
    run.steps = {r: 15 for r in range(3)}                          # restored step 15
    loss_commits(run, {0: 2.0, 1: 2.0, 2: 2.0}, steps=10, history=1)
    assert [e.step for e in written(run) if isinstance(e, LossSpiked)] == [21]
    assert all(run.state(r) is ReplicaState.RUNNING for r in range(3))
    assert all(run.supervisor.state.run.replica(r).failures == 0 for r in range(3))
    # ft-launch status lists it among the events
    from ft_launch.launcher.reporting.status import describe_event
    assert describe_event(spiked[0]) == "loss spiked at step 21: 40 against 2 -> rollback"
