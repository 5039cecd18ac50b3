"""The demo: fault-tolerant training on the local Slurm cluster, with a node killed.

Submits ``etc/examples/train.sbatch`` (3 replicas of 2 ranks sharding the model
with FSDP2 + 1 warm standby), waits until
training is under way, kills replica 1's node (its slurmd and every process on
it, like a crash), shows the recovery live (eviction, promotion, catch-up), then
the summary. Run by ``etc/demo.sh`` after the cluster is up; root only.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from launcher import events as controller_events
from launcher.report import commits, controller_log, status_text
from tests.cluster import labcluster

STEPS = 1500
KILL_AT_STEP = 200
RANKS = 2          # per replica: FSDP2 shards the model over them


def progress(run_dir: Path) -> dict[int, int]:
    return {r: max((e.step for e in events), default=-1)
            for r, events in commits(run_dir).items()}


def wait(condition, timeout: float, what: str, show: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    last_print = 0.0
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"demo: timed out waiting for {what}")
        if show is not None and time.monotonic() - last_print > 2:
            last_print = time.monotonic()
            print(status_text(show, recent=4), flush=True)
        time.sleep(0.25)


def job_state(job_id: str) -> str:
    out = labcluster.ctl_run(["squeue", "-h", "-j", job_id, "-o", "%T"], check=False)
    return out.stdout.strip()


def main() -> int:
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
    print(f"== submitted job {job_id}: 3 replicas of {RANKS} FSDP2 ranks + 1 warm standby; "
          f"run directory {run_dir}")
    wait(lambda: len(progress(run_dir)) == 3 and min(progress(run_dir).values()) >= KILL_AT_STEP,
         300, f"training to pass step {KILL_AT_STEP}", show=run_dir)
    launches = {e.replica_id: e for e in controller_log(run_dir)
                if isinstance(e, controller_events.ReplicaLaunched)}
    victim = launches[1].nodes[0]
    print(f"== killing node {victim} (replica 1): its slurmd and every process on it")
    labcluster.kill_node(victim)
    killed_at = time.time()
    wait(lambda: any(e.caught_up and e.time > killed_at for e in commits(run_dir).get(1, [])),
         120, "replica 1 to rejoin", show=run_dir)
    print(status_text(run_dir))
    print(f"== replica 1 is back {time.time() - killed_at:.1f} s after the crash; training "
          "goes on to the end")
    wait(lambda: job_state(job_id) == "", 600, "the job to finish")
    print((out / "job.out").read_text().split("summary (")[-1])
    finals = [json.loads(p.read_text()) for p in (run_dir / "final").glob("*.json")]
    # Rank k of every replica holds the same shards of the FSDP2-sharded model.
    same = len(finals) == 3 * RANKS and all(
        len({f["state_sha256"] for f in finals if f["rank"] == rank}) == 1
        for rank in range(RANKS))
    print(f"== replicas bit-identical at the end: {same}; node {victim} drained: "
          f"{labcluster.ctl_run(['sinfo', '-h', '-n', victim, '-o', '%t %E']).stdout.strip()}")
    labcluster.heal_node(victim)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
