"""GPU checks on the simulated backend (every fault of the catalogue), the fault
file format, and the NVML backend's mapping against a stand-in NVML module."""

import json
import sys
import types

import pytest

from ft_launch.errors import ConfigError
from ft_launch.health.catalog import CATALOG, bind, default_params
from ft_launch.health.context import CheckContext
from ft_launch.health.gpu_facts import NoGpuBackend
from ft_launch.health.result import CheckStatus
from ft_launch.health.simulation import (
    SimulatedHostFacts,
    SimulatedNvml,
    fault_file,
    load_faults,
    parse_faults,
)

GPUS = 8


def run_check(name, faults, gpus=GPUS, tmp_path=None, params=None):
    path = tmp_path / "n1.json"
    path.write_text(json.dumps(faults))
    backend = SimulatedNvml(gpus, path)
    ctx = CheckContext(node="n1", gpu_backend=backend, expected_gpus=gpus,
                       host=SimulatedHostFacts(faults=backend.faults()))
    return bind(name, params or default_params(name))(ctx)


@pytest.mark.parametrize("check, faults, status, reason", [
    ("gpu_count", [{"gpus_visible": 7}], CheckStatus.FAIL, "gpus 7/8 visible"),
    ("gpu_lost", [{"gpu": 1, "lost": True}], CheckStatus.FAIL, "gpu1 lost"),
    ("gpu_xid", [{"gpu": 3, "xid": 79}], CheckStatus.FAIL, "gpu3 xid 79"),
    ("gpu_xid", [{"gpu": 2, "xid": 63}], CheckStatus.WARN, "gpu2 xid 63"),
    ("gpu_xid", [{"gpu": 2, "xid": 13}], CheckStatus.PASS, "ok"),   # application error
    ("gpu_ecc", [{"gpu": 0, "ecc_uncorrected": 2}], CheckStatus.FAIL, "gpu0 ecc uncorrectable 2"),
    ("gpu_remap", [{"gpu": 4, "remap_pending": True}], CheckStatus.FAIL,
     "gpu4 row remap pending"),
    ("gpu_remap", [{"gpu": 4, "remap_failed": True}], CheckStatus.FAIL, "gpu4 row remap failed"),
    ("gpu_remap", [{"gpu": 5, "retired_pending": True}], CheckStatus.FAIL,
     "gpu5 page retirement pending"),
    ("gpu_recovery", [{"gpu": 6, "recovery_action": "node_reboot"}], CheckStatus.FAIL,
     "gpu6 needs node_reboot"),
    ("gpu_thermal", [{"gpu": 2, "temperature": 97}], CheckStatus.FAIL, "gpu2 temp 97C>90C"),
    ("gpu_thermal", [{"gpu": 2, "throttle": ["hw_slowdown"]}], CheckStatus.FAIL,
     "gpu2 throttled hw_slowdown"),
    ("gpu_thermal", [{"gpu": 2, "throttle": ["sw_thermal"]}], CheckStatus.WARN,
     "gpu2 throttled sw_thermal"),
    ("gpu_clocks", [{"gpu": 7, "max_sm_clock": 1200}], CheckStatus.WARN,
     "gpu7 max sm clock 1200MHz<1980MHz"),
    ("gpu_pcie", [{"gpu": 0, "pcie_width": 8}], CheckStatus.FAIL, "gpu0 pcie x8<x16"),
    ("gpu_nvlink", [{"gpu": 1, "nvlink_down": [2]}], CheckStatus.FAIL, "gpu1 nvlink2 down"),
    ("gpu_nvlink", [{"gpu": 1, "nvlink_errors": 10 ** 6}], CheckStatus.WARN,
     "gpu1 nvlink errors 1000000"),
])
def test_each_injected_fault_gives_a_precise_reason(tmp_path, check, faults, status, reason):
    result = run_check(check, faults, tmp_path=tmp_path)
    assert (result.status, result.reason) == (status, reason)


@pytest.mark.parametrize("check", [name for name, spec in CATALOG.items()
                                   if spec.gpu and name != "alignment"])
def test_healthy_simulated_node_passes_every_gpu_check(tmp_path, check):
    assert run_check(check, [], tmp_path=tmp_path).status is CheckStatus.PASS


def test_lost_gpu_is_not_judged_by_other_checks(tmp_path):
    result = run_check("gpu_ecc", [{"gpu": 1, "lost": True}], tmp_path=tmp_path)
    assert result.status is CheckStatus.PASS


