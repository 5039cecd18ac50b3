"""What the hooks take from outside: the SLURM_* variables and the drain request a
job names. Real hook processes (the ``lab`` of test_plugins: a recording
``scontrol`` on PATH, simulated GPUs), real files, links and FIFOs."""

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from ft_launch.errors import ExitCode
from tests.health.test_plugins import calls, lab  # noqa: F401 (lab: a fixture)

pytestmark = pytest.mark.timeout(120)

HOOK_TIMEOUT = 30          # a hook that takes this long is hung (they take < 1 s)
MEMORY_CAP = 1 << 30       # the 1 GiB cap under which /dev/zero made the old Epilog fail open
ROOT_HOOKS = ["ft_launch.slurm_plugins.prolog", "ft_launch.slurm_plugins.epilog",
              "ft_launch.slurm_plugins.healthcheck"]
ALL_HOOKS = [*ROOT_HOOKS, "ft_launch.slurm_plugins.gate"]
UID = os.getuid()


def _cap_memory():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))


def run_capped(module, env, **extra_env):
    """The hook as slurmd runs it, under a memory cap, bounded in time."""
    return subprocess.run([sys.executable, "-m", module], check=False, capture_output=True,
                          text=True, env={**env, **extra_env}, timeout=HOOK_TIMEOUT,
                          preexec_fn=_cap_memory)


def files_under(root):
    return {p.relative_to(root) for p in root.rglob("*")}


# -- SLURM_* values -------------------------------------------------------------------

BAD_NODES = {"dotdot": "../x", "slash": "a/b", "long": "n" * 300, "dot": ".hidden",
             "newline": "n3\n"}


@pytest.mark.parametrize("node", list(BAD_NODES.values()), ids=list(BAD_NODES))
@pytest.mark.parametrize("module", ALL_HOOKS)
def test_a_bad_node_name_is_refused_in_one_line_and_nothing_is_written(lab, module, node):
    tmp_path, env = lab
    before = files_under(tmp_path)
    done = run_capped(module, env, SLURMD_NODENAME=node, SLURM_JOB_ID="41",
                      SLURM_JOB_UID=str(UID))
    assert "Traceback" not in done.stderr
    assert "SLURMD_NODENAME" in done.stderr and "not a Slurm node name" in done.stderr
    if module == "ft_launch.slurm_plugins.gate":
        # The step's environment is the job owner's: theirs to fix, the step fails.
        assert done.returncode == ExitCode.USAGE
        assert done.stderr.startswith("ft-gate: ")
    else:
        # From slurmd's own setup, alike on every node: fail open (see hook.py).
        assert done.returncode == ExitCode.OK
        assert "NOT checked" in done.stderr
    assert files_under(tmp_path) == before          # no report, in its folder or outside
    assert calls(tmp_path) == []                    # no node of that name drained


BAD_JOB_VALUES = {"uid-superscript": ("SLURM_JOB_UID", "²"),
                  "uid-5000-digits": ("SLURM_JOB_UID", "9" * 5000),
                  "uid-negative": ("SLURM_JOB_UID", "-1"),
                  "jobid-superscript": ("SLURM_JOB_ID", "²"),
                  "jobid-over-32-bits": ("SLURM_JOB_ID", "4" * 11),
                  "user-shell": ("SLURM_JOB_USER", "$(reboot)"),
                  "user-long": ("SLURM_JOB_USER", "u" * 300)}


@pytest.mark.parametrize("key, value", list(BAD_JOB_VALUES.values()), ids=list(BAD_JOB_VALUES))
@pytest.mark.parametrize("module", ALL_HOOKS)
def test_a_bad_job_variable_is_dropped_in_one_line_and_the_node_still_checked(
        lab, module, key, value):
    tmp_path, env = lab
    values = {"SLURM_JOB_ID": "41", "SLURM_JOB_UID": str(UID), "SLURM_JOB_USER": "alice",
              key: value}
    before = files_under(tmp_path)
    done = run_capped(module, env, **values)
    assert "Traceback" not in done.stderr
    assert done.returncode == ExitCode.OK, done.stderr     # a healthy node passes
    warned = [line for line in done.stderr.splitlines() if f"{key}=" in line]
    assert len(warned) == 1 and "ignored: expected" in warned[0], done.stderr
    assert len(warned[0]) < 300                              # the value is quoted short
    written = files_under(tmp_path) - before - {Path("calls")}
    if module == "ft_launch.slurm_plugins.gate":
        assert written == set()                 # the gate writes only its --report
        return
    hook = module.rsplit(".", 1)[1]
    job = "" if key == "SLURM_JOB_ID" else "-41"
    assert written == {Path("reports/n3"), Path(f"reports/n3/{hook}{job}.json")}


# -- the drain request a job names ----------------------------------------------------

def epilog_record(tmp_path, run_dir):
    (tmp_path / "job.txt").write_text(
        f"JobId=43 JobState=COMPLETING ExitCode=0:0 DerivedExitCode=0:0 "
        f"Comment=ft-launch-run={run_dir}\n")


