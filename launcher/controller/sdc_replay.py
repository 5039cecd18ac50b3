"""Dual-phase replay in ``ft-launch run``: which node of a replica computes NaN/Inf.

The controller orders it (``replay_rule.RunReplay``) once a replica of several
nodes has discarded ``recovery.nonfinite_limit`` steps with NaN/Inf gradients of
its own, and has cancelled that replica (the others train on). The supervisor runs
each replay on a thread of its own (``SdcReplay``), bounded by
``recovery.replay_timeout``, so its poll loop goes on watching the others:

1. capture: the newest step S of a training replica, every rank's shard fetched
   from its state server as a catch-up would (``ft_launch.ckpt.fetch``; the servers are in
   ``replay/servers/``), rank 0's newest step, then the same step of the other
   ranks, into ``replay/<id>/state/``: pinned, since that replica trains on;
2. the grid: the replica's N nodes are column 0, N x (N - 1) healthy reference
   nodes the other columns (``ft_launch.health.replay.plan_replay_grid``, PP = DP = N): each
   row and each column is N nodes, the replica's world layout;
3. phase 1 runs every row, phase 2 every column, each group one Slurm step
   (``srun --overlap``: reference nodes may be training) of the replica's own
   training command in replay mode (``ft_launch.launcher.worker.replay``): step S + 1,
   digested; the groups of a phase run side by side;
4. judge: a group fails when it did not finish, counted NaN/Inf, or its digests
   differ from the reference columns' (healthy nodes only, which must agree); the
   failing row x failing column is the node (``ft_launch.health.replay.judge``);
5. the report goes to ``replay/<id>/report.json`` and ``report.txt``, its summary
   into the controller's event log (``SdcReplayReported``) and ``ft-launch
   status``; the outcome comes back to the decision as ``ReplayLocated``.

The capture holds one rank's shard in the controller's memory at a time, and the
replay's state files take one replica's state on the run directory's file system.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ft_launch.ckpt.errors import FetchError
from ft_launch.ckpt.fetch import Peer, fetch_state
from ft_launch.env import ENV_NUM_REPLICAS, ENV_REPLAY, ENV_REPLICA_ID
from ft_launch.errors import FtError
from ft_launch.files import atomic_write_text
from ft_launch.health.replay import GroupResult, Judgement, ReplayGrid, judge, plan_replay_grid
from ft_launch.health.replay_runner import GroupOutcome, SrunGroupLauncher, run_phases
from ft_launch.slurm.client import SlurmBackend

from ..worker.identity import replica_world_env
from ..worker.replay_files import (
    ReplayFileError,
    ReplaySpec,
    read_result,
    read_state_servers,
    replay_dir,
    save_captured,
    spec_file,
    write_spec,
)
from .events import SdcReplayReported
from .replay_rule import FAILED, ReplayLocated, RunReplay

log = logging.getLogger(__name__)

#: Tries at one replica's step: rank 0's newest may be gone from another rank's
#: buffers by the time that rank is asked (it trains on meanwhile).
CAPTURE_ATTEMPTS = 5
#: How long a rank's state server may wait for the step's snapshot to complete.
SNAPSHOT_WAIT = 5.0


class ReplayCaptureError(FtError):
    """No training replica's state could be captured for the replay."""


@dataclass(frozen=True)
class ReplaySetup:
    """What every replay of the run shares (the supervisor's)."""

    slurm: SlurmBackend
    run_dir: Path
    job_id: str
    secret: str
    worker_env: Mapping[str, str]
    num_replicas: int
    tasks_per_node: int
    timeout: float                      # recovery.replay_timeout
    fetch_timeout: float                # ckpt.fetch_timeout
    fetch_streams: int = 1
    srun_extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class ReplayOutcome:
    replica_id: int
    status: str                         # a ReplayStatus value, or FAILED
    suspects: tuple[str, ...] = ()
    failed_rows: tuple[int, ...] = ()
    failed_columns: tuple[int, ...] = ()
    step: int | None = None             # the step replayed
    summary: str = ""
    report: str = ""
    duration_s: float = 0.0

    def record(self) -> SdcReplayReported:
        return SdcReplayReported(replica_id=self.replica_id, status=self.status,
                                 suspects=list(self.suspects),
                                 failed_rows=list(self.failed_rows),
                                 failed_columns=list(self.failed_columns), step=self.step,
                                 summary=self.summary, report=self.report,
                                 duration_s=round(self.duration_s, 3))

    def located(self) -> ReplayLocated:
        return ReplayLocated(self.replica_id, self.status, self.suspects, self.failed_rows,
                             self.failed_columns, self.summary)


# --------------------------------------------------------------------------- capture


