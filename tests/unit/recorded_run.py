"""A run directory as ft-launch writes it, with a scripted history, for the reporting
tests: 3 replicas from T0; replica 1's node fails at FAULT, a warm standby (s1)
takes over at PROMOTED and commits again from BACK; replica 2 crashes at CRASH, is
retried in place on a new code version at RETRY and commits again from BACK_2;
every replica commits once a second; the run ends at END. s2 stays warm."""

from __future__ import annotations

from pathlib import Path

from ft_launch.events import EventLog, RunStarted
from ft_launch.launcher.controller.events import (
    NodeFaultDetected,
    ReplicaExited,
    ReplicaLaunched,
    RunFinished,
    StandbyPromoted,
)
from ft_launch.launcher.controller.versions import CodeVersionApplied
from ft_launch.launcher.worker.events import StepCommitted, WorkerStarted

T0 = 1_000.0
FAULT, PROMOTED, BACK = 40.5, 41.0, 80.0        # replica 1: node lost, standby, first commit
CRASH, RETRY, BACK_2 = 50.0, 51.0, 55.0          # replica 2: crash, retry on a new version
LAST_1, LAST_2 = 40.0, 49.0                      # their last commits before
END = 100.5
TRAIN = "/opt/venv/bin/python3"


def commit(replica_id: int, at: float, step: int) -> StepCommitted:
    return StepCommitted(replica_id=replica_id, rank=0, step=step, quorum_id=1,
                         contributors=3, caught_up=False, lr_factor=1.0, time=T0 + at)


def commit_times(replica_id: int, until: float = 100.0) -> list[float]:
    every = [float(t) for t in range(2, int(until) + 1)]
    if replica_id == 1:
        return [t for t in every if t < FAULT or t >= BACK]
    if replica_id == 2:
        return [t for t in every if t < CRASH or t >= BACK_2]
    return every


def write_controller_log(run_dir: Path, *, finished: bool = True) -> None:
    with EventLog(run_dir / "controller.jsonl") as log:
        log.emit(RunStarted(job_id="42", replicas=3, nodes=["n0", "n1", "n2", "s1", "s2"],
                            time=T0))
        for r in range(3):
            log.emit(ReplicaLaunched(replica_id=r, nodes=[f"n{r}"], how="initial",
                                     time=T0 + 0.5))
            log.emit(CodeVersionApplied(replica_id=r, version=1,
                                        command=[TRAIN, "/home/me/gpt/train.py"],
                                        digest="a" * 64, time=T0 + 0.5))
        log.emit(NodeFaultDetected(node="n1", replica_id=1, reason="xid 79", time=T0 + FAULT))
        log.emit(StandbyPromoted(replica_id=1, node="s1", time=T0 + PROMOTED))
        log.emit(ReplicaLaunched(replica_id=1, nodes=["s1"], how="promoted",
                                 time=T0 + PROMOTED))
        log.emit(ReplicaExited(replica_id=2, exit_code=1, time=T0 + CRASH))
        log.emit(ReplicaLaunched(replica_id=2, nodes=["n2"], how="retry", time=T0 + RETRY))
        log.emit(CodeVersionApplied(replica_id=2, version=2,
                                    command=[TRAIN, "/home/me/gpt/train2.py", "--lr", "3e-4"],
                                    digest="b" * 64, time=T0 + RETRY))
        if finished:
            log.emit(ReplicaExited(replica_id=0, exit_code=0, time=T0 + 100.2))
            log.emit(RunFinished(exit_code=0, reason="training finished", time=T0 + END))


def write_commits(run_dir: Path, until: float = 100.0) -> None:
    for r in range(3):
        with EventLog(run_dir / "events" / f"replica-{r}-rank-0.jsonl") as log:
            log.emit(WorkerStarted(replica_id=r, rank=0, next_step=0, time=T0 + 1))
            for step, at in enumerate(commit_times(r, until)):
                log.emit(commit(r, at, step if r != 1 or at < FAULT else int(at)))


def write_standby(run_dir: Path) -> None:
    standby = run_dir / "standby"
    standby.mkdir()
    for name in ("s1.ready", "s1.activate", "s2.ready"):
        (standby / name).write_text("{}")


def write_run(run_dir: Path) -> Path:
    write_controller_log(run_dir)
    write_commits(run_dir)
    write_standby(run_dir)
    return run_dir
