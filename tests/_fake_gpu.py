"""The two narrow seams of GPU telemetry, faked for machines without a GPU.

:class:`FakeCudaMemory` is a :class:`~zoomer_serve.telemetry.CudaMemorySource`: a tiny caching allocator
per device (allocations, 2 MiB segments, peak, ``num_alloc_retries`` / ``num_ooms`` /
``num_device_alloc``), a history ring buffer with the TraceEntry structure torch documents for
``torch.cuda.memory._snapshot()`` (action, addr or device_free, size, stream, time_us, user_metadata, frames),
per-thread metadata like ``_set_memory_metadata``, and the OOM observer hook. Tests drive it with
:meth:`FakeCudaMemory.allocate` / :meth:`FakeCudaMemory.free`, the way tensors would.

:class:`FakeNvml` is a pynvml stand-in: the functions GPU telemetry calls, the real pynvml constants and
exception classes, per-device values, and per-device, per-function failures (``fail``) with any NVML error
code (NotSupported, LibraryNotFound, ...).
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml

from zoomer_serve.telemetry.memory_source import MemoryCounters, counters_of

SEGMENT = 2 << 20  # the fake allocator reserves memory in 2 MiB segments


class FakeOutOfMemoryError(RuntimeError):
    """What torch.OutOfMemoryError is to the real allocator."""


@dataclass
class _FakeDevice:
    limit: int
    allocated: int = 0
    reserved: int = 0
    peak: int = 0
    alloc_retries: int = 0
    ooms: int = 0
    device_allocs: int = 0
    blocks: dict[int, int] = field(default_factory=dict)
    trace: collections.deque = field(default_factory=lambda: collections.deque(maxlen=10_000))


class FakeCudaMemory:
    """A fake CUDA caching allocator behind the CudaMemorySource protocol (see the module docstring).

    ``limit_bytes``: device memory per device. ``clock_us``: the trace clock (default: wall clock in µs,
    so bursts share a time_us like the real one's coarse clock).
    """

    supports_metadata = True

    def __init__(self, devices: int = 1, limit_bytes: int = 1 << 30, clock_us: Any = None) -> None:
        self.devices = [_FakeDevice(limit_bytes) for _ in range(devices)]
        self.initialized = True
        self.recording = False
        self.stacks = "python"
        self.history_calls: list[tuple[bool, str, int]] = []
        self.snapshot_calls = 0
        self.snapshot_delay_s = 0.0
        self.snapshot_error: BaseException | None = None
        self.clear_on_disable = True  # whether stopping the recording empties the ring (as torch may or not)
        self.reset_calls = 0
        self._oom_callbacks: list[Any] = []
        self._meta = threading.local()
        self._lock = threading.RLock()
        self._next_addr = 0x7F0000000000
        self._clock_us = clock_us or (lambda: time.time_ns() // 1000)

    # -- driving it (what tensors would do) ---------------------------------------------------------
    def allocate(self, nbytes: int, device: int = 0, stream: int = 0) -> int:
        """Allocate ``nbytes``; raises FakeOutOfMemoryError (after the OOM observers ran) beyond the limit."""
        with self._lock:
            dev = self.devices[device]
            if dev.allocated + nbytes > dev.limit:
                dev.ooms += 1
                free = dev.limit - dev.reserved
                self._trace(device, "oom", 0, nbytes, stream, device_free=free)
                callbacks = list(self._oom_callbacks)
            else:
                callbacks = None
                if dev.reserved - dev.allocated < nbytes:
                    seg = -(-nbytes // SEGMENT) * SEGMENT
                    if dev.reserved + seg > dev.limit:
                        dev.alloc_retries += 1  # the real allocator frees its cache and retries
                        seg = nbytes
                    dev.reserved += seg
                    dev.device_allocs += 1
                    self._trace(device, "segment_alloc", self._addr(), seg, stream)
                addr = self._addr()
                dev.blocks[addr] = nbytes
                dev.allocated += nbytes
                dev.peak = max(dev.peak, dev.allocated)
                self._trace(device, "alloc", addr, nbytes, stream)
                return addr
        for cb in callbacks:  # outside the lock, like the real allocator
            cb(device, nbytes, dev.limit, free)
        raise FakeOutOfMemoryError(f"CUDA out of memory. Tried to allocate {nbytes} bytes")

    def free(self, addr: int, device: int = 0, stream: int = 0) -> None:
        with self._lock:
            dev = self.devices[device]
            size = dev.blocks.pop(addr)
            self._trace(device, "free_requested", addr, size, stream)
            dev.allocated -= size
            self._trace(device, "free_completed", addr, size, stream)

    def empty_cache(self, device: int = 0) -> None:
        with self._lock:
            dev = self.devices[device]
            spare = dev.reserved - dev.allocated
            if spare > 0:
                dev.reserved -= spare
                self._trace(device, "segment_free", self._addr(), spare, 0)

    def _addr(self) -> int:
        self._next_addr += 0x1000
        return self._next_addr

    def _trace(self, device: int, action: str, addr: int, size: int, stream: int, device_free: int = 0) -> None:
        if not self.recording:
            return
        entry: dict[str, Any] = {"action": action, "size": size, "stream": stream, "time_us": self._clock_us(),
                                 "user_metadata": getattr(self._meta, "value", ""), "compile_context": ""}
        if action == "oom":
            entry["device_free"] = device_free
        else:
            entry["addr"] = addr
        if self.stacks == "python":
            entry["frames"] = [{"filename": "model.py", "line": 42, "name": "forward"}]
        self.devices[device].trace.append(entry)

    def current_metadata(self) -> str:
        return getattr(self._meta, "value", "")

    # -- CudaMemorySource -------------------------------------------------------------------------------
    def is_initialized(self) -> bool:
        return self.initialized

    def device_count(self) -> int:
        return len(self.devices)

    def device_uuid(self, device: int) -> str | None:
        return f"GPU-fake-{device:04d}" if self.initialized else None

    def counters(self, device: int) -> MemoryCounters:
        d = self.devices[device]
        return counters_of((d.allocated, d.peak, d.reserved, d.alloc_retries, d.ooms, d.device_allocs))

    def memory_allocated(self, device: int) -> int:
        return self.devices[device].allocated

    def memory_reserved(self, device: int) -> int:
        return self.devices[device].reserved

    def memory_stats(self, device: int) -> dict[str, Any]:
        d = self.devices[device]
        return {"allocated_bytes.all.current": d.allocated, "allocated_bytes.all.peak": d.peak,
                "reserved_bytes.all.current": d.reserved, "num_alloc_retries": d.alloc_retries,
                "num_ooms": d.ooms, "num_device_alloc": d.device_allocs}

    def reset_peak_memory_stats(self, device: int) -> None:
        self.reset_calls += 1
        d = self.devices[device]
        d.peak = d.allocated

    def snapshot(self) -> dict[str, Any]:
        self.snapshot_calls += 1
        if self.snapshot_delay_s:
            time.sleep(self.snapshot_delay_s)
        if self.snapshot_error is not None:
            raise self.snapshot_error
        with self._lock:
            segments = [{"device": i, "address": 0x7E0000000000 + i, "total_size": d.reserved, "stream": 0,
                         "segment_type": "large", "allocated_size": d.allocated, "active_size": d.allocated,
                         "blocks": [{"size": s, "requested_size": s, "address": a, "state": "active_allocated",
                                     "frames": []} for a, s in d.blocks.items()]}
                        for i, d in enumerate(self.devices) if d.reserved]
            return {"segments": segments, "device_traces": [list(d.trace) for d in self.devices],
                    "allocator_settings": {}}

    def record_memory_history(self, enabled: bool, stacks: str = "python", max_entries: int = 10_000) -> None:
        with self._lock:
            self.history_calls.append((enabled, stacks, max_entries))
            self.recording = enabled
            self.stacks = stacks
            if enabled:
                for d in self.devices:
                    d.trace = collections.deque(d.trace, maxlen=max_entries)
            elif self.clear_on_disable:
                for d in self.devices:
                    d.trace.clear()

    def set_memory_metadata(self, metadata: str) -> None:
        self._meta.value = metadata

    def attach_oom_observer(self, callback: Any) -> None:
        self._oom_callbacks.append(callback)

    def detach_oom_observer(self, callback: Any) -> None:
        if callback in self._oom_callbacks:
            self._oom_callbacks.remove(callback)


# -- NVML ------------------------------------------------------------------------------------------------
@dataclass
class FakeGpu:
    """One NVML device's readings (units as NVML returns them)."""

    uuid: str = "GPU-fake-0000"
    name: str = "NVIDIA H100 80GB HBM3"
    util_gpu: int = 37
    util_memory: int = 12
    memory_total: int = 80 << 30
    memory_used: int = 20 << 30
    bar1_total: int = 128 << 30
    bar1_used: int = 1 << 30
    power_mw: int = 250_000
    energy_mj: int = 1_000_000
    pcie_rx_kbs: int = 1000
    pcie_tx_kbs: int = 500
    sm_clock_mhz: int = 1980
    temperature_c: int = 55
    clock_reasons: int = pynvml.nvmlClocksEventReasonSwPowerCap
    processes: list[tuple[int, int | None]] = field(default_factory=list)
    gpm: bool = True
    gpm_values: dict[int, float] = field(default_factory=lambda: {
        pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: 40.0, pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 25.0,
        pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: 60.0})
    mig: list[FakeGpu] = field(default_factory=list)
    gpu_instance_id: int = 0


class _GpmMetricsGet:
    def __init__(self) -> None:
        self.version = 0
        self.numMetrics = 0
        self.sample1: Any = None
        self.sample2: Any = None
        self.metrics = [SimpleNamespace(metricId=0, nvmlReturn=-1, value=0.0) for _ in range(16)]


class FakeNvml:
    """A pynvml stand-in over :class:`FakeGpu` records.

    ``fail[(uuid, function_name)] = NVML error code`` makes that call raise the real pynvml exception
    (``"*"`` as uuid: every device; ``("*", "nvmlInit")`` for init). ``calls`` counts calls per function.
    """

    NVMLError = pynvml.NVMLError
    c_nvmlGpmMetricsGet_t = _GpmMetricsGet

    def __init__(self, gpus: list[FakeGpu] | None = None) -> None:
        self.gpus = gpus if gpus is not None else [FakeGpu()]
        self.fail: dict[tuple[str, str], int] = {}
        self.calls: collections.Counter[str] = collections.Counter()
        self.initialized = 0
        self.shutdowns = 0
        self.gpm_allocated = 0
        self.gpm_freed = 0

    def __getattr__(self, name: str) -> Any:  # constants (NVML_*, nvmlClocks*) come from the real module
        if name.startswith(("NVML_", "nvmlClocks")):
            return getattr(pynvml, name)
        raise AttributeError(name)

    def _call(self, fn: str, gpu: FakeGpu | None = None) -> None:
        self.calls[fn] += 1
        code = self.fail.get((gpu.uuid if gpu else "*", fn), self.fail.get(("*", fn)))
        if code is not None:
            raise pynvml.NVMLError(code)

    # library
    def nvmlInit(self) -> None:
        self._call("nvmlInit")
        self.initialized += 1

    def nvmlShutdown(self) -> None:
        self._call("nvmlShutdown")
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        self._call("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        self._call("nvmlDeviceGetHandleByIndex")
        return self.gpus[index]

    def nvmlDeviceGetUUID(self, h: FakeGpu) -> str:
        self._call("nvmlDeviceGetUUID", h)
        return h.uuid

    def nvmlDeviceGetName(self, h: FakeGpu) -> str:
        self._call("nvmlDeviceGetName", h)
        return h.name

    # fields
    def nvmlDeviceGetUtilizationRates(self, h: FakeGpu) -> Any:
        self._call("nvmlDeviceGetUtilizationRates", h)
        return SimpleNamespace(gpu=h.util_gpu, memory=h.util_memory)

    def nvmlDeviceGetMemoryInfo(self, h: FakeGpu) -> Any:
        self._call("nvmlDeviceGetMemoryInfo", h)
        return SimpleNamespace(total=h.memory_total, used=h.memory_used, free=h.memory_total - h.memory_used)

    def nvmlDeviceGetBAR1MemoryInfo(self, h: FakeGpu) -> Any:
        self._call("nvmlDeviceGetBAR1MemoryInfo", h)
        return SimpleNamespace(bar1Total=h.bar1_total, bar1Used=h.bar1_used, bar1Free=h.bar1_total - h.bar1_used)

    def nvmlDeviceGetPowerUsage(self, h: FakeGpu) -> int:
        self._call("nvmlDeviceGetPowerUsage", h)
        return h.power_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, h: FakeGpu) -> int:
        self._call("nvmlDeviceGetTotalEnergyConsumption", h)
        return h.energy_mj

    def nvmlDeviceGetPcieThroughput(self, h: FakeGpu, counter: int) -> int:
        self._call("nvmlDeviceGetPcieThroughput", h)
        return h.pcie_rx_kbs if counter == pynvml.NVML_PCIE_UTIL_RX_BYTES else h.pcie_tx_kbs

    def nvmlDeviceGetClockInfo(self, h: FakeGpu, clock: int) -> int:
        self._call("nvmlDeviceGetClockInfo", h)
        assert clock == pynvml.NVML_CLOCK_SM
        return h.sm_clock_mhz

    def nvmlDeviceGetTemperature(self, h: FakeGpu, sensor: int) -> int:
        self._call("nvmlDeviceGetTemperature", h)
        return h.temperature_c

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: FakeGpu) -> int:
        self._call("nvmlDeviceGetCurrentClocksEventReasons", h)
        return h.clock_reasons

    def nvmlDeviceGetComputeRunningProcesses(self, h: FakeGpu) -> list[Any]:
        self._call("nvmlDeviceGetComputeRunningProcesses", h)
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in h.processes]

    # MIG
    def nvmlDeviceGetMigMode(self, h: FakeGpu) -> list[int]:
        self._call("nvmlDeviceGetMigMode", h)
        return [1 if h.mig else 0, 1 if h.mig else 0]

    def nvmlDeviceGetMaxMigDeviceCount(self, h: FakeGpu) -> int:
        self._call("nvmlDeviceGetMaxMigDeviceCount", h)
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: FakeGpu, index: int) -> FakeGpu:
        self._call("nvmlDeviceGetMigDeviceHandleByIndex", h)
        if index >= len(h.mig):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return h.mig[index]

    def nvmlDeviceGetGpuInstanceId(self, h: FakeGpu) -> int:
        self._call("nvmlDeviceGetGpuInstanceId", h)
        return h.gpu_instance_id

    # GPM
    def nvmlGpmQueryDeviceSupport(self, h: FakeGpu) -> Any:
        self._call("nvmlGpmQueryDeviceSupport", h)
        return SimpleNamespace(version=1, isSupportedDevice=int(h.gpm))

    def nvmlGpmSampleAlloc(self) -> Any:
        self._call("nvmlGpmSampleAlloc")
        self.gpm_allocated += 1
        return SimpleNamespace(gpu=None)

    def nvmlGpmSampleFree(self, sample: Any) -> None:
        self._call("nvmlGpmSampleFree")
        self.gpm_freed += 1

    def nvmlGpmSampleGet(self, h: FakeGpu, sample: Any) -> Any:
        self._call("nvmlGpmSampleGet", h)
        sample.gpu = h
        return sample

    def nvmlGpmMigSampleGet(self, h: FakeGpu, gpu_instance_id: int, sample: Any) -> Any:
        self._call("nvmlGpmMigSampleGet", h)
        sample.gpu = next(m for m in h.mig if m.gpu_instance_id == gpu_instance_id)
        return sample

    def nvmlGpmMetricsGet(self, request: Any) -> Any:
        gpu = request.sample2.gpu
        self._call("nvmlGpmMetricsGet", gpu)
        assert request.sample1.gpu is gpu and request.version == pynvml.NVML_GPM_METRICS_GET_VERSION
        for metric in request.metrics[:request.numMetrics]:
            if metric.metricId in gpu.gpm_values:
                metric.value, metric.nvmlReturn = gpu.gpm_values[metric.metricId], pynvml.NVML_SUCCESS
            else:
                metric.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return request
