"""Replicas as local processes on this machine (loopback): for development, the
tests and ``benchmarks/fault_run.py``. ``ft-launch run`` does the same through
Slurm job steps."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ft_launch.env import ENV_INJECT, ENV_PREFIX
from ft_launch.events import Event, read_events
from ft_launch.ids import new_job_secret

from . import events as worker_events
from .identity import (
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


def free_port() -> int:
    """A loopback port free now (the replica's rank 0 binds it moments later)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class LocalJob:
    """``replicas`` copies of ``command``, each replica ``ranks`` processes."""

    run_dir: Path
    replicas: int
    command: Sequence[str]
    config_env: Mapping[str, str] = field(default_factory=dict)   # FTL_* settings
    ranks: int = 1
    secret: str = field(default_factory=new_job_secret)
    # replica -> its incarnations, each the processes of its ranks
    procs: dict[int, list[list[subprocess.Popen[bytes]]]] = field(default_factory=dict)

    def env(self, replica_id: int, inject: str, rank: int = 0,
            incarnation: str = "0", master_port: int = 0) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
        env.update(self.config_env)
        env.update({ENV_REPLICA_ID: str(replica_id), ENV_NUM_REPLICAS: str(self.replicas),
                    ENV_RUN_DIR: str(self.run_dir), ENV_SECRET: self.secret,
                    ENV_HOST: "127.0.0.1", ENV_JOB_ID: "local", ENV_INJECT: inject,
                    ENV_RANK: str(rank), ENV_RANKS: str(self.ranks),
                    ENV_INCARNATION: incarnation,
                    "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
                    # The replica's torch world, as torchrun (or ft-launch run) sets it.
                    "RANK": str(rank), "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(self.ranks), "LOCAL_WORLD_SIZE": str(self.ranks),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port)})
        return env

    def start(self, replica_id: int, inject: str = "") -> subprocess.Popen[bytes]:
        """Start every rank of ``replica_id`` (a new incarnation); returns rank 0."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        incarnation = str(len(self.procs.get(replica_id, [])))
        ranks = []
        port = free_port()
        with (self.run_dir / f"replica-{replica_id}.log").open("ab") as log:
            for rank in range(self.ranks):
                ranks.append(subprocess.Popen(
                    list(self.command), env=self.env(replica_id, inject, rank, incarnation, port),
                    stdout=log, stderr=subprocess.STDOUT))
        self.procs.setdefault(replica_id, []).append(ranks)
        return ranks[0]

    def start_all(self, injects: Mapping[int, str] | None = None) -> None:
        for replica_id in range(self.replicas):
            self.start(replica_id, (injects or {}).get(replica_id, ""))

    def current(self, replica_id: int) -> subprocess.Popen[bytes]:
        """Rank 0 of the replica's latest incarnation."""
        return self.procs[replica_id][-1][0]

    def resume(self, replica_id: int) -> None:
        """SIGCONT every rank of the replica's latest incarnation (after a ``stop`` fault)."""
        for proc in self.procs[replica_id][-1]:
            proc.send_signal(signal.SIGCONT)

    def wait_all(self, timeout: float) -> dict[int, int]:
        """Worst exit code of each replica's latest incarnation."""
        return {r: max((p.wait(timeout=timeout) for p in incarnations[-1]), key=abs)
                for r, incarnations in self.procs.items()}

    def stop_everything(self) -> None:
        """End every process this job started (resuming stopped ones first)."""
        for incarnations in self.procs.values():
            for proc in (p for ranks in incarnations for p in ranks):
                if proc.poll() is None:
                    proc.send_signal(signal.SIGCONT)
                    proc.kill()
                    proc.wait(timeout=30)

    # ------------------------------------------------------------------ reading back

    def events(self, replica_id: int, rank: int = 0) -> list[Event]:
        path = self.run_dir / "events" / f"replica-{replica_id}-rank-{rank}.jsonl"
        return list(read_events(path)) if path.exists() else []

    def committed(self, replica_id: int) -> list[worker_events.StepCommitted]:
        return [e for e in self.events(replica_id)
                if isinstance(e, worker_events.StepCommitted)]

    def last_committed_step(self, replica_id: int) -> int:
        return max((e.step for e in self.committed(replica_id)), default=-1)

    def finals(self) -> dict[int, dict[str, object]]:
        return {r: json.loads((self.run_dir / "final" / f"replica-{r}-rank-0.json").read_text())
                for r in range(self.replicas)}

    def log(self, replica_id: int) -> str:
        return (self.run_dir / f"replica-{replica_id}.log").read_text(errors="replace")
