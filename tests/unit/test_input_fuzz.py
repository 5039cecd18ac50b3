"""Property tests of every text input: config files, ``--set``, ``FTL_*`` and hostlists.

Whatever comes in, only the project's own error escapes (``ConfigError``,
``HostlistError``), and whatever is accepted saves as valid TOML that loads back
equal. Bounded (300 examples each) so the suite stays fast.
"""

import dataclasses
import enum
import math
import re
import tomllib
import typing

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ft_launch.config import SECTIONS, Config, field_bounds, load_config, save_config, to_toml
from ft_launch.errors import ConfigError
from ft_launch.slurm.hostlist import MAX_HOSTS, MAX_NAME_CHARS, HostlistError, compress, expand

FUZZ = settings(max_examples=300, deadline=None, database=None,  # no example files in the tree
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
HINTS = {name: typing.get_type_hints(section) for name, section in SECTIONS.items()}
HOST_NAME = re.compile(r"[A-Za-z0-9._-]{1,%d}" % MAX_NAME_CHARS)
CLEAN_TEXT = st.text(st.characters(exclude_categories=("Cc", "Cs")), max_size=40)

# --------------------------------------------------------------------------- values


def in_range(section, key):
    """Values a field accepts on its own (cross-field rules may still refuse them)."""
    hint, bounds = HINTS[section][key], field_bounds(SECTIONS[section], key)
    if hint is int:
        return st.integers(int(bounds.low), int(bounds.high))
    if hint is float:
        return st.floats(bounds.low, bounds.high, exclude_min=bounds.open_low,
                         allow_nan=False, allow_infinity=False)
    if hint is bool:
        return st.booleans()
    if hint is str:
        return CLEAN_TEXT
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return st.sampled_from([m.value for m in hint])
    return st.lists(CLEAN_TEXT, max_size=4)


JUNK = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                max_size=3),
    max_leaves=8)


@st.composite
def raw_config(draw):
    """{section: {key: value}}: half the time only real keys with in-range values (so
    that accepted configs are common), else a mix with junk keys and junk values."""
    clean = draw(st.booleans())
    raw = {}
    for _ in range(draw(st.integers(0, 4))):
        real_section = st.sampled_from(list(SECTIONS))
        section = draw(real_section if clean else real_section | st.text(max_size=8))
        real_key = st.sampled_from(list(HINTS.get(section, {})) or ["x"])
        table = raw.setdefault(section, {})
        for _ in range(draw(st.integers(0, 4))):
            key = draw(real_key if clean else real_key | st.text(max_size=8))
            if section in SECTIONS and key in HINTS[section]:
                value = in_range(section, key) if clean else in_range(section, key) | JUNK
            else:
                value = JUNK
            table[key] = draw(value)
    return raw


