"""The one loader of the one typed configuration tree.

Sources, later ones winning: dataclass defaults -> a TOML file (the path given,
else ``$FTL_CONFIG``) -> ``FTL_*`` environment variables (read here and nowhere
else) -> ``--set section.key=value`` overrides from the command line.

Environment variables are ``FTL_<SECTION>_<KEY>`` in upper case, e.g.
``FTL_QUORUM_JOIN_TIMEOUT=3``; ``FTL_CONFIG`` names the file. Values given as
strings (environment, ``--set``) are read as TOML literals (``3``, ``true``,
``["a", "b"]``) except for string fields, which take the text as it is. The
named tables (``[checks.disk]``) are set in the file or with ``--set
checks.disk.paths=[...]``.

Unknown sections or keys, wrong types and impossible values raise
``ConfigError`` naming the source, the key, the value and what was expected.
Durations are seconds, named ``*_timeout`` / ``*_interval``.

A program running as root (the Slurm hooks) passes ``trusted_only=True``: it
reads only a file that root owns and no one else may write (whoever named the
path), and takes no ``FTL_<SECTION>_<KEY>`` values: what a root hook does is in
root's file alone.
"""

from __future__ import annotations

import enum
import os
import stat
import tomllib
import typing
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from ..env import ENV_CONFIG, ENV_PREFIX, WORKER_PREFIX
from ..errors import ConfigError
from ..files import atomic_write_text
from .fields import MiB, _describe, _name, _shown
from .health import Tables
from .sections import SECTIONS, TABLE_SECTIONS, Config

#: A config file is a few KiB; reading stops here (``--config /dev/zero``).
MAX_FILE_BYTES = 1 * MiB


# --------------------------------------------------------------------------- loading


def config_file(env: Mapping[str, str]) -> Path | None:
    """The file ``$FTL_CONFIG`` names, if any."""
    named = env.get(ENV_CONFIG, "")
    return Path(named) if named else None


def load_config(path: str | os.PathLike[str] | None = None, *,
                env: Mapping[str, str] | None = None,
                overrides: Iterable[str] = (), trusted_only: bool = False) -> Config:
    """Resolve the configuration from every source (see module docstring)."""
    env = os.environ if env is None else env
    config = Config()
    file = Path(path) if path is not None else config_file(env)
    if file is not None:
        config = parse_config(_read_toml(file, trusted_only), _name(str(file)))
    env_values = {} if trusted_only else _env_values(env)
    if env_values:
        config = _apply(config, env_values, "environment", from_text=True)
    for item in overrides:
        config = _apply(config, _parse_override(item), "--set", from_text=True)
    return config


def parse_config(raw: Mapping[str, Any], source: str) -> Config:
    """The config a TOML document already read (``tomllib``) describes, over the
    defaults; ``source`` names it in errors."""
    return _apply(Config(), raw, source, from_text=False)


def _read_toml(path: Path, trusted_only: bool = False) -> dict[str, Any]:
    source = _name(str(path))
    try:
        with path.open("rb") as handle:
            if trusted_only:
                _check_trusted(os.fstat(handle.fileno()), source)
            data = handle.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError("file not found", source=source,
                          hint=f"check the --config path or ${ENV_CONFIG}") from None
    except IsADirectoryError:
        raise ConfigError("is a directory, not a TOML file", source=source,
                          hint=f"check the --config path or ${ENV_CONFIG}") from None
    except (OSError, ValueError) as exc:  # no permission, a NUL in the name, ...
        raise ConfigError(f"cannot read the file: {exc}", source=source) from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"larger than {MAX_FILE_BYTES} bytes, too large for a config file",
                          source=source)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
                          f"{exc.start})", source=source, hint="TOML files are UTF-8") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"not valid TOML: {exc}", source=source) from None
    except RecursionError:
        raise ConfigError("not valid TOML: arrays or tables nested too deeply",
                          source=source) from None
    except ValueError as exc:  # an integer of more than 4,300 digits
        raise ConfigError(f"not valid TOML: {str(exc).split(':')[0]}", source=source) from None


def _check_trusted(info: os.stat_result, source: str) -> None:
    """Refuse a file another user could have written (checked on the open file, so a
    path swapped after the check changes nothing)."""
    if info.st_uid != 0 or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(f"not a file only root can write (owner uid {info.st_uid}, mode "
                          f"{stat.filemode(info.st_mode)})", source=source,
                          hint="a program running as root reads only root's config: "
                               "chown root and chmod go-w it")


