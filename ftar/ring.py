"""``FtarGroup``: one member's handle on the fault-tolerant ring all-reduce.

Members are the same rank in each replica of the current quorum. The group listens
from construction (publish ``address`` to the quorum), ``reconfigure`` builds the
ring of a quorum, and ``allreduce`` reduces an array in place::

    group = FtarGroup(config.ftar, secret)
    group.reconfigure(quorum_id, members, my_index)     # when the quorum changes
    group.allreduce(grads, op=ReduceOp.AVG, contributes=not catching_up, step=step)

Failure contract: a dead, silent or disconnecting neighbour raises
``PeerFailedError`` (recoverable) once it has been silent for ``timeout``, or at
once when ``member_lost`` names a member (the quorum noticed first); the
ring is then broken and every later call raises the same error until
``reconfigure``. A mismatch between members or a local fault raises
``FtarUsageError`` (fatal). The array's content is undefined after an error.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Self

import numpy as np

from ft_launch.config import FtarConfig

from .connections import Connector, RingPosition
from .dtypes import ElementType, HostKernels, element_type_of
from .engine import Combiner, HostCombiner, Operation, ProgressHook, ReduceOp, RingEngine
from .errors import FtarUsageError
from .link import LinkStats
from .schedule import member_program, plan_ring
from .transport import Address, Hello, Purpose, connect

log = logging.getLogger(__name__)


__all__ = ["Combiner", "FtarGroup", "FtarStats", "GroupState", "ReduceOp"]


class GroupState(enum.Enum):
    UNCONFIGURED = "unconfigured"   # listening; no quorum yet
    READY = "ready"
    BROKEN = "broken"               # an operation or reconfigure failed; reconfigure
    CLOSED = "closed"


@dataclass(frozen=True)
class FtarStats:
    """Counters since construction (all rings)."""

    ops_completed: int
    ops_failed: int
    frames_sent: int
    bytes_sent: int
    frames_received: int
    bytes_received: int
    max_inflight_bytes: int       # largest unconsumed payload seen on one connection
    inflight_limit_bytes: int     # what credits allow per connection
    refused_connections: int
    last_contributors: int


class FtarGroup:
    """One member of the cross-replica ring (see module docstring)."""

    def __init__(self, config: FtarConfig, secret: str, host: str = "127.0.0.1", *,
                 progress_hook: ProgressHook | None = None) -> None:
        """Tuning comes from ``config`` (``[ftar]``): ``reduce_bytes`` is the
        granularity of receive-then-add inside a chunk (cache sized, tuned apart from
        the transport's ``chunk_bytes``); segments smaller than ``chunk_bytes x
        chunks_in_flight`` are still cut into up to ``chunks_in_flight`` chunks of at
        least ``min_chunk_bytes`` to pipeline the ring steps (0 turns that off);
        ``socket_buffer_bytes`` sets SO_SNDBUF/SO_RCVBUF (0 keeps kernel autotuning).
        ``progress_hook``: called after each completed ring step (tracing, tests)."""
        problems = list(config.problems())
        if problems:
            raise FtarUsageError(f"bad [ftar] config: {problems}")
        self.config = config
        self._secret = secret
        self._reduce_bytes = config.reduce_bytes
        self._min_chunk_bytes = config.min_chunk_bytes
        self._socket_buffer_bytes = config.socket_buffer_bytes
        self._progress_hook = progress_hook
        self._connector = Connector(config, secret, host, on_member_lost=self._relayed_lost)
        # Receive buffers, allocated once: chunks_in_flight slots of chunk_bytes.
        self._slots = np.empty((config.chunks_in_flight, config.chunk_bytes), np.uint8)
        self._kernels: dict[ElementType, HostKernels] = {}
        self._busy = threading.Lock()          # one caller at a time
        self._closed = False
        self._position: RingPosition | None = None
        self._engine: RingEngine | None = None
        self._op_seq = 0
        self._rings_built = 0
        self._window = max(1, -(-config.chunks_in_flight // config.sockets_per_peer))
        # links of torn-down rings, folded: (sent, received) totals
        self._retired = (LinkStats(), LinkStats())
        self._ops = {"completed": 0, "failed": 0}
        self._last_contributors = 0

    # ------------------------------------------------------------------ properties

    @property
    def address(self) -> Address:
        """Where peers connect; valid from construction."""
        return self._connector.address

    @property
    def state(self) -> GroupState:
        if self._closed:
            return GroupState.CLOSED
        if self._position is None:
            return GroupState.UNCONFIGURED
        if self._position.size == 1:
            return GroupState.READY
        if self._engine is None or self._engine.failure is not None:
            return GroupState.BROKEN
        return GroupState.READY

    @property
    def quorum_id(self) -> int | None:
        return self._position.quorum_id if self._position else None

    @property
    def size(self) -> int:
        return self._position.size if self._position else 0

    @property
    def rings_built(self) -> int:
        """How many rings this member has built (``reconfigure`` calls). Every frame
        carries the count of operations since the ring was built, so an all-reduce that
        succeeds is the same one since the build on every member: the first of some kind
        on a new ring is the first on all of them (the worker's DDP layout check)."""
        return self._rings_built

    def stats(self) -> FtarStats:
        out, inn = [self._retired[0]], [self._retired[1]]
        if self._engine is not None:
            ring_out, ring_in = self._engine.link_stats()
            out += ring_out
            inn += ring_in
        return FtarStats(
            ops_completed=self._ops["completed"], ops_failed=self._ops["failed"],
            frames_sent=sum(s.frames for s in out), bytes_sent=sum(s.payload_bytes for s in out),
            frames_received=sum(s.frames for s in inn),
            bytes_received=sum(s.payload_bytes for s in inn),
            max_inflight_bytes=max((s.max_inflight_bytes for s in out), default=0),
            inflight_limit_bytes=self._window * self.config.chunk_bytes,
            refused_connections=self._connector.refused,
            last_contributors=self._last_contributors)

    # ------------------------------------------------------------------ control plane

    def reconfigure(self, quorum_id: int, members: Sequence[Address], my_index: int) -> None:
        """Tear down the current ring and build the one of ``quorum_id``.

        ``members``: every member's ``address`` in ring order, this one at
        ``my_index``. The same ``quorum_id`` again rebuilds the ring after a failure.
        Raises ``PeerFailedError`` if a neighbour cannot be reached within
        ``connect_timeout``, ``StaleQuorumError`` if a neighbour is in a newer quorum,
        ``AuthenticationError`` on a secret mismatch.
        """
        with _Exclusive(self._busy, "reconfigure", None):
            position = self._validate_position(quorum_id, members, my_index)
            self._teardown()
            self._position = position
            self._op_seq = 0
            self._rings_built += 1
            self._connector.enter(position)
            if position.size == 1:
                return
            outgoing, incoming = self._connector.connect_ring(position)
            self._engine = RingEngine(position, outgoing, incoming, self.config, self._slots,
                                      self._reduce_bytes, self._socket_buffer_bytes,
                                      self._progress_hook)
            log.info("FTAR ring of quorum %d ready: member %d of %d", quorum_id, my_index,
                     position.size)

    def _validate_position(self, quorum_id: int, members: Sequence[Address],
                           my_index: int) -> RingPosition:
        if self._closed:
            raise FtarUsageError("reconfigure on a closed FtarGroup")
        if quorum_id < 0:
            raise FtarUsageError(f"quorum ids are 0 or more, got {quorum_id}")
        if not members or not 0 <= my_index < len(members):
            raise FtarUsageError(f"my_index {my_index} is not in a quorum of "
                                 f"{len(members)} members", quorum_id=quorum_id)
        if self._position is not None and quorum_id < self._position.quorum_id:
            raise FtarUsageError(f"quorum {quorum_id} is older than the current quorum "
                                 f"{self._position.quorum_id}", quorum_id=quorum_id)
        if int(members[my_index][1]) != self.address[1]:
            raise FtarUsageError(f"members[{my_index}] = {members[my_index]} is not this "
                                 f"member's address {self.address}", quorum_id=quorum_id)
        return RingPosition(quorum_id, tuple((str(h), int(p)) for h, p in members), my_index)

    def _teardown(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.stop()
            ring_out, ring_in = engine.link_stats()
            for total, links in zip(self._retired, (ring_out, ring_in)):
                total.frames += sum(link.frames for link in links)
                total.payload_bytes += sum(link.payload_bytes for link in links)
                total.max_inflight_bytes = max([total.max_inflight_bytes,
                                                *(link.max_inflight_bytes for link in links)])

    def close(self) -> None:
        """Stop the listener and the ring; the group cannot be used again."""
        if self._closed:
            return
        self._closed = True
        self._teardown()
        self._connector.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def member_lost(self, quorum_id: int, index: int, detail: str) -> bool:
        """Member ``index`` of quorum ``quorum_id``'s ring was reported lost (by the
        quorum's heartbeats): the running or next operation raises ``PeerFailedError``
        now instead of after ``timeout`` of silence, and the neighbours are told.
        ``index`` this member: it leaves the ring (the others' operation fails as
        if it were lost). Thread safe. False if that ring is no longer the current one."""
        engine = self._engine
        if (engine is None or engine.position.quorum_id != quorum_id
                or not 0 <= index < engine.position.size):
            return False
        engine.member_lost(index, detail)
        return True

    def relay_member_lost(self, address: Address, quorum_id: int, index: int) -> None:
        """Tell the member listening at ``address`` (another rank of this replica, in
        its own ring of ``quorum_id``) that member ``index`` is lost: an authenticated
        notice on its FTAR listener, within ``connect_timeout``. Raises
        ``StaleQuorumError`` if it is in another quorum, ``OSError`` if unreachable."""
        notice = Hello(quorum_id, 0, index, 0, 0, 0, 0, purpose=Purpose.MEMBER_LOST)
        connect(address, self._secret, notice, self.config.connect_timeout).close()

    def _relayed_lost(self, quorum_id: int, index: int) -> None:
        self.member_lost(quorum_id, index, "relayed by rank 0 of this replica")

    # ------------------------------------------------------------------ data plane

    def allreduce(self, array: np.ndarray, op: ReduceOp = ReduceOp.AVG,
                  contributes: bool = True, step: int | None = None, *,
                  dtype: str | None = None) -> np.ndarray:
        """Reduce ``array`` in place across the quorum and return it.

        ``contributes=False`` (a catching-up member): the array is zeroed and not
        counted in the average. ``dtype="bfloat16"`` reads a uint16 array as
        bfloat16 bits.
        """
        if not isinstance(array, np.ndarray):
            raise FtarUsageError(f"allreduce takes a numpy array, got {type(array).__name__}",
                                 step=step)
        etype = element_type_of(array, dtype)
        if not (array.flags.c_contiguous and array.flags.writeable):
            raise FtarUsageError("allreduce reduces in place: it needs a C-contiguous, "
                                 "writeable array (use np.ascontiguousarray and copy back)",
                                 step=step)
        flat = array.reshape(-1).view(etype.storage)
        self.reduce_flat(flat, etype, op=op, contributes=contributes, step=step)
        return array

    def reduce_flat(self, flat: np.ndarray, etype: ElementType, *, op: ReduceOp,
                    contributes: bool, step: int | None,
                    combiner: Combiner | None = None) -> int:
        """The engine behind every front end: reduce the 1-D host array ``flat``.

        ``combiner`` does the arithmetic (default: numpy in ``flat`` itself).
        Returns the number of members that contributed.
        """
        if flat.ndim != 1 or flat.dtype != etype.storage or not flat.flags.c_contiguous:
            raise FtarUsageError(f"reduce_flat needs a contiguous 1-D {etype.storage} array "
                                 f"for {etype.name.lower()}, got {flat.ndim}-D {flat.dtype}",
                                 step=step)
        with _Exclusive(self._busy, "allreduce", step):
            position = self._ready_position(step)
            if not contributes:
                flat.fill(0)
            if combiner is None:
                combiner = HostCombiner(flat, self._host_kernels(etype))
            own = 1 if contributes else 0
            if position.size == 1:
                count = own
            else:
                assert self._engine is not None
                plan = plan_ring(flat.size, etype.itemsize, position.size,
                                 self.config.chunk_bytes, self.config.chunks_in_flight,
                                 self._min_chunk_bytes)
                operation = Operation(op, etype, flat.size, self._op_seq, step, own,
                                      memoryview(flat.view(np.uint8)),  # type: ignore[arg-type]
                                      combiner)
                self._op_seq += 1
                try:
                    count = self._engine.run(operation, member_program(plan, position.index))
                except BaseException:
                    self._ops["failed"] += 1
                    raise
            combiner.finish()
            self._ops["completed"] += 1
            self._last_contributors = count
            return count

    def _host_kernels(self, etype: ElementType) -> HostKernels:
        kernels = self._kernels.get(etype)
        if kernels is None:
            largest = max(self.config.chunk_bytes, self._reduce_bytes) // etype.itemsize + 1
            kernels = self._kernels[etype] = HostKernels(etype, largest)
        return kernels

    def _ready_position(self, step: int | None) -> RingPosition:
        position = self._position
        if self._closed or position is None:
            raise FtarUsageError(f"allreduce on a group that is {self.state.value}; call "
                                 "reconfigure(quorum_id, members, my_index) first",
                                 quorum_id=self.quorum_id, step=step)
        if position.size > 1 and self._engine is None:
            raise FtarUsageError("allreduce after a failed reconfigure; reconfigure again",
                                 quorum_id=self.quorum_id, step=step)
        if self._engine is not None and self._engine.failure is not None:
            raise self._engine.failure
        return position


class _Exclusive:
    """Refuse concurrent use of one group: operations must run in the same order
    on every member, which concurrent callers cannot guarantee."""

    def __init__(self, lock: threading.Lock, what: str, step: int | None) -> None:
        self._lock = lock
        self._what = what
        self._step = step

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            raise FtarUsageError(f"{self._what} called while another FTAR call is running "
                                 "on this group; calls must be sequential", step=self._step)

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