def toml_value(value):
    if value is None:
        return '""'  # TOML has no null; a string stands in
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else repr(value)  # repr: inf, -inf, 1e+16: TOML
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{toml_string(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


def toml_string(text):
    """A TOML basic string written independently of the loader's saver."""
    return '"' + "".join(c if c.isprintable() and c not in '"\\' else f"\\u{ord(c):04x}"
                         if ord(c) < 0x10000 else f"\\U{ord(c):08x}" for c in text) + '"'


def toml_document(raw):
    lines = []
    for section, table in raw.items():
        lines.append(f"[{toml_string(section)}]")
        lines += [f"{toml_string(key)} = {toml_value(value)}" for key, value in table.items()]
    return "\n".join(lines) + "\n"


def set_text(value):
    """How a user would type ``value`` after ``--set key=``: strings as they are."""
    return value if isinstance(value, str) else toml_value(value)


def assert_round_trips(config, directory):
    text = to_toml(config)
    tomllib.loads(text)  # valid TOML whatever the values
    assert load_config(save_config(config, directory), env={}) == config


# --------------------------------------------------------------------------- config


@FUZZ
@given(raw=raw_config())
def test_toml_files_load_or_raise_config_error_and_round_trip(raw, tmp_path_factory):
    directory = tmp_path_factory.mktemp("fuzz")
    path = directory / "c.toml"
    path.write_text(toml_document(raw), encoding="utf-8")
    try:
        config = load_config(path, env={})
    except ConfigError:
        return
    assert_round_trips(config, directory / "saved")


@FUZZ
@given(data=st.binary(max_size=300))
@example(data=b"\xff\xfe[job]")
@example(data=b"[slurm]\nsrun_extra_args = " + b"[" * 3000)
@example(data=b"[job]\nreplicas = " + b"9" * 5000)
@example(data=b"[recovery]\nlost_timeout = nan")
def test_arbitrary_bytes_as_a_config_file_raise_only_config_error(data, tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "c.toml"
    path.write_bytes(data)
    try:
        load_config(path, env={})
    except ConfigError:
        pass


@FUZZ
@given(raw=raw_config(), through_env=st.booleans())
def test_set_and_environment_values_load_or_raise_config_error(raw, through_env,
                                                                tmp_path_factory):
    items = {f"{section}.{key}": set_text(value) for section, table in raw.items()
             if isinstance(section, str) for key, value in table.items()}
    try:
        if through_env:
            env = {f"FTL_{k.replace('.', '_').upper()}": v.replace("\0", "") for k, v in
                   items.items()}
            config = load_config(env=env)
        else:
            config = load_config(env={}, overrides=[f"{k}={v}" for k, v in items.items()])
    except ConfigError:
        return
    assert_round_trips(config, tmp_path_factory.mktemp("fuzz"))


@FUZZ
@given(item=st.text(max_size=60))
@example(item="job.replicas=" + "[" * 2000)
@example(item="recovery.lost_timeout=nan")
@example(item="ftar.sockets_per_peer=65536")
@example(item="ckpt.dir=a\x00b")
def test_arbitrary_set_items_raise_only_config_error(item):
    try:
        config = load_config(env={}, overrides=[item])
    except ConfigError:
        return
    tomllib.loads(to_toml(config))


#: Narrower draws where a cross-field rule would refuse most in-range values.
MOSTLY_ACCEPTED = {("job", "replicas"): st.integers(1, 300),
                   ("job", "nodes_per_replica"): st.integers(1, 300),
                   ("job", "standby"): st.integers(0, 10_000),
                   ("health", "backend"): st.sampled_from(["auto", "nvml", "simulated", "none"]),
                   ("ckpt", "dir"): CLEAN_TEXT.filter(bool),
                   ("run", "log_dir"): CLEAN_TEXT.filter(bool)}


@st.composite
def in_range_config(draw):
    sections = {}
    for name, section in SECTIONS.items():
        values = {}
        for item in dataclasses.fields(section):
            key = (name, item.name)
            value = draw(MOSTLY_ACCEPTED[key] if key in MOSTLY_ACCEPTED else in_range(*key))
            hint = HINTS[name][item.name]
            if isinstance(hint, type) and issubclass(hint, enum.Enum):
                value = hint(value)
            values[item.name] = tuple(value) if isinstance(value, list) else value
        sections[name] = section(**values)
    return Config(**sections)


@FUZZ
@given(config=in_range_config())
def test_the_saver_writes_valid_toml_for_every_accepted_value(config, tmp_path_factory):
    """Any in-range config saves and loads back equal, or the saver refuses it as the
    loader would (a cross-field rule such as election_timeout > heartbeat_interval)."""
    refused = any(list(getattr(config, f.name).problems()) for f in dataclasses.fields(config))
    try:
        assert_round_trips(config, tmp_path_factory.mktemp("fuzz"))
    except ConfigError:
        assert refused
    else:
        assert not refused


# --------------------------------------------------------------------------- hostlists

HOSTLIST_TOKENS = st.sampled_from(list("n01239[]-,._x$ é٣\x00") + ["[0-99999]", "[1-3,5]"])


@FUZZ
@given(expression=st.text(max_size=40) | st.lists(HOSTLIST_TOKENS, max_size=20).map("".join))
@example(expression="n[0-99999999]")
@example(expression="n[1-" + "9" * 5000 + "]")
@example(expression="a[1-999]b[1-999]")
def test_hostlists_expand_to_valid_names_or_raise_hostlist_error(expression):
    try:
        names = expand(expression)
    except HostlistError:
        return
    assert len(names) <= MAX_HOSTS
    assert all(HOST_NAME.fullmatch(name) for name in names)


@FUZZ
@given(names=st.lists(st.from_regex(r"[A-Za-z._-]{0,6}[0-9]{0,4}", fullmatch=True)
                      .filter(bool), max_size=30))
def test_compressed_hostlists_expand_back_to_the_same_names(names):
    assert sorted(set(expand(compress(names)))) == sorted(set(names))
