"""Two replicas on the real cluster, with the controller as the default witness.

Two replicas alone are no majority of two when one dies; with the controller's
witness votes the survivor trains on. Both placements of the controller:

* ``ft-launch submit``: the controller on the login node, whose hostname resolves
  to loopback; its witness listens at the source of its route to the nodes. No
  standby: a replica's node dies, the survivor trains on alone, without a pause
  longer than the configured detection allows, to the last step;
* ``sbatch``: the controller on the batch host (the standby). The killed replica's
  node is replaced, the newcomer catches up and rejoins, and both end identical.

Every sample is trained exactly once in both.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ft_launch.config import Config, load_config
from ft_launch.launcher.controller import events as controller_events
from ft_launch.launcher.quorum.reach import is_loopback
from ft_launch.launcher.reporting.runlog import commits
from ft_launch.launcher.worker.audit import check_exactly_once
from tests.cluster import labcluster
from tests.slurm import test_run
from tests.slurm.login import submitted, wait_controller
from tests.slurm.test_run import REPO, Training, crash
from tests.worker.harness import max_gap, stall_bound

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(400)]

#: the fixture that submits the example with sbatch, then cancels it and heals the nodes
training = test_run.training

STEPS = 400


def run_config(run: Training) -> Config:
    """The config the run resolved (``RUN_DIR/config.toml``), whatever set it."""
    return load_config(run.run_dir / "config.toml", env={})


def detection(config: Config) -> float:
    """What the config allows a survivor to take to go on alone: the quorum notices
    the silence (member timeout), a new leader is elected if the dead one led (the
    election timeout, twice for the random spread), a join window, and the ring
    gives up connecting to the dead peer."""
    q = config.quorum
    return (q.member_timeout + 2 * q.election_timeout + q.join_timeout
            + config.ftar.connect_timeout)


def assert_witness_voted(run: Training, address: str | None = None) -> None:
    (chosen,) = run.events(controller_events.ControllerWitnessChosen)
    assert chosen.voting and not is_loopback(chosen.address), chosen
    assert address is None or chosen.address == address, chosen
    status = subprocess.run([sys.executable, "-m", "ft_launch.launcher.cli", "status",
                             str(run.run_dir)], check=False, cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert f"controller witness: votes at {chosen.address}" in status.stdout, status


def assert_survivor_kept_stepping(run: Training, survivor: int) -> None:
    mine = commits(run.run_dir)[survivor]
    gap, bound = max_gap(mine), stall_bound(detection(run_config(run)), mine)
    assert gap < bound, f"the survivor stalled {gap:.1f} s (bound {bound:.1f} s)"


def test_two_replicas_without_standby_the_survivor_trains_on_alone(slurm_cluster, tmp_path):
    with submitted(slurm_cluster, tmp_path, replicas=2, standby=0, steps=STEPS) as (run, pid):
        run.wait_training(40)
        # the login node's address on the nodes' network, not its hostname's (loopback)
        assert_witness_voted(run, f"{labcluster.subnet()}.1")
        victim = run.replica_nodes()[1]
        crash(victim)
        run.end_early()
        wait_controller(run, pid, 300)
    (finished,) = run.events(controller_events.RunFinished)
    assert finished.exit_code == 0, finished
    (fault,) = run.events(controller_events.NodeFaultDetected)
    assert fault.node == victim and fault.replica_id == 1, fault
    assert not run.events(controller_events.StandbyPromoted)
    by_replica = commits(run.run_dir)
    survivor, dead_last = by_replica[0], max(e.step for e in by_replica[1])
    assert survivor[-1].step == run.steps - 1
    # after the step the dead replica may have contributed to, the survivor trained alone
    alone = [e for e in survivor if e.step > dead_last + 1]
    assert alone and all(e.contributors == 1 for e in alone), \
        sorted({e.contributors for e in alone})
    assert_survivor_kept_stepping(run, 0)
    audit = check_exactly_once(run.run_dir, 2, run.steps)
    finals = [json.loads(p.read_text()) for p in (run.run_dir / "final").glob("*.json")]
    assert len(finals) == 1 and finals[0]["positions"] == list(audit.positions), finals


def test_two_replicas_and_a_standby_the_replacement_catches_up_and_rejoins(training):
    run = training(replicas=2, standby=1, steps=250)   # paced: test_run.PACE_S
    run.wait_training(40)
    assert_witness_voted(run)
    (victim,) = run.victims(1)
    victim_replica = next(r for r, n in run.replica_nodes().items() if n == victim)
    survivor = 1 - victim_replica
    step_at_kill = run.last_step(survivor)
    crash(victim)
    (promoted,) = run.wait_promoted(1)
    assert promoted.replica_id == victim_replica and promoted.node != victim
    summary = run.finish()       # completed, identical finals, every sample once
    assert summary["promotions"] == 1 and summary["nodes_drained"] == [victim]
    by_replica = commits(run.run_dir)
    rejoined = [e for e in by_replica[victim_replica] if e.caught_up]
    assert rejoined and rejoined[0].step > step_at_kill
    # until the newcomer was back, the survivor trained alone
    between = [e for e in by_replica[survivor] if step_at_kill + 1 < e.step < rejoined[0].step]
    assert any(e.contributors == 1 for e in between), [(e.step, e.contributors)
                                                      for e in between]
    assert_survivor_kept_stepping(run, survivor)
