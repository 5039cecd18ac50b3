"""Slurm ``Epilog=``: after a job, the ``epilog`` profile; after a failed job, the
deeper ``epilog_failure`` profile.

The compute-node Epilog is not told how the job ended (SLURM_JOB_EXIT_CODE is
for EpilogSlurmctld only), so it asks slurmctld (``scontrol show job``): the
batch script's ``ExitCode`` and the steps' ``DerivedExitCode`` are final by
then. When slurmctld cannot say, the deeper profile runs: a slower epilog is
cheaper than a sick node taking the next job. A node the job's ft-launch
controller evicted without the rights to drain it is drained here
(``ft_launch.health.drain_request``); so is a node whose job named a drain request the
Epilog cannot trust (a link, a FIFO, another user's file...), and the post-job
checks run in either case.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping, Sequence

from ft_launch.errors import SlurmCommandError
from ft_launch.health.drain import drain_node
from ft_launch.health.drain_request import InvalidDrainRequest, requested_reason
from ft_launch.health.settings import HealthSettings
from ft_launch.slurm.client import SlurmCli
from ft_launch.slurm.commands import show_job_argv
from ft_launch.slurm.parse import parse_records

from .hook import HookEnv, run_hook

log = logging.getLogger(__name__)

PROFILE_OK = "epilog"
PROFILE_FAILED = "epilog_failure"
BAD_STATES = ("FAILED", "NODE_FAIL", "TIMEOUT", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def ended_badly(record: Mapping[str, str]) -> bool:
    """Pure: did the job described by this ``scontrol show job -o`` record fail?"""
    codes = [record.get("ExitCode", "0:0"), record.get("DerivedExitCode", "0:0")]
    for code in codes:
        status, _, signal = code.partition(":")
        if status not in ("", "0") or signal not in ("", "0"):
            return True
    return any(state in record.get("JobState", "") for state in BAD_STATES)


def choose_profile(env: HookEnv, settings: HealthSettings, slurm: SlurmCli) -> str:
    if env.job_id is None:
        return PROFILE_FAILED
    try:
        records = parse_records(slurm.run(show_job_argv(env.job_id)))
    except SlurmCommandError as exc:
        log.warning("job %s: cannot tell how it ended (%s): deeper checks", env.job_id, exc)
        return PROFILE_FAILED
    record = next((r for r in records if r.get("JobId") == env.job_id), None)
    if record is None:
        return PROFILE_FAILED
    honour_drain_request(record, env, slurm)
    return PROFILE_FAILED if ended_badly(record) else PROFILE_OK


def honour_drain_request(record: Mapping[str, str], env: HookEnv, slurm: SlurmCli) -> None:
    """Drain this node if the job's ft-launch controller evicted it but could not drain
    it (no operator rights), or if the job named a request that cannot be trusted:
    fail closed, since a root hook cannot tell a hostile request from a broken one.
    See ``ft_launch.health.drain_request``. Never raises: the post-job checks follow."""
    try:
        reason = requested_reason(record, env.job_id or "", env.node, env.job_uid)
    except InvalidDrainRequest as exc:
        reason = f"ft-launch: invalid drain request: {exc}"
        log.error("job %s: %s; draining %s", env.job_id, reason, env.node)
    else:
        if reason is None:
            return
        log.warning("job %s's controller evicted %s: draining it (%s)", env.job_id,
                    env.node, reason)
    try:
        drain_node(slurm, env.node, reason)
    except SlurmCommandError as exc:
        log.error("could not drain %s: %s", env.node, exc)


def main(argv: Sequence[str] | None = None) -> int:
    return run_hook("epilog", choose_profile, job_ended=True, argv=argv)


if __name__ == "__main__":
    sys.exit(main())
