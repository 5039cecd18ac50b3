"""Slurm hostlist expressions: ``n[1-3,07],gpu[01-02]-ib`` <-> a list of names."""

from __future__ import annotations

import re
from collections.abc import Iterable

from ..errors import UsageError

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand(expression: str) -> list[str]:
    """Expand a hostlist expression into node names, in order, duplicates kept."""
    names: list[str] = []
    for item in _split_top_level(expression.strip()):
        names.extend(_expand_item(item, expression))
    return names


def _split_top_level(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for pos, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(text[start:pos])
            start = pos + 1
    items.append(text[start:])
    return [item for item in items if item]


def _expand_item(item: str, whole: str) -> list[str]:
    match = re.match(r"^([^\[\]]*)\[([^\[\]]+)\](.*)$", item)
    if not match:
        if "[" in item or "]" in item or not re.match(r"^[\w.\-]+$", item):
            raise _bad(whole, f"malformed name {item!r}")
        return [item]
    prefix, ranges, suffix = match.groups()
    names: list[str] = []
    for part in ranges.split(","):
        bounds = _RANGE.match(part.strip())
        if not bounds:
            raise _bad(whole, f"malformed range {part!r}")
        low_text, high_text = bounds.group(1), bounds.group(2) or bounds.group(1)
        low, high = int(low_text), int(high_text)
        if high < low:
            raise _bad(whole, f"range {part!r} goes backwards")
        width = len(low_text) if low_text.startswith("0") else 0
        for number in range(low, high + 1):
            for rest in _expand_item(suffix, whole) if suffix else [""]:
                names.append(f"{prefix}{number:0{width}d}{rest}")
    return names


def _bad(expression: str, problem: str) -> UsageError:
    return UsageError(f"bad hostlist {expression!r}: {problem}",
                      hint="write it like n[1-4,7] or node01,node02")


def compress(names: Iterable[str]) -> str:
    """Compress names into a hostlist expression (inverse of ``expand`` up to order)."""
    groups: dict[tuple[str, int], list[int]] = {}
    order: list[tuple[str, int] | str] = []
    for name in names:
        match = re.match(r"^(.*?)(\d+)$", name)
        if not match:
            order.append(name)
            continue
        prefix, digits = match.groups()
        width = len(digits) if digits.startswith("0") else 0
        key = (prefix, width)
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(int(digits))
    parts: list[str] = []
    for entry in order:
        if isinstance(entry, str):
            parts.append(entry)
            continue
        prefix, width = entry
        numbers = sorted(set(groups[entry]))
        if len(numbers) == 1:
            parts.append(f"{prefix}{numbers[0]:0{width}d}")
            continue
        parts.append(f"{prefix}[{','.join(_runs(numbers, width))}]")
    return ",".join(parts)


def _runs(numbers: list[int], width: int) -> list[str]:
    """Sorted distinct numbers -> ``["1-3", "7"]``."""
    runs: list[list[int]] = []
    for number in numbers:
        if runs and number == runs[-1][1] + 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    return [f"{lo:0{width}d}" if lo == hi else f"{lo:0{width}d}-{hi:0{width}d}"
            for lo, hi in runs]
