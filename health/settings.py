"""The node-side health configuration an admin writes (TOML), and what it builds:
GPU backend, check context, profiles.

Slurm hooks run outside any job, so they cannot use the job's ``ftcore``
config. They read ``/etc/ft-launch/health.toml``, or the file named by
``FT_LAUNCH_HEALTH_CONFIG`` (deliberately outside the ``FTL_*`` namespace, which
belongs to the job config). A missing default file means built-in defaults; a
missing file that was named explicitly, unknown keys, wrong types and
impossible values are ``ConfigError``s naming the file, the key and the valid
choices. Layout (every table optional; see ``etc/health/health.toml.example``)::

    [node]              NodeSettings fields
    [checks.NAME]       parameters of one catalog check
    [profiles.NAME]     checks = [...], budget = seconds, warn_only = [...]
"""

from __future__ import annotations

import os
import tomllib
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ftcore.config import HealthConfig
from ftcore.errors import ConfigError

from .catalog import CATALOG, bind, default_params
from .context import CheckContext, JobFacts
from .gpu_facts import GpuBackend, NoGpuBackend
from .profile import BoundCheck, Profile
from .profiles import BUILTIN, ProfileSpec
from .simulation import SimulatedFaults, SimulatedNvml, fault_file

DEFAULT_PATH = Path("/etc/ft-launch/health.toml")
CONFIG_ENV = "FT_LAUNCH_HEALTH_CONFIG"
BACKENDS = ("auto", "nvml", "simulated", "none")


@dataclass(frozen=True)
class NodeSettings:
    gpus_per_node: int = 0            # 0: the GPU count is not judged
    backend: str = "auto"             # auto: NVML when /dev/nvidiactl exists, else none
    sim_fault_dir: str = ""           # simulated backend: faults in <dir>/<node>.json
    xid_window: float = 3600.0        # seconds of kernel log that count (0: since boot)
    drain: bool = True                # hooks drain a failing node themselves
    report_dir: str = ""              # each hook run writes <dir>/<node>/<hook>-<job>.json
    log_file: str = ""                # hooks log here as well as to stderr
    slurm_command_timeout: float = 10.0

    def problems(self) -> Iterable[tuple[str, str]]:
        if self.gpus_per_node < 0:
            yield "gpus_per_node", "must be 0 or more"
        if self.backend not in BACKENDS:
            yield "backend", f"must be one of {', '.join(BACKENDS)}"
        if self.backend == "none" and self.gpus_per_node:
            yield "backend", "'none' contradicts gpus_per_node > 0"
        if self.slurm_command_timeout <= 0:
            yield "slurm_command_timeout", "must be a positive number of seconds"


@dataclass(frozen=True)
class HealthSettings:
    node: NodeSettings = field(default_factory=NodeSettings)
    check_params: Mapping[str, Any] = field(default_factory=dict)
    profiles: Mapping[str, ProfileSpec] = field(default_factory=lambda: dict(BUILTIN))
    source: str = "defaults"

    def profile(self, name: str) -> Profile:
        spec = self.profiles.get(name)
        if spec is None:
            raise ConfigError(f"unknown profile {name!r}", source=self.source,
                              hint=f"profiles: {', '.join(sorted(self.profiles))}")
        checks = tuple(BoundCheck(c, bind(c, self.params(c))) for c in spec.checks)
        return Profile(name, checks, spec.budget, frozenset(spec.warn_only))

    def params(self, check: str) -> Any:
        return self.check_params.get(check, default_params(check))

    def gpu_backend(self, node: str, watch_events: bool = False) -> GpuBackend:
        kind = self.node.backend
        if kind == "auto":
            kind = "nvml" if self.node.gpus_per_node or Path("/dev/nvidiactl").exists() \
                else "none"
        if kind == "simulated":
            path = fault_file(self.node.sim_fault_dir, node) if self.node.sim_fault_dir else None
            return SimulatedNvml(self.node.gpus_per_node, path)
        if kind == "nvml":
            from .nvml_backend import NvmlBackend

            return NvmlBackend(self.node.xid_window, watch_events=watch_events)
        return NoGpuBackend()

    def context(self, node: str, job: JobFacts | None = None,
                backend: GpuBackend | None = None) -> CheckContext:
        backend = backend or self.gpu_backend(node)
        faults = backend.faults() if isinstance(backend, SimulatedNvml) else SimulatedFaults()
        return CheckContext(node=node, gpu_backend=backend, expected_gpus=self.node.gpus_per_node,
                            faults=faults, job=job)


# --------------------------------------------------------------------------- loading


