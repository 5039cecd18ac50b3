"""Profiles: ordered checks with a time budget, run against one context.

A profile stops starting checks once its budget is spent (the rest are reported
as warnings, not silently dropped). A check that raises is a bug in the
checker, not proof that the node is broken: it is reported as a warning with
the exception, so one bad check cannot drain a whole cluster; hardware faults
are reported by the checks themselves as FAIL.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .context import CheckContext
from .result import CheckResult, CheckStatus, first_failure, warned, worst

log = logging.getLogger(__name__)

CheckFn = Callable[[CheckContext], CheckResult]


@dataclass(frozen=True)
class BoundCheck:
    """A catalog check with its parameters bound: ``run(ctx) -> CheckResult``."""

    name: str
    run: CheckFn


@dataclass(frozen=True)
class Profile:
    name: str
    checks: tuple[BoundCheck, ...]
    budget: float = 5.0
    #: Checks whose FAIL only warns here (e.g. load right after a heavy job).
    warn_only: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ProfileReport:
    profile: str
    node: str
    results: tuple[CheckResult, ...]
    started: float = field(default_factory=time.time)
    duration: float = 0.0

    @property
    def status(self) -> CheckStatus:
        return worst(self.results)

    @property
    def failure(self) -> CheckResult | None:
        return first_failure(self.results)

    def to_dict(self) -> dict[str, Any]:
        return {"profile": self.profile, "node": self.node, "status": self.status.value,
                "started": self.started, "duration": self.duration,
                "results": [r.to_dict() for r in self.results]}

    @staticmethod
    def from_dict(raw: Mapping[str, Any]) -> ProfileReport:
        return ProfileReport(profile=str(raw["profile"]), node=str(raw["node"]),
                             results=tuple(CheckResult.from_dict(r) for r in raw["results"]),
                             started=float(raw.get("started", 0.0)),
                             duration=float(raw.get("duration", 0.0)))


def run_profile(profile: Profile, ctx: CheckContext,
                clock: Callable[[], float] = time.monotonic) -> ProfileReport:
    start, wall = clock(), time.time()
    results: list[CheckResult] = []
    for check in profile.checks:
        spent = clock() - start
        if spent > profile.budget:
            results.append(warned(check.name, f"not run: {profile.name} budget "
                                              f"{profile.budget:g}s spent"))
            continue
        result = _run_one(check, ctx)
        if result.failed and check.name in profile.warn_only:
            result = CheckResult(result.name, CheckStatus.WARN, result.reason, result.evidence)
        results.append(result)
    return ProfileReport(profile.name, ctx.node, tuple(results), wall, clock() - start)


def _run_one(check: BoundCheck, ctx: CheckContext) -> CheckResult:
    try:
        return check.run(ctx)
    except Exception as exc:  # a bug in one check must not stop the others (see above)
        log.exception("check %s crashed on %s", check.name, ctx.node)
        return warned(check.name, f"check error: {type(exc).__name__}: {exc}"[:120])
