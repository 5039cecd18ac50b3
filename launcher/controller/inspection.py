"""Real-time inspection during a run: one ``python -m ft_launch.health.inspection`` step per
node (``srun --overlap`` beside the replica or standby agent, so a hung or crashed
training process does not silence it), each streaming signed reports of the
``inspection`` profile to a collector in the controller. A failed report is an
alarm: the controller evicts the node (design.md: "inspection alarm on a node ->
evict, promote a standby").
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

from ft_launch.config import HealthConfig
from ft_launch.health.channel import Collector
from ft_launch.health.inspection import node_alarm, report_from
from ft_launch.slurm.client import SlurmBackend, cancel_named_step, launch_logged
from ft_launch.slurm.commands import StepSpec

from ..worker.identity import node_address

log = logging.getLogger(__name__)


class NodeInspection:
    """The collector and the per-node inspection steps of one run."""

    def __init__(self, config: HealthConfig, slurm: SlurmBackend, secret: str,
                 env: dict[str, str], logs: Path, extra_args: tuple[str, ...] = (),
                 host: str | None = None) -> None:
        self.config = config
        self.slurm = slurm
        self.env = env
        self.logs = logs
        self.extra_args = extra_args
        # The nodes' steps connect here: ``host`` is the controller's route's source
        # address towards them (a host name may resolve to loopback on a login node).
        self.collector = Collector(secret, bind=f"tcp://{host or node_address()}:0")
        self.steps: dict[str, tuple[str | None, subprocess.Popen[bytes]]] = {}
        self.alarmed: set[str] = set()

    def watch(self, node: str, job_id: str | None) -> None:
        """Start the node's inspection step (once per node and job)."""
        if node in self.steps:
            return
        command = (sys.executable, "-m", "ft_launch.health.inspection", "--endpoint",
                   self.collector.endpoint, "--node", node,
                   "--interval", str(self.config.inspection_interval))
        spec = StepSpec(nodes=(node,), command=command, name=f"inspect-{node}",
                        job_id=job_id, overlap=True, kill_on_bad_exit=False,
                        extra_args=self.extra_args)
        self.steps[node] = (job_id, launch_logged(self.slurm, spec,
                                                  self.logs / f"inspect-{node}", self.env))

    def unwatch(self, node: str) -> None:
        found = self.steps.pop(node, None)
        if found is None:
            return
        job_id, proc = found
        cancel_named_step(self.slurm, job_id or "", f"inspect-{node}", proc)

    @property
    def rejected_messages(self) -> dict[str, int]:
        """Health messages dropped so far, by reason (``ft_launch.health.wire.Rejection``)."""
        return dict(self.collector.rejections)

    def alarms(self) -> list[tuple[str, str]]:
        """(node, reason) for each node whose newest report failed, once per node.

        Never raises on what peers send: the collector hands over only verified
        envelopes whose every field ``ft_launch.health.wire.decode`` checked, and counts
        the rest in ``rejected_messages``."""
        found: list[tuple[str, str]] = []
        for envelope in self.collector.poll(0):
            report = report_from(envelope)
            alarm = node_alarm(report) if report is not None else None
            if alarm is not None and alarm.node in self.steps and alarm.node not in self.alarmed:
                self.alarmed.add(alarm.node)
                found.append((alarm.node, f"inspection: {alarm.reason}"))
        return found

    def close(self) -> None:
        for node in list(self.steps):
            self.unwatch(node)
        self.collector.close()
