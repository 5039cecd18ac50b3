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

Every number field declares its range beside its default (``_count``,
``_seconds``). One check, ``_Section.problems``, applies the ranges, refuses NaN
and infinities in every float field and control characters in every string, so
a config that loads also saves as valid TOML and loads back equal.
"""

from __future__ import annotations

import enum
import math
import os
import tomllib
import typing
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .files import atomic_write_text
from .slurm.hostlist import MAX_HOSTS

ENV_PREFIX = "FTL_"
MiB = 1 << 20
GiB = 1 << 30
#: The longest duration any setting takes: a week (keeps timevals and waits in range too).
MAX_SECONDS = 7 * 86400.0
#: Strings are paths, names and srun arguments: PATH_MAX is plenty.
MAX_STRING_CHARS = 4096
#: A config file is a few KiB; reading stops here (``--config /dev/zero``).
MAX_FILE_BYTES = 1 * MiB
_BOUNDS = "ftl_bounds"


@dataclass(frozen=True)
class Bounds:
    """The range a number field accepts; ``open_low``: the low end itself is excluded."""

    low: float
    high: float
    open_low: bool = False
    seconds: bool = False

    def contains(self, value: float) -> bool:
        above = value > self.low if self.open_low else value >= self.low
        finite = not isinstance(value, float) or math.isfinite(value)  # isfinite(10**400) raises
        return finite and above and value <= self.high

    def describe(self) -> str:
        if self.seconds and self.open_low:
            return f"must be a positive, finite number of seconds, at most {self.high:g}"
        if self.seconds:
            return f"must be a finite number of seconds from {self.low:g} to {self.high:g}"
        return f"must be at least {self.low:g} and at most {self.high:g}"


def _count(default: int, low: int, high: int) -> Any:
    """An integer field accepting ``low..high``."""
    return field(default=default, metadata={_BOUNDS: Bounds(low, high)})


def _seconds(default: float, *, zero_ok: bool = False, high: float = MAX_SECONDS) -> Any:
    """A duration field: finite, positive (or 0 with ``zero_ok``), at most ``high``."""
    return field(default=default,
                 metadata={_BOUNDS: Bounds(0.0, high, open_low=not zero_ok, seconds=True)})


def field_bounds(section: Any, name: str) -> Bounds | None:
    """The declared range of a number field (``None`` for other fields)."""
    return next((f.metadata.get(_BOUNDS) for f in fields(section) if f.name == name), None)


def string_problem(text: str) -> str | None:
    """Why ``text`` cannot be a config string (too long, control characters), or None.

    TOML strings cannot hold raw control characters, and lone surrogates (from
    undecodable environment or argv bytes) cannot be written as UTF-8 at all."""
    if len(text) > MAX_STRING_CHARS:
        return f"must be at most {MAX_STRING_CHARS} characters"
    for char in text:
        category = unicodedata.category(char)
        if category == "Cc":
            return f"must not contain control characters (found U+{ord(char):04X})"
        if category == "Cs":
            return f"must be valid text (found U+{ord(char):04X}, from an undecodable byte)"
    return None


class _Section:
    """What every section checks: declared ranges, finite floats, clean strings.

    A section adds its cross-field checks in ``rules``; callers use ``problems``."""

    def problems(self) -> Iterable[tuple[str, str]]:
        hints = typing.get_type_hints(type(self))
        for item in fields(self):  # type: ignore[arg-type]
            problem = _field_problem(getattr(self, item.name), hints[item.name],
                                     item.metadata.get(_BOUNDS))
            if problem:
                yield item.name, problem
        yield from self.rules()

    def rules(self) -> Iterable[tuple[str, str]]:
        return ()


def _field_problem(value: Any, hint: Any, bounds: Bounds | None) -> str | None:
    if hint in (int, float):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or (
                hint is int and isinstance(value, float)):
            return f"must be {_describe(hint)}"
        if isinstance(value, float) and not math.isfinite(value):
            return "must be a finite number (not NaN or infinity)"
        return None if bounds is None or bounds.contains(value) else bounds.describe()
    if hint is str:
        return string_problem(value) if isinstance(value, str) else "must be a string"
    if typing.get_origin(hint) is tuple:
        if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
            return "must be a list of strings"
        return next((f"item {i} {p}" for i, v in enumerate(value)
                     if (p := string_problem(v))), None)
    return None


class LrScaling(enum.Enum):
    """How the learning rate follows the share of healthy replicas."""

    NONE = "none"
    LINEAR = "linear"
    SQRT = "sqrt"


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
    backup_every: int = _count(1, 1, 10**9)        # steps between backup pushes to the peer
    fetch_streams: int = _count(2, 1, 64)          # connections per catch-up fetch
    serve_port: int = _count(0, 0, 65535)          # state server port (0: any free port)
    durable: bool = True                 # fsync shards and loader state
    snapshot_nice: int = _count(19, -20, 19)       # priority of the snapshot thread
    check_finite: bool = True            # restore rejects copies holding NaN/Inf

    def rules(self) -> Iterable[tuple[str, str]]:
        if not self.dir:
            yield "dir", "must name a directory"


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


@dataclass(frozen=True)
class RecoveryConfig(_Section):
    """The launcher's recovery controller."""

    lost_timeout: float = _seconds(10.0)    # a running replica without a commit this long is lost
    start_timeout: float = _seconds(300.0)  # a (re)started replica gets this long to commit
    retries_in_place: int = _count(1, 0, 1000)  # unexplained crashes retried on the same nodes
    finish_grace: float = _seconds(60.0)    # after one replica finished, the others get this long
    poll_interval: float = _seconds(0.2)


