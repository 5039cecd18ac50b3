"""``ft-launch run``'s thin shell: launch one job step per replica and a warm
standby agent per standby node, watch them, and carry out what
``recovery.decide`` orders (srun, scancel, scontrol). Never imports torch.

Watching:
* a replica's srun exits: finished (0), node unhealthy (76, from the gate) or
  crashed (anything else);
* a replica stops committing steps while the others go on (``lost_timeout``),
  or Slurm reports its node DOWN / not responding: the node is at fault;
* progress comes from the replicas' own event files (``events/``).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from ftcore.config import Config, PromotionPath, StandbyMode
from ftcore.errors import ExitCode, SlurmCommandError
from ftcore.events import Event, EventLog, NodeDrained
from ftcore.slurm.client import SlurmBackend, cancel_named_step, launch_logged
from ftcore.slurm.commands import StepSpec
from ftcore.slurm.states import Disposition, node_disposition
from health.drain_request import job_comment, write_request

from . import recovery as rc
from . import versions as cv
from .events import (
    EventTail,
    FullRestartOrdered,
    NodeDrainRequested,
    NodeFaultDetected,
    ReplicaExited,
    ReplicaLaunched,
    RunFinished,
    StandbyPromoted,
)
from .heartbeat import HeartbeatWriter
from .inspection import NodeInspection
from .plan import LaunchPlan, replica_step_spec
from .pool import ReservationPool
from .standby import activate, unhealthy_file
from .worker.events import StepCommitted, WorkerStarted
from .worker.identity import ENV_REPLICA_ID, ENV_SECRET, replica_world_env

log = logging.getLogger(__name__)
NODE_CHECK_INTERVAL = 2.0


@dataclass
class Watched:
    """A running step the supervisor owns (a replica, or a standby agent)."""

    name: str
    proc: subprocess.Popen[bytes]
    started: float
    job_id: str | None = None   # the job the step runs in (a standby job, or the main one)


@dataclass
class Progress:
    last_time: float = field(default_factory=time.monotonic)  # last commit or (re)launch
    last_commit: float | None = None
    previous_commit: float | None = None    # the poll before, when it committed too
    #: (re)launched: commits count again only after the new process says it started
    #: (lines the cancelled one wrote may still be unread)
    awaiting_start: bool = False
    #: the first commit of the current unbroken run of commits
    moving_since: float | None = None


class Supervisor:
    def __init__(self, config: Config, plan: LaunchPlan, slurm: SlurmBackend, run_dir: Path,
                 worker_env: dict[str, str], events: EventLog) -> None:
        self.config = config
        self.plan = plan
        self.slurm = slurm
        self.run_dir = run_dir
        self.worker_env = worker_env
        self.events = events
        self.state = rc.RunState(
            replicas=tuple(rc.Replica(r.replica_id, r.nodes) for r in plan.replicas),
            standby=plan.standby, nodes_per_replica=config.job.nodes_per_replica,
            last_standby=plan.batch_host)
        self.policy = rc.Policy(retries_in_place=config.recovery.retries_in_place)
        self.replicas: dict[int, Watched] = {}
        self.standbys: dict[str, Watched] = {}
        self.progress = {r.replica_id: Progress() for r in plan.replicas}
        self.tails = {r.replica_id: EventTail(run_dir / "events" /
                                              f"replica-{r.replica_id}-rank-0.jsonl")
                      for r in plan.replicas}
        self.logs = run_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self._finished_at: float | None = None
        self._last_node_check = 0.0
        self.pool = ReservationPool(slurm, config.job, plan.job_id or "") \
            if config.job.standby_mode is StandbyMode.RESERVATION else None
        self.inspection = NodeInspection(
            config.health, slurm, worker_env[ENV_SECRET], worker_env, self.logs,
            config.slurm.srun_extra_args) if config.health.inspection else None
        self.versions = cv.VersionState.initial(
            plan.command, cv.digest_command(plan.command, Path.cwd()),
            [r.replica_id for r in plan.replicas], time.time())
        self._updates_read = 0
        self._expanded: set[str] = set()    # nodes the job got by expansion
        self._launches: dict[int, int] = {}   # replica -> launches so far

    # ------------------------------------------------------------------ launching

    def _popen(self, spec: StepSpec, env: dict[str, str], log_name: str
               ) -> subprocess.Popen[bytes]:
        return launch_logged(self.slurm, spec, self.logs / log_name, env)

    def launch_replica(self, replica_id: int, nodes: tuple[str, ...], how: str) -> None:
        for node in nodes:  # a node taken over from the pool: end its standby agent
            self._cancel_standby(node)
        command = self._command_for(replica_id)
        if how != "initial":
            # Stop-time diagnosis before a retry in place (or on a node new to the job):
            # the gate's health checks; a failure exits 76 and the node is evicted.
            command = (sys.executable, "-m", "slurm_plugins.gate", "--", *command)
        spec = replica_step_spec(self.plan, nodes, replica_id,
                                 self.config.slurm.srun_extra_args, command=command,
                                 overlap=bool(set(nodes) & self._expanded))
        env = self._replica_env(replica_id, len(nodes))
        proc = self._popen(spec, env, f"replica-{replica_id}")
        self.replicas[replica_id] = Watched(spec.name, proc, time.monotonic(), self.plan.job_id)
        self._restarted(replica_id)
        self.events.emit(ReplicaLaunched(replica_id=replica_id, nodes=list(nodes), how=how))

    def _replica_env(self, replica_id: int, nodes: int) -> dict[str, str]:
        launch = self._launches[replica_id] = self._launches.get(replica_id, -1) + 1
        return {**self.worker_env, ENV_REPLICA_ID: str(replica_id),
                **replica_world_env(self.plan.job_id or "", replica_id, launch, nodes,
                                    self.plan.tasks_per_node)}

    def _restarted(self, replica_id: int) -> None:
        progress = self.progress[replica_id]
        progress.last_time, progress.awaiting_start = time.monotonic(), True

    def launch_standby(self, node: str) -> None:
        command = (sys.executable, "-m", "slurm_plugins.gate", "--",
                   sys.executable, "-m", "launcher.standby", "--run-dir", str(self.run_dir),
                   "--node", node, "--", *self.plan.command)
        job_id = (self.pool.job_of(node) if self.pool else None) or self.plan.job_id
        spec = StepSpec(nodes=(node,), command=command, tasks_per_node=self.plan.tasks_per_node,
                        name=f"standby-{node}", job_id=job_id,
                        extra_args=self.config.slurm.srun_extra_args)
        self.standbys[node] = Watched(spec.name, self._popen(spec, self.worker_env,
                                                              f"standby-{node}"),
                                      time.monotonic(), job_id)

    def start(self) -> None:
        for replica in self.plan.replicas:
            self.launch_replica(replica.replica_id, replica.nodes, "initial")
        if self.pool is not None:
            held = self.pool.acquire()
            self.state = self.state.with_standby(self.state.standby + held)
        for node in self.state.standby:
            self.launch_standby(node)
        for replica in self.state.replicas:
            for node in replica.nodes:
                self._inspect(node, self.plan.job_id)
        for node in self.state.standby:
            self._inspect(node, self.standbys[node].job_id)

    def _inspect(self, node: str, job_id: str | None) -> None:
        if self.inspection is not None:
            self.inspection.watch(node, job_id)

    # ------------------------------------------------------------------ the loop

    def run(self) -> int:
        heartbeat = HeartbeatWriter(self.run_dir, self.config.runtime.controller_timeout).start()
        try:
            self.start()     # inside: what a failed start launched is stopped too
            while True:
                code = self.poll()
                if code is not None:
                    return code
                time.sleep(self.config.recovery.poll_interval)
        finally:
            self.stop_all()
            heartbeat.stop()

    def poll(self) -> int | None:
        """One round of watching; an exit code when the run is over."""
        now = time.monotonic()
        observed: list[rc.Event] = []
        observed += self._read_progress(now)
        observed += self._reap_exits()
        observed += self._check_stalls(now)
        if now - self._last_node_check > NODE_CHECK_INTERVAL:
            self._last_node_check = now
            observed += self._check_nodes()
        if self.inspection is not None:
            observed += [self._fault(None, node, reason)
                         for node, reason in self.inspection.alarms()
                         if node not in self.state.evicted]
        for event in observed:
            code = self._execute_all(self._decide(event))
            if code is not None:
                return code
        code = self._execute_all(self._check_updates())
        return code if code is not None else self._finish_code(now)

    def _decide(self, event: rc.Event) -> list[rc.Action | cv.VersionAction]:
        """Recovery and code versions both hear of the event. A crash that rolls back a
        code update is the code's fault, not the node's: the replica is relaunched in
        place on the older version instead of evicting its node."""
        if isinstance(event, rc.ReplicaProgressed) and \
                self.progress[event.replica_id].awaiting_start:
            return []  # read before an action of this poll relaunched it: stale
        fact = _version_fact(event)
        versioned = self._versions(fact) if fact is not None else []
        if isinstance(event, rc.ReplicaCrashed) and any(isinstance(a, cv.RollBack)
                                                        for a in versioned):
            event = rc.RestartRequested(event.replica_id)
        self.state, actions = rc.decide(self.state, event, self.policy)
        replica_id = getattr(event, "replica_id", None)
        if replica_id is not None and self.state.replica(replica_id).state \
                is rc.ReplicaState.FAILED:   # given up on: the rollout stops waiting for it
            versioned += self._versions(cv.ReplicaRetired(replica_id))
        return [*versioned, *actions]

    def _execute_all(self, actions: list[rc.Action | cv.VersionAction]) -> int | None:
        for action in actions:
            code = self.execute(action)
            if code is not None:
                return code
        return None

    # ------------------------------------------------------------------ code versions

    def _versions(self, event: cv.VersionEvent) -> list[cv.VersionAction]:
        self.versions, actions = cv.decide_version(self.versions, event, time.time())
        return actions

    def _command_for(self, replica_id: int) -> tuple[str, ...]:
        """Every launch asks which code version the replica runs (a pending update is
        applied at its next recovery)."""
        actions = self._versions(cv.ReplicaLaunching(replica_id))
        self._execute_all(actions)      # the records; RunVersion itself is read here
        (run,) = [a for a in actions if isinstance(a, cv.RunVersion)]
        return run.version.command

    def _check_updates(self) -> list[cv.VersionAction]:
        """New ``ft-launch update`` requests, then the forced windows."""
        actions: list[cv.VersionAction] = []
        try:
            requests = cv.read_update_requests(self.run_dir, after=self._updates_read)
        except cv.UpdateRequestError as error:
            log.error("update request ignored: %s", error)
            requests = []
            self._updates_read += 1
        for request in requests:
            self._updates_read = max(self._updates_read, request.number)
            actions += self._versions(cv.UpdateRequested(request))
        return actions + self._versions(cv.Tick())

    def _read_progress(self, now: float) -> list[rc.Event]:
        found: list[rc.Event] = []
        for replica_id, tail in self.tails.items():
            # Any new commit is progress: after a full restart, steps repeat from the
            # checkpoint's, below the highest ever seen.
            progress = self.progress[replica_id]
            commits = 0
            for event in tail.read():
                if isinstance(event, WorkerStarted):
                    progress.awaiting_start = False
                elif isinstance(event, StepCommitted) and not progress.awaiting_start:
                    commits += 1
            if commits:
                # (several commits read at once: the one before was just now too)
                previous = now if commits > 1 else progress.last_commit
                continuing = (progress.last_commit is not None and progress.moving_since
                              is not None and now - progress.last_commit
                              <= self.config.recovery.lost_timeout / 2)
                self.progress[replica_id] = Progress(
                    now, now, previous,
                    moving_since=progress.moving_since if continuing else now)
                found.append(rc.ReplicaProgressed(replica_id))
        return found

    def _reap_exits(self) -> list[rc.Event]:
        found: list[rc.Event] = []
        for replica_id, watched in list(self.replicas.items()):
            code = watched.proc.poll()
            if code is None:
                continue
            del self.replicas[replica_id]
            self.events.emit(ReplicaExited(replica_id=replica_id, exit_code=code))
            log.info("replica %d exited with %d", replica_id, code)
            if code == 0:
                # srun of a --no-kill job also ends with 0 when its node fails: finished
                # only if Slurm still has the nodes healthy.
                nodes = self.state.replica(replica_id).nodes
                failed = self._unhealthy(nodes)
                found += [self._fault(replica_id, node, f"step ended with its node failing "
                                                        f"({reason})")
                          for node, reason in failed.items()] or [rc.ReplicaFinished(replica_id)]
            elif code == ExitCode.NODE_UNHEALTHY:
                node = self.state.replica(replica_id).nodes[0]
                found.append(self._fault(replica_id, node, self._gate_reason(node)))
            else:
                found.append(rc.ReplicaCrashed(replica_id, code))
        for node, watched in list(self.standbys.items()):
            code = watched.proc.poll()
            if code is not None:
                del self.standbys[node]
                if node in self.state.standby:
                    found.append(self._fault(None, node, f"standby agent exited with {code}"))
        return found

    def _gate_reason(self, node: str) -> str:
        """What the gate found, when a promoted standby wrote it down."""
        try:
            return unhealthy_file(self.run_dir, node).read_text(encoding="utf-8").strip()
        except OSError:
            return "health gate failed (its reason is in the replica's log)"

    def _check_stalls(self, now: float) -> list[rc.Event]:
        """A replica that stopped committing while another went on: its node is suspect.
        Only commits count as going on: a replica just (re)launched is not progress, and
        survivors of a lost majority are stalled by the quorum, not by their nodes."""
        timeout = self.config.recovery
        # "Going on" means committing steadily: the last commit within half the window
        # and the one before within the window, from a replica not (re)launched within
        # it. When a peer dies the survivors all stall on FTAR / quorum timeouts and
        # resume a few ms apart; the first to resume is not yet "steady" if the stall was
        # longer than the window, and if it was shorter the others are not over the
        # limit. A restarted replica's catch-up commit does not count either.
        # And it must have gone on for a whole window: after a lost majority re-forms,
        # the survivors resume one quorum round apart, and the later ones get the same
        # window to show progress as a replica that stalled alone.
        window = timeout.lost_timeout
        steady = [rid for rid, p in self.progress.items()
                  if rid in self.replicas and now - self.replicas[rid].started > window
                  and p.last_commit is not None and p.last_commit > now - window / 2
                  and p.previous_commit is not None and p.previous_commit > now - window
                  and p.moving_since is not None and now - p.moving_since >= window]
        found: list[rc.Event] = []
        for replica in self.state.replicas:
            if replica.replica_id not in self.replicas:
                continue
            silent = now - self.progress[replica.replica_id].last_time
            limit = timeout.start_timeout if replica.state is rc.ReplicaState.RECOVERING \
                else timeout.lost_timeout
            others_moving = any(rid != replica.replica_id for rid in steady)
            if silent > limit and (others_moving or replica.state is rc.ReplicaState.RECOVERING):
                found.append(self._fault(replica.replica_id, replica.nodes[0],
                                         f"replica {replica.replica_id} made no progress for "
                                         f"{silent:.0f} s"))
        return found

    def _check_nodes(self) -> list[rc.Event]:
        watched: dict[str, int | None] = {n: r.replica_id for r in self.state.replicas
                                          if r.replica_id in self.replicas for n in r.nodes}
        watched.update({n: None for n in self.standbys if n in self.state.standby})
        return [self._fault(watched[node], node, reason)
                for node, reason in self._unhealthy(tuple(sorted(watched))).items()]

    def _unhealthy(self, nodes: tuple[str, ...]) -> dict[str, str]:
        """Nodes Slurm reports unusable (down, not responding, failing), with why."""
        try:
            infos = self.slurm.nodes(nodes)
        except SlurmCommandError as error:
            log.warning("cannot read node states: %s", error)
            return {}
        return {i.name: f"Slurm reports {i.state.value}+{'+'.join(sorted(i.flags))}"
                for i in infos if i.name in nodes
                and node_disposition(i.state, i.flags) is Disposition.NODE_UNHEALTHY}

    def _fault(self, replica_id: int | None, node: str, reason: str) -> rc.NodeFaulted:
        self.events.emit(NodeFaultDetected(node=node, replica_id=replica_id, reason=reason))
        log.warning("node %s at fault (replica %s): %s", node, replica_id, reason)
        return rc.NodeFaulted(replica_id, node, reason)

    def _finish_code(self, now: float) -> int | None:
        states = [r.state for r in self.state.replicas]
        if rc.ReplicaState.FINISHED not in states:
            return None
        if self._finished_at is None:
            self._finished_at = now
        done = all(s in (rc.ReplicaState.FINISHED, rc.ReplicaState.FAILED) for s in states)
        if done or now - self._finished_at > self.config.recovery.finish_grace:
            self.events.emit(RunFinished(exit_code=0, reason="training finished"))
            return ExitCode.OK
        return None

    # ------------------------------------------------------------------ actions

    def execute(self, action: rc.Action | cv.VersionAction) -> int | None:
        if isinstance(action, Event):
            self.events.emit(action)
            return None
        log.info("action: %s", action)
        if isinstance(action, cv.RestartReplicaForUpdate):
            self.state, actions = rc.decide(self.state, rc.RestartRequested(action.replica_id),
                                            self.policy)
            return self._execute_all(actions)
        if isinstance(action, (cv.RunVersion, cv.RollBack)):
            return None  # the launch reads it / the records say it; relaunches follow
        if isinstance(action, rc.EvictNode):
            self._drain(action.node, action.reason)
        elif isinstance(action, rc.CancelReplica):
            self._cancel_replica(action.replica_id)
        elif isinstance(action, rc.PromoteStandby):
            self._promote(action.replica_id, action.node)
        elif isinstance(action, rc.RelaunchReplica):
            self.launch_replica(action.replica_id, action.nodes, "relaunch")
        elif isinstance(action, rc.FullRestart):
            self.events.emit(FullRestartOrdered(placements={str(r): list(nodes) for r, nodes
                                                            in action.placements}))
            for replica_id, nodes in action.placements:
                self.launch_replica(replica_id, nodes, "restart")
        elif isinstance(action, rc.GiveUp):
            code = ExitCode.FATAL_NO_REQUEUE if action.fatal else ExitCode.RECOVERABLE
            self.events.emit(RunFinished(exit_code=code, reason=action.reason))
            log.error("giving up: %s", action.reason)
            return code
        return None

    def _drain(self, node: str, reason: str) -> None:
        text = f"ft-launch: {reason}"
        try:
            self.slurm.set_node_state(node, "drain", text)
            self.events.emit(NodeDrained(node=node, reason=text))
        except SlurmCommandError as error:
            # Without operator rights: recorded, so the node's Epilog drains it.
            log.error("could not drain %s (%s): %s; the Epilog will", node, text, error)
            self._request_epilog_drain(node, text)
        self._cancel_standby(node)
        if self.inspection is not None:
            self.inspection.unwatch(node)

    def _request_epilog_drain(self, node: str, reason: str) -> None:
        job_id = self.plan.job_id or ""
        write_request(self.run_dir, job_id, node, reason)
        try:
            self.slurm.set_comment(job_id, job_comment(self.run_dir))
        except SlurmCommandError as error:
            log.error("job comment not set (%s): an admin must drain %s", error, node)
        self.events.emit(NodeDrainRequested(node=node, reason=reason))

    def _promote(self, replica_id: int, node: str) -> None:
        if self.pool is not None and node in self.pool.holder \
                and self.pool.path is PromotionPath.EXPANSION:
            self._cancel_standby(node)
            if self.inspection is not None:
                self.inspection.unwatch(node)   # its step ends with the standby job's node
            self.pool.move_to_main(node)
            self._expanded.add(node)
            self._inspect(node, self.plan.job_id)
            self.events.emit(StandbyPromoted(replica_id=replica_id, node=node,
                                             how="moved into the job (expansion)"))
            self.launch_replica(replica_id, (node,), "promoted")
        else:
            watched = self.standbys.pop(node)
            env = self._replica_env(replica_id, 1)
            activate(self.run_dir, node, env, command=self._command_for(replica_id))
            self.replicas[replica_id] = Watched(watched.name, watched.proc, time.monotonic(),
                                                watched.job_id)
            self._restarted(replica_id)
            how = "warm agent in the allocation"
            if self.pool is not None and node in self.pool.holder:
                self.pool.promoted_in_place(node)
                how = f"warm agent in standby job {watched.job_id}"
            self.events.emit(StandbyPromoted(replica_id=replica_id, node=node, how=how))
            self.events.emit(ReplicaLaunched(replica_id=replica_id, nodes=[node],
                                             how="promoted"))
        self._replenish()

    def _replenish(self) -> None:
        """Reservation mode: hold a new standby node for the one just used."""
        added = self.pool.grow() if self.pool is not None else None
        if added is not None:
            self.state, _ = rc.decide(self.state, rc.StandbyAdded(added), self.policy)
            self.launch_standby(added)
            self._inspect(added, self.standbys[added].job_id)

    def _cancel_replica(self, replica_id: int) -> None:
        watched = self.replicas.pop(replica_id, None)
        if watched is not None:
            self._cancel_step(watched)

    def _cancel_standby(self, node: str) -> None:
        watched = self.standbys.pop(node, None)
        if watched is not None:
            self._cancel_step(watched)

    def _cancel_step(self, watched: Watched) -> None:
        cancel_named_step(self.slurm, watched.job_id or self.plan.job_id or "", watched.name,
                          watched.proc)

    def stop_all(self) -> None:
        for replica_id in list(self.replicas):
            self._cancel_replica(replica_id)
        for node in list(self.standbys):
            self._cancel_standby(node)
        if self.inspection is not None:
            self.inspection.close()
        if self.pool is not None:
            self.pool.release()


def _version_fact(event: rc.Event) -> cv.VersionEvent | None:
    """What the code-version bookkeeping needs to know of a recovery event. A node fault
    counts as a failure too: the table rolls back an update when the same replica fails
    again after a retry or an eviction."""
    if isinstance(event, rc.ReplicaProgressed):
        return cv.ReplicaProgressed(event.replica_id)
    if isinstance(event, rc.ReplicaFinished):
        return cv.ReplicaRetired(event.replica_id)
    if isinstance(event, (rc.ReplicaCrashed, rc.NodeFaulted)) and event.replica_id is not None:
        return cv.ReplicaFailed(event.replica_id)
    return None
