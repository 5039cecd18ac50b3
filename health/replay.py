"""Dual-phase replay (pure): where on an m x n grid of machines the failure lies.

ByteRobust's rule (Algorithm 1): m = k * PP rows, n = DP / k columns, k >= 1 and
m <= n. The machines of the job, ordered replica by replica (DP-major, PP stage
inside), fill the grid column by column, so each column holds k complete
pipelines of the original layout. Phase 1 reruns a reduced job (same TP and PP,
smaller DP) on every row, phase 2 on every column; a machine in a failing row
and a failing column is the faulty one. With one faulty machine (the usual
case of silent data corruption) exactly one row and one column fail.

Whether a group failed is judged against a reference (``judge``): the groups of
healthy machines only, which must agree among themselves. A group fails when it
did not finish, held NaN/Inf, or computed other bits than the reference.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ft_launch.errors import UsageError


class ReplayStatus(enum.Enum):
    FOUND = "found"                  # one machine in the failing row and column
    NOT_REPRODUCED = "not_reproduced"
    AMBIGUOUS = "ambiguous"          # several candidates (or rows and columns disagree)


@dataclass(frozen=True)
class ReplayGrid:
    pp: int
    dp: int
    k: int
    cells: tuple[tuple[str, ...], ...]   # cells[row][column]

    @property
    def rows(self) -> tuple[tuple[str, ...], ...]:
        return self.cells

    @property
    def columns(self) -> tuple[tuple[str, ...], ...]:
        return tuple(zip(*self.cells))


@dataclass(frozen=True)
class ReplayVerdict:
    status: ReplayStatus
    suspects: tuple[str, ...]
    failed_rows: tuple[int, ...]
    failed_columns: tuple[int, ...]

    def describe(self) -> str:
        return (f"replay {self.status.value}: suspects {list(self.suspects)} (rows "
                f"{list(self.failed_rows)}, columns {list(self.failed_columns)} failed)")


def plan_replay_grid(nodes: Sequence[str], pp: int, dp: int, k: int = 1) -> ReplayGrid:
    """Arrange ``pp * dp`` machines on the m x n grid (see module docstring)."""
    if pp < 1 or dp < 1 or k < 1:
        raise UsageError(f"pp, dp and k must be at least 1 (got pp={pp}, dp={dp}, k={k})")
    if dp % k:
        raise UsageError(f"k={k} must divide DP={dp}", hint="choose k among the divisors of DP")
    m, n = k * pp, dp // k
    if m > n:
        raise UsageError(f"m = k*PP = {m} exceeds n = DP/k = {n}: the faulty machine would "
                         f"not be unique", hint="use a smaller k")
    if len(nodes) != m * n or len(set(nodes)) != len(nodes):
        raise UsageError(f"need {m * n} distinct machines (PP={pp} x DP={dp}), "
                         f"got {len(nodes)}")
    columns = [tuple(nodes[c * m:(c + 1) * m]) for c in range(n)]
    return ReplayGrid(pp, dp, k, tuple(zip(*columns)))


def feasible_ks(pp: int, dp: int) -> list[int]:
    """Every k the rule allows for this layout."""
    return [k for k in range(1, dp + 1) if dp % k == 0 and k * pp <= dp // k]


def locate(grid: ReplayGrid, failed_rows: Iterable[int],
           failed_columns: Iterable[int]) -> ReplayVerdict:
    rows, columns = tuple(sorted(set(failed_rows))), tuple(sorted(set(failed_columns)))
    if not rows and not columns:
        return ReplayVerdict(ReplayStatus.NOT_REPRODUCED, (), rows, columns)
    if rows and columns:
        suspects = tuple(grid.cells[r][c] for r in rows for c in columns)
    else:  # one phase failed and the other did not: suspect all it names
        suspects = tuple(sorted({n for r in rows for n in grid.rows[r]} |
                                {n for c in columns for n in grid.columns[c]}))
    status = ReplayStatus.FOUND if len(suspects) == 1 else ReplayStatus.AMBIGUOUS
    return ReplayVerdict(status, suspects, rows, columns)


@dataclass(frozen=True)
class GroupResult:
    """What one group of a replay computed: ``digest`` None when it did not finish or
    held NaN/Inf (``detail`` says which)."""

    label: str
    digest: str | None
    detail: str = ""


@dataclass(frozen=True)
class Judgement:
    verdict: ReplayVerdict | None       # None: no reference to judge by (``error``)
    reference: str | None
    failed: tuple[GroupResult, ...]     # the groups that failed, each with why
    error: str = ""


def judge(grid: ReplayGrid, rows: Sequence[GroupResult], columns: Sequence[GroupResult],
          reference_columns: Sequence[int]) -> Judgement:
    """Each group against the reference columns (healthy machines only), then
    ``locate``. References that failed or disagree judge nothing."""
    if len(rows) != len(grid.rows) or len(columns) != len(grid.columns):
        raise UsageError(f"{len(rows)} row and {len(columns)} column results for a "
                         f"{len(grid.rows)} x {len(grid.columns)} grid")
    references = [columns[c] for c in reference_columns]
    if not references:
        return Judgement(None, None, (), "no reference column of healthy machines")
    broken = tuple(r for r in references if r.digest is None)
    if broken:
        return Judgement(None, None, broken, "the reference group failed: " +
                         "; ".join(f"{r.label}: {r.detail}" for r in broken))
    if len({r.digest for r in references}) > 1:
        return Judgement(None, None, (), "the reference groups disagree: "
                         + ", ".join(f"{r.label} {r.digest}" for r in references))
    reference = references[0].digest
    failed_rows = [i for i, r in enumerate(rows) if r.digest != reference]
    failed_columns = [j for j, r in enumerate(columns) if r.digest != reference]
    failed = tuple(r for r in (*rows, *columns) if r.digest != reference)
    return Judgement(locate(grid, failed_rows, failed_columns), reference, failed)
