"""The controller's one decision (pure): ``decide(state, event, now) -> Decision``.

Everything ``ft-launch run`` observes arrives as one event; ``decide`` returns the
new state, the actions to carry out in order (each saying why) and the reason of
the decision as a whole. The shell (``supervisor``) only observes (srun exits, event
files, ``scontrol``, inspection) and executes; it decides nothing.

    event --> observation rules here (exit codes, stalls, node reports, finish)
          --> fault / update facts --> versions table (rollback, rollout)
                                   --> recovery table (retry, evict, promote, restart)
          --> a loss spike --> rollback rule (``rollback``: every replica restarted)
          --> every launch stamped with the code version it runs

Time comes in as ``Now``: ``elapsed`` (monotonic: timeouts, unaffected by clock
steps) and ``wall`` (seconds since the epoch: update windows and records).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ft_launch.config import SlowPolicy
from ft_launch.errors import ExitCode
from ft_launch.events import Event as Record

from . import recovery, replay_rule, rollback, versions
from .events import FailSlowDetected, NodeFaultDetected
from .lifecycle_model import (
    Action,
    ControllerState,
    Decision,
    DiagnoseHang,
    Event,
    FinishRun,
    GradientsNonFinite,
    HangDiagnosed,
    HangWatch,
    InspectionAlarmed,
    NodesReported,
    Now,
    Order,
    Policy,
    ProcessStarted,
    PromotionFailed,
    QuorumLostMembers,
    ReplicaSlowed,
    RunStarted,
    StandbyAgentExited,
    StartReplica,
    StepExited,
    StepsCommitted,
    Tick,
    Watch,
)
from .run_state import ReplicaProgressed, ReplicaState, RunState

#: The values are ``lifecycle_model``'s, re-exported: ``decide`` takes and returns them.
__all__ = [
    "Action", "ControllerState", "Decision", "DiagnoseHang", "Event", "FinishRun",
    "GradientsNonFinite", "HangDiagnosed", "HangWatch", "InspectionAlarmed",
    "NodesReported", "Now", "Order", "Policy", "ProcessStarted", "PromotionFailed",
    "QuorumLostMembers", "ReplicaSlowed", "RunStarted", "StandbyAgentExited", "StartReplica",
    "StepExited", "StepsCommitted", "Tick", "Watch", "decide", "nodes_to_check",
]


def nodes_to_check(state: ControllerState) -> tuple[str, ...]:
    """The nodes whose Slurm state matters now: live replicas' and the standby pool."""
    return tuple(sorted(_watched_nodes(state)))


def _watched_nodes(state: ControllerState) -> dict[str, int | None]:
    watched: dict[str, int | None] = {n: r.replica_id for r in state.run.replicas
                                      if state.watch[r.replica_id].live for n in r.nodes}
    watched.update({n: None for n in state.run.standby})
    return watched


# --------------------------------------------------------------------------- decide


