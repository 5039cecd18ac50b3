"""The health sections of the one config, the one config-file variable, and what a
program running as root reads (``trusted_only``)."""

import os
from pathlib import Path

import pytest

from ft_launch.config import ENV_CONFIG, Config, load_config, parse_config, save_config, to_toml
from ft_launch.errors import ConfigError

pytestmark = pytest.mark.timeout(30)
ETC = Path(__file__).resolve().parents[2] / "etc" / "health"


def write(path, text, mode=0o644):
    path.write_text(text)
    path.chmod(mode)
    return path


def test_ftl_config_names_the_file_and_an_explicit_path_wins(tmp_path):
    named = write(tmp_path / "named.toml", "[job]\nreplicas = 4\n")
    given = write(tmp_path / "given.toml", "[job]\nreplicas = 6\n")
    assert load_config(env={ENV_CONFIG: str(named)}).job.replicas == 4
    assert load_config(given, env={ENV_CONFIG: str(named)}).job.replicas == 6
    assert load_config(env={ENV_CONFIG: ""}) == Config()
    with pytest.raises(ConfigError, match=f"file not found.*{ENV_CONFIG}"):
        load_config(env={ENV_CONFIG: str(tmp_path / "missing.toml")})


def test_named_tables_load_merge_and_save_back_equal(tmp_path):
    path = write(tmp_path / "h.toml", '[health]\nbackend = "simulated"\ngpus_per_node = 8\n'
                 '[checks.disk]\npaths = ["/"]\nmin_free_bytes = 1\n'
                 '[checks.alignment]\nreferences = { "cpu-x" = "abc" }\n'
                 '[profiles.mine]\nchecks = ["disk"]\nbudget = 1.5\n')
    config = load_config(path, env={"FTL_HEALTH_XID_WINDOW": "0"},
                         overrides=['checks.disk.paths=["/tmp"]'])
    assert config.health.backend == "simulated" and config.health.xid_window == 0.0
    assert config.checks.get("disk") == {"paths": ["/tmp"], "min_free_bytes": 1}
    assert config.checks.source("disk") == "--set" and config.checks.source("alignment") == \
        str(path)
    assert dict(config.profiles.get("mine")) == {"checks": ["disk"], "budget": 1.5}
    saved = save_config(config, tmp_path / "run")
    assert load_config(saved, env={}) == config
    assert "[checks.disk]" in to_toml(config)


@pytest.mark.parametrize("raw, message", [
    ({"checks": {"disk": "/"}}, "key 'checks.disk': must be a table"),
    ({"checks": {"disk": {"paths": float("nan")}}}, "checks.disk.paths.*finite"),
    ({"profiles": {"p": {"note": "a\x01b"}}}, "profiles.p.note.*control characters"),
])
def test_named_tables_hold_only_plain_values(raw, message):
    with pytest.raises(ConfigError, match=message) as info:
        parse_config(raw, "h.toml")
    assert info.value.source == "h.toml"


def test_named_tables_are_not_set_from_the_environment():
    with pytest.raises(ConfigError, match="FTL_CHECKS_DISK_PATHS.*tables") as info:
        load_config(env={"FTL_CHECKS_DISK_PATHS": '["/"]'})
    assert "--set checks.NAME.KEY=VALUE" in str(info.value)
    with pytest.raises(ConfigError, match="checks.NAME.KEY=VALUE"):
        load_config(env={}, overrides=["checks.disk=1"])


@pytest.mark.parametrize("path", sorted(ETC.glob("*.toml.example")), ids=lambda p: p.name)
def test_node_examples_are_configs_of_the_one_loader(path):
    config = load_config(path, env={})
    assert config.health != Config().health and len(config.checks)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to own files as another user")
def test_trusted_only_reads_only_roots_own_file_and_no_environment(tmp_path):
    good = write(tmp_path / "root.toml", "[health]\ndrain = false\n")
    env = {ENV_CONFIG: str(good), "FTL_HEALTH_REPORT_DIR": "/home/user/x"}
    config = load_config(env=env, trusted_only=True)
    assert config.health.drain is False and config.health.report_dir == ""  # env ignored
    assert load_config(env=env).health.report_dir == "/home/user/x"  # not trusted: applied
    group_writable = write(tmp_path / "gw.toml", "[health]\n", mode=0o664)
    users = write(tmp_path / "user.toml", "[health]\n")
    os.chown(users, 65534, -1)
    for path, why in [(group_writable, "-rw-rw-r--"), (users, "owner uid 65534")]:
        with pytest.raises(ConfigError, match=f"only root can write.*{why}") as info:
            load_config(path, env={}, trusted_only=True)
        assert info.value.source == str(path)
        load_config(path, env={})  # a program not running as root reads it
