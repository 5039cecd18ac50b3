"""The effectful half of one quorum agent: its sockets, peers and counters.

Every method except the snapshots (``status``, ``stats``) runs on the thread of
the ``AgentLoop`` hosting the node. The node turns socket input into core
events, runs ``decide``, and performs the actions: one ROUTER socket receives
everything; a DEALER per peer, opened on first use, sends.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from ftcore.errors import FatalError
from ftcore.events import Event
from ftcore.logs import log_sampled

from . import events as ev
from .core import decide, initial_state, next_deadline
from .directory import PeerDirectory, PeerRecord
from .errors import MajorityLostError
from .model import Health, Quorum, QuorumParams, Role
from .state import (
    Action,
    CommitFailureReported,
    DeliverQuorum,
    FailQuorumRequest,
    Input,
    LeadershipTransferRequested,
    MessageReceived,
    MessagesReceived,
    NotifyLeaderElected,
    NotifyLeadershipLost,
    NotifyLivenessChanged,
    NotifyMajorityLost,
    NotifyMajorityRegained,
    NotifyQuorumFormed,
    QuorumRequested,
    QuorumState,
    Send,
    TimerFired,
)
from .wire import (
    BROADCAST,
    MAX_ADDRESS_BYTES,
    Codec,
    Envelope,
    Rejected,
    Rejection,
    ReplayGuard,
    max_message_bytes,
)

if TYPE_CHECKING:
    from .loop import AgentLoop

log = logging.getLogger(__name__)

_BATCH = 256
_ZERO_COPY_BYTES = 16384
_NOBLOCK = int(zmq.NOBLOCK)
_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_RCVMORE = int(zmq.RCVMORE)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
#: Messages ZeroMQ queues per connection before it stops reading from it (the
#: backlog then waits in the sender's queue, which drops when full): a peer
#: sends one or two messages per heartbeat and the loop drains the socket each
#: wake-up, and one connection can make the ROUTER hold at most this many
#: frames of ``max_message_bytes``.
_RECV_HWM = 8
#: A DEALER only sends; what a peer sends back to it is never read.
_DEALER_MAX_RECEIVE = 4096
_COUNTERS = ("sent", "received", "dropped_unreachable", "dropped_full", "dropped_by_fault",
             "dropped_oversize", *(f"rejected_{r.value}" for r in Rejection))

Answer = Callable[[Quorum | BaseException], None]


@dataclass(frozen=True)
class QuorumStats:
    """Message counters of one agent since it started."""

    counts: dict[str, int]

    @property
    def unauthenticated(self) -> int:
        return sum(self.counts[f"rejected_{r.value}"] for r in
                   (Rejection.BAD_SIGNATURE, Rejection.MALFORMED, Rejection.UNKNOWN_SENDER))

    @property
    def replayed(self) -> int:
        return sum(self.counts[f"rejected_{r.value}"] for r in
                   (Rejection.REPLAYED, Rejection.EXPIRED, Rejection.NOT_FOR_ME))

    def __getitem__(self, name: str) -> int:
        return self.counts[name]


@dataclass(frozen=True)
class QuorumStatus:
    """A snapshot of one agent's view, for the status display and tests."""

    replica_id: int
    role: Role
    term: int
    leader_id: int | None
    majority_lost: bool
    live: tuple[int, ...]
    round_joined: tuple[int, ...]
    last_quorum_id: int

    @classmethod
    def of(cls, state: QuorumState) -> QuorumStatus:
        lead = state.leadership
        joined = tuple(sorted(lead.round.joins)) if lead.round is not None else ()
        last = state.member.last_quorum
        return cls(state.me, state.role, state.term, state.leader_id,
                   state.election.majority_lost, tuple(sorted(lead.live)), joined,
                   last.quorum_id if last is not None else 0)


