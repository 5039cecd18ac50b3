"""Each step's quorum, for every rank of a replica: rank 0 runs the replica's quorum
agent and asks it; every rank gets the answer (or why there is none) from rank 0,
and turns it into the step's plan (``protocol.plan_step``). Also where the replica's
endpoints, what it advertises to the quorum, are gathered.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ft_launch.config import Config
from ft_launch.errors import ExitCode, FatalError, RecoverableError
from ft_launch.events import EventLog
from ft_launch.ftar import FtarGroup
from ft_launch.launcher.quorum import FileDirectory, QuorumAgent
from ft_launch.launcher.quorum.events import Event as QuorumEvent
from ft_launch.launcher.quorum.witness_service import MemoryFile, replica_memory_path, run_witnesses

from .controller_loss import ControllerLoss, ControllerLostNotice
from .exits import FinishedRun, NoQuorum, ending, nothing_to_join, run_finished
from .identity import WorkerIdentity
from .protocol import (
    FailureBudget,
    OtherHistoryError,
    QuorumView,
    ReplicaEndpoints,
    StepPlan,
    plan_step,
)
from .replica_group import ReplicaGroup

log = logging.getLogger(__name__)


def gather_endpoints(group: ReplicaGroup, ftar: FtarGroup, state_server: tuple[str, int],
                     history: int) -> ReplicaEndpoints:
    """Every rank's FTAR and state server address, as the replica advertises them
    (collective)."""
    gathered = group.all_gather((ftar.address, state_server))
    return ReplicaEndpoints(tuple(tuple(g[0]) for g in gathered),   # type: ignore[misc]
                            tuple(tuple(g[1]) for g in gathered),   # type: ignore[misc]
                            history)


class StepQuorum:
    """The quorum of each step (module doc). ``on_new_quorum`` is called with the view
    of a quorum whose ring is built anew, before its plan is returned."""

    def __init__(self, config: Config, identity: WorkerIdentity, group: ReplicaGroup,
                 events: EventLog, budget: FailureBudget, controller: ControllerLoss,
                 on_new_quorum: Callable[[QuorumView], None]) -> None:
        self._config = config
        self._identity = identity
        self._group = group
        self._budget = budget
        self._controller = controller
        self._on_new_quorum = on_new_quorum
        self._agent: QuorumAgent | None = None
        if identity.rank == 0:
            run_dir = identity.run_dir
            directory = FileDirectory(run_dir / "peers", identity.secret, identity.job_id)
            # Witness 0 counts only if the controller (it writes the heartbeat) says it votes.
            witnesses = run_witnesses(run_dir, config.quorum,
                                      controlled=identity.heartbeat is not None)
            # its term and vote outlive the process: a relaunch votes as it did
            memory = MemoryFile(replica_memory_path(run_dir, identity.replica_id),
                                identity.job_id)
            self._agent = QuorumAgent(identity.replica_id, range(identity.num_replicas),
                                      directory, identity.secret, config.quorum,
                                      job_id=identity.job_id, host=identity.host,
                                      event_log=events, witnesses=witnesses,
                                      memory=memory).start()

    def subscribe(self, callback: Callable[[QuorumEvent], None]) -> None:
        """Hear the agent's events (rank 0 only has an agent: elsewhere nothing)."""
        if self._agent is not None:
            self._agent.subscribe(callback)

    def report_commit_failure(self) -> None:
        if self._agent is not None:
            self._agent.report_commit_failure()

    def stop(self) -> None:
        if self._agent is not None:
            self._agent.stop()

    def join(self, next_step: int, quorum_id: int | None, endpoints: ReplicaEndpoints
             ) -> tuple[StepPlan, ControllerLostNotice | None]:
        """The plan of step ``next_step`` (``quorum_id``: the quorum this rank's ring
        is built for), and rank 0's finding that the controller is lost, if it found
        it (every member then stops at this step, ``controller_loss``). A quorum that
        cannot form yet (election, stragglers, majority briefly lost) is asked again,
        each failure counted against ``runtime.max_consecutive_failures``. Attempts
        are paced one join window apart: a replica that cannot reach a majority is
        answered at once, and unpaced retries would spend the whole budget in
        milliseconds instead of waiting for the others to come back. Once the budget
        is spent the replica ends (``NoQuorum``); once the run has finished, at once
        (``NothingToJoin``)."""
        waiting = time.monotonic()
        attempts = 0
        while True:
            attempt_started = time.monotonic()
            attempts += 1
            try:
                view, stopping = self._view(next_step, endpoints)
                plan = plan_step(view, self._identity.replica_id, self._identity.rank,
                                 quorum_id, next_step)
                if plan.reconfigure:
                    self._on_new_quorum(view)
                return plan, stopping
            except RecoverableError as error:
                log.warning("no quorum for step %d yet: %s", next_step, error)
                if not isinstance(error, OtherHistoryError):   # a rollback: nobody's fault
                    try:
                        self._budget.failed(error, next_step)
                    except FatalError:
                        raise self._no_quorum(error, next_step, attempts,
                                              time.monotonic() - waiting) from error
                time.sleep(max(0.0, attempt_started + self._config.quorum.join_timeout
                               - time.monotonic()))

    def _no_quorum(self, error: RecoverableError, next_step: int, attempts: int,
                   waited: float) -> NoQuorum:
        """The exit of a replica whose failure budget ran out waiting for a quorum."""
        me, budget = self._identity, self._budget.limit
        message = (f"replica {me.replica_id} rank {me.rank} could not join: no quorum for "
                   f"step {next_step} in {waited:.1f} s ({attempts} attempt(s); the "
                   f"last: {error}); the other replicas are gone or unreachable. "
                   f"runtime.max_consecutive_failures = {budget} bounds this wait (each "
                   "attempt waits up to quorum.join_timeout + quorum.member_timeout + 4 x "
                   f"quorum.election_timeout); exit {int(ExitCode.RECOVERABLE)}")
        log.error("%s", message)
        return ending(NoQuorum(message))

    def _view(self, next_step: int, endpoints: ReplicaEndpoints
              ) -> tuple[QuorumView, ControllerLostNotice | None]:
        """Rank 0 asks the quorum; every rank of the replica gets its answer (or error)."""
        answer: QuorumView | ControllerLostNotice | FinishedRun | str | None = None
        notice = self._controller.notice()
        if self._agent is not None:
            try:
                answer = self._ask(next_step, endpoints)
            except RecoverableError as error:
                # no quorum now: if because the run finished, none will ever come
                answer = run_finished(self._identity) or str(error)
        if notice is not None and not isinstance(answer, QuorumView):
            answer = notice   # no step to stop at with the others: stop now
        answer, stopping = self._group.broadcast((answer, notice))
        if isinstance(answer, FinishedRun):
            raise nothing_to_join(answer, self._identity)
        if isinstance(answer, ControllerLostNotice):
            self._controller.end(answer.reason, next_step)
        if isinstance(answer, str):
            raise RecoverableError(answer, replica_id=self._identity.replica_id,
                                   rank=self._identity.rank)
        assert answer is not None
        return answer, stopping

    def _ask(self, next_step: int, endpoints: ReplicaEndpoints) -> QuorumView:
        assert self._agent is not None
        quorum = self._agent.get_quorum(next_step, address=endpoints.encode())
        return QuorumView(quorum_id=quorum.quorum_id, max_step=quorum.max_step,
                          members=tuple(sorted((m.replica_id, m.address)
                                               for m in quorum.members)),
                          behind=tuple(quorum.behind))