def decide(state: ControllerState, event: Event, now: Now) -> Decision:
    if isinstance(event, RunStarted):
        starts: list[Action] = [StartReplica(r.replica_id, r.nodes, "the run starts")
                                for r in state.run.replicas]
        return _finish(state, starts, now, "the run starts: every replica launched")
    if isinstance(event, ProcessStarted):
        watch = replace(state.watch[event.replica_id], awaiting_start=False)
        return Decision(state.with_watch(event.replica_id, watch), [],
                        f"replica {event.replica_id}'s process started")
    if isinstance(event, StepsCommitted):
        return _committed(state, event, now)
    if isinstance(event, StepExited):
        return _exited(state, event, now)
    if isinstance(event, StandbyAgentExited):
        faults = [recovery.NodeFaulted(None, event.node, f"standby agent exited with "
                                                         f"{event.exit_code}")] \
            if event.node in state.run.standby else []
        return _faults(state, faults, now, f"standby agent on {event.node} exited")
    if isinstance(event, PromotionFailed):
        # the same path as a promoted standby whose gate fails: the next standby, or
        # the replica is lost and the others train on
        return _faults(state, [recovery.NodeFaulted(event.replica_id, event.node, event.reason)],
                       now, f"the promotion of {event.node} failed")
    if isinstance(event, NodesReported):
        watched = _watched_nodes(state)
        faults = [recovery.NodeFaulted(watched[node], node, reason)
                  for node, reason in event.unhealthy if node in watched]
        return _faults(state, faults, now, "Slurm reports node states")
    if isinstance(event, GradientsNonFinite):
        if replay_rule.applies(state.policy.sdc_replay, state.run, event.replica_id):
            return _replayed(state, _replay_nonfinite(state, event, now), now)
        return _nonfinite(state, event, now)
    if isinstance(event, replay_rule.ReplayLocated):
        return _replayed(state, replay_rule.on_located(state.replays, event), now)
    if isinstance(event, QuorumLostMembers):
        return _quorum_lost(state, event)
    if isinstance(event, ReplicaSlowed):
        return _slowed(state, event, now)
    if isinstance(event, HangDiagnosed):
        return _hang_diagnosed(state, event, now)
    if isinstance(event, rollback.LossSpikeFound):
        spiked = rollback.decide(state.run, state.rolled_back, event, state.policy.spikes, now.wall)
        return _finish(replace(state, run=spiked.run, rolled_back=spiked.rolled_back),
                       list(spiked.actions), now, spiked.reason)
    if isinstance(event, InspectionAlarmed):
        faults = [] if event.node in state.run.evicted else [
            recovery.NodeFaulted(None, event.node, event.reason)]
        return _faults(state, faults, now, f"inspection alarm on {event.node}")
    if isinstance(event, versions.UpdateRequested):
        run, versioned = versions.decide_version(state.run, event, now.wall, state.policy.versions)
        run, actions = _restarts(run, versioned, state.policy)
        return _finish(replace(state, run=run), actions, now,
                       f"update request {event.request.number}")
    if isinstance(event, recovery.StandbyAdded):
        # Only the pool changes: nothing to launch, roll or finish (the shell hears of a
        # new standby while it carries out a promotion).
        run, added = recovery.decide(state.run, event, state.policy.recovery)
        return Decision(replace(state, run=run), list(added), f"standby {event.node} added")
    overdue = replay_rule.on_tick(state.replays, now.elapsed, state.policy.replay_timeout)
    if overdue is not None:
        return _replayed(state, overdue, now)
    return _ticked(state, now)


def _replay_nonfinite(state: ControllerState, event: GradientsNonFinite, now: Now
                      ) -> replay_rule.ReplayDecision:
    watch = state.watch[event.replica_id]
    training = [r.replica_id for r in state.run.replicas if _training(state, r.replica_id)]
    return replay_rule.on_nonfinite(state.replays, state.run, event.replica_id,
                                    watch.live and not watch.awaiting_start, training,
                                    state.policy.nonfinite_limit, now.elapsed,
                                    state.policy.replay_on_standby)


def _replayed(state: ControllerState, decision: replay_rule.ReplayDecision, now: Now) -> Decision:
    """What the replay rule decided: a replay (the replica cancelled first), or its
    nodes to evict (one failure of it, as a hang's)."""
    state, replica_id = replace(state, replays=decision.book), decision.replica_id
    actions: list[Action] = [decision.record] if decision.record is not None else []
    if decision.replay is not None:
        actions += [recovery.CancelReplica(replica_id, decision.reason), decision.replay]
    if decision.evict:
        state, evicted = _hang_faults(state, replica_id, decision.evict, decision.reason, now)
        actions += evicted
    return _finish(state, actions, now, decision.reason)


