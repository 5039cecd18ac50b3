"""``QuorumAgent``: the thread-safe handle a replica (or a witness) uses.

One agent per process: a thread that owns a ROUTER socket receiving everything
sent to this agent, a DEALER per peer it sends to (opened on first use, closed
when idle), the ``QuorumCore`` and its one timer. Callers hand it work through a
queue; answers come back as ``concurrent.futures.Future`` s.
"""

from __future__ import annotations

import logging
import math
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from typing import Any, Self

import zmq

from ft_launch.config import QuorumConfig
from ft_launch.errors import ConfigError, FatalError
from ft_launch.events import Event, EventLog
from ft_launch.logs import log_sampled

from . import events as ev
from .core import QuorumCore
from .directory import PeerDirectory, PeerRecord, StaticDirectory
from .election import Action, Deliver, Fail, Send
from .errors import MajorityLostError, QuorumStoppedError, QuorumTimeoutError
from .model import EndorseAnswered, Memory, MemoryStore, Quorum, QuorumParams, Role
from .wire import (
    BROADCAST,
    MAX_ADDRESS_BYTES,
    Codec,
    Rejected,
    Rejection,
    ReplayGuard,
    max_message_bytes,
)

log = logging.getLogger(__name__)

Subscriber = Callable[[Event], None]
Call = Callable[[QuorumCore, float], list[Action]]

#: Messages taken from the socket per wake-up before the timers get a look.
_BATCH = 256
_ZERO_COPY_BYTES = 16384
#: Messages ZeroMQ queues per connection before it stops reading it: a peer sends
#: one or two per heartbeat and the loop drains the socket each wake-up.
_RECV_HWM = 8
#: A DEALER queues 1,000 messages while its peer is slow or unreachable (then drops),
#: and only sends: what a peer sends back is never read.
_DEALER_OPTIONS = ((zmq.LINGER, 0), (zmq.SNDHWM, 1000), (zmq.MAXMSGSIZE, 4096),
                   (zmq.RCVHWM, 1), (zmq.RECONNECT_IVL, 100), (zmq.RECONNECT_IVL_MAX, 2000))
_COUNTERS = ("sent", "received", "dropped_unreachable", "dropped_full", "dropped_by_fault",
             "dropped_oversize", "memory_unsaved", "endorsements_refused", "failed_steps",
             *(f"rejected_{r.value}" for r in Rejection))
#: What a person should read in the log, by event (the rest are for machines).
_LOGGED = {ev.LeaderElected: logging.INFO, ev.LeadershipLost: logging.INFO,
           ev.MajorityLost: logging.ERROR, ev.MembersLivenessChanged: logging.INFO,
           ev.StandingEnded: logging.INFO}


@dataclass(frozen=True)
class QuorumStatus:
    """A snapshot of one agent's view (tests, the benchmark): ``round_joined`` are
    the members whose joins a leader holds for its open round."""

    replica_id: int
    role: Role
    term: int
    leader_id: int | None
    round_joined: tuple[int, ...]


