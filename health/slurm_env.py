"""The documented ``SLURM_*`` variables a hook reads, validated in this one place.

A hook runs as root (Prolog, Epilog, HealthCheckProgram) or inside the job's own
step (the gate), and each value becomes a file name, a command argument or a
number, so none is used unchecked:

* ``SLURMD_NODENAME`` names the report's folder and the node to drain. A value
  that is not a node name (``../x``, ``a/b``, 300 characters) raises
  ``ConfigError``: the caller cannot check, report on, or drain a node it cannot
  name, and decides what that means for its exit (``ft_launch.slurm_plugins.hook``).
* ``SLURM_JOB_ID``, ``SLURM_JOB_UID``, ``SLURM_JOB_USER`` describe the job, not the
  node. A bad one is dropped (as if Slurm had not set it) with one line saying
  why, and the node is checked all the same: its health does not depend on them.

Pure: no I/O besides the caller's ``hostname``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from ft_launch.errors import ConfigError

SOURCE = "the hook's environment"

#: A hostname label charset (RFC 1123 letters, digits, '-', plus '.' and '_', which
#: slurm.conf NodeName also allows); 255 is DNS's bound on a whole name.
_NODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}", re.ASCII)
#: Slurm job ids and uids are 32-bit unsigned integers: at most 10 ASCII digits
#: (``str.isdigit`` also accepts '²', which ``int`` then rejects).
_NUMBER = re.compile(r"[0-9]{1,10}", re.ASCII)
_MAX_ID = 2**32 - 1
#: POSIX portable user names, plus '@' and '$' that directory services use.
_USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@$-]{0,255}", re.ASCII)
_SHOWN = 40   # characters of a rejected value worth quoting in a log line


def shown(value: str) -> str:
    """A rejected value, quoted and cut short enough for one log line."""
    return repr(value[:_SHOWN] + ("..." if len(value) > _SHOWN else ""))


def node_name_problem(name: str) -> str | None:
    """Why ``name`` is not a node name one may use as a file name, or None."""
    if not _NODE.fullmatch(name) or ".." in name:
        return (f"{shown(name)} is not a Slurm node name (expected 1-255 of A-Z a-z 0-9 . _ -, "
                f"starting with a letter or digit, no '..')")
    return None


def _number(env: Mapping[str, str], key: str, rejected: list[str]) -> str | None:
    """The value of ``key`` when it is a 32-bit number (as written), else None."""
    text = env.get(key, "")
    if not text:
        return None
    if _NUMBER.fullmatch(text) and int(text) <= _MAX_ID:
        return text
    rejected.append(f"{key}={shown(text)} ignored: expected a number 0-{_MAX_ID} "
                    f"in ASCII digits")
    return None


@dataclass(frozen=True)
class SlurmInputs:
    """What a hook may believe about its node and job. ``rejected``: one line per
    job variable that was set but invalid, and so dropped."""

    node: str
    job_id: str | None = None
    job_uid: int | None = None
    job_user: str = ""
    rejected: tuple[str, ...] = ()


def read_slurm_env(env: Mapping[str, str], hostname: str) -> SlurmInputs:
    """Validate the hook variables of ``env``; ``hostname`` stands in for an unset
    ``SLURMD_NODENAME`` (a manual run). Raises ``ConfigError`` for a bad node name."""
    node = env.get("SLURMD_NODENAME") or hostname.split(".")[0]
    problem = node_name_problem(node)
    if problem is not None:
        key = "SLURMD_NODENAME" if env.get("SLURMD_NODENAME") else "hostname"
        raise ConfigError(problem, source=SOURCE, key=key)
    rejected: list[str] = []
    job_id = _number(env, "SLURM_JOB_ID", rejected)
    uid = _number(env, "SLURM_JOB_UID", rejected)
    user = env.get("SLURM_JOB_USER", "")
    if user and not _USER.fullmatch(user):
        rejected.append(f"SLURM_JOB_USER={shown(user)} ignored: expected a user name "
                        f"(A-Z a-z 0-9 _ . @ $ -, at most 256)")
        user = ""
    return SlurmInputs(node=node, job_id=job_id, job_uid=None if uid is None else int(uid),
                       job_user=user, rejected=tuple(rejected))
