"""The demo: fault-tolerant training on the local Slurm cluster, with a node killed.

Submits ``etc/examples/train.sbatch`` (3 replicas of 2 ranks sharding the model
with FSDP2 + 1 warm standby), waits until training is under way, kills replica
1's node (its slurmd and every process on it, like a crash), shows the recovery
in one live status view (``ft-launch status --watch``'s: eviction, promotion,
catch-up), then the summary. Run by ``etc/demo.sh`` after the cluster is up;
root only. ``--images DIR`` also saves the live view as it was when replica 1
came back (``live-status.svg``) and the run's ``timeline.png`` there (the
README's pictures, ``etc/img/``).
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rich.console import Console

from launcher.reporting.live import StatusDisplay, status_view
from launcher.reporting.status import RunStatus
from launcher.reporting.timeline import BandState
from tests.cluster import labcluster

STEPS = 1500
KILL_AT_STEP = 200
RANKS = 2          # per replica: FSDP2 shards the model over them
REFRESH_INTERVAL = 0.5


def wait(condition: Callable[[RunStatus], bool], timeout: float, what: str,
         display: StatusDisplay) -> RunStatus:
    """Refresh the view until ``condition`` holds of the run's status."""
    deadline = time.monotonic() + timeout
    status = display.refresh()
    while not condition(status):
        if time.monotonic() > deadline:
            raise SystemExit(f"demo: timed out waiting for {what}")
        time.sleep(REFRESH_INTERVAL)        # the view's refresh period
        status = display.refresh()
    return status


def training_past(step: int) -> Callable[[RunStatus], bool]:
    return lambda s: len(s.replicas) == 3 and all(
        r.step is not None and r.step >= step for r in s.replicas)


def rejoined(replica_id: int) -> Callable[[RunStatus], bool]:
    """The promoted replica committed a step (it caught up from a survivor)."""
    return lambda s: any(r.replica_id == replica_id and r.how == "promoted"
                         and r.state is BandState.TRAINING for r in s.replicas)


def step_of(status: RunStatus, replica_id: int) -> int:
    return next((r.step for r in status.replicas if r.replica_id == replica_id), None) or -1


def job_state(job_id: str) -> str:
    out = labcluster.ctl_run(["squeue", "-h", "-j", job_id, "-o", "%T"], check=False)
    return out.stdout.strip()


def save_live_view(status: RunStatus, path: Path) -> None:
    recorder = Console(record=True, width=110, force_terminal=True, file=io.StringIO())
    recorder.print(status_view(status, STEPS))
    recorder.save_svg(str(path), title="ft-launch status --watch")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=Path, metavar="DIR",
                        help="save live-status.svg and timeline.png here")
    args = parser.parse_args(argv)
    console = Console()
    out = Path(tempfile.mkdtemp(prefix="ftl-demo-"))
    runs = out / "runs"
    exports = ",".join(["ALL", f"PYTHON={sys.executable}", f"STEPS={STEPS}", "SIZE=small",
                        f"TASKS_PER_NODE={RANKS}",
                        f"FTL_RUN_LOG_DIR={runs}", "FTL_RECOVERY_LOST_TIMEOUT=5",
                        "FTL_QUORUM_MEMBER_TIMEOUT=2", "FTL_QUORUM_JOIN_TIMEOUT=1"])
    submitted = labcluster.ctl_run(["sbatch", "--parsable", f"--chdir={REPO}",
                                    f"--output={out}/job.out", f"--export={exports}",
                                    str(REPO / "etc" / "examples" / "train.sbatch")])
    job_id = submitted.stdout.strip().split(";")[0]
    run_dir = runs / job_id
    console.print(f"== submitted job {job_id}: 3 replicas of {RANKS} FSDP2 ranks + 1 warm "
                  f"standby; run directory {run_dir}", highlight=False)
    with StatusDisplay(run_dir, console, total_steps=STEPS) as display:
        status = wait(training_past(KILL_AT_STEP), 300, f"training to pass step {KILL_AT_STEP}",
                      display)
        victim = next(r.nodes[0] for r in status.replicas if r.replica_id == 1)
        display.note(f"== killing node {victim} (replica 1): its slurmd and every process on it")
        labcluster.kill_node(victim)
        killed_at = time.time()
        status = wait(rejoined(1), 120, "replica 1 to rejoin", display)
        display.note(f"== replica 1 is back {time.time() - killed_at:.1f} s after the crash; "
                     "training goes on to the end")
        if args.images:     # once it trains at speed again
            back = step_of(status, 1)
            status = wait(lambda s: step_of(s, 1) >= back + 10, 60, "replica 1 to go on",
                          display)
            args.images.mkdir(parents=True, exist_ok=True)
            save_live_view(status, args.images / "live-status.svg")
        wait(lambda s: job_state(job_id) == "", 600, "the job to finish", display)
    report = (out / "job.out").read_text().split("summary (")[-1]
    console.out("summary (" + report, highlight=False)
    finals = [json.loads(p.read_text()) for p in (run_dir / "final").glob("*.json")]
    # Rank k of every replica holds the same shards of the FSDP2-sharded model.
    same = len(finals) == 3 * RANKS and all(
        len({f["state_sha256"] for f in finals if f["rank"] == rank}) == 1
        for rank in range(RANKS))
    drained = labcluster.ctl_run(["sinfo", "-h", "-n", victim, "-o", "%t %E"]).stdout.strip()
    console.print(f"== replicas bit-identical at the end: {same}; node {victim} drained: "
                  f"{drained}", highlight=False)
    if args.images and (run_dir / "timeline.png").exists():
        shutil.copyfile(run_dir / "timeline.png", args.images / "timeline.png")
    labcluster.heal_node(victim)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
