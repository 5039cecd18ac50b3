"""Collectives among the ranks of one replica (the intra-replica side of the
protocol: quorum broadcast, endpoint exchange, commit vote)."""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class ReplicaGroup(Protocol):
    def broadcast(self, value: T | None) -> T: ...          # rank 0's value to every rank
    def all_gather(self, value: T) -> list[T]: ...         # in rank order
    def all_true(self, flag: bool) -> bool: ...            # the commit vote


class SoloGroup:
    """A replica of one rank: every collective is the identity."""

    def broadcast(self, value: Any) -> Any:
        if value is None:
            raise ValueError("rank 0 must supply the value it broadcasts")
        return value

    def all_gather(self, value: Any) -> list[Any]:
        return [value]

    def all_true(self, flag: bool) -> bool:
        return flag
