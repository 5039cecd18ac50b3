"""Record the parser fixtures of ``tests/unit/fixtures/slurm-<release>/`` from a real
cluster of that release (the parsers' tests read nothing shaped by hand).

    tests/cluster/slurm-cluster up --slurm 24.11
    LAB_SLURM_RELEASE=24.11 python3 -m tests.cluster.record_fixtures

One scenario on every release, so the files compare line by line: a finished
job; a running 3-node batch job ``ftl-fixture`` (batch host n1) with two steps;
n5 drained with a reason; a reservation ``standby`` on n6; n6's slurmd killed
until the node is DOWN; a job expanded by one node; and the environment each
hook (Prolog, Epilog, HealthCheckProgram) runs with. The cluster is put back as
it was afterwards.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

from ft_launch.slurm import commands
from tests.cluster import labcluster
from tests.waiting import wait_until

FIXTURES = Path(__file__).resolve().parents[1] / "unit" / "fixtures"
DRAIN_REASON = "ft-launch: test drain gpu3 xid 79"


def ctl(*argv: str, check: bool = True) -> str:
    done = labcluster.ctl_run(list(argv), check=False, timeout=60, cwd="/tmp")
    if check and done.returncode != 0:
        raise SystemExit(f"record_fixtures: {' '.join(argv)} failed: {done.stderr.strip()}")
    return done.stdout + (done.stderr if not check else "")


def job_state(job_id: str) -> str:
    found = re.search(r"JobState=(\S+)", ctl("scontrol", "show", "job", "-o", job_id))
    return found.group(1) if found else ""


def node_state(node: str) -> str:
    return ctl("sinfo", "-h", "-n", node, "-o", "%t").strip()


def sbatch(scratch: Path, name: str, body: str, *args: str) -> str:
    script = scratch / f"{name}.sh"
    script.write_text(f"#!/bin/bash\n{body}\n")
    out = ctl("sbatch", "--parsable", f"--job-name={name}", "--output=/dev/null", *args,
              str(script))
    return out.strip().split(";")[0]


def record(out: Path, scratch: Path) -> None:
    def save(name: str, text: str) -> None:
        (out / name).write_text(text)
        print(f"  {out.name}/{name}: {len(text)} bytes")

    save("sinfo.json", ctl("sinfo", "--json"))
    save("scontrol_show_node.txt", ctl(*commands.show_nodes_argv()))
    done = sbatch(scratch, "ftl-done", "true", "--nodes=1", "--nodelist=n4")
    wait_until(lambda: job_state(done) == "COMPLETED", 60, f"job {done} to complete")
    main = sbatch(scratch, "ftl-fixture",
                  "srun --exact -N1 -n1 -w n2 sleep 600 &\n"
                  "srun --exact -N1 -n1 -w n1 sleep 600 &\nwait",
                  "--nodes=3", "--nodelist=n[1-3]", "--no-kill")
    wait_until(lambda: len(ctl(*commands.list_steps_argv(main)).splitlines()) >= 3, 60,
               f"job {main} to run two steps")
    ctl(*commands.update_node_argv("n5", "drain", DRAIN_REASON))
    ctl(*commands.create_reservation_argv("standby", ("n6",), 60, ("root",), ("IGNORE_JOBS",)))
    save("squeue.json", ctl("squeue", "--json"))
    save("squeue_steps.txt", ctl(*commands.list_steps_argv(main)))
    save("scontrol_show_job.txt", ctl("scontrol", "show", "job", "-o"))
    save("scontrol_show_reservation.txt", ctl(*commands.show_reservation_argv()))
    save("scontrol_show_node_drain.txt", ctl(*commands.show_nodes_argv(("n5",))))
    save("sinfo_drain.json", ctl("sinfo", "--json"))
    labcluster.kill_node("n6")
    wait_until(lambda: node_state("n6").startswith("down"), 120, "n6 to be DOWN")
    save("scontrol_show_node_down.txt", ctl(*commands.show_nodes_argv(("n6",))))
    save("sinfo_down.json", ctl("sinfo", "--json"))
    ctl("scancel", main)
    ctl("scontrol", "delete", "reservationname=standby")
    labcluster.heal_node("n6")
    ctl(*commands.update_node_argv("n5", "resume"))
    save("expansion.txt", record_expansion())
    for hook, text in record_hook_envs(scratch).items():
        save(f"env_{hook}.txt", text)


def record_expansion() -> str:
    """Grow a running allocation by one node (``--dependency=expand``); the file holds
    the commands' answers and the grown job as ``scontrol show job -o`` shows it."""
    lines = []
    main = labcluster.ctl_run(["salloc", "--no-shell", "--no-kill", "-N1", "-w", "n1",
                               "--job-name=ftl-main"], check=False, timeout=60)
    main_id = re.search(r"Granted job allocation (\d+)", main.stderr + main.stdout).group(1)
    grow = labcluster.ctl_run(["salloc", "--no-shell", "-N1", "-w", "n4", "--job-name=ftl-grow",
                               f"--dependency=expand:{main_id}", "--immediate=30"],
                              check=False, timeout=60)
    lines.append(f"# salloc --dependency=expand:MAIN -> exit {grow.returncode}: "
                 f"{(grow.stderr + grow.stdout).strip()}")
    grow_id = re.search(r"Granted job allocation (\d+)", grow.stderr + grow.stdout)
    if grow_id:
        update = labcluster.ctl_run(["scontrol", "update", f"jobid={grow_id.group(1)}",
                                     "NumNodes=0"], check=False, timeout=60, cwd="/tmp")
        lines.append(f"# scontrol update jobid=GROW NumNodes=0 -> exit {update.returncode}: "
                     f"{(update.stderr + update.stdout).strip()}")
        ctl("scancel", grow_id.group(1), check=False)
        wait_until(lambda: grow_id.group(1) not in ctl("squeue", "-h", "-o", "%i").split(),
                   60, "the expanding job to be gone")
    lines.append(ctl("scontrol", "show", "job", "-o", main_id).strip())
    ctl("scancel", main_id, check=False)
    return "\n".join(lines) + "\n"