def _env_values(env: Mapping[str, str]) -> dict[str, dict[str, str]]:
    values: dict[str, dict[str, str]] = {}
    for name, text in env.items():
        if not name.startswith(ENV_PREFIX) or name == ENV_CONFIG \
                or name.startswith(WORKER_PREFIX):       # set by ft-launch, not config
            continue
        rest = name[len(ENV_PREFIX):].lower()
        section, _, key = rest.partition("_")
        if section in TABLE_SECTIONS:
            raise ConfigError(f"{_name(name)}: [{section}.NAME] tables are not set from the "
                              f"environment", source="environment",
                              hint=f"set them in the config file or with --set "
                                   f"{section}.NAME.KEY=VALUE")
        if section not in SECTIONS or not key:
            raise ConfigError(
                f"unknown variable {_name(name)}",
                source="environment",
                hint=f"expected {ENV_CONFIG} or {ENV_PREFIX}<SECTION>_<KEY> with SECTION "
                     f"one of {', '.join(s.upper() for s in SECTIONS)}")
        values.setdefault(section, {})[key] = text
    return values


def _parse_override(item: str) -> dict[str, dict[str, str]]:
    dotted, sep, text = item.partition("=")
    section, dot, key = dotted.strip().partition(".")
    if not sep or not dot or not key:
        raise ConfigError(f"expected section.key=value, got {_shown(item)}", source="--set")
    return {section: {key: text.strip()}}


def _apply(config: Config, raw: Mapping[str, Any], source: str, *, from_text: bool) -> Config:
    updates: dict[str, Any] = {}
    for section_name, values in raw.items():
        if section_name not in SECTIONS and section_name not in TABLE_SECTIONS:
            raise ConfigError(f"unknown section [{_name(section_name)}]", source=source,
                              hint=f"valid sections: {', '.join((*SECTIONS, *TABLE_SECTIONS))}")
        if not isinstance(values, Mapping):
            raise ConfigError(f"[{section_name}] must be a table of keys, got "
                              f"{_shown(values)}", source=source)
        current = getattr(config, section_name)
        apply = _apply_tables if section_name in TABLE_SECTIONS else apply_table
        updates[section_name] = apply(current, section_name, values, source, from_text)
    return replace(config, **updates)


def _apply_tables(current: Tables, section_name: str, values: Mapping[str, Any],
                  source: str, from_text: bool) -> Tables:
    """``[checks.disk]`` tables from a file; ``checks.disk.paths=...`` from ``--set``."""
    for name, table in values.items():
        if from_text:  # "disk.paths" = "[...]"
            name, dot, key = name.partition(".")
            if not dot or not key:
                raise ConfigError(f"expected {section_name}.NAME.KEY=VALUE, got "
                                  f"{_shown(f'{section_name}.{name}')}", source=source)
            table = {key: _toml_literal(table)}
        if not isinstance(table, Mapping):
            raise ConfigError(f"must be a table [{section_name}.{_name(name)}], got "
                              f"{_shown(table)}", source=source, key=f"{section_name}.{name}")
        current = current.updated(name, table, source)
    for key, problem in current.problems():
        raise ConfigError(problem, source=source, key=_name(f"{section_name}.{key}"))
    return current


def apply_table(current: Any, section_name: str, values: Mapping[str, Any],
                source: str, from_text: bool = False) -> Any:
    """``current`` (a frozen dataclass) with ``values`` from ``source`` applied: unknown
    keys, wrong types and what its ``problems()`` finds are ``ConfigError``s naming
    ``source`` and ``section_name.key``. Sections use it, and so does ``ft_launch.health.settings``
    for the named tables it types (``[checks.disk]``)."""
    hints = typing.get_type_hints(type(current))
    valid = [f.name for f in fields(current)]
    changes: dict[str, Any] = {}
    for key, value in values.items():
        dotted = f"{section_name}.{key}"
        if key not in hints:
            raise ConfigError("unknown key", source=source, key=_name(dotted),
                              hint=f"valid keys in [{section_name}]: {', '.join(valid)}")
        changes[key] = _coerce(value, hints[key], source, dotted, from_text)
    section = replace(current, **changes)
    for key, problem in getattr(section, "problems", lambda: ())():
        raise ConfigError(f"{problem} (got {_shown(getattr(section, key))})", source=source,
                          key=f"{section_name}.{key}")
    return section


