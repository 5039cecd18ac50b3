"""The admin config: strict loading, where it is found, what it builds; and every
example in etc/health/ loads."""

import json
from pathlib import Path

import pytest

from ft_launch.config import Config, HealthConfig
from ft_launch.errors import ConfigError
from ft_launch.health.catalog import CATALOG
from ft_launch.health.gpu_facts import NoGpuBackend
from ft_launch.health.profile import run_profile
from ft_launch.health.result import CheckStatus
from ft_launch.health.settings import (
    DEFAULT_PATH,
    ENV_CONFIG,
    HealthSettings,
    load_settings,
    parse_settings,
    settings_from,
)
from ft_launch.health.simulation import SimulatedNvml, load_faults

ETC = Path(__file__).resolve().parents[2] / "etc" / "health"
SLURM_CONF_KEYS = {"Prolog", "Epilog", "PrologFlags", "HealthCheckProgram",
                   "HealthCheckInterval", "HealthCheckNodeState"}


@pytest.mark.parametrize("path", sorted(ETC.glob("*.toml.example")), ids=lambda p: p.name)
def test_every_example_config_loads_and_builds_its_profiles(path):
    settings = load_settings(path)
    for name in settings.profiles:
        assert settings.profile(name).checks


@pytest.mark.parametrize("path", sorted(ETC.glob("*.json")), ids=lambda p: p.name)
def test_every_example_fault_file_loads(path):
    faults = load_faults(path)
    assert faults.gpu or faults.disk_free_bytes


def test_slurm_conf_snippet_names_our_programs():
    lines = [line for line in (ETC / "slurm.conf.snippet").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    settings = dict(line.split("=", 1) for line in lines)
    assert set(settings) == SLURM_CONF_KEYS
    assert {Path(settings[k]).name for k in ("Prolog", "Epilog", "HealthCheckProgram")} == \
        {"ft-prolog", "ft-epilog", "ft-healthcheck"}
    assert all(settings[k].startswith("/") for k in ("Prolog", "Epilog", "HealthCheckProgram"))


def test_lab_config_simulates_faults_per_node(tmp_path):
    settings = load_settings(ETC / "health-lab.toml.example")
    backend = settings.gpu_backend("n3")
    assert isinstance(backend, SimulatedNvml)
    assert backend.fault_path == Path("/tmp/ftl-health/faults/n3.json")


@pytest.mark.parametrize("raw, message", [
    ({"node": {}}, "unknown section \\[node\\]"),
    ({"health": {"gpus": 8}}, "key 'health.gpus': unknown key"),
    ({"health": {"gpus_per_node": "8"}}, "key 'health.gpus_per_node': expected an integer"),
    ({"health": {"backend": "cuda"}}, "key 'health.backend': must be one of"),
    ({"health": {"backend": "none", "gpus_per_node": 8}}, "contradicts"),
    ({"health": {"xid_window": -1.0}}, "key 'health.xid_window': must be a finite number"),
    ({"checks": {"disks": {}}}, "key 'checks.disks': unknown check"),
    ({"checks": {"disk": {"path": "/"}}}, "key 'checks.disk.path': unknown key"),
    ({"checks": {"disk": {"paths": "/"}}}, "expected a list"),
    ({"checks": {"disk": "/"}}, "key 'checks.disk': must be a table"),
    ({"checks": {"gpu_lost": {"x": 1}}}, "takes no parameters"),
    ({"checks": {"gpu_thermal": {"fail_throttle": ["hot"]}}}, "unknown reasons"),
    ({"checks": {"alignment": {"references": {"cpu": 1}}}}, "references.cpu.*expected a string"),
    ({"profiles": {"prolog": {"checks": ["gpu_xid", "gpu_xdi"]}}}, "unknown check 'gpu_xdi'"),
    ({"profiles": {"prolog": {"budget": 0}}}, "positive"),
])
def test_config_mistakes_are_errors_naming_the_file_and_key(raw, message):
    with pytest.raises(ConfigError, match=message) as info:
        parse_settings(raw, "test.toml")
    assert info.value.source == "test.toml"


def test_profiles_can_be_replaced_and_added():
    settings = parse_settings({"profiles": {"prolog": {"checks": ["disk"]},
                                            "mine": {"checks": ["memory", "shm"], "budget": 1}},
                               "checks": {"disk": {"min_free_bytes": 1 << 60}}}, "t")
    assert [c.name for c in settings.profile("prolog").checks] == ["disk"]
    assert settings.profile("mine").budget == 1.0
    report = run_profile(settings.profile("prolog"), settings.context("n1"))
    assert report.failure.reason.startswith("disk / free")
    with pytest.raises(ConfigError, match="unknown profile 'nope'"):
        settings.profile("nope")


def test_config_file_location(tmp_path):
    assert load_settings(env={}).source in ("defaults", str(DEFAULT_PATH))
    named = tmp_path / "h.toml"
    with pytest.raises(ConfigError, match="file not found"):
        load_settings(env={ENV_CONFIG: str(named)})
    named.write_text('[health]\nbackend = "none"\n')
    assert load_settings(env={ENV_CONFIG: str(named)}).source == str(named)
    named.write_text("[node\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(named)


def test_settings_from_the_job_health_section():
    settings = settings_from(Config(health=HealthConfig(gpus_per_node=4, backend="simulated",
                                                        min_free_disk_bytes=123)))
    assert settings.node.gpus_per_node == 4 and settings.params("disk").min_free_bytes == 123
    assert isinstance(settings.gpu_backend("n1"), SimulatedNvml)
    if not Path("/dev/nvidiactl").exists():  # "auto" without a GPU driver: no backend
        assert isinstance(HealthSettings().gpu_backend("n1"), NoGpuBackend)


def test_every_builtin_profile_passes_on_a_healthy_simulated_node(tmp_path):
    settings = parse_settings({"health": {"backend": "simulated", "gpus_per_node": 8,
                                        "sim_fault_dir": str(tmp_path)},
                               "checks": {"disk": {"min_free_bytes": 1}}}, "t")
    for name in settings.profiles:
        if "alignment" in settings.profiles[name].checks:
            continue  # torch: covered in test_alignment
        report = run_profile(settings.profile(name), settings.context("n1"))
        assert report.failure is None, (name, report.failure)
    (tmp_path / "n1.json").write_text(json.dumps([{"gpu": 3, "xid": 79}]))
    report = run_profile(settings.profile("prolog"), settings.context("n1"))
    assert report.status is CheckStatus.FAIL and report.failure.reason == "gpu3 xid 79"
    assert set(CATALOG) >= {c for spec in settings.profiles.values() for c in spec.checks}
