"""The one typed configuration tree and its loader.

Sources, later ones winning: dataclass defaults -> a TOML file -> ``FTL_*``
environment variables (read here and nowhere else) -> ``--set section.key=value``
overrides from the command line.

Environment variables are ``FTL_<SECTION>_<KEY>`` in upper case, e.g.
``FTL_QUORUM_JOIN_TIMEOUT=3``. Values given as strings (environment, ``--set``)
are read as TOML literals (``3``, ``true``, ``["a", "b"]``) except for string
fields, which take the text as it is.

Unknown sections or keys, wrong types and impossible values raise
``ConfigError`` naming the source, the key, the value and what was expected.
Durations are seconds, named ``*_timeout`` / ``*_interval``.
"""

from __future__ import annotations

import enum
import os
import tomllib
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .files import atomic_write_text

ENV_PREFIX = "FTL_"
MiB = 1 << 20


class LrScaling(enum.Enum):
    """How the learning rate follows the share of healthy replicas."""

    NONE = "none"
    LINEAR = "linear"
    SQRT = "sqrt"


class StandbyMode(enum.Enum):
    """Where warm standby nodes are held."""

    IN_ALLOCATION = "in_allocation"   # spare nodes of the job itself
    RESERVATION = "reservation"       # a standby job inside a site reservation


class PromotionPath(enum.Enum):
    """How a standby node held in a reservation becomes a replica (reservation mode)."""

    AUTO = "auto"                     # expansion where the site permits it, else standby_job
    EXPANSION = "expansion"           # move the node into the main job (permit_job_expansion)
    STANDBY_JOB = "standby_job"       # run the replica as a step of the standby job (warm)


@dataclass(frozen=True)
class JobConfig:
    """How the allocation is split into replicas and standby nodes."""

    replicas: int = 2
    nodes_per_replica: int = 1
    tasks_per_node: int = 1
    standby: int = 0
    standby_mode: StandbyMode = StandbyMode.IN_ALLOCATION
    reservation: str = ""
    promote_by: PromotionPath = PromotionPath.AUTO
    exclude_batch_host: bool = False

    def problems(self) -> Iterable[tuple[str, str]]:
        if self.replicas < 1:
            yield "replicas", "must be at least 1"
        if self.nodes_per_replica < 1:
            yield "nodes_per_replica", "must be at least 1"
        if self.tasks_per_node < 1:
            yield "tasks_per_node", "must be at least 1"
        if self.standby < 0:
            yield "standby", "must be 0 or more"
        if self.standby_mode is StandbyMode.RESERVATION and not self.reservation:
            yield "reservation", "must name a reservation when standby_mode = 'reservation'"


@dataclass(frozen=True)
class QuorumConfig:
    """The leader-elected membership service among replica leaders."""

    port: int = 0
    min_replicas: int = 1
    join_timeout: float = 2.0
    heartbeat_interval: float = 0.2
    election_timeout: float = 1.0
    member_timeout: float = 3.0
    max_message_age: float = 30.0    # replay window; node clock skew must stay below it
    election_slot: float = 0.02      # per-voter stretch of the election timeout spread
    peer_dir: str = ""               # shared directory of agent addresses ("": run dir)

    def problems(self) -> Iterable[tuple[str, str]]:
        if not 0 <= self.port <= 65535:
            yield "port", "must be 0 (any free port) or a TCP port number"
        if self.min_replicas < 1:
            yield "min_replicas", "must be at least 1"
        for name in ("join_timeout", "heartbeat_interval", "election_timeout",
                     "member_timeout", "max_message_age"):
            if getattr(self, name) <= 0:
                yield name, "must be a positive number of seconds"
        if self.election_timeout <= self.heartbeat_interval:
            yield "election_timeout", "must be longer than heartbeat_interval"
        if self.election_slot < 0:
            yield "election_slot", "must be 0 or more seconds"


@dataclass(frozen=True)
class FtarConfig:
    """Fault-tolerant ring all-reduce across replicas."""

    chunk_bytes: int = 16 * MiB
    chunks_in_flight: int = 2
    sockets_per_peer: int = 1
    timeout: float = 30.0
    connect_timeout: float = 10.0
    reduce_bytes: int = 2 * MiB          # receive-then-add piece inside a chunk (cache sized)
    min_chunk_bytes: int = 1 * MiB       # small segments still pipelined in chunks this big
    socket_buffer_bytes: int = 0         # SO_SNDBUF/SO_RCVBUF; 0: kernel autotuning (best here)

    def problems(self) -> Iterable[tuple[str, str]]:
        if self.reduce_bytes < 4096:
            yield "reduce_bytes", "must be at least 4096"
        if self.min_chunk_bytes < 0 or self.socket_buffer_bytes < 0:
            yield ("min_chunk_bytes" if self.min_chunk_bytes < 0 else "socket_buffer_bytes",
                   "must be 0 or more")
        if self.chunk_bytes < 4096:
            yield "chunk_bytes", "must be at least 4096"
        if self.chunks_in_flight < 1:
            yield "chunks_in_flight", "must be at least 1"
        if self.sockets_per_peer < 1:
            yield "sockets_per_peer", "must be at least 1"
        for name in ("timeout", "connect_timeout"):
            if getattr(self, name) <= 0:
                yield name, "must be a positive number of seconds"


