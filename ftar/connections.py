"""Building one member's ring connections for a quorum (the effectful control plane).

A ``Connector`` listens from construction, so a member's address can be published
before any quorum exists. For a quorum it connects ``sockets_per_peer`` sockets to
its right neighbour and waits for as many from its left neighbour. Connections
that arrive before this member has entered their quorum (a faster neighbour) are
*parked* and adopted when it does; connections from an older quorum are refused
in the handshake, and parked ones are dropped when a newer quorum is entered.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ft_launch.config import FtarConfig

from .errors import FailureKind, PeerFailedError
from .transport import Address, Hello, Listener, Purpose, Verdict, connect

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RingPosition:
    """This member's place in the ring of one quorum."""

    quorum_id: int
    members: tuple[Address, ...]
    index: int

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def left(self) -> int:
        return (self.index - 1) % self.size

    @property
    def right(self) -> int:
        return (self.index + 1) % self.size

    def address_of(self, member: int) -> str:
        host, port = self.members[member]
        return f"{host}:{port}"


ParkKey = tuple[int, int, int]  # (quorum id, from member, socket index)


class Connector:
    """Listener plus the connections waiting to be adopted by a ring."""

    def __init__(self, config: FtarConfig, secret: str, host: str,
                 on_member_lost: Callable[[int, int], None] = lambda quorum_id, member: None
                 ) -> None:
        self._config = config
        self._secret = secret
        self._on_member_lost = on_member_lost
        self._cv = threading.Condition()
        self._position: RingPosition | None = None
        self._parked: dict[ParkKey, socket.socket] = {}
        self._closed = False
        self._listener = Listener(host, secret, self._judge, self._deliver,
                                  config.connect_timeout)

    @property
    def address(self) -> Address:
        return self._listener.address

    @property
    def refused(self) -> int:
        return self._listener.refused

    def _judge(self, hello: Hello) -> tuple[Verdict, int]:
        config = self._config
        with self._cv:
            position = self._position
            current = position.quorum_id if position else 0
            if self._closed:
                return Verdict.CLOSING, current
            if hello.purpose is Purpose.MEMBER_LOST:
                # Only about the ring this member is in: an older one is gone anyway.
                return (Verdict.ACCEPTED if position and hello.quorum_id == current
                        else Verdict.STALE_QUORUM), current
            if (hello.chunk_bytes, hello.chunks_in_flight, hello.sockets) != (
                    config.chunk_bytes, config.chunks_in_flight, config.sockets_per_peer):
                return Verdict.CONFIG_MISMATCH, current
            if position is None or hello.quorum_id > current:
                return Verdict.ACCEPTED, current  # a quorum this member has not entered yet
            if hello.quorum_id < current:
                return Verdict.STALE_QUORUM, current
            if (hello.to_index, hello.from_index) != (position.index, position.left):
                return Verdict.UNEXPECTED, current
            return Verdict.ACCEPTED, current

    def _deliver(self, hello: Hello, sock: socket.socket) -> None:
        if hello.purpose is Purpose.MEMBER_LOST:
            sock.close()
            self._on_member_lost(hello.quorum_id, hello.to_index)
            return
        key = (hello.quorum_id, hello.from_index, hello.socket_index)
        with self._cv:
            position = self._position
            if self._closed or (position is not None and hello.quorum_id < position.quorum_id):
                sock.close()  # a newer quorum was entered during the handshake
                return
            previous = self._parked.pop(key, None)
            if previous is not None:
                previous.close()  # the peer reconnected (a retried reconfigure): newest wins
            self._parked[key] = sock
            self._cv.notify_all()

    def enter(self, position: RingPosition) -> None:
        """Make ``position`` current: older connections are refused and dropped."""
        with self._cv:
            self._position = position
            for key in [k for k in self._parked if k[0] < position.quorum_id]:
                self._parked.pop(key).close()

    def connect_ring(self, position: RingPosition) -> tuple[list[socket.socket],
                                                            list[socket.socket]]:
        """Sockets to the right neighbour and from the left one, within connect_timeout."""
        config = self._config
        deadline = time.monotonic() + config.connect_timeout
        outgoing: list[socket.socket] = []
        try:
            for index in range(config.sockets_per_peer):
                hello = Hello(position.quorum_id, position.index, position.right, index,
                              config.sockets_per_peer, config.chunk_bytes,
                              config.chunks_in_flight)
                remaining = max(deadline - time.monotonic(), 0.001)
                try:
                    outgoing.append(connect(position.members[position.right], self._secret,
                                            hello, remaining))
                except OSError as exc:
                    raise self._not_reached(position, position.right,
                                            FailureKind.CONNECT_FAILED, str(exc)) from exc
            incoming = self._adopt(position, deadline)
        except BaseException:
            for sock in outgoing:
                sock.close()
            raise
        return outgoing, incoming

    def _adopt(self, position: RingPosition, deadline: float) -> list[socket.socket]:
        keys = [(position.quorum_id, position.left, index)
                for index in range(self._config.sockets_per_peer)]
        with self._cv:
            arrived = self._cv.wait_for(lambda: all(k in self._parked for k in keys),
                                        timeout=max(deadline - time.monotonic(), 0.0))
            if not arrived:
                raise self._not_reached(
                    position, position.left, FailureKind.NOT_CONNECTED,
                    f"no connection within connect_timeout={self._config.connect_timeout:g} s")
            return [self._parked.pop(k) for k in keys]

    @staticmethod
    def _not_reached(position: RingPosition, member: int, kind: FailureKind,
                     detail: str) -> PeerFailedError:
        return PeerFailedError(kind, peer_index=member,
                               peer_address=position.address_of(member),
                               quorum_id=position.quorum_id, where="reconfigure",
                               detail=detail)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            parked, self._parked = self._parked, {}
        for sock in parked.values():
            sock.close()
        self._listener.close()
