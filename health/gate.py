"""The step-level health gate's check: a profile (``gate`` unless told) on the node this
process runs on, inside the job's own step.

Two callers share it: the ``ft-gate`` plugin (``ft_launch.slurm_plugins.gate``), which the
controller puts in front of a promoted replica's step and of every standby agent, and
the standby agent itself (``ft_launch.launcher.controller.standby``), which checks its
node again when it is promoted, maybe hours after it passed the gate. Torch-free.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping

from .context import JobFacts
from .profile import ProfileReport, run_profile
from .settings import HealthSettings
from .slurm_env import read_slurm_env

log = logging.getLogger(__name__)

GATE_PROFILE = "gate"


def check_node(settings: HealthSettings, env: Mapping[str, str],
               profile: str = GATE_PROFILE) -> ProfileReport:
    """Run ``profile`` on this node: the one ``SLURMD_NODENAME`` names (else the host
    name), for the job ``env`` describes. Each value is validated
    (``ft_launch.health.slurm_env``): a bad job variable is dropped with one warning line;
    a node that cannot be named raises ``ConfigError``."""
    inputs = read_slurm_env(env, socket.gethostname())
    for line in inputs.rejected:
        log.warning("ft-gate on %s: %s", inputs.node, line)
    job = (None if inputs.job_id is None
           else JobFacts(inputs.job_id, inputs.job_uid, inputs.job_user, ended=False))
    return run_profile(settings.profile(profile), settings.context(inputs.node, job))
