"""Fault run (not a test): the GPT example with 3 replicas on loopback, one replica
SIGKILLed at a step in the middle and restarted, against a fault-free run of the
same length; or (``--fault hang``) one replica SIGSTOPped inside the gradient
all-reduce and resumed later, with and without ``runtime.drop_lost_members``.

    python benchmarks/fault_run.py [--fault kill|hang] [--steps 80] [--kill-step 25]
                                   [--size small] [--json F]

A faulty run lasts as long as what it measures: it ends (the example's ``end-step``
file) ``AFTER_CATCH_UP`` steps after the faulty replica has caught up, and not before
step ``--steps``, however long the restart takes; the fault-free run then trains as
many steps (``steps`` in the summary).

Prints and writes ``{"summary": {"identical_final_state", "samples_exactly_once",
"max_healthy_stall_s", "rejoin_s", "step_time_s", "final_loss",
"baseline_final_loss", ...}}``:

* ``max_healthy_stall_s``: the longest wall-clock gap between two commits of a
  healthy replica after the kill (detection + re-quorum + one step);
* ``rejoin_s``: from the restart of the killed replica's process to its first
  committed step (process start, imports, quorum join, state fetch);
* ``step_time_s``: median gap between commits of the fault-free run.

With ``--fault hang`` the quorum and FTAR timeouts are the defaults (member
timeout 3 s, ftar.timeout 30 s) and the summary adds ``ring_timeout_only_stall_s``
(the same hang with ``drop_lost_members = false``: the survivors' all-reduce
waits for its own timeout, as a ring without a quorum's word would) and
``stall_ratio`` (that over ``max_healthy_stall_s``). ``rejoin_s`` is then from the
hung replica's resumption to its next commit.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))   # the tests' harness: how a faulty run ends

from record import write_json

from ft_launch.env import ENV_OBSERVER
from ft_launch.launcher.worker.audit import AuditError, check_exactly_once
from ft_launch.launcher.worker.events import StepCommitted
from ft_launch.launcher.worker.local import LocalJob
from tests.worker.harness import end_once_caught_up

TRAIN = REPO / "etc" / "examples" / "gpt" / "train.py"
#: The workers' step observer: it injects the kill or the hang (tests/faults)
INJECTOR = {ENV_OBSERVER: str(REPO / "tests" / "faults" / "injector.py")}
CONFIG = {
    "FTL_QUORUM_HEARTBEAT_INTERVAL": "0.1", "FTL_QUORUM_ELECTION_TIMEOUT": "0.5",
    "FTL_QUORUM_MEMBER_TIMEOUT": "1.0", "FTL_QUORUM_JOIN_TIMEOUT": "1.0",
    "FTL_FTAR_TIMEOUT": "5", "FTL_CKPT_PERSIST_EVERY": "100000",
}


#: Steps a faulty run trains once its faulty replica has caught up: it commits them
#: among the others again.
AFTER_CATCH_UP = 10
#: The example's ``--steps`` in a faulty run: its end is decided while it trains.
UNBOUNDED = 1_000_000


#: Production timeouts for the hang: what a hung peer costs is what they make it.
HANG_CONFIG = {"FTL_CKPT_PERSIST_EVERY": "100000"}


def run(run_dir: Path, args: argparse.Namespace, fault: str | None,
        config: dict[str, str] | None = None, steps: int | None = None) -> dict[str, object]:
    """One run; ``fault``: None, "kill" (restart) or "hang" (SIGSTOP, then SIGCONT).
    Fault-free, it trains ``steps`` (default ``--steps``); faulty, it ends
    ``AFTER_CATCH_UP`` steps after the faulty replica caught up, at ``--steps`` or later.
    The result's ``steps``: how many it trained."""
    steps = steps or args.steps
    command = [sys.executable, str(TRAIN), "--steps", str(UNBOUNDED if fault else steps),
               "--size", args.size, "--batch-size", str(args.batch_size), "--threads", "1"]
    job = LocalJob(run_dir, args.replicas, command, {**(config or CONFIG), **INJECTOR})
    victim = 1
    point = {"kill": "kill@after_commit", "hang": "stop@mid_allreduce"}.get(fault or "")
    job.start_all({victim: f"{point}:{args.kill_step}"} if point else {})
    restarted_at = None
    try:
        if fault == "kill":
            job.current(victim).wait(timeout=args.timeout)
            restarted_at = time.time()
            job.start(victim)
            steps = caught_up_end(job, victim, args, run_dir)
        elif fault == "hang":
            deadline = time.monotonic() + args.timeout
            while job.last_committed_step(0) < args.kill_step + 10:
                if time.monotonic() > deadline:
                    raise SystemExit(f"the survivors did not get past the hang; logs in {run_dir}")
                time.sleep(0.2)  # polling a benchmark's progress, not synchronising a test
            restarted_at = time.time()
            job.resume(victim)
            steps = caught_up_end(job, victim, args, run_dir)
        codes = job.wait_all(args.timeout)
    finally:
        job.stop_everything()
    if any(codes.values()):
        raise SystemExit(f"a replica failed: {codes}; logs in {run_dir}")
    finals = job.finals()
    try:
        audit = check_exactly_once(run_dir, args.replicas, steps)
        exactly_once = all(f["positions"] == list(audit.positions) for f in finals.values())
    except AuditError as error:
        print(f"audit failed: {error}")
        exactly_once = False
    healthy = [r for r in range(args.replicas) if not fault or r != victim]
    gaps = [b.time - a.time for r in healthy
            for a, b in itertools.pairwise(sorted(job.committed(r), key=lambda e: e.time))
            if a.step >= 1]
    # A kill after the commit of kill_step stalls the next step; a hang inside
    # kill_step's all-reduce stalls that step itself.
    first_stalled = args.kill_step if fault == "hang" else args.kill_step + 1
    after_kill = [b.time - a.time for r in healthy
                  for a, b in itertools.pairwise(sorted(job.committed(r), key=lambda e: e.time))
                  if b.step >= first_stalled]
    result: dict[str, object] = {
        "identical_final_state": len({f["state_sha256"] for f in finals.values()}) == 1,
        "samples_exactly_once": exactly_once,
        "final_loss": statistics.fmean(float(f["loss"]) for f in finals.values()),  # type: ignore[arg-type]
        "step_time_s": statistics.median(gaps),
        "max_stall_s": max(after_kill or gaps),
        "steps": steps,
    }
    if fault and restarted_at is not None:
        rejoined = [e for e in job.committed(victim) if isinstance(e, StepCommitted)
                    and e.time > restarted_at]
        result["rejoin_s"] = min(e.time for e in rejoined) - restarted_at
    return result


