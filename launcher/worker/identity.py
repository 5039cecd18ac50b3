"""Who a worker is, as the launcher tells it (environment of the replica step)."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ftcore.errors import UsageError

#: Variables ft-launch sets for every worker (runtime identity, not configuration).
ENV_JOB_ID = "FTLAUNCH_JOB_ID"
ENV_REPLICA_ID = "FTLAUNCH_REPLICA_ID"
ENV_NUM_REPLICAS = "FTLAUNCH_NUM_REPLICAS"
ENV_RUN_DIR = "FTLAUNCH_RUN_DIR"
ENV_SECRET = "FTLAUNCH_JOB_SECRET"
ENV_HOST = "FTLAUNCH_HOST"
ENV_RANK = "FTLAUNCH_RANK"
ENV_RANKS = "FTLAUNCH_RANKS"
ENV_CONFIG = "FTLAUNCH_CONFIG"
ENV_INCARNATION = "FTLAUNCH_INCARNATION"   # tells apart relaunches of a replica
ENV_HEARTBEAT = "FTLAUNCH_CONTROLLER_HEARTBEAT"   # the controller's heartbeat file


@dataclass(frozen=True)
class WorkerIdentity:
    job_id: str
    replica_id: int
    num_replicas: int
    rank: int            # index inside the replica
    ranks: int           # ranks per replica
    host: str            # address peers reach this worker at
    run_dir: Path        # shared by all replicas: peer directory, audit, checkpoints
    secret: str
    #: the controller's heartbeat file (None: no controller watches this worker)
    heartbeat: Path | None = None

    @staticmethod
    def from_env(env: Mapping[str, str] | None = None) -> WorkerIdentity:
        env = os.environ if env is None else env
        missing = [v for v in (ENV_REPLICA_ID, ENV_NUM_REPLICAS, ENV_RUN_DIR, ENV_SECRET)
                   if not env.get(v)]
        if missing:
            raise UsageError(f"worker environment lacks {', '.join(missing)}",
                             hint="start workers with 'ft-launch run', which sets them")
        try:
            replica_id, replicas = int(env[ENV_REPLICA_ID]), int(env[ENV_NUM_REPLICAS])
            # Inside a replica step Slurm numbers the tasks; outside Slurm the caller does.
            rank = int(env.get(ENV_RANK) or env.get("SLURM_PROCID") or 0)
            ranks = int(env.get(ENV_RANKS) or env.get("SLURM_NTASKS") or 1)
        except ValueError as exc:
            raise UsageError(f"worker environment has a non-integer id: {exc}") from None
        if not 0 <= replica_id < replicas or not 0 <= rank < ranks:
            raise UsageError(f"replica {replica_id} of {replicas} / rank {rank} of {ranks} "
                             "is out of range")
        return WorkerIdentity(
            job_id=env.get(ENV_JOB_ID) or env.get("SLURM_JOB_ID") or "local",
            replica_id=replica_id, num_replicas=replicas, rank=rank, ranks=ranks,
            host=env.get(ENV_HOST) or node_address(), run_dir=Path(env[ENV_RUN_DIR]),
            secret=env[ENV_SECRET],
            heartbeat=Path(env[ENV_HEARTBEAT]) if env.get(ENV_HEARTBEAT) else None)


def node_address() -> str:
    """This node's address as other nodes see it (its hostname's address)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
