import dataclasses
from pathlib import Path

import pytest

from ftcore.config import Config, LrScaling, load_config, save_config, to_toml
from ftcore.errors import ConfigError, ExitCode

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
    ("job.exclude_batch_host=maybe", "true or false"),
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
