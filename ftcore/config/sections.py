"""The sections of the job's run: one per stage of the data flow, and the whole tree.

The node health sections (``[health]``, ``[checks.NAME]``, ``[profiles.NAME]``)
are in ``ft_launch.config.health``."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field, fields

from ..slurm.hostlist import MAX_HOSTS
from .fields import GiB, MiB, _count, _factor, _seconds, _Section
from .health import HealthConfig, Tables


class LrScaling(enum.Enum):
    """How the learning rate follows the share of healthy replicas."""

    NONE = "none"
    LINEAR = "linear"
    SQRT = "sqrt"


class IdenticalStart(enum.Enum):
    """What the run's first step does when the replicas' models differ (seeded apart)."""

    COPY = "copy"                     # every replica takes the lowest replica's, as DDP does
    REFUSE = "refuse"                 # every replica exits, naming the replicas that differ


class StandbyMode(enum.Enum):
    """Where warm standby nodes are held."""

    IN_ALLOCATION = "in_allocation"   # spare nodes of the job itself
    RESERVATION = "reservation"       # a standby job inside a site reservation


class BatchHostRole(enum.Enum):
    """What the node running the batch script (and with it the controller and every
    srun client) does. Losing it loses them all, so by default it trains nothing."""

    STANDBY = "standby"               # a standby node, promoted only when no other is left
    EXCLUDED = "excluded"             # neither replica nor standby
    REPLICA = "replica"               # trains like any node (losing it ends the run)


class SlowPolicy(enum.Enum):
    """What the controller does with a fail-slow replica."""

    EVICT = "evict"                   # drain its nodes (ft: fail-slow ...), promote a standby
    REPORT = "report"                 # record it (event log, status) and train on
    OFF = "off"                       # do not watch step times


class SpikePolicy(enum.Enum):
    """What the controller does when the job's loss spikes."""

    ROLLBACK = "rollback"             # every replica restarts from its newest state before it
    REPORT = "report"                 # record it (event log, status) and train on
    OFF = "off"                       # do not watch the loss


class PromotionPath(enum.Enum):
    """How a standby node held in a reservation becomes a replica (reservation mode)."""

    AUTO = "auto"                     # expansion where the site permits it, else standby_job
    EXPANSION = "expansion"           # move the node into the main job (permit_job_expansion)
    STANDBY_JOB = "standby_job"       # run the replica as a step of the standby job (warm)


@dataclass(frozen=True)
class JobConfig(_Section):
    """How the allocation is split into replicas and standby nodes."""

    replicas: int = _count(2, 1, MAX_HOSTS)
    nodes_per_replica: int = _count(1, 1, MAX_HOSTS)
    tasks_per_node: int = _count(1, 1, 1024)
    standby: int = _count(0, 0, MAX_HOSTS)
    standby_mode: StandbyMode = StandbyMode.IN_ALLOCATION
    reservation: str = ""
    promote_by: PromotionPath = PromotionPath.AUTO
    batch_host: BatchHostRole = BatchHostRole.STANDBY

    def rules(self) -> Iterable[tuple[str, str]]:
        if self.replicas * self.nodes_per_replica + self.standby > MAX_HOSTS:
            yield "replicas", (f"replicas x nodes_per_replica + standby must be at most "
                               f"{MAX_HOSTS} nodes (the hostlist limit)")
        if self.standby_mode is StandbyMode.RESERVATION and not self.reservation:
            yield "reservation", "must name a reservation when standby_mode = 'reservation'"


@dataclass(frozen=True)
class QuorumConfig(_Section):
    """The leader-elected membership service among replica leaders."""

    port: int = _count(0, 0, 65535)                  # 0: any free port
    min_replicas: int = _count(1, 1, MAX_HOSTS)
    join_timeout: float = _seconds(2.0)
    heartbeat_interval: float = _seconds(0.2)
    election_timeout: float = _seconds(1.0)
    member_timeout: float = _seconds(3.0)
    max_message_age: float = _seconds(30.0)  # replay window; node clock skew must stay below it
    election_slot: float = _seconds(0.02, zero_ok=True)  # per-voter stretch of the spread
    peer_dir: str = ""               # shared directory of agent addresses ("": run dir)
    #: The controller (ft-launch run) votes as witness 0: with it, one live replica
    #: trains on; without any witness, a majority of the replicas must be live. It
    #: listens at the source address of its route to the nodes (not its hostname's,
    #: which on a login node may be loopback); with none that reaches every node it
    #: does not vote and says so (controller.log, controller.jsonl, ft-launch status),
    #: since the witnesses hold replicas - 1 votes and an unreachable one would cost
    #: two of three replicas their majority.
    controller_witness: bool = True
    #: More witnesses, each an ``ft-launch witness --index K`` (K = 1..witnesses) on a
    #: login or service node; the witnesses share replicas - 1 votes between them.
    witnesses: int = _count(0, 0, 64)
    #: While nothing changes, the members of the last quorum go on with it from step
    #: to step without a round: the leader's heartbeats grant it a few steps ahead
    #: (``ft_launch.launcher.quorum.core``). Off: every step runs a round (joins, answers).
    standing: bool = True

    def rules(self) -> Iterable[tuple[str, str]]:
        if self.election_timeout <= self.heartbeat_interval:
            yield "election_timeout", "must be longer than heartbeat_interval"


