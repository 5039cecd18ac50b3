"""The data plane of one ring (one quorum): runs member programs over the links.

A ``RingEngine`` lives from one ``reconfigure`` to the next. ``run`` executes one
all-reduce: it submits the frames the program allows, then handles each incoming
frame in order (receive and add, or receive in place), returns a credit, and
submits the frames that unblocks, so that receiving, reducing and sending of
successive chunks overlap. It returns only when the right neighbour has every
frame, so the caller may then overwrite the array.

The first failure is recorded, announced to both neighbours (abort notices name
the failed member), and every socket is shut down so that blocked threads here
and at the neighbours wake at once. Later calls raise the same error.
"""

from __future__ import annotations

import enum
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ft_launch.config import FtarConfig
from ft_launch.errors import FtError

from .connections import RingPosition
from .dtypes import ElementType, HostKernels
from .errors import FailureKind, FtarUsageError, PeerFailedError
from .link import (
    FRAME_ABORT,
    FRAME_DATA,
    HEADER,
    InLink,
    LinkBroken,
    LinkStats,
    OutLink,
    RemoteAbort,
    SendItem,
    abort_notice,
    credit_abort_notice,
    shutdown_quietly,
)
from .schedule import MemberProgram, Span, Transfer
from .transport import tune_data_socket

log = logging.getLogger(__name__)

ABORT_NOTICE_WAIT = 0.2   # seconds to wait for a frame boundary to slip an abort notice in
LINGER = 2.0              # seconds a healthy ring waits to deliver queued frames on close


class ReduceOp(enum.Enum):
    """Wire codes are part of the frame header: do not renumber."""

    SUM = 1
    AVG = 2   # divided by the number of members that contributed real data


class Combiner(Protocol):
    """Where the arithmetic happens; the ring moves bytes of a host array.

    ``add``: fold ``incoming`` into the host array's ``span`` (reduce-scatter).
    ``scale``: divide a fully reduced span. ``landed``: an all-gathered span arrived
    in the host array. ``finish``: the operation completed.
    """

    def add(self, span: Span, incoming: np.ndarray) -> None: ...
    def scale(self, span: Span, divisor: int) -> None: ...
    def landed(self, span: Span) -> None: ...
    def finish(self) -> None: ...


class HostCombiner:
    """Reduce in place in the host array itself (numpy, CPU tensors)."""

    def __init__(self, flat: np.ndarray, kernels: HostKernels) -> None:
        self._flat = flat
        self._kernels = kernels

    def add(self, span: Span, incoming: np.ndarray) -> None:
        self._kernels.add(self._flat[span.start:span.stop], incoming)

    def scale(self, span: Span, divisor: int) -> None:
        self._kernels.divide(self._flat[span.start:span.stop], divisor)

    def landed(self, span: Span) -> None:
        pass

    def finish(self) -> None:
        pass


@dataclass
class Operation:
    """One all-reduce in progress."""

    op: ReduceOp
    etype: ElementType
    total: int
    seq: int                  # operations since reconfigure: members must agree
    step: int | None          # the caller's training step, for error messages
    own: int                  # 1 if this member contributes real data
    data: memoryview          # the host array's bytes
    combiner: Combiner
    current: Transfer | None = None


ProgressHook = Callable[[Transfer], None]