class QuorumNode:
    def __init__(self, *, replica_id: int, replica_ids: Iterable[int],
                 directory: PeerDirectory, codec: Codec, params: QuorumParams, host: str,
                 port: int, incarnation: int, seed: int, on_answer: Answer,
                 max_age: float, electable: bool = True) -> None:
        self.replica_id = replica_id
        self.voters = frozenset(replica_ids) | {replica_id}
        self.directory = directory
        self.codec = codec
        self.params = params
        self.host = host
        self.port = port
        self.incarnation = incarnation
        self.seed = seed
        self.electable = electable
        self.on_answer = on_answer
        #: Set by the agent once someone listens; building events costs O(members).
        self.emit: Callable[[Event], None] | None = None
        self.blocked: frozenset[int] = frozenset()
        self.address = ""
        self.socket: zmq.Socket[Any] = None  # type: ignore[assignment]
        self.state: QuorumState | None = None
        self._guard = ReplayGuard(replica_id, max_age)
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._nonce = 0
        self._peers: dict[int, PeerRecord] = {}
        self._dealers: dict[int, zmq.Socket[Any]] = {}
        self._looked_up: dict[int, float] = {}
        self._refresh_interval = max(params.heartbeat_interval, params.member_timeout / 3)
        # A DEALER per peer costs file descriptors: a member that once ran an
        # election must not keep one to every peer for ever.
        self._idle_timeout = max(10.0, 3 * params.member_timeout)
        self._used_at: dict[int, float] = {}
        self._sweep_at = math.inf
        self._loop: AgentLoop | None = None
        self.max_message_bytes = max_message_bytes(len(self.voters))

    def __repr__(self) -> str:
        return f"QuorumNode(replica {self.replica_id} at {self.address or 'unbound'})"

    # ------------------------------------------------------------------ snapshots
    def status(self) -> QuorumStatus:
        state = self.state
        if state is None:
            raise RuntimeError("the agent has not started")
        return QuorumStatus.of(state)

    def stats(self) -> QuorumStats:
        return QuorumStats(dict(self._counts))

    # ------------------------------------------------------------------ lifecycle
    def bind(self, loop: AgentLoop) -> None:
        """Bind and publish the address; messages queue until ``begin``."""
        sock = loop.context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # Bounds what an unauthenticated peer can make this process buffer: a
        # larger frame ends its connection before the MAC is ever checked.
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        sock.setsockopt(zmq.RCVHWM, _RECV_HWM)
        sock.bind(f"tcp://{self.host}:{self.port or '*'}")
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.socket = sock
        self._loop = loop
        self.directory.publish(PeerRecord(self.replica_id, self.address, self.incarnation))

    def begin(self) -> None:
        """Start taking part: arm the election timer and read the socket."""
        assert self._loop is not None
        now = time.monotonic()
        self.state = initial_state(self.replica_id, self.voters, self.params, now,
                                   seed=self.seed, join_seq_base=self.incarnation,
                                   electable=self.electable)
        self._sweep_at = now + self._idle_timeout
        self._loop.add(self)

    def close(self) -> None:
        if self._loop is not None:
            self._loop.remove(self)
        for sock in self._dealers.values():
            sock.close(linger=0)
        self._dealers.clear()
        if self.socket is not None:
            self.socket.close(linger=0)

    # ------------------------------------------------------------------ inputs
    def request(self, next_step: int, address: str, health: Health) -> None:
        size = len(address.encode())
        if size > MAX_ADDRESS_BYTES:  # every receiver would drop the announcements
            self.on_answer(FatalError(
                f"replica {self.replica_id} advertises a quorum address of {size} bytes; "
                f"the quorum carries at most {MAX_ADDRESS_BYTES} per member",
                hint="fewer ranks per replica, or raise quorum.wire.MAX_ADDRESS_BYTES "
                     "on every replica", replica_id=self.replica_id, step=next_step))
            return
        self.feed(QuorumRequested(next_step, address, health), time.monotonic())

    def report_commit_failure(self) -> None:
        self.feed(CommitFailureReported(), time.monotonic())

    def transfer_leadership(self, target: int) -> None:
        self.feed(LeadershipTransferRequested(target), time.monotonic())

    def on_timer(self, now: float) -> None:
        self.feed(TimerFired(), now)

    def deadline(self, now: float) -> float:
        return next_deadline(self.state, now) if self.state is not None else math.inf

    def on_readable(self, now: float, wall: float) -> bool:
        """Take up to a batch of messages; True if more may be waiting. The
        batch goes to the core as one event (a leader takes 1,000 joins a round)."""
        sock = self.socket
        batch: list[MessageReceived] = []
        more = True
        for _ in range(_BATCH):
            try:
                frames = [sock.recv(_NOBLOCK)]
            except zmq.Again:
                more = False
                break
            while sock.get(_RCVMORE):  # what recv_multipart does, without its enum costs
                frames.append(sock.recv(_NOBLOCK))
            received = self._receive(frames[1:], wall)
            if received is not None:
                batch.append(received)
            if not int(sock.get(_EVENTS)) & _POLLIN:
                # Empty now: asking is cheaper than the raised ``zmq.Again`` of
                # one more recv (a follower reads one message per wake-up).
                more = False
                break
        if len(batch) == 1:
            self.feed(batch[0], now)
        elif batch:
            self.feed(MessagesReceived(tuple(batch)), now)
        return more

    def _receive(self, frames: list[bytes], wall: float) -> MessageReceived | None:
        try:
            envelope = self.codec.open(frames)
            if envelope.sender not in self.voters or envelope.sender == self.replica_id:
                raise Rejected(Rejection.UNKNOWN_SENDER, str(envelope.sender))
            if envelope.sender in self.blocked:
                self._counts["dropped_by_fault"] += 1
                return None
            self._guard.check(envelope, wall)
        except Rejected as exc:
            self._reject(exc)
            return None
        self._counts["received"] += 1
        self._learn(envelope)
        return MessageReceived(envelope.sender, envelope.message)

    def _reject(self, exc: Rejected) -> None:
        name = f"rejected_{exc.reason.value}"
        self._counts[name] += 1
        log_sampled(log, self._counts[name], "replica %d dropped a quorum message (%s)",
                    self.replica_id, exc)

    def feed(self, event: Input, now: float) -> None:
        assert self.state is not None
        self.state, actions = decide(self.state, event, now)
        for action in actions:
            self._perform(action, now)
        if now >= self._sweep_at:
            self._close_idle_dealers(now)
        if self._loop is not None:
            self._loop.schedule(self, next_deadline(self.state, now))

    # ------------------------------------------------------------------ actions
    def _perform(self, action: Action, now: float) -> None:
        if isinstance(action, Send):
            self._send(action, now)
            return
        if isinstance(action, DeliverQuorum):
            self.on_answer(action.quorum)
        elif isinstance(action, FailQuorumRequest):
            self.on_answer(MajorityLostError(
                f"no leader, and only replicas {list(action.reachable)} of "
                f"{len(self.voters)} reachable: a majority needs {len(self.voters) // 2 + 1}",
                hint="if other replicas still form quorums this one is cut off and "
                     "should restart behind; otherwise restart the whole job in place",
                reachable=action.reachable, configured=len(self.voters),
                replica_id=self.replica_id))
        self._notify(action)

    def _notify(self, action: Action) -> None:
        """Log what a person should know and hand events to listeners."""
        me = self.replica_id
        event: Event | None = None
        if isinstance(action, NotifyLeaderElected):
            log.info("replica %d: leader is %d (term %d)", me, action.leader_id, action.term)
            event = ev.LeaderElected(me, action.leader_id, action.term)
        elif isinstance(action, NotifyLeadershipLost):
            # Routine after a hand-over; the majority-lost case logs an error below.
            log.info("replica %d: no longer leader (term %d): %s", me, action.term,
                     action.reason)
            event = ev.LeadershipLost(me, action.term, action.reason)
        elif isinstance(action, NotifyMajorityLost):
            log.error("replica %d: majority lost, reachable %s of %d", me,
                      list(action.reachable), len(self.voters))
            event = ev.MajorityLost(me, list(action.reachable), len(self.voters))
        elif isinstance(action, NotifyMajorityRegained):
            event = ev.MajorityRegained(me, action.leader_id)
        elif isinstance(action, NotifyLivenessChanged):
            log.info("replica %d: members lost %s, recovered %s", me, list(action.lost),
                     list(action.recovered))
            event = ev.MembersLivenessChanged(me, list(action.lost), list(action.recovered))
        emit = self.emit
        if emit is None:
            return
        if isinstance(action, NotifyQuorumFormed):
            event = ev.QuorumFormed.of(me, action.quorum, action.window)
        elif isinstance(action, DeliverQuorum):
            q = action.quorum
            event = ev.QuorumJoined(me, q.quorum_id, list(q.replica_ids), q.max_step,
                                    list(q.behind))
        if event is not None:
            emit(event)

    def _send(self, action: Send, now: float) -> None:
        self._nonce += 1
        to = action.to[0] if len(action.to) == 1 else BROADCAST
        data, mac = self.codec.seal(self.replica_id, to, self.incarnation, self._nonce,
                                    time.time(), self.address, action.message)
        if len(data) > self.max_message_bytes:  # receivers would drop the connection
            self._counts["dropped_oversize"] += 1
            log_sampled(log, self._counts["dropped_oversize"], "replica %d cannot send a "
                        "quorum message of %d bytes: receivers accept at most %d",
                        self.replica_id, len(data), self.max_message_bytes,
                        level=logging.ERROR)
            return
        # A large broadcast is wrapped once and sent to everyone without
        # copying; small messages are cheaper copied (pyzmq's zero-copy path
        # costs more than a short memcpy). Plain ``send`` with int flags: the
        # enum arithmetic of ``send_multipart`` cost 5 us a peer.
        zero_copy = len(data) >= _ZERO_COPY_BYTES
        first: Any = zmq.Frame(data) if zero_copy else data
        blocked, counts = self.blocked, self._counts
        for peer in action.to:
            if peer in blocked:
                counts["dropped_by_fault"] += 1
                continue
            sock = self._dealer(peer, now)
            if sock is None:
                counts["dropped_unreachable"] += 1
                continue
            try:
                sock.send(first, _MORE, copy=not zero_copy)
                sock.send(mac, _NOBLOCK)
                counts["sent"] += 1
            except zmq.Again:
                counts["dropped_full"] += 1

    # ------------------------------------------------------------------ peers
    def _dealer(self, peer: int, now: float) -> zmq.Socket[Any] | None:
        record = self._peers.get(peer)
        heard = self.state.heard.get(peer, -math.inf) if self.state is not None else -math.inf
        if record is None or now - heard > self.params.member_timeout:
            record = self._refresh(peer, now)
        if record is None:
            return None
        self._used_at[peer] = now
        sock = self._dealers.get(peer)
        if sock is None:
            assert self._loop is not None
            try:
                sock = self._loop.context.socket(zmq.DEALER)
            except zmq.ZMQError as exc:  # out of sockets or descriptors: drop, retry later
                log.error("replica %d: no socket for replica %d: %s", self.replica_id, peer, exc)
                return None
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 1000)
            sock.setsockopt(zmq.MAXMSGSIZE, _DEALER_MAX_RECEIVE)
            sock.setsockopt(zmq.RCVHWM, 1)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            sock.connect(record.address)
            self._dealers[peer] = sock
        return sock

    def _close_idle_dealers(self, now: float) -> None:
        horizon = now - self._idle_timeout
        for peer in [p for p in self._dealers if self._used_at.get(p, -math.inf) < horizon]:
            self._dealers.pop(peer).close(linger=0)
        self._sweep_at = now + self._idle_timeout / 2

    def _refresh(self, peer: int, now: float) -> PeerRecord | None:
        """Re-read a quiet or unknown peer's record, at most once per interval."""
        if now - self._looked_up.get(peer, -math.inf) >= self._refresh_interval:
            self._looked_up[peer] = now
            found = self.directory.lookup(peer)
            if found is not None and found.newer_than(self._peers.get(peer)):
                self._update_peer(found)
        return self._peers.get(peer)

    def _learn(self, envelope: Envelope) -> None:
        known = self._peers.get(envelope.sender)
        if known is not None and known.incarnation == envelope.incarnation \
                and known.address == envelope.address:
            return  # the common case, without building a record
        record = PeerRecord(envelope.sender, envelope.address, envelope.incarnation)
        if record.newer_than(known):
            self._update_peer(record)

    def _update_peer(self, record: PeerRecord) -> None:
        old = self._peers.get(record.replica_id)
        self._peers[record.replica_id] = record
        if old is not None and old.address != record.address:
            log.info("replica %d: replica %d moved %s -> %s", self.replica_id,
                     record.replica_id, old.address, record.address)
            sock = self._dealers.pop(record.replica_id, None)
            if sock is not None:
                sock.close(linger=0)
