"""Running dual-phase replay: the reduced job on every row, then on every column,
each group as one Slurm step (``SrunGroupLauncher``) or, for tests and
single-machine trials, as local processes (``LocalGroupLauncher``). Groups of a
phase run side by side (their machines are disjoint).

Each group's processes get ``FTL_WORKER_REPLAY_GROUP`` (``row2``/``col0``) and
``FTL_WORKER_REPLAY_NODES`` (comma-separated) in their environment.
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from ftcore.env import ENV_REPLAY_GROUP, ENV_REPLAY_NODES
from ftcore.slurm.client import SlurmCli
from ftcore.slurm.commands import StepSpec

from .replay import ReplayGrid, ReplayVerdict, locate

log = logging.getLogger(__name__)


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


class SrunGroupLauncher:
    """One ``srun`` step per group inside allocation ``job_id``."""

    def __init__(self, slurm: SlurmCli, command: Sequence[str], *, job_id: str | None = None,
                 tasks_per_node: int = 1, timeout: float = 600.0,
                 extra_args: Sequence[str] = ()) -> None:
        self.slurm = slurm
        self.command = tuple(command)
        self.job_id = job_id
        self.tasks_per_node = tasks_per_node
        self.timeout = timeout
        self.extra_args = tuple(extra_args)

    def run_group(self, label: str, nodes: tuple[str, ...]) -> GroupOutcome:
        spec = StepSpec(nodes=nodes, command=self.command, tasks_per_node=self.tasks_per_node,
                        name=f"ftl-replay-{label}", job_id=self.job_id,
                        extra_args=self.extra_args)
        proc = self.slurm.launch_step(spec, env=group_env(label, nodes), stdout=subprocess.PIPE)
        code, detail = _finish(proc, self.timeout)
        return GroupOutcome(label, nodes, code == 0, code, detail)


class LocalGroupLauncher:
    """Every node of a group as a local process with ``SLURMD_NODENAME`` set."""

    def __init__(self, command: Sequence[str], *, timeout: float = 120.0,
                 env: Mapping[str, str] | None = None) -> None:
        self.command = tuple(command)
        self.timeout = timeout
        self.env = dict(os.environ if env is None else env)

    def run_group(self, label: str, nodes: tuple[str, ...]) -> GroupOutcome:
        procs = [subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL,
                                  env={**self.env, **group_env(label, nodes),
                                       "SLURMD_NODENAME": node, "SLURM_PROCID": str(rank)})
                 for rank, node in enumerate(nodes)]
        results = [_finish(proc, self.timeout) for proc in procs]
        failed = [(node, code, text) for node, (code, text) in zip(nodes, results) if code != 0]
        if not failed:
            return GroupOutcome(label, nodes, True, 0)
        node, code, text = failed[0]
        return GroupOutcome(label, nodes, False, code, f"{node}: {text.strip()[-200:]}")


def _phase(launcher: GroupLauncher, prefix: str,
           groups: Sequence[tuple[str, ...]]) -> list[GroupOutcome]:
    with ThreadPoolExecutor(max_workers=max(1, len(groups))) as pool:
        return list(pool.map(lambda item: launcher.run_group(f"{prefix}{item[0]}", item[1]),
                             enumerate(groups)))


def run_replay(grid: ReplayGrid, launcher: GroupLauncher) -> tuple[ReplayVerdict,
                                                                   list[GroupOutcome]]:
    """Phase 1 on the rows, phase 2 on the columns, then the intersection."""
    rows = _phase(launcher, "row", grid.rows)
    columns = _phase(launcher, "col", grid.columns)
    verdict = locate(grid, [i for i, o in enumerate(rows) if not o.ok],
                     [j for j, o in enumerate(columns) if not o.ok])
    log.info("%s", verdict.describe())
    return verdict, rows + columns
