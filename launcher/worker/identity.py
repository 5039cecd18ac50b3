"""Who a worker is, as the launcher tells it (environment of the replica step)."""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ft_launch.env import (
    ENV_CONFIG,
    ENV_HEARTBEAT,
    ENV_HOST,
    ENV_INCARNATION,
    ENV_JOB_ID,
    ENV_NUM_REPLICAS,
    ENV_RANK,
    ENV_RANKS,
    ENV_REPLICA_ID,
    ENV_RUN_DIR,
    ENV_SECRET,
)
from ft_launch.errors import UsageError
from ft_launch.slurm.hostlist import expand

__all__ = ["ENV_CONFIG", "ENV_HEARTBEAT", "ENV_HOST", "ENV_INCARNATION", "ENV_JOB_ID",
           "ENV_NUM_REPLICAS", "ENV_RANK", "ENV_RANKS", "ENV_REPLICA_ID", "ENV_RUN_DIR",
           "ENV_SECRET", "WorkerIdentity", "replica_world_env", "task_world_env"]


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
    #: the node as Slurm names it (SLURMD_NODENAME; the hostname outside Slurm)
    node: str = ""

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
            node=env.get("SLURMD_NODENAME") or socket.gethostname(),
            secret=env[ENV_SECRET],
            heartbeat=Path(env[ENV_HEARTBEAT]) if env.get(ENV_HEARTBEAT) else None)


def node_address() -> str:
    """This node's address as other nodes see it (its hostname's address)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


# ---------------------------------------------------------------------- torch world

#: MASTER_PORT range: below Linux's ephemeral ports (32768-60999), above the usual services.
MASTER_PORT_BASE, MASTER_PORT_SPAN = 15000, 15000


def master_port(job_id: str, replica_id: int, launch: int) -> int:
    """The replica's rendezvous port for its ``launch``-th start: spread by job so
    jobs sharing a node rarely meet, and new each launch so a relaunch never waits
    for its dead predecessor's port."""
    digest = hashlib.sha256(f"{job_id}/{replica_id}/{launch}".encode()).digest()
    return MASTER_PORT_BASE + int.from_bytes(digest[:4], "big") % MASTER_PORT_SPAN


def replica_world_env(job_id: str, replica_id: int, launch: int, nodes: int,
                      tasks_per_node: int) -> dict[str, str]:
    """What every task of a replica's step shares of its torch world (the controller
    sets it; ``task_world_env`` adds each task's own part)."""
    return {"WORLD_SIZE": str(nodes * tasks_per_node),
            "LOCAL_WORLD_SIZE": str(tasks_per_node),
            "MASTER_PORT": str(master_port(job_id, replica_id, launch))}


def task_world_env(env: Mapping[str, str]) -> dict[str, str]:
    """This task's part of the replica's torch world, as torchrun would set it:
    ``RANK``/``LOCAL_RANK`` from Slurm's task ids, ``MASTER_ADDR`` the step's first
    node (where Slurm places task 0). Empty outside a Slurm step."""
    if "SLURM_PROCID" not in env or "SLURM_STEP_NODELIST" not in env:
        return {}
    return {"RANK": env["SLURM_PROCID"], "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
            "MASTER_ADDR": expand(env["SLURM_STEP_NODELIST"])[0]}
