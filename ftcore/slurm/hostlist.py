"""Slurm hostlist expressions: ``n[1-3,07],gpu[01-02]-ib`` <-> a list of names.

An expression comes from the command line (``--nodelist``) or from Slurm's
environment, so the parser bounds what it builds: names use only the characters
Slurm allows in host names, a range bound has at most ``MAX_DIGITS`` digits,
and the expansion is counted before it is built and refused past ``MAX_HOSTS``
names (python-hostlist's limit). Every refusal is a ``HostlistError``.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Iterator

from ..errors import UsageError

#: The most names one expression may expand to (python-hostlist's cap).
MAX_HOSTS = 100_000
#: A host name is a DNS label chain: 255 characters at most.
MAX_NAME_CHARS = 255
#: Digits in one range bound (int64 holds 18); more is a typo or an attack.
MAX_DIGITS = 18

_NAME = re.compile(r"[A-Za-z0-9._-]+")
_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_GROUP = re.compile(r"\[([^\[\]]*)\]")


class HostlistError(UsageError):
    """A hostlist expression that is malformed or too large; names the input."""


def expand(expression: str) -> list[str]:
    """Expand a hostlist expression into node names, in order, duplicates kept."""
    items = [_parse_item(item, expression) for item in _split_top_level(expression.strip())]
    total = 0
    for segments in items:
        total += _count(segments)
        if total > MAX_HOSTS:
            raise _bad(expression, f"expands to more than {MAX_HOSTS} names")
    names: list[str] = []
    for segments in items:
        for name in _names(segments):
            if len(name) > MAX_NAME_CHARS:
                raise _bad(expression, f"name {_shown(name)} is longer than "
                                       f"{MAX_NAME_CHARS} characters")
            names.append(name)
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


#: One item, parsed: literal text and, for each ``[...]``, its (low, high, width) ranges.
Segment = str | list[tuple[int, int, int]]


def _parse_item(item: str, whole: str) -> list[Segment]:
    segments: list[Segment] = []
    pos = 0
    for group in _GROUP.finditer(item):
        segments.append(_literal(item[pos:group.start()], whole))
        segments.append([_parse_range(part, whole) for part in group.group(1).split(",")])
        pos = group.end()
    segments.append(_literal(item[pos:], whole))
    return segments


def _literal(text: str, whole: str) -> str:
    if "[" in text or "]" in text:
        raise _bad(whole, f"unbalanced or nested brackets in {_shown(text)}")
    if text and not _NAME.fullmatch(text):
        raise _bad(whole, f"malformed name part {_shown(text)}: host names use only "
                          "letters, digits, '-', '_' and '.'")
    return text


def _parse_range(part: str, whole: str) -> tuple[int, int, int]:
    bounds = _RANGE.fullmatch(part.strip())
    if not bounds:
        raise _bad(whole, f"malformed range {_shown(part)}: expected N or N-M with digits 0-9")
    low_text, high_text = bounds.group(1), bounds.group(2) or bounds.group(1)
    if max(len(low_text), len(high_text)) > MAX_DIGITS:
        raise _bad(whole, f"range {_shown(part)} has a bound of more than {MAX_DIGITS} digits")
    low, high = int(low_text), int(high_text)
    if high < low:
        raise _bad(whole, f"range {_shown(part)} goes backwards")
    width = len(low_text) if low_text.startswith("0") else 0
    return low, high, width


def _count(segments: list[Segment]) -> int:
    """How many names the item expands to, without building them."""
    count = 1
    for segment in segments:
        if isinstance(segment, list):
            count *= sum(high - low + 1 for low, high, _width in segment)
            if count > MAX_HOSTS:
                return count  # already too many; stop before the product gets huge
    return count


def _names(segments: list[Segment]) -> Iterator[str]:
    choices = [[segment] if isinstance(segment, str) else
               [f"{number:0{width}d}" for low, high, width in segment
                for number in range(low, high + 1)]
               for segment in segments]
    for parts in itertools.product(*choices):
        yield "".join(parts)


def _shown(text: str, limit: int = 60) -> str:
    """``text`` quoted for a message: escaped, and cut if long."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} chars)"


def _bad(expression: str, problem: str) -> HostlistError:
    return HostlistError(f"bad hostlist {_shown(expression)}: {problem}",
                         hint="write it like n[1-4,7] or node01,node02")


def compress(names: Iterable[str]) -> str:
    """Compress names into a hostlist expression (inverse of ``expand`` up to order)."""
    groups: dict[tuple[str, int], list[int]] = {}
    order: list[tuple[str, int] | str] = []
    for name in names:
        match = re.match(r"^(.*?)([0-9]+)$", name)
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
