"""The pure part of benchmarks/product_run.py (detection_bench.py's product figures):
a run directory's files read into fault -> detection -> drain -> replica back.

The files are written by the product's own writers: the controller's and the ranks'
events by ``EventLog`` with the real event classes, the rank's fault line by the real
``FaultInjector`` through ``ft_launch.logs.FORMAT``. Nothing here starts a process."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from ft_launch.events import EventLog, NodeDrained
from ft_launch.launcher.controller.diagnosis import HangDiagnosisReported
from ft_launch.launcher.controller.events import (
    FailSlowDetected,
    NodeFaultDetected,
    StandbyPromoted,
)
from ft_launch.launcher.worker.events import StepCommitted, WorkerStarted
from ft_launch.logs import FORMAT
from tests.faults.injector import FaultInjector, FaultPoint, parse_faults
from tests.scale.helpers import load_benchmark

product_run = load_benchmark("product_run")

NODE, OTHER, REPLICA = "n3", "n4", 1


def log_injected(run_dir: Path, spec: str, steps: range, rank: int = 1) -> float:
    """The real injector fires ``spec`` at ``steps`` into rank ``rank``'s log;
    returns when it logged the first line (the record's own clock)."""
    path = run_dir / "logs" / f"replica-{REPLICA}.{rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    created: list[float] = []
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(lambda record: created.append(record.created) or True)
    logger = logging.getLogger("tests.faults.injector")
    logger.addHandler(handler)
    try:
        injector = FaultInjector(parse_faults(spec))
        for step in steps:
            assert injector.check(FaultPoint.GRADIENTS, step)
    finally:
        logger.removeHandler(handler)
        handler.close()
    return created[0]


def write_events(path: Path, *events) -> None:
    with EventLog(path) as log:
        for event in events:
            log.emit(event)


def commit(step: int, at: float) -> StepCommitted:
    return StepCommitted(replica_id=REPLICA, rank=0, step=step, quorum_id=1, contributors=3,
                         caught_up=False, lr_factor=1.0, time=at)


def sdc_reason(steps: int) -> str:
    return f"sdc: gradients computed on {NODE} held NaN/Inf in {steps} steps (replica 1)"


@pytest.fixture
def sdc_run(tmp_path: Path) -> tuple[Path, float]:
    """A run in which n3 computes NaN gradients from step 60 on and is found, drained
    and replaced; decoys before the fault and of other nodes around it."""
    fault = log_injected(tmp_path, f"nan@gradients:60+/1@{NODE}", range(60, 64))
    write_events(tmp_path / "controller.jsonl",
                 NodeDrained(node=NODE, reason="ft: " + sdc_reason(3), time=fault - 30),
                 NodeFaultDetected(node=OTHER, replica_id=2, reason="sdc: on n4", time=fault + 1),
                 NodeDrained(node=OTHER, reason="ft: sdc: on n4", time=fault + 1.1),
                 NodeFaultDetected(node=NODE, replica_id=REPLICA, reason=sdc_reason(3),
                                   time=fault + 2.0),
                 StandbyPromoted(replica_id=2, node="n5", time=fault + 1.2),
                 NodeDrained(node=NODE, reason="ft: " + sdc_reason(3), time=fault + 2.25),
                 StandbyPromoted(replica_id=REPLICA, node="n1", time=fault + 2.5))
    write_events(tmp_path / "events" / f"replica-{REPLICA}-rank-0.jsonl",
                 WorkerStarted(replica_id=REPLICA, rank=0, next_step=0, time=fault - 60),
                 commit(59, fault - 0.2),
                 # retried in place, before its node was found
                 WorkerStarted(replica_id=REPLICA, rank=0, next_step=60, time=fault + 1.4),
                 commit(60, fault + 1.6),
                 # the old incarnation, after the promotion
                 commit(61, fault + 2.6), commit(62, fault + 2.8),
                 WorkerStarted(replica_id=REPLICA, rank=0, next_step=60, time=fault + 3.0),
                 commit(66, fault + 4.75))
    return tmp_path, fault


def test_the_fault_time_is_the_ranks_first_logged_line_to_the_millisecond(sdc_run):
    run_dir, fault = sdc_run
    logged = product_run.logged_fault_time(run_dir / "logs", REPLICA, "nan")
    assert logged is not None and fault - 0.001 < logged <= fault
    assert product_run.logged_fault_time(run_dir / "logs", REPLICA, "hang") is None
    assert product_run.logged_fault_time(run_dir / "logs", 0, "nan") is None


def test_sdc_is_timed_to_its_nodes_drain_with_the_sdc_reason_and_the_new_incarnation(sdc_run):
    run_dir, fault = sdc_run
    timings = product_run.fault_timings(run_dir, "sdc", NODE, REPLICA)
    assert timings.complete and timings.fault_source == "rank log"
    figures = timings.figures()
    offset = fault - timings.fault_at            # the log line's millisecond truncation
    assert figures["fault_to_event_s"] == pytest.approx(2.0 + offset, abs=1e-3)
    assert figures["fault_to_drained_s"] == pytest.approx(2.25 + offset, abs=1e-3)
    assert figures["fault_to_back_s"] == pytest.approx(4.75 + offset, abs=1e-3)
    assert figures["event"] == "NodeFaultDetected" and "sdc:" in figures["drain_reason"]


def test_a_drain_for_another_reason_is_not_the_sdc_found(tmp_path):
    fault = log_injected(tmp_path, f"nan@gradients:60+/1@{NODE}", range(60, 61))
    write_events(tmp_path / "controller.jsonl",
                 NodeFaultDetected(node=NODE, replica_id=REPLICA,
                                   reason="replica 1 made no progress for 4 s", time=fault + 5),
                 NodeDrained(node=NODE, reason="ft: replica 1 made no progress for 4 s",
                             time=fault + 5.1))
    timings = product_run.fault_timings(tmp_path, "sdc", NODE, REPLICA)
    assert timings.event is None and timings.drained is None and not timings.complete
    assert timings.figures()["fault_to_drained_s"] is None
    # the kill's answer is any drain of its node: this one
    kill = product_run.fault_timings(tmp_path, "kill", NODE, REPLICA, injected_at=fault)
    assert kill.figures()["fault_to_drained_s"] == pytest.approx(5.1, abs=1e-6)
    assert kill.fault_source == "injector" and kill.back_at is None


def test_fail_slow_is_timed_from_the_injector_to_its_replicas_report(tmp_path):
    start = 1_700_000_000.0
    reason = "fail-slow: replica 1 took 2.1x as long as its peers"
    write_events(tmp_path / "controller.jsonl",
                 FailSlowDetected(replica_id=2, nodes=[OTHER], own_s=1, peers_s=0.4, steps=30,
                                  reason="fail-slow: replica 2", time=start + 3),
                 FailSlowDetected(replica_id=REPLICA, nodes=[NODE], own_s=0.24, peers_s=0.11,
                                  steps=30, reason=reason, time=start + 12.5),
                 NodeDrained(node=NODE, reason="ft: " + reason, time=start + 12.5))
    figures = product_run.fault_timings(tmp_path, "slow", NODE, REPLICA, start).figures()
    assert figures["fault_to_event_s"] == 12.5 and figures["fault_to_drained_s"] == 12.5
    assert figures["event"] == "FailSlowDetected" and figures["fault_to_back_s"] is None
    # without the injector's time there is nothing to time from
    assert product_run.fault_timings(tmp_path, "slow", NODE, REPLICA).figures()[
        "fault_to_event_s"] is None


def test_a_hang_is_timed_to_the_diagnosis_of_its_replica(tmp_path):
    path = tmp_path / "logs" / f"replica-{REPLICA}.1.log"
    path.parent.mkdir(parents=True)
    # the deadlock itself cannot run here: its line as the injector writes it
    record = logging.LogRecord("tests.faults.injector", logging.WARNING, __file__, 0,
                               "injecting fault: %s at %s of step %d",
                               ("hang", "before_commit", 60), None)
    path.write_text(logging.Formatter(FORMAT).format(record) + "\n")
    fault = record.created
    write_events(tmp_path / "controller.jsonl",
                 HangDiagnosisReported(replica_id=0, suspects=["n2"], outliers=[0],
                                       summary="other", report="r0", time=fault + 1),
                 HangDiagnosisReported(replica_id=REPLICA, suspects=[NODE], outliers=[1],
                                       summary="rank 1 in injected_deadlock", report="r1",
                                       time=fault + 9.5))
    timings = product_run.fault_timings(tmp_path, "hang", NODE, REPLICA)
    assert timings.event is not None and timings.event.report == "r1"
    assert timings.figures()["fault_to_event_s"] == pytest.approx(
        9.5 + fault - timings.fault_at, abs=1e-3)
