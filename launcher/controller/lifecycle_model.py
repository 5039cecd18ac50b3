"""The controller's values (``lifecycle`` decides on them): its state, the events
it observes and the actions it orders, with ``Decision`` tying them together.
Frozen values only; ``lifecycle`` re-exports them, so ``lifecycle.StepExited``
and the rest are where a reader of ``decide`` looks for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ft_launch.config import Config, SlowPolicy, StandbyMode
from ft_launch.events import Event as Record

from .recovery import RecoveryAction, RecoveryPolicy, StandbyAdded
from .replay_rule import ReplayBook, ReplayLocated, RunReplay
from .rollback import LossSpikeFound, SpikeRules
from .run_state import RunState
from .versions import UpdateRequested, VersionPolicy


@dataclass(frozen=True)
class Now:
    elapsed: float      # monotonic seconds
    wall: float         # seconds since the epoch


@dataclass(frozen=True)
class Policy:
    recovery: RecoveryPolicy = field(default_factory=RecoveryPolicy)
    versions: VersionPolicy = field(default_factory=VersionPolicy)
    lost_timeout: float = 10.0      # a running replica without a commit this long is lost
    start_timeout: float = 300.0    # a relaunched replica gets this long to commit
    finish_grace: float = 60.0      # after one replica finished, the others get this long
    nonfinite_limit: int = 3        # NaN/Inf steps computed on one node before it is evicted
    hang_diagnosis: bool = True     # a stalled replica's stacks are taken before eviction
    diagnosis_timeout: float = 30.0  # the shell's bound on taking them
    slow_policy: SlowPolicy = SlowPolicy.EVICT   # a fail-slow replica's nodes are evicted
    member_timeout: float = 3.0     # quorum.member_timeout: a lost member was silent this long
    spikes: SpikeRules = field(default_factory=SpikeRules)   # a loss spike: rollback
    sdc_replay: bool = True         # a multi-node replica's NaN/Inf node found by replay
    replay_timeout: float = 300.0   # the shell's bound on a replay
    #: standbys can host replay steps (in the allocation, not in a reservation's jobs)
    replay_on_standby: bool = True

    @classmethod
    def from_config(cls, whole: Config) -> Policy:
        config = whole.recovery
        return cls(recovery=RecoveryPolicy(retries_in_place=config.retries_in_place),
                   lost_timeout=config.lost_timeout, start_timeout=config.start_timeout,
                   finish_grace=config.finish_grace, nonfinite_limit=config.nonfinite_limit,
                   hang_diagnosis=config.hang_diagnosis,
                   diagnosis_timeout=config.diagnosis_timeout,
                   slow_policy=config.slow_policy,
                   member_timeout=whole.quorum.member_timeout,
                   spikes=SpikeRules.from_config(whole),
                   sdc_replay=config.sdc_replay, replay_timeout=config.replay_timeout,
                   replay_on_standby=whole.job.standby_mode is StandbyMode.IN_ALLOCATION)


@dataclass(frozen=True)
class Watch:
    """What the controller last heard of a replica's step (``Now.elapsed`` times)."""

    live: bool = False                      # a step of it runs and is watched
    launched_at: float = 0.0
    last_time: float = 0.0                  # last commit or (re)launch
    last_commit: float | None = None
    previous_commit: float | None = None    # the commit before, when it was recent too
    #: (re)launched: commits count again only after the new process says it started
    #: (lines the cancelled one wrote may still be unread)
    awaiting_start: bool = False
    moving_since: float | None = None       # first commit of the current unbroken run


@dataclass(frozen=True)
class HangWatch:
    """A stalled replica whose ranks' stacks are being taken (``DiagnoseHang``)."""

    replica_id: int
    since: float            # when it was ordered (``Now.elapsed``)
    launched_at: float      # of the process diagnosed: after a relaunch the answer is stale
    why: str                # the stall, as ``_stalls`` put it


@dataclass(frozen=True)
class ControllerState:
    run: RunState
    watch: tuple[Watch, ...]                # by replica id
    policy: Policy = field(default_factory=Policy)
    finished_at: float | None = None        # when the first replica finished
    #: per node, the steps whose gradients computed there held NaN/Inf
    nonfinite_steps: tuple[tuple[str, int], ...] = ()
    #: (lost, reporter): the reporter's quorum lost that replica; it is lost for good
    #: once the reporter commits without it (it trained on) before it commits again
    suspects: tuple[tuple[int, int], ...] = ()
    #: stalled replicas being diagnosed (their stacks taken) before they are evicted
    diagnosing: tuple[HangWatch, ...] = ()
    #: the spiking step of every rollback so far (``rollback``): every launch carries them
    rolled_back: tuple[int, ...] = ()
    #: multi-node replicas' NaN/Inf steps, and their replays (``replay_rule``)
    replays: ReplayBook = field(default_factory=ReplayBook)

    @classmethod
    def initial(cls, run: RunState, policy: Policy | None = None) -> ControllerState:
        return cls(run, tuple(Watch() for _ in run.replicas), policy or Policy())

    def with_watch(self, replica_id: int, watch: Watch) -> ControllerState:
        watches = list(self.watch)
        watches[replica_id] = watch
        return replace(self, watch=tuple(watches))