def test_without_backend_gpu_checks_are_skipped():
    ctx = CheckContext(node="n1", gpu_backend=NoGpuBackend())
    result = bind("gpu_xid", default_params("gpu_xid"))(ctx)
    assert result.status is CheckStatus.PASS and result.evidence.get("skipped")


def test_faults_accumulate_and_host_faults_parse(tmp_path):
    faults = parse_faults({"gpus": 4, "faults": [
        {"gpu": 3, "xid": 79}, {"gpu": 3, "xid": 48}, {"disk_free_bytes": 0, "path": "/scratch"},
        {"readonly": "/tmp"}, {"link_down": "ib0"}, {"sdc": True}]})
    assert faults.gpus_visible == 4
    assert faults.gpu[3]["xids"] == (79, 48)
    assert faults.disk_free_bytes == {"/scratch": 0}
    assert faults.readonly == {"/tmp"} and faults.links_down == {"ib0"} and faults.sdc
    assert load_faults(tmp_path / "absent.json") == parse_faults([])
    assert fault_file(tmp_path, "n7") == tmp_path / "n7.json"


@pytest.mark.parametrize("raw, message", [
    ([{"gpu": 1, "xdi": 79}], "unknown fault 'xdi'"),
    ([{"gpu": 1, "xid": "79"}], "must be int"),
    ([{"gpu": 1, "recovery_action": "pray"}], "unknown recovery_action"),
    ([{"gpu": 1, "throttle": ["hot"]}], "unknown throttle"),
    ([{"disk_ful": 0}], "unknown fault 'disk_ful'"),
    ({"gpus": 8, "fault": []}, "unknown keys"),
    ("nonsense", "expected a list"),
])
def test_fault_file_typos_are_errors(raw, message):
    with pytest.raises(ConfigError, match=message):
        parse_faults(raw)


def test_snapshot_rereads_the_fault_file(tmp_path):
    path = tmp_path / "n1.json"
    backend = SimulatedNvml(2, path)
    assert backend.snapshot().devices[1].xids == ()
    path.write_text(json.dumps([{"gpu": 1, "xid": 74}]))
    assert backend.snapshot().devices[1].xids == (74,)


# --------------------------------------------------------------------------- NVML mapping


class FakeNvmlError(Exception):
    def __init__(self, value):
        super().__init__(f"nvml error {value}")
        self.value = value


