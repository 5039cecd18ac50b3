"""A run directory's event logs read back: the controller's and each replica's
rank 0 commits, at once or as they are appended (``RunTail``, for the live view).

Lines of an event type this version does not know are skipped, not fatal: a run
written by a newer ft-launch still reads, less what is new.
"""

from __future__ import annotations

from pathlib import Path

from ft_launch.events import Event
from ft_launch.launcher.worker.events import StepCommitted

from ..controller import versions  # noqa: F401  (registers the code-version events)
from ..controller.events import EventTail

CONTROLLER_LOG = "controller.jsonl"


def replica_of(path: Path) -> int:
    """The replica of an ``events/replica-R-rank-K.jsonl`` file."""
    return int(path.name.split("-")[1])


class RunTail:
    """The new events of a run directory since the last ``read``: the controller
    log and rank 0 of every replica (files that appear later are picked up)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._control = EventTail(run_dir / CONTROLLER_LOG)
        self._ranks: dict[int, EventTail] = {}

    def read(self) -> tuple[list[Event], dict[int, list[StepCommitted]]]:
        for path in sorted((self.run_dir / "events").glob("replica-*-rank-0.jsonl")):
            self._ranks.setdefault(replica_of(path), EventTail(path))
        found = {replica_id: [e for e in tail.read() if isinstance(e, StepCommitted)]
                 for replica_id, tail in sorted(self._ranks.items())}
        return self._control.read(), found


def controller_log(run_dir: Path) -> list[Event]:
    return EventTail(run_dir / CONTROLLER_LOG).read()


def commits(run_dir: Path) -> dict[int, list[StepCommitted]]:
    """Rank 0's committed steps of every replica, oldest first."""
    return RunTail(run_dir).read()[1]