def _nonfinite(state: ControllerState, event: GradientsNonFinite, now: Now) -> Decision:
    """Every replica discards a step with a non-finite average, so one bad step costs
    little; a node whose ranks keep computing NaN/Inf corrupts silently: evict it."""
    counts = dict(state.nonfinite_steps)
    for node in event.nodes:
        counts[node] = counts.get(node, 0) + 1
    state = replace(state, nonfinite_steps=tuple(sorted(counts.items())))
    limit = state.policy.nonfinite_limit
    watched = _watched_nodes(state)
    faults = [recovery.NodeFaulted(event.replica_id, node,
                                   f"sdc: gradients computed on {node} held NaN/Inf in "
                                   f"{counts[node]} steps (replica {event.replica_id})")
              for node in event.nodes
              if limit and counts[node] >= limit and watched.get(node) == event.replica_id]
    return _faults(state, faults, now,
                   f"replica {event.replica_id}: NaN/Inf gradients from "
                   f"{', '.join(event.nodes)}")


def _slowed(state: ControllerState, event: ReplicaSlowed, now: Now) -> Decision:
    """A fail-slow replica holds every other one back: under ``recovery.slow_policy =
    evict`` its nodes are drained and a standby takes its place (which node of a
    multi-node replica is slow its rank 0 cannot tell: all of them go)."""
    rid = event.replica_id
    nodes = state.run.replica(rid).nodes
    # no quotes: a drain reason keeps to what scontrol takes (ft_launch.health.drain)
    reason = (f"fail-slow: replica {rid} took {event.own_s / event.peers_s:.1f}x as long as "
              f"its peers for its own part of a step ({event.own_s:.3g} s against "
              f"{event.peers_s:.3g} s, medians of {event.steps} steps)")
    record = FailSlowDetected(replica_id=rid, nodes=list(nodes), own_s=event.own_s,
                              peers_s=event.peers_s, steps=event.steps, reason=reason,
                              time=now.wall)
    if state.policy.slow_policy is not SlowPolicy.EVICT or not _training(state, rid):
        return Decision(state, [record], f"{reason}: reported, not evicted")
    decision = _faults(state, [recovery.NodeFaulted(None, node, reason) for node in nodes], now,
                       f"replica {rid} is fail-slow")
    return replace(decision, actions=[record, *decision.actions])


def _started_in(state: ControllerState, replica_id: int, phase: ReplicaState) -> bool:
    """In ``phase``, watched, and its process started since its last (re)launch."""
    watch = state.watch[replica_id]
    return (state.run.replica(replica_id).state is phase and watch.live
            and not watch.awaiting_start)


def _training(state: ControllerState, replica_id: int) -> bool:
    """Running, watched, and not (re)launched since: its commits are its own."""
    return _started_in(state, replica_id, ReplicaState.RUNNING)


def _recovering(state: ControllerState, replica_id: int) -> bool:
    """Relaunched, its process started, not committed yet."""
    return _started_in(state, replica_id, ReplicaState.RECOVERING)


def _waits_for_lost(state: ControllerState, replica_id: int) -> bool:
    """It reported training replicas lost that are not replaced yet: with too few
    members left for a quorum (``quorum.min_replicas``, a majority) it cannot commit
    until they are, however healthy its node."""
    return any(reporter == replica_id and _training(state, lost)
               for lost, reporter in state.suspects)


def _quorum_lost(state: ControllerState, event: QuorumLostMembers) -> Decision:
    """A replica's quorum names members it lost, long before ``lost_timeout``. Its word
    alone is not enough (a partitioned leader loses everyone; a new leader, or one
    starved of CPU, may not have heard a live member in time): each lost replica that
    trains is suspected, and found lost only when the reporter commits again before it
    does while it has been silent for ``quorum.member_timeout`` in its own event file
    too (``_committed``): the reporter trained on without it, and it did not go on.
    A relaunched replica's report counts too: until it is settled, that replica's
    silence is the quorum waiting for the lost, not its node's fault (``_stalls``)."""
    if not (_training(state, event.reporter) or _recovering(state, event.reporter)):
        return Decision(state, [], f"replica {event.reporter} reports lost {list(event.lost)}"
                                   " but does not train")
    new = [(rid, event.reporter) for rid in event.lost
           if rid != event.reporter and 0 <= rid < len(state.watch) and _training(state, rid)
           and (rid, event.reporter) not in state.suspects]
    return Decision(replace(state, suspects=state.suspects + tuple(new)), [],
                    f"replica {event.reporter}'s quorum lost {list(event.lost)}")


