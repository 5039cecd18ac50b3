"""Recovery benchmark (not a test): the same failure handled by ft-launch and by
what users have today, on the local Slurm cluster (root; brings it up).

Both runs train the example GPT with 3 replicas on 4 nodes and lose replica 1's
node (its slurmd and every process on it) at the same step.

* **ft-launch**: ``etc/examples/train.sbatch`` (3 replicas + 1 warm standby,
  ``--no-kill``): the others keep training, the standby is promoted.
* **requeue baseline**: the replicas as one ``srun`` step of a ``--requeue`` job
  (torchrun-style; every replica is needed for a step, so the survivors wait):
  Slurm sees the node fail, requeues the whole job, and the restarted job
  resumes from the newest persistent checkpoint (every ``--persist-every`` steps).

    python benchmarks/recovery_bench.py [--steps 900] [--kill-step 200] [--json F]

Measured from the replicas' commit events: *no progress* = the longest time
after the crash in which no replica committed a step; *full strength* = crash
-> first step committed by all 3 replicas again; *lost steps* = committed steps
whose work was thrown away (redone after a rollback to a checkpoint); *replica
back* = crash -> the lost replica's first commit again (on its new node).
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from record import write_json

from ft_launch.launcher.reporting.runlog import commits
from ft_launch.launcher.worker.events import StepCommitted
from tests.cluster import labcluster

TRAIN = REPO / "etc" / "examples" / "gpt" / "train.py"
LOST_REPLICA = 1            # the replica whose node is killed
FAST = ["FTL_QUORUM_MEMBER_TIMEOUT=2", "FTL_QUORUM_JOIN_TIMEOUT=1",
        "FTL_RECOVERY_LOST_TIMEOUT=5"]


def sbatch(args: list[str]) -> str:
    return labcluster.ctl_run(["sbatch", "--parsable", *args]).stdout.strip().split(";")[0]


def squeue_state(job_id: str) -> str:
    return labcluster.ctl_run(["squeue", "-h", "-j", job_id, "-o", "%T"], check=False).stdout.strip()


def all_commits(run_dir: Path) -> list[StepCommitted]:
    return sorted((e for events in commits(run_dir).values() for e in events),
                  key=lambda e: e.time)


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.2)


def victim_node(run_dir: Path, replica: int) -> str:
    """The node running ``replica``: the host of the quorum address it published."""
    record = json.loads((run_dir / "peers" / f"replica-{replica}.json").read_text())
    host = record["address"].split("//")[1].rsplit(":", 1)[0]
    nodes = labcluster.require_state().nodes
    return {labcluster.node_address(i): n for i, n in enumerate(nodes, start=1)}[host]


def measure(run_dir: Path, killed_at: float, replicas: int) -> dict[str, float]:
    events = all_commits(run_dir)
    before = [e for e in events if e.time <= killed_at]
    after = [e for e in events if e.time > killed_at]
    last_before = max(e.step for e in before)
    times = [killed_at] + [e.time for e in after]
    no_progress = max(b - a for a, b in itertools.pairwise(times))
    by_step: dict[int, set[int]] = {}
    full = None
    for e in after:
        by_step.setdefault(e.step, set()).add(e.replica_id)
        if e.step > last_before and len(by_step[e.step]) == replicas and e.contributors == replicas:
            full = e.time - killed_at
            break
    back = next((e.time - killed_at for e in after if e.replica_id == LOST_REPLICA), float("nan"))
    return {"no_progress_s": round(no_progress, 3),
            "full_strength_s": round(full if full is not None else float("nan"), 3),
            "replica_back_s": round(back, 3),
            "lost_steps": lost_steps(events)}


def lost_steps(events: list[StepCommitted]) -> int:
    """Committed steps thrown away: a replica committing a step again after having
    committed up to a later one (a restart from an older checkpoint)."""
    lost = 0
    newest: dict[int, int] = {}
    for e in events:
        before = newest.get(e.replica_id, -1)
        if e.step <= before:
            lost = max(lost, before + 1 - e.step)
        newest[e.replica_id] = max(before, e.step)
    return lost


def run_ftlaunch(out: Path, args: argparse.Namespace) -> dict[str, float]:
    runs = out / "ftl-runs"
    exports = ",".join(["ALL", f"PYTHON={sys.executable}", f"STEPS={args.steps}", "SIZE=small",
                        f"FTL_RUN_LOG_DIR={runs}", f"FTL_CKPT_PERSIST_EVERY={args.persist_every}",
                        *FAST])
    job = sbatch([f"--chdir={REPO}", f"--output={out}/ftl.out", f"--export={exports}",
                  str(REPO / "etc" / "examples" / "train.sbatch")])
    run_dir = runs / job
    return kill_and_measure(job, run_dir, args)


def run_requeue(out: Path, args: argparse.Namespace) -> dict[str, float]:
    run_dir = out / "requeue-run"
    script = out / "requeue.sbatch"
    # what etc/examples/train.sbatch trains: 2 FSDP2 ranks per replica, bf16
    train = shlex.join([sys.executable, str(TRAIN), "--steps", str(args.steps), "--size",
                        "small", "--threads", "1", "--parallel", "fsdp", "--param-dtype",
                        "bf16"])
    script.write_text("\n".join([
        "#!/bin/bash",
        "set -euo pipefail",
        f"export FTL_WORKER_NUM_REPLICAS=3 FTL_WORKER_RUN_DIR={run_dir} FTL_WORKER_RANKS=2",
        f"export FTL_WORKER_SECRET={'ab' * 32} FTL_CKPT_PERSIST_EVERY={args.persist_every}",
        *[f"export {item}" for item in FAST],
        # Plain data parallelism: every replica is needed for a step, and survivors wait
        # (like a hung collective) until Slurm kills and requeues the job.
        "export FTL_QUORUM_MIN_REPLICAS=3 FTL_RUNTIME_MAX_CONSECUTIVE_FAILURES=100000",
        # each node a replica: a torch world of its two tasks
        "export WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500",
        # one step for all replicas, like torchrun: one failure ends (and requeues) the job
        ("exec srun --kill-on-bad-exit=1 -N3 -n6 --ntasks-per-node=2 bash -c "
         "'export FTL_WORKER_REPLICA_ID=$SLURM_NODEID FTL_WORKER_RANK=$SLURM_LOCALID "
         f"RANK=$SLURM_LOCALID LOCAL_RANK=$SLURM_LOCALID; exec {train}'"), ""]))
    job = sbatch([f"--chdir={REPO}", f"--output={out}/requeue-%j.out", "--requeue", "-N3",
                  "--ntasks-per-node=2", str(script)])
    return kill_and_measure(job, run_dir, args)


def kill_and_measure(job: str, run_dir: Path, args: argparse.Namespace) -> dict[str, float]:
    wait_for(lambda: len(commits(run_dir)) == 3 and
             min(max((e.step for e in v), default=-1) for v in commits(run_dir).values())
             >= args.kill_step, 600, f"job {job} to reach step {args.kill_step}")
    node = victim_node(run_dir, LOST_REPLICA)
    labcluster.kill_node(node)
    killed_at = time.time()
    try:
        wait_for(lambda: squeue_state(job) == "", args.timeout, f"job {job} to finish")
    finally:
        labcluster.ctl_run(["scancel", job], check=False)
        labcluster.heal_node(node)
    result = measure(run_dir, killed_at, 3)
    result["final_step"] = max(e.step for e in all_commits(run_dir))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=900)
    parser.add_argument("--kill-step", type=int, default=200)
    parser.add_argument("--persist-every", type=int, default=50)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    labcluster.up()
    out = Path(tempfile.mkdtemp(prefix="ftl-recovery-bench-"))
    ftl = run_ftlaunch(out, args)
    requeue = run_requeue(out, args)
    summary = {
        "ftlaunch_no_progress_s": ftl["no_progress_s"],
        "requeue_no_progress_s": requeue["no_progress_s"],
        "ratio": round(requeue["no_progress_s"] / ftl["no_progress_s"], 2),
        "ftlaunch_full_strength_s": ftl["full_strength_s"],
        "kill_to_replica_back_s": ftl["replica_back_s"],
        "requeue_kill_to_replica_back_s": requeue["replica_back_s"],
        "requeue_full_strength_s": requeue["full_strength_s"],
        "lost_steps_ftlaunch": ftl["lost_steps"],
        "lost_steps_requeue": requeue["lost_steps"],
        "steps": args.steps, "kill_step": args.kill_step,
        "persist_every": args.persist_every, "output": str(out),
    }
    print(f"{'':24s} {'ft-launch':>10s} {'requeue':>10s}")
    for key in ("no_progress_s", "full_strength_s", "replica_back_s", "lost_steps"):
        print(f"{key:24s} {ftl[key]:>10} {requeue[key]:>10}")
    print(f"no-progress ratio (requeue / ft-launch): {summary['ratio']}x")
    if args.json:
        write_json(args.json, {"summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
