"""Hang diagnosis: the stacks of a stalled replica's ranks, taken before anything
of it is cancelled, and the nodes they name.

The controller (``lifecycle``) orders it when a replica stops committing
(``DiagnoseHang``); the supervisor runs one ``HangDiagnosis`` per replica in a
thread of its own, so the poll loop goes on watching the others:

1. each rank wrote its node and pid into the run directory when it started
   (``ft_launch.launcher.worker.pids``);
2. on each node of the replica, ``srun --overlap --jobid JOB`` runs ``python -m
   ft_launch.health.stacks --pid ...`` (py-spy) against that node's ranks, all nodes at once,
   the whole bounded by ``recovery.diagnosis_timeout`` (a node that does not answer
   in time: its ranks count as unreadable, hence suspect);
3. ``ft_launch.health.aggregation.hang_suspects`` groups the stacks and names the outlier
   ranks and the smallest group holding them (their node, or, when nothing stands
   out, the whole replica: over-eviction rather than a guess);
4. the report goes to ``<run_dir>/diagnosis/hang-R-N/report.txt`` (and ``.json``,
   with every thread's stack), its summary into the controller's event log
   (``HangDiagnosisReported``) and ``ft-launch status``; the outcome comes back to
   the controller's decision as ``lifecycle.HangDiagnosed``, which evicts.

``build_report`` and ``report_text`` are pure; ``HangDiagnosis`` is the shell.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ft_launch.errors import SlurmCommandError
from ft_launch.events import Event
from ft_launch.files import atomic_write_text
from ft_launch.health.aggregation import (
    Aggregation,
    EvictionDecision,
    RankPlace,
    hang_suspects,
    innermost_own_frame,
    signature,
)
from ft_launch.health.stacks import ProcessStack
from ft_launch.slurm.client import SlurmBackend, cancel_named_step, launch_logged
from ft_launch.slurm.commands import StepSpec

from ..worker.pids import RankProcess, read_rank_pids

log = logging.getLogger(__name__)

DIAGNOSIS_DIR = "diagnosis"
#: What one node's stacks may take on disk (py-spy's JSON of a few processes is KBs).
MAX_STACKS_BYTES = 8 << 20
POLL_INTERVAL = 0.05
#: Outlier ranks named one by one in a summary; more are counted.
NAMED_OUTLIERS = 3


@dataclass(frozen=True)
class HangDiagnosisReported(Event):
    """The stacks of a stalled replica's ranks were taken and aggregated."""

    replica_id: int
    suspects: list[str]         # the nodes to evict
    outliers: list[int]         # the ranks that stand out
    summary: str
    report: str                 # path of the readable report


