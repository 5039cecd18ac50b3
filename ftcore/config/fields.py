"""What a config section is: typed fields with declared ranges, and the one check
(``_Section.problems``) that applies them, refuses NaN and infinities in every
float field and control characters in every string, so a config that loads
also saves as valid TOML and loads back equal."""

from __future__ import annotations

import enum
import math
import typing
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

MiB = 1 << 20
GiB = 1 << 30
#: The longest duration any setting takes: a week (keeps timevals and waits in range too).
MAX_SECONDS = 7 * 86400.0
#: Strings are paths, names and srun arguments: PATH_MAX is plenty.
MAX_STRING_CHARS = 4096
_BOUNDS = "ftl_bounds"


@dataclass(frozen=True)
class Bounds:
    """The range a number field accepts; ``open_low``: the low end itself is excluded."""

    low: float
    high: float
    open_low: bool = False
    seconds: bool = False

    def contains(self, value: float) -> bool:
        above = value > self.low if self.open_low else value >= self.low
        finite = not isinstance(value, float) or math.isfinite(value)  # isfinite(10**400) raises
        return finite and above and value <= self.high

    def describe(self) -> str:
        if self.seconds and self.open_low:
            return f"must be a positive, finite number of seconds, at most {self.high:g}"
        if self.seconds:
            return f"must be a finite number of seconds from {self.low:g} to {self.high:g}"
        return f"must be at least {self.low:g} and at most {self.high:g}"


def _count(default: int, low: int, high: int) -> Any:
    """An integer field accepting ``low..high``."""
    return field(default=default, metadata={_BOUNDS: Bounds(low, high)})


def _factor(default: float, low: float, high: float) -> Any:
    """A float field above ``low`` (excluded) and at most ``high``."""
    return field(default=default, metadata={_BOUNDS: Bounds(low, high, open_low=True)})


def _seconds(default: float, *, zero_ok: bool = False, high: float = MAX_SECONDS) -> Any:
    """A duration field: finite, positive (or 0 with ``zero_ok``), at most ``high``."""
    return field(default=default,
                 metadata={_BOUNDS: Bounds(0.0, high, open_low=not zero_ok, seconds=True)})


def field_bounds(section: Any, name: str) -> Bounds | None:
    """The declared range of a number field (``None`` for other fields)."""
    return next((f.metadata.get(_BOUNDS) for f in fields(section) if f.name == name), None)


def string_problem(text: str) -> str | None:
    """Why ``text`` cannot be a config string (too long, control characters), or None.

    TOML strings cannot hold raw control characters, and lone surrogates (from
    undecodable environment or argv bytes) cannot be written as UTF-8 at all."""
    if len(text) > MAX_STRING_CHARS:
        return f"must be at most {MAX_STRING_CHARS} characters"
    for char in text:
        category = unicodedata.category(char)
        if category == "Cc":
            return f"must not contain control characters (found U+{ord(char):04X})"
        if category == "Cs":
            return f"must be valid text (found U+{ord(char):04X}, from an undecodable byte)"
    return None


class _Section:
    """What every section checks: declared ranges, finite floats, clean strings.

    A section adds its cross-field checks in ``rules``; callers use ``problems``."""

    def problems(self) -> Iterable[tuple[str, str]]:
        hints = typing.get_type_hints(type(self))
        for item in fields(self):  # type: ignore[arg-type]
            problem = _field_problem(getattr(self, item.name), hints[item.name],
                                     item.metadata.get(_BOUNDS))
            if problem:
                yield item.name, problem
        yield from self.rules()

    def rules(self) -> Iterable[tuple[str, str]]:
        return ()


def _field_problem(value: Any, hint: Any, bounds: Bounds | None) -> str | None:
    if hint in (int, float):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or (
                hint is int and isinstance(value, float)):
            return f"must be {_describe(hint)}"
        if isinstance(value, float) and not math.isfinite(value):
            return "must be a finite number (not NaN or infinity)"
        return None if bounds is None or bounds.contains(value) else bounds.describe()
    if hint is str:
        return string_problem(value) if isinstance(value, str) else "must be a string"
    if typing.get_origin(hint) is tuple:
        if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
            return "must be a list of strings"
        return next((f"item {i} {p}" for i, v in enumerate(value)
                     if (p := string_problem(v))), None)
    return None


def _shown(value: Any, limit: int = 80) -> str:
    """``value``'s repr for a message, cut if long (a hostile value may be megabytes)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def _name(text: str) -> str:
    """A name or path the user typed, for a message: as is if plain, else escaped and cut."""
    if text.isprintable() and len(text) <= 200:
        return text
    escaped = repr(text)[1:-1]
    return escaped if len(escaped) <= 200 else f"{escaped[:200]}... ({len(text)} chars)"


def _describe(target: Any) -> str:
    if typing.get_origin(target) is tuple:
        return f"a list of {_describe(typing.get_args(target)[0]).removeprefix('a ')}s"
    if typing.get_origin(target) is dict:
        return f"a table of {_describe(typing.get_args(target)[1]).removeprefix('a ')}s"
    if isinstance(target, type) and issubclass(target, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in target)
    return {int: "an integer", float: "a number", bool: "true or false",
            str: "a string"}.get(target, str(target))
