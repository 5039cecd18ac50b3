"""The leader's feed: one publish per broadcast instead of one send per member.

A leader binds a ZeroMQ PUB socket (``QuorumNode`` does, when it takes office)
and names its address in every message it sends (``wire``). Each ``AgentLoop``
holds one SUB socket, ``FeedReader``, connected to the feeds that the agents it
hosts follow; it hands every message to each of those agents, which open it as
they open a unicast message (signature, sender, freshness, replay: each agent
has a replay guard for the feed apart from its socket's). A benchmark process
hosting hundreds of agents therefore takes one copy of a round's announcement,
and a replica's process one, as on a machine of its own.

Bounded: the PUB queues at most ``FEED_HWM`` messages per subscriber and drops
beyond (a member that misses an answer asks again, as after any lost message),
the SUB at most ``FEED_HWM`` too, and it refuses a frame larger than its
followers' largest legitimate message before buffering it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import zmq

log = logging.getLogger(__name__)

#: Messages queued per subscriber at the PUB, and at the SUB: a leader
#: publishes a heartbeat or two per interval and one or two announcements a round.
FEED_HWM = 64
_BATCH = 256
_NOBLOCK = int(zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
#: Frames of one feed message: the topic (the feed's address), data and MAC.
_FRAMES = 3


class Follower(Protocol):
    def on_published(self, frames: list[bytes], now: float, wall: float) -> None: ...


Guard = Callable[..., bool]


class FeedReader:
    """The SUB socket of one loop and who follows which feed (loop thread only)."""

    def __init__(self, context: zmq.Context[Any], run: Guard) -> None:
        #: Runs one follower's step so that a bug there spares the others.
        self._run = run
        self.socket: zmq.Socket[Any] = context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, FEED_HWM)
        self.socket.setsockopt(zmq.RECONNECT_IVL, 100)
        self.socket.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._max_bytes = 0
        self._followers: dict[bytes, dict[Follower, None]] = {}
        self.dropped = 0

    def follow(self, endpoint: str, follower: Follower, max_bytes: int) -> None:
        topic = endpoint.encode()
        followers = self._followers.get(topic)
        if followers is None:
            if max_bytes > self._max_bytes:  # applies to the connections made from now on
                self._max_bytes = max_bytes
                self.socket.setsockopt(zmq.MAXMSGSIZE, max_bytes)
            try:
                self.socket.connect(endpoint)
            except zmq.ZMQError as exc:  # a malformed endpoint: stay on unicast
                log.warning("cannot follow the quorum feed at %s: %s", endpoint, exc)
                return
            followers = self._followers[topic] = {}
        followers[follower] = None

    def unfollow(self, endpoint: str, follower: Follower) -> None:
        topic = endpoint.encode()
        followers = self._followers.get(topic)
        if followers is None:
            return
        followers.pop(follower, None)
        if followers:
            return
        del self._followers[topic]
        try:
            self.socket.disconnect(endpoint)
        except zmq.ZMQError:
            pass  # already gone

    # ------------------------------------------------------------------ Hosted
    def on_readable(self, now: float, wall: float) -> bool:
        sock = self.socket
        for _ in range(_BATCH):
            try:
                frames = [sock.recv(_NOBLOCK)]
            except zmq.Again:
                return False
            while sock.get(_RCVMORE):
                frames.append(sock.recv(_NOBLOCK))
            followers = self._followers.get(frames[0]) if len(frames) == _FRAMES else None
            if followers is None:
                self.dropped += 1  # a feed we just left, or not a feed message
            else:
                parts = frames[1:]
                for follower in list(followers):
                    self._run(follower, follower.on_published, parts, now, wall)
            if not int(sock.get(_EVENTS)) & _POLLIN:
                return False
        return True

    def on_timer(self, now: float) -> None:
        pass

    def deadline(self, now: float) -> float:
        return float("inf")

    def close(self) -> None:
        self.socket.close(linger=0)


def open_feed(context: zmq.Context[Any], host: str) -> tuple[zmq.Socket[Any], str]:
    """A leader's PUB socket, bound on ``host``, and its address."""
    sock = context.socket(zmq.PUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, FEED_HWM)
    # A subscriber never sends data; its subscription frames are a few bytes.
    sock.setsockopt(zmq.MAXMSGSIZE, 4096)
    sock.bind(f"tcp://{host}:*")
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)