def caught_up_end(job: LocalJob, victim: int, args: argparse.Namespace, run_dir: Path) -> int:
    """The end step of a faulty run, set once ``victim`` has caught up."""
    try:
        return end_once_caught_up(job, victim, AFTER_CATCH_UP, args.timeout, args.steps)
    except AssertionError as error:
        raise SystemExit(f"{error}; logs in {run_dir}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fault", choices=["kill", "hang"], default="kill")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--kill-step", type=int, default=25)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--size", default="small", choices=["tiny", "small", "default"])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    hang = args.fault == "hang"
    with tempfile.TemporaryDirectory(prefix="ftl-fault-run-") as tmp:
        faulty = run(Path(tmp) / "fault", args, args.fault, HANG_CONFIG if hang else CONFIG)
        # as long as the faulty run turned out
        baseline = run(Path(tmp) / "baseline", args, None, steps=faulty["steps"])  # type: ignore[arg-type]
        ring_only = (run(Path(tmp) / "ring-only", args, "hang",
                         {**HANG_CONFIG, "FTL_RUNTIME_DROP_LOST_MEMBERS": "false"})
                     if hang else None)
    summary = {
        "identical_final_state": faulty["identical_final_state"],
        "samples_exactly_once": faulty["samples_exactly_once"],
        "max_healthy_stall_s": round(float(faulty["max_stall_s"]), 3),  # type: ignore[arg-type]
        "rejoin_s": round(float(faulty["rejoin_s"]), 3),  # type: ignore[arg-type]
        "step_time_s": round(float(baseline["step_time_s"]), 4),  # type: ignore[arg-type]
        "final_loss": round(float(faulty["final_loss"]), 4),  # type: ignore[arg-type]
        "baseline_final_loss": round(float(baseline["final_loss"]), 4),  # type: ignore[arg-type]
        "baseline_identical_final_state": baseline["identical_final_state"],
        "steps": faulty["steps"], "kill_step": args.kill_step, "replicas": args.replicas,
        "size": args.size, "fault": args.fault,
    }
    if ring_only is not None:
        stall = float(ring_only["max_stall_s"])  # type: ignore[arg-type]
        summary["ring_timeout_only_stall_s"] = round(stall, 3)
        summary["stall_ratio"] = round(stall / float(summary["max_healthy_stall_s"]), 1)  # type: ignore[arg-type]
        summary["ring_timeout_only_identical_final_state"] = ring_only["identical_final_state"]
    width = max(map(len, summary))
    for key, value in summary.items():
        print(f"{key:<{width}}  {value}")
    if args.json:
        write_json(args.json, {"summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
