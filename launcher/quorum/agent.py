"""``QuorumAgent``: the thread-safe handle a replica (or the benchmark) uses.

One agent per replica, in its rank-0 process or beside it. The agent owns a
``QuorumNode`` on an ``AgentLoop`` thread (its own, or one shared with other
agents) and turns the node's answers into futures, errors and events.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import CancelledError
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Self

from ft_launch.config import QuorumConfig
from ft_launch.errors import ConfigError
from ft_launch.events import Event, EventLog

from .directory import PeerDirectory, StaticDirectory
from .errors import QuorumStoppedError, QuorumTimeoutError
from .loop import AgentLoop
from .model import Health, Quorum, QuorumParams
from .node import QuorumNode, QuorumStats, QuorumStatus
from .witness import MemoryStore

log = logging.getLogger(__name__)

Subscriber = Callable[[Event], None]

_PENDING, _CANCELLED, _SETTLED = range(3)


class PendingQuorum:
    """The answer to one ``request_quorum``, to come: the part of
    ``concurrent.futures.Future`` that callers use (``result``, ``exception``,
    ``done``, ``cancel``, ``cancelled``, ``add_done_callback``), raising the same
    ``TimeoutError`` and ``CancelledError``. A ``Future`` builds a ``Condition``
    over an ``RLock`` and notifies it when it completes: a member asks every
    step, and a loop hosting hundreds of agents spent a fifth of its time on
    their futures. Two plain locks do: one guards the state, the other is held
    until the answer is in, so a waiter blocks on it."""

    __slots__ = ("_callbacks", "_guard", "_in", "_status", "_value")

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._in = threading.Lock()
        self._in.acquire()
        self._status = _PENDING
        self._value: Quorum | BaseException | None = None
        self._callbacks: list[Callable[[PendingQuorum], None]] = []

    def done(self) -> bool:
        return self._status != _PENDING

    def cancelled(self) -> bool:
        return self._status == _CANCELLED

    def cancel(self) -> bool:
        """Give up on the answer; False once it is in."""
        return self._finish(_CANCELLED, None) or self._status == _CANCELLED

    def result(self, timeout: float | None = None) -> Quorum:
        outcome = self._outcome(timeout)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def exception(self, timeout: float | None = None) -> BaseException | None:
        outcome = self._outcome(timeout)
        return outcome if isinstance(outcome, BaseException) else None

    def add_done_callback(self, callback: Callable[[PendingQuorum], None]) -> None:
        """Call ``callback(self)`` once the answer is in (at once if it is)."""
        with self._guard:
            if self._status == _PENDING:
                self._callbacks.append(callback)
                return
        self._call(callback)

    def settle(self, outcome: Quorum | BaseException) -> None:
        """Hand over the answer, unless the caller gave up on it."""
        self._finish(_SETTLED, outcome)

    def _outcome(self, timeout: float | None) -> Quorum | BaseException:
        if self._status == _PENDING:
            if not self._in.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
                raise FutureTimeout()
            self._in.release()  # for any other waiter
        if self._status == _CANCELLED:
            raise CancelledError()
        assert self._value is not None
        return self._value

    def _finish(self, status: int, value: Quorum | BaseException | None) -> bool:
        with self._guard:
            if self._status != _PENDING:
                return False
            self._value, self._status = value, status
            callbacks, self._callbacks = self._callbacks, []
        self._in.release()
        for callback in callbacks:
            self._call(callback)
        return True

    def _call(self, callback: Callable[[PendingQuorum], None]) -> None:
        try:
            callback(self)
        except Exception:
            log.exception("callback %r on a quorum answer failed", callback)


class QuorumAgent:
    """A member of the replica quorum.

    ``replica_ids`` is the job's configured replica set (from the launcher);
    ``directory`` is where agents publish and find addresses (a mapping of
    ``replica_id -> address`` is taken as a static directory); ``secret`` is the
    per-job secret (``ft_launch.ids.new_job_secret()``) that authenticates every
    message. ``incarnation`` must grow when a replica is replaced (default: the
    wall clock in ns at construction). ``electable=False`` makes a member that
    votes and joins but never stands for leader. ``witnesses``: the voter ids of
    the job's witnesses (``model.witness_ids``); an agent whose ``replica_id`` is
    one of them is a witness (``witness_service.witness_agent`` runs one).
    ``memory`` keeps what the voter must not forget across a restart
    (``witness.Memory``; ``witness_service.MemoryFile``): every voter of a job
    needs one, or a restart can let it vote twice in a term. The replay window
    (``config.max_message_age``) and the election slot come from ``config``;
    ``config.peer_dir`` is the launcher's business (it builds ``directory``).
    """

    def __init__(self, replica_id: int, replica_ids: Iterable[int],
                 directory: PeerDirectory | Mapping[int, str], secret: str,
                 config: QuorumConfig | None = None, *, job_id: str = "",
                 host: str = "127.0.0.1", incarnation: int | None = None,
                 loop: AgentLoop | None = None, event_log: EventLog | None = None,
                 seed: int | None = None, electable: bool = True,
                 witnesses: Iterable[int] = (), memory: MemoryStore | None = None) -> None:
        self.config = config or QuorumConfig()
        for key, problem in self.config.problems():
            raise ConfigError(f"{problem} (got {getattr(self.config, key)!r})",
                              key=f"quorum.{key}")
        witness_set = frozenset(witnesses)
        voters = frozenset(replica_ids) | witness_set
        if replica_id not in voters:
            raise ConfigError(f"replica {replica_id} is not among the configured replicas "
                              f"{sorted(voters - witness_set)} or witnesses "
                              f"{sorted(witness_set)}")
        self.replica_id = replica_id
        self.job_id = job_id
        self._own_loop = loop is None
        self._loop = loop or AgentLoop(name=f"quorum-{replica_id}")
        if isinstance(directory, Mapping):
            directory = StaticDirectory(directory)
        self._node = QuorumNode(
            replica_id=replica_id, replica_ids=voters, directory=directory,
            codec=self._loop.codec(secret, job_id),
            params=QuorumParams.from_config(self.config, len(voters)), host=host,
            port=self.config.port, incarnation=incarnation or time.time_ns(),
            seed=random.SystemRandom().getrandbits(62) if seed is None else seed,
            on_answer=self._on_answer, max_age=self.config.max_message_age,
            electable=electable, witnesses=witness_set, memory=memory)
        self._event_log = event_log
        self._lock = threading.Lock()
        self._subscribers: list[Subscriber] = []
        self._waiter: PendingQuorum | None = None  # touched on the loop thread only
        self._running = False
        self._stopped = False

    # ------------------------------------------------------------------ lifecycle
    def bind(self) -> str:
        """Bind and publish the address without taking part yet (optional: lets a
        launcher gather every address before any election starts)."""
        if not self._node.address:
            if self._own_loop:
                self._loop.start()
            self._loop.call(lambda: self._node.bind(self._loop))
        return self._node.address

    def start(self) -> Self:
        """Bind if needed, then start taking part in elections and quorums."""
        if self._running:
            return self
        if self._stopped:
            raise QuorumStoppedError("a stopped quorum agent cannot start again",
                                     hint="create a new agent (with a higher incarnation)")
        self.bind()
        if self._event_log is not None:
            self._node.emit = self._emit
        self._loop.call(self._node.begin)
        self._running = True
        return self

    def stop(self) -> None:
        """Leave: close the sockets; a caller waiting in ``get_quorum`` gets
        ``QuorumStoppedError``. The others notice within their timeouts."""
        if not self._node.address or self._stopped:
            return
        self._stopped = True
        self._running = False
        if self._loop.running:
            self._loop.call(self._close_on_loop)
        if self._own_loop:
            self._loop.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def address(self) -> str:
        """The ZeroMQ endpoint this agent receives on."""
        return self._node.address

    @property
    def incarnation(self) -> int:
        return self._node.incarnation

    @property
    def default_timeout(self) -> float:
        """Long enough for one join window plus a leader failover."""
        c = self.config
        return c.join_timeout + c.member_timeout + 4 * c.election_timeout

    # ------------------------------------------------------------------ the per-step call
    def request_quorum(self, next_step: int, *, health: Health | str = Health.OK,
                       address: str | None = None) -> PendingQuorum:
        """Ask for the quorum of ``next_step`` without waiting. A newer request
        replaces an unanswered older one (whose future is cancelled)."""
        self._check_running()
        future = PendingQuorum()
        health = health if isinstance(health, Health) else Health(health)
        advertised = address or self.address
        self._loop.call_soon(lambda: self._begin(future, next_step, advertised, health))
        return future

    def get_quorum(self, next_step: int, *, health: Health | str = Health.OK,
                   address: str | None = None, timeout: float | None = None) -> Quorum:
        """Join the quorum for ``next_step`` and wait for the leader's answer.

        Raises ``QuorumTimeoutError`` (retry), ``MajorityLostError`` (this replica
        is cut off or the majority is gone) or ``QuorumStoppedError``.
        """
        limit = self.default_timeout if timeout is None else timeout
        future = self.request_quorum(next_step, health=health, address=address)
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
        self._loop.call_soon(self._node.report_commit_failure)

    def transfer_leadership(self, to: int) -> None:
        """If this agent leads, hand leadership to replica ``to`` (one vote
        round instead of a failover, e.g. before draining this node)."""
        self._check_running()
        self._loop.call_soon(lambda: self._node.transfer_leadership(to))

    # ------------------------------------------------------------------ observing
    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call ``callback(event)`` for each quorum event, on the agent's loop
        thread (keep it short). Returns a function that unsubscribes."""
        with self._lock:
            self._subscribers.append(callback)
        self._node.emit = self._emit

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)
        return unsubscribe

    def status(self) -> QuorumStatus:
        return self._node.status()

    def stats(self) -> QuorumStats:
        return self._node.stats()

    # ------------------------------------------------------------------ fault injection
    def drop_traffic(self, peers: Iterable[int]) -> None:
        """FAULT INJECTION: drop every message to and from ``peers`` (a network
        partition, for tests and drills); counted as ``dropped_by_fault``."""
        blocked = frozenset(peers)
        self._loop.call(lambda: setattr(self._node, "blocked", blocked))

    # ------------------------------------------------------------------ loop thread
    def _begin(self, future: PendingQuorum, next_step: int, address: str,
               health: Health) -> None:
        if not self._running:
            future.settle(QuorumStoppedError("the quorum agent is stopped",
                                             replica_id=self.replica_id))
            return
        old, self._waiter = self._waiter, future
        if old is not None:
            old.cancel()
        self._node.request(next_step, address, health)

    def _on_answer(self, result: Quorum | BaseException) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter.settle(result)

    def _close_on_loop(self) -> None:
        self._node.close()
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter.settle(QuorumStoppedError("the quorum agent was stopped",
                                             replica_id=self.replica_id))

    def _emit(self, event: Event) -> None:
        if self._event_log is not None:
            self._event_log.emit(event)
        with self._lock:
            subscribers = list(self._subscribers)
        for callback in subscribers:
            try:
                callback(event)
            except Exception:
                log.exception("quorum event subscriber %r failed on %s", callback, event)

    def _check_running(self) -> None:
        if not self._running:
            raise QuorumStoppedError("the quorum agent is not running",
                                     hint="call start() first", replica_id=self.replica_id)