def capture_state(run_dir: Path, job_id: str, secret: str, sources: Sequence[int],
                  ranks: int, state_dir: Path, timeout: float, streams: int = 1
                  ) -> tuple[int, int]:
    """One step of every rank of the first of ``sources`` that serves it, saved in
    ``state_dir``; (that replica, the step)."""
    deadline = time.monotonic() + timeout
    problems: list[str] = []
    for replica in sources:
        try:
            servers = [Peer(*a) for a in read_state_servers(run_dir, replica, job_id)]
        except ReplayFileError as error:
            problems.append(str(error))
            continue
        if len(servers) != ranks:
            problems.append(f"replica {replica} serves {len(servers)} ranks, not {ranks}")
            continue
        for _ in range(CAPTURE_ATTEMPTS):
            if time.monotonic() >= deadline:
                break
            try:
                return replica, _capture_step(servers, secret, state_dir, deadline, streams)
            except FetchError as error:
                problems.append(f"replica {replica}: {error}")
    raise ReplayCaptureError(f"no state captured within {timeout:g} s: "
                             + ("; ".join(problems[-3:]) or "no replica to capture from"))


def _capture_step(servers: Sequence[Peer], secret: str, state_dir: Path, deadline: float,
                  streams: int) -> int:
    first = fetch_state(servers[0], secret, timeout=_left(deadline), streams=streams)
    save_captured(state_dir, 0, first.manifest, first.buffer)
    for rank, server in enumerate(servers[1:], start=1):
        left = _left(deadline)
        fetched = fetch_state(server, secret, step=first.step, timeout=left,
                              wait=min(SNAPSHOT_WAIT, left / 2), streams=streams)
        save_captured(state_dir, rank, fetched.manifest, fetched.buffer)
    return first.step


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise FetchError("no time left to capture the state")
    return left


# --------------------------------------------------------------------------- one replay


def group_result(spec: ReplaySpec, outcome: GroupOutcome) -> GroupResult:
    """A group's digest (every rank's, in rank order), or why it has none. Every rank
    that wrote its result had computed it: how the step ended after is no verdict."""
    try:
        results = [read_result(spec.result_file(outcome.label, rank))
                   for rank in range(spec.ranks)]
    except ReplayFileError as error:
        why = outcome.detail or f"exited with {outcome.exit_code}"
        return GroupResult(outcome.label, None, why if not outcome.ok else str(error))
    bad = [r for r in results if r.nonfinite]
    if bad:
        return GroupResult(outcome.label, None, "NaN/Inf on " + ", ".join(
            f"rank {r.rank} ({r.node}, {r.nonfinite} values)" for r in bad))
    return GroupResult(outcome.label, ",".join(r.digest for r in results))


