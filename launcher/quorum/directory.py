"""Where quorum agents find each other.

Agents bind port 0, so each publishes its address once it knows it. A replaced
replica publishes under the same ``replica_id`` with a higher ``incarnation``;
peers re-read a record when a peer has gone quiet, and learn a new address at
once from any authenticated message that replica sends (its envelope carries it).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ft_launch.files import atomic_write_text
from ft_launch.ids import sign, verify

log = logging.getLogger(__name__)

_DOMAIN = b"ftl-quorum-peer/1"


@dataclass(frozen=True)
class PeerRecord:
    replica_id: int
    address: str
    incarnation: int = 0

    def newer_than(self, other: PeerRecord | None) -> bool:
        if other is None:
            return True
        return (self.incarnation, self.address) != (other.incarnation, other.address) \
            and self.incarnation >= other.incarnation


class PeerDirectory(Protocol):
    """Publishes this agent's address and finds the others'."""

    def publish(self, record: PeerRecord) -> None: ...

    def lookup(self, replica_id: int) -> PeerRecord | None: ...


class StaticDirectory:
    """An in-memory mapping: for tests, or a launcher that knows the addresses.
    ``publish`` updates it, so agents of one process can share one."""

    def __init__(self, addresses: Mapping[int, str] | None = None) -> None:
        self._lock = threading.Lock()
        self._records = {r: PeerRecord(r, a) for r, a in (addresses or {}).items()}

    def publish(self, record: PeerRecord) -> None:
        with self._lock:
            self._records[record.replica_id] = record

    def lookup(self, replica_id: int) -> PeerRecord | None:
        with self._lock:
            return self._records.get(replica_id)


class FileDirectory:
    """One ``replica-<id>.json`` per replica in a directory every node can read
    (a Slurm job's shared filesystem), written atomically and signed with the job
    secret so another user cannot redirect the quorum to an address of theirs."""

    def __init__(self, path: str | os.PathLike[str], secret: str, job_id: str = "") -> None:
        self.path = Path(path)
        self._secret = secret
        self._job = job_id

    def file_for(self, replica_id: int) -> Path:
        return self.path / f"replica-{replica_id}.json"

    def publish(self, record: PeerRecord) -> None:
        body = {"replica_id": record.replica_id, "address": record.address,
                "incarnation": record.incarnation, "job_id": self._job,
                "mac": self._mac(record).hex()}
        # Not fsynced: after a crash the agent publishes again when it restarts.
        atomic_write_text(self.file_for(record.replica_id), json.dumps(body) + "\n",
                          durable=False)

    def lookup(self, replica_id: int) -> PeerRecord | None:
        path = self.file_for(replica_id)
        try:
            body = json.loads(path.read_text(encoding="utf-8"))
            record = PeerRecord(int(body["replica_id"]), str(body["address"]),
                                int(body["incarnation"]))
            mac = bytes.fromhex(body["mac"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
            # RecursionError: JSON nested deeper than the parser's stack.
            log.warning("ignoring unreadable peer record %s: %s", path, str(exc)[:200])
            return None
        if record.replica_id != replica_id or body.get("job_id") != self._job \
                or not verify(self._secret, mac, *self._parts(record)):
            log.warning("ignoring peer record %s: not signed for this job", path)
            return None
        return record

    def _mac(self, record: PeerRecord) -> bytes:
        return sign(self._secret, *self._parts(record))

    def _parts(self, record: PeerRecord) -> tuple[bytes, ...]:
        return (_DOMAIN, self._job.encode(), str(record.replica_id).encode(),
                record.address.encode(), str(record.incarnation).encode())
