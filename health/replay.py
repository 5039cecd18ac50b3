"""Dual-phase replay (pure): where on an m x n grid of machines the failure lies.

ByteRobust's rule (Algorithm 1): m = k * PP rows, n = DP / k columns, k >= 1 and
m <= n. The machines of the job, ordered replica by replica (DP-major, PP stage
inside), fill the grid column by column, so each column holds k complete
pipelines of the original layout. Phase 1 reruns a reduced job (same TP and PP,
smaller DP) on every row, phase 2 on every column; a machine in a failing row
and a failing column is the faulty one. With one faulty machine (the usual
case of silent data corruption) exactly one row and one column fail.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ftcore.errors import UsageError


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
