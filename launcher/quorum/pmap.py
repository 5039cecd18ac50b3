"""A small persistent (immutable) mapping with cheap one-key updates.

The pure core threads a new state through every message, so a leader that
copied its 1,000-entry ``heard`` and ``joins`` mappings on each of a round's
1,000 joins did quadratic work per round. ``PMap`` keeps a shared ``base`` dict
and a small ``top`` dict of recent changes; an update copies only ``top``, and
``top`` is merged into a fresh ``base`` once it holds about ``sqrt(len)``
entries, so an update costs O(sqrt(n)) and a round O(n sqrt(n)) in the worst
case (a few microseconds per join at 1,000 members). Neither dict is ever
mutated after it is built, so old states stay valid.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")

_MIN_TOP = 8


class PMap(Mapping[K, V]):
    __slots__ = ("_base", "_len", "_top")

    _base: dict[K, V]
    _top: dict[K, V]
    _len: int

    def __init__(self, items: Mapping[K, V] | None = None) -> None:
        self._base = dict(items) if items else {}
        self._top = {}
        self._len = len(self._base)

    @classmethod
    def _of(cls, base: dict[K, V], top: dict[K, V], length: int) -> PMap[K, V]:
        new: PMap[K, V] = object.__new__(cls)
        new._base, new._top, new._len = base, top, length
        return new

    def set(self, key: K, value: V) -> PMap[K, V]:
        """A new map with ``key`` bound to ``value``; this one is unchanged."""
        top = self._top
        length = self._len if (key in top or key in self._base) else self._len + 1
        if len(top) >= max(_MIN_TOP, math.isqrt(len(self._base))):
            return PMap._of({**self._base, **top, key: value}, {}, length)
        return PMap._of(self._base, {**top, key: value}, length)

    def updated(self, items: Mapping[K, V]) -> PMap[K, V]:
        """A new map with every binding of ``items`` (a batch of updates: one
        merge instead of one ``set`` each); this one is unchanged."""
        if len(items) < _MIN_TOP:
            new = self
            for key, value in items.items():
                new = new.set(key, value)
            return new
        added = sum(1 for key in items if key not in self)
        return PMap._of({**self._base, **self._top, **items}, {}, self._len + added)

    def __getitem__(self, key: K) -> V:
        top = self._top
        if key in top:
            return top[key]
        return self._base[key]

    def get(self, key: K, default: V | None = None) -> V | None:  # type: ignore[override]
        top = self._top
        if key in top:
            return top[key]
        return self._base.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._top or key in self._base

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[K]:
        top = self._top
        if not top:
            return iter(self._base)
        return iter([k for k in self._base if k not in top] + list(top))

    def __repr__(self) -> str:
        return f"PMap({dict(self.items())!r})"


def with_items(mapping: Mapping[K, V], items: Mapping[K, V]) -> PMap[K, V]:
    """``{**mapping, **items}`` without copying a ``PMap`` more than once."""
    base = mapping if isinstance(mapping, PMap) else PMap(mapping)
    return base.updated(items) if items else base


def with_item(mapping: Mapping[K, V], key: K, value: V) -> PMap[K, V]:
    """``{**mapping, key: value}`` without copying a ``PMap`` whole."""
    base = mapping if isinstance(mapping, PMap) else PMap(mapping)
    return base.set(key, value)
