"""Running dual-phase replay: the reduced job on every row, then on every column,
each group as one Slurm step (``SrunGroupLauncher``) or, for tests and
single-machine trials, as local processes (``LocalGroupLauncher``). Groups of a
phase run side by side (their machines are disjoint).

Each group's processes get ``FTL_WORKER_REPLAY_GROUP`` (``row2``/``col0``) and
``FTL_WORKER_REPLAY_NODES`` (comma-separated) in their environment, and whatever
the launcher's ``env`` adds for the group. ``run_phases`` leaves judging to the
caller (``ft_launch.health.replay.judge``: against a reference); ``run_replay`` judges by
exit codes alone (a job that exits non-zero on a wrong result).
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ft_launch.env import ENV_REPLAY_GROUP, ENV_REPLAY_NODES
from ft_launch.slurm.client import SlurmBackend, cancel_named_step, launch_logged
from ft_launch.slurm.commands import StepSpec

from .replay import ReplayGrid, ReplayVerdict, locate

log = logging.getLogger(__name__)

#: How often a waiting launcher looks whether it was cancelled.
CANCEL_POLL_INTERVAL = 0.2

#: What a group's processes get besides the group's label and nodes.
GroupEnv = Callable[[str, tuple[str, ...]], Mapping[str, str]]


@dataclass(frozen=True)
class GroupOutcome:
    label: str
    nodes: tuple[str, ...]
    ok: bool
    exit_code: int
    detail: str = ""


class GroupLauncher(Protocol):
    def run_group(self, label: str, nodes: tuple[str, ...]) -> GroupOutcome: ...


def group_env(label: str, nodes: Sequence[str]) -> dict[str, str]:
    return {ENV_REPLAY_GROUP: label, ENV_REPLAY_NODES: ",".join(nodes)}


def _finish(proc: subprocess.Popen[bytes], timeout: float) -> tuple[int, str]:
    """Wait for ``proc`` up to ``timeout``; a process over time is ended (TERM, then KILL)."""
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, (out or b"").decode(errors="replace")[-500:]
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        return -1, f"timed out after {timeout:g}s"


def _finish_group(procs: Sequence[subprocess.Popen[bytes]], timeout: float
                  ) -> list[tuple[int, tuple[int, str]]]:
    """(index, (exit code, output tail)) of each process as it ends; as Slurm's
    ``--kill-on-bad-exit`` would, it ends the others (they would wait for it)."""
    order: list[int] = []
    with ThreadPoolExecutor(max_workers=max(1, len(procs))) as pool:
        waits = {pool.submit(_finish, proc, timeout): index for index, proc in enumerate(procs)}
        for done in as_completed(waits):
            order.append(waits[done])
            if done.result()[0] != 0:
                for proc in procs:
                    if proc.poll() is None:
                        proc.kill()
        results = {index: wait.result() for wait, index in waits.items()}
    return [(index, results[index]) for index in order]


class SrunGroupLauncher:
    """One ``srun`` step per group inside allocation ``job_id``. With ``log_dir`` each
    task writes ``<log_dir>/<label>.<task>.log``, a step over time is cancelled by
    name, and ``cancel`` ends every step still running."""

    def __init__(self, slurm: SlurmBackend, command: Sequence[str], *,
                 job_id: str | None = None, tasks_per_node: int = 1, timeout: float = 600.0,
                 extra_args: Sequence[str] = (), env: GroupEnv | None = None,
                 overlap: bool = False, log_dir: Path | None = None) -> None:
        self.slurm = slurm
        self.command = tuple(command)
        self.job_id = job_id
        self.tasks_per_node = tasks_per_node
        self.timeout = timeout
        self.extra_args = tuple(extra_args)
        self.env = env
        self.overlap = overlap
        self.log_dir = log_dir
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    def run_group(self, label: str, nodes: tuple[str, ...]) -> GroupOutcome:
        spec = StepSpec(nodes=nodes, command=self.command, tasks_per_node=self.tasks_per_node,
                        name=f"ftl-replay-{label}", job_id=self.job_id, overlap=self.overlap,
                        extra_args=self.extra_args)
        env = {**group_env(label, nodes), **(self.env(label, nodes) if self.env else {})}
        if self.log_dir is None:
            proc = self.slurm.launch_step(spec, env=env, stdout=subprocess.PIPE)
            code, detail = _finish(proc, self.timeout)
        else:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            proc = launch_logged(self.slurm, spec, self.log_dir / label, env)
            code, detail = self._wait_logged(spec.name, proc, label)
        return GroupOutcome(label, nodes, code == 0, code, detail)

    def _wait_logged(self, name: str, proc: subprocess.Popen[bytes], label: str
                     ) -> tuple[int, str]:
        waited = 0.0
        while waited < self.timeout and not self._cancelled.is_set():
            try:
                code = proc.wait(timeout=min(CANCEL_POLL_INTERVAL, self.timeout - waited))
            except subprocess.TimeoutExpired:
                waited += CANCEL_POLL_INTERVAL
                continue
            detail = "" if code == 0 else \
                f"exited with {code} (see {self.log_dir}/{label}.*.log)"
            return code, detail
        cancel_named_step(self.slurm, self.job_id or "", name, proc)
        return -1, ("cancelled" if self._cancelled.is_set()
                    else f"timed out after {self.timeout:g} s")


class LocalGroupLauncher:
    """Every node of a group as a local process with ``SLURMD_NODENAME`` set, and the
    group's torch world (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``; ``MASTER_PORT``
    from ``env``) as a Slurm step would give it, one task per node."""

    def __init__(self, command: Sequence[str], *, timeout: float = 120.0,
                 env: Mapping[str, str] | None = None, group: GroupEnv | None = None) -> None:
        self.command = tuple(command)
        self.timeout = timeout
        self.env = dict(os.environ if env is None else env)
        self.group = group

    def run_group(self, label: str, nodes: tuple[str, ...]) -> GroupOutcome:
        extra = {**group_env(label, nodes), **(self.group(label, nodes) if self.group else {})}
        procs = [subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL,
                                  env={**self.env, **extra, "SLURMD_NODENAME": node,
                                       "SLURM_PROCID": str(rank), "RANK": str(rank),
                                       "LOCAL_RANK": "0", "WORLD_SIZE": str(len(nodes)),
                                       "MASTER_ADDR": "127.0.0.1"})
                 for rank, node in enumerate(nodes)]
        results = _finish_group(procs, self.timeout)
        failed = [(nodes[i], code, text) for i, (code, text) in results if code != 0]
        if not failed:
            return GroupOutcome(label, nodes, True, 0)
        node, code, text = failed[0]
        return GroupOutcome(label, nodes, False, code, f"{node}: {text.strip()[-200:]}")


def _phase(launcher: GroupLauncher, prefix: str,
           groups: Sequence[tuple[str, ...]]) -> list[GroupOutcome]:
    with ThreadPoolExecutor(max_workers=max(1, len(groups))) as pool:
        return list(pool.map(lambda item: launcher.run_group(f"{prefix}{item[0]}", item[1]),
                             enumerate(groups)))


def run_phases(grid: ReplayGrid, launcher: GroupLauncher,
               before_columns: Callable[[], None] | None = None
               ) -> tuple[list[GroupOutcome], list[GroupOutcome]]:
    """Phase 1 on the rows, then phase 2 on the columns (``before_columns`` runs
    between them: a launcher's new time limit, say)."""
    rows = _phase(launcher, "row", grid.rows)
    if before_columns is not None:
        before_columns()
    return rows, _phase(launcher, "col", grid.columns)


def run_replay(grid: ReplayGrid, launcher: GroupLauncher) -> tuple[ReplayVerdict,
                                                                   list[GroupOutcome]]:
    """Both phases, each group judged by its exit code, then the intersection."""
    rows, columns = run_phases(grid, launcher)
    verdict = locate(grid, [i for i, o in enumerate(rows) if not o.ok],
                     [j for j, o in enumerate(columns) if not o.ok])
    log.info("%s", verdict.describe())
    return verdict, rows + columns