@dataclass(frozen=True)
class HealthConfig(_Section):
    """Node checks and runtime inspection."""

    gpus_per_node: int = _count(0, 0, 128)
    backend: str = "auto"
    inspection: bool = True          # an inspection step per node during ft-launch run
    inspection_interval: float = _seconds(5.0)
    min_free_disk_bytes: int = _count(1 << 30, 0, 1 << 62)

    def rules(self) -> Iterable[tuple[str, str]]:
        if self.backend not in ("auto", "nvml", "simulated", "none"):
            yield "backend", "must be one of 'auto', 'nvml', 'simulated', 'none'"


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
        config = _apply(config, _read_toml(Path(path)), _name(str(path)), from_text=False)
    env_values = _env_values(os.environ if env is None else env)
    if env_values:
        config = _apply(config, env_values, "environment", from_text=True)
    for item in overrides:
        config = _apply(config, _parse_override(item), "--set", from_text=True)
    return config


def _read_toml(path: Path) -> dict[str, Any]:
    source = _name(str(path))
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError("file not found", source=source,
                          hint="check the --config path") from None
    except IsADirectoryError:
        raise ConfigError("is a directory, not a TOML file", source=source,
                          hint="check the --config path") from None
    except (OSError, ValueError) as exc:  # no permission, a NUL in the name, ...
        raise ConfigError(f"cannot read the file: {exc}", source=source) from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"larger than {MAX_FILE_BYTES} bytes, too large for a config file",
                          source=source)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
                          f"{exc.start})", source=source, hint="TOML files are UTF-8") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"not valid TOML: {exc}", source=source) from None
    except RecursionError:
        raise ConfigError("not valid TOML: arrays or tables nested too deeply",
                          source=source) from None
    except ValueError as exc:  # an integer of more than 4,300 digits
        raise ConfigError(f"not valid TOML: {str(exc).split(':')[0]}", source=source) from None


def _env_values(env: Mapping[str, str]) -> dict[str, dict[str, str]]:
    values: dict[str, dict[str, str]] = {}
    for name, text in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX):].lower()
        section, _, key = rest.partition("_")
        if section not in SECTIONS or not key:
            raise ConfigError(
                f"unknown variable {_name(name)}",
                source="environment",
                hint=f"expected {ENV_PREFIX}<SECTION>_<KEY> with SECTION one of "
                     f"{', '.join(s.upper() for s in SECTIONS)}")
        values.setdefault(section, {})[key] = text
    return values


def _parse_override(item: str) -> dict[str, dict[str, str]]:
    dotted, sep, text = item.partition("=")
    section, dot, key = dotted.strip().partition(".")
    if not sep or not dot or not key:
        raise ConfigError(f"expected section.key=value, got {_shown(item)}", source="--set")
    return {section: {key: text.strip()}}


