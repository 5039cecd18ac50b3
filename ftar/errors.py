"""FTAR's errors, placed in the product's one hierarchy.

* ``PeerFailedError`` (recoverable): a neighbour died, went silent, closed or reset
  its connection, or never connected. The operation is abandoned, queued work is
  dropped, the ring is marked broken; the caller skips the step, reconfigures
  (usually with a new quorum) and retries.
* ``StaleQuorumError`` (recoverable): a peer is in a newer quorum than this member;
  this member must fetch the current quorum and reconfigure.
* ``AuthenticationError`` (fatal): this member and a peer do not share the job
  secret; a retry cannot fix a misconfigured secret.
* ``FtarUsageError`` (fatal): a local programming error or a disagreement between
  members that no retry fixes (dtype/size mismatch, unsupported dtype, a buffer
  that cannot be reduced in place, use before ``reconfigure``).
"""

from __future__ import annotations

import enum

from ft_launch.errors import FatalError, RecoverableError

FATAL_HINT = "fatal: retrying cannot help; fix the caller or the configuration"


class FailureKind(enum.Enum):
    """How a peer failed, as seen from this member."""

    TIMEOUT = "timed out"                   # silent peer: nothing within the timeout
    CLOSED = "closed the connection"       # the process died or aborted the operation
    RESET = "reset the connection"
    CONNECT_FAILED = "could not be connected"
    NOT_CONNECTED = "did not connect"
    ABORTED = "aborted the operation"       # a local error there (it reported it)
    LOST = "was reported lost by the quorum"  # silent to the quorum's heartbeats
    OUT_OF_STEP = "is in another all-reduce"  # a failure left the ring out of step

    @property
    def code(self) -> int:
        """Wire code in abort notices."""
        return list(FailureKind).index(self) + 1

    @staticmethod
    def from_code(code: int) -> FailureKind:
        kinds = list(FailureKind)
        return kinds[code - 1] if 1 <= code <= len(kinds) else FailureKind.ABORTED


class PeerFailedError(RecoverableError):
    """A ring neighbour failed; the operation was abandoned and the ring is broken."""

    def __init__(self, kind: FailureKind, *, peer_index: int, peer_address: str,
                 quorum_id: int | None, step: int | None = None, where: str = "",
                 detail: str = "") -> None:
        self.kind = kind
        self.peer_index = peer_index
        self.peer_address = peer_address
        self.where = where
        message = f"FTAR peer member {peer_index} ({peer_address}) {kind.value}"
        if where:
            message += f" during {where}"
        if detail:
            message += f": {detail}"
        super().__init__(
            message, quorum_id=quorum_id, step=step,
            hint="recoverable: skip this step, reconfigure the ring (new quorum) and retry")


class StaleQuorumError(RecoverableError):
    """A peer refused this member because it already belongs to a newer quorum."""

    def __init__(self, *, quorum_id: int, peer_quorum_id: int, peer_address: str) -> None:
        self.peer_quorum_id = peer_quorum_id
        self.peer_address = peer_address
        super().__init__(
            f"FTAR peer {peer_address} refused quorum {quorum_id}: it is in quorum "
            f"{peer_quorum_id}", quorum_id=quorum_id,
            hint="recoverable: fetch the current quorum and reconfigure")


class AuthenticationError(FatalError):
    """A handshake failed the job-secret check (either direction)."""

    def __init__(self, message: str, *, peer_address: str,
                 quorum_id: int | None = None) -> None:
        self.peer_address = peer_address
        super().__init__(f"FTAR handshake with {peer_address}: {message}",
                         quorum_id=quorum_id,
                         hint="fatal: every member of a job must use the same job secret")


class FtarUsageError(FatalError):
    """A local programming error or a member disagreement; never retried."""

    def __init__(self, message: str, *, quorum_id: int | None = None,
                 step: int | None = None) -> None:
        super().__init__(message, quorum_id=quorum_id, step=step, hint=FATAL_HINT)