def record_hook_envs(scratch: Path) -> dict[str, str]:
    """Each hook writes its environment; one job on n2 runs Prolog and Epilog."""
    envs = scratch / "envs"
    envs.mkdir(exist_ok=True)

    def hook(name: str) -> str:
        path = scratch / f"hook-{name}"
        path.write_text(f"#!/bin/sh\nenv | LC_ALL=C sort > {shlex.quote(str(envs))}/{name}."
                        "${SLURMD_NODENAME:-x}.${SLURM_JOB_ID:-0}.$$\nexit 0\n")
        path.chmod(0o755)
        return str(path)

    labcluster.configure(labcluster.Hooks(prolog=hook("prolog"), epilog=hook("epilog"),
                                          healthcheck=hook("healthcheck"),
                                          healthcheck_interval=5, prolog_flags="Alloc"))
    try:
        job = sbatch(scratch, "ftl-hooks", "true", "--nodes=1", "--nodelist=n2")
        wait_until(lambda: all(list(envs.glob(f"{h}.n2.*")) for h in ("prolog", "epilog",
                                                                       "healthcheck")),
                   120, f"the hooks of job {job} to run")
    finally:
        labcluster.configure(labcluster.Hooks())
    return {h: min(envs.glob(f"{h}.n2.*")).read_text() for h in
            ("prolog", "epilog", "healthcheck")}


def main() -> int:
    state = labcluster.require_state()
    version = ctl("sinfo", "-V").split()[-1]
    release = ".".join(version.split(".")[:2])
    out = FIXTURES / f"slurm-{release}"
    out.mkdir(parents=True, exist_ok=True)
    scratch = labcluster.state_dir() / "record"
    scratch.mkdir(exist_ok=True)
    print(f"recording Slurm {version} ({state.release} cluster) into {out}")
    record(out, scratch)
    (out / "VERSION").write_text(version + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