@dataclass
class SdcReplay:
    """One replay, on a thread of its own (``start``); ``outcome`` is set once it is
    over, at the latest ``setup.timeout`` seconds (plus the cancels) later."""

    setup: ReplaySetup
    order: RunReplay
    replay_id: str
    outcome: ReplayOutcome | None = None
    _launcher: SrunGroupLauncher | None = None
    _thread: threading.Thread | None = None
    _cancelled: threading.Event = field(default_factory=threading.Event)

    @property
    def out_dir(self) -> Path:
        return replay_dir(self.setup.run_dir) / self.replay_id

    def start(self) -> SdcReplay:
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"sdc-replay-{self.order.replica_id}")
        self._thread.start()
        return self

    def cancel(self, wait: float = 10.0) -> None:
        self._cancelled.set()
        if self._launcher is not None:
            self._launcher.cancel()
        if self._thread is not None:
            self._thread.join(timeout=wait)

    def _run(self) -> None:
        started = time.monotonic()
        try:
            self.outcome = self._replay(started)
        except Exception as error:  # a thread's end: the controller must hear of it
            log.exception("replay of replica %d failed", self.order.replica_id)
            self.outcome = ReplayOutcome(self.order.replica_id, FAILED,
                                         summary=f"replay failed: {error}",
                                         duration_s=time.monotonic() - started)

    def _replay(self, started: float) -> ReplayOutcome:
        setup, order = self.setup, self.order
        deadline = started + setup.timeout
        size = len(order.suspects)
        ranks = size * setup.tasks_per_node
        source, step = capture_state(setup.run_dir, setup.job_id, setup.secret, order.sources,
                                     ranks, self.out_dir / "state",
                                     min(setup.fetch_timeout, setup.timeout),
                                     setup.fetch_streams)
        spec = ReplaySpec(self.replay_id, order.replica_id, step, ranks,
                          str(self.out_dir / "state"), str(self.out_dir / "results"))
        path = write_spec(spec_file(setup.run_dir, self.replay_id), spec)
        grid = plan_replay_grid((*order.suspects, *order.references), pp=size, dp=size)
        launcher = self._launcher = SrunGroupLauncher(
            setup.slurm,
            (sys.executable, "-m", "ft_launch.launcher.worker.task", "--", *order.command),
            job_id=setup.job_id or None, tasks_per_node=setup.tasks_per_node,
            timeout=max(1.0, (deadline - time.monotonic()) / 2),
            extra_args=("--export=ALL", *setup.srun_extra_args),
            env=lambda label, nodes: self._env(
                path, label, len(nodes)), overlap=True, log_dir=self.out_dir / "logs")
        if self._cancelled.is_set():
            launcher.cancel()

        def last_phase() -> None:
            launcher.timeout = max(1.0, deadline - time.monotonic())

        rows, columns = run_phases(grid, launcher, before_columns=last_phase)
        row_results = [group_result(spec, o) for o in rows]
        column_results = [group_result(spec, o) for o in columns]
        found = judge(grid, row_results, column_results, range(1, size))
        outcome = self._outcome(found, step + 1, time.monotonic() - started)
        outcome = replace(outcome, report=self._report(
            grid, source, spec, list(zip(rows + columns, row_results + column_results)),
            found, outcome))
        log.info("replay of replica %d: %s (%s)", order.replica_id, outcome.summary,
                 outcome.report)
        return outcome

    def _env(self, spec: Path, label: str, nodes: int) -> dict[str, str]:
        """The group's processes: the replica's worker environment, a torch world of
        their own (its port drawn from the group), the replay spec."""
        setup, rid = self.setup, self.order.replica_id
        world = replica_world_env(f"{setup.job_id}/{self.replay_id}/{label}", rid, 0, nodes,
                                  setup.tasks_per_node)
        return {**setup.worker_env, **world, ENV_REPLICA_ID: str(rid),
                ENV_NUM_REPLICAS: str(setup.num_replicas), ENV_REPLAY: str(spec)}

    def _outcome(self, found: Judgement, step: int, duration: float) -> ReplayOutcome:
        rid = self.order.replica_id
        if found.verdict is None:
            return ReplayOutcome(rid, FAILED, step=step, summary=found.error,
                                 duration_s=duration)
        verdict = found.verdict
        failed = "; ".join(f"{g.label}: {g.detail or 'other bits than the reference'}"
                           for g in found.failed)
        summary = f"{verdict.describe()}" + (f"; {failed}" if failed else "")
        return ReplayOutcome(rid, verdict.status.value, verdict.suspects, verdict.failed_rows,
                             verdict.failed_columns, step, summary, duration_s=duration)

    def _report(self, grid: ReplayGrid, source: int, spec: ReplaySpec,
                groups: Sequence[tuple[GroupOutcome, GroupResult]], found: Judgement,
                outcome: ReplayOutcome) -> str:
        path = self.out_dir / "report.txt"
        record: dict[str, Any] = {
            **asdict(outcome), "report": str(path), "why": self.order.reason,
            "source_replica": source, "captured_step": spec.step,
            "grid": [list(row) for row in grid.rows], "reference": found.reference,
            "groups": [{**asdict(o), "digest": r.digest, "why": r.detail} for o, r in groups],
            "failed": [g.label for g in found.failed]}
        atomic_write_text(self.out_dir / "report.json", json.dumps(record, indent=1) + "\n",
                          durable=False)
        lines = [(f"dual-phase replay of replica {outcome.replica_id} "
                  f"({', '.join(self.order.suspects)})"),
                 f"why: {self.order.reason}",
                 (f"replayed step {spec.step + 1} from replica {source}'s state of step "
                  f"{spec.step}, in {outcome.duration_s:.1f} s"),
                 f"verdict: {outcome.summary}", "grid (rows of nodes):"]
        lines += [f"  row{r}: {' '.join(row)}" for r, row in enumerate(grid.rows)]
        lines.append("groups:")
        lines += [f"  {o.label} on {','.join(o.nodes)}: " + (
                  r.detail if r.digest is None else "the reference's bits"
                  if r.digest == found.reference else "other bits than the reference")
                  for o, r in groups]
        atomic_write_text(path, "\n".join(lines) + "\n", durable=False)
        return str(path)


class SdcReplays:
    """The supervisor's replays, one per replica at most."""

    def __init__(self, setup: ReplaySetup) -> None:
        self.setup = setup
        self.running: dict[int, SdcReplay] = {}
        self._count = 0

    def start(self, order: RunReplay) -> None:
        self._count += 1
        replay_id = f"replica-{order.replica_id}-{self._count}"
        self.running[order.replica_id] = SdcReplay(self.setup, order, replay_id).start()

    def finished(self) -> list[ReplayOutcome]:
        done = []
        for rid, replay in list(self.running.items()):
            if replay.outcome is not None:
                del self.running[rid]
                done.append(replay.outcome)
        return done

    def cancel_all(self) -> None:
        for replay in self.running.values():
            replay.cancel()
