"""A drain the controller could not do itself, left for the node's Epilog.

Draining needs Slurm operator rights, which a user's job usually lacks. Then the
controller (which has stopped using the node anyway) writes
``<run_dir>/drain-requests/<node>.json`` and names the run directory in the job's
``Comment`` (``ft-launch-run=<dir>``, which a job's owner may set); the Epilog, run
as root on that node when the job ends, reads the job record it fetches anyway and
drains its own node with the recorded reason. The Epilog accepts a request only
for its own node and its own job.

The path is the job owner's choice and the reader is root, so the reader follows
no link below the run directory (each component opened ``O_NOFOLLOW`` from its
parent's descriptor), opens without blocking (a FIFO cannot hang it), and reads
at most ``MAX_REQUEST_BYTES`` of a regular file the job's user owns. (A device
node the user could place there needs root to make: ``mknod``, or a hard link,
which ``fs.protected_hardlinks`` refuses for files one does not own.) What fails
these rules raises ``InvalidDrainRequest``, and the Epilog drains the node: a
request it cannot trust must neither be skipped silently nor stop the checks.

Here, not in ``launcher``, because both the launcher (writer) and the Epilog
(reader, ``slurm_plugins``) use it and imports flow down to ``health``.
Torch-free.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

from ft_launch.errors import NodeUnhealthyError
from ft_launch.files import atomic_write_text

from .slurm_env import node_name_problem, shown

COMMENT_PREFIX = "ft-launch-run="
REQUESTS_DIR = "drain-requests"
MAX_REASON = 200
#: A request is three short fields; the reason is cut to MAX_REASON anyway.
MAX_REQUEST_BYTES = 4096

_OPEN = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
_BELOW = _OPEN | os.O_NOFOLLOW


class InvalidDrainRequest(NodeUnhealthyError):
    """The job named a drain request the Epilog cannot trust: the node is drained
    (a verdict it cannot read is not a healthy verdict) and the checks still run."""


def request_file(run_dir: Path, node: str) -> Path:
    return run_dir / REQUESTS_DIR / f"{node}.json"


def write_request(run_dir: Path, job_id: str, node: str, reason: str) -> Path:
    path = request_file(run_dir, node)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({"job_id": job_id, "node": node, "reason": reason}))
    return path


def job_comment(run_dir: Path) -> str:
    """The Epilog wants an absolute path with no '..': the launcher's is resolved."""
    return f"{COMMENT_PREFIX}{run_dir.resolve()}"


def requested_reason(record: Mapping[str, str], job_id: str, node: str,
                     uid: int | None) -> str | None:
    """Epilog side: the reason to drain ``node`` after job ``job_id`` (owner ``uid``),
    or None when its controller asked nothing of this node (``record``: the job's
    ``scontrol show job -o`` fields). Raises ``InvalidDrainRequest`` saying why."""
    comment = record.get("Comment", "")
    if not comment.startswith(COMMENT_PREFIX):
        return None
    run_dir = _run_dir(comment[len(COMMENT_PREFIX):])
    problem = node_name_problem(node)
    if problem is not None:
        raise InvalidDrainRequest(f"node {problem}")
    if uid is None:
        raise InvalidDrainRequest("job uid unknown (SLURM_JOB_UID), so the request's "
                                  "owner cannot be checked")
    data = read_request_bytes(run_dir, f"{node}.json", uid)
    if data is None:
        return None
    return _reason(data, job_id, node)


def _run_dir(text: str) -> Path:
    path = PurePosixPath(text)
    if not path.is_absolute() or ".." in path.parts:
        raise InvalidDrainRequest(f"run dir {shown(text)} not absolute or has '..'")
    return Path(path)


def read_request_bytes(run_dir: Path, name: str, uid: int) -> bytes | None:
    """``run_dir/drain-requests/name``, read as described above; None when absent
    (the controller asked nothing of this node)."""
    try:
        top = os.open(run_dir, _OPEN | os.O_DIRECTORY)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise InvalidDrainRequest(f"run dir {shown(str(run_dir))}: {exc.strerror}") from None
    try:
        below = _open_below(top, REQUESTS_DIR, directory=True)
        if below is None:
            return None
        try:
            handle = _open_below(below, name, directory=False)
        finally:
            os.close(below)
    finally:
        os.close(top)
    if handle is None:
        return None
    with os.fdopen(handle, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise InvalidDrainRequest(f"{name} is not a regular file")
        if info.st_uid != uid:
            raise InvalidDrainRequest(f"{name} owned by uid {info.st_uid}, not job uid {uid}")
        try:
            data = file.read(MAX_REQUEST_BYTES + 1)   # bounded even if it grows meanwhile
        except OSError as exc:
            raise InvalidDrainRequest(f"{name}: {exc.strerror}") from None
    if len(data) > MAX_REQUEST_BYTES:
        raise InvalidDrainRequest(f"{name} over {MAX_REQUEST_BYTES} bytes")
    return data


def _open_below(parent: int, name: str, *, directory: bool) -> int | None:
    """Open ``name`` in the directory ``parent`` without following a link."""
    try:
        return os.open(name, _BELOW | (os.O_DIRECTORY if directory else 0), dir_fd=parent)
    except FileNotFoundError:
        return None
    except OSError as exc:
        # ELOOP (a link, file) or ENOTDIR (a link or a non-directory, directory).
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(parent, name):
            raise InvalidDrainRequest(f"{name} is a symlink") from None
        raise InvalidDrainRequest(f"{name}: {exc.strerror}") from None


def _is_link(parent: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _reason(data: bytes, job_id: str, node: str) -> str | None:
    try:
        raw = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:   # UnicodeDecodeError is a ValueError
        raise InvalidDrainRequest(f"{node}.json is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise InvalidDrainRequest(f"{node}.json is not a JSON object")
    if raw.get("job_id") != job_id or raw.get("node") != node:
        # Left by an earlier job in a reused run directory, or for another node.
        return None
    reason = " ".join(str(raw.get("reason", "")).split())[:MAX_REASON]
    return f"evicted by ft-launch (job {job_id}): {reason or 'no reason given'}"
