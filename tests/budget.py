"""A pytest plugin for running as much of a tier as a fixed time allows (CI):
``--run-first`` puts the most telling tests at the front, ``--end-by`` skips a
test whose own timeout would run past the end, so a tier can never make CI
overrun, and the summary names every test it skipped for time."""

from __future__ import annotations

import time

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("time budget", "running part of a tier within a fixed time (CI)")
    group.addoption("--end-by", type=float, metavar="UNIX_TIME",
                    help="start a test only if its timeout would run out before this "
                         "wall-clock time; skip the others (the summary lists them)")
    group.addoption("--run-first", action="append", default=[], metavar="NODEID_PREFIX",
                    help="run the tests whose node id starts with this first, in the order "
                         "the options are given (repeatable); the rest keep their order")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    first: list[str] = config.getoption("run_first")
    if first:
        items.sort(key=lambda item: next(
            (i for i, prefix in enumerate(first) if item.nodeid.startswith(prefix)), len(first)))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    end_by: float | None = item.config.getoption("end_by")
    if end_by is None:
        return
    marker = item.get_closest_marker("timeout")
    timeout = float(marker.args[0] if marker and marker.args else item.config.getini("timeout"))
    if time.time() + timeout > end_by:
        pytest.skip(f"time budget: its {timeout:.0f} s timeout would run past --end-by "
                    f"({time.strftime('%H:%M:%S', time.localtime(end_by))})")