class RingEngine:
    """The links of one ring and the loop that runs operations over them."""

    def __init__(self, position: RingPosition, outgoing: list[socket.socket],
                 incoming: list[socket.socket], config: FtarConfig, slots: np.ndarray,
                 reduce_bytes: int, socket_buffer_bytes: int,
                 progress_hook: ProgressHook | None) -> None:
        self.position = position
        self.failure: FtError | None = None
        self._config = config
        self._slots = slots
        self._reduce_bytes = reduce_bytes
        self._hook = progress_hook
        self._lock = threading.Lock()
        self._step: int | None = None
        self._op_seq = 0
        # The kernel bounds each socket call by ``timeout`` (SO_RCVTIMEO/SO_SNDTIMEO); a
        # call that runs out with its frame incomplete fails the peer too, so a peer
        # that falls silent, even mid-frame, is reported within ``timeout``.
        wait = config.timeout
        for sock in outgoing + incoming:
            tune_data_socket(sock, wait, socket_buffer_bytes)
        window = max(1, -(-config.chunks_in_flight // config.sockets_per_peer))
        self.window = window
        self._out = [OutLink(sock, window, wait, position.right, self._on_send_failure,
                             f"ftar-send-q{position.quorum_id}-{i}")
                     for i, sock in enumerate(outgoing)]
        self._in = [InLink(sock, wait, position.left) for sock in incoming]

    # ------------------------------------------------------------------ operation

    def run(self, op: Operation, program: MemberProgram) -> int:
        """Execute ``program``; the number of contributing members, or raise."""
        if self.failure is not None:
            raise self.failure
        self._step, self._op_seq = op.step, op.seq
        try:
            return self._execute(op, program)
        except LinkBroken as exc:
            member = exc.member if isinstance(exc, RemoteAbort) else self.position.left
            self.fail(self._peer_failure(exc, member, op.current, op.step))
        except FtError as exc:
            self.fail(exc)
        except Exception as exc:
            self.fail(FtarUsageError(f"local error in FTAR: {exc!r}",
                                     quorum_id=self.position.quorum_id, step=op.step))
            raise self.failure from exc  # type: ignore[misc]
        except BaseException:
            self.fail(FtarUsageError("operation interrupted", step=op.step))
            raise
        assert self.failure is not None
        raise self.failure

    def _execute(self, op: Operation, program: MemberProgram) -> int:
        for transfer in program.first_sends:
            self._submit(op, transfer, op.own)
        count = op.own
        sockets = len(self._in)
        itemsize = op.etype.itemsize
        for receive in program.receives:
            transfer = op.current = receive.transfer
            link = self._in[transfer.seq % sockets]
            contributors = self._check_header(op, link.recv_header(), transfer)
            span = transfer.span
            if receive.reduce:
                self._receive_and_add(op, link, transfer)
                count = contributors + op.own
                if receive.owns and op.op is ReduceOp.AVG and count > 0:
                    op.combiner.scale(span, count)
            else:
                link.recv_exact(op.data[span.start * itemsize:span.stop * itemsize])
                op.combiner.landed(span)
                count = contributors
            link.credit()
            if receive.forward is not None:
                self._submit(op, receive.forward, count)
            for first in receive.start_next:
                self._submit(op, first, op.own)
            if self._hook is not None and receive.ends_step:
                self._hook(transfer)
        self._await_sends(op)
        return count

    def _receive_and_add(self, op: Operation, link: InLink, transfer: Transfer) -> None:
        """Receive a chunk piece by piece and add each piece while it is in cache."""
        itemsize = op.etype.itemsize
        slot = self._slots[transfer.seq % len(self._slots)]
        slot_bytes = memoryview(slot)
        piece = max(1, self._reduce_bytes // itemsize)
        base = start = transfer.span.start
        while start < transfer.span.stop:
            stop = min(start + piece, transfer.span.stop)
            lo, hi = (start - base) * itemsize, (stop - base) * itemsize
            link.recv_exact(slot_bytes[lo:hi])
            op.combiner.add(Span(start, stop), slot[lo:hi].view(op.etype.storage))
            start = stop

    def _submit(self, op: Operation, transfer: Transfer, count: int) -> None:
        itemsize = op.etype.itemsize
        payload = op.data[transfer.span.start * itemsize:transfer.span.stop * itemsize]
        header = HEADER.pack(FRAME_DATA, op.op.value, op.etype.value, 0, count, op.seq,
                             op.total, transfer.seq, 0, len(payload))
        self._out[transfer.seq % len(self._out)].submit(SendItem(header, payload, transfer))

    def _check_header(self, op: Operation, fields: tuple[int, ...], transfer: Transfer) -> int:
        kind, opcode, dtype, flags, contributors, seq, total, frame, _r, size = fields
        if kind == FRAME_ABORT:
            raise RemoteAbort(FailureKind.from_code(flags), contributors, self.position.left)
        mine = (FRAME_DATA, op.op.value, op.etype.value, op.seq, op.total, transfer.seq,
                transfer.span.size * op.etype.itemsize)
        if (kind, opcode, dtype, seq, total, frame, size) == mine:
            return contributors
        if kind == FRAME_DATA and seq != op.seq:
            # Not misuse: after a failure one member went on to its next all-reduce
            # while this one still ran the last (or the other way round).
            left = self.position.left
            raise PeerFailedError(
                FailureKind.OUT_OF_STEP, peer_index=left,
                peer_address=self.position.address_of(left),
                quorum_id=self.position.quorum_id, step=op.step,
                where=transfer.describe(self.position.size),
                detail=f"it sent all-reduce #{seq}, this member runs #{op.seq}")
        raise FtarUsageError(
            f"members disagree on the all-reduce: member {self.position.left} sent "
            f"{describe_frame(opcode, dtype, total, seq)} (frame {frame}, {size} bytes), "
            f"this member runs {describe_frame(op.op.value, op.etype.value, op.total, op.seq)}"
            f" (frame {transfer.seq}); every member must reduce the same dtype, size and op "
            "in the same order", quorum_id=self.position.quorum_id, step=op.step)

    def _await_sends(self, op: Operation) -> None:
        for link in self._out:
            fence = link.fence()
            last_progress = -1
            while not fence.wait(self._config.timeout) and self.failure is None:
                if link.progress == last_progress:
                    self.fail(self._peer_failure(
                        LinkBroken(FailureKind.TIMEOUT, "sends made no progress"),
                        self.position.right, op.current, op.step))
                    break
                last_progress = link.progress
        if self.failure is not None:
            raise LinkBroken(FailureKind.CLOSED, "see the recorded failure")

    # ------------------------------------------------------------------ failures

    def _peer_failure(self, exc: LinkBroken, member: int, transfer: Transfer | None,
                      step: int | None) -> PeerFailedError:
        position = self.position
        where = transfer.describe(position.size) if transfer is not None else ""
        return PeerFailedError(exc.kind, peer_index=member,
                               peer_address=position.address_of(member),
                               quorum_id=position.quorum_id, step=step, where=where,
                               detail=exc.detail)

    def _on_send_failure(self, exc: Exception, transfer: Transfer | None) -> None:
        """Called on a sender thread: record the failure and wake the caller."""
        if isinstance(exc, LinkBroken):
            member = exc.member if isinstance(exc, RemoteAbort) else self.position.right
            self.fail(self._peer_failure(exc, member, transfer, self._step))
        else:
            self.fail(FtarUsageError(f"local error while sending: {exc!r}",
                                     quorum_id=self.position.quorum_id, step=self._step))

    def member_lost(self, member: int, detail: str) -> None:
        """Ring member ``member`` was reported lost by another source (the quorum's
        heartbeats): fail now rather than after ``timeout`` of silence. Thread safe."""
        position = self.position
        self.fail(PeerFailedError(FailureKind.LOST, peer_index=member,
                                  peer_address=position.address_of(member),
                                  quorum_id=position.quorum_id, step=self._step, detail=detail))

    def fail(self, error: FtError) -> None:
        """Record the first failure, tell both neighbours who failed, wake everyone."""
        with self._lock:
            first = self.failure is None
            if first:
                self.failure = error
                log.warning("FTAR operation failed: %s", error)
        if first:
            kind, member = ((error.kind, error.peer_index) if isinstance(error, PeerFailedError)
                            else (FailureKind.ABORTED, self.position.index))
            for inn in self._in:
                inn.notify_abort(credit_abort_notice(kind, member))
            for out in self._out:
                out.notify_abort(abort_notice(kind, member, self._op_seq),
                                 wait=ABORT_NOTICE_WAIT)
        for sock in [o.sock for o in self._out] + [i.sock for i in self._in]:
            shutdown_quietly(sock)

    # ------------------------------------------------------------------ lifetime

    def link_stats(self) -> tuple[list[LinkStats], list[LinkStats]]:
        return [o.stats for o in self._out], [i.stats for i in self._in]

    def stop(self) -> None:
        """Close the ring; a healthy one first delivers what is still queued."""
        linger = 0.0 if self.failure is not None else min(self._config.timeout, LINGER)
        for out in self._out:
            out.stop(linger)
        for inn in self._in:
            inn.close()


def describe_frame(opcode: int, dtype: int, total: int, seq: int) -> str:
    op = ReduceOp(opcode).name if opcode in (1, 2) else f"op {opcode}"
    etype = ElementType(dtype).name.lower() if dtype in (1, 2, 3, 4) else f"dtype {dtype}"
    return f"{op} of {total} x {etype} (operation #{seq})"
