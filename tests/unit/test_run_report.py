"""The report ``ft-launch run`` writes once the run is over: a failure to write it is
logged and never replaces the run's exit code with a traceback."""

from __future__ import annotations

import logging

from ft_launch.launcher.cli import write_run_report


def test_an_unreadable_run_log_is_a_warning_not_a_traceback(tmp_path, caplog):
    (tmp_path / "controller.jsonl").mkdir()          # reading it is an OSError
    with caplog.at_level(logging.WARNING):
        write_run_report(tmp_path)
    assert "no run report" in caplog.text and "controller.jsonl" in caplog.text
    assert not (tmp_path / "summary.json").exists()


def test_a_run_without_a_committed_step_has_no_report(tmp_path, caplog):
    (tmp_path / "controller.jsonl").write_text("")
    with caplog.at_level(logging.WARNING):
        write_run_report(tmp_path)
    assert "no committed step" in caplog.text
