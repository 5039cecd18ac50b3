"""The CI time-budget plugin (``tests/budget.py``), run on a small suite of its own."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parents[2]

SUITE = """
import pytest

def test_plain(): pass

@pytest.mark.timeout(5)
def test_short(): pass

def test_last(): pass
"""


@pytest.fixture
def run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
        ) -> Callable[..., pytest.RunResult]:
    # The suite runs in a directory of its own: the plugin comes from the repo.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    pytester.makeini("[pytest]\ntimeout = 300\n")
    pytester.makepyfile(test_suite=SUITE)
    return lambda *args: pytester.runpytest_subprocess("-p", "tests.budget", "-v", "-rs", *args)


def test_a_test_whose_timeout_runs_past_the_end_is_skipped_and_one_that_fits_runs(
        run: Callable[..., pytest.RunResult]) -> None:
    result = run("--end-by", str(time.time() + 150))
    result.assert_outcomes(passed=1, skipped=2)
    result.stdout.fnmatch_lines(["*test_short PASSED*",
                                 "*time budget: its 300 s timeout would run past --end-by*"])


def test_without_an_end_every_test_runs(run: Callable[..., pytest.RunResult]) -> None:
    run().assert_outcomes(passed=3)


def test_run_first_puts_the_named_tests_at_the_front_in_the_order_given(
        run: Callable[..., pytest.RunResult]) -> None:
    result = run("--run-first", "test_suite.py::test_last",
                 "--run-first", "test_suite.py::test_short")
    ran = [line.split("::")[1].split()[0] for line in result.stdout.lines
           if "PASSED" in line and "::" in line]
    assert ran == ["test_last", "test_short", "test_plain"]
