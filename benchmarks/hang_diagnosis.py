"""Hang diagnosis in a real ``ft-launch run`` on the lab cluster (root; the cluster up):
``detection_bench.py``'s ``hang_diagnose_s``, or alone.

``etc/examples/train.sbatch`` on four pinned nodes (3 replicas of 2 FSDP2 ranks, the
batch host the standby); rank 1 of replica 1 deadlocks before step ``--hang-step``'s
commit (``hang@before_commit:N/1@NODE``). Measured, from the moment that rank enters
the deadlock (its ``injecting fault`` log line):

* ``hang_diagnose_s``: -> the controller's ``HangDiagnosisReported`` (the stall seen,
  then both ranks' stacks taken with py-spy and aggregated);
* ``hang_drained_s``: -> its node drained (``NodeDrained``);
* ``capture_s``: the stack capture alone (srun --overlap + py-spy on each node);
* ``named_right``: the report names that rank and node, and only them.

    python benchmarks/hang_diagnosis.py [--hang-step 60] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ftcore.events import NodeDrained
from launcher.diagnosis import HangDiagnosisReported
from launcher.reporting.runlog import controller_log
from tests.cluster import labcluster

DETECTION = ["FTL_RECOVERY_LOST_TIMEOUT=4", "FTL_RECOVERY_START_TIMEOUT=60",
             "FTL_QUORUM_JOIN_TIMEOUT=1", "FTL_CKPT_PERSIST_EVERY=100000"]
FAULT_LINE = "injecting fault: hang"


def injected_at(log: Path) -> float | None:
    """When the rank logged that it enters the deadlock (its node's clock: the lab
    cluster's nodes share this machine's)."""
    for line in log.read_text(errors="replace").splitlines():
        if FAULT_LINE in line:
            stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            return stamp.timestamp()
    return None


def wait_for(condition: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.2)     # polling the run directory, with a deadline
    return value


def measure(hang_step: int = 60, steps: int = 200, timeout: float = 600) -> dict[str, Any]:
    nodes = labcluster.require_state().nodes[:4]
    hung = nodes[2]         # replica 1: the batch host (standby) is listed first
    out = Path(tempfile.mkdtemp(prefix="ftl-hang-bench-"))
    runs = out / "runs"
    exports = ",".join(["ALL", f"PYTHON={sys.executable}", f"STEPS={steps}", "SIZE=small",
                        "TASKS_PER_NODE=2", f"FTL_RUN_LOG_DIR={runs}", *DETECTION,
                        f"FTL_WORKER_INJECT=hang@before_commit:{hang_step}/1@{hung}"])
    job = labcluster.ctl_run(["sbatch", "--parsable", f"--chdir={REPO}",
                              f"--nodelist={','.join(nodes)}", f"--output={out}/job.out",
                              f"--export={exports}",
                              str(REPO / "etc" / "examples" / "train.sbatch")]
                             ).stdout.strip().split(";")[0]
    run_dir = runs / job
    try:
        report = wait_for(lambda: [e for e in controller_log(run_dir)
                                   if isinstance(e, HangDiagnosisReported)], timeout,
                          "the hang diagnosis")[0]
        drained = wait_for(lambda: [e for e in controller_log(run_dir)
                                    if isinstance(e, NodeDrained)], 60, "the drain")[0]
    finally:
        labcluster.ctl_run(["scancel", job], check=False)
        labcluster.heal_node(hung)
    started = injected_at(run_dir / "logs" / "replica-1.1.log")
    details = json.loads((Path(report.report).parent / "report.json").read_text())
    return {
        "hang_diagnose_s": round(report.time - started, 3) if started else None,
        "hang_drained_s": round(drained.time - started, 3) if started else None,
        "capture_s": details["duration_s"],
        "named_right": report.suspects == [hung] and report.outliers == [1]
        and drained.node == hung,
        "summary": report.summary, "report": report.report}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hang-step", type=int, default=60)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    labcluster.up()
    result = measure(args.hang_step)
    sys.stdout.write(json.dumps(result, indent=1) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if result["named_right"] else 1


if __name__ == "__main__":
    sys.exit(main())
