"""Hang diagnosis in a real ``ft-launch run`` on the lab cluster (root; the cluster up):
``detection_bench.py``'s ``hang_diagnose_s``, or alone.

``benchmarks/product_run.py``'s ``hang`` run: rank 1 of replica 1 deadlocks before
step ``--hang-step``'s commit. Measured, from the moment that rank enters the
deadlock (its ``injecting fault`` log line):

* ``hang_diagnose_s``: -> the controller's ``HangDiagnosisReported`` (the stall seen,
  then both ranks' stacks taken with py-spy and aggregated);
* ``hang_drained_s``: -> its node drained with the diagnosis as the reason;
* ``hang_replica_back_s``: -> the replica's first commit on the promoted standby;
* ``capture_s``: the stack capture alone (srun --overlap + py-spy on each node);
* ``named_right``: the report names that rank and node, and only them.

    python benchmarks/hang_diagnosis.py [--hang-step 60] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.product_run import ProductRun, run_with_fault, why_unavailable
from ft_launch.launcher.controller.diagnosis import HangDiagnosisReported


def hang_figures(run: ProductRun) -> dict[str, Any]:
    """The hang run's figures, and whether its report named the hung rank's node."""
    timings, figures = run.timings, run.figures()
    report = timings.event
    details: dict[str, Any] = {}
    if isinstance(report, HangDiagnosisReported):
        report_file = Path(report.report).parent / "report.json"
        if report_file.exists():
            details = json.loads(report_file.read_text())
    return {
        "hang_diagnose_s": figures["fault_to_event_s"],
        "hang_drained_s": figures["fault_to_drained_s"],
        "hang_replica_back_s": figures["fault_to_back_s"],
        "capture_s": details.get("duration_s"),
        "named_right": isinstance(report, HangDiagnosisReported)
        and report.suspects == [timings.node] and report.outliers == [1]
        and timings.drained is not None,
        "summary": getattr(report, "summary", None), "report": getattr(report, "report", None),
        "error": run.error, "run_dir": str(run.run_dir)}


def measure(hang_step: int = 60) -> dict[str, Any]:
    return hang_figures(run_with_fault("hang", step=hang_step))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hang-step", type=int, default=60,
                        help="the step before whose commit the rank deadlocks")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    reason = why_unavailable()
    if reason:
        sys.stderr.write(f"hang_diagnosis: {reason}\n")
        return 2
    result = measure(args.hang_step)
    sys.stdout.write(json.dumps(result, indent=1) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if result["named_right"] else 1


if __name__ == "__main__":
    sys.exit(main())
