"""Hot update and rollback of the training code: ``decide_version(state, event, now)``,
the code-version rules of the one controller decision (``lifecycle.decide``), over the
one ``RunState`` (each replica's version lives in its lifecycle record).

The code a replica runs is a recorded ``CodeVersion`` (1 = the command the run
started with). ``ft-launch update`` drops a request file in
``<run_dir>/updates/NNNN.json``; the controller turns it into a new version.

| event             | when                                 | what happens                         |
| ----------------- | ------------------------------------ | ------------------------------------ |
| UpdateRequested   | same command and digest as current   | no new version; its urgency or       |
|                   |                                      | window still apply                   |
|                   | same as a version rolled back as bad | ignored, recorded with the reason    |
|                   | otherwise                            | a new version becomes ``current``,   |
|                   |                                      | forced now if urgent, else after its |
|                   |                                      | window (default: the policy's 24 h)  |
| ReplicaLaunching  | any launch: retry, relaunch,         | ``RunVersion(current)``: the next    |
|                   | promotion, update restart            | recovery applies the update;         |
|                   |                                      | ``CodeVersionApplied`` on a change   |
| ReplicaProgressed |                                      | failures reset; a replica restarted  |
|                   |                                      | for an update is back, the next goes |
| ReplicaFailed     | ``rollback_after``-th failure on a   | version marked bad, ``current`` :=   |
|                   | version > 1, no step in between      | the newest good older one;           |
|                   |                                      | ``RollBack`` + ``CodeRolledBack``    |
| ReplicaRetired    | given up on (FINISHED, FAILED: final)| no longer waited for                 |
| Tick, and after   | a deadline passed or a replica runs  | ``RestartReplicaForUpdate`` of the   |
| every event       | a bad version; no update restart in  | lowest such replica: one at a time,  |
|                   | flight; every live replica RUNNING   | so an update never costs the job     |
|                   |                                      | more than one replica                |

A second request while a rollout is under way never delays it: replicas still
to be restarted go straight to the newest version. Mixed versions across
replicas are expected during a rollout; an update must keep the checkpoint and
the model compatible (the operator's side of the contract).

The digest covers the argv and the bytes of every argv item (or ``--flag=value``
value) that names an existing regular file, e.g. the training script; modules
run with ``python -m`` and files they import are not covered.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ft_launch.errors import ConfigError, UsageError
from ft_launch.events import Event
from ft_launch.files import atomic_write_bytes, fsync_directory

from .run_state import (
    RETIRED,
    CodeVersion,
    Replica,
    ReplicaProgressed,
    ReplicaState,
    RunState,
    record_progress,
)

DEFAULT_UPDATE_WINDOW = 24 * 3600.0     # design.md: a non-urgent update is forced after 24 h
_REQUEST_NAME = re.compile(r"^(\d+)\.json$")
_REQUEST_FIELDS = ("command", "urgent", "window_s", "note", "digest", "created")


# --------------------------------------------------------------------------- digests


def digest_command(command: Sequence[str], cwd: Path) -> str:
    """sha256 of the argv and of the contents of each existing regular file it names."""
    digest = hashlib.sha256()
    for arg in command:
        digest.update(f"arg {len(arg)}:".encode() + arg.encode())
        value = arg.partition("=")[2]
        for name in [arg] + ([value] if value else []):
            path = Path(name) if Path(name).is_absolute() else cwd / name
            if path.is_file():
                try:
                    data = path.read_bytes()
                except OSError as error:
                    raise UsageError(f"cannot read {path}, named by the training command: "
                                     f"{error}") from error
                digest.update(f"file {name} {len(data)}:".encode() + data)
    return digest.hexdigest()


# --------------------------------------------------------------------------- request files


@dataclass(frozen=True)
class UpdateRequest:
    number: int                 # from the file name: updates/NNNN.json
    command: tuple[str, ...]
    urgent: bool
    window_s: float | None      # force after this long; None: the controller's default
    note: str
    digest: str
    created: float


class UpdateRequestError(ConfigError):
    """An update request file that cannot be read; names the file and the field."""


def write_update_request(run_dir: Path, command: Sequence[str], *, urgent: bool,
                         window_s: float | None, note: str, cwd: Path | None = None,
                         now: float | None = None) -> UpdateRequest:
    """Record a request for the controller (atomically, never overwriting another one).

    The digest is taken now, of the files as ``cwd`` (default: this process's) sees
    them: pass the directory the training command runs in."""
    if not run_dir.is_dir():
        raise UsageError(f"run directory {run_dir} does not exist")
    if not command or not all(isinstance(a, str) and a for a in command):
        raise UsageError(f"an update needs a non-empty command, got {list(command)!r}")
    if window_s is not None and not (math.isfinite(window_s) and window_s >= 0):
        raise UsageError(f"update window must be a finite number of seconds >= 0, "
                         f"got {window_s!r}")
    record = {"command": list(command), "urgent": urgent, "window_s": window_s, "note": note,
              "digest": digest_command(command, cwd or Path.cwd()),
              "created": time.time() if now is None else now}
    path = _publish(run_dir / "updates", json.dumps(record, indent=2).encode() + b"\n")
    return read_update_request(path)


def _publish(directory: Path, data: bytes) -> Path:
    """Write under a private name, then hard-link to the next free NNNN.json: a reader
    never sees half a file and two writers never take the same number."""
    staged = atomic_write_bytes(directory / f".staged-{uuid.uuid4().hex}.json", data)
    try:
        number = max((n for n, _ in _request_files(directory)), default=0) + 1
        while True:
            target = directory / f"{number:04d}.json"
            try:
                os.link(staged, target)
            except FileExistsError:
                number += 1
                continue
            fsync_directory(directory)
            return target
    finally:
        staged.unlink(missing_ok=True)


def _request_files(directory: Path) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir()
             if (m := _REQUEST_NAME.match(p.name))]
    return sorted(found)


def read_update_requests(run_dir: Path, after: int = 0) -> list[UpdateRequest]:
    """The requests numbered above ``after``, in order; a bad file raises
    ``UpdateRequestError`` (use ``read_update_request`` to skip one and go on)."""
    return [read_update_request(path) for number, path in _request_files(run_dir / "updates")
            if number > after]


def read_update_request(path: Path) -> UpdateRequest:
    match = _REQUEST_NAME.match(path.name)
    if match is None:
        raise UpdateRequestError("the name must be NNNN.json", source=str(path))
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise UpdateRequestError(f"not readable as JSON: {error}", source=str(path)) from error
    if not isinstance(record, dict):
        raise UpdateRequestError("must be a JSON object", source=str(path))
    unknown = sorted(set(record) - set(_REQUEST_FIELDS))
    if unknown:
        raise UpdateRequestError(f"unknown field(s) {unknown}; valid: {list(_REQUEST_FIELDS)}",
                                 source=str(path), key=unknown[0])
    for name in _REQUEST_FIELDS:
        if name not in record:
            raise UpdateRequestError("missing", source=str(path), key=name)
        if not _valid(name, record[name]):
            raise UpdateRequestError(f"invalid value {record[name]!r}: {_EXPECTED[name]}",
                                     source=str(path), key=name)
    return UpdateRequest(number=int(match.group(1)), command=tuple(record["command"]),
                         urgent=record["urgent"],
                         window_s=None if record["window_s"] is None else float(record["window_s"]),
                         note=record["note"], digest=record["digest"],
                         created=float(record["created"]))


_EXPECTED = {"command": "a non-empty list of non-empty strings", "urgent": "true or false",
             "window_s": "null or a number of seconds >= 0", "note": "a string",
             "digest": "64 hex digits (sha256)", "created": "a time in seconds since the epoch"}


def _valid(name: str, value: Any) -> bool:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if name == "command":
        return (isinstance(value, list) and bool(value)
                and all(isinstance(a, str) and a for a in value))
    if name == "urgent":
        return isinstance(value, bool)
    if name == "window_s":
        return value is None or (number and math.isfinite(value) and value >= 0)
    if name == "digest":
        return isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value) is not None
    if name == "created":
        return number and math.isfinite(value)
    return isinstance(value, str)


# --------------------------------------------------------------------------- records (logged)


@dataclass(frozen=True)
class CodeUpdateRequested(Event):
    request: int
    command: list[str]
    digest: str
    urgent: bool
    window_s: float | None
    note: str
    version: int | None         # the version it maps to; None when ignored
    forced_at: float | None     # when replicas still on older versions get restarted
    ignored: str = ""           # why it was ignored


@dataclass(frozen=True)
class CodeVersionApplied(Event):
    replica_id: int
    version: int
    command: list[str]
    digest: str


@dataclass(frozen=True)
class CodeRolledBack(Event):
    from_version: int
    to_version: int
    replica_id: int
    reason: str


# --------------------------------------------------------------------------- events, actions


@dataclass(frozen=True)
class UpdateRequested:
    """A request file the shell has read (``read_update_requests``)."""

    request: UpdateRequest


@dataclass(frozen=True)
class ReplicaLaunching:
    """Sent before every launch of a replica; the answer is a ``RunVersion``."""

    replica_id: int
    version: int | None = None  # what it will run when the shell cannot choose (warm standby)


@dataclass(frozen=True)
class ReplicaFailed:
    """The replica crashed or lost a node (not: stopped by ``RestartReplicaForUpdate``)."""

    replica_id: int


@dataclass(frozen=True)
class ReplicaRetired:
    """Recovery gave up on the replica: the rollout stops waiting for it."""

    replica_id: int


@dataclass(frozen=True)
class Tick:
    """Time passed: a forced window may have run out."""


VersionEvent = (UpdateRequested | ReplicaLaunching | ReplicaProgressed | ReplicaFailed
                | ReplicaRetired | Tick)


@dataclass(frozen=True)
class RunVersion:
    """The answer to ``ReplicaLaunching``: launch the replica with this version."""

    replica_id: int
    version: CodeVersion


@dataclass(frozen=True)
class RestartReplicaForUpdate:
    """Stop the replica (not a failure) and launch it again; the launch adopts ``version``."""

    replica_id: int
    version: CodeVersion
    reason: str = field(default="", compare=False)


@dataclass(frozen=True)
class RollBack:
    """``from_version`` is bad: new launches run ``to_version`` (restarts follow)."""

    from_version: int
    to_version: int
    reason: str


#: Records (``Event`` instances) are in the list too: the shell writes them to its log.
VersionAction = RunVersion | RestartReplicaForUpdate | RollBack | Event


@dataclass(frozen=True)
class VersionPolicy:
    rollback_after: int = 2     # failures on a new version, without a step, that roll it back
    update_window: float = DEFAULT_UPDATE_WINDOW  # for requests with no window of their own


# --------------------------------------------------------------------------- decide


def decide_version(state: RunState, event: VersionEvent, now: float,
                   policy: VersionPolicy | None = None
                   ) -> tuple[RunState, list[VersionAction]]:
    policy = policy or VersionPolicy()
    actions: list[VersionAction] = []
    if isinstance(event, UpdateRequested):
        state = _requested(state, event.request, now, policy, actions)
    elif isinstance(event, ReplicaLaunching):
        state = launching(state, event.replica_id, now, actions, event.version)
    elif isinstance(event, ReplicaProgressed):
        state = record_progress(state, event.replica_id)
    elif isinstance(event, ReplicaFailed):
        state = _failed(state, event.replica_id, now, policy, actions)
    elif isinstance(event, ReplicaRetired):
        replica = state.replica(event.replica_id)
        if not replica.retired:
            state = state.with_replica(replace(replica, state=ReplicaState.FAILED))
    return roll(state, now, actions)


def _requested(state: RunState, request: UpdateRequest, now: float, policy: VersionPolicy,
               actions: list[VersionAction]) -> RunState:
    window = 0.0 if request.urgent else (policy.update_window if request.window_s is None
                                         else request.window_s)
    same = [v.number for v in state.versions
            if (v.command, v.digest) == (request.command, request.digest)]
    bad = [n for n in same if n in state.bad]
    record = CodeUpdateRequested(request=request.number, command=list(request.command),
                                 digest=request.digest, urgent=request.urgent,
                                 window_s=request.window_s, note=request.note, version=None,
                                 forced_at=None, time=now)
    if bad:
        actions.append(replace(record, ignored=f"same code as version {bad[-1]}, which was "
                                               "rolled back: change the code and request again"))
        return state
    number = state.current
    if state.current not in same:
        number = len(state.versions) + 1
        version = CodeVersion(number, request.command, request.digest, request.note, now)
        state = replace(state, versions=state.versions + (version,), current=number)
    actions.append(replace(record, version=number, forced_at=now + window))
    return replace(state, deadlines=state.deadlines + ((number, now + window),))


def launching(state: RunState, replica_id: int, now: float, actions: list[VersionAction],
              version: int | None = None) -> RunState:
    """A launch of ``replica_id`` (first, retry, relaunch, promotion, update restart): it
    runs ``current`` (or ``version``, what a warm standby was started with), recorded
    with ``CodeVersionApplied`` when that changes. A first launch is STARTING, any other
    RECOVERING."""
    number = state.current if version is None else version
    replica = state.replica(replica_id)
    code = state.version(number)
    if number != replica.version:
        actions.append(CodeVersionApplied(replica_id=replica_id, version=number,
                                          command=list(code.command), digest=code.digest,
                                          time=now))
        replica = replace(replica, version=number, failures_on_version=0)
    actions.append(RunVersion(replica_id, code))
    lifecycle = ReplicaState.STARTING if replica.state is ReplicaState.NOT_LAUNCHED \
        else ReplicaState.RECOVERING
    return state.with_replica(replace(replica, state=lifecycle))


def _failed(state: RunState, replica_id: int, now: float, policy: VersionPolicy,
            actions: list[VersionAction]) -> RunState:
    replica = state.replica(replica_id)
    if replica.retired:
        return state    # a late report of a replica nobody waits for
    replica = replace(replica, state=ReplicaState.DOWN,
                      failures_on_version=replica.failures_on_version + 1)
    state = state.with_replica(replica)
    bad = replica.version
    older = [v.number for v in state.versions if v.number < bad and v.number not in state.bad]
    if replica.failures_on_version < policy.rollback_after or bad in state.bad or not older:
        return state
    target = older[-1] if state.current == bad else state.current
    reason = (f"replica {replica_id} failed {replica.failures_on_version} times on code "
              f"version {bad} without committing a step")
    actions += [RollBack(bad, target, reason),
                CodeRolledBack(from_version=bad, to_version=target, replica_id=replica_id,
                               reason=reason, time=now)]
    # The failed replica is down already: it is the one restart in flight (its relaunch
    # adopts ``target``); the others on the bad version follow one at a time.
    return replace(state, bad=state.bad + (bad,), current=target,
                   deadlines=tuple(d for d in state.deadlines if d[0] != bad),
                   restarting=replica_id if state.restarting is None else state.restarting)


def roll(state: RunState, now: float, actions: list[VersionAction]
         ) -> tuple[RunState, list[VersionAction]]:
    """Restart at most one replica that must change version, when nothing else is down.
    A replica restarted for an update that retired meanwhile is not waited for."""
    if state.restarting is not None and state.replica(state.restarting).state in RETIRED:
        state = replace(state, restarting=None)
    live = [r for r in state.replicas if not r.retired]
    if state.restarting is not None or any(r.state is not ReplicaState.RUNNING for r in live):
        return state, actions
    required = state.required(now)
    due = [r for r in live if r.version in state.bad or r.version < required]
    if not due:
        return state, actions
    target = due[0]
    actions.append(RestartReplicaForUpdate(target.replica_id, state.version(state.current),
                                           _restart_reason(state, target, now)))
    return replace(state, restarting=target.replica_id), actions


def _restart_reason(state: RunState, replica: Replica, now: float) -> str:
    if replica.version in state.bad:
        return (f"replica {replica.replica_id} runs code version {replica.version}, rolled "
                f"back: restarted onto version {state.current}")
    return (f"replica {replica.replica_id} runs code version {replica.version}, older than "
            f"version {state.required(now)} whose window has run out: restarted onto "
            f"version {state.current}")
