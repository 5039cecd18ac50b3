"""On a machine with an NVIDIA GPU (a lent device machine): the real NVML backend,
the node profiles on it, and the alignment test on CUDA. Skipped elsewhere."""

import pytest

from ft_launch.health.nvml_backend import NvmlBackend
from ft_launch.health.profile import run_profile
from ft_launch.health.settings import parse_settings

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def snapshot():
    snap = NvmlBackend().snapshot()
    if snap.error or not snap.count:
        pytest.skip(f"no NVIDIA GPU here ({snap.error or 'no devices'})")
    return snap


def test_nvml_reports_every_gpu_with_its_facts(snapshot):
    for gpu in snapshot.devices:
        assert not gpu.lost and gpu.uuid.startswith("GPU-") and gpu.pci_bus_id
        assert gpu.temperature_c is not None and gpu.max_sm_clock_mhz
        assert gpu.pcie_width_max and gpu.ecc_uncorrected_volatile in (None, 0)


def test_node_profiles_pass_on_a_healthy_gpu_node(snapshot):
    settings = parse_settings({"health": {"backend": "nvml", "gpus_per_node": snapshot.count},
                               "checks": {"disk": {"min_free_bytes": 1}}}, "gpu")
    for name in ("prolog", "healthcheck", "inspection"):
        report = run_profile(settings.profile(name), settings.context("gpu-node"))
        assert report.failure is None, (name, report.failure)


def test_alignment_is_bitwise_repeatable_on_cuda(snapshot):
    pytest.importorskip("torch")
    from ft_launch.health.alignment import run_in_subprocess
    runs = run_in_subprocess(("all",), repeats=3, timeout=240)
    assert runs and all(run.device.startswith("cuda") for run in runs)
    assert all(run.deterministic for run in runs), [r.digests for r in runs]
    corrupt = run_in_subprocess((runs[0].device,), repeats=1, corrupt=True, timeout=240)
    assert corrupt[0].digests[0] != runs[0].digests[0]
