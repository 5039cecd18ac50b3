"""``ft-launch run``'s thin shell: launch one job step per replica and a warm
standby agent per standby node, watch them, and carry out what the one controller
decision (``lifecycle.decide``) orders (srun, scancel, scontrol). Never imports
torch; decides nothing.

Watching (each observation is one ``lifecycle`` event):
* a replica's srun exits (``StepExited``, with what Slurm says of its nodes and
  what the health gate wrote down);
* progress comes from the replicas' own event files (``events/``);
* Slurm's node states, inspection alarms, update requests, and time (``Tick``);
* the hang diagnoses it runs in the background (``HangDiagnosed``: see ``diagnosis``),
  so a stalled replica's stacks never hold up the loop;
* the dual-phase replays it runs in the background too (``ReplayLocated``: see
  ``sdc_replay``).

Every action is logged with its reason (``ActionTaken``); every drain reason goes
through ``ft_launch.health.drain``'s one sanitiser.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ft_launch.config import Config, PromotionPath, SlowPolicy, SpikePolicy, StandbyMode
from ft_launch.env import ENV_ROLLBACKS
from ft_launch.errors import ExitCode, SlurmCommandError
from ft_launch.events import Event, EventLog, NodeDrained
from ft_launch.health.anomaly import PeerSlowdownDetector, StepLossSpikes
from ft_launch.health.drain import drain_node, drain_reason
from ft_launch.health.drain_request import job_comment, write_request
from ft_launch.slurm.client import SlurmBackend, cancel_named_step, launch_logged
from ft_launch.slurm.commands import StepSpec
from ft_launch.slurm.states import Disposition, node_disposition

from ..heartbeat import HeartbeatWriter
from ..quorum.events import MembersLivenessChanged
from ..worker.events import StepCommitted, StepDiscarded, WorkerStarted
from ..worker.identity import ENV_REPLICA_ID, ENV_SECRET, replica_world_env
from ..worker.pids import clear_rank_pids
from ..worker.rollbacks import Rollbacks
from . import lifecycle, recovery, rollback, versions
from .diagnosis import DIAGNOSIS_DIR, HangDiagnosis, HangRequest
from .events import (
    ActionTaken,
    EventTail,
    FullRestartOrdered,
    NodeDrainRequested,
    ReplicaExited,
    ReplicaLaunched,
    RunFinished,
    StandbyPromoted,
)
from .inspection import NodeInspection
from .plan import LaunchPlan, replica_step_spec
from .pool import ReservationPool
from .replay_rule import RunReplay
from .run_state import RunState
from .sdc_replay import ReplaySetup, SdcReplays
from .standby import activate, unhealthy_file

log = logging.getLogger(__name__)
NODE_CHECK_INTERVAL = 2.0


@dataclass
class Watched:
    """A running step the supervisor owns (a replica, or a standby agent)."""

    name: str
    proc: subprocess.Popen[bytes]
    job_id: str | None = None   # the job the step runs in (a standby job, or the main one)


def system_clock() -> lifecycle.Now:
    return lifecycle.Now(elapsed=time.monotonic(), wall=time.time())


class Supervisor:
    """The shell of ``ft-launch run``'s controller: it observes, hands each observation
    to ``lifecycle.decide`` and carries out the actions that come back, in order.

    Owns: the controller's state (``lifecycle.ControllerState``, replaced by each
    decision), the running job steps (``replicas``: one srun per replica; ``standbys``:
    one warm standby agent per standby node), each replica's rank-0 event file tail,
    the hang diagnoses and dual-phase replays running in the background (``replays``),
    and where configured the reservation pool of standby nodes (``pool``), the
    inspection collector and its per-node steps (``inspection``), the fail-slow and
    loss-spike detectors (``pace``, ``spikes``).

    The loop (``run``): ``start`` decides ``RunStarted`` and launches what it orders,
    then every ``recovery.poll_interval`` ``poll`` observes (new event-file lines,
    exited steps, Slurm's node states, inspection alarms, ``ft-launch update``
    requests, finished diagnoses and replays), turns each observation into one
    ``lifecycle`` event, then a ``Tick``, and passes each to ``decide``, which calls
    ``lifecycle.decide`` and ``execute``s its actions (srun, scancel, scontrol drain,
    events). It ends with the exit code of a ``FinishRun`` or ``GiveUp`` action, and
    in any case stops everything it started (``stop_all``).

    It never decides itself: whether to retry, evict, promote, restart, roll back or
    give up is ``lifecycle.decide``'s alone. Where carrying out an action fails in a
    way the decision must know (Slurm refuses a promotion), that outcome goes back to
    ``decide`` as an event (``PromotionFailed``); a drain Slurm refuses is handed to
    the node's Epilog instead.

    Starts: an srun process (``subprocess.Popen``) per replica, standby agent and
    inspection step; the heartbeat writer thread (``HeartbeatWriter``, for as long as
    ``run`` runs); a thread per hang diagnosis and per replay, each of which starts
    its own sruns. Torch is never imported.

    Args:
        config: the run's configuration.
        plan: the launch plan (replicas and their nodes, standby nodes, the job).
        slurm: the Slurm backend every srun, scancel and scontrol goes through.
        run_dir: the shared run directory (events, logs, heartbeat, diagnoses).
        worker_env: the environment every step gets (the job secret among it).
        events: the controller's event log.
        clock: the time ``decide`` is given; the system clock unless a test's.
        listen_host: where the controller's own endpoints (the inspection collector)
            listen; None: its host name's address.
    """

    def __init__(self, config: Config, plan: LaunchPlan, slurm: SlurmBackend, run_dir: Path,
                 worker_env: dict[str, str], events: EventLog,
                 clock: Callable[[], lifecycle.Now] = system_clock,
                 listen_host: str | None = None) -> None:
        """``listen_host``: where the controller's own endpoints (the inspection
        collector) listen: the source address of its route to the nodes; None:
        its host name's address."""
        self.config = config
        self.plan = plan
        self.slurm = slurm
        self.run_dir = run_dir
        self.worker_env = worker_env
        self.events = events
        self.clock = clock
        run = RunState.initial(plan.command, versions.digest_command(plan.command, Path.cwd()),
                               {r.replica_id: r.nodes for r in plan.replicas}, clock().wall,
                               standby=plan.standby,
                               nodes_per_replica=config.job.nodes_per_replica,
                               last_standby=plan.batch_host)
        self.state = lifecycle.ControllerState.initial(run, lifecycle.Policy.from_config(config))
        self.replicas: dict[int, Watched] = {}
        self.standbys: dict[str, Watched] = {}
        self.tails = {r.replica_id: EventTail(run_dir / "events" /
                                              f"replica-{r.replica_id}-rank-0.jsonl")
                      for r in plan.replicas}
        self.logs = run_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self._last_node_check: float | None = None
        self.pool = ReservationPool(slurm, config.job, plan.job_id or "") \
            if config.job.standby_mode is StandbyMode.RESERVATION else None
        self.inspection = NodeInspection(
            config.health, slurm, worker_env[ENV_SECRET], worker_env, self.logs,
            config.slurm.srun_extra_args, listen_host) if config.health.inspection else None
        self._updates_read = 0
        self._expanded: set[str] = set()    # nodes the job got by expansion
        self._launches: dict[int, int] = {}   # replica -> launches so far
        self._diagnoses: dict[int, HangDiagnosis] = {}   # replica -> its running diagnosis
        self._diagnosis_count = 0
        self.replays = SdcReplays(ReplaySetup(
            slurm, run_dir, plan.job_id or "", worker_env[ENV_SECRET], worker_env,
            len(plan.replicas), plan.tasks_per_node, config.recovery.replay_timeout,
            config.ckpt.fetch_timeout, config.ckpt.fetch_streams, config.slurm.srun_extra_args))
        rules = config.recovery
        self.pace = (PeerSlowdownDetector(rules.slow_factor, rules.slow_window)
                     if rules.slow_policy is not SlowPolicy.OFF else None)
        self.spikes = (StepLossSpikes(rules.spike_factor, rules.spike_window)
                       if rules.spike_policy is not SpikePolicy.OFF else None)

    # ------------------------------------------------------------------ launching

    def _popen(self, spec: StepSpec, env: dict[str, str], log_name: str
               ) -> subprocess.Popen[bytes]:
        return launch_logged(self.slurm, spec, self.logs / log_name, env)

    def launch_replica(self, replica_id: int, nodes: tuple[str, ...], how: str,
                       command: tuple[str, ...]) -> None:
        for node in nodes:  # a node taken over from the pool: end its standby agent
            self._cancel_standby(node)
        if how != "initial":
            # Stop-time diagnosis before a retry in place (or on a node new to the job):
            # the gate's health checks; a failure exits 76 and the node is evicted.
            command = (sys.executable, "-m", "ft_launch.slurm_plugins.gate", "--", *command)
        spec = replica_step_spec(self.plan, nodes, replica_id,
                                 self.config.slurm.srun_extra_args, command=command,
                                 overlap=bool(set(nodes) & self._expanded))
        env = self._replica_env(replica_id, len(nodes))
        proc = self._popen(spec, env, f"replica-{replica_id}")
        self.replicas[replica_id] = Watched(spec.name, proc, self.plan.job_id)
        self.events.emit(ReplicaLaunched(replica_id=replica_id, nodes=list(nodes), how=how))

    def _replica_env(self, replica_id: int, nodes: int) -> dict[str, str]:
        launch = self._launches[replica_id] = self._launches.get(replica_id, -1) + 1
        clear_rank_pids(self.run_dir, replica_id)   # a diagnosis finds only the new ones
        return {**self.worker_env, ENV_REPLICA_ID: str(replica_id),
                # the states a (re)launched replica may restore (``rollback``)
                ENV_ROLLBACKS: Rollbacks(self.state.rolled_back).to_env(),
                **replica_world_env(self.plan.job_id or "", replica_id, launch, nodes,
                                    self.plan.tasks_per_node)}

    def launch_standby(self, node: str) -> None:
        command = (sys.executable, "-m", "ft_launch.slurm_plugins.gate", "--",
                   sys.executable, "-m", "ft_launch.launcher.controller.standby",
                   "--run-dir", str(self.run_dir), "--node", node, "--", *self.plan.command)
        job_id = (self.pool.job_of(node) if self.pool else None) or self.plan.job_id
        spec = StepSpec(nodes=(node,), command=command, tasks_per_node=self.plan.tasks_per_node,
                        name=f"standby-{node}", job_id=job_id,
                        extra_args=self.config.slurm.srun_extra_args)
        self.standbys[node] = Watched(spec.name, self._popen(spec, self.worker_env,
                                                              f"standby-{node}"), job_id)

    def start(self) -> None:
        code = self.decide(lifecycle.RunStarted())
        if code is not None:
            raise RuntimeError(f"the run ended as it started (exit code {code})")
        if self.pool is not None:
            for node in self.pool.acquire():
                self.decide(recovery.StandbyAdded(node))
        for node in self.state.run.standby:
            self.launch_standby(node)
        for replica in self.state.run.replicas:
            for node in replica.nodes:
                self._inspect(node, self.plan.job_id)
        for node in self.state.run.standby:
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
        observed: list[lifecycle.Event] = [*self._read_progress(), *self._reap_exits()]
        now = self.clock()
        if self._last_node_check is None or \
                now.elapsed - self._last_node_check > NODE_CHECK_INTERVAL:
            self._last_node_check = now.elapsed
            observed.append(lifecycle.NodesReported(tuple(
                self._unhealthy(lifecycle.nodes_to_check(self.state)).items())))
        if self.inspection is not None:
            observed += [lifecycle.InspectionAlarmed(node, reason)
                         for node, reason in self.inspection.alarms()]
        observed += self._update_requests()
        observed += self._diagnosed()
        observed += self._replayed()
        for event in [*observed, lifecycle.Tick()]:
            code = self.decide(event)
            if code is not None:
                return code
        if self.pool is not None and self.pool.grow_due(now.elapsed):
            self._replenish()
        return None

    def decide(self, event: lifecycle.Event) -> int | None:
        """The one decision, then its actions in order; an exit code when the run ends."""
        decision = lifecycle.decide(self.state, event, self.clock())
        self.state = decision.state
        if decision.actions:
            log.info("decided: %s", decision.reason)
        return self._execute_all(decision.actions)

    def _execute_all(self, actions: list[lifecycle.Action]) -> int | None:
        for action in actions:
            code = self.execute(action)
            if code is not None:
                return code
        return None

    # ------------------------------------------------------------------ observing

    def _update_requests(self) -> list[lifecycle.Event]:
        """New ``ft-launch update`` requests."""
        try:
            requests = versions.read_update_requests(self.run_dir, after=self._updates_read)
        except versions.UpdateRequestError as error:
            log.error("update request ignored: %s", error)
            self._updates_read += 1
            return []
        self._updates_read = max([self._updates_read, *(r.number for r in requests)])
        return [versions.UpdateRequested(request) for request in requests]

    def _read_progress(self) -> list[lifecycle.Event]:
        """Each replica's new lines, in order: runs of commits (counted as one event)
        between the lines the controller acts on."""
        found: list[lifecycle.Event] = []
        trained: list[StepCommitted] = []
        for replica_id, tail in self.tails.items():
            commits = 0
            for event in tail.read():
                if isinstance(event, StepCommitted):
                    commits += 1
                    trained.append(event)
                    slowed = self._paced(replica_id, event)
                    if slowed is None:
                        continue
                    found.extend([lifecycle.StepsCommitted(replica_id, commits), slowed])
                    commits = 0
                    continue
                if isinstance(event, WorkerStarted) and self.pace is not None:
                    self.pace.forget(replica_id)    # a new process: a new pace
                observed = _observation(replica_id, event)
                if observed is not None:
                    if commits:
                        found.append(lifecycle.StepsCommitted(replica_id, commits))
                    found.append(observed)
                    commits = 0
            if commits:
                found.append(lifecycle.StepsCommitted(replica_id, commits))
        # The spike watch judges a step once every replica reported it, or once the job
        # is a few steps further (a replica died in it): so it takes this poll's losses
        # in step order across the replicas. One replica's lines read before the others'
        # would have the step judged on that replica's loss alone.
        trained.sort(key=lambda commit: commit.step)
        found.extend(spike for spike in map(self._spiked, trained) if spike is not None)
        return found

    def _paced(self, replica_id: int, commit: StepCommitted) -> lifecycle.ReplicaSlowed | None:
        """A commit's own time (step minus waiting for the others) for the fail-slow
        watch: only trained steps with peers to wait for."""
        if (self.pace is None or commit.caught_up or commit.contributors < 2
                or commit.step_s is None or commit.wait_s is None):
            return None
        slow = self.pace.observe(replica_id, commit.step_s - commit.wait_s)
        return None if slow is None else lifecycle.ReplicaSlowed(replica_id, slow.own_s,
                                                                 slow.peers_s, slow.steps)

    def _spiked(self, commit: StepCommitted) -> rollback.LossSpikeFound | None:
        """A commit's loss for the loss-spike watch: only trained steps of the history
        the run is in (the lines of processes a rollback cancelled are read late)."""
        if (self.spikes is None or commit.caught_up or commit.loss is None
                or commit.history != len(self.state.rolled_back)):
            return None
        spike = self.spikes.observe(commit.step, commit.loss, commit.contributors,
                                    commit.history)
        return None if spike is None else rollback.LossSpikeFound(
            spike.step, spike.loss, spike.baseline, spike.replicas, commit.history)

    def _reap_exits(self) -> list[lifecycle.Event]:
        found: list[lifecycle.Event] = []
        for replica_id, watched in list(self.replicas.items()):
            code = watched.proc.poll()
            if code is None:
                continue
            del self.replicas[replica_id]
            self.events.emit(ReplicaExited(replica_id=replica_id, exit_code=code))
            log.info("replica %d exited with %d", replica_id, code)
            nodes = self.state.run.replica(replica_id).nodes
            found.append(lifecycle.StepExited(replica_id, code,
                                              tuple(self._unhealthy(nodes).items()),
                                              self._gate_reason(nodes[0]) if nodes else None))
        for node, watched in list(self.standbys.items()):
            code = watched.proc.poll()
            if code is not None:
                del self.standbys[node]
                found.append(lifecycle.StandbyAgentExited(node, code))
        return found

    def _gate_reason(self, node: str) -> str | None:
        """What the gate found, when a promoted standby wrote it down."""
        try:
            return unhealthy_file(self.run_dir, node).read_text(encoding="utf-8").strip()
        except OSError:
            return None

    def _unhealthy(self, nodes: tuple[str, ...]) -> dict[str, str]:
        """Nodes Slurm reports unusable (down, not responding, failing), with why."""
        if not nodes:
            return {}
        try:
            infos = self.slurm.nodes(nodes)
        except SlurmCommandError as error:
            log.warning("cannot read node states: %s", error)
            return {}
        return {i.name: f"Slurm reports {i.state.value}+{'+'.join(sorted(i.flags))}"
                for i in infos if i.name in nodes
                and node_disposition(i.state, i.flags) is Disposition.NODE_UNHEALTHY}

    # ------------------------------------------------------------------ actions

    def execute(self, action: lifecycle.Action) -> int | None:
        if isinstance(action, Event):
            self.events.emit(action)
            return None
        self._record(action)
        if isinstance(action, recovery.EvictNode):
            self._drain(action.node, action.reason)
        elif isinstance(action, recovery.CancelReplica):
            self._cancel_replica(action.replica_id)
        elif isinstance(action, recovery.PromoteStandby):
            self._promote(action.replica_id, action.node, action.command)
        elif isinstance(action, lifecycle.StartReplica):
            self.launch_replica(action.replica_id, action.nodes, "initial", action.command)
        elif isinstance(action, recovery.RelaunchReplica):
            self.launch_replica(action.replica_id, action.nodes, "relaunch", action.command)
        elif isinstance(action, recovery.FullRestart):
            self.events.emit(FullRestartOrdered(placements={str(r): list(nodes) for r, nodes
                                                            in action.placements}))
            for (replica_id, nodes), command in zip(action.placements, action.commands,
                                                    strict=True):
                self.launch_replica(replica_id, nodes, "restart", command)
        elif isinstance(action, recovery.GiveUp):
            code = ExitCode.FATAL_NO_REQUEUE if action.fatal else ExitCode.RECOVERABLE
            self.events.emit(RunFinished(exit_code=code, reason=action.reason))
            log.error("giving up: %s", action.reason)
            return code
        elif isinstance(action, lifecycle.FinishRun):
            self.events.emit(RunFinished(exit_code=ExitCode.OK, reason=action.reason))
            return ExitCode.OK
        elif isinstance(action, lifecycle.DiagnoseHang):
            self._diagnose(action)
        elif isinstance(action, RunReplay):
            self.replays.start(action)
        return None

    # ------------------------------------------------------------------ hang diagnosis

    def _diagnose(self, action: lifecycle.DiagnoseHang) -> None:
        """Take the stalled replica's stacks on a thread of its own (bounded by
        ``recovery.diagnosis_timeout``); ``_diagnosed`` hands the outcome to decide."""
        self._diagnosis_count += 1
        rid = action.replica_id
        out_dir = self.run_dir / DIAGNOSIS_DIR / f"hang-{rid}-{self._diagnosis_count}"
        watched = self.replicas.get(rid)
        request = HangRequest(rid, action.nodes, self.plan.tasks_per_node,
                              action.stall or action.reason, out_dir)
        self._diagnoses[rid] = HangDiagnosis(
            self.slurm, request, self.run_dir,
            (watched.job_id if watched else None) or self.plan.job_id or "",
            self.config.recovery.diagnosis_timeout,
            self.config.slurm.srun_extra_args).start()

    def _diagnosed(self) -> list[lifecycle.Event]:
        found: list[lifecycle.Event] = []
        for rid, diagnosis in list(self._diagnoses.items()):
            outcome = diagnosis.outcome
            if outcome is None:
                continue
            del self._diagnoses[rid]
            self.events.emit(outcome.record())
            found.append(lifecycle.HangDiagnosed(rid, outcome.suspects, outcome.summary,
                                                 outcome.report, outcome.error))
        return found

    def _replayed(self) -> list[lifecycle.Event]:
        found: list[lifecycle.Event] = []
        for outcome in self.replays.finished():
            self.events.emit(outcome.record())
            found.append(outcome.located())
        return found

    def _record(self, action: lifecycle.Order) -> None:
        log.info("action: %s (%s)", type(action).__name__, action.reason)
        node = getattr(action, "node", None)
        self.events.emit(ActionTaken(action=type(action).__name__,
                                     replica_id=getattr(action, "replica_id", None),
                                     node=node if isinstance(node, str) else None,
                                     reason=action.reason))

    def _drain(self, node: str, reason: str) -> None:
        """Drain through ``ft_launch.health.drain`` (its one sanitised ``ft: <reason>`` format); an
        evicted node is drained even when an earlier drain left another reason."""
        try:
            drain_node(self.slurm, node, reason, keep_existing=False)
            self.events.emit(NodeDrained(node=node, reason=drain_reason(reason)))
        except SlurmCommandError as error:
            # Without operator rights: recorded, so the node's Epilog drains it (through
            # the same sanitiser).
            log.error("could not drain %s (%s): %s; the Epilog will", node, reason, error)
            self._request_epilog_drain(node, reason)
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

    def _promote(self, replica_id: int, node: str, command: tuple[str, ...]) -> None:
        if self.pool is not None and node in self.pool.holder \
                and self.pool.path is PromotionPath.EXPANSION:
            self._cancel_standby(node)
            if self.inspection is not None:
                self.inspection.unwatch(node)   # its step ends with the standby job's node
            try:
                self.pool.move_to_main(node)
            except SlurmCommandError as error:
                # Its standby job is gone, but Slurm did not hand the node over (a busy
                # slurmctld; a node slow to end the standby job): the run goes on.
                log.error("standby %s not moved into job %s: %s", node, self.plan.job_id, error)
                self.decide(lifecycle.PromotionFailed(
                    replica_id, node, f"promotion failed: Slurm did not move {node} into job "
                                      f"{self.plan.job_id} (the controller's log says why)"))
                return
            self._expanded.add(node)
            self._inspect(node, self.plan.job_id)
            self.events.emit(StandbyPromoted(replica_id=replica_id, node=node,
                                             how="moved into the job (expansion)"))
            self.launch_replica(replica_id, (node,), "promoted", command)
        else:
            watched = self.standbys.pop(node)
            env = self._replica_env(replica_id, 1)
            activate(self.run_dir, node, env, command=command)
            self.replicas[replica_id] = Watched(watched.name, watched.proc, watched.job_id)
            how = "warm agent in the allocation"
            if self.pool is not None and node in self.pool.holder:
                self.pool.promoted_in_place(node)
                how = f"warm agent in standby job {watched.job_id}"
            self.events.emit(StandbyPromoted(replica_id=replica_id, node=node, how=how))
            self.events.emit(ReplicaLaunched(replica_id=replica_id, nodes=[node],
                                             how="promoted"))
        self._replenish()

    def _replenish(self) -> None:
        """Reservation mode: hold a new standby node for one a promotion used (``poll``
        tries again while the pool is short)."""
        if self.pool is None or not self.pool.short:
            return
        added = self.pool.grow(self.clock().elapsed)
        if added is not None:
            self.decide(recovery.StandbyAdded(added))
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
        for diagnosis in self._diagnoses.values():
            diagnosis.cancel()
        self.replays.cancel_all()
        for replica_id in list(self.replicas):
            self._cancel_replica(replica_id)
        for node in list(self.standbys):
            self._cancel_standby(node)
        if self.inspection is not None:
            self.inspection.close()
        if self.pool is not None:
            self.pool.release()


def _observation(replica_id: int, event: Event) -> lifecycle.Event | None:
    """What a line of a replica's event file tells the controller (None: nothing)."""
    if isinstance(event, WorkerStarted):
        return lifecycle.ProcessStarted(replica_id)
    if isinstance(event, MembersLivenessChanged) and event.lost:
        return lifecycle.QuorumLostMembers(replica_id, tuple(event.lost))
    if isinstance(event, StepDiscarded) and event.nonfinite_nodes:
        return lifecycle.GradientsNonFinite(replica_id, tuple(event.nonfinite_nodes))
    return None
