"""``benchmarks/fault_run.py`` as people run it, at a toy size: a replica killed and
started again, the run sized by its recovery, the summary its README table reads."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.waiting import patience

from .harness import REPO

pytest.importorskip("torch")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SUMMARY_KEYS = {"identical_final_state", "samples_exactly_once", "max_healthy_stall_s",
                "rejoin_s", "step_time_s", "final_loss", "baseline_final_loss",
                "baseline_identical_final_state", "steps", "kill_step", "replicas", "size",
                "fault"}


def test_a_kill_run_lasts_until_the_restarted_replica_trains_again(tmp_path):
    """--steps 4 ends long before a restarted process is up (imports, quorum join,
    state fetch): the run goes on until the restarted replica has caught up and
    trained ``AFTER_CATCH_UP`` steps among the others. Before, the survivors finished
    step 4 first and the restarted replica failed ("a replica failed")."""
    out, kill_step = tmp_path / "fault.json", 2
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "fault_run.py"), "--size", "tiny",
         "--steps", "4", "--kill-step", str(kill_step), "--json", str(out)],
        check=False, capture_output=True, text=True, timeout=patience(300))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(out.read_text())["summary"]
    assert SUMMARY_KEYS <= summary.keys(), summary
    assert summary["identical_final_state"] and summary["samples_exactly_once"], summary
    assert summary["baseline_identical_final_state"], summary
    # caught up after the kill, then trained AFTER_CATCH_UP (10) more steps
    assert summary["steps"] >= kill_step + 1 + 10, summary
    assert summary["rejoin_s"] > 0 and summary["max_healthy_stall_s"] > 0, summary