def _committed(state: ControllerState, event: StepsCommitted, now: Now) -> Decision:
    rid = event.replica_id
    watch = state.watch[rid]
    if watch.awaiting_start:
        # Read before an action relaunched it: the cancelled process's lines.
        return Decision(state, [], f"stale commits of replica {rid} ignored")
    t = now.elapsed
    # (several commits read at once: the one before was just now too)
    previous = t if event.count > 1 else watch.last_commit
    continuing = (watch.last_commit is not None and watch.moving_since is not None
                  and t - watch.last_commit <= state.policy.lost_timeout / 2)
    watch = replace(watch, last_time=t, last_commit=t, previous_commit=previous,
                    moving_since=watch.moving_since if continuing else t)
    state = state.with_watch(rid, watch)
    # Any new commit is progress: after a full restart, steps repeat from the
    # checkpoint's, below the highest ever seen.
    state = replace(state, run=recovery.decide(state.run, ReplicaProgressed(rid))[0])
    # it lives: nobody's suspect; the ones it reported lost stayed silent while it went on
    # (for as long as the quorum waited for them: else they may be alive, and stay suspects)
    reported = [lost for lost, reporter in state.suspects
                if reporter == rid and _training(state, lost)]
    confirmed = [lost for lost in reported
                 if t - state.watch[lost].last_time >= state.policy.member_timeout]
    state = replace(state, suspects=tuple(s for s in state.suspects if s[0] != rid and
                                          not (s[1] == rid and s[0] not in reported) and
                                          s[0] not in confirmed))
    faults = [recovery.NodeFaulted(lost, state.run.replica(lost).nodes[0],
                                   f"the quorum of replica {rid} lost replica {lost}, and "
                                   f"replica {rid} trained on without it")
              for lost in confirmed]
    if faults:
        return _faults(state, faults, now, f"replica {rid} committed without replica(s) "
                                           f"{confirmed}")
    return _finish(state, [], now, f"replica {rid} committed {event.count} step(s)")


def _exited(state: ControllerState, event: StepExited, now: Now) -> Decision:
    rid = event.replica_id
    state = state.with_watch(rid, replace(state.watch[rid], live=False))
    nodes = state.run.replica(rid).nodes
    why = f"replica {rid} exited with {event.exit_code}"
    if event.exit_code == 0:
        # srun of a --no-kill job also ends with 0 when its node fails: finished only if
        # Slurm still has the nodes healthy.
        failing = [recovery.NodeFaulted(rid, node, f"step ended with its node failing ({reason})")
                   for node, reason in event.failing_nodes if node in nodes]
        if failing:
            return _faults(state, failing, now, why)
        run, _ = recovery.decide(state.run, recovery.ReplicaFinished(rid))
        return _finish(replace(state, run=run), [], now, f"replica {rid} finished")
    if event.exit_code == ExitCode.RUN_FINISHED:
        # started again after another replica had finished the run: nothing to join,
        # and nothing a relaunch could do
        run, _ = recovery.decide(state.run, recovery.ReplicaFinished(rid))
        return _finish(replace(state, run=run), [], now,
                       f"replica {rid} found the run finished: nothing to join")
    if event.exit_code == ExitCode.NODE_UNHEALTHY and nodes:
        reason = event.gate_reason or "health gate failed (its reason is in the replica's log)"
        return _faults(state, [recovery.NodeFaulted(rid, nodes[0], reason)], now, why)
    return _failure(state, recovery.ReplicaCrashed(rid, event.exit_code), [], now, why)


def _ticked(state: ControllerState, now: Now) -> Decision:
    stalls = _stalls(state, now.elapsed)
    if not state.policy.hang_diagnosis:
        return _faults(state, stalls, now, "time passed")
    return _diagnose_stalls(state, stalls, now)


# ------------------------------------------------------------------- hang diagnosis