@dataclass(frozen=True)
class FtarConfig(_Section):
    """Fault-tolerant ring all-reduce across replicas.

    The handshake carries ``sockets_per_peer`` in 16 bits and ``chunks_in_flight``
    in 32 (``ftar/transport.py``); the limits here are far inside both and keep
    the preallocated buffers (``chunks_in_flight`` x ``chunk_bytes`` a link) sane."""

    chunk_bytes: int = _count(16 * MiB, 4096, 1 * GiB)
    chunks_in_flight: int = _count(2, 1, 1024)
    sockets_per_peer: int = _count(1, 1, 64)     # one sender thread each
    timeout: float = _seconds(30.0)
    connect_timeout: float = _seconds(10.0)
    #: receive-then-add piece inside a chunk (cache sized)
    reduce_bytes: int = _count(2 * MiB, 4096, 1 * GiB)
    #: small segments still pipelined in chunks this big
    min_chunk_bytes: int = _count(1 * MiB, 0, 1 * GiB)
    #: SO_SNDBUF/SO_RCVBUF (a C int); 0: kernel autotuning (best here)
    socket_buffer_bytes: int = _count(0, 0, 1 * GiB)


@dataclass(frozen=True)
class CkptConfig(_Section):
    """In-memory snapshots, peer backup, state serving, persistent tier."""

    dir: str = "ftl-ckpt"
    persist_every: int = _count(100, 1, 10**9)     # steps between persistent checkpoints
    keep: int = _count(2, 1, 1000)                 # persistent checkpoints kept
    peer_backup: bool = True
    fetch_timeout: float = _seconds(60.0)
    local_dir: str = ""                  # node-local disk tier ("": off)
    #: Steps between pushes of a rank's snapshot to its backup peer. A push costs CPU
    #: time (SHA-256 at both ends, CRC-32, the socket), taken from training where it keeps
    #: every core busy: on a CPU trainer a push every 50 steps added a little to what the
    #: snapshots cost, every 10 or every step far more (measurements:
    #: benchmarks/results/measurements.md#backup-every). 50 is half of persist_every: a
    #: job that loses every replica loses at most ~50 steps, not 100. Where host cores
    #: idle (GPU training) a push is near free: set it lower.
    backup_every: int = _count(50, 1, 10**9)
    #: Node-local directory where a rank keeps the backups it holds for others, as
    #: files (tmpfs: memory that outlives the process, so the next incarnation of a
    #: job that lost every replica finds them; ckpt/held.py). "": process memory only.
    backup_dir: str = "/dev/shm"
    fetch_streams: int = _count(2, 1, 64)          # connections per catch-up fetch
    serve_port: int = _count(0, 0, 65535)          # state server port (0: any free port)
    durable: bool = True                 # fsync shards and loader state
    snapshot_nice: int = _count(19, -20, 19)       # priority of the snapshot thread
    check_finite: bool = True            # restore rejects copies holding NaN/Inf

    def rules(self) -> Iterable[tuple[str, str]]:
        if not self.dir:
            yield "dir", "must name a directory"
        if self.backup_dir and not self.backup_dir.startswith("/"):
            yield "backup_dir", ("must be an absolute node-local path (a relative one would "
                                 "follow the working directory, often a shared file system), "
                                 "or empty")


@dataclass(frozen=True)
class RuntimeConfig(_Section):
    """The per-step protocol inside each worker."""

    lr_scaling: LrScaling = LrScaling.SQRT
    max_consecutive_failures: int = _count(5, 1, 10**6)
    #: An all-reduce stops waiting for a replica the quorum reports lost (its
    #: heartbeats stopped for quorum.member_timeout); off: only ftar.timeout ends it.
    drop_lost_members: bool = True
    #: A worker that hears no controller heartbeat this long (its node is gone) saves
    #: the newest state to the persistent tier and requeues the job (or ends it).
    controller_timeout: float = _seconds(20.0)
    #: Reduce gradients across replicas during backward (FSDP2's all-reduce hook, DDP's
    #: comm hook); off: all of them after backward.
    overlap_backward: bool = True
    #: The replicas' models before the first step (parameters and buffers, compared by
    #: digest): "copy" makes every replica train the lowest one's, as DDP broadcasts
    #: rank 0's at construction; "refuse" ends the run naming the replicas that differ.
    identical_start: IdenticalStart = IdenticalStart.COPY


