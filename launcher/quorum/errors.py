"""Errors a quorum member raises; the controller maps them (see each class)."""

from __future__ import annotations

from typing import Any

from ft_launch.errors import FatalError, RecoverableError


class QuorumTimeoutError(RecoverableError):
    """No quorum within the caller's timeout (election in progress, or too few
    members joined). Retry ``get_quorum``; the outstanding bid stays in place."""


class MajorityLostError(RecoverableError):
    """This member has had no leader and heard from fewer than a strict majority
    of the configured replicas for the majority window.

    Either this replica is cut off from the majority (the others go on; the
    controller restarts it as a behind replica) or the majority itself is gone
    (no member anywhere forms a quorum; the controller does a full in-allocation
    restart from the newest checkpoint). The controller tells the two apart by
    whether any other replica still reports ``QuorumFormed``.
    """

    def __init__(self, message: str, *, reachable: tuple[int, ...] = (),
                 configured: int = 0, **kwargs: Any) -> None:
        self.reachable = reachable
        self.configured = configured
        super().__init__(message, **kwargs)


class QuorumStoppedError(FatalError):
    """The quorum agent was stopped (or never started) while a caller used it."""
