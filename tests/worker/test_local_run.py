"""``ft-launch local``: the user's script as replicas on this machine, a killed replica
started again, and the run directory ``status`` and ``timeline`` read."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from ft_launch.files import atomic_write_text
from ft_launch.launcher.cli import main
from ft_launch.launcher.controller import events as controller_events
from ft_launch.launcher.reporting.runlog import commits, controller_log
from ft_launch.launcher.worker.audit import check_exactly_once
from tests.waiting import patience, wait_until
from tests.worker.harness import BATCH, TEST_CONFIG, TRAIN

END_STEP_FILE = "end-step"   # the example's: a number there ends its run before that step

KILL_AT = 5
#: The run is ended this many steps after the newest commit once the restarted replica
#: is back (``end-step``): ahead of every replica, and steps trained all together again.
TOGETHER = 100


def env() -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("FTL_")}, **TEST_CONFIG}


def ft_launch(*argv: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ft_launch.launcher.cli", *argv], env=env(),
                          check=False,
                          capture_output=True, text=True, timeout=patience(timeout))


def test_a_killed_replica_is_started_again_and_the_run_reads_back(tmp_path):
    run_dir = tmp_path / "run"
    local = subprocess.Popen(
        [sys.executable, "-m", "ft_launch.launcher.cli", "local", "--replicas", "3",
         "--kill", f"1@{KILL_AT}", "--run-dir", str(run_dir), "--",
         sys.executable, str(TRAIN), "--steps", "100000", "--size", "tiny",
         "--batch-size", str(BATCH), "--threads", "1", "--parallel", "none"],
        env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # long enough for the restarted replica to be back; then ended (end-step)
        back = wait_until(lambda: [e.step for e in commits(run_dir).get(1, [])
                                   if e.step > KILL_AT], 240, "replica 1 back after its kill")
        steps = max(back[-1], *(e.step for events in commits(run_dir).values()
                                for e in events)) + TOGETHER
        atomic_write_text(run_dir / END_STEP_FILE, str(steps))
        out, _ = local.communicate(timeout=patience(180))
    finally:
        if local.poll() is None:
            local.kill()
            local.wait()
    assert local.returncode == 0, out[-4000:]
    assert f"run directory  {run_dir}" in out
    control = controller_log(run_dir)
    exited = [(e.replica_id, e.exit_code) for e in control
              if isinstance(e, controller_events.ReplicaExited)]
    assert sorted(exited) == [(0, 0), (1, -signal.SIGKILL), (1, 0), (2, 0)]
    restarted = [e.replica_id for e in control if isinstance(e, controller_events.ReplicaLaunched)
                 and e.how == "restart"]
    assert restarted == [1]
    finished = [e for e in control if isinstance(e, controller_events.RunFinished)]
    assert [(f.exit_code, f.reason) for f in finished] == [(0, "training finished")]
    # the restarted replica caught up from the others and ends with the same model
    assert any(e.caught_up for e in commits(run_dir)[1])
    finals = [json.loads(p.read_text()) for p in (run_dir / "final").glob("*.json")]
    assert len(finals) == 3 and len({f["state_sha256"] for f in finals}) == 1
    check_exactly_once(run_dir, 3, steps)
    # what a run under Slurm leaves, a local run leaves too
    assert json.loads((run_dir / "summary.json").read_text())["failures"] == 1
    assert (run_dir / "timeline.png").stat().st_size > 0
    status = ft_launch("status", str(run_dir), timeout=60)
    assert status.returncode == 0 and "replica" in status.stdout, status.stderr


@pytest.mark.parametrize("argv, complaint", [
    (["--kill", "5@3"], "replica must be 0..1"),
    (["--kill", "one"], "expected REPLICA@STEP"),
    (["--max-restarts", "-1"], "expected 0 or more"),
])
def test_bad_local_input_is_named(argv, complaint, capsys, tmp_path):
    code = main(["local", *argv, "--run-dir", str(tmp_path), "--", "train.py"])
    assert code == 2 and complaint in capsys.readouterr().err


def test_local_without_a_command_says_how(capsys):
    assert main(["local"]) == 2
    assert "ft-launch local -- python train.py" in capsys.readouterr().err
