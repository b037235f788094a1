"""NVML hardware metrics: a sampler over nvidia-ml-py (``import pynvml``) exported as OpenTelemetry metrics.

:class:`NvmlSampler` opens NVML once, lists the GPUs (and, on a GPU in MIG mode, its MIG instances), and
on each :meth:`NvmlSampler.sample` (the GPU telemetry thread calls it every ``nvml_period_ms``) reads a
fixed set of fields per device. Observable instruments on the SDK ``MeterProvider`` report the latest
sample when the metric reader collects. Names, units and sources:

| metric | instrument | unit | NVML source |
| --- | --- | --- | --- |
| ``hw.gpu.utilization`` {``hw.gpu.task=general``} | gauge | 1 | ``nvmlDeviceGetUtilizationRates().gpu / 100`` |
| ``hw.gpu.memory.usage`` / ``hw.gpu.memory.limit`` | up-down counter | By | ``nvmlDeviceGetMemoryInfo().used`` / ``.total`` |
| ``hw.gpu.memory.utilization`` | gauge | 1 | ``used / total`` of the same read |
| ``hw.gpu.io`` {``network.io.direction``} | counter | By | ``nvmlDeviceGetPcieThroughput`` (KiB/s, a 20 ms sample) x seconds between samples: an estimate |
| ``hw.power`` | gauge | W | ``nvmlDeviceGetPowerUsage`` (mW) / 1000 |
| ``hw.energy`` | counter | J | ``nvmlDeviceGetTotalEnergyConsumption`` (mJ since the driver loaded) / 1000 |
| ``zoomer.gpu.memory.busy`` | gauge | 1 | ``nvmlDeviceGetUtilizationRates().memory / 100`` (time device memory was read or written) |
| ``zoomer.gpu.clock.sm`` | gauge | MHz | ``nvmlDeviceGetClockInfo(NVML_CLOCK_SM)`` |
| ``zoomer.gpu.temperature`` | gauge | Cel | ``nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU)`` |
| ``zoomer.gpu.clock_event.active`` {``zoomer.gpu.clock_event.reason``} | gauge | 1 | bits of ``nvmlDeviceGetCurrentClocksEventReasons`` (throttle reasons), 1 = active |
| ``zoomer.gpu.process.memory.usage`` {``process.pid``} | up-down counter | By | this process's ``usedGpuMemory`` in ``nvmlDeviceGetComputeRunningProcesses`` |
| ``zoomer.gpu.bar1.memory.usage`` / ``.limit`` | up-down counter | By | ``nvmlDeviceGetBAR1MemoryInfo().bar1Used`` / ``.bar1Total`` |
| ``zoomer.gpu.sm.occupancy`` | gauge | 1 | GPM ``NVML_GPM_METRIC_SM_OCCUPANCY`` / 100 (Hopper or newer) |
| ``zoomer.gpu.tensor.activity`` | gauge | 1 | GPM ``NVML_GPM_METRIC_ANY_TENSOR_UTIL`` / 100 |
| ``zoomer.gpu.dram.bandwidth.utilization`` | gauge | 1 | GPM ``NVML_GPM_METRIC_DRAM_BW_UTIL`` / 100 |
| ``zoomer.gpu.nvml.unsupported`` {``zoomer.gpu.nvml.field``} | gauge | 1 | 1 for each field the device answered NotSupported |

Every point carries ``hw.id`` (the NVML UUID, ``GPU-...`` or ``MIG-...``), ``hw.type=gpu`` and ``hw.name``;
a MIG instance also ``hw.parent`` (its GPU's UUID).

A field a device does not support (NVML ``NotSupported``, ``NoPermission``, ``FunctionNotFound``) is
logged once, reported by ``zoomer.gpu.nvml.unsupported`` and not asked again; other errors are logged once
per device, field and error and asked again next tick. The sampler never stops on an NVML error.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from zoomer_serve.recording import internal_error
from zoomer_serve.telemetry import names as n

logger = logging.getLogger("zoomer_serve.telemetry")

Values = dict[str, list[tuple[dict[str, Any] | None, float]]]
"""Latest values of one device: metric name -> [(extra attributes or None, value), ...]."""

_CLOCK_EVENT_REASONS = (
    ("GpuIdle", "gpu_idle"), ("ApplicationsClocksSetting", "applications_clocks_setting"),
    ("SwPowerCap", "sw_power_cap"), ("HwSlowdown", "hw_slowdown"), ("SyncBoost", "sync_boost"),
    ("SwThermalSlowdown", "sw_thermal_slowdown"), ("HwThermalSlowdown", "hw_thermal_slowdown"),
    ("HwPowerBrakeSlowdown", "hw_power_brake_slowdown"), ("DisplayClockSetting", "display_clock_setting"),
)
_GPM_METRICS = (
    ("NVML_GPM_METRIC_SM_OCCUPANCY", n.GPU_SM_OCCUPANCY),
    ("NVML_GPM_METRIC_ANY_TENSOR_UTIL", n.GPU_TENSOR_ACTIVITY),
    ("NVML_GPM_METRIC_DRAM_BW_UTIL", n.GPU_DRAM_BANDWIDTH_UTILIZATION),
)
_UNSUPPORTED_CODES = ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_NO_PERMISSION", "NVML_ERROR_FUNCTION_NOT_FOUND")

# (name, instrument kind, unit, description)
_INSTRUMENTS = (
    (n.HW_GPU_UTILIZATION, "gauge", "1", "Fraction of time the GPU ran kernels (NVML utilization.gpu)."),
    (n.HW_GPU_MEMORY_USAGE, "updown", "By", "GPU memory used (NVML memory info used)."),
    (n.HW_GPU_MEMORY_LIMIT, "updown", "By", "Size of the GPU memory (NVML memory info total)."),
    (n.HW_GPU_MEMORY_UTILIZATION, "gauge", "1", "Fraction of GPU memory used."),
    (n.HW_GPU_IO, "counter", "By", "PCIe bytes received and transmitted (estimated from NVML PCIe throughput)."),
    (n.HW_POWER, "gauge", "W", "Instantaneous power drawn by the GPU."),
    (n.HW_ENERGY, "counter", "J", "Energy consumed by the GPU since the driver loaded."),
    (n.GPU_MEMORY_BUSY, "gauge", "1", "Fraction of time device memory was read or written (NVML utilization.memory)."),
    (n.GPU_CLOCK_SM, "gauge", "MHz", "SM clock."),
    (n.GPU_TEMPERATURE, "gauge", "Cel", "GPU core temperature."),
    (n.GPU_CLOCK_EVENT_ACTIVE, "gauge", "1", "1 while the clock-event (throttle) reason is active."),
    (n.GPU_PROCESS_MEMORY_USAGE, "updown", "By", "GPU memory used by this process (NVML running processes)."),
    (n.GPU_BAR1_MEMORY_USAGE, "updown", "By", "BAR1 memory used."),
    (n.GPU_BAR1_MEMORY_LIMIT, "updown", "By", "BAR1 memory size."),
    (n.GPU_SM_OCCUPANCY, "gauge", "1", "Fraction of the maximum resident warps (NVML GPM SM occupancy)."),
    (n.GPU_TENSOR_ACTIVITY, "gauge", "1", "Fraction of time SMs ran tensor-core work (NVML GPM)."),
    (n.GPU_DRAM_BANDWIDTH_UTILIZATION, "gauge", "1", "Fraction of peak DRAM bandwidth used (NVML GPM)."),
    (n.NVML_UNSUPPORTED, "gauge", "1", "1 for each NVML field the device does not support."),
)


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used here (no driver, library not found, not installed); the message says why."""


@dataclass
class NvmlDevice:
    """One sampled device: a GPU, or a MIG instance (``parent`` set to its GPU's UUID)."""

    handle: Any
    uuid: str
    name: str
    index: int  # NVML index of the GPU (of the parent GPU for a MIG instance)
    parent: str | None = None
    parent_handle: Any = None
    gpu_instance_id: int | None = None
    gpm: bool = False
    gpm_samples: list[Any] = field(default_factory=list)
    gpm_primed: bool = False
    unsupported: set[str] = field(default_factory=set)
    errors_logged: set[tuple[str, str]] = field(default_factory=set)
    io_bytes: dict[str, float] = field(default_factory=lambda: {"receive": 0.0, "transmit": 0.0})
    last_sample_s: float = 0.0

    @property
    def attributes(self) -> dict[str, Any]:
        attrs: dict[str, Any] = {n.HW_ID: self.uuid, n.HW_TYPE: "gpu", n.HW_NAME: self.name}
        if self.parent:
            attrs[n.HW_PARENT] = self.parent
        return attrs


class NvmlSampler:
    """Samples NVML devices into the latest-value table that the metric callbacks read.

    Args:
        nvml: the pynvml module (or a fake with the same functions and constants).
        pid: the process whose GPU memory ``zoomer.gpu.process.memory.usage`` reports (default: this one).
        clock: seconds, monotonic (tests pass their own).
    Raises:
        NvmlUnavailable from :meth:`open` when NVML cannot initialise.
    """

    def __init__(self, nvml: Any, pid: int | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.nvml = nvml
        self.pid = os.getpid() if pid is None else pid
        self.devices: list[NvmlDevice] = []
        self.latest: dict[str, Values] = {}  # hw.id -> values (replaced whole after each device's sample)
        self.samples = 0
        self._clock = clock
        self._opened = False
        self._lock = threading.Lock()
        self._unsupported_codes = {getattr(nvml, c) for c in _UNSUPPORTED_CODES if hasattr(nvml, c)}

    # -- lifecycle -------------------------------------------------------------------------------------
    def open(self) -> None:
        """Initialise NVML and list the devices. Raises NvmlUnavailable with NVML's reason."""
        nvml = self.nvml
        try:
            nvml.nvmlInit()
        except Exception as exc:
            raise NvmlUnavailable(f"NVML did not initialise: {exc} ({type(exc).__name__})") from None
        self._opened = True
        try:
            for i in range(nvml.nvmlDeviceGetCount()):
                self._add_gpu(i)
        except Exception as exc:
            self.close()
            raise NvmlUnavailable(f"NVML could not list devices: {exc} ({type(exc).__name__})") from None

    def close(self) -> None:
        """Shut NVML down (once); GPM samples are freed."""
        with self._lock:
            if not self._opened:
                return
            self._opened = False
            for dev in self.devices:
                for sample in dev.gpm_samples:
                    self._quietly(self.nvml.nvmlGpmSampleFree, sample)
                dev.gpm_samples = []
            self._quietly(self.nvml.nvmlShutdown)

    def _quietly(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:
            logger.debug("zoomer-serve: NVML %s failed: %r", getattr(fn, "__name__", fn), exc)

    def _add_gpu(self, index: int) -> None:
        nvml = self.nvml
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        gpu = NvmlDevice(handle, _text(nvml.nvmlDeviceGetUUID(handle)), _text(nvml.nvmlDeviceGetName(handle)), index)
        gpu.gpm = self._gpm_supported(handle)
        self.devices.append(gpu)
        for mig in self._mig_instances(gpu):
            self.devices.append(mig)

    def _mig_instances(self, gpu: NvmlDevice) -> Iterable[NvmlDevice]:
        nvml = self.nvml
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(gpu.handle)
        except Exception:
            return  # not MIG capable
        if current != nvml.NVML_DEVICE_MIG_ENABLE:
            return
        for j in range(nvml.nvmlDeviceGetMaxMigDeviceCount(gpu.handle)):
            try:
                handle = nvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu.handle, j)
            except Exception:
                continue  # empty slot (NVML NotFound)
            gi = None
            try:
                gi = int(nvml.nvmlDeviceGetGpuInstanceId(handle))
            except Exception:
                gi = None
            yield NvmlDevice(handle, _text(nvml.nvmlDeviceGetUUID(handle)), _text(nvml.nvmlDeviceGetName(handle)),
                             gpu.index, parent=gpu.uuid, parent_handle=gpu.handle, gpu_instance_id=gi,
                             gpm=gpu.gpm and gi is not None)

    def _gpm_supported(self, handle: Any) -> bool:
        try:
            return bool(self.nvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice)
        except Exception:
            return False

    # -- sampling --------------------------------------------------------------------------------------
    def sample(self) -> None:
        """One tick: every field of every device. Never raises."""
        with self._lock:
            if not self._opened:
                return
            for dev in self.devices:
                try:
                    self._sample_device(dev)
                except Exception as exc:
                    internal_error("gpu.nvml.sample", exc)
            self.samples += 1

    def _sample_device(self, dev: NvmlDevice) -> None:
        now = self._clock()
        elapsed = max(0.0, now - dev.last_sample_s) if dev.last_sample_s else 0.0
        dev.last_sample_s = now
        values: Values = {}
        for fld, reader in self._fields(dev):
            if fld in dev.unsupported:
                continue
            try:
                reader(dev, values, elapsed)
            except Exception as exc:
                self._field_failed(dev, fld, exc)
        if dev.unsupported:
            values[n.NVML_UNSUPPORTED] = [({n.NVML_FIELD: f}, 1) for f in sorted(dev.unsupported)]
        self.latest[dev.uuid] = values

    def _fields(self, dev: NvmlDevice) -> list[tuple[str, Callable[[NvmlDevice, Values, float], None]]]:
        fields: list[tuple[str, Callable[[NvmlDevice, Values, float], None]]] = [
            ("utilization", self._utilization), ("memory", self._memory), ("bar1_memory", self._bar1),
            ("power", self._power), ("energy", self._energy), ("pcie_throughput", self._pcie),
            ("sm_clock", self._sm_clock), ("temperature", self._temperature),
            ("clock_event_reasons", self._clock_events), ("process_memory", self._process_memory)]
        if dev.gpm:
            fields.append(("gpm", self._gpm))
        return fields

    def _field_failed(self, dev: NvmlDevice, fld: str, exc: BaseException) -> None:
        code = getattr(exc, "value", None)
        if code in self._unsupported_codes:
            dev.unsupported.add(fld)
            logger.info("zoomer-serve: NVML field %s is not supported on %s (%s): %s; reported as %s, not asked "
                        "again", fld, dev.uuid, dev.name, exc, n.NVML_UNSUPPORTED)
            return
        key = (fld, type(exc).__name__)
        if key not in dev.errors_logged:
            dev.errors_logged.add(key)
            logger.warning("zoomer-serve: NVML field %s failed on %s: %r (logged once; retried every tick)",
                           fld, dev.uuid, exc)

    # -- field readers (each puts its values in ``values``; NVML errors propagate) ---------------------
    def _utilization(self, dev: NvmlDevice, values: Values, elapsed: float) -> None:
        u = self.nvml.nvmlDeviceGetUtilizationRates(dev.handle)
        values[n.HW_GPU_UTILIZATION] = [({n.HW_GPU_TASK: "general"}, u.gpu / 100.0)]
        values[n.GPU_MEMORY_BUSY] = [(None, u.memory / 100.0)]

    def _memory(self, dev: NvmlDevice, values: Values, elapsed: float) -> None:
        m = self.nvml.nvmlDeviceGetMemoryInfo(dev.handle)
        values[n.HW_GPU_MEMORY_USAGE] = [(None, m.used)]
        values[n.HW_GPU_MEMORY_LIMIT] = [(None, m.total)]
        if m.total:
            values[n.HW_GPU_MEMORY_UTILIZATION] = [(None, m.used / m.total)]

    def _bar1(self, dev: NvmlDevice, values: Values, elapsed: float) -> None:
        b = self.nvml.nvmlDeviceGetBAR1MemoryInfo(dev.handle)
        values[n.GPU_BAR1_MEMORY_USAGE] = [(None, b.bar1Used)]
        values[n.GPU_BAR1_MEMORY_LIMIT] = [(None, b.bar1Total)]

    def _power(self, dev: NvmlDevice, values: Values, elapsed: float) -> None:
        values[n.HW_POWER] = [(None, self.nvml.nvmlDeviceGetPowerUsage(dev.handle) / 1000.0)]

    def _energy(self, dev: NvmlDevice, values: Values, elapsed: float) -> None:
        values[n.HW_ENERGY] = [(None, self.nvml.nvmlDeviceGetTotalEnergyConsumption(dev.handle) / 1000.0)]

    def _pcie(self, dev: NvmlDevice, values: Values, elapsed: float) -> None:
        nvml = self.nvml
        rx = nvml.nvmlDeviceGetPcieThroughput(dev.handle, nvml.NVML_PCIE_UTIL_RX_BYTES)
        tx = nvml.nvmlDeviceGetPcieThroughput(dev.handle, nvml.NVML_PCIE_UTIL_TX_BYTES)
        dev.io_bytes["receive"] += rx * 1024.0 * elapsed
        dev.io_bytes["transmit"] += tx * 1024.0 * elapsed
        values[n.HW_GPU_IO] = [({n.NETWORK_IO_DIRECTION: d}, total) for d, total in dev.io_bytes.items()]

    def _sm_clock(self, dev: NvmlDevice, values: Values, elapsed: float) -> None:
        values[n.GPU_CLOCK_SM] = [(None, self.nvml.nvmlDeviceGetClockInfo(dev.handle, self.nvml.NVML_CLOCK_SM))]

    def _temperature(self, dev: NvmlDevice, values: Values, elapsed: float) -> None:
        t = self.nvml.nvmlDeviceGetTemperature(dev.handle, self.nvml.NVML_TEMPERATURE_GPU)
        values[n.GPU_TEMPERATURE] = [(None, t)]

    def _clock_events(self, dev: NvmlDevice, values: Values, elapsed: float) -> None:
        nvml = self.nvml
        read = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        mask = int(read(dev.handle))
        out: list[tuple[dict[str, Any] | None, float]] = []
        for suffix, reason in _CLOCK_EVENT_REASONS:
            bit = getattr(nvml, "nvmlClocksEventReason" + suffix, None)
            if bit is None:
                bit = getattr(nvml, "nvmlClocksThrottleReason" + suffix, 0)
            if bit:
                out.append(({n.CLOCK_EVENT_REASON: reason}, 1 if mask & bit else 0))
        values[n.GPU_CLOCK_EVENT_ACTIVE] = out

    def _process_memory(self, dev: NvmlDevice, values: Values, elapsed: float) -> None:
        for proc in self.nvml.nvmlDeviceGetComputeRunningProcesses(dev.handle):
            if proc.pid == self.pid and proc.usedGpuMemory is not None:
                values[n.GPU_PROCESS_MEMORY_USAGE] = [({n.PROCESS_PID: self.pid}, proc.usedGpuMemory)]
                return

    def _gpm(self, dev: NvmlDevice, values: Values, elapsed: float) -> None:
        nvml = self.nvml
        if not dev.gpm_samples:
            dev.gpm_samples = [nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()]
        previous, current = dev.gpm_samples
        if dev.parent_handle is not None:
            nvml.nvmlGpmMigSampleGet(dev.parent_handle, dev.gpu_instance_id, current)
        else:
            nvml.nvmlGpmSampleGet(dev.handle, current)
        dev.gpm_samples = [current, previous]  # the next tick compares against this one
        if not dev.gpm_primed:
            dev.gpm_primed = True
            return
        request = nvml.c_nvmlGpmMetricsGet_t()
        request.version = nvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(_GPM_METRICS)
        request.sample1 = previous
        request.sample2 = current
        for i, (const, _name) in enumerate(_GPM_METRICS):
            request.metrics[i].metricId = getattr(nvml, const)
        nvml.nvmlGpmMetricsGet(request)
        for i, (_const, name) in enumerate(_GPM_METRICS):
            metric = request.metrics[i]
            if metric.nvmlReturn == nvml.NVML_SUCCESS:
                values[name] = [(None, metric.value / 100.0)]

    # -- reading ---------------------------------------------------------------------------------------
    def utilization_by_uuid(self) -> dict[str, float]:
        """Latest ``hw.gpu.utilization`` (ratio) per device UUID (devices that report it)."""
        out = {}
        for uuid, values in list(self.latest.items()):
            points = values.get(n.HW_GPU_UTILIZATION)
            if points:
                out[uuid] = points[0][1]
        return out

    def observations(self, metric: str) -> list[tuple[dict[str, Any], float]]:
        """``(attributes, value)`` of every device's latest ``metric``."""
        out = []
        for dev in self.devices:
            for extra, value in self.latest.get(dev.uuid, {}).get(metric, ()):
                attrs = dev.attributes
                if extra:
                    attrs.update(extra)
                out.append((attrs, value))
        return out

    def register_metrics(self, meter: Any) -> None:
        """Create one observable instrument per metric of the table above on ``meter``."""
        from opentelemetry.metrics import Observation

        for name, kind, unit, description in _INSTRUMENTS:
            def callback(options: Any, _name: str = name) -> list[Observation]:
                return [Observation(value, attrs) for attrs, value in self.observations(_name)]

            create = {"gauge": meter.create_observable_gauge, "updown": meter.create_observable_up_down_counter,
                      "counter": meter.create_observable_counter}[kind]
            create(name, callbacks=[callback], unit=unit, description=description)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