def settings_path(env: Mapping[str, str]) -> tuple[Path, bool]:
    """The file to read and whether it was named explicitly."""
    named = env.get(CONFIG_ENV, "")
    return (Path(named), True) if named else (DEFAULT_PATH, False)


def load_settings(path: str | os.PathLike[str] | None = None,
                  env: Mapping[str, str] | None = None) -> HealthSettings:
    """Read the admin config: ``path``, else $FT_LAUNCH_HEALTH_CONFIG, else the default."""
    explicit = path is not None
    file = Path(path) if path is not None else None
    if file is None:
        file, explicit = settings_path(os.environ if env is None else env)
    try:
        with file.open("rb") as handle:
            raw = tomllib.load(handle)
    except FileNotFoundError:
        if explicit:
            raise ConfigError("file not found", source=str(file),
                              hint=f"fix {CONFIG_ENV} or the path given") from None
        return HealthSettings()
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"not valid TOML: {exc}", source=str(file)) from None
    return parse_settings(raw, str(file))


def parse_settings(raw: Mapping[str, Any], source: str) -> HealthSettings:
    _known(raw, ("node", "checks", "profiles"), source, "top level")
    node = build(NodeSettings, _table(raw, "node", source), source, "node")
    checks_raw = _table(raw, "checks", source)
    _known(checks_raw, CATALOG, source, "[checks]")
    params = {}
    for name in checks_raw:
        spec = CATALOG[name]
        if spec.params is None:
            raise ConfigError(f"check {name!r} takes no parameters", source=source)
        params[name] = build(spec.params, _table(checks_raw, name, source), source,
                             f"checks.{name}")
    profiles = dict(BUILTIN)
    for name, table in _table(raw, "profiles", source).items():
        base = BUILTIN.get(name, ProfileSpec((), 10.0))
        if not isinstance(table, Mapping):
            raise ConfigError(f"[profiles.{name}] must be a table", source=source)
        spec = build(ProfileSpec, {"checks": base.checks, "budget": base.budget,
                                   "warn_only": base.warn_only, **table},
                     source, f"profiles.{name}")
        for check in (*spec.checks, *spec.warn_only):
            _known({check: None}, CATALOG, source, f"[profiles.{name}]")
        profiles[name] = spec
    return HealthSettings(node, params, profiles, source)


def from_health_config(config: HealthConfig, base: HealthSettings | None = None) -> HealthSettings:
    """Settings for job-side use (inspection agent) from the job's ``[health]`` section."""
    base = base or HealthSettings()
    node = NodeSettings(**{**{f.name: getattr(base.node, f.name) for f in fields(NodeSettings)},
                           "gpus_per_node": config.gpus_per_node, "backend": config.backend})
    disk = base.params("disk")
    params = {**base.check_params,
              "disk": type(disk)(paths=disk.paths, min_free_bytes=config.min_free_disk_bytes)}
    return HealthSettings(node, params, base.profiles, base.source)


def _table(raw: Mapping[str, Any], key: str, source: str) -> Mapping[str, Any]:
    value = raw.get(key, {})
    if not isinstance(value, Mapping):
        raise ConfigError(f"[{key}] must be a table", source=source)
    return value


def _known(raw: Mapping[str, Any], valid: Iterable[str], source: str, where: str) -> None:
    valid = list(valid)
    for key in raw:
        if key not in valid:
            raise ConfigError(f"unknown key {key!r} in {where}", source=source,
                              hint=f"valid: {', '.join(sorted(valid))}")


def build(cls: type, table: Mapping[str, Any], source: str, where: str) -> Any:
    """A frozen dataclass from a TOML table: unknown keys and wrong types are errors."""
    hints = typing.get_type_hints(cls)
    _known(table, hints, source, f"[{where}]")
    values = {key: _coerce(value, hints[key], source, f"{where}.{key}")
              for key, value in table.items()}
    built = cls(**values)
    for key, problem in getattr(built, "problems", lambda: ())():
        raise ConfigError(f"{problem} (got {getattr(built, key)!r})", source=source,
                          key=f"{where}.{key}")
    return built


def _coerce(value: Any, target: Any, source: str, key: str) -> Any:
    origin = typing.get_origin(target)
    if origin is tuple:
        item = typing.get_args(target)[0]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"expected a list, got {value!r}", source=source, key=key)
        return tuple(_coerce(v, item, source, key) for v in value)
    if origin is dict:
        if not isinstance(value, Mapping) or not all(isinstance(v, str) for v in value.values()):
            raise ConfigError(f"expected a table of strings, got {value!r}", source=source,
                              key=key)
        return dict(value)
    if target is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(value) is not target:
        names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
        raise ConfigError(f"expected {names.get(target, target)}, got {value!r}",
                          source=source, key=key)
    return value
