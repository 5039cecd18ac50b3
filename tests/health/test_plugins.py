"""The Slurm hooks and the step gate as slurmd / srun run them: real processes with
only the documented SLURM_* variables, a stand-in ``scontrol`` on PATH recording
its argv, simulated GPU faults per node."""

import json
import subprocess
import sys
import time

import pytest

from ft_launch.errors import ExitCode
from ft_launch.slurm_plugins.epilog import ended_badly
from tests.waiting import patience

pytestmark = pytest.mark.timeout(60)

FAKE_SCONTROL = """#!/bin/sh
# Records each call as one line of tab-separated argv; answers 'show node/job' from files.
for arg in "$@"; do printf '%s\\t' "$arg"; done >> "$FAKE_DIR/calls"
echo >> "$FAKE_DIR/calls"
case "$1 $2" in
  "show node") cat "$FAKE_DIR/node.txt" 2>/dev/null ;;
  "show job") cat "$FAKE_DIR/job.txt" 2>/dev/null ;;
esac
exit 0
"""


@pytest.fixture
def lab(tmp_path):
    """A node 'n3' with simulated GPUs, its config, and a recording scontrol."""
    bin_dir, faults, reports = tmp_path / "bin", tmp_path / "faults", tmp_path / "reports"
    for d in (bin_dir, faults, reports):
        d.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(FAKE_SCONTROL)
    scontrol.chmod(0o755)
    config = tmp_path / "health.toml"
    config.write_text(f'[health]\ngpus_per_node = 8\nbackend = "simulated"\n'
                      f'sim_fault_dir = "{faults}"\nreport_dir = "{reports}"\n'
                      f'[checks.disk]\npaths = ["/"]\nmin_free_bytes = 1\n')
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_DIR": str(tmp_path),
           "FTL_CONFIG": str(config), "SLURMD_NODENAME": "n3"}
    return tmp_path, env


def run(module, env, *args, **extra_env):
    return subprocess.run([sys.executable, "-m", module, *args], check=False,
                          capture_output=True, text=True,
                          env={**env, **extra_env}, timeout=30)


def calls(tmp_path):
    path = tmp_path / "calls"
    if not path.exists():
        return []
    return [line.rstrip("\t").split("\t") for line in path.read_text().splitlines() if line]


def inject(tmp_path, node, *faults):
    (tmp_path / "faults" / f"{node}.json").write_text(json.dumps(list(faults)))


def report(tmp_path, name):
    return json.loads((tmp_path / "reports" / "n3" / name).read_text())


def test_prolog_passes_a_healthy_node_without_touching_slurm(lab):
    tmp_path, env = lab
    done = run("ft_launch.slurm_plugins.prolog", env, SLURM_JOB_ID="41", SLURM_JOB_UID="1000")
    assert done.returncode == 0, done.stderr
    assert calls(tmp_path) == []
    assert report(tmp_path, "prolog-41.json")["status"] == "pass"


def test_prolog_drains_the_faulty_node_with_the_precise_reason(lab):
    tmp_path, env = lab
    inject(tmp_path, "n3", {"gpu": 3, "xid": 79})
    inject(tmp_path, "n4", {"gpu": 0, "lost": True})   # another node's fault is not ours
    done = run("ft_launch.slurm_plugins.prolog", env, SLURM_JOB_ID="42")
    assert done.returncode == ExitCode.NODE_UNHEALTHY, done.stderr
    assert calls(tmp_path) == [
        ["show", "node", "-o", "n3"],
        ["update", "nodename=n3", "state=drain", "reason=ft: gpu3 xid 79"]]


def test_a_node_drained_already_keeps_its_reason(lab):
    tmp_path, env = lab
    (tmp_path / "node.txt").write_text("NodeName=n3 State=IDLE+DRAIN Reason=admin [root]\n")
    inject(tmp_path, "n3", {"gpu": 1, "ecc_uncorrected": 4})
    done = run("ft_launch.slurm_plugins.healthcheck", env)
    assert done.returncode == ExitCode.NODE_UNHEALTHY
    assert [c[0] for c in calls(tmp_path)] == ["show"]


def test_healthcheck_drains_a_node_whose_disk_is_full(lab):
    tmp_path, env = lab
    inject(tmp_path, "n3", {"disk_free_bytes": 0, "path": "/"})
    done = run("ft_launch.slurm_plugins.healthcheck", env)
    assert done.returncode == ExitCode.NODE_UNHEALTHY
    assert calls(tmp_path)[-1] == ["update", "nodename=n3", "state=drain",
                                   "reason=ft: disk / free 0B<1B"]
    assert report(tmp_path, "healthcheck.json")["profile"] == "healthcheck"