def request_dir(tmp_path):
    requests = tmp_path / "run" / "drain-requests"
    requests.mkdir(parents=True)
    return requests


def write_valid(path, node="n3"):
    path.write_text(f'{{"job_id": "43", "node": "{node}", "reason": "replica 1 stalled"}}')


def drained_reasons(tmp_path):
    return [c[3] for c in calls(tmp_path) if c[:1] == ["update"]]


def _symlink_to_dev_zero(tmp_path):
    (request_dir(tmp_path) / "n3.json").symlink_to("/dev/zero")
    return tmp_path / "run"


def _fifo(tmp_path):
    os.mkfifo(request_dir(tmp_path) / "n3.json")
    return tmp_path / "run"


def _other_owner(tmp_path):
    path = request_dir(tmp_path) / "n3.json"
    write_valid(path)
    os.chown(path, UID + 4242, -1)
    return tmp_path / "run"


def _oversize(tmp_path):
    path = request_dir(tmp_path) / "n3.json"
    path.write_text('{"job_id": "43", "node": "n3", "reason": "' + "x" * 100_000 + '"}')
    return tmp_path / "run"


def _symlinked_parent(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    write_valid(elsewhere / "n3.json")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "drain-requests").symlink_to(elsewhere)
    return tmp_path / "run"


def _dotdot(tmp_path):
    write_valid(request_dir(tmp_path) / "n3.json")
    return f"{tmp_path}/run/../run"


def _relative(tmp_path):
    write_valid(request_dir(tmp_path) / "n3.json")
    return "run"


HOSTILE = {"symlink to /dev/zero": (_symlink_to_dev_zero, "n3.json is a symlink"),
           "fifo": (_fifo, "n3.json is not a regular file"),
           "another user's file": (_other_owner, f"owned by uid {UID + 4242}"),
           "oversize": (_oversize, "n3.json over 4096 bytes"),
           "symlinked parent": (_symlinked_parent, "drain-requests is a symlink"),
           "dotdot": (_dotdot, "not absolute or has"),
           "relative": (_relative, "not absolute or has")}


@pytest.mark.skipif(os.geteuid() != 0, reason="the Epilog runs as root: chown needs root")
@pytest.mark.parametrize("kind", list(HOSTILE))
def test_the_epilog_fails_closed_on_a_request_it_cannot_trust(lab, kind):
    tmp_path, env = lab
    make, why = HOSTILE[kind]
    epilog_record(tmp_path, make(tmp_path))
    done = run_capped("ft_launch.slurm_plugins.epilog", env, SLURM_JOB_ID="43",
                      SLURM_JOB_UID=str(UID))
    assert "Traceback" not in done.stderr
    assert done.returncode == ExitCode.OK, done.stderr            # the node itself is healthy
    [reason] = drained_reasons(tmp_path)
    assert reason.startswith("reason=ft: ft-launch: invalid drain request: "), reason
    assert why.replace("'", "") in reason or why in done.stderr, (reason, done.stderr)
    report = tmp_path / "reports" / "n3" / "epilog-43.json"
    assert report.is_file(), done.stderr                           # the checks still ran


def test_the_epilog_honours_a_valid_request_and_still_checks(lab):
    tmp_path, env = lab
    write_valid(request_dir(tmp_path) / "n3.json")
    epilog_record(tmp_path, tmp_path / "run")
    done = run_capped("ft_launch.slurm_plugins.epilog", env, SLURM_JOB_ID="43",
                      SLURM_JOB_UID=str(UID))
    assert done.returncode == ExitCode.OK, done.stderr
    assert drained_reasons(tmp_path) == [
        "reason=ft: evicted by ft-launch (job 43): replica 1 stalled"]
    assert (tmp_path / "reports" / "n3" / "epilog-43.json").is_file()


def test_the_epilog_ignores_a_run_without_a_request_for_its_node(lab):
    tmp_path, env = lab
    write_valid(request_dir(tmp_path) / "n4.json", node="n4")     # another node's request
    epilog_record(tmp_path, tmp_path / "run")
    done = run_capped("ft_launch.slurm_plugins.epilog", env, SLURM_JOB_ID="43",
                      SLURM_JOB_UID=str(UID))
    assert done.returncode == ExitCode.OK, done.stderr
    assert drained_reasons(tmp_path) == []


def test_plugins_import_nothing_from_the_launcher():
    """Imports flow slurm_plugins -> health -> ftcore (house style)."""
    modules = ", ".join(f"ft_launch.slurm_plugins.{m}"
                        for m in ("prolog", "epilog", "healthcheck", "gate", "hook"))
    code = (f"import sys, {modules}; "
            "print(sorted({'.'.join(m.split('.')[:2]) for m in sys.modules} & "
            "{'ft_launch.launcher', 'ft_launch.ftar', 'ft_launch.ckpt'}))")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                          text=True, timeout=60)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr
