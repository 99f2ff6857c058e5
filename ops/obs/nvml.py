"""GPU telemetry through NVML (``pynvml`` from nvidia-ml-py) as ``ptops_gpu_*`` series.

Where NVML is absent (no driver, no GPU, no pynvml) the collector yields
nothing: no series, no error, one debug log line. Each field is read on its
own, so a field a GPU does not support is skipped, not fatal.

XID errors come from an NVML event set registered for critical XID events and
drained (non-blocking) at each scrape: ``ptops_gpu_xid_errors_total{gpu}`` and
``ptops_gpu_last_xid{gpu}``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger("ptops.exporters.nvml")

# nvmlClocksThrottleReason* / nvmlClocksEventReason* bits -> label
THROTTLE_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


class NvmlCollector:
    """A Prometheus collector for the GPUs this process can see."""

    def __init__(self, labels: Mapping[str, str] | None = None, pynvml_module: Any = None) -> None:
        self.labels = dict(labels or {})
        self._lock = threading.Lock()
        self._nvml = None
        self._handles: list[Any] = []
        self._event_set = None
        self._xid_count: dict[int, int] = {}
        self._last_xid: dict[int, int] = {}
        try:
            nv = pynvml_module
            if nv is None:
                import pynvml as nv  # nvidia-ml-py
            nv.nvmlInit()
            n = nv.nvmlDeviceGetCount()
            self._handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
            self._nvml = nv
        except Exception as e:  # NVMLError_LibraryNotFound, ImportError, driver errors
            log.debug("NVML unavailable, no GPU metrics: %s", e)
            self._nvml = None
            return
        try:
            es = nv.nvmlEventSetCreate()
            for h in self._handles:
                nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, es)
            self._event_set = es
        except Exception as e:
            log.debug("NVML XID events unavailable: %s", e)
        for i in range(len(self._handles)):
            self._xid_count[i] = 0

    @property
    def available(self) -> bool:
        return self._nvml is not None

    def _drain_xid(self) -> None:
        nv = self._nvml
        if self._event_set is None:
            return
        for _ in range(1000):
            try:
                data = nv.nvmlEventSetWait_v2(self._event_set, 0)
            except Exception:  # NVMLError_Timeout: nothing pending
                return
            idx = None
            for i, h in enumerate(self._handles):
                if getattr(data, "device", None) == h:
                    idx = i
            if idx is None:
                idx = 0
            self._xid_count[idx] = self._xid_count.get(idx, 0) + 1
            self._last_xid[idx] = int(getattr(data, "eventData", 0))

    def collect(self):
        if self._nvml is None:
            return
        nv = self._nvml
        names = [*self.labels, "gpu"]
        base = list(self.labels.values())

        def fam(cls, name, doc, extra=()):
            return cls(name, doc, labels=[*names, *extra])

        util = fam(GaugeMetricFamily, "ptops_gpu_utilization_ratio", "GPU busy fraction (0-1).")
        mem_util = fam(
            GaugeMetricFamily,
            "ptops_gpu_memory_utilization_ratio",
            "Memory controller busy fraction.",
        )
        used = fam(GaugeMetricFamily, "ptops_gpu_memory_used_bytes", "GPU memory used.")
        total = fam(GaugeMetricFamily, "ptops_gpu_memory_total_bytes", "GPU memory total.")
        temp = fam(GaugeMetricFamily, "ptops_gpu_temperature_celsius", "GPU core temperature.")
        power = fam(GaugeMetricFamily, "ptops_gpu_power_watts", "GPU power draw.")
        clock = fam(GaugeMetricFamily, "ptops_gpu_sm_clock_hertz", "SM clock.")
        thr_mask = fam(
            GaugeMetricFamily, "ptops_gpu_throttle_reasons", "Clock throttle reasons bitmask."
        )
        thr = fam(
            GaugeMetricFamily,
            "ptops_gpu_throttle",
            "1 while a clock throttle reason is active.",
            ["reason"],
        )
        ecc = fam(
            CounterMetricFamily, "ptops_gpu_ecc_errors", "ECC errors since driver load.", ["type"]
        )
        xid = fam(
            CounterMetricFamily,
            "ptops_gpu_xid_errors",
            "Critical XID events seen by this exporter.",
        )
        last_xid = fam(
            GaugeMetricFamily, "ptops_gpu_last_xid", "Code of the latest critical XID event."
        )

        def read(fn, *args):
            try:
                return fn(*args)
            except Exception:
                return None

        with self._lock:
            self._drain_xid()
            for i, h in enumerate(self._handles):
                lv = [*base, str(i)]
                u = read(nv.nvmlDeviceGetUtilizationRates, h)
                if u is not None:
                    util.add_metric(lv, u.gpu / 100.0)
                    mem_util.add_metric(lv, u.memory / 100.0)
                m = read(nv.nvmlDeviceGetMemoryInfo, h)
                if m is not None:
                    used.add_metric(lv, float(m.used))
                    total.add_metric(lv, float(m.total))
                t = read(nv.nvmlDeviceGetTemperature, h, getattr(nv, "NVML_TEMPERATURE_GPU", 0))
                if t is not None:
                    temp.add_metric(lv, float(t))
                p = read(nv.nvmlDeviceGetPowerUsage, h)
                if p is not None:
                    power.add_metric(lv, p / 1000.0)
                c = read(nv.nvmlDeviceGetClockInfo, h, getattr(nv, "NVML_CLOCK_SM", 1))
                if c is not None:
                    clock.add_metric(lv, c * 1e6)
                fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
                    nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None
                )
                mask = read(fn, h) if fn else None
                if mask is not None:
                    thr_mask.add_metric(lv, float(mask))
                    for bit, reason in THROTTLE_REASONS.items():
                        thr.add_metric([*lv, reason], 1.0 if mask & bit else 0.0)
                for kind, err_type in (
                    ("corrected", getattr(nv, "NVML_MEMORY_ERROR_TYPE_CORRECTED", 0)),
                    ("uncorrected", getattr(nv, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1)),
                ):
                    v = read(
                        nv.nvmlDeviceGetTotalEccErrors,
                        h,
                        err_type,
                        getattr(nv, "NVML_VOLATILE_ECC", 0),
                    )
                    if v is not None:
                        ecc.add_metric([*lv, kind], float(v))
                if self._event_set is not None:
                    xid.add_metric(lv, float(self._xid_count.get(i, 0)))
                    if i in self._last_xid:
                        last_xid.add_metric(lv, float(self._last_xid[i]))
        for f in (
            util,
            mem_util,
            used,
            total,
            temp,
            power,
            clock,
            thr_mask,
            thr,
            ecc,
            xid,
            last_xid,
        ):
            if f.samples:
                yield f

    def close(self) -> None:
        nv = self._nvml
        if nv is None:
            return
        with self._lock:
            try:
                if self._event_set is not None:
                    nv.nvmlEventSetFree(self._event_set)
                nv.nvmlShutdown()
            except Exception:
                pass
            self._nvml = None