@dataclass(frozen=True)
class CkptConfig:
    """In-memory snapshots, peer backup, state serving, persistent tier."""

    dir: str = "ftl-ckpt"
    persist_every: int = 100
    keep: int = 2
    peer_backup: bool = True
    fetch_timeout: float = 60.0
    local_dir: str = ""                  # node-local disk tier ("": off)
    backup_every: int = 1                # steps between backup pushes to the peer
    fetch_streams: int = 2               # connections per catch-up fetch
    serve_port: int = 0                  # state server port (0: any free port)
    durable: bool = True                 # fsync shards and loader state
    snapshot_nice: int = 19              # priority of the snapshot thread
    check_finite: bool = True            # restore rejects copies holding NaN/Inf

    def problems(self) -> Iterable[tuple[str, str]]:
        if not self.dir:
            yield "dir", "must name a directory"
        if self.persist_every < 1:
            yield "persist_every", "must be at least 1 step"
        if self.keep < 1:
            yield "keep", "must keep at least 1 checkpoint"
        if self.fetch_timeout <= 0:
            yield "fetch_timeout", "must be a positive number of seconds"
        if self.backup_every < 1:
            yield "backup_every", "must be at least 1 step"
        if self.fetch_streams < 1:
            yield "fetch_streams", "must be at least 1"
        if not 0 <= self.serve_port <= 65535:
            yield "serve_port", "must be 0 (any free port) or a TCP port number"
        if not -20 <= self.snapshot_nice <= 19:
            yield "snapshot_nice", "must be a nice value from -20 to 19"


@dataclass(frozen=True)
class RuntimeConfig:
    """The per-step protocol inside each worker."""

    lr_scaling: LrScaling = LrScaling.SQRT
    max_consecutive_failures: int = 5
    #: An all-reduce stops waiting for a replica the quorum reports lost (its
    #: heartbeats stopped for quorum.member_timeout); off: only ftar.timeout ends it.
    drop_lost_members: bool = True

    def problems(self) -> Iterable[tuple[str, str]]:
        if self.max_consecutive_failures < 1:
            yield "max_consecutive_failures", "must be at least 1"


@dataclass(frozen=True)
class RecoveryConfig:
    """The launcher's recovery controller."""

    lost_timeout: float = 10.0       # a running replica without a commit this long is lost
    start_timeout: float = 300.0     # a (re)started replica gets this long to commit a step
    retries_in_place: int = 1        # crashes without a known cause retried on the same nodes
    finish_grace: float = 60.0       # after one replica finished, the others get this long
    poll_interval: float = 0.2

    def problems(self) -> Iterable[tuple[str, str]]:
        for name in ("lost_timeout", "start_timeout", "finish_grace", "poll_interval"):
            if getattr(self, name) <= 0:
                yield name, "must be a positive number of seconds"
        if self.retries_in_place < 0:
            yield "retries_in_place", "must be 0 or more"


@dataclass(frozen=True)
class HealthConfig:
    """Node checks and runtime inspection."""

    gpus_per_node: int = 0
    backend: str = "auto"
    inspection: bool = True          # an inspection step per node during ft-launch run
    inspection_interval: float = 5.0
    min_free_disk_bytes: int = 1 << 30

    def problems(self) -> Iterable[tuple[str, str]]:
        if self.gpus_per_node < 0:
            yield "gpus_per_node", "must be 0 or more"
        if self.backend not in ("auto", "nvml", "simulated", "none"):
            yield "backend", "must be one of 'auto', 'nvml', 'simulated', 'none'"
        if self.inspection_interval <= 0:
            yield "inspection_interval", "must be a positive number of seconds"


@dataclass(frozen=True)
class SlurmConfig:
    """How Slurm commands are run."""

    srun_extra_args: tuple[str, ...] = ()
    command_timeout: float = 30.0

    def problems(self) -> Iterable[tuple[str, str]]:
        if self.command_timeout <= 0:
            yield "command_timeout", "must be a positive number of seconds"


@dataclass(frozen=True)
class RunConfig:
    """Where a run writes its logs, events and resolved config."""

    log_dir: str = "ftl-logs"

    def problems(self) -> Iterable[tuple[str, str]]:
        if not self.log_dir:
            yield "log_dir", "must name a directory"


@dataclass(frozen=True)
class Config:
    """The whole configuration; one section per stage of the data flow."""

    job: JobConfig = field(default_factory=JobConfig)
    quorum: QuorumConfig = field(default_factory=QuorumConfig)
    ftar: FtarConfig = field(default_factory=FtarConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    run: RunConfig = field(default_factory=RunConfig)


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in fields(Config)}  # type: ignore[misc]


# --------------------------------------------------------------------------- loading