def _diagnose_stalls(state: ControllerState, stalls: Sequence[recovery.NodeFaulted], now: Now
                     ) -> Decision:
    """A stalled replica is diagnosed before it is evicted: its ranks' stacks say which
    node hangs (``HangDiagnosed``). A diagnosis the shell never answers (twice its own
    bound) evicts every node of the replica, as a failed one does."""
    state = replace(state, diagnosing=tuple(h for h in state.diagnosing
                                            if _still_hung(state, h)))
    actions: list[Action] = []
    reasons = []
    limit = 2 * state.policy.diagnosis_timeout
    overdue = [h for h in state.diagnosing if now.elapsed - h.since > limit]
    for hang in overdue:
        state = _undiagnosed(state, hang.replica_id)
        reason = f"hang: {hang.why}; no stacks within {limit:g} s: every node of it"
        state, evicted = _hang_faults(state, hang.replica_id,
                                      state.run.replica(hang.replica_id).nodes, reason, now)
        actions += evicted
        reasons.append(reason)
    handled = {h.replica_id for h in state.diagnosing} | {h.replica_id for h in overdue}
    for fault in stalls:
        rid = fault.replica_id
        if rid is None or rid in handled:
            continue
        hang = HangWatch(rid, now.elapsed, state.watch[rid].launched_at, fault.reason)
        state = replace(state, diagnosing=state.diagnosing + (hang,))
        actions.append(DiagnoseHang(rid, state.run.replica(rid).nodes,
                                    f"{fault.reason}: its ranks' stacks are taken before "
                                    "anything is cancelled", stall=fault.reason))
        reasons.append(f"{fault.reason}: diagnosing")
    return _finish(state, actions, now,
                   "time passed" + (f": {'; '.join(reasons)}" if reasons else ""))


def _still_hung(state: ControllerState, hang: HangWatch) -> bool:
    """The diagnosed process runs on, silent: not relaunched, exited or committing."""
    watch = state.watch[hang.replica_id]
    return (watch.live and watch.launched_at == hang.launched_at
            and watch.last_time <= hang.since
            and not state.run.replica(hang.replica_id).retired)


def _undiagnosed(state: ControllerState, replica_id: int) -> ControllerState:
    return replace(state, diagnosing=tuple(h for h in state.diagnosing
                                           if h.replica_id != replica_id))


def _hang_diagnosed(state: ControllerState, event: HangDiagnosed, now: Now) -> Decision:
    """Evict the nodes the stacks name; every node of the replica when they name none
    (the diagnosis failed). An answer about a replica that moved on meanwhile (it
    committed, exited, or was relaunched) evicts nothing."""
    rid = event.replica_id
    hang = next((h for h in state.diagnosing if h.replica_id == rid), None)
    state = _undiagnosed(state, rid)
    if hang is None or not _still_hung(state, hang):
        return Decision(state, [], f"replica {rid}'s hang diagnosis came after it moved on: "
                                   "nothing to evict")
    nodes = state.run.replica(rid).nodes
    suspects = tuple(n for n in event.suspects if n in nodes)
    if suspects:
        reason = f"hang: {event.summary or 'stacks name ' + ', '.join(suspects)}; {hang.why}"
    else:
        suspects = nodes
        reason = f"hang: {hang.why}; {event.error or 'the stacks name no node'}: every node " \
                 "of it"
    state, actions = _hang_faults(state, rid, suspects, reason, now)
    return _finish(state, actions, now, f"replica {rid} hung: {reason}")


def _hang_faults(state: ControllerState, replica_id: int, nodes: Sequence[str], reason: str,
                 now: Now) -> tuple[ControllerState, list[Action]]:
    """Evict ``nodes`` of a hung replica: one failure of it (counted once against its
    code version), relaunched once even when it loses several nodes."""
    actions: list[Action] = []
    failures = state.run.replica(replica_id).failures
    for index, node in enumerate(nodes):
        actions.append(NodeFaultDetected(node=node, replica_id=replica_id, reason=reason,
                                         time=now.wall))
        fault = recovery.NodeFaulted(replica_id if index == 0 else None, node, reason)
        decision = _failure(state, fault, [], now, reason, finish=False)
        state, actions = decision.state, actions + decision.actions
    replica = state.run.replica(replica_id)
    if replica.failures > failures + 1:    # the recovery table counted each node
        state = replace(state, run=state.run.with_replica(replace(replica,
                                                                  failures=failures + 1)))
    superseded = [i for i, a in enumerate(actions) if isinstance(a, recovery.RelaunchReplica)
                  and any(isinstance(b, recovery.CancelReplica) and b.replica_id == a.replica_id
                          for b in actions[i + 1:])]
    return state, [a for i, a in enumerate(actions) if i not in superseded]


