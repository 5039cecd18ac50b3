"""The Slurm CLI backend against the real cluster: node state, reservations, steps."""

from __future__ import annotations

import pytest

from ft_launch.errors import SlurmCommandError
from ft_launch.slurm.client import SlurmCli
from ft_launch.slurm.states import NodeState

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(120)]


def test_drain_with_reason_then_resume(slurm_cluster):
    slurm = slurm_cluster.slurm
    node = slurm_cluster.nodes[-1]
    reason = "ft-launch: test gpu3 xid 79"
    slurm.set_node_state(node, "drain", reason)
    try:
        (info,) = slurm.nodes((node,))
        assert info.drained and info.reason.startswith(reason)
    finally:
        slurm.set_node_state(node, "resume")
    (info,) = slurm.nodes((node,))
    assert not info.drained and info.state is NodeState.IDLE


def test_reservation_create_grow_delete(slurm_cluster):
    slurm = slurm_cluster.slurm
    a, b = slurm_cluster.nodes[-2:]
    slurm.create_reservation("ftl-test-pool", (a,), 10, ("root",), ("IGNORE_JOBS",))
    try:
        assert slurm.reservation("ftl-test-pool").nodes == (a,)
        slurm.update_reservation("ftl-test-pool", (a, b))
        assert slurm.reservation("ftl-test-pool").nodes == (a, b)
    finally:
        slurm.delete_reservation("ftl-test-pool")
    assert slurm.reservation("ftl-test-pool") is None


def test_failures_are_recoverable_errors_with_the_command(slurm_cluster):
    with pytest.raises(SlurmCommandError, match="scontrol update nodename=no-such-node"):
        slurm_cluster.slurm.set_node_state("no-such-node", "drain", "x")


def test_a_salloc_that_times_out_in_the_queue_leaves_no_job_behind(slurm_cluster):
    """Killed while its request waits, salloc cannot withdraw it: the job would take
    the node later for nobody (seen after a slurmctld stall). The client cancels it."""
    node = slurm_cluster.nodes[-1]
    slurm = slurm_cluster.slurm
    holder = slurm.allocate(1, name="ftl-test-holder", nodelist=(node,), immediate_s=30)
    impatient = SlurmCli(command_timeout=3, env=slurm.env, prefix=slurm.prefix)
    try:
        with pytest.raises(SlurmCommandError, match="did not answer within 3 s"):
            impatient.allocate(1, name="ftl-test-queued", nodelist=(node,))
        queue = slurm.run(["squeue", "-h", "-o", "%j %T"]).split("\n")
        assert not [line for line in queue if line.startswith("ftl-test-queued")
                    and line.split()[-1] in ("PENDING", "RUNNING")], queue
    finally:
        slurm.cancel_job(holder)
