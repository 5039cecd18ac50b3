"""The demo: fault-tolerant training on the local Slurm cluster, with a node killed.

Submits ``etc/examples/train.sbatch`` (3 replicas of 2 ranks sharding the model
with FSDP2 + 1 warm standby), waits until training is under way, kills replica
1's node (its slurmd and every process on it, like a crash), shows the recovery
in one live status view (``ft-launch status --watch``'s: eviction, promotion,
catch-up), then the summary. Run by ``etc/demo.sh`` after the cluster is up;
root only. ``--images DIR`` also saves the live view as it was when replica 1
came back (``live-status.svg``) and the run's ``timeline.png`` there (the
README's pictures, ``etc/img/``).

Other faults of replica 1's node, each found, named, drained and replaced:

* ``--fault hang`` deadlocks its rank 1 at that step (an injected fault: the process
  lives, its peer waits in the commit vote): the controller takes both ranks' stacks
  with py-spy before it cancels anything and names the rank and its node;
* ``--fault sdc``: its GPU "corrupts" gradients from that step on (a NaN injected into
  one rank's contribution): every replica discards those steps, and after
  ``recovery.nonfinite_limit`` of them the node that computed the NaN goes;
* ``--fault slow``: its training processes are throttled (SIGSTOP/SIGCONT bursts): the
  replicas all slow down with it, but its own part of each step grows while the
  others wait for it, and after ``recovery.slow_window`` steps it goes.

And one of the training, on every node: ``--fault spike`` scales every rank's loss and
gradients up at that step; the controller finds the spike in the replicas' mean loss
and rolls every replica back to its newest peer backup from before it (no node
drained), and they train the steps after it again.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rich.console import Console

from ft_launch.launcher.controller.events import LossSpiked, NodeFaultDetected
from ft_launch.launcher.reporting.live import StatusDisplay, status_view
from ft_launch.launcher.reporting.runlog import controller_log
from ft_launch.launcher.reporting.status import RunStatus
from ft_launch.launcher.reporting.timeline import BandState
from tests.cluster import labcluster
from tests.faults import lab_env

STEPS = 1500
KILL_AT_STEP = 200
RANKS = 2          # per replica: FSDP2 shards the model over them
REFRESH_INTERVAL = 0.5
#: Training that commits no step for this long is stuck (a recovery takes well under a
#: minute); the demo then ends rather than wait for the job.
STALL_S = 300.0


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


def rolled_back(status: RunStatus) -> bool:
    """Every replica relaunched by the rollback commits steps again."""
    return len(status.replicas) == 3 and all(r.how == "relaunch"
                                             and r.state is BandState.TRAINING
                                             for r in status.replicas)


def step_of(status: RunStatus, replica_id: int) -> int:
    return next((r.step for r in status.replicas if r.replica_id == replica_id), None) or -1


def finished(job_id: str, stall_s: float) -> Callable[[RunStatus], bool]:
    """The job has ended; while it has not, training must go on: no new step for
    ``stall_s`` ends the demo. A fixed time limit would not do: the steps left after
    the recovery take minutes, and several times longer on a CPU that emulates bf16."""
    newest, since = -1, time.monotonic()

    def ended(status: RunStatus) -> bool:
        nonlocal newest, since
        step = max((r.step for r in status.replicas if r.step is not None), default=-1)
        if step > newest:
            newest, since = step, time.monotonic()
        elif time.monotonic() - since > stall_s:
            raise SystemExit(f"demo: no replica committed a step for {stall_s:.0f} s "
                             f"(the newest is {newest}) and the job has not ended")
        return job_state(job_id) == ""
    return ended


def job_state(job_id: str) -> str:
    out = labcluster.ctl_run(["squeue", "-h", "-j", job_id, "-o", "%T"], check=False)
    return out.stdout.strip()


def save_live_view(status: RunStatus, path: Path) -> None:
    recorder = Console(record=True, width=110, force_terminal=True, file=io.StringIO())
    recorder.print(status_view(status, STEPS))
    recorder.save_svg(str(path), title="ft-launch status --watch")


#: faults injected through the job's environment, for the node of replica 1
INJECTED = {"hang": f"hang@before_commit:{KILL_AT_STEP}/1",
            "sdc": f"nan@gradients:{KILL_AT_STEP}+/1"}


def pinned_placement() -> tuple[list[str], str]:
    """For a fault set before the job starts: the job's nodes, pinned so that it lands
    on replica 1's node: the batch host (the standby) comes first, then replicas 0, 1, 2."""
    nodes = labcluster.require_state().nodes[:4]
    return [f"--nodelist={','.join(nodes)}"], nodes[2]


def found_fault(run_dir: Path) -> NodeFaultDetected | None:
    return next((e for e in controller_log(run_dir) if isinstance(e, NodeFaultDetected)),
                None)


