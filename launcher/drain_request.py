"""A drain the controller could not do itself, left for the node's Epilog.

Draining needs Slurm operator rights, which a user's job usually lacks. Then the
controller (which has stopped using the node anyway) writes
``<run_dir>/drain-requests/<node>.json`` and names the run directory in the job's
``Comment`` (``ft-launch-run=<dir>``, which a job's owner may set); the Epilog, run
as root on that node when the job ends, reads the job record it fetches anyway and
drains its own node with the recorded reason. The Epilog accepts a request only
for its own node and its own job. Torch-free: the Epilog imports this.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from ftcore.files import atomic_write_text

COMMENT_PREFIX = "ft-launch-run="
MAX_REASON = 200


def request_file(run_dir: Path, node: str) -> Path:
    return run_dir / "drain-requests" / f"{node}.json"


def write_request(run_dir: Path, job_id: str, node: str, reason: str) -> Path:
    path = request_file(run_dir, node)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({"job_id": job_id, "node": node, "reason": reason}))
    return path


def job_comment(run_dir: Path) -> str:
    return f"{COMMENT_PREFIX}{run_dir}"


def requested_reason(record: Mapping[str, str], job_id: str, node: str) -> str | None:
    """Epilog side: the reason to drain ``node`` after job ``job_id``, if its
    controller asked (``record``: the job's ``scontrol show job -o`` fields)."""
    comment = record.get("Comment", "")
    if not comment.startswith(COMMENT_PREFIX):
        return None
    try:
        raw = json.loads(request_file(Path(comment[len(COMMENT_PREFIX):]), node)
                         .read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or raw.get("job_id") != job_id or raw.get("node") != node:
        return None
    reason = " ".join(str(raw.get("reason", "")).split())[:MAX_REASON]
    return f"evicted by ft-launch (job {job_id}): {reason or 'no reason given'}"