class QuorumAgent:
    """A voter of the replica quorum.

    ``replica_ids`` is the job's replica set; ``directory`` is where agents publish
    and find addresses (a mapping ``replica_id -> address`` is taken as a static
    directory); ``secret`` is the per-job secret that authenticates every message.
    ``electable=False`` makes a member that votes and joins but never stands for
    leader. ``witnesses``: the voter ids of the job's witnesses; an agent whose
    ``replica_id`` is one of them is a witness. ``memory`` keeps what the voter must
    not forget across a restart (``model.Memory``): every voter of a job needs one,
    or a restart can let it vote twice in a term. The incarnation (the wall clock in
    ns) tells a replaced replica's messages from its predecessor's.
    """

    def __init__(self, replica_id: int, replica_ids: Iterable[int],
                 directory: PeerDirectory | Mapping[int, str], secret: str,
                 config: QuorumConfig | None = None, *, job_id: str = "",
                 host: str = "127.0.0.1", event_log: EventLog | None = None,
                 electable: bool = True, witnesses: Iterable[int] = (),
                 memory: MemoryStore | None = None) -> None:
        self.config = config or QuorumConfig()
        for key, problem in self.config.problems():
            raise ConfigError(f"{problem} (got {getattr(self.config, key)!r})",
                              key=f"quorum.{key}")
        self.witnesses = frozenset(witnesses)
        self.voters = frozenset(replica_ids) | self.witnesses
        if replica_id not in self.voters:
            raise ConfigError(f"replica {replica_id} is not among the configured replicas "
                              f"{sorted(self.voters - self.witnesses)} or witnesses "
                              f"{sorted(self.witnesses)}")
        self.replica_id, self.job_id, self.host = replica_id, job_id, host
        self.incarnation = time.time_ns()
        self.params = QuorumParams.from_config(self.config, len(self.voters))
        self.directory = directory if not isinstance(directory, Mapping) \
            else StaticDirectory(directory)
        self._codec = Codec(secret, job_id)
        self._guard = ReplayGuard(replica_id, self.config.max_message_age)
        self._electable, self._memory, self._event_log = electable, memory, event_log
        self._remembered: Memory | None = None
        self._core: QuorumCore | None = None
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._nonce = 0
        self._blocked: frozenset[int] = frozenset()
        self._subscribers: list[Subscriber] = []
        self._waiter: Future[Quorum] | None = None
        #: Work for the agent's thread, each with the future it answers (if any).
        self._calls: deque[tuple[Future[Any] | None, Call]] = deque()
        self._context: zmq.Context[Any] | None = None
        self._socket: zmq.Socket[Any] | None = None
        self.address = ""
        self._peers: dict[int, PeerRecord] = {}
        #: Peer -> (its DEALER, when last used); closed when idle: a member that once
        #: ran an election must not keep a socket to every peer for ever.
        self._dealers: dict[int, tuple[zmq.Socket[Any], float]] = {}
        self._looked_up: dict[int, float] = {}
        self._refresh_interval = max(self.params.heartbeat_interval,
                                     self.params.member_timeout / 3)
        self._idle_timeout = max(10.0, 3 * self.params.member_timeout)
        self._max_bytes = max_message_bytes(len(self.voters))
        self._wake_r = self._wake_w = -1
        self._thread: threading.Thread | None = None
        self._state = "new"  # -> bound -> running -> stopped

    # ------------------------------------------------------------------ lifecycle
    def bind(self) -> str:
        """Bind and publish the address without taking part yet (lets a launcher
        gather every address before any election starts)."""
        if self._socket is None:
            self._context, (self._wake_r, self._wake_w) = zmq.Context(), os.pipe()
            sock = self._context.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            # Bounds what an unauthenticated peer can make this process buffer: a
            # larger frame ends its connection before the MAC is ever checked.
            sock.setsockopt(zmq.MAXMSGSIZE, self._max_bytes)
            sock.setsockopt(zmq.RCVHWM, _RECV_HWM)
            sock.bind(f"tcp://{self.host}:{self.config.port or '*'}")
            self._socket, self.address = sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self.directory.publish(PeerRecord(self.replica_id, self.address, self.incarnation))
            self._state = "bound"
        return self.address

    def start(self) -> Self:
        """Bind if needed, then take part in elections and quorums."""
        if self._state == "stopped":
            raise QuorumStoppedError("a stopped quorum agent cannot start again",
                                     hint="create a new agent (with a higher incarnation)")
        if self._state == "running":
            return self
        self.bind()
        now = time.monotonic()
        core = QuorumCore(self.replica_id, self.voters, self.params, now,
                          seed=random.SystemRandom().getrandbits(62),
                          join_seq_base=self.incarnation, electable=self._electable,
                          witnesses=self.witnesses)
        if self._memory is not None:
            self._remembered = self._memory.load()
            core.restore(self._remembered)
        self._core, self._state = core, "running"
        self._thread = threading.Thread(target=self._run, name=f"quorum-{self.replica_id}",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Leave: close the sockets; a caller waiting for a quorum gets
        ``QuorumStoppedError``. The others notice within their timeouts."""
        if self._state in ("new", "stopped"):
            self._state = "stopped"
            return
        thread, self._state = self._thread, "stopped"
        if thread is not None and thread is not threading.current_thread():
            self._wake()
            thread.join(10)
        assert self._context is not None
        self._context.destroy(linger=0)  # closes the ROUTER and the DEALERs
        self._dealers.clear()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        stopped = QuorumStoppedError("the quorum agent was stopped", replica_id=self.replica_id)
        self._settle(stopped)
        while self._calls:  # never run: their callers learn why
            future, _ = self._calls.popleft()
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(stopped)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def default_timeout(self) -> float:
        """Long enough for one join window plus a leader failover."""
        c = self.config
        return c.join_timeout + c.member_timeout + 4 * c.election_timeout

    # ------------------------------------------------------------------ the per-step call
    def request_quorum(self, next_step: int, *, address: str | None = None) -> Future[Quorum]:
        """Ask for the quorum of ``next_step`` without waiting. A newer request
        replaces an unanswered older one (whose future is cancelled)."""
        self._check_running()
        future: Future[Quorum] = Future()
        advertised = address or self.address
        size = len(advertised.encode())
        if size > MAX_ADDRESS_BYTES:  # every receiver would drop the announcements
            future.set_exception(FatalError(
                f"replica {self.replica_id} advertises a quorum address of {size} bytes; "
                f"the quorum carries at most {MAX_ADDRESS_BYTES} per member",
                hint="fewer ranks per replica, or raise quorum.wire.MAX_ADDRESS_BYTES "
                     "on every replica", replica_id=self.replica_id, step=next_step))
            return future

        def begin(core: QuorumCore, now: float) -> list[Action]:
            old, self._waiter = self._waiter, future
            if old is not None:
                old.cancel()
            return core.request(next_step, advertised, now)
        self._call(begin, future)
        return future

    def get_quorum(self, next_step: int, *, address: str | None = None,
                   timeout: float | None = None) -> Quorum:
        """Join the quorum for ``next_step`` and wait for the leader's answer.

        Raises ``QuorumTimeoutError`` (retry), ``MajorityLostError`` (this replica
        is cut off or the majority is gone) or ``QuorumStoppedError``.
        """
        limit = self.default_timeout if timeout is None else timeout
        future = self.request_quorum(next_step, address=address)
        try:
            return future.result(limit)
        except FutureTimeout:
            raise QuorumTimeoutError(
                f"no quorum within {limit:.1f}s",
                hint="an election may be in progress or too few replicas joined; retry",
                replica_id=self.replica_id, step=next_step) from None
        except CancelledError:
            raise QuorumTimeoutError("superseded by a newer quorum request",
                                     replica_id=self.replica_id, step=next_step) from None

    def report_commit_failure(self) -> None:
        """The last step's commit failed here: the next quorum gets a new id."""
        self._check_running()
        self._call(lambda core, now: core.report_commit_failure(now))

    # ------------------------------------------------------------------ observing
    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call ``callback(event)`` for each quorum event, on the agent's thread
        (keep it short). Returns a function that unsubscribes."""
        self._subscribers = [*self._subscribers, callback]

        def unsubscribe() -> None:
            self._subscribers = [s for s in self._subscribers if s is not callback]
        return unsubscribe

    def status(self) -> QuorumStatus:
        """A snapshot of this agent's view, taken on its thread."""
        self._check_running()
        future: Future[QuorumStatus] = Future()

        def snapshot(core: QuorumCore, now: float) -> list[Action]:
            joined = core.lead.round.joins if core.lead and core.lead.round else {}
            future.set_running_or_notify_cancel()
            future.set_result(QuorumStatus(core.me, core.role, core.term, core.leader_id,
                                           tuple(sorted(joined))))
            return []
        self._call(snapshot, future)
        return future.result(10)

    def stats(self) -> dict[str, int]:
        """Message counters since the agent started."""
        return dict(self._counts)

    def drop_traffic(self, peers: Iterable[int]) -> None:
        """FAULT INJECTION: drop every message to and from ``peers`` (a network
        partition, for tests and drills); counted as ``dropped_by_fault``."""
        self._blocked = frozenset(peers)

    # ------------------------------------------------------------------ the thread
    def _check_running(self) -> None:
        if self._state != "running":
            raise QuorumStoppedError("the quorum agent is not running",
                                     hint="call start() first", replica_id=self.replica_id)

    def _call(self, fn: Call, future: Future[Any] | None = None) -> None:
        """Run ``fn(core, now)`` on the agent's thread and perform its actions."""
        self._calls.append((future, fn))
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass  # full: it wakes anyway; closed: it has stopped

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        sweep_at = time.monotonic() + self._idle_timeout
        core = self._core
        assert core is not None
        while self._state == "running":
            wait = min(1.0, core.next_deadline(time.monotonic()) - time.monotonic())
            events = dict(poller.poll(max(0, math.ceil(1000 * wait))))
            if self._wake_r in events:
                os.read(self._wake_r, 4096)
            while self._calls:
                self._guarded(self._run_one, self._calls.popleft()[1])
            if self._socket in events:
                self._guarded(self._receive)
            now = time.monotonic()
            if now >= core.next_deadline(now):
                self._guarded(self._run_one, QuorumCore.tick)
            if now >= sweep_at:
                sweep_at = now + self._idle_timeout / 2
                for peer in [p for p, (_, used) in self._dealers.items()
                             if used < now - self._idle_timeout]:
                    self._dealers.pop(peer)[0].close(linger=0)

    def _run_one(self, fn: Call) -> None:
        now = time.monotonic()
        self._perform(fn(self._core, now), now)  # type: ignore[arg-type]

    def _guarded(self, step: Callable[..., object], *args: Any) -> None:
        """A bug that raises is logged (sampled: input that trips it again and again
        must not flood the log) and the input dropped; the agent keeps going."""
        try:
            step(*args)
        except Exception:  # noqa: BLE001 - one bad input must not stop the agent
            self._counts["failed_steps"] += 1
            log_sampled(log, self._counts["failed_steps"], "quorum agent %d failed on an "
                        "input, which is dropped", self.replica_id, level=logging.ERROR,
                        exc_info=True)

    def _receive(self) -> None:
        sock, core = self._socket, self._core
        assert sock is not None and core is not None
        for _ in range(_BATCH):
            try:
                sock.recv(zmq.NOBLOCK)  # the ROUTER's peer identity
            except zmq.Again:
                return
            frames = sock.recv_multipart(zmq.NOBLOCK)
            try:
                envelope = self._codec.open(frames)
                sender = envelope.sender
                if sender not in self.voters or sender == self.replica_id:
                    raise Rejected(Rejection.UNKNOWN_SENDER, str(sender))
                if sender in self._blocked:
                    self._counts["dropped_by_fault"] += 1
                    continue
                self._guard.check(envelope, time.time())
            except Rejected as exc:
                name = f"rejected_{exc.reason.value}"
                self._counts[name] += 1
                log_sampled(log, self._counts[name], "replica %d dropped a quorum message "
                            "(%s)", self.replica_id, exc)
                continue
            self._counts["received"] += 1
            record = PeerRecord(sender, envelope.address, envelope.incarnation)
            if record.newer_than(self._peers.get(sender)):
                self._update_peer(record)
            now = time.monotonic()
            self._perform(core.step(sender, envelope.body, now), now)

    def _perform(self, actions: list[Action], now: float) -> None:
        if self._memory is not None and not self._remember():
            return  # nothing leaves that a restart could contradict
        for action in actions:
            if isinstance(action, Send):
                self._send(action, now)
            elif isinstance(action, Deliver):
                self._settle(action.quorum)
                q = action.quorum
                self._emit(ev.QuorumJoined(self.replica_id, q.quorum_id, list(q.replica_ids),
                                           q.max_step, list(q.behind)))
            elif isinstance(action, Fail):
                core = self._core
                assert core is not None
                self._settle(MajorityLostError(
                    f"no leader, and only voters {list(action.reachable)} of "
                    f"{len(self.voters)} reachable ({core.weight_of(action.reachable)} of "
                    f"{sum(core.weights.values())} votes): a majority needs {core.majority}",
                    hint="if other replicas still form quorums this one is cut off and "
                         "should restart behind; otherwise restart the whole job in place",
                    reachable=action.reachable, configured=len(self.voters),
                    replica_id=self.replica_id))
            else:
                self._emit(replace(action, time=time.time()))

    def _settle(self, outcome: Quorum | BaseException) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is None or not waiter.set_running_or_notify_cancel():
            return
        if isinstance(outcome, BaseException):
            waiter.set_exception(outcome)
        else:
            waiter.set_result(outcome)

    def _emit(self, event: Event) -> None:
        level = _LOGGED.get(type(event))
        if level is not None:
            log.log(level, "replica %d: %s", self.replica_id, event)
        if self._event_log is not None:
            self._event_log.emit(event)
        for callback in self._subscribers:
            try:
                callback(event)
            except Exception:
                log.exception("quorum event subscriber %r failed on %s", callback, event)

    def _remember(self) -> bool:
        """Persist the voter's memory if it changed; False if that failed."""
        assert self._core is not None and self._memory is not None
        memory = self._core.memory()
        if memory == self._remembered:
            return True
        try:
            self._memory.save(memory)
        except OSError as exc:
            self._counts["memory_unsaved"] += 1
            log_sampled(log, self._counts["memory_unsaved"], "voter %d cannot save its "
                        "quorum memory, so it answers nothing: %s", self.replica_id, exc,
                        level=logging.ERROR)
            return False
        self._remembered = memory
        return True

    # ------------------------------------------------------------------ sending
    def _send(self, action: Send, now: float) -> None:
        message, counts = action.message, self._counts
        if isinstance(message, EndorseAnswered) and not message.granted:
            counts["endorsements_refused"] += 1
            log_sampled(log, counts["endorsements_refused"], "witness %d refused to endorse "
                        "quorum %d: it shares no replica with the last round this witness "
                        "knows", self.replica_id, message.quorum_id, level=logging.WARNING)
        self._nonce += 1
        to = action.to[0] if len(action.to) == 1 else BROADCAST
        data, mac = self._codec.seal(self.replica_id, to, self.incarnation, self._nonce,
                                     time.time(), self.address, message)
        if len(data) > self._max_bytes:  # receivers would drop the connection
            counts["dropped_oversize"] += 1
            log_sampled(log, counts["dropped_oversize"], "replica %d cannot send a quorum "
                        "message of %d bytes: receivers accept at most %d", self.replica_id,
                        len(data), self._max_bytes, level=logging.ERROR)
            return
        # A large broadcast is wrapped once and sent to everyone without copying.
        first: Any = zmq.Frame(data) if len(data) >= _ZERO_COPY_BYTES else data
        for peer in action.to:
            sock = None if peer in self._blocked else self._dealer(peer, now)
            if sock is None:
                counts["dropped_by_fault" if peer in self._blocked
                       else "dropped_unreachable"] += 1
                continue
            try:
                sock.send(first, zmq.NOBLOCK | zmq.SNDMORE, copy=first is data)
                sock.send(mac, zmq.NOBLOCK)
                counts["sent"] += 1
            except zmq.Again:
                counts["dropped_full"] += 1

    def _dealer(self, peer: int, now: float) -> zmq.Socket[Any] | None:
        """The socket to ``peer``, opened on first use; None while its address is
        unknown. A quiet or unknown peer's record is re-read, at most once per
        refresh interval (a replaced replica may have moved)."""
        core = self._core
        record = self._peers.get(peer)
        heard = core.heard.get(peer, -math.inf) if core is not None else -math.inf
        if (record is None or now - heard > self.params.member_timeout) \
                and now - self._looked_up.get(peer, -math.inf) >= self._refresh_interval:
            self._looked_up[peer] = now
            found = self.directory.lookup(peer)
            if found is not None and found.newer_than(record):
                self._update_peer(found)
            record = self._peers.get(peer)
        if record is None:
            return None
        held = self._dealers.get(peer)
        if held is not None:
            sock = held[0]
        else:
            assert self._context is not None
            try:
                sock = self._context.socket(zmq.DEALER)
            except zmq.ZMQError as exc:  # out of sockets or descriptors: retry later
                log.error("replica %d: no socket for replica %d: %s", self.replica_id, peer, exc)
                return None
            for option, value in _DEALER_OPTIONS:
                sock.setsockopt(option, value)
            sock.connect(record.address)
        self._dealers[peer] = (sock, now)
        return sock

    def _update_peer(self, record: PeerRecord) -> None:
        old = self._peers.get(record.replica_id)
        self._peers[record.replica_id] = record
        if old is not None and old.address != record.address:
            log.info("replica %d: replica %d moved %s -> %s", self.replica_id,
                     record.replica_id, old.address, record.address)
            held = self._dealers.pop(record.replica_id, None)
            if held is not None:
                held[0].close(linger=0)