def found_spike(run_dir: Path) -> LossSpiked | None:
    return next((e for e in controller_log(run_dir) if isinstance(e, LossSpiked)), None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=Path, metavar="DIR",
                        help="save live-status.svg and timeline.png here")
    parser.add_argument("--fault", choices=("kill", "hang", "sdc", "slow", "spike"),
                        default="kill",
                        help="kill replica 1's node (default), deadlock one of its ranks, "
                             "corrupt its gradients or throttle it; or spike the loss "
                             "everywhere (rolled back)")
    args = parser.parse_args(argv)
    console = Console()
    out = Path(tempfile.mkdtemp(prefix="ftl-demo-"))
    runs = out / "runs"
    exports = ",".join(["ALL", f"PYTHON={sys.executable}", f"STEPS={STEPS}", "SIZE=small",
                        f"TASKS_PER_NODE={RANKS}",
                        f"FTL_RUN_LOG_DIR={runs}", "FTL_RECOVERY_LOST_TIMEOUT=5",
                        "FTL_QUORUM_MEMBER_TIMEOUT=2", "FTL_QUORUM_JOIN_TIMEOUT=1"])
    pinned, victim = pinned_placement() if args.fault in INJECTED else ([], "")
    if args.fault in INJECTED:
        exports += f",FTL_WORKER_INJECT={INJECTED[args.fault]}@{victim}"
    if args.fault == "spike":        # every rank of every replica, on every node
        exports += f",FTL_WORKER_INJECT=spike@loss:{KILL_AT_STEP}"
    if "FTL_WORKER_INJECT" in exports:   # the workers' step observer injects it
        exports += "".join(f",{name}={value}" for name, value in lab_env().items())
    submitted = labcluster.ctl_run(["sbatch", "--parsable", f"--chdir={REPO}", *pinned,
                                    f"--output={out}/job.out", f"--export={exports}",
                                    str(REPO / "etc" / "examples" / "train.sbatch")])
    job_id = submitted.stdout.strip().split(";")[0]
    run_dir = runs / job_id
    console.print(f"== submitted job {job_id}: 3 replicas of {RANKS} FSDP2 ranks + 1 warm "
                  f"standby; run directory {run_dir}", highlight=False)
    with StatusDisplay(run_dir, console, total_steps=STEPS) as display:
        if args.fault == "hang":
            display.note(f"== at step {KILL_AT_STEP}, rank 1 of replica 1 (on {victim}) "
                         "deadlocks before its commit: alive, silent, its peer waiting")
            status = wait(lambda s: bool(s.diagnoses), 300, "the hang diagnosis", display)
            killed_at = status.diagnoses[-1].time
            display.note(f"== hang diagnosis: {status.diagnoses[-1].summary}; report "
                         f"{status.diagnoses[-1].report}")
        elif args.fault in ("sdc", "slow"):
            status = wait(training_past(KILL_AT_STEP), 300,
                          f"training to pass step {KILL_AT_STEP}", display)
            victim = victim or next(r.nodes[0] for r in status.replicas if r.replica_id == 1)
            display.note(f"== from step {KILL_AT_STEP}, node {victim} (replica 1) "
                         + ("computes NaN gradients on rank 1" if args.fault == "sdc" else
                            "is throttled: its training processes run 1/6 of the time"))
            with labcluster.throttle_node(victim) if args.fault == "slow" else nullcontext():
                wait(lambda s: found_fault(run_dir) is not None, 300,
                     f"the controller to find {victim}", display)
            fault = found_fault(run_dir)
            assert fault is not None
            killed_at = fault.time
            display.note(f"== found: {fault.reason}")
        elif args.fault == "spike":
            display.note(f"== at step {KILL_AT_STEP}, every rank's loss and gradients are "
                         "scaled up (a loss spike, in every replica's weights)")
            wait(lambda s: found_spike(run_dir) is not None, 300, "the loss spike", display)
            spike = found_spike(run_dir)
            assert spike is not None
            killed_at = spike.time
            display.note(f"== {spike.reason}")
        else:
            status = wait(training_past(KILL_AT_STEP), 300,
                          f"training to pass step {KILL_AT_STEP}", display)
            victim = next(r.nodes[0] for r in status.replicas if r.replica_id == 1)
            display.note(f"== killing node {victim} (replica 1): its slurmd and every "
                         "process on it")
            labcluster.kill_node(victim)
            killed_at = time.time()
        if args.fault == "spike":
            status = wait(rolled_back, 300, "every replica to train again", display)
            display.note(f"== every replica trains again {time.time() - killed_at:.1f} s "
                         "after the spike was found, from before it")
        else:
            status = wait(rejoined(1), 120, "replica 1 to rejoin", display)
            found = {"hang": "diagnosis", "kill": "crash"}.get(args.fault, "fault was found")
            display.note(f"== replica 1 is back {time.time() - killed_at:.1f} s after the "
                         f"{found}; training goes on to the end")
        if args.images:     # once it trains at speed again
            back = step_of(status, 1)
            status = wait(lambda s: step_of(s, 1) >= back + 10, 60, "replica 1 to go on",
                          display)
            args.images.mkdir(parents=True, exist_ok=True)
            save_live_view(status, args.images / "live-status.svg")
        wait(finished(job_id, STALL_S), math.inf, "the job to finish", display)
    report = (out / "job.out").read_text().split("summary (")[-1]
    console.out("summary (" + report, highlight=False)
    finals = [json.loads(p.read_text()) for p in (run_dir / "final").glob("*.json")]
    # Rank k of every replica holds the same shards of the FSDP2-sharded model.
    same = len(finals) == 3 * RANKS and all(
        len({f["state_sha256"] for f in finals if f["rank"] == rank}) == 1
        for rank in range(RANKS))
    if victim:
        drained = labcluster.ctl_run(["sinfo", "-h", "-n", victim, "-o",
                                      "%t %E"]).stdout.strip()
        console.print(f"== replicas bit-identical at the end: {same}; node {victim} "
                      f"drained: {drained}", highlight=False)
    else:
        summary = json.loads((run_dir / "summary.json").read_text())
        console.print(f"== replicas bit-identical at the end: {same}; nodes drained: "
                      f"{summary['nodes_drained'] or 'none'}", highlight=False)
    if args.images and (run_dir / "timeline.png").exists():
        shutil.copyfile(run_dir / "timeline.png", args.images / "timeline.png")
    if victim:
        labcluster.heal_node(victim)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