@dataclass(frozen=True)
class HangRequest:
    replica_id: int
    nodes: tuple[str, ...]
    tasks_per_node: int
    why: str                    # "replica 0 made no progress for 5 s"
    out_dir: Path

    @property
    def ranks(self) -> int:
        return len(self.nodes) * self.tasks_per_node

    def node_of(self, rank: int) -> str:
        """Where Slurm puts ``rank`` (block distribution: the first node's tasks first)."""
        return self.nodes[min(rank // self.tasks_per_node, len(self.nodes) - 1)]


@dataclass(frozen=True)
class RankReport:
    rank: int
    node: str
    pid: int | None             # None: the rank wrote no pid file
    stack: ProcessStack

    def where(self) -> str:
        if self.stack.error:
            return f"no stack ({self.stack.error})"
        if self.stack.stopped:
            return "stopped (SIGSTOP)"
        frame = innermost_own_frame(self.stack)
        if frame is None:
            return "no Python thread"
        short = frame.file.rsplit("/", 1)[-1]
        return f"in {frame.function} ({short}:{frame.line})"

    def describe(self) -> str:
        pid = f", pid {self.pid}" if self.pid is not None else ""
        return f"rank {self.rank} on {self.node}{pid} {self.where()}"


@dataclass(frozen=True)
class HangReport:
    request: HangRequest
    ranks: tuple[RankReport, ...]
    found: Aggregation
    decision: EvictionDecision | None
    duration_s: float
    problems: tuple[str, ...] = ()      # what went wrong while taking the stacks

    @property
    def suspects(self) -> tuple[str, ...]:
        return self.decision.nodes if self.decision is not None else self.request.nodes

    @property
    def singled_out(self) -> bool:
        """Some ranks stand out; False: every rank is suspect."""
        return bool(self.found.outliers)

    def summary(self) -> str:
        if not self.singled_out:
            return (f"no rank stands out ({len(self.ranks)} ranks, "
                    f"{len(self.found.groups)} stacks): every rank suspect")
        outliers = [r for r in self.ranks if r.rank in self.found.outliers]
        named = "; ".join(r.describe() for r in outliers[:NAMED_OUTLIERS])
        more = len(outliers) - NAMED_OUTLIERS
        return named + (f"; {more} more" if more > 0 else "")

    def to_json(self) -> dict[str, Any]:
        decision = self.decision
        return {
            "replica_id": self.request.replica_id, "nodes": list(self.request.nodes),
            "why": self.request.why, "duration_s": round(self.duration_s, 3),
            "suspects": list(self.suspects), "outliers": list(self.found.outliers),
            "ambiguous": self.found.ambiguous, "waiting": list(self.found.waiting),
            "summary": self.summary(), "problems": list(self.problems),
            "evict": None if decision is None else {
                "group": str(decision.group), "nodes": list(decision.nodes),
                "covers_all": decision.covers_all},
            "groups": [{"signature": g.signature, "ranks": list(g.ranks)}
                       for g in self.found.groups],
            "ranks": [{"rank": r.rank, "node": r.node, "pid": r.pid, "where": r.where(),
                       "signature": signature(r.stack), "stack": r.stack.to_dict()}
                      for r in self.ranks]}


# --------------------------------------------------------------------------- pure


def build_report(request: HangRequest, processes: Sequence[RankProcess],
                 stacks: Mapping[str, Mapping[int, ProcessStack]],
                 node_errors: Mapping[str, str], duration_s: float,
                 problems: Sequence[str] = ()) -> HangReport:
    """One row per rank the replica runs: its stack as its node's capture returned it,
    or why there is none (no pid file, node silent, process gone)."""
    by_rank = {p.rank: p for p in processes if p.node in request.nodes}
    rows = []
    for rank in range(request.ranks):
        process = by_rank.get(rank)
        if process is None:
            rows.append(RankReport(rank, request.node_of(rank), None, ProcessStack(
                0, error="no pid file: the rank had not started its manager")))
            continue
        stack = stacks.get(process.node, {}).get(process.pid) or ProcessStack(
            process.pid, error=node_errors.get(process.node, "not in its node's stacks"))
        rows.append(RankReport(rank, process.node, process.pid, stack))
    topology = [RankPlace(rank=r.rank, node=r.node, replica_id=request.replica_id)
                for r in rows]
    found, decision = hang_suspects({r.rank: r.stack for r in rows}, topology)
    return HangReport(request, tuple(rows), found, decision, duration_s, tuple(problems))


def report_text(report: HangReport) -> str:
    """The report a person reads: the verdict, then each distinct stack once, with the
    ranks that share it (outliers marked ``*``)."""
    request = report.request
    lines = [f"hang diagnosis of replica {request.replica_id} on {', '.join(request.nodes)}",
             f"why: {request.why}",
             f"stacks taken in {report.duration_s:.1f} s",
             f"verdict: {report.summary()}",
             report.decision.describe() if report.decision else "evict: nothing"]
    lines += [f"problem: {problem}" for problem in report.problems]
    rows = {r.rank: r for r in report.ranks}
    for group in report.found.groups:
        lines.append("")
        lines.append(f"{len(group.ranks)} rank(s) with stack {group.signature}")
        for rank in group.ranks:
            mark = "*" if rank in report.found.outliers else " "
            lines.append(f" {mark} {rows[rank].describe()}")
        for thread in rows[group.ranks[0]].stack.threads:
            lines.append(f"   thread {thread.name}{' (main)' if thread.main else ''}:")
            lines += [f"     {f.function} ({f.file}:{f.line})" for f in thread.frames]
    return "\n".join(lines) + "\n"


def parse_node_stacks(text: str) -> dict[int, ProcessStack]:
    """{pid: stack} from ``python -m ft_launch.health.stacks`` output; ValueError if it is not."""
    raw = json.loads(text)
    if not isinstance(raw, list):
        # a parse error like any other: the caller catches ValueError
        raise ValueError("expected a JSON list of process stacks")  # noqa: TRY004
    stacks = [ProcessStack.from_dict(item) for item in raw]
    return {s.pid: s for s in stacks}


# --------------------------------------------------------------------------- shell


@dataclass
class _NodeCapture:
    node: str
    step_name: str
    out: Path
    proc: Any = None                 # the srun (a Popen, or a fake's stand-in)
    error: str = ""


@dataclass(frozen=True)
class HangOutcome:
    replica_id: int
    suspects: tuple[str, ...]
    outliers: tuple[int, ...]
    summary: str
    report: str = ""                 # path of report.txt ("" when none was written)
    error: str = ""                  # the diagnosis itself failed: why

    def record(self) -> HangDiagnosisReported:
        return HangDiagnosisReported(replica_id=self.replica_id, suspects=list(self.suspects),
                                     outliers=list(self.outliers),
                                     summary=self.error or self.summary, report=self.report)


@dataclass
class HangDiagnosis:
    """One replica's diagnosis, on a thread of its own (``start``); ``outcome`` is set
    once it is over, at the latest ``timeout`` seconds (plus the cancels) later."""

    slurm: SlurmBackend
    request: HangRequest
    run_dir: Path
    job_id: str
    timeout: float
    srun_extra_args: tuple[str, ...] = ()
    outcome: HangOutcome | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> HangDiagnosis:
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"hang-diagnosis-{self.request.replica_id}")
        self._thread.start()
        return self

    @property
    def done(self) -> bool:
        return self.outcome is not None

    def cancel(self, wait: float = 10.0) -> None:
        """End it early (the run stops): its sruns are cancelled, no outcome needed."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=wait)

    def _run(self) -> None:
        rid = self.request.replica_id
        try:
            self.outcome = self._diagnose()
        except Exception as error:  # a thread's end: the controller must hear of it
            log.exception("hang diagnosis of replica %d failed", rid)
            self.outcome = HangOutcome(rid, (), (), "", error=f"diagnosis failed: {error}")

    def _diagnose(self) -> HangOutcome:
        started = time.monotonic()
        request = self.request
        request.out_dir.mkdir(parents=True, exist_ok=True)
        processes, problems = read_rank_pids(self.run_dir, request.replica_id)
        captures = [self._launch(node, [p.pid for p in processes if p.node == node])
                    for node in request.nodes
                    if any(p.node == node for p in processes)]
        self._wait(captures, started + self.timeout)
        stacks, errors = {}, {}
        for capture in captures:
            try:
                stacks[capture.node] = self._read(capture)
            except (OSError, ValueError) as error:
                errors[capture.node] = capture.error or f"unreadable stacks: {error}"
        report = build_report(request, processes, stacks, errors,
                              time.monotonic() - started, problems)
        path = request.out_dir / "report.txt"
        atomic_write_text(request.out_dir / "report.json",
                          json.dumps(report.to_json(), indent=1) + "\n", durable=False)
        atomic_write_text(path, report_text(report), durable=False)
        log.info("hang diagnosis of replica %d: %s -> evict %s (%s)", request.replica_id,
                 report.summary(), ",".join(report.suspects), path)
        return HangOutcome(request.replica_id, report.suspects, report.found.outliers,
                           report.summary(), str(path))

    def _launch(self, node: str, pids: list[int]) -> _NodeCapture:
        request = self.request
        capture = _NodeCapture(node, f"ftl-diagnose-{request.replica_id}-{node}",
                               request.out_dir / f"{node}.json")
        per_process = max(1.0, min(10.0, self.timeout / 3))
        command = (sys.executable, "-m", "ft_launch.health.stacks", "--timeout", f"{per_process:g}",
                   "--out", str(capture.out), "--pid", *map(str, pids))
        spec = StepSpec(nodes=(node,), command=command, tasks_per_node=1,
                        name=capture.step_name, job_id=self.job_id or None, overlap=True,
                        kill_on_bad_exit=False, extra_args=self.srun_extra_args)
        try:
            capture.proc = launch_logged(self.slurm, spec, request.out_dir / node)
        except (OSError, SlurmCommandError) as error:
            capture.error = f"srun on {node} did not start: {error}"
        return capture

    def _wait(self, captures: list[_NodeCapture], deadline: float) -> None:
        running = [c for c in captures if c.proc is not None]
        while running and time.monotonic() < deadline and not self._stop.is_set():
            running = [c for c in running if c.proc.poll() is None]
            if running:
                self._stop.wait(POLL_INTERVAL)
        for capture in running:
            if capture.proc.poll() is None:
                capture.error = f"no stacks from {capture.node} within {self.timeout:g} s"
                cancel_named_step(self.slurm, self.job_id, capture.step_name, capture.proc)
        for capture in captures:
            code = capture.proc.poll() if capture.proc is not None else None
            if code not in (None, 0) and not capture.error:
                capture.error = f"srun on {capture.node} exited with {code} (see " \
                                f"{capture.out.with_suffix('')}.*.log)"

    @staticmethod
    def _read(capture: _NodeCapture) -> dict[int, ProcessStack]:
        with capture.out.open("rb") as handle:
            data = handle.read(MAX_STACKS_BYTES + 1)
        if len(data) > MAX_STACKS_BYTES:
            raise ValueError(f"{capture.out} is over {MAX_STACKS_BYTES} bytes")
        return parse_node_stacks(data.decode("utf-8"))
