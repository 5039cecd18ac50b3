"""Where each rank's process can be found: ``<run_dir>/pids/replica-R-rank-K.json``.

A rank writes its file when its ``Manager`` starts (``{"replica_id", "rank", "node",
"pid"}``; the pid is in its node's process namespace). The controller reads them
when a replica hangs: it runs ``py-spy`` on each node against the pids listed for
that node (``ft_launch.launcher.controller.diagnosis``), and knows which rank sits on which node. It
clears a replica's files before each launch, so what it finds was written by the
replica's current processes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ft_launch.files import atomic_write_text

from .identity import WorkerIdentity

PIDS_DIR = "pids"
#: A pid file is one short JSON object; more than this is not one of ours.
MAX_PID_FILE_BYTES = 4096


@dataclass(frozen=True)
class RankProcess:
    replica_id: int
    rank: int
    node: str
    pid: int


def pid_file(run_dir: Path, replica_id: int, rank: int) -> Path:
    return run_dir / PIDS_DIR / f"replica-{replica_id}-rank-{rank}.json"


def write_rank_pid(identity: WorkerIdentity, pid: int | None = None) -> Path:
    """This process's file (not fsynced: it matters only while the process lives)."""
    record = {"replica_id": identity.replica_id, "rank": identity.rank,
              "node": identity.node, "pid": os.getpid() if pid is None else pid}
    return atomic_write_text(pid_file(identity.run_dir, identity.replica_id, identity.rank),
                             json.dumps(record) + "\n", durable=False)


def read_rank_pids(run_dir: Path, replica_id: int) -> tuple[list[RankProcess], list[str]]:
    """The replica's rank processes in rank order, and a line for each file that could
    not be read (it names the file and what is wrong with it)."""
    found, problems = [], []
    for path in sorted((run_dir / PIDS_DIR).glob(f"replica-{replica_id}-rank-*.json")):
        try:
            with path.open("rb") as handle:
                raw = handle.read(MAX_PID_FILE_BYTES + 1)
            if len(raw) > MAX_PID_FILE_BYTES:
                raise ValueError(f"longer than {MAX_PID_FILE_BYTES} bytes")
            record = json.loads(raw)
            process = RankProcess(int(record["replica_id"]), int(record["rank"]),
                                  str(record["node"]), int(record["pid"]))
        except (OSError, ValueError, KeyError, TypeError) as error:
            problems.append(f"{path}: unreadable pid file ({error}); expected "
                            '{"replica_id", "rank", "node", "pid"}')
            continue
        if process.replica_id == replica_id:
            found.append(process)
    return sorted(found, key=lambda p: p.rank), problems


def clear_rank_pids(run_dir: Path, replica_id: int) -> None:
    """Before a launch: the files of the replica's previous processes go."""
    for path in (run_dir / PIDS_DIR).glob(f"replica-{replica_id}-rank-*.json"):
        path.unlink(missing_ok=True)
