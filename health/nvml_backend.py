"""The real GPU backend over NVML (nvidia-ml-py), imported lazily.

Every query that the GPU or driver does not support yields ``None`` (nothing to
judge); ``NVML_ERROR_GPU_IS_LOST`` marks the GPU lost; any other error is kept
as the GPU's ``query_error``. XIDs come from the kernel log (one-shot hooks) and,
when ``watch_events`` is set (the long-running inspection agent), also from an
NVML event set registered for critical XIDs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .gpu_facts import GpuFacts, GpuSnapshot
from .xid import XidEvent, normalise_bus_id, read_kernel_xids, recent, uptime_s

log = logging.getLogger(__name__)


class _GpuLost(Exception):
    pass


class NvmlBackend:
    name = "nvml"

    def __init__(self, xid_window_s: float = 3600.0, kmsg_path: str = "/dev/kmsg",
                 watch_events: bool = False) -> None:
        self.xid_window_s = xid_window_s
        self.kmsg_path = kmsg_path
        self.watch_events = watch_events
        self._nvml: Any = None
        self._event_set: Any = None
        self._event_xids: list[tuple[float, int, int]] = []  # (uptime, gpu index, xid)

    def _init(self) -> Any:
        if self._nvml is None:
            import pynvml  # lazy: hooks on GPU-less nodes never load libnvidia-ml

            pynvml.nvmlInit()
            self._nvml = pynvml
            if self.watch_events:
                self._register_events()
        return self._nvml

    def snapshot(self) -> GpuSnapshot:
        try:
            import pynvml
        except ImportError as exc:
            return GpuSnapshot(backend=self.name, error=_describe(exc))
        try:
            nvml = self._init()
            count = nvml.nvmlDeviceGetCount()
            driver = _text(nvml.nvmlSystemGetDriverVersion())
        except (pynvml.NVMLError, OSError) as exc:  # no driver, library not found, ...
            return GpuSnapshot(backend=self.name, error=_describe(exc))
        kernel = recent(read_kernel_xids(self.kmsg_path), uptime_s(), self.xid_window_s)
        self._drain_events()
        devices = tuple(self._device(nvml, index, kernel) for index in range(count))
        return GpuSnapshot(backend=self.name, devices=devices, driver_version=driver)

    def close(self) -> None:
        if self._nvml is None:
            return
        try:
            if self._event_set is not None:
                self._nvml.nvmlEventSetFree(self._event_set)
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError as exc:
            log.debug("nvml shutdown: %s", exc)
        self._nvml = self._event_set = None

    # ------------------------------------------------------------------ one device

    def _device(self, nvml: Any, index: int, kernel: list[XidEvent]) -> GpuFacts:
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except nvml.NVMLError as exc:
            lost = exc.value == nvml.NVML_ERROR_GPU_IS_LOST
            return GpuFacts(index=index, lost=lost, query_error="" if lost else str(exc))
        errors: list[str] = []

        def ask(fn: Callable[..., Any], *args: Any) -> Any:
            return _query(nvml, errors, fn, handle, *args)
        try:
            facts = self._read(nvml, index, ask)
        except _GpuLost:
            return GpuFacts(index=index, lost=True)
        xids = tuple(e.xid for e in kernel if e.pci_bus_id == facts.pci_bus_id)
        xids += tuple(x for _, gpu, x in self._event_xids if gpu == index)
        return replace(facts, xids=xids, query_error="; ".join(errors)[:200])

    def _read(self, nvml: Any, index: int, ask: Callable[..., Any]) -> GpuFacts:
        pci = ask(nvml.nvmlDeviceGetPciInfo)
        remap = ask(nvml.nvmlDeviceGetRemappedRows)
        pending = ask(nvml.nvmlDeviceGetRetiredPagesPendingStatus)
        throttle = ask(nvml.nvmlDeviceGetCurrentClocksEventReasons)
        if throttle is None:  # drivers before r535 have only the older name
            throttle = ask(nvml.nvmlDeviceGetCurrentClocksThrottleReasons)
        links, link_errors = self._nvlinks(nvml, ask)
        return GpuFacts(
            index=index,
            uuid=_text(ask(nvml.nvmlDeviceGetUUID) or ""),
            pci_bus_id=normalise_bus_id(_text(pci.busId)) if pci is not None else "",
            ecc_uncorrected_volatile=ask(nvml.nvmlDeviceGetTotalEccErrors,
                                         nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                         nvml.NVML_VOLATILE_ECC),
            ecc_uncorrected_aggregate=ask(nvml.nvmlDeviceGetTotalEccErrors,
                                          nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                          nvml.NVML_AGGREGATE_ECC),
            ecc_corrected_volatile=ask(nvml.nvmlDeviceGetTotalEccErrors,
                                       nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                                       nvml.NVML_VOLATILE_ECC),
            retired_pages_pending=None if pending is None else bool(pending),
            remap_pending=None if remap is None else bool(remap[2]),
            remap_failed=None if remap is None else bool(remap[3]),
            temperature_c=ask(nvml.nvmlDeviceGetTemperature, nvml.NVML_TEMPERATURE_GPU),
            throttle_mask=throttle,
            sm_clock_mhz=ask(nvml.nvmlDeviceGetClockInfo, nvml.NVML_CLOCK_SM),
            max_sm_clock_mhz=ask(nvml.nvmlDeviceGetMaxClockInfo, nvml.NVML_CLOCK_SM),
            pcie_gen=ask(nvml.nvmlDeviceGetCurrPcieLinkGeneration),
            pcie_gen_max=ask(nvml.nvmlDeviceGetMaxPcieLinkGeneration),
            pcie_width=ask(nvml.nvmlDeviceGetCurrPcieLinkWidth),
            pcie_width_max=ask(nvml.nvmlDeviceGetMaxPcieLinkWidth),
            nvlink_up=links, nvlink_errors=link_errors,
            recovery_action=self._recovery_action(nvml, ask))

    @staticmethod
    def _nvlinks(nvml: Any, ask: Callable[..., Any]) -> tuple[tuple[bool, ...], int | None]:
        states: list[bool] = []
        errors = 0
        counters = (nvml.NVML_NVLINK_ERROR_DL_REPLAY, nvml.NVML_NVLINK_ERROR_DL_RECOVERY,
                    nvml.NVML_NVLINK_ERROR_DL_CRC_FLIT, nvml.NVML_NVLINK_ERROR_DL_CRC_DATA)
        for link in range(nvml.NVML_NVLINK_MAX_LINKS):
            state = ask(nvml.nvmlDeviceGetNvLinkState, link)
            if state is None:  # no such link (or no NVLink at all): the list ends here
                break
            states.append(bool(state))
            errors += sum(ask(nvml.nvmlDeviceGetNvLinkErrorCounter, link, c) or 0
                          for c in counters)
        return tuple(states), (errors if states else None)

    @staticmethod
    def _recovery_action(nvml: Any, ask: Callable[..., Any]) -> int | None:
        field_id = getattr(nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
        if field_id is None:
            return None
        values = ask(nvml.nvmlDeviceGetFieldValues, [field_id])
        if values is None or values[0].nvmlReturn != nvml.NVML_SUCCESS:
            return None  # driver older than r550: the field does not exist
        return int(values[0].value.uiVal)

    # ------------------------------------------------------------------ XID events

    def _register_events(self) -> None:
        nvml = self._nvml
        try:
            self._event_set = nvml.nvmlEventSetCreate()
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError,
                                              self._event_set)
        except nvml.NVMLError as exc:
            log.warning("NVML XID events unavailable (kernel log only): %s", exc)

    def _drain_events(self) -> None:
        nvml = self._nvml
        if self._event_set is None:
            return
        now = uptime_s()
        while True:
            try:
                data = nvml.nvmlEventSetWait(self._event_set, 0)
            except nvml.NVMLError:  # NVML_ERROR_TIMEOUT: nothing more pending
                break
            index = nvml.nvmlDeviceGetIndex(data.device)
            self._event_xids.append((now, index, int(data.eventData)))
        self._event_xids = [e for e in self._event_xids
                            if self.xid_window_s <= 0 or e[0] >= now - self.xid_window_s]


def _query(nvml: Any, errors: list[str], fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except nvml.NVMLError as exc:
        if exc.value == nvml.NVML_ERROR_GPU_IS_LOST:
            raise _GpuLost() from None
        if exc.value not in (nvml.NVML_ERROR_NOT_SUPPORTED, nvml.NVML_ERROR_NO_PERMISSION,
                             nvml.NVML_ERROR_FUNCTION_NOT_FOUND,
                             nvml.NVML_ERROR_INVALID_ARGUMENT, nvml.NVML_ERROR_NOT_FOUND):
            errors.append(f"{getattr(fn, '__name__', fn)}: {exc}")
        return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:160]
