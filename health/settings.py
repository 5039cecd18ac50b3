"""What the health sections of the one config build: GPU backend, check context,
profiles.

The sections are ``ft_launch.config``'s ``[health]`` (the node, what the hooks do,
the inspection), ``[checks.NAME]`` (parameters of one catalog check) and
``[profiles.NAME]`` (checks = [...], budget = seconds, warn_only = [...]); see
``etc/health/health.toml.example``. The node programs (Slurm hooks, gate,
inspection agent, ``python -m ft_launch.health``) read them from the file given
(``--config``), else the one ``$FTL_CONFIG``, else ``/etc/ft-launch/health.toml``
when it exists, else use the defaults; ``FTL_HEALTH_<KEY>`` variables apply
on top, as for any section. The named tables are typed here, against the
check catalog, with the loader's error style (file, key, what was expected).

The Slurm hooks run as root outside any job (``trusted_only``): they read only
a file that root owns and no one else may write, and take no ``FTL_`` values,
so no path or value a user chose reaches them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ft_launch.config import (
    ENV_CONFIG,
    Config,
    HealthConfig,
    apply_table,
    config_file,
    load_config,
    parse_config,
)
from ft_launch.errors import ConfigError

from .catalog import CATALOG, bind, default_params
from .context import CheckContext, JobFacts
from .gpu_facts import GpuBackend, NoGpuBackend
from .host_facts import HostFacts
from .profile import BoundCheck, Profile
from .profiles import BUILTIN, ProfileSpec
from .simulation import SimulatedHostFacts, SimulatedNvml, fault_file

__all__ = [
    "DEFAULT_PATH",
    "ENV_CONFIG",
    "HealthSettings",
    "load_settings",
    "parse_settings",
    "settings_from",
]

DEFAULT_PATH = Path("/etc/ft-launch/health.toml")


@dataclass(frozen=True)
class HealthSettings:
    node: HealthConfig = field(default_factory=HealthConfig)
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
        # A simulated node is simulated whole: its fault file changes its host facts as
        # it changes its GPUs (read once per context, as the GPU snapshot is taken once).
        host = SimulatedHostFacts(faults=backend.faults()) if isinstance(backend, SimulatedNvml) \
            else HostFacts()
        return CheckContext(node=node, gpu_backend=backend, expected_gpus=self.node.gpus_per_node,
                            host=host, job=job)


# --------------------------------------------------------------------------- loading


def load_settings(path: str | os.PathLike[str] | None = None,
                  env: Mapping[str, str] | None = None, *,
                  trusted_only: bool = False) -> HealthSettings:
    """The health settings from ``path``, else ``$FTL_CONFIG``, else the default
    file when it exists, else the defaults (see the module docstring)."""
    env = os.environ if env is None else env
    file = Path(path) if path is not None else config_file(env)
    if file is None and DEFAULT_PATH.exists():
        file = DEFAULT_PATH
    # ``env`` without FTL_CONFIG: the file was chosen above (a default ignored there).
    config = load_config(file, env={k: v for k, v in env.items() if k != ENV_CONFIG},
                         trusted_only=trusted_only)
    return settings_from(config, str(file) if file is not None else "defaults")


def parse_settings(raw: Mapping[str, Any], source: str) -> HealthSettings:
    """The settings a TOML document already read describes (``source`` names it)."""
    return settings_from(parse_config(raw, source), source)


def settings_from(config: Config, source: str = "defaults") -> HealthSettings:
    """Typed check parameters and profiles from the config's named tables."""
    params = {name: _check_params(config, name) for name in config.checks}
    if "disk" not in params:
        params["disk"] = _check_params(config, "disk")
    profiles = dict(BUILTIN)
    for name in config.profiles:
        base = BUILTIN.get(name, ProfileSpec((), 10.0))
        spec = apply_table(base, f"profiles.{name}", config.profiles.get(name),
                           config.profiles.source(name))
        for check in (*spec.checks, *spec.warn_only):
            if check not in CATALOG:
                raise ConfigError(f"unknown check {check!r}", source=config.profiles.source(name),
                                  key=f"profiles.{name}", hint=f"checks: {', '.join(CATALOG)}")
        profiles[name] = spec
    return HealthSettings(config.health, params, profiles, source)


def _check_params(config: Config, name: str) -> Any:
    source = config.checks.source(name)
    spec = CATALOG.get(name)
    if spec is None:
        raise ConfigError("unknown check", source=source, key=f"checks.{name}",
                          hint=f"checks: {', '.join(CATALOG)}")
    table = config.checks.get(name)
    if spec.params is None:
        raise ConfigError(f"check {name!r} takes no parameters", source=source,
                          key=f"checks.{name}")
    base = default_params(name)
    if name == "disk":  # [health] min_free_disk_bytes, unless [checks.disk] sets its own
        table = {"min_free_bytes": config.health.min_free_disk_bytes, **table}
    return apply_table(base, f"checks.{name}", table, source)
