"""What a worker knows of the run's rollbacks (pure): which states it may restore,
which peers it may train with.

When the loss spikes the controller rolls every replica back
(``ft_launch.launcher.controller.rollback``): it restarts them all with
``FTL_WORKER_ROLLBACKS`` naming the spiking step of every rollback so far, in order
(``"120,415"``: rolled back twice, first to before step 120). The count is this
worker's *history*: 0 for a run never rolled back.

Every state a worker saves (snapshot, backup, checkpoint) records its history in its
loader state, and so does every audit line and every commit. Then:

* a state of history ``h`` and step ``s`` may be restored only if no rollback since
  ``h`` went back to or before ``s``: ``s < bound`` for each bound after the first
  ``h`` ones. So the relaunched replicas take the newest state from before the spike
  (the peer backups that the node's tmpfs kept, else the persistent tier), and a
  copy of a rolled-back step, left in a tmpfs or on disk, is never restored later;
* replicas of different histories never form a ring (``protocol.plan_step``): a
  replica restarted by the rollback would otherwise catch up from a not yet
  cancelled process of the old history, and take the spike back.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ft_launch.env import ENV_ROLLBACKS
from ft_launch.errors import UsageError

#: the key of a state's history in its loader state
HISTORY_KEY = "history"


@dataclass(frozen=True)
class Rollbacks:
    """The run's rollbacks: each one's spiking step, in order."""

    before: tuple[int, ...] = ()

    @property
    def history(self) -> int:
        return len(self.before)

    @staticmethod
    def parse(text: str) -> Rollbacks:
        try:
            before = tuple(int(item) for item in text.split(",") if item.strip())
        except ValueError:
            raise UsageError(f"bad {ENV_ROLLBACKS} {text!r}",
                             hint="comma-separated step numbers; set by ft-launch run") from None
        if any(step < 0 for step in before):
            raise UsageError(f"bad {ENV_ROLLBACKS} {text!r}: a step below 0")
        return Rollbacks(before)

    @staticmethod
    def from_env(env: Mapping[str, str] | None = None) -> Rollbacks:
        return Rollbacks.parse((os.environ if env is None else env).get(ENV_ROLLBACKS, ""))

    def to_env(self) -> str:
        return ",".join(str(step) for step in self.before)

    def restorable(self, step: int, history: int) -> bool:
        """May a state of ``step``, saved in history ``history``, be restored now?"""
        return 0 <= history <= self.history and all(step < bound
                                                    for bound in self.before[history:])


def history_of(meta: Mapping[str, Any]) -> int:
    """The history a state was saved in, from its manifest's meta: the loader state
    rides there (``ft_launch.ckpt.torch_state``); a state saved before rollbacks existed is of
    history 0."""
    loader = meta.get("loader_state")
    value = loader.get(HISTORY_KEY, 0) if isinstance(loader, Mapping) else 0
    return value if isinstance(value, int) else -1
