"""What a check says about a node: a status, a short reason, and the evidence.

The reason of the first failing check becomes the Slurm drain reason
(``ft: gpu3 xid 79``), so it must be short and precise: the component, what is
wrong, the value that proved it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


class CheckStatus(enum.Enum):
    """Outcome of one check; ordered by severity."""

    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"

    @property
    def severity(self) -> int:
        return _SEVERITY[self]


_SEVERITY = {CheckStatus.PASS: 0, CheckStatus.WARN: 1, CheckStatus.FAIL: 2}


@dataclass(frozen=True)
class CheckResult:
    """One check's verdict. ``evidence`` holds the raw values (JSON-serialisable)."""

    name: str
    status: CheckStatus
    reason: str = ""
    evidence: Mapping[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.status is CheckStatus.FAIL

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status.value, "reason": self.reason,
                "evidence": dict(self.evidence)}

    @staticmethod
    def from_dict(raw: Mapping[str, Any]) -> CheckResult:
        return CheckResult(name=str(raw["name"]), status=CheckStatus(raw["status"]),
                           reason=str(raw.get("reason", "")),
                           evidence=dict(raw.get("evidence", {})))


def passed(name: str, reason: str = "ok", /, **evidence: Any) -> CheckResult:
    return CheckResult(name, CheckStatus.PASS, reason, evidence)


def warned(name: str, reason: str, /, **evidence: Any) -> CheckResult:
    return CheckResult(name, CheckStatus.WARN, reason, evidence)


def failed(name: str, reason: str, /, **evidence: Any) -> CheckResult:
    return CheckResult(name, CheckStatus.FAIL, reason, evidence)


def skipped(name: str, why: str) -> CheckResult:
    """A check that does not apply here (no GPU backend, no job): counts as a pass."""
    return CheckResult(name, CheckStatus.PASS, f"skipped: {why}", {"skipped": True})


def from_problems(name: str, problems: Iterable[str], status: CheckStatus = CheckStatus.FAIL,
                  /, **evidence: Any) -> CheckResult:
    """PASS when ``problems`` is empty, else ``status`` with the problems joined.

    Several problems are summarised as the first plus a count, so the drain
    reason stays one short line; all of them stay in the evidence.
    """
    found = list(problems)
    if not found:
        return passed(name, **evidence)
    reason = found[0] if len(found) == 1 else f"{found[0]} (+{len(found) - 1} more)"
    return CheckResult(name, status, reason, {**evidence, "problems": found})


def worst(results: Iterable[CheckResult]) -> CheckStatus:
    return max((r.status for r in results), key=lambda s: s.severity, default=CheckStatus.PASS)


def first_failure(results: Iterable[CheckResult]) -> CheckResult | None:
    return next((r for r in results if r.failed), None)


def format_bytes(value: float) -> str:
    """Compact binary size for reasons: ``512MiB``, ``1.5GiB``, ``0B``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            text = f"{value:.1f}".rstrip("0").rstrip(".") if unit != "B" else f"{int(value)}"
            return f"{text}{unit}"
        value /= 1024
    raise AssertionError("unreachable")
