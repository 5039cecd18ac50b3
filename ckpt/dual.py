"""Two alternating state buffers with explicit states and reader leases.

Shared by the rank's own snapshots (``snapshot.py``) and the backups it keeps
for a peer (``backup.py``): a write always goes into the buffer that does not
hold the newest complete copy, so that copy stays readable until the new one
is complete. A copying writer never waits for readers: if the buffer it would
reuse is leased, ``begin`` declines and the caller skips that copy. Resident
state (``resident.py``), whose optimizer step must write somewhere, waits a
bounded time instead.

A copy may be committed without checksums (snapshots: see ``snapshot``); the
first lease that needs them computes them from the leased bytes, once, and
keeps them in the slot's manifest for every later reader.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .errors import NoCheckpointError
from .manifest import Bytes, Manifest, add_checksums

log = logging.getLogger(__name__)

Allocator = Callable[[int], Bytes]


class SlotState(enum.Enum):
    EMPTY = "empty"
    COPYING = "copying"
    COMPLETE = "complete"
    FAILED = "failed"


#: The only moves a buffer makes; anything else is a bug.
TRANSITIONS: dict[SlotState, frozenset[SlotState]] = {
    SlotState.EMPTY: frozenset({SlotState.COPYING}),
    SlotState.COPYING: frozenset({SlotState.COMPLETE, SlotState.FAILED}),
    SlotState.COMPLETE: frozenset({SlotState.COPYING}),
    SlotState.FAILED: frozenset({SlotState.COPYING}),
}


@dataclass
class Slot:
    """One buffer; ``buffer`` is written only while the slot is COPYING."""

    index: int
    buffer: Bytes | None = None
    state: SlotState = SlotState.EMPTY
    manifest: Manifest | None = None
    readers: int = 0
    #: Held while computing this copy's checksums, so concurrent readers compute them once.
    checksum_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def move(self, new: SlotState) -> None:
        if new not in TRANSITIONS[self.state]:
            raise AssertionError(f"state buffer {self.index}: {self.state.value} -> "
                                 f"{new.value} is not an allowed transition")
        self.state = new


@dataclass(frozen=True)
class Snapshot:
    """A complete copy under lease: its manifest and a read-only view of its bytes."""

    manifest: Manifest
    buffer: Bytes

    @property
    def step(self) -> int:
        return self.manifest.step


class LeaseProvider(Protocol):
    """Anything that lends complete snapshots for reading (see ``DualBuffer.lease``)."""

    def lease(self, step: int | None = None, timeout: float = 0.0, *,
              checksums: bool = True) -> contextlib.AbstractContextManager[Snapshot]: ...


def numpy_allocator(nbytes: int) -> Bytes:
    buffer = np.empty(nbytes, dtype=np.uint8)
    buffer[::4096] = 0  # touch every page now, not during the first copy
    return buffer


class DualBuffer:
    """The two slots, which one is newest, and who is reading what."""

    def __init__(self, allocator: Allocator = numpy_allocator, name: str = "state") -> None:
        self.name = name
        self._allocator = allocator
        self._cond = threading.Condition()
        self._slots = (Slot(0), Slot(1))
        self._latest: Slot | None = None

    def begin(self, total_bytes: int, wait: float = 0.0) -> Slot | None:
        """Claim the older slot for writing ``total_bytes``; None if it is still
        being read after ``wait`` seconds (copies skip; resident state waits)."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._older().readers, wait):
                return None
            slot = self._older()
            slot.move(SlotState.COPYING)
            slot.manifest = None
        # Allocating outside the lock is safe: nobody reads a COPYING slot.
        if slot.buffer is None or slot.buffer.nbytes < total_bytes:
            log.info("%s: allocating buffer %d of %d bytes", self.name, slot.index, total_bytes)
            slot.buffer = None  # free the old one before allocating the new
            slot.buffer = self._allocator(max(total_bytes, 1))
        return slot

    def _older(self) -> Slot:
        """The slot that does not hold the newest complete copy."""
        return self._slots[0] if self._latest is None else self._slots[1 - self._latest.index]

    def commit(self, slot: Slot, manifest: Manifest) -> None:
        """The copy in ``slot`` is complete and checked: make it the newest."""
        with self._cond:
            slot.manifest = manifest
            slot.move(SlotState.COMPLETE)
            self._latest = slot
            self._cond.notify_all()

    def fail(self, slot: Slot) -> None:
        with self._cond:
            slot.manifest = None
            slot.move(SlotState.FAILED)
            self._cond.notify_all()

    def latest_step(self) -> int | None:
        """Step of the newest complete copy; None before the first one."""
        with self._cond:
            latest = self._latest
            return latest.manifest.step if latest and latest.manifest else None

    def complete_steps(self) -> list[int]:
        """Steps of the complete copies held, oldest first."""
        with self._cond:
            return sorted(s.manifest.step for s in self._slots
                          if s.state is SlotState.COMPLETE and s.manifest is not None)

    def wait_newer(self, step: int | None, timeout: float) -> int | None:
        """Wait until the newest complete step differs from ``step``; the newest step."""
        with self._cond:
            self._cond.wait_for(lambda: self.latest_step() != step, timeout)
            return self.latest_step()

    def states(self) -> tuple[SlotState, SlotState]:
        with self._cond:
            return (self._slots[0].state, self._slots[1].state)

    @contextlib.contextmanager
    def lease(self, step: int | None = None, timeout: float = 0.0, *,
              checksums: bool = True) -> Iterator[Snapshot]:
        """Hold the newest complete copy (or the one of ``step``) while reading it.

        With ``step`` and a ``timeout``, waits for that step's copy to complete;
        raises ``NoCheckpointError`` if it does not, or was already replaced.
        With ``checksums`` (the default) the manifest carries every tensor's
        CRC-32, computed here on first use; ``checksums=False`` is for readers
        that only stream bytes whose manifest was already sent.
        """
        with self._cond:
            self._cond.wait_for(lambda: self._settled(step), timeout)
            slot = self._find(step)
            if slot is None:
                wanted = f" of step {step}" if step is not None else ""
                raise NoCheckpointError(f"{self.name}: no complete copy{wanted}",
                                        reasons=(f"newest complete step {self.latest_step()}",))
            slot.readers += 1
        try:
            assert slot.buffer is not None and slot.manifest is not None
            view = slot.buffer[:slot.manifest.total_bytes]
            view.flags.writeable = False
            manifest = self._checksummed(slot, view) if checksums else slot.manifest
            yield Snapshot(manifest, view)
        finally:
            with self._cond:
                slot.readers -= 1
                self._cond.notify_all()

    def _checksummed(self, slot: Slot, view: Bytes) -> Manifest:
        """The leased slot's manifest with checksums, computing and keeping them if missing.

        Safe outside ``_cond``: a leased slot is never rewritten.
        """
        with slot.checksum_lock:
            assert slot.manifest is not None
            if not slot.manifest.checksummed:
                manifest = add_checksums(slot.manifest, view)
                with self._cond:
                    slot.manifest = manifest
            return slot.manifest

    def _settled(self, step: int | None) -> bool:
        if self._find(step) is not None:
            return True
        newest = self.latest_step()
        return step is not None and newest is not None and newest > step

    def _find(self, step: int | None) -> Slot | None:
        if step is None:
            return self._latest
        for slot in self._slots:
            if slot.state is SlotState.COMPLETE and slot.manifest and slot.manifest.step == step:
                return slot
        return None
