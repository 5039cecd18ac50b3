"""Real-time inspection: per node, the cheap profile every few seconds, each
report streamed (signed) to the controller; and ``node_alarm``, the pure
decision the controller takes on a report.

The agent keeps one GPU backend open for its lifetime (so NVML XID events
registered at start are seen), and re-reads simulated faults every round.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from ft_launch.env import ENV_SECRET
from ft_launch.logs import configure_logging

from .channel import Sender
from .gpu_facts import GpuBackend
from .profile import ProfileReport, run_profile
from .result import CheckStatus
from .settings import ENV_CONFIG, HealthSettings, load_settings
from .wire import Envelope, MessageKind, new_sender_id

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeAlarm:
    """Evict ``node``: the inspection found ``reason`` (the drain reason)."""

    node: str
    check: str
    reason: str


def node_alarm(report: ProfileReport) -> NodeAlarm | None:
    failure = report.failure
    return None if failure is None else NodeAlarm(report.node, failure.name, failure.reason)


def report_from(envelope: Envelope) -> ProfileReport | None:
    if envelope.kind is not MessageKind.REPORT:
        return None
    return ProfileReport.from_dict(envelope.body)


class InspectionAgent:
    """Runs ``profile`` every ``interval`` seconds on ``node`` and sends each report."""

    def __init__(self, settings: HealthSettings, node: str, endpoint: str, secret: str, *,
                 interval: float = 5.0, profile: str = "inspection",
                 backend: GpuBackend | None = None) -> None:
        self.settings = settings
        self.node = node
        self.interval = interval
        self.profile = settings.profile(profile)
        self.backend = backend or settings.gpu_backend(node, watch_events=True)
        self.sender = Sender(endpoint, secret, new_sender_id(f"agent:{node}"))
        self.rounds = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def run_once(self) -> ProfileReport:
        report = run_profile(self.profile, self.settings.context(self.node, backend=self.backend))
        self.sender.send(MessageKind.REPORT, report.to_dict())
        self.rounds += 1
        if report.status is not CheckStatus.PASS:
            log.warning("inspection on %s: %s", self.node,
                        "; ".join(r.reason for r in report.results if r.status is not
                                  CheckStatus.PASS))
        return report

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_once()
            except Exception:  # the agent outlives one bad round; the next may work
                log.exception("inspection round failed on %s", self.node)
            self._stop.wait(self.interval)  # the inspection period (stop() ends it at once)

    def start(self) -> InspectionAgent:
        self._thread = threading.Thread(target=self._loop, name=f"inspection-{self.node}",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.sender.close()
        self.backend.close()


SECRET_ENV = ENV_SECRET


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ft_launch.health.inspection --endpoint tcp://HOST:PORT``: one agent per node,
    until SIGTERM. The job secret comes from the environment, never the command line
    (which every user of the node can read)."""
    parser = argparse.ArgumentParser(prog="python -m ft_launch.health.inspection",
                                     description="Per-node inspection agent.")
    parser.add_argument("--endpoint", required=True, help="the controller's collector")
    parser.add_argument("--node", default=os.environ.get("SLURMD_NODENAME", ""))
    parser.add_argument("--interval", type=float, default=5.0)
    parser.add_argument("--profile", default="inspection")
    parser.add_argument("--config", help=f"admin health config (default: ${ENV_CONFIG})")
    parser.add_argument("--secret-env", default=SECRET_ENV,
                        help="environment variable holding the job secret")
    args = parser.parse_args(argv)
    configure_logging("INFO")
    secret = os.environ.get(args.secret_env, "")
    if not secret:
        parser.error(f"${args.secret_env} is not set")
    node = args.node or os.uname().nodename.split(".")[0]
    agent = InspectionAgent(load_settings(args.config), node, args.endpoint, secret,
                            interval=args.interval, profile=args.profile)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    agent.start()
    while not stopping.wait(1.0):  # woken by the signal handler; the timeout is a safety net
        pass
    agent.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
