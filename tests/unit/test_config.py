import dataclasses
import math
import typing
from pathlib import Path

import pytest

from ft_launch.config import (
    MAX_FILE_BYTES,
    SECTIONS,
    Config,
    FtarConfig,
    LrScaling,
    RecoveryConfig,
    field_bounds,
    load_config,
    save_config,
    to_toml,
)
from ft_launch.errors import ConfigError, ExitCode

REPO = Path(__file__).resolve().parents[2]


def test_defaults_are_valid():
    config = load_config(env={})
    assert config == Config()
    for section in dataclasses.fields(config):
        assert list(getattr(config, section.name).problems()) == []


def test_sources_apply_in_order(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[job]\nreplicas = 3\nstandby = 1\n[quorum]\njoin_timeout = 5\n")
    config = load_config(path, env={"FTL_JOB_REPLICAS": "4", "FTL_RUNTIME_LR_SCALING": "linear"},
                         overrides=["job.replicas=5"])
    assert config.job.replicas == 5          # CLI beats env beats file
    assert config.job.standby == 1           # file beats default
    assert config.quorum.join_timeout == 5.0  # int accepted for a float field
    assert config.runtime.lr_scaling is LrScaling.LINEAR


def test_unknown_key_lists_valid_ones(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[job]\nreplica = 3\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    message = str(info.value)
    assert str(path) in message and "job.replica" in message
    assert "replicas" in message and "nodes_per_replica" in message


def test_unknown_section_and_env_variable():
    with pytest.raises(ConfigError, match="unknown section"):
        load_config(env={}, overrides=["jobs.replicas=2"])
    with pytest.raises(ConfigError, match="FTL_BOGUS_X"):
        load_config(env={"FTL_BOGUS_X": "1"})


@pytest.mark.parametrize("override, expected", [
    ("job.replicas=two", "expected an integer"),
    ("job.replicas=0", "at least 1"),
    ("quorum.heartbeat_interval=-1", "positive"),
    ("runtime.lr_scaling=cubic", "one of 'none', 'linear', 'sqrt'"),
    ("ckpt.durable=maybe", "true or false"),
    ("job.standby_mode=reservation", "must name a reservation"),
])
def test_bad_values_say_what_was_expected(override, expected):
    with pytest.raises(ConfigError, match=expected) as info:
        load_config(env={}, overrides=[override])
    assert info.value.exit_code is ExitCode.FATAL_NO_REQUEUE


def test_bad_toml_and_missing_file(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[job\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(path, env={})
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "nope.toml", env={})


def test_string_field_keeps_text_and_lists_parse():
    config = load_config(env={"FTL_CKPT_DIR": "123"},
                         overrides=['slurm.srun_extra_args=["--mpi=none", "-v"]'])
    assert config.ckpt.dir == "123"
    assert config.slurm.srun_extra_args == ("--mpi=none", "-v")


def test_saved_config_reads_back(tmp_path):
    config = load_config(env={}, overrides=["job.replicas=7", "ckpt.dir=a \"quoted\" dir"])
    path = save_config(config, tmp_path / "run")
    assert load_config(path, env={}) == config
    assert to_toml(config) == path.read_text()


def test_every_example_config_loads():
    examples = sorted((REPO / "etc").rglob("*.toml"))
    assert examples, "etc/ must hold at least one example config"
    for example in examples:
        load_config(example, env={})


def fields_of_type(*types):
    """(section, key) of every config field whose annotation is one of ``types``."""
    return [(name, item.name) for name, section in SECTIONS.items()
            for item in dataclasses.fields(section)
            if typing.get_type_hints(section)[item.name] in types]


FLOAT_FIELDS = fields_of_type(float)
INT_FIELDS = fields_of_type(int)
STRING_FIELDS = fields_of_type(str, tuple[str, ...])


def test_unreadable_files_are_config_errors_naming_the_file(tmp_path):
    not_utf8 = tmp_path / "latin1.toml"
    not_utf8.write_bytes(b"[ckpt]\ndir = \"caf\xe9\"\n")
    deep = tmp_path / "deep.toml"
    deep.write_text("[slurm]\nsrun_extra_args = " + "[" * 3000)
    huge = tmp_path / "huge.toml"
    huge.write_bytes(b"#" * (MAX_FILE_BYTES + 1))
    digits = tmp_path / "digits.toml"
    digits.write_text(f"[job]\nreplicas = {'9' * 5000}\n")
    for path, expected in [(not_utf8, "not UTF-8"), (tmp_path, "is a directory"),
                           (deep, "nested too deeply"), (huge, "too large"),
                           (digits, "not valid TOML"), (tmp_path / "a\0b", "cannot read")]:
        with pytest.raises(ConfigError, match=expected) as info:
            load_config(path, env={})
        assert info.value.source and str(tmp_path) in info.value.source


@pytest.mark.parametrize("value", ["[" * 2000, "9" * 5000, "9" * 400, "3\nx = 4", "{" * 2000])
def test_hostile_set_values_are_config_errors(value):
    for key in ("job.replicas", "recovery.lost_timeout", "slurm.srun_extra_args"):
        with pytest.raises(ConfigError) as info:
            load_config(env={}, overrides=[f"{key}={value}"])
        assert info.value.key == key and len(str(info.value)) < 1000


@pytest.mark.parametrize("section, key", FLOAT_FIELDS)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e400"])
def test_every_float_field_must_be_finite(section, key, value, tmp_path):
    with pytest.raises(ConfigError, match="finite") as info:
        load_config(env={}, overrides=[f"{section}.{key}={value}"])
    assert info.value.key == f"{section}.{key}"
    path = tmp_path / "c.toml"
    path.write_text(f"[{section}]\n{key} = {value}\n")
    with pytest.raises(ConfigError, match="finite"):
        load_config(path, env={})
    with pytest.raises(ConfigError, match="finite"):
        load_config(env={f"FTL_{section.upper()}_{key.upper()}": value})


def test_nan_lost_timeout_is_refused_in_code_too():
    """The stalled-replica case: a section built in code reports NaN as a problem."""
    assert dict(RecoveryConfig(lost_timeout=math.nan).problems())["lost_timeout"]
    with pytest.raises(ConfigError, match="recovery.lost_timeout"):
        to_toml(dataclasses.replace(Config(), recovery=RecoveryConfig(lost_timeout=math.nan)))


@pytest.mark.parametrize("section, key", FLOAT_FIELDS + INT_FIELDS)
def test_every_number_field_has_bounds_and_refuses_values_past_them(section, key):
    bounds = field_bounds(SECTIONS[section], key)
    assert bounds is not None, f"{section}.{key} declares no range (use _count/_seconds)"
    assert math.isfinite(bounds.high)
    is_float = (section, key) in FLOAT_FIELDS
    for value in (bounds.high * 2 + 1, bounds.low - 1):
        text = repr(float(value)) if is_float else str(int(value))
        with pytest.raises(ConfigError, match="at most|at least|positive|from") as info:
            load_config(env={}, overrides=[f"{section}.{key}={text}"])
        assert info.value.key == f"{section}.{key}"


def test_ports_and_ftar_counts_fit_their_wire_formats():
    from ft_launch.ftar.transport import Hello
    for section, key in [("quorum", "port"), ("ckpt", "serve_port")]:
        bounds = field_bounds(SECTIONS[section], key)
        assert (bounds.low, bounds.high) == (0, 65535)
    with pytest.raises(ConfigError, match="ftar.sockets_per_peer.*at most"):
        load_config(env={}, overrides=["ftar.sockets_per_peer=65536"])
    sockets, chunk, in_flight = (int(field_bounds(FtarConfig, name).high) for name in
                                 ("sockets_per_peer", "chunk_bytes", "chunks_in_flight"))
    # The largest accepted values still pack into the handshake (it raises if not).
    Hello(0, 0, 1, sockets - 1, sockets, chunk, in_flight).pack(bytes(16))


@pytest.mark.parametrize("section, key", STRING_FIELDS)
@pytest.mark.parametrize("char", ["\x00", "\n", "\x1b", "\x7f", "\x85", "\udcff"])
def test_strings_refuse_control_characters(section, key, char, tmp_path):
    is_list = typing.get_origin(typing.get_type_hints(SECTIONS[section])[key]) is tuple
    # A list is a TOML literal, where the character comes escaped (raw, TOML refuses it).
    text = f"a\\u{ord(char):04x}b" if is_list else f"a{char}b"
    # TOML has no escape for a lone surrogate: as a list item it is simply not TOML.
    expected = "valid text|expected a list" if char == "\udcff" else "control characters"
    with pytest.raises(ConfigError, match=expected) as info:
        load_config(env={}, overrides=[f'{section}.{key}=["{text}"]' if is_list
                                       else f"{section}.{key}={text}"])
    assert info.value.key == f"{section}.{key}"
    if char != "\udcff":  # a TOML file cannot hold a lone surrogate at all
        escaped = f"\\u{ord(char):04x}"
        path = tmp_path / "c.toml"
        path.write_text(f'[{section}]\n{key} = {"[" if is_list else ""}"a{escaped}b"'
                        f'{"]" if is_list else ""}\n')
        with pytest.raises(ConfigError, match="control characters"):
            load_config(path, env={})


def test_saved_strings_are_escaped_valid_toml(tmp_path):
    odd = 'q"uote \\back\\slash \u00e9 \u2028 \U0001f600 # not a comment'
    config = load_config(env={}, overrides=[f"ckpt.dir={odd}", f"run.log_dir={odd}",
                                            "slurm.srun_extra_args=['a\"b', 'c\\\\d']"])
    assert config.ckpt.dir == odd
    path = save_config(config, tmp_path)
    assert load_config(path, env={}) == config
    broken = dataclasses.replace(config, ckpt=dataclasses.replace(config.ckpt, dir="a\x01"))
    with pytest.raises(ConfigError, match="ckpt.dir.*control characters"):
        save_config(broken, tmp_path / "other")
