"""Pure parsers of Slurm command output, tolerant of the 22.05, 24.11 and 26.05 formats
(each recorded from the real release: ``tests/unit/fixtures/slurm-*/``).

``scontrol show ... -o`` (one record a line, ``Key=Value`` pairs) keeps its shape
across these releases (fields are added, e.g. ``ReservationName=`` after a
node's ``Reason=`` from 24.11 on) and is the primary source. ``squeue``/``sinfo
--json`` differ: v0.0.38 in 22.05 has scalars, ``state`` + ``state_flags`` and
one entry per node; the data_parser of 24.11 (v0.0.42) and 26.05 (v0.0.45) has
lists of state names, ``{"set", "infinite", "number"}`` numbers, node groups,
and a node's reason as an object (``description``, ``time``, and in 24.11
``user``). Both shapes are read.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ..ids import StepRef
from .hostlist import expand
from .states import JobState, NodeState


@dataclass(frozen=True)
class JobInfo:
    job_id: str
    name: str
    state: JobState
    nodes: tuple[str, ...]
    batch_host: str | None
    reason: str
    exit_code: int
    restarts: int


@dataclass(frozen=True)
class NodeInfo:
    name: str
    state: NodeState
    flags: frozenset[str]
    reason: str
    address: str

    @property
    def drained(self) -> bool:
        return bool(self.flags & {"DRAIN", "DRAINED", "DRAINING"})


@dataclass(frozen=True)
class StepInfo:
    step: StepRef
    name: str
    nodes: tuple[str, ...]
    elapsed: str


@dataclass(frozen=True)
class ReservationInfo:
    name: str
    nodes: tuple[str, ...]
    state: str
    flags: frozenset[str]
    users: tuple[str, ...]


# --------------------------------------------------------------------------- scontrol -o


def parse_records(text: str) -> list[dict[str, str]]:
    """Parse ``scontrol show X -o``: one record per line of ``Key=Value`` tokens.

    A token without ``=`` continues the previous value (values such as ``OS=`` or
    ``Reason=`` hold spaces).
    """
    records = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("No ") or "=" not in line:
            continue
        record: dict[str, str] = {}
        key = None
        for token in line.split(" "):
            name, sep, value = token.partition("=")
            if sep and name and " " not in name and (key is None or _looks_like_key(name)):
                key = name
                record[key] = value
            elif key is not None:
                record[key] += " " + token
        records.append({k: v.strip() for k, v in record.items()})
    return records


def _looks_like_key(name: str) -> bool:
    return name[0].isupper() or name[0] in "_"


def _nodes(text: str | None) -> tuple[str, ...]:
    if not text or text in ("(null)", "None"):
        return ()
    return tuple(expand(text))


def _optional(text: str | None) -> str | None:
    return None if text in (None, "", "(null)", "None") else text


def job_from_record(record: dict[str, str]) -> JobInfo:
    exit_code = record.get("ExitCode", "0:0").split(":")[0]
    return JobInfo(
        job_id=record["JobId"],
        name=record.get("JobName", ""),
        state=JobState.parse(record.get("JobState", "")),
        nodes=_nodes(record.get("NodeList")),
        batch_host=_optional(record.get("BatchHost")),
        reason=record.get("Reason", ""),
        exit_code=int(exit_code) if exit_code.isdigit() else -1,
        restarts=int(record.get("Restarts", "0") or 0),
    )


def parse_jobs(text: str) -> list[JobInfo]:
    return [job_from_record(r) for r in parse_records(text) if "JobId" in r]


def node_from_record(record: dict[str, str]) -> NodeInfo:
    base, *flags = record.get("State", "UNKNOWN").split("+")
    # 24.11 may append a trailing '*' to a non-responding state in short forms.
    return NodeInfo(
        name=record["NodeName"],
        state=NodeState.parse(base.rstrip("*~#!%$@^-")),
        flags=frozenset(f.upper() for f in flags),
        reason=_optional(record.get("Reason")) or "",
        address=record.get("NodeAddr", ""),
    )


def parse_nodes(text: str) -> list[NodeInfo]:
    return [node_from_record(r) for r in parse_records(text) if "NodeName" in r]


def parse_reservations(text: str) -> list[ReservationInfo]:
    out = []
    for r in parse_records(text):
        if "ReservationName" not in r:
            continue
        out.append(ReservationInfo(
            name=r["ReservationName"], nodes=_nodes(r.get("Nodes")),
            state=r.get("State", ""),
            flags=frozenset(f for f in r.get("Flags", "").split(",") if f),
            users=tuple(u for u in r.get("Users", "").split(",") if u and u != "(null)")))
    return out


def parse_steps(text: str) -> list[StepInfo]:
    """Parse ``squeue --steps --format=%i|%N|%M|%j`` (see ``commands.STEP_FORMAT``)."""
    steps = []
    for line in text.splitlines():
        if not line.strip():
            continue
        step_id, nodes, elapsed, name = line.split("|", 3)
        job_id, _, step = step_id.strip().partition(".")
        steps.append(StepInfo(StepRef(job_id, step), name.strip(), _nodes(nodes.strip()),
                              elapsed.strip()))
    return steps


# --------------------------------------------------------------------------- JSON


def _number(value: Any) -> Any:
    """24.11 wraps numbers as ``{"set": bool, "infinite": bool, "number": n}``."""
    if isinstance(value, dict) and "number" in value:
        return value["number"] if value.get("set", True) else None
    return value


def _state_words(value: Any) -> list[str]:
    if isinstance(value, list):
        return [str(v).upper() for v in value]
    return [str(value).upper()] if value else []


def parse_squeue_json(text: str) -> list[JobInfo]:
    jobs = []
    for raw in json.loads(text).get("jobs", []):
        states = _state_words(raw.get("job_state"))
        exit_code = _number(raw.get("exit_code"))
        if isinstance(exit_code, dict):  # 24.11: {"status": [...], "return_code": {...}}
            exit_code = _number(exit_code.get("return_code"))
        jobs.append(JobInfo(
            job_id=str(_number(raw["job_id"])),
            name=raw.get("name", ""),
            state=JobState.parse(states[0] if states else ""),
            nodes=_nodes(raw.get("nodes")),
            batch_host=raw.get("batch_host") or None,
            reason=raw.get("state_reason", ""),
            exit_code=int(exit_code or 0),
            restarts=int(_number(raw.get("restart_cnt")) or 0),
        ))
    return jobs


def parse_sinfo_json(text: str) -> list[NodeInfo]:
    data = json.loads(text)
    nodes: dict[str, NodeInfo] = {}
    for raw in data.get("nodes", []):  # 22.05: one entry per node
        words = _state_words(raw.get("state")) + _state_words(raw.get("state_flags"))
        nodes[raw["name"]] = _node_from_words(raw["name"], words, _reason(raw.get("reason")),
                                              raw.get("address", ""))
    for raw in data.get("sinfo", []):  # 23.02+: one entry per node group and partition
        words = _state_words(raw.get("node", {}).get("state"))
        group = raw.get("nodes", {})
        addresses = group.get("addresses") or []
        for index, name in enumerate(group.get("nodes", [])):
            address = addresses[index] if index < len(addresses) else ""
            nodes[name] = _node_from_words(name, words, _reason(raw.get("reason")), address)
    return list(nodes.values())


def _reason(value: Any) -> str:
    """22.05: the text; 24.11+: ``{"description": text, "time": t, ...}``."""
    if isinstance(value, dict):
        return str(value.get("description") or "")
    return str(value or "")


def _node_from_words(name: str, words: list[str], reason: str, address: str) -> NodeInfo:
    base = next((w for w in words if NodeState.parse(w) is not NodeState.UNKNOWN), "UNKNOWN")
    return NodeInfo(name=name, state=NodeState.parse(base),
                    flags=frozenset(w for w in words if w != base), reason=reason or "",
                    address=address or "")


_GRANTED = re.compile(r"Granted job allocation (\d+)")
_PENDING = re.compile(r"Pending job allocation (\d+)")


def parse_granted_job(text: str) -> str | None:
    """The job id salloc reports (on stderr), or None."""
    found = _GRANTED.search(text)
    return found.group(1) if found else None


def parse_pending_job(text: str) -> str | None:
    """The job id salloc reports while its request waits in the queue, or None."""
    found = _PENDING.search(text)
    return found.group(1) if found else None


def parse_config(text: str) -> dict[str, str]:
    """``scontrol show config``: ``Name = value`` lines."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        name, sep, value = line.partition("=")
        if sep and name.strip() and " " not in name.strip():
            found[name.strip()] = value.strip()
    return found