def _stalls(state: ControllerState, t: float) -> list[recovery.NodeFaulted]:
    """A replica that stopped committing while another went on: its node is suspect.
    Only commits count as going on: a replica just (re)launched is not progress, and
    survivors of a lost majority are stalled by the quorum, not by their nodes.

    "Going on" means committing steadily: the last commit within half the window and
    the one before within the window, from a replica not (re)launched within it. When
    a peer dies the survivors all stall on FTAR / quorum timeouts and resume a few ms
    apart; the first to resume is not yet "steady" if the stall was longer than the
    window, and if it was shorter the others are not over the limit. A restarted
    replica's catch-up commit does not count either. And it must have gone on for a
    whole window: after a lost majority re-forms, the survivors resume one quorum round
    apart, and the later ones get the same window to show progress as a replica that
    stalled alone."""
    window = state.policy.lost_timeout
    steady = [rid for rid, w in enumerate(state.watch)
              if w.live and t - w.launched_at > window
              and w.last_commit is not None and w.last_commit > t - window / 2
              and w.previous_commit is not None and w.previous_commit > t - window
              and w.moving_since is not None and t - w.moving_since >= window]
    found = []
    for replica in state.run.replicas:
        rid = replica.replica_id
        watch = state.watch[rid]
        if not watch.live:
            continue
        silent = t - watch.last_time
        recovering = replica.state is ReplicaState.RECOVERING
        limit = state.policy.start_timeout if recovering else window
        others_moving = any(other != rid for other in steady)
        if recovering and not others_moving:
            # Nobody trains: it needs the others to form a quorum, so its time runs
            # from the newest (re)launch among them, and not while replicas it
            # reported lost still await replacement (Slurm's word on their nodes).
            if _waits_for_lost(state, rid):
                continue
            silent = t - max([watch.last_time, *(w.launched_at for other, w in
                                                  enumerate(state.watch)
                                                  if other != rid and w.live)])
        if silent > limit and (others_moving or recovering):
            found.append(recovery.NodeFaulted(rid, replica.nodes[0],
                                              f"replica {rid} made no progress for "
                                              f"{silent:.0f} s"))
    return found


def _faults(state: ControllerState, faults: Sequence[recovery.NodeFaulted], now: Now,
            why: str) -> Decision:
    """Each fault recorded, then decided in turn."""
    actions: list[Action] = []
    for fault in faults:
        actions.append(NodeFaultDetected(node=fault.node, replica_id=fault.replica_id,
                                         reason=fault.reason, time=now.wall))
        decision = _failure(state, fault, [], now, why, finish=False)
        state, actions = decision.state, actions + decision.actions
    reason = "; ".join(f.reason for f in faults) if faults else why
    return _finish(state, actions, now, f"{why}: {reason}" if faults else why)


def _failure(state: ControllerState, event: recovery.NodeFaulted | recovery.ReplicaCrashed,
             actions: list[Action], now: Now, why: str, finish: bool = True) -> Decision:
    """Both tables hear of a replica's failure. A crash that rolls back a code update is
    the code's fault, not the node's: the replica is relaunched in place on the older
    version instead of being retried or evicted. A node fault reported without a
    replica (an alarm, Slurm) does not count against the code."""
    run = state.run
    recovery_event: recovery.RecoveryEvent = event
    if event.replica_id is not None:
        run, versioned = versions.decide_version(run, versions.ReplicaFailed(event.replica_id),
                                                 now.wall, state.policy.versions)
        run, more = _restarts(run, versioned, state.policy)
        actions = actions + more
        rollbacks = [a for a in versioned if isinstance(a, versions.RollBack)]
        if isinstance(event, recovery.ReplicaCrashed) and rollbacks:
            recovery_event = recovery.RestartRequested(event.replica_id, rollbacks[0].reason)
    run, recovered = recovery.decide(run, recovery_event, state.policy.recovery)
    state = replace(state, run=run)
    if not finish:
        return Decision(state, actions + list(recovered), why)
    return _finish(state, actions + list(recovered), now, why)