def _coerce(value: Any, target: Any, source: str, key: str, from_text: bool) -> Any:
    if from_text and isinstance(value, str) and target is not str:
        value = _toml_literal(value)
    origin = typing.get_origin(target)
    expected = _describe(target)
    if origin is tuple:
        (item_type, _ellipsis) = typing.get_args(target)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"expected {expected}, got {_shown(value)}", source=source,
                              key=key)
        return tuple(_coerce(v, item_type, source, key, False) for v in value)
    if origin is dict:
        (key_type, item_type) = typing.get_args(target)
        if not isinstance(value, Mapping) or not all(isinstance(k, key_type) for k in value):
            raise ConfigError(f"expected {expected}, got {_shown(value)}", source=source,
                              key=key)
        return {k: _coerce(v, item_type, source, f"{key}.{k}", False) for k, v in value.items()}
    if isinstance(target, type) and issubclass(target, enum.Enum):
        try:
            return target(value)
        except (ValueError, TypeError):
            raise ConfigError(f"expected {expected}, got {_shown(value)}", source=source,
                              key=key) from None
    if target is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            raise ConfigError(f"expected a finite number, got {_shown(value)}",
                              source=source, key=key) from None
    if type(value) is not target:
        raise ConfigError(f"expected {expected}, got {_shown(value)}", source=source, key=key)
    return value


def _toml_literal(text: str) -> Any:
    """``text`` read as one TOML value; else ``text`` itself (the type check reports it)."""
    try:
        parsed = tomllib.loads(f"v = {text}")
    except (ValueError, RecursionError):  # bad TOML, 4,300+ digits, 2,000 nested '['
        return text
    return parsed["v"] if parsed.keys() == {"v"} else text  # "1\nx = 2" is not one value


# --------------------------------------------------------------------------- saving


def to_toml(config: Config) -> str:
    """Render the resolved config as TOML that ``load_config`` reads back equal.

    Refuses (``ConfigError``) a config that ``load_config`` would refuse, e.g. one
    built in code with NaN or a control character."""
    lines: list[str] = []
    for section_field in fields(config):
        section = getattr(config, section_field.name)
        if isinstance(section, Tables):
            lines += _tables_toml(section_field.name, section)
            continue
        for key, problem in section.problems():
            raise ConfigError(f"{problem} (got {_shown(getattr(section, key))})",
                              source="the config to save", key=f"{section_field.name}.{key}")
        lines.append(f"[{section_field.name}]")
        for item in fields(section):
            lines.append(f"{item.name} = {_toml_value(getattr(section, item.name))}")
        lines.append("")
    return "\n".join(lines)


def _tables_toml(section_name: str, tables: Tables) -> list[str]:
    for key, problem in tables.problems():
        raise ConfigError(problem, source="the config to save", key=f"{section_name}.{key}")
    lines: list[str] = []
    for name in tables:
        lines.append(f"[{section_name}.{_toml_key(name)}]")
        lines += [f"{_toml_key(key)} = {_toml_value(value)}"
                  for key, value in tables.get(name).items()]
        lines.append("")
    return lines


def _toml_key(key: str) -> str:
    """A bare key where TOML allows one (``min_free_bytes``), else a quoted one."""
    return key if key and all(c.isascii() and (c.isalnum() or c in "_-") for c in key) \
        else _toml_value(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + "".join(_toml_char(c) for c in value) + '"'
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}"
                               for k, v in value.items()) + "}"
    raise TypeError(f"cannot render {value!r} as TOML")


_TOML_ESCAPES = {"\\": "\\\\", '"': '\\"', "\b": "\\b", "\t": "\\t", "\n": "\\n",
                 "\f": "\\f", "\r": "\\r"}


def _toml_char(char: str) -> str:
    """One character inside a TOML basic string: escaped where TOML requires it."""
    if char in _TOML_ESCAPES:
        return _TOML_ESCAPES[char]
    return f"\\u{ord(char):04x}" if unicodedata.category(char) == "Cc" else char


def save_config(config: Config, directory: str | os.PathLike[str]) -> Path:
    """Write the resolved config atomically as ``DIR/config.toml``."""
    return atomic_write_text(Path(directory) / "config.toml", to_toml(config))

