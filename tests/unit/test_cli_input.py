"""Bad input to the real ``ft-launch`` process: exit 2, the project's message, no traceback.

The exit contract (README "Exit codes"): 2 is a bad command line or input file.
A ``ConfigError`` found inside a running job keeps 78 (fatal, do not requeue).
"""

import os
import subprocess
import sys

import pytest

from ft_launch.errors import ConfigError, ExitCode


def run_cli(*args, cwd=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "FTL_"))}
    return subprocess.run([sys.executable, "-m", "ft_launch.launcher.cli", *args],
                          capture_output=True, text=True, errors="backslashreplace",
                          timeout=120, env=env,
                          check=False, cwd=cwd)


def assert_bad_input(result, *expected):
    assert result.returncode == ExitCode.USAGE, (result.returncode, result.stderr)
    assert result.stderr.startswith("ft-launch: error: "), result.stderr
    assert "Traceback" not in result.stderr
    for text in expected:
        assert text in result.stderr, (text, result.stderr)


PLAN = ["plan", "--nodelist", "n[1-4]"]


@pytest.mark.parametrize("args, expected", [
    (PLAN + ["--replicas", "0"], ["--set", "job.replicas", "at least 1"]),
    (["--set", "recovery.lost_timeout=nan"] + PLAN, ["recovery.lost_timeout", "finite"]),
    (["--set", "ftar.sockets_per_peer=65536"] + PLAN, ["ftar.sockets_per_peer", "at most 64"]),
    (["--set", "job.replicas=" + "[" * 2000] + PLAN, ["job.replicas", "expected an integer"]),
    (["--set", "ckpt.dir=a\x01b"] + PLAN, ["ckpt.dir", "control characters"]),
    (["--config", "/"] + PLAN, ["in /", "is a directory"]),
    (["plan", "--nodelist", "n[0-99999999]"], ["bad hostlist", "more than 100000 names"]),
    (["plan", "--nodelist", "n[1-" + "9" * 5000 + "]"], ["bad hostlist", "18 digits"]),
    (["plan", "--nodelist", "n$(reboot)"], ["bad hostlist", "letters, digits"]),
])
def test_bad_input_exits_2_with_the_projects_message(args, expected):
    assert_bad_input(run_cli(*args, "--", "python3", "train.py"), *expected)


def test_a_config_file_that_is_not_utf8_exits_2(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes(b"[ckpt]\ndir = \"caf\xe9\"\n")
    assert_bad_input(run_cli("--config", str(path), *PLAN, "--", "x"), str(path), "not UTF-8")


def test_config_errors_keep_fatal_no_requeue_outside_the_command_line():
    """A worker loading a broken config.toml inside the job: retrying cannot help (78)."""
    assert ConfigError("x").exit_code is ExitCode.FATAL_NO_REQUEUE