def _apply(config: Config, raw: Mapping[str, Any], source: str, *, from_text: bool) -> Config:
    updates: dict[str, Any] = {}
    for section_name, values in raw.items():
        section_type = SECTIONS.get(section_name)
        if section_type is None:
            raise ConfigError(f"unknown section [{_name(section_name)}]", source=source,
                              hint=f"valid sections: {', '.join(SECTIONS)}")
        if not isinstance(values, Mapping):
            raise ConfigError(f"[{section_name}] must be a table of keys, got "
                              f"{_shown(values)}", source=source)
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
            raise ConfigError("unknown key", source=source, key=_name(dotted),
                              hint=f"valid keys in [{section_name}]: {', '.join(valid)}")
        changes[key] = _coerce(value, hints[key], source, dotted, from_text)
    section = replace(current, **changes)
    for key, problem in section.problems():
        raise ConfigError(f"{problem} (got {_shown(getattr(section, key))})", source=source,
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
            raise ConfigError(f"expected {expected}, got {_shown(value)}", source=source,
                              key=key)
        return tuple(_coerce(v, item_type, source, key, False) for v in value)
    if isinstance(target, type) and issubclass(target, enum.Enum):
        try:
            return target(value)
        except (ValueError, TypeError):
            raise ConfigError(f"expected {expected}, got {_shown(value)}", source=source,
                              key=key) from None
    if target is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            raise ConfigError(f"expected a finite number, got {_shown(value)}",
                              source=source, key=key) from None
    if type(value) is not target:
        raise ConfigError(f"expected {expected}, got {_shown(value)}", source=source, key=key)
    return value


def _toml_literal(text: str) -> Any:
    """``text`` read as one TOML value; else ``text`` itself (the type check reports it)."""
    try:
        parsed = tomllib.loads(f"v = {text}")
    except (ValueError, RecursionError):  # bad TOML, 4,300+ digits, 2,000 nested '['
        return text
    return parsed["v"] if parsed.keys() == {"v"} else text  # "1\nx = 2" is not one value


def _shown(value: Any, limit: int = 80) -> str:
    """``value``'s repr for a message, cut if long (a hostile value may be megabytes)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def _name(text: str) -> str:
    """A name or path the user typed, for a message: as is if plain, else escaped and cut."""
    if text.isprintable() and len(text) <= 200:
        return text
    escaped = repr(text)[1:-1]
    return escaped if len(escaped) <= 200 else f"{escaped[:200]}... ({len(text)} chars)"


def _describe(target: Any) -> str:
    if typing.get_origin(target) is tuple:
        return f"a list of {_describe(typing.get_args(target)[0]).removeprefix('a ')}s"
    if isinstance(target, type) and issubclass(target, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in target)
    return {int: "an integer", float: "a number", bool: "true or false",
            str: "a string"}.get(target, str(target))


# --------------------------------------------------------------------------- saving


def to_toml(config: Config) -> str:
    """Render the resolved config as TOML that ``load_config`` reads back equal.

    Refuses (``ConfigError``) a config that ``load_config`` would refuse, e.g. one
    built in code with NaN or a control character."""
    lines: list[str] = []
    for section_field in fields(config):
        section = getattr(config, section_field.name)
        for key, problem in section.problems():
            raise ConfigError(f"{problem} (got {_shown(getattr(section, key))})",
                              source="the config to save", key=f"{section_field.name}.{key}")
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
        return '"' + "".join(_toml_char(c) for c in value) + '"'
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot render {value!r} as TOML")


_TOML_ESCAPES = {"\\": "\\\\", '"': '\\"', "\b": "\\b", "\t": "\\t", "\n": "\\n",
                 "\f": "\\f", "\r": "\\r"}


def _toml_char(char: str) -> str:
    """One character inside a TOML basic string: escaped where TOML requires it."""
    if char in _TOML_ESCAPES:
        return _TOML_ESCAPES[char]
    return f"\\u{ord(char):04x}" if unicodedata.category(char) == "Cc" else char


def save_config(config: Config, directory: str | os.PathLike[str]) -> Path:
    """Write the resolved config atomically as ``DIR/config.toml``."""
    return atomic_write_text(Path(directory) / "config.toml", to_toml(config))

