"""Structured events: past-tense dataclasses written as JSON lines.

Events are facts for machines (the status view, the summary, tests); human logs
go through ``logging`` and never share a file with them.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

_REGISTRY: dict[str, type[Event]] = {}


@dataclass(frozen=True)
class Event:
    """Base of every event; ``time`` is wall-clock seconds since the epoch."""

    time: float = field(default_factory=time.time, kw_only=True)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _REGISTRY[cls.__name__] = cls

    def to_json(self) -> str:
        record = {"event": type(self).__name__}
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            record[item.name] = value.value if isinstance(value, enum.Enum) else value
        return json.dumps(record, sort_keys=True, default=list)


def event_from_json(line: str) -> Event:
    """Parse one line written by ``Event.to_json`` back into its dataclass."""
    record = json.loads(line)
    cls = _REGISTRY.get(record.pop("event", ""))
    if cls is None:
        raise ValueError(f"unknown event in line: {line.strip()[:200]}")
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in record.items() if k in names})


class EventLog:
    """Append-only JSON-lines file; thread safe; each line flushed when written."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._handle: IO[str] = self.path.open("a", encoding="utf-8")

    def emit(self, event: Event) -> None:
        line = event.to_json() + "\n"
        with self._lock:
            self._handle.write(line)
            self._handle.flush()

    def close(self) -> None:
        with self._lock:
            self._handle.close()

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_events(path: str | os.PathLike[str]) -> Iterator[Event]:
    """Events of a log in order; a torn last line (writer crashed) is skipped."""
    with Path(path).open(encoding="utf-8") as handle:
        for line in handle:
            if not line.endswith("\n"):
                return
            yield event_from_json(line)


# --------------------------------------------------------------------------- shared events


@dataclass(frozen=True)
class RunStarted(Event):
    job_id: str
    replicas: int
    nodes: list[str]


@dataclass(frozen=True)
class StepEnded(Event):
    job_id: str
    replica_id: int
    step_id: str
    exit_code: int


@dataclass(frozen=True)
class NodeDrained(Event):
    node: str
    reason: str
