"""Replicas as local processes on this machine (loopback): ``ft-launch local``, the
tests and ``benchmarks/fault_run.py``. ``ft-launch run`` does the same through Slurm
job steps.

``LocalJob`` starts and reads back the processes; ``LocalRun`` is the supervisor of
``ft-launch local``: it starts every replica, starts one that dies again (as
``torchrun --max-restarts`` would), and records what it did in the run directory's
``controller.jsonl``, so ``ft-launch status`` and ``timeline`` read a local run as
they read one under Slurm. Its ``--kill`` is a step observer in the worker
(``KillAfterCommit``).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ft_launch.config import Config
from ft_launch.env import ENV_INJECT, ENV_KILL_AFTER, ENV_OBSERVER, ENV_PREFIX
from ft_launch.errors import ExitCode, UsageError
from ft_launch.events import Event, EventLog, RunStarted, read_events
from ft_launch.ids import new_job_secret
from ft_launch.launcher.controller.events import ReplicaExited, ReplicaLaunched, RunFinished

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
    WorkerIdentity,
)
from .observer import StepObserver

log = logging.getLogger(__name__)

#: The one host of a local run, as its events name it.
LOCAL_NODE = "localhost"


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
    job_id: str = "local"       # names the run's files outside run_dir (/dev/shm, backups)
    # replica -> its incarnations, each the processes of its ranks
    procs: dict[int, list[list[subprocess.Popen[bytes]]]] = field(default_factory=dict)

    def env(self, replica_id: int, inject: str, rank: int = 0,
            incarnation: str = "0", master_port: int = 0) -> dict[str, str]:
        """A rank's environment. ``inject``: its scripted faults (``FTL_WORKER_INJECT``,
        for the step observer this process names, as ft-launch run's job steps
        inherit it: the tests' fault injector)."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(ENV_PREFIX) or k == ENV_OBSERVER}
        env.update(self.config_env)
        env.update({ENV_REPLICA_ID: str(replica_id), ENV_NUM_REPLICAS: str(self.replicas),
                    ENV_RUN_DIR: str(self.run_dir), ENV_SECRET: self.secret,
                    ENV_HOST: "127.0.0.1", ENV_JOB_ID: self.job_id, ENV_INJECT: inject,
                    ENV_RANK: str(rank), ENV_RANKS: str(self.ranks),
                    ENV_INCARNATION: incarnation,
                    "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
                    # The replica's torch world, as torchrun (or ft-launch run) sets it.
                    "RANK": str(rank), "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(self.ranks), "LOCAL_WORLD_SIZE": str(self.ranks),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port)})
        return env

    def start(self, replica_id: int, inject: str = "",
              extra_env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start every rank of ``replica_id`` (a new incarnation); returns rank 0.
        ``extra_env`` goes over each rank's environment."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        incarnation = str(len(self.procs.get(replica_id, [])))
        ranks = []
        port = free_port()
        with (self.run_dir / f"replica-{replica_id}.log").open("ab") as log:
            for rank in range(self.ranks):
                env = {**self.env(replica_id, inject, rank, incarnation, port),
                       **(extra_env or {})}
                ranks.append(subprocess.Popen(list(self.command), env=env, stdout=log,
                                              stderr=subprocess.STDOUT))
        self.procs.setdefault(replica_id, []).append(ranks)
        return ranks[0]

    def start_all(self, injects: Mapping[int, str] | None = None) -> None:
        for replica_id in range(self.replicas):
            self.start(replica_id, (injects or {}).get(replica_id, ""))

    def ranks_of(self, replica_id: int) -> list[subprocess.Popen[bytes]]:
        """Every rank of the replica's latest incarnation."""
        return self.procs[replica_id][-1]

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


@dataclass
class LocalRun:
    """``ft-launch local``: ``job``'s replicas supervised on this machine until every
    replica has finished. A replica whose rank fails (exits non-zero or is killed)
    loses its other ranks too (they would wait in their replica's collectives) and is
    started again, up to ``max_restarts`` times each, unless another replica has
    finished: the run is over then and there is nothing left to catch up from (a
    replica started again just after that exits ``ExitCode.RUN_FINISHED``, which counts
    as finished). ``kills``: replica -> the step after whose commit its first incarnation is killed
    (SIGKILL), to watch a recovery. Exit code: 0 if every replica finished, else the
    worst exit code of the replicas that did not."""

    job: LocalJob
    max_restarts: int = 3
    kills: Mapping[int, int] = field(default_factory=dict)
    poll_s: float = 0.2
    restarts: dict[int, int] = field(default_factory=dict)   # replica -> times started again
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> int:
        job = self.job
        job.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        with EventLog(job.run_dir / "controller.jsonl") as events:
            events.emit(RunStarted(job_id=job.job_id, replicas=job.replicas,
                                   nodes=[LOCAL_NODE]))
            for replica_id in range(job.replicas):
                kill = self.kills.get(replica_id)
                job.start(replica_id, extra_env=None if kill is None else kill_after_commit(kill))
                events.emit(ReplicaLaunched(replica_id=replica_id, nodes=[LOCAL_NODE],
                                            how="initial"))
            try:
                codes = self._supervise(events)
            finally:
                job.stop_everything()
            failed = {r: c for r, c in codes.items() if c != 0}
            code = max(failed.values(), key=abs) if failed else 0
            reason = ("training finished" if not failed else
                      f"replica(s) {sorted(failed)} ended with exit code(s) "
                      f"{[failed[r] for r in sorted(failed)]}")
            if self.stop.is_set():
                reason, code = "stopped (SIGINT or SIGTERM)", code or 130
            events.emit(RunFinished(exit_code=code, reason=reason))
            log.info("local run %s: %s", job.run_dir, reason)
            return code

    def _supervise(self, events: EventLog) -> dict[int, int]:
        """Until every replica's latest incarnation has ended: its exit code each."""
        ended: dict[int, int] = {}
        while len(ended) < self.job.replicas and not self.stop.wait(self.poll_s):
            for replica_id in range(self.job.replicas):
                if replica_id in ended:
                    continue
                code = self._exit_code(replica_id)
                if code is None:
                    continue
                events.emit(ReplicaExited(replica_id=replica_id, exit_code=code))
                finished = any(c == 0 for c in ended.values())
                restarts = self.restarts.get(replica_id, 0)
                if code == ExitCode.RUN_FINISHED:
                    log.info("replica %d came back after the run finished", replica_id)
                    code = 0
                if code == 0 or finished or restarts >= self.max_restarts:
                    if code != 0:
                        log.error("replica %d exited with %d; not started again (%s)",
                                  replica_id, code, "the run has finished" if finished
                                  else f"{self.max_restarts} restart(s) used")
                    ended[replica_id] = code
                    continue
                self.restarts[replica_id] = restarts + 1
                log.warning("replica %d exited with %d: starting it again (restart %d of %d)",
                            replica_id, code, restarts + 1, self.max_restarts)
                self.job.start(replica_id)
                events.emit(ReplicaLaunched(replica_id=replica_id, nodes=[LOCAL_NODE],
                                            how="restart"))
        return ended

    def _exit_code(self, replica_id: int) -> int | None:
        """None while every rank of the replica runs; else the first failure's exit code
        (the other ranks are ended), or 0 once every rank has exited 0."""
        ranks = self.job.ranks_of(replica_id)
        codes = [p.poll() for p in ranks]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            for proc in ranks:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            return failed[0]
        return 0 if all(c == 0 for c in codes) else None


def kill_after_commit(step: int) -> dict[str, str]:
    """The environment of a replica that ``ft-launch local --kill`` kills after it
    commits ``step`` (its first incarnation: ``LocalRun`` starts the next without)."""
    return {ENV_OBSERVER: f"{__name__}:KillAfterCommit", ENV_KILL_AFTER: str(step)}


class KillAfterCommit(StepObserver):
    """``ft-launch local --kill``, in the worker: SIGKILL right after committing the
    step ``FTL_WORKER_KILL_AFTER`` names, to watch the replica recover (every rank
    alike: a node lost)."""

    def __init__(self, config: Config, identity: WorkerIdentity) -> None:
        try:
            self.step = int(os.environ.get(ENV_KILL_AFTER, ""))
        except ValueError:
            raise UsageError(f"{ENV_KILL_AFTER}={os.environ.get(ENV_KILL_AFTER)!r}: expected "
                             "a step number", hint="ft-launch local --kill sets it") from None

    def after_commit(self, step: int) -> None:
        if step == self.step:
            log.warning("ft-launch local --kill: killed after committing step %d", step)
            os.kill(os.getpid(), signal.SIGKILL)
