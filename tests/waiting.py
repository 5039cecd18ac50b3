"""Waiting on a condition with a deadline: the only way tests wait.

A deadline here is how long a test waits before it calls a thing lost, never a
claim about the product: so it stretches with the machine's load (beside other
work a test on 2 cores may get a fraction of one). What a test asserts about a
duration is derived from the configured timeouts, or measured against something
else in the same run, never an absolute number of seconds.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def load_factor() -> float:
    """How many times slower than idle this machine may run now, at least 1: the
    runnable tasks per core, over the last minute or right now, whichever is more
    (the minute's average lags behind work that has just started)."""
    cores = len(os.sched_getaffinity(0)) or 1
    runnable = os.getloadavg()[0]
    try:
        with open("/proc/loadavg", encoding="ascii") as stats:
            running = int(stats.read().split()[3].split("/")[0]) - 1  # minus this process
        runnable = max(runnable, running)
    except (OSError, IndexError, ValueError):  # not Linux: the average alone
        pass
    return max(1.0, runnable / cores)


def patience(seconds: float) -> float:
    """``seconds`` of waiting on an idle machine, stretched by the load now."""
    return seconds * load_factor()


def wait_until(condition: Callable[[], T], timeout: float, what: str,
               interval: float = 0.05) -> T:
    """Return the first truthy value of ``condition()``; fail after ``timeout``
    seconds (on an idle machine: stretched by ``patience``)."""
    factor = load_factor()
    limit = timeout * factor
    deadline = time.monotonic() + limit
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {limit:.1f} s ({timeout:g} s at load "
                                 f"factor {factor:.1f}) waiting for {what}")
        time.sleep(interval)  # polling interval of the condition, not synchronisation