def load_config(path: str | os.PathLike[str] | None = None, *,
                env: Mapping[str, str] | None = None,
                overrides: Iterable[str] = ()) -> Config:
    """Resolve the configuration from every source (see module docstring)."""
    config = Config()
    if path is not None:
        config = _apply(config, _read_toml(Path(path)), str(path), from_text=False)
    env_values = _env_values(os.environ if env is None else env)
    if env_values:
        config = _apply(config, env_values, "environment", from_text=True)
    for item in overrides:
        config = _apply(config, _parse_override(item), f"--set {item}", from_text=True)
    return config


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError("file not found", source=str(path),
                          hint="check the --config path") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"not valid TOML: {exc}", source=str(path)) from None


def _env_values(env: Mapping[str, str]) -> dict[str, dict[str, str]]:
    values: dict[str, dict[str, str]] = {}
    for name, text in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX):].lower()
        section, _, key = rest.partition("_")
        if section not in SECTIONS or not key:
            raise ConfigError(
                f"unknown variable {name}",
                source="environment",
                hint=f"expected {ENV_PREFIX}<SECTION>_<KEY> with SECTION one of "
                     f"{', '.join(s.upper() for s in SECTIONS)}")
        values.setdefault(section, {})[key] = text
    return values


def _parse_override(item: str) -> dict[str, dict[str, str]]:
    dotted, sep, text = item.partition("=")
    section, dot, key = dotted.strip().partition(".")
    if not sep or not dot or not key:
        raise ConfigError(f"expected section.key=value, got {item!r}", source="--set")
    return {section: {key: text.strip()}}


def _apply(config: Config, raw: Mapping[str, Any], source: str, *, from_text: bool) -> Config:
    updates: dict[str, Any] = {}
    for section_name, values in raw.items():
        section_type = SECTIONS.get(section_name)
        if section_type is None:
            raise ConfigError(f"unknown section [{section_name}]", source=source,
                              hint=f"valid sections: {', '.join(SECTIONS)}")
        if not isinstance(values, Mapping):
            raise ConfigError(f"[{section_name}] must be a table of keys", source=source)
        current = getattr(config, section_name)
        updates[section_name] = _apply_section(current, section_name, values, source,
                                               from_text)
    return replace(config, **updates)


def _apply_section(current: Any, section_name: str, values: Mapping[str, Any],
                   source: str, from_text: bool) -> Any:
    hints = typing.get_type_hints(type(current))
    valid = [f.name for f in fields(current)]
    changes: dict[str, Any] = {}
    for key, value in values.items():
        dotted = f"{section_name}.{key}"
        if key not in hints:
            raise ConfigError("unknown key", source=source, key=dotted,
                              hint=f"valid keys in [{section_name}]: {', '.join(valid)}")
        changes[key] = _coerce(value, hints[key], source, dotted, from_text)
    section = replace(current, **changes)
    for key, problem in section.problems():
        raise ConfigError(f"{problem} (got {getattr(section, key)!r})", source=source,
                          key=f"{section_name}.{key}")
    return section


def _coerce(value: Any, target: Any, source: str, key: str, from_text: bool) -> Any:
    if from_text and isinstance(value, str) and target is not str:
        value = _toml_literal(value)
    origin = typing.get_origin(target)
    expected = _describe(target)
    if origin is tuple:
        (item_type, _ellipsis) = typing.get_args(target)
        if not isinstance(value, list):
            raise ConfigError(f"expected {expected}, got {value!r}", source=source, key=key)
        return tuple(_coerce(v, item_type, source, key, False) for v in value)
    if isinstance(target, type) and issubclass(target, enum.Enum):
        try:
            return target(value)
        except ValueError:
            raise ConfigError(f"expected {expected}, got {value!r}", source=source,
                              key=key) from None
    if target is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(value) is not target:
        raise ConfigError(f"expected {expected}, got {value!r}", source=source, key=key)
    return value


def _toml_literal(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # left as a string; the type check reports it if wrong


def _describe(target: Any) -> str:
    if typing.get_origin(target) is tuple:
        return f"a list of {_describe(typing.get_args(target)[0])}"
    if isinstance(target, type) and issubclass(target, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in target)
    return {int: "an integer", float: "a number", bool: "true or false",
            str: "a string"}.get(target, str(target))


# --------------------------------------------------------------------------- saving


def to_toml(config: Config) -> str:
    """Render the resolved config as TOML that ``load_config`` reads back."""
    lines: list[str] = []
    for section_field in fields(config):
        section = getattr(config, section_field.name)
        lines.append(f"[{section_field.name}]")
        for item in fields(section):
            lines.append(f"{item.name} = {_toml_value(getattr(section, item.name))}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        return f'"{escaped}"'
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot render {value!r} as TOML")


def save_config(config: Config, directory: str | os.PathLike[str]) -> Path:
    """Write the resolved config atomically as ``DIR/config.toml``."""
    return atomic_write_text(Path(directory) / "config.toml", to_toml(config))

