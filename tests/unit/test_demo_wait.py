"""The demo waits for its job as long as training goes on, and no longer."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.scale.helpers import load_script

DEMO = Path(__file__).resolve().parents[2] / "etc" / "demo.py"


@pytest.fixture
def demo(monkeypatch):
    module = load_script(DEMO)
    clock = SimpleNamespace(now=1000.0)
    # The demo's own clock only: the time module stays as it is for everyone else.
    monkeypatch.setattr(module, "time", SimpleNamespace(monotonic=lambda: clock.now))
    module.clock = clock
    return module


def status(*steps):
    return SimpleNamespace(replicas=[SimpleNamespace(step=s) for s in steps])


def test_a_job_that_keeps_stepping_is_waited_for_however_long_it_takes(demo, monkeypatch):
    monkeypatch.setattr(demo, "job_state", lambda job_id: "RUNNING")
    ended = demo.finished("7", stall_s=300)
    for step in range(0, 3000, 100):        # far past any fixed limit, a step each minute
        demo.clock.now += 60
        assert ended(status(step, step, None)) is False
    monkeypatch.setattr(demo, "job_state", lambda job_id: "")
    assert ended(status(3000, 3000, 3000)) is True


def test_no_new_step_for_the_stall_time_ends_the_demo_with_the_newest_step(demo, monkeypatch):
    monkeypatch.setattr(demo, "job_state", lambda job_id: "RUNNING")
    ended = demo.finished("7", stall_s=300)
    assert ended(status(41, 42)) is False
    demo.clock.now += 299
    assert ended(status(41, 42)) is False
    demo.clock.now += 2
    with pytest.raises(SystemExit, match="no replica committed a step for 300 s.*newest is 42"):
        ended(status(41, 42))