def _records(actions: Sequence[versions.VersionAction]) -> list[Record]:
    """The version table's records; its RunVersion / RollBack are consumed here."""
    return [a for a in actions if isinstance(a, Record)]


def _restarts(run: RunState, versioned: Sequence[versions.VersionAction], policy: Policy
              ) -> tuple[RunState, list[Action]]:
    """The version table's records, and its update restarts carried out by the recovery
    table (stop the replica, not a failure, and launch it again)."""
    actions: list[Action] = []
    for action in versioned:
        if isinstance(action, versions.RestartReplicaForUpdate):
            restart = recovery.RestartRequested(action.replica_id, action.reason)
            run, more = recovery.decide(run, restart, policy.recovery)
            actions += more
        elif isinstance(action, Record):
            actions.append(action)
    return run, actions


def _finish(state: ControllerState, actions: list[Action], now: Now, why: str) -> Decision:
    """Every decision ends alike: a due update restart, launches stamped with their code
    version and watched, the run's end if it came."""
    if any(isinstance(a, recovery.GiveUp) for a in actions):
        return Decision(state, actions, why)
    run, versioned = versions.roll(state.run, now.wall, [])
    run, restarts = _restarts(run, versioned, state.policy)
    state, actions = replace(state, run=run), actions + restarts
    state, actions = _launched(state, actions, now)
    return _finished(state, actions, now, why)


def _launched(state: ControllerState, actions: list[Action], now: Now
              ) -> tuple[ControllerState, list[Action]]:
    stamped: list[Action] = []
    for action in actions:
        if isinstance(action, recovery.CancelReplica):
            watch = replace(state.watch[action.replica_id], live=False)
            state = state.with_watch(action.replica_id, watch)
        if isinstance(action, (StartReplica, recovery.RelaunchReplica, recovery.PromoteStandby)):
            state, records, command = _launch(state, action.replica_id, now)
            stamped += records
            action = replace(action, command=command)
        elif isinstance(action, recovery.FullRestart):
            commands = []
            for replica_id, _ in action.placements:
                state, records, command = _launch(state, replica_id, now)
                stamped += records
                commands.append(command)
            action = replace(action, commands=tuple(commands))
        stamped.append(action)
    return state, stamped


def _launch(state: ControllerState, replica_id: int, now: Now
            ) -> tuple[ControllerState, list[Record], tuple[str, ...]]:
    """Every launch runs the current code version (a pending update is applied at the
    replica's next recovery) and is watched from now on."""
    versioned: list[versions.VersionAction] = []
    run = versions.launching(state.run, replica_id, now.wall, versioned)
    (runs,) = [a for a in versioned if isinstance(a, versions.RunVersion)]
    watch = replace(state.watch[replica_id], live=True, launched_at=now.elapsed,
                    last_time=now.elapsed, awaiting_start=True)
    state = replace(state, run=run).with_watch(replica_id, watch)
    return state, _records(versioned), runs.version.command


def _finished(state: ControllerState, actions: list[Action], now: Now, why: str) -> Decision:
    """Once a replica finished, the run ends when all have, or after the finish grace."""
    replicas = state.run.replicas
    if not any(r.state is ReplicaState.FINISHED for r in replicas):
        return Decision(state, actions, why)
    if state.finished_at is None:
        state = replace(state, finished_at=now.elapsed)
    assert state.finished_at is not None
    done = all(r.retired for r in replicas)
    if done or now.elapsed - state.finished_at > state.policy.finish_grace:
        return Decision(state, [*actions, FinishRun("training finished")],
                        f"{why}; training finished")
    return Decision(state, actions, why)