def fake_pynvml(lost_index=None, unsupported=("nvmlDeviceGetRetiredPagesPendingStatus",)):
    """A stand-in ``pynvml`` with two H100-like GPUs; only what NvmlBackend calls."""
    m = types.ModuleType("pynvml")
    vars(m).update({
        "NVML_ERROR_GPU_IS_LOST": 15, "NVML_ERROR_NOT_SUPPORTED": 3,
        "NVML_ERROR_NO_PERMISSION": 4, "NVML_ERROR_FUNCTION_NOT_FOUND": 13,
        "NVML_ERROR_INVALID_ARGUMENT": 2, "NVML_ERROR_NOT_FOUND": 6, "NVML_SUCCESS": 0,
        "NVML_MEMORY_ERROR_TYPE_CORRECTED": 0, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED": 1,
        "NVML_VOLATILE_ECC": 0, "NVML_AGGREGATE_ECC": 1, "NVML_TEMPERATURE_GPU": 0,
        "NVML_CLOCK_SM": 1, "NVML_NVLINK_MAX_LINKS": 36, "NVML_NVLINK_ERROR_DL_REPLAY": 0,
        "NVML_NVLINK_ERROR_DL_RECOVERY": 1, "NVML_NVLINK_ERROR_DL_CRC_FLIT": 2,
        "NVML_NVLINK_ERROR_DL_CRC_DATA": 3, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION": 230,
        "nvmlEventTypeXidCriticalError": 8})
    m.NVMLError = FakeNvmlError

    def device_fn(name, value):
        def fn(handle, *args):
            if name in unsupported:
                raise FakeNvmlError(3)
            if handle == lost_index and name != "nvmlDeviceGetHandleByIndex":
                raise FakeNvmlError(15)
            return value(handle, *args) if callable(value) else value
        fn.__name__ = name
        return fn

    def nvlink_state(handle, link):
        if link >= 4:
            raise FakeNvmlError(2)  # no such link
        return 0 if (handle, link) == (1, 3) else 1

    values = types.SimpleNamespace(nvmlReturn=0, value=types.SimpleNamespace(uiVal=1))
    m.nvmlInit = m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetCount = lambda: 2
    m.nvmlSystemGetDriverVersion = lambda: b"570.86"
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    for name, value in {
        "nvmlDeviceGetPciInfo": lambda h: types.SimpleNamespace(
            busId=f"00000000:{h + 0x18:02X}:00.0".encode()),
        "nvmlDeviceGetUUID": lambda h: f"GPU-{h}",
        "nvmlDeviceGetRemappedRows": lambda h: (0, 0, h == 0, 0),
        "nvmlDeviceGetRetiredPagesPendingStatus": 0,
        "nvmlDeviceGetCurrentClocksEventReasons": 0x8,
        "nvmlDeviceGetCurrentClocksThrottleReasons": 0x8,
        "nvmlDeviceGetTotalEccErrors": lambda h, kind, counter: 3 if kind == 1 and h == 1 else 0,
        "nvmlDeviceGetTemperature": 45, "nvmlDeviceGetClockInfo": 1400,
        "nvmlDeviceGetMaxClockInfo": 1980, "nvmlDeviceGetCurrPcieLinkGeneration": 5,
        "nvmlDeviceGetMaxPcieLinkGeneration": 5, "nvmlDeviceGetCurrPcieLinkWidth": 16,
        "nvmlDeviceGetMaxPcieLinkWidth": 16, "nvmlDeviceGetNvLinkState": nvlink_state,
        "nvmlDeviceGetNvLinkErrorCounter": 1,
        "nvmlDeviceGetFieldValues": lambda h, ids: [values] if h == 1 else
        [types.SimpleNamespace(nvmlReturn=3, value=None)],
    }.items():
        setattr(m, name, device_fn(name, value))
    return m


@pytest.fixture
def nvml_module(monkeypatch):
    def install(**kwargs):
        module = fake_pynvml(**kwargs)
        monkeypatch.setitem(sys.modules, "pynvml", module)
        return module
    return install


def test_nvml_backend_maps_every_fact(nvml_module, tmp_path):
    from ft_launch.health.nvml_backend import NvmlBackend
    nvml_module()
    kmsg = tmp_path / "kmsg"  # not a real /dev/kmsg: read as one record
    kmsg.write_text("4,1,100,-;NVRM: Xid (PCI:0000:19:00): 79, pid=1, fallen off the bus\n")
    snapshot = NvmlBackend(xid_window_s=0, kmsg_path=str(kmsg)).snapshot()
    assert snapshot.error == "" and snapshot.driver_version == "570.86"
    gpu0, gpu1 = snapshot.devices
    assert gpu0.pci_bus_id == "0000:18:00" and gpu0.remap_pending is True
    assert gpu0.retired_pages_pending is None          # not supported: nothing to judge
    assert gpu1.ecc_uncorrected_volatile == 3 and gpu1.xids == (79,)
    assert gpu1.nvlink_up == (True, True, True, False) and gpu1.nvlink_errors == 16
    assert gpu1.recovery_action == 1 and gpu0.recovery_action is None
    assert gpu0.throttle_mask == 0x8 and gpu0.max_sm_clock_mhz == 1980


def test_nvml_backend_marks_a_lost_gpu(nvml_module):
    from ft_launch.health.nvml_backend import NvmlBackend
    nvml_module(lost_index=1)
    devices = NvmlBackend(kmsg_path="/nonexistent").snapshot().devices
    assert [d.lost for d in devices] == [False, True]


def test_nvml_backend_reports_a_missing_driver(monkeypatch):
    from ft_launch.health.nvml_backend import NvmlBackend
    module = fake_pynvml()

    def no_driver():
        raise FakeNvmlError(9)
    module.nvmlInit = no_driver
    monkeypatch.setitem(sys.modules, "pynvml", module)
    snapshot = NvmlBackend().snapshot()
    assert snapshot.error
    ctx = CheckContext(node="n1", gpu_backend=NvmlBackend(), expected_gpus=8)
    result = bind("gpu_count", default_params("gpu_count"))(ctx)
    assert result.status is CheckStatus.FAIL and "gpu backend nvml failed" in result.reason
