"""The common body of every Slurm hook: read the documented ``SLURM_*`` variables,
load the admin config, run a profile, record the report, drain on failure.

Documented variables read (and nothing else from the job): ``SLURMD_NODENAME``
(all hooks), ``SLURM_JOB_ID``, ``SLURM_JOB_UID``, ``SLURM_JOB_USER`` (Prolog,
Epilog), each validated by ``ft_launch.health.slurm_env``. Job-controlled strings never
reach a shell: Slurm commands are argv lists.

Failure policy: a failing check drains the node (``ft: <reason>``) and the hook
exits ``ExitCode.NODE_UNHEALTHY`` (76). A broken admin config, a
``SLURMD_NODENAME`` that is not a node name, or a bug in the hook itself fails
*open* (one error line, exit 0): all three come from the node's setup, not from
the job, so they hit every node alike, and failing closed would drain every
node of the cluster and, for the Prolog, requeue and hold every job; a node we
cannot name we cannot drain or report on either. A bad job variable
(``SLURM_JOB_UID=²``) is dropped with one warning line and the node is checked
all the same: its health does not depend on who ran the job.

Run as root, a hook reads its config only from a file root owns and no one else
may write (``--config``, ``$FTL_CONFIG`` or ``/etc/ft-launch/health.toml``) and
takes no ``FTL_<SECTION>_<KEY>`` values (``ft_launch.health.settings``): no path or value
a user chose reaches a root process. It logs the variables it ignored.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ft_launch.config import ENV_CONFIG, ENV_PREFIX
from ft_launch.errors import ConfigError, ExitCode, SlurmCommandError
from ft_launch.files import atomic_write_text
from ft_launch.health.context import JobFacts
from ft_launch.health.drain import drain_node
from ft_launch.health.profile import ProfileReport, run_profile
from ft_launch.health.settings import DEFAULT_PATH as DEFAULT_CONFIG
from ft_launch.health.settings import HealthSettings, load_settings
from ft_launch.health.slurm_env import read_slurm_env
from ft_launch.logs import configure_logging
from ft_launch.slurm.client import SlurmCli

log = logging.getLogger(__name__)

#: Prolog/Epilog run with no search path (Slurm's prolog_epilog guide): give one.
SEARCH_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class HookEnv:
    node: str
    job_id: str | None = None
    job_uid: int | None = None
    job_user: str = ""
    rejected: tuple[str, ...] = ()     # job variables dropped as invalid, one line each

    @staticmethod
    def from_environ(env: Mapping[str, str]) -> HookEnv:
        """Raises ``ConfigError`` when the node cannot be named (see
        ``ft_launch.health.slurm_env``)."""
        inputs = read_slurm_env(env, socket.gethostname())
        return HookEnv(node=inputs.node, job_id=inputs.job_id, job_uid=inputs.job_uid,
                       job_user=inputs.job_user, rejected=inputs.rejected)

    def warn_rejected(self, hook: str) -> None:
        for line in self.rejected:
            log.warning("ft-%s on %s: %s", hook, self.node, line)

    def job(self, ended: bool) -> JobFacts | None:
        if self.job_id is None:
            return None
        return JobFacts(self.job_id, self.job_uid, self.job_user, ended=ended)


def slurm_client(settings: HealthSettings, env: Mapping[str, str]) -> SlurmCli:
    child_env = dict(env)
    child_env.setdefault("PATH", SEARCH_PATH)
    return SlurmCli(command_timeout=settings.node.slurm_command_timeout, env=child_env)


def write_report(settings: HealthSettings, hook: str, job_id: str | None,
                 report: ProfileReport) -> Path | None:
    """``<report_dir>/<node>/<hook>-<job>.json``: what ran and why, for admins and tests."""
    if not settings.node.report_dir:
        return None
    name = f"{hook}-{job_id}.json" if job_id else f"{hook}.json"
    path = Path(settings.node.report_dir) / report.node / name
    return atomic_write_text(path, json.dumps({"hook": hook, "job_id": job_id,
                                               **report.to_dict()}, indent=1), durable=False)


def parse_args(hook: str, argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"ft-{hook}", description=f"Slurm {hook} hook of ft-launch: run the node's health "
        f"profile, drain the node with a precise reason when a check fails.")
    parser.add_argument("--config", help=f"admin config (default: ${ENV_CONFIG} or "
                                          f"{DEFAULT_CONFIG})")
    return parser.parse_args(argv)


def setup(hook: str, argv: Sequence[str] | None, env: Mapping[str, str]) -> HealthSettings:
    """Logging to stderr at once, then the admin config (and its log file)."""
    configure_logging("INFO")
    as_root = os.geteuid() == 0
    settings = load_settings(parse_args(hook, argv).config, env=env, trusted_only=as_root)
    ignored = sorted(k for k in env if k.startswith(ENV_PREFIX) and k != ENV_CONFIG)
    if as_root and ignored:
        log.warning("ft-%s runs as root: ignoring %s (set them in the config file)", hook,
                    ", ".join(ignored))
    if settings.node.log_file:
        configure_logging("INFO", settings.node.log_file)
    return settings


def run_hook(hook: str, choose_profile: Callable[[HookEnv, HealthSettings, SlurmCli], str],
             *, job_ended: bool, argv: Sequence[str] | None = None,
             env: Mapping[str, str] | None = None) -> int:
    """The whole hook; returns the process exit code."""
    env = os.environ if env is None else env
    try:
        settings = setup(hook, argv, env)
    except ConfigError as exc:
        log.error("ft-%s: health config unusable, node NOT checked: %s", hook, exc)
        return ExitCode.OK
    try:
        return _checked_run(hook, choose_profile, job_ended, settings, env)
    except ConfigError as exc:
        log.error("ft-%s: %s; node NOT checked", hook, exc)
    except Exception:  # fail open: see the module docstring
        log.exception("ft-%s crashed; node NOT checked", hook)
    return ExitCode.OK


def _checked_run(hook: str, choose_profile: Callable[[HookEnv, HealthSettings, SlurmCli], str],
                 job_ended: bool, settings: HealthSettings, env: Mapping[str, str]) -> int:
    hook_env = HookEnv.from_environ(env)
    hook_env.warn_rejected(hook)
    slurm = slurm_client(settings, env)
    profile = choose_profile(hook_env, settings, slurm)
    report = run_profile(settings.profile(profile), settings.context(hook_env.node,
                                                                     hook_env.job(job_ended)))
    write_report(settings, hook, hook_env.job_id, report)
    failure = report.failure
    if failure is None:
        log.info("ft-%s %s on %s: %s in %.3fs", hook, profile, hook_env.node,
                 report.status.value, report.duration)
        return ExitCode.OK
    log.error("ft-%s %s on %s: FAIL %s", hook, profile, hook_env.node, failure.reason)
    if settings.node.drain:
        try:
            drain_node(slurm, hook_env.node, failure.reason)
        except SlurmCommandError as exc:
            log.error("could not drain %s: %s", hook_env.node, exc)
    return ExitCode.NODE_UNHEALTHY
