"""The step observer seam (``worker.observer``): production runs the no-op observer;
``FTL_WORKER_OBSERVER`` names another (the tests' fault injector, ``ft-launch local
--kill``'s), and faults fire through it. Injected faults through the whole worker:
test_fault_tolerance, test_rollback, test_replay_mode."""

from __future__ import annotations

import math

import pytest
import torch

from ft_launch.config import Config
from ft_launch.env import ENV_INJECT, ENV_KILL_AFTER, ENV_OBSERVER
from ft_launch.errors import UsageError
from ft_launch.launcher.worker.identity import WorkerIdentity
from ft_launch.launcher.worker.local import KillAfterCommit, kill_after_commit
from ft_launch.launcher.worker.observer import StepObserver, load_observer
from tests.faults import INJECTOR
from tests.faults.injector import SPIKE_SCALE


def identity(tmp_path, rank: int = 0) -> WorkerIdentity:
    return WorkerIdentity(job_id="j", replica_id=1, num_replicas=2, rank=rank, ranks=2,
                          host="127.0.0.1", run_dir=tmp_path, secret="s", node="n1")


def test_production_runs_the_no_op_observer(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_OBSERVER, raising=False)      # the tests set it (conftest)
    monkeypatch.delenv(ENV_INJECT, raising=False)
    observer = load_observer(Config(), identity(tmp_path))
    assert type(observer) is StepObserver
    assert observer.gradients(3) is None and observer.loss(3, 2.5) == 2.5
    for point in (observer.step_started, observer.mid_allreduce, observer.before_commit,
                  observer.after_commit):
        assert point(3) is None
    assert not (tmp_path / "faults").exists()


def test_faults_asked_for_with_no_observer_to_inject_them_are_refused(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_OBSERVER, raising=False)
    monkeypatch.setenv(ENV_INJECT, "kill@after_commit:3")
    with pytest.raises(UsageError, match=f"no step observer.*{ENV_OBSERVER}"):
        load_observer(Config(), identity(tmp_path))


def test_injected_faults_fire_through_the_seam(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_OBSERVER, str(INJECTOR))
    monkeypatch.setenv(ENV_INJECT, "raise@start_step:2/1,nan@gradients:4,spike@loss:5")
    assert load_observer(Config(), identity(tmp_path, rank=0)).gradients(4) is not None
    observer = load_observer(Config(), identity(tmp_path, rank=1))
    assert type(observer).__name__ == "FaultObserver"
    observer.step_started(1)
    with pytest.raises(RuntimeError, match="injected fault at start_step of step 2"):
        observer.step_started(2)
    assert (tmp_path / "faults" / "replica-1-rank-1" / "raise-start_step-2").exists()

    gradients = torch.ones(4)
    alter = observer.gradients(4)
    assert alter is not None
    alter(gradients)
    assert math.isnan(gradients[0]) and gradients[1:].eq(1).all()
    assert observer.gradients(4) is None            # once: the next reduction is left alone

    observer.step_started(5)
    spiked = torch.ones(2)
    alter = observer.gradients(5)
    assert alter is not None
    alter(spiked)
    assert spiked.eq(SPIKE_SCALE).all() and observer.loss(5, 2.0) == 2.0 * SPIKE_SCALE
    observer.step_started(6)
    assert observer.gradients(6) is None and observer.loss(6, 2.0) == 2.0


def test_a_module_observer_by_name(monkeypatch, tmp_path):
    """``ft-launch local --kill``'s: ``MODULE:NAME``, its step from the environment."""
    monkeypatch.delenv(ENV_INJECT, raising=False)
    for name, value in kill_after_commit(7).items():
        monkeypatch.setenv(name, value)
    observer = load_observer(Config(), identity(tmp_path))
    assert isinstance(observer, KillAfterCommit) and observer.step == 7
    observer.after_commit(6)                         # not its step: nothing happens
    monkeypatch.setenv(ENV_KILL_AFTER, "seven")
    with pytest.raises(UsageError, match="expected a step number"):
        load_observer(Config(), identity(tmp_path))


@pytest.mark.parametrize("spec, error", [
    ("/nowhere/observer.py", "cannot load /nowhere/observer.py"),
    ("ft_launch.no_such_module", "cannot load ft_launch.no_such_module"),
    ("ft_launch.launcher.worker.observer", "has no callable step_observer"),
    ("ft_launch.launcher.worker.observer:DEFAULT_FACTORY", "has no callable DEFAULT_FACTORY"),
    ("operator:is_", "made a bool, not a StepObserver"),
])
def test_a_bad_observer_is_a_usage_error(monkeypatch, tmp_path, spec, error):
    monkeypatch.delenv(ENV_INJECT, raising=False)
    monkeypatch.setenv(ENV_OBSERVER, spec)
    with pytest.raises(UsageError, match=error):
        load_observer(Config(), identity(tmp_path))
