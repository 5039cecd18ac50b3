"""The effectful half of one quorum agent: its sockets, peers and counters.

Every method except the snapshots (``status``, ``stats``) runs on the thread of
the ``AgentLoop`` hosting the node. The node turns socket input into core
events, runs ``decide``, and performs the actions: one ROUTER socket receives
everything sent to this agent; a DEALER per peer address, shared by the agents
of its loop (``loop.Connections``) and opened on first use, sends.
A leader publishes a broadcast once on its feed (``feed``) to the followers
that say they receive it, and sends it to the others as before; a follower
follows its leader's feed through its loop's SUB socket.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from ft_launch.envelope import MAC_BYTES
from ft_launch.errors import FatalError
from ft_launch.events import Event
from ft_launch.logs import log_sampled

from . import events as ev
from . import witness
from .core import decide, initial_state, next_deadline
from .directory import PeerDirectory, PeerRecord
from .errors import MajorityLostError
from .feed import open_feed
from .loop import split_batch
from .model import EndorseAnswered, Health, Quorum, QuorumParams, Role
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
    NotifyStandingEnded,
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
_COUNTERS = ("sent", "published", "received", "received_on_feed", "dropped_unreachable",
             "dropped_full", "dropped_by_fault", "dropped_oversize", "memory_unsaved",
             "endorsements_refused",
             *(f"rejected_{r.value}" for r in Rejection))

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
                 max_age: float, electable: bool = True,
                 witnesses: Iterable[int] = (),
                 memory: witness.MemoryStore | None = None) -> None:
        self.replica_id = replica_id
        self.witnesses = frozenset(witnesses)
        self.voters = frozenset(replica_ids) | self.witnesses | {replica_id}
        self.directory = directory
        self.codec = codec
        self.params = params
        self.host = host
        self.port = port
        self.incarnation = incarnation
        self.seed = seed
        self.electable = electable
        self.on_answer = on_answer
        #: The voter's persistent memory (``witness.Memory``), and what it holds.
        self.memory = memory
        self._remembered: witness.Memory | None = None
        #: Set by the agent once someone listens; building events costs O(members).
        self.emit: Callable[[Event], None] | None = None
        self.blocked: frozenset[int] = frozenset()
        self.address = ""
        self.socket: zmq.Socket[Any] = None  # type: ignore[assignment]
        self.state: QuorumState | None = None
        self._guard = ReplayGuard(replica_id, max_age)
        # The feed is another TCP stream: its messages and the unicast ones
        # interleave in any order, so each channel keeps its own guard.
        self._feed_guard = ReplayGuard(replica_id, max_age)
        #: Leader: the PUB socket once it took office, and its address.
        self._pub: zmq.Socket[Any] | None = None
        self.feed_address = ""
        #: Leader: the peers whose last message said they receive our feed.
        self._on_our_feed: set[int] = set()
        #: Each peer's feed address as its messages name it, by incarnation.
        self._feeds: dict[int, tuple[int, str]] = {}
        #: Follower: the feed followed (its leader's: id, incarnation, address),
        #: and whether a message from it has arrived (then our messages to
        #: that leader say so).
        self._following: tuple[int, int, str] | None = None
        self._feed_heard = False
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._nonce = 0
        self._peers: dict[int, PeerRecord] = {}
        #: The address of the loop's shared socket to each peer this node sends to.
        self._dealers: dict[int, str] = {}
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
                                   electable=self.electable, witnesses=self.witnesses)
        if self.memory is not None:
            self._remembered = self.memory.load()
            self.state = witness.restore(self.state, self._remembered)
        self._sweep_at = now + self._idle_timeout
        self._loop.add(self)

    def close(self) -> None:
        if self._loop is not None:
            self._loop.remove(self)
            self._follow(None)
        if self._pub is not None:
            self._pub.close(linger=0)
            self._pub = None
        if self._loop is not None:
            for address in self._dealers.values():
                self._loop.connections.release(address)
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
        for index in range(_BATCH):
            try:
                sock.recv(_NOBLOCK)  # the ROUTER's peer identity
            except zmq.Again:
                more = False
                break
            # A ROUTER hands over an identity with at least one part after it.
            frames = [sock.recv(_NOBLOCK)]
            while sock.get(_RCVMORE):  # what recv_multipart does, without its enum costs
                frames.append(sock.recv(_NOBLOCK))
            for message in self._messages(frames):
                received = self._receive(message, wall)
                if received is not None:
                    batch.append(received)
            if index == 0 and not int(sock.get(_EVENTS)) & _POLLIN:
                # Empty now: asking is cheaper than the raised ``zmq.Again`` of
                # one more recv (a follower reads one message per wake-up); a
                # leader taking a round's joins pays one ``Again`` a batch instead.
                more = False
                break
        if len(batch) == 1:
            self.feed(batch[0], now)
        elif batch:
            self.feed(MessagesReceived(tuple(batch)), now)
        return more

    def _messages(self, frames: list[bytes]) -> list[list[bytes]]:
        """One message ``[data, mac]``, or the messages of a batch frame
        (``loop.Connections``); a malformed batch is dropped whole."""
        if len(frames) != 1:
            return [frames]
        try:
            return split_batch(frames[0], MAC_BYTES)
        except ValueError as exc:
            self._reject(Rejected(Rejection.MALFORMED, f"a batch frame: {exc}"))
            return []

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
        if envelope.on_feed:
            self._on_our_feed.add(envelope.sender)
        else:
            self._on_our_feed.discard(envelope.sender)
        return MessageReceived(envelope.sender, envelope.message)

    def on_published(self, frames: list[bytes], now: float, wall: float) -> None:
        """A message on the feed this node follows (from its loop's ``FeedReader``)."""
        try:
            envelope = self.codec.open(frames, feed=True)
            if envelope.sender not in self.voters or envelope.sender == self.replica_id:
                raise Rejected(Rejection.UNKNOWN_SENDER, str(envelope.sender))
            if envelope.sender in self.blocked:
                self._counts["dropped_by_fault"] += 1
                return
            self._feed_guard.check(envelope, wall)
        except Rejected as exc:
            self._reject(exc)
            return
        self._counts["received_on_feed"] += 1
        self._learn(envelope)
        if self._follows(envelope.sender):
            self._feed_heard = True
        self.feed(MessageReceived(envelope.sender, envelope.message, from_feed=True), now)

    def _reject(self, exc: Rejected) -> None:
        name = f"rejected_{exc.reason.value}"
        self._counts[name] += 1
        log_sampled(log, self._counts[name], "replica %d dropped a quorum message (%s)",
                    self.replica_id, exc)

    def feed(self, event: Input, now: float) -> None:
        assert self.state is not None
        self.state, actions = decide(self.state, event, now)
        if self.memory is not None and not self._remember():
            actions = []  # nothing leaves that a restart could contradict
        for action in actions:
            self._perform(action, now)
        if now >= self._sweep_at:
            self._close_idle_dealers(now)
        if self._loop is not None:
            self._follow_leader()
            self._loop.schedule(self, next_deadline(self.state, now))

    def _remember(self) -> bool:
        """Persist the voter's memory if it changed; False if that failed."""
        assert self.state is not None and self.memory is not None
        memory = witness.memory_of(self.state)
        if memory == self._remembered:
            return True
        try:
            self.memory.save(memory)
        except OSError as exc:
            self._counts["memory_unsaved"] += 1
            log_sampled(log, self._counts["memory_unsaved"], "voter %d cannot save its "
                        "quorum memory, so it answers nothing: %s", self.replica_id, exc,
                        level=logging.ERROR)
            return False
        self._remembered = memory
        return True

    # ------------------------------------------------------------------ actions
    def _perform(self, action: Action, now: float) -> None:
        if isinstance(action, Send):
            message = action.message
            if isinstance(message, EndorseAnswered) and not message.granted:
                self._counts["endorsements_refused"] += 1
                log_sampled(log, self._counts["endorsements_refused"], "witness %d refused "
                            "to endorse quorum %d: it shares no replica with the last "
                            "round this witness knows", self.replica_id, message.quorum_id,
                            level=logging.WARNING)
            self._send(action, now)
            return
        if isinstance(action, DeliverQuorum):
            self.on_answer(action.quorum)
            if self.emit is None:
                return  # nothing to log or tell: a member's answer every step
        elif isinstance(action, FailQuorumRequest):
            assert self.state is not None
            votes = self.state.weight_of(frozenset(action.reachable))
            self.on_answer(MajorityLostError(
                f"no leader, and only voters {list(action.reachable)} of "
                f"{len(self.voters)} reachable ({votes} of {self.state.total_weight} votes): "
                f"a majority needs {self.state.majority}",
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
        elif isinstance(action, NotifyStandingEnded):
            why = ("its leader changed" if action.ended_by == me
                   else f"replica {action.ended_by} asked for a round")
            log.info("replica %d: quorum %d stands through step %d only: %s",
                     me, action.quorum_id, action.through, why)
            event = ev.StandingEnded(me, action.quorum_id, action.through, action.ended_by)
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
        recipients = action.to
        if len(recipients) > 1 and self._publishes(recipients):
            if self._publish(action, now):
                recipients = tuple(p for p in recipients if p not in self._on_our_feed)
            if not recipients:
                return
        self._nonce += 1
        to = recipients[0] if len(recipients) == 1 else BROADCAST
        on_feed = self._feed_heard and len(recipients) == 1 and self._follows(to)
        data, mac = self.codec.seal(self.replica_id, to, self.incarnation, self._nonce,
                                    time.time(), self.address, action.message,
                                    feed_address=self.feed_address, on_feed=on_feed)
        if not self._fits(data):
            return
        # A large broadcast is wrapped once and sent to everyone without
        # copying; small messages are cheaper copied (pyzmq's zero-copy path
        # costs more than a short memcpy). Plain ``send`` with int flags: the
        # enum arithmetic of ``send_multipart`` cost 5 us a peer.
        # Small ones wait for the end of the loop's pass and leave batched
        # per address (``loop.Connections``).
        zero_copy = len(data) >= _ZERO_COPY_BYTES
        first: Any = zmq.Frame(data) if zero_copy else data
        blocked, counts = self.blocked, self._counts
        assert self._loop is not None
        connections = self._loop.connections
        for peer in recipients:
            if peer in blocked:
                counts["dropped_by_fault"] += 1
                continue
            address = self._dealer(peer, now)
            if address is None:
                counts["dropped_unreachable"] += 1
            elif zero_copy:
                connections.send_now(address, (first, mac), False, counts)
            else:
                connections.post(address, data, mac, counts)

    def _fits(self, data: bytes) -> bool:
        if len(data) <= self.max_message_bytes:
            return True
        # Receivers would drop the connection.
        self._counts["dropped_oversize"] += 1
        log_sampled(log, self._counts["dropped_oversize"], "replica %d cannot send a "
                    "quorum message of %d bytes: receivers accept at most %d",
                    self.replica_id, len(data), self.max_message_bytes, level=logging.ERROR)
        return False

    # ------------------------------------------------------------------ the feed
    def _publishes(self, recipients: tuple[int, ...]) -> bool:
        """Publish a leader's message meant for at least half of the others
        (heartbeats, a round's announcement): every follower gets what is
        published, so a message for a few goes to them alone. Never while a
        fault is injected: the feed cannot leave the blocked peers out."""
        state = self.state
        if state is None or state.role is not Role.LEADER or self.blocked \
                or 2 * len(recipients) < len(self.voters) - 1:
            return False
        if self._pub is None:
            assert self._loop is not None
            try:
                self._pub, self.feed_address = open_feed(self._loop.context, self.host)
            except zmq.ZMQError as exc:  # out of sockets or ports: unicast only
                log.error("replica %d: no quorum feed: %s", self.replica_id, exc)
                return False
            log.info("replica %d: publishing the quorum feed at %s", self.replica_id,
                     self.feed_address)
        return True

    def _publish(self, action: Send, now: float) -> bool:
        """Publish once; the followers on the feed need no message of their own."""
        assert self._pub is not None
        self._nonce += 1
        data, mac = self.codec.seal(self.replica_id, BROADCAST, self.incarnation, self._nonce,
                                    time.time(), self.address, action.message,
                                    feed_address=self.feed_address, feed=True)
        if not self._fits(data):
            return False
        try:
            self._pub.send(self.feed_address.encode(), _MORE)
            self._pub.send(data, _MORE, copy=len(data) < _ZERO_COPY_BYTES)
            self._pub.send(mac, _NOBLOCK)
        except zmq.Again:  # a PUB drops rather than blocks; kept for safety
            self._counts["dropped_full"] += 1
            return False
        self._counts["sent"] += 1
        self._counts["published"] += 1
        return True

    def _follows(self, peer: int) -> bool:
        """Whether the feed followed is ``peer``'s, as we know ``peer`` now."""
        following, known = self._following, self._peers.get(peer)
        return following is not None and known is not None \
            and following[:2] == (peer, known.incarnation)

    def _follow_leader(self) -> None:
        """Follow the current leader's feed, and only that one."""
        state = self.state
        leader = state.leader_id if state is not None else None
        target = None
        if leader is not None and leader != self.replica_id:
            feed = self._feeds.get(leader)
            known = self._peers.get(leader)
            if feed is not None and known is not None and feed[0] == known.incarnation:
                target = (leader, feed[0], feed[1])
        if target != self._following:
            self._follow(target)

    def _follow(self, target: tuple[int, int, str] | None) -> None:
        assert self._loop is not None
        if self._following is not None:
            self._loop.feed.unfollow(self._following[2], self)
        self._following, self._feed_heard = target, False
        if target is not None:
            self._loop.feed.follow(target[2], self, self.max_message_bytes)

    # ------------------------------------------------------------------ peers
    def _dealer(self, peer: int, now: float) -> str | None:
        """The address of the loop's socket to ``peer`` (acquired), or None."""
        record = self._peers.get(peer)
        heard = self.state.heard.get(peer, -math.inf) if self.state is not None else -math.inf
        if record is None or now - heard > self.params.member_timeout:
            record = self._refresh(peer, now)
        if record is None:
            return None
        self._used_at[peer] = now
        held = self._dealers.get(peer)
        if held is not None:
            return held
        assert self._loop is not None
        try:
            self._loop.connections.acquire(record.address)
        except zmq.ZMQError as exc:  # out of sockets or descriptors: drop, retry later
            log.error("replica %d: no socket for replica %d: %s", self.replica_id, peer, exc)
            return None
        self._dealers[peer] = record.address
        return record.address

    def _close_idle_dealers(self, now: float) -> None:
        horizon = now - self._idle_timeout
        assert self._loop is not None
        for peer in [p for p in self._dealers if self._used_at.get(p, -math.inf) < horizon]:
            self._loop.connections.release(self._dealers.pop(peer))
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
        if envelope.feed:
            feed = self._feeds.get(envelope.sender)
            if feed is None or feed != (envelope.incarnation, envelope.feed):
                self._feeds[envelope.sender] = (envelope.incarnation, envelope.feed)
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
            held = self._dealers.pop(record.replica_id, None)
            if held is not None and self._loop is not None:
                self._loop.connections.release(held)