@dataclass(frozen=True)
class RecoveryConfig(_Section):
    """The launcher's recovery controller."""

    lost_timeout: float = _seconds(10.0)    # a running replica without a commit this long is lost
    start_timeout: float = _seconds(300.0)  # a (re)started replica gets this long to commit
    retries_in_place: int = _count(1, 0, 1000)  # unexplained crashes retried on the same nodes
    finish_grace: float = _seconds(60.0)    # after one replica finished, the others get this long
    poll_interval: float = _seconds(0.2)
    #: steps in which gradients computed on one node held NaN/Inf (every replica discarded
    #: them) before that node is evicted as silently corrupting (0: never)
    nonfinite_limit: int = _count(3, 0, 1_000_000)
    #: a replica found stalled is not cancelled at once: py-spy takes the stacks of its
    #: ranks first (srun --overlap on its nodes) and names the nodes to evict; off: its
    #: first node is evicted at once
    hang_diagnosis: bool = True
    #: how long taking those stacks may last; past it, every node of the replica goes
    diagnosis_timeout: float = _seconds(30.0)
    #: a replica of several nodes whose gradients keep holding NaN/Inf names all its
    #: nodes (they mix their gradients): it is cancelled and the step replayed on them
    #: and healthy nodes in two phases (rows, columns), which names the one that
    #: computes them; off: every node it names is evicted (nonfinite_limit)
    sdc_replay: bool = True
    #: how long capturing a healthy state and both phases may last; past it, every
    #: node of the replica goes
    replay_timeout: float = _seconds(300.0)
    #: fail-slow: replicas train in lockstep, so a slow one slows every step; each
    #: replica's own time (its step minus what it waited for the others) is compared.
    #: One whose median over slow_window committed steps stays above slow_factor x the
    #: median of its peers' is slow (replicas sharing a node's CPUs differ by far less).
    slow_policy: SlowPolicy = SlowPolicy.EVICT
    slow_factor: float = _factor(2.0, 1.0, 1000.0)
    slow_window: int = _count(30, 3, 100_000)
    #: loss spike: per step the mean loss over the replicas that trained it, against the
    #: median of the spike_window steps before (none judged before spike_window steps).
    #: A mean above spike_factor x that median (x5: design.md's threshold) spiked. The
    #: default rolls every replica back to its newest state from before the spiking
    #: step (ft_launch.launcher.controller.rollback): the all-reduce put the spike into
    #: every replica's weights, and a human would find it too late; a false alarm costs the steps
    #: since that state, at most max_rollbacks times a run (then reported only), and a
    #: spike that comes back within spike_window steps of one rolled back is reported.
    spike_policy: SpikePolicy = SpikePolicy.ROLLBACK
    spike_factor: float = _factor(5.0, 1.0, 1000.0)
    spike_window: int = _count(20, 3, 100_000)
    max_rollbacks: int = _count(3, 0, 1000)


@dataclass(frozen=True)
class SlurmConfig(_Section):
    """How Slurm commands are run."""

    srun_extra_args: tuple[str, ...] = ()
    command_timeout: float = _seconds(30.0)


@dataclass(frozen=True)
class RunConfig(_Section):
    """Where a run writes its logs, events and resolved config."""

    log_dir: str = "ftl-logs"

    def rules(self) -> Iterable[tuple[str, str]]:
        if not self.log_dir:
            yield "log_dir", "must name a directory"


@dataclass(frozen=True)
class Config:
    """The whole configuration; one section per stage of the data flow, and the
    node health sections the Slurm hooks read too (``ft_launch.config.health``)."""

    job: JobConfig = field(default_factory=JobConfig)
    quorum: QuorumConfig = field(default_factory=QuorumConfig)
    ftar: FtarConfig = field(default_factory=FtarConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    run: RunConfig = field(default_factory=RunConfig)
    #: ``[checks.NAME]``: parameters of one health check (``ft_launch.health.catalog``).
    checks: Tables = field(default_factory=Tables)
    #: ``[profiles.NAME]``: checks = [...], budget = seconds, warn_only = [...].
    profiles: Tables = field(default_factory=Tables)


#: The sections of ``key = value`` fields, by name.
SECTIONS: dict[str, type] = {f.name: f.default_factory for f in fields(Config)  # type: ignore[misc]
                             if f.default_factory is not Tables}
#: The sections of named tables (``[checks.disk]``), whose keys the loader cannot
#: know: it checks that each holds plain config values; ``ft_launch.health.settings`` checks
#: the names and keys against the check catalog, naming the file each came from.
TABLE_SECTIONS: tuple[str, ...] = tuple(f.name for f in fields(Config)
                                        if f.default_factory is Tables)