# --------------------------------------------------------------------------- events


@dataclass(frozen=True)
class RunStarted:
    """Launch every replica where the plan put it."""


@dataclass(frozen=True)
class ProcessStarted:
    """A replica's (new) process said it started (``WorkerStarted`` in its event file)."""

    replica_id: int


@dataclass(frozen=True)
class StepsCommitted:
    """``count`` commits read at once from a replica's event file."""

    replica_id: int
    count: int = 1


@dataclass(frozen=True)
class StepExited:
    """A replica's srun exited. ``failing_nodes``: its nodes Slurm reports unusable (node,
    why); ``gate_reason``: what the health gate wrote down, if it did."""

    replica_id: int
    exit_code: int
    failing_nodes: tuple[tuple[str, str], ...] = ()
    gate_reason: str | None = None


@dataclass(frozen=True)
class StandbyAgentExited:
    node: str
    exit_code: int


@dataclass(frozen=True)
class PromotionFailed:
    """Slurm did not hand the promoted standby ``node`` to the replica (its move into
    the job failed): the node is lost to the run, and the replica needs the next one."""

    replica_id: int
    node: str
    reason: str


@dataclass(frozen=True)
class NodesReported:
    """Slurm's answer for ``nodes_to_check``: the unusable ones, with why."""

    unhealthy: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class InspectionAlarmed:
    node: str
    reason: str


@dataclass(frozen=True)
class GradientsNonFinite:
    """A replica discarded a step because the gradients its ranks on ``nodes`` computed
    held NaN/Inf before the reduction."""

    replica_id: int
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class QuorumLostMembers:
    """Replica ``reporter``'s quorum stopped hearing from ``lost`` (no heartbeat within
    ``quorum.member_timeout``): sooner than ``recovery.lost_timeout`` would tell."""

    reporter: int
    lost: tuple[int, ...]


@dataclass(frozen=True)
class HangDiagnosed:
    """The stacks of a stalled replica's ranks were taken (``diagnosis``): ``suspects``,
    the nodes they name; none when the diagnosis failed (``error``)."""

    replica_id: int
    suspects: tuple[str, ...]
    summary: str = ""           # "rank 1 on n3, pid 812 in injected_deadlock (faults.py:121)"
    report: str = ""            # the report's path
    error: str = ""


@dataclass(frozen=True)
class ReplicaSlowed:
    """Replica ``replica_id``'s own step time (its step minus what it waited for the
    others) stayed ``own_s`` against its peers' ``peers_s``, medians over ``steps``
    committed steps (``ft_launch.health.anomaly.PeerSlowdownDetector``): fail-slow."""

    replica_id: int
    own_s: float
    peers_s: float
    steps: int


@dataclass(frozen=True)
class Tick:
    """Time passed: stalls, forced update windows, the finish grace."""


Event = (RunStarted | ProcessStarted | StepsCommitted | StepExited | StandbyAgentExited
         | PromotionFailed | NodesReported | InspectionAlarmed | GradientsNonFinite | QuorumLostMembers
         | HangDiagnosed | ReplicaSlowed | LossSpikeFound | ReplayLocated | UpdateRequested
         | StandbyAdded | Tick)


# --------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class StartReplica:
    """The first launch of a replica, on the plan's nodes."""

    replica_id: int
    nodes: tuple[str, ...]
    reason: str = field(default="", compare=False)
    command: tuple[str, ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class FinishRun:
    reason: str


@dataclass(frozen=True)
class DiagnoseHang:
    """Take the stacks of every rank of a stalled replica (py-spy, ``srun --overlap`` on
    ``nodes``), cancelling nothing; the answer comes back as ``HangDiagnosed``."""

    replica_id: int
    nodes: tuple[str, ...]
    reason: str = field(default="", compare=False)
    stall: str = field(default="", compare=False)   # what was seen: for the report


#: What the shell carries out; each says why.
Order = RecoveryAction | StartReplica | FinishRun | DiagnoseHang | RunReplay
#: Records (``ft_launch.events.Event``) are in the list too: the shell writes them to its log.
Action = Order | Record


@dataclass(frozen=True)
class Decision:
    state: ControllerState
    actions: list[Action]
    reason: str
