"""XID events from the kernel log (``NVRM: Xid (PCI:0000:3b:00): 79, ...``).

NVML reports XIDs only as events to a process that registered before they
happened; a one-shot prolog must read them from the kernel ring buffer instead
(as NHC does with dmesg). The parser is pure; ``read_kernel_xids`` reads
``/dev/kmsg`` without blocking.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass

log = logging.getLogger(__name__)

_XID = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F:.]+)\): (\d+)")


@dataclass(frozen=True)
class XidEvent:
    pci_bus_id: str      # normalised: dddd:bb:dd (lower case)
    xid: int
    uptime_s: float      # kernel timestamp, seconds since boot
    text: str


def normalise_bus_id(bus_id: str) -> str:
    """``00000000:3B:00.0`` (NVML) and ``0000:3b:00`` (kernel) -> ``0000:3b:00``."""
    parts = bus_id.strip().lower().split(".")[0].split(":")
    if len(parts) == 2:
        parts = ["0", *parts]
    domain, bus, device = parts[-3:]
    return f"{int(domain, 16):04x}:{bus}:{device}"


def parse_kmsg_record(record: str) -> XidEvent | None:
    """One ``/dev/kmsg`` record: ``prio,seq,usec,flags;message``."""
    head, sep, message = record.partition(";")
    if not sep:
        return None
    match = _XID.search(message)
    if not match:
        return None
    fields = head.split(",")
    usec = int(fields[2]) if len(fields) > 2 and fields[2].isdigit() else 0
    return XidEvent(normalise_bus_id(match.group(1)), int(match.group(2)), usec / 1e6,
                    message.strip()[:200])


def recent(events: Iterable[XidEvent], now_uptime_s: float, window_s: float) -> list[XidEvent]:
    """Events newer than ``window_s`` (0: every event since boot)."""
    return [e for e in events if window_s <= 0 or e.uptime_s >= now_uptime_s - window_s]


def read_kernel_xids(path: str = "/dev/kmsg", max_records: int = 100_000) -> list[XidEvent]:
    """Every XID record still in the kernel ring buffer; [] when it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        log.warning("cannot read %s for XID events: %s", path, exc)
        return []
    events: list[XidEvent] = []
    try:
        for _ in range(max_records):
            try:
                record = os.read(fd, 8192)
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # overwritten while reading: skip ahead
                    continue
                if exc.errno != errno.EAGAIN:
                    log.warning("reading %s: %s", path, exc)
                break
            if not record:
                break
            event = parse_kmsg_record(record.decode("utf-8", "replace"))
            if event is not None:
                events.append(event)
    finally:
        os.close(fd)
    return events


def uptime_s() -> float:
    """The kernel log's clock (monotonic since boot)."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)