@pytest.mark.parametrize("job_record, profile", [
    ("JobId=43 JobState=COMPLETING ExitCode=0:0 DerivedExitCode=0:0", "epilog"),
    ("JobId=43 JobState=COMPLETING ExitCode=3:0 DerivedExitCode=0:0", "epilog_failure"),
    ("JobId=43 JobState=COMPLETING ExitCode=0:0 DerivedExitCode=76:0", "epilog_failure"),
    ("", "epilog_failure"),   # slurmctld does not know the job: check deeper
])
def test_epilog_runs_the_deeper_profile_after_a_failed_job(lab, job_record, profile):
    tmp_path, env = lab
    (tmp_path / "job.txt").write_text(job_record + "\n")
    done = run("ft_launch.slurm_plugins.epilog", env, SLURM_JOB_ID="43")
    assert done.returncode == 0, done.stderr
    assert report(tmp_path, "epilog-43.json")["profile"] == profile
    assert calls(tmp_path) == [["show", "job", "-o", "43"]]


def test_epilog_judges_the_job_record():
    assert not ended_badly({"ExitCode": "0:0", "JobState": "COMPLETING"})
    assert ended_badly({"ExitCode": "0:9"})
    assert ended_badly({"ExitCode": "0:0", "JobState": "NODE_FAIL"})


def test_a_broken_config_fails_open(lab, tmp_path):
    _, env = lab
    bad = tmp_path / "bad.toml"
    bad.write_text("[health]\ngpus = 8\n")
    done = run("ft_launch.slurm_plugins.prolog", env, FTL_CONFIG=str(bad))
    assert done.returncode == 0
    assert "NOT checked" in done.stderr and "key 'health.gpus': unknown key" in done.stderr


def test_job_controlled_strings_never_reach_a_command(lab):
    tmp_path, env = lab
    inject(tmp_path, "n3", {"gpu": 2, "xid": 48})
    done = run("ft_launch.slurm_plugins.prolog", env, SLURM_JOB_ID="44; touch /tmp/pwned",
               SLURM_JOB_USER="$(reboot)")
    assert done.returncode == ExitCode.NODE_UNHEALTHY
    flat = [arg for call in calls(tmp_path) for arg in call]
    assert not any("pwned" in a or "reboot" in a for a in flat)


def test_gate_fails_only_its_step_and_runs_the_command_when_healthy(lab):
    tmp_path, env = lab
    marker = tmp_path / "ran"
    command = ["--", sys.executable, "-c", f"open({str(marker)!r}, 'w').write('ok')"]
    done = run("ft_launch.slurm_plugins.gate", env, *command, SLURM_JOB_ID="45")
    assert done.returncode == 0, done.stderr
    assert marker.read_text() == "ok"
    marker.unlink()
    inject(tmp_path, "n3", {"gpu": 6, "nvlink_down": [1]})
    done = run("ft_launch.slurm_plugins.gate", env, "--report", str(tmp_path / "gate.json"),
               *command, SLURM_JOB_ID="45")
    assert done.returncode == ExitCode.NODE_UNHEALTHY
    assert "ft-gate: n3 unhealthy: gpu6 nvlink1 down" in done.stderr
    assert not marker.exists()
    assert calls(tmp_path) == []      # no --drain: the launcher acts on the exit code
    assert json.loads((tmp_path / "gate.json").read_text())["status"] == "fail"


#: What a hook may cost next to importing torch, both measured in the same run so that
#: a loaded machine slows both alike. Seen idle and beside two busy processes: importing
#: a hook 1/30 to 1/10 of importing torch, a whole hook run 1/15 to 1/6; a hook that
#: imports torch, even lazily, costs all of it and more.
HOOK_SHARE_OF_TORCH = 0.5


@pytest.mark.parametrize("module", ["ft_launch.slurm_plugins.prolog",
                                    "ft_launch.slurm_plugins.epilog",
                                    "ft_launch.slurm_plugins.healthcheck",
                                    "ft_launch.slurm_plugins.gate"])
def test_hooks_start_fast_and_never_import_torch(lab, module):
    # slurmd runs these on every job and node: they must not pay for torch (seconds,
    # GiBs of pages). Timed against importing torch right after, in the same
    # interpreter, not against a fixed number of seconds.
    _, env = lab
    code = (f"import sys, time; t = time.perf_counter(); import {module}; "
            "hook = time.perf_counter() - t; loaded = 'torch' in sys.modules, "
            "'numpy' in sys.modules; t = time.perf_counter(); import torch; "
            "print(hook, time.perf_counter() - t, *loaded)")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                          text=True, env=env, timeout=patience(30))
    assert done.returncode == 0, done.stderr
    hook_import, torch_import, torch, numpy = done.stdout.split()
    assert (torch, numpy) == ("False", "False")
    assert float(hook_import) < HOOK_SHARE_OF_TORCH * float(torch_import), done.stdout
    runs = []
    for _ in range(2):   # the faster of two: one run can be unlucky on a busy machine
        start = time.perf_counter()
        assert run(module, env, SLURM_JOB_ID="46").returncode == 0
        runs.append(time.perf_counter() - start)
    # the whole run, interpreter start included
    assert min(runs) < HOOK_SHARE_OF_TORCH * float(torch_import), (runs, torch_import)
