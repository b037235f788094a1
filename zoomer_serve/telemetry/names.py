"""Every name that GPU telemetry writes: span attributes, span events and metrics, with unit and source.

One place for each name; code and docs refer to these constants. Units follow UCUM as OpenTelemetry uses
it (``By`` bytes, ``1`` ratio in [0, 1], ``W``, ``J``, ``MHz``, ``Cel``).

Request span attributes (set by :class:`~zoomer_serve.telemetry.memory.GpuMemoryObserver`; values are sums
over the watched CUDA devices, and with more than one device each also comes per device as an int list
named ``<name>.by_device`` in the order of :data:`GPU_DEVICES`):

| attribute | unit | source (torch caching allocator of this process) |
| --- | --- | --- |
| ``zoomer.gpu.devices`` | int list | the watched CUDA device indices |
| ``zoomer.gpu.memory.allocated.start`` / ``.end`` | By | ``memory_stats()["allocated_bytes.all.current"]`` at start / end |
| ``zoomer.gpu.memory.reserved.start`` / ``.end`` | By | ``memory_stats()["reserved_bytes.all.current"]`` at start / end |
| ``zoomer.gpu.memory.peak`` | By | ``memory_stats()["allocated_bytes.all.peak"]`` over the request's window |
| ``zoomer.gpu.memory.peak.shared`` | bool | another request was in flight during the window: the peak is the device's |
| ``zoomer.gpu.memory.alloc_retries`` | {retry} | delta of ``num_alloc_retries`` (cudaMalloc failed, cache flushed, retried) |
| ``zoomer.gpu.memory.ooms`` | {oom} | delta of ``num_ooms`` |
| ``zoomer.gpu.memory.device_allocs`` | {call} | delta of ``num_device_alloc`` (cudaMalloc / cuMemMap: the slow path) |
| ``zoomer.gpu.utilization`` | 1 | latest NVML sample (``nvmlDeviceGetUtilizationRates().gpu / 100``) at span end, max over devices |
"""

from __future__ import annotations

from typing import Final

PREFIX: Final = "zoomer.gpu."

# -- request span attributes -------------------------------------------------------------------------
GPU_DEVICES: Final = "zoomer.gpu.devices"
MEM_ALLOCATED_START: Final = "zoomer.gpu.memory.allocated.start"
MEM_ALLOCATED_END: Final = "zoomer.gpu.memory.allocated.end"
MEM_RESERVED_START: Final = "zoomer.gpu.memory.reserved.start"
MEM_RESERVED_END: Final = "zoomer.gpu.memory.reserved.end"
MEM_PEAK: Final = "zoomer.gpu.memory.peak"
MEM_PEAK_SHARED: Final = "zoomer.gpu.memory.peak.shared"
MEM_ALLOC_RETRIES: Final = "zoomer.gpu.memory.alloc_retries"
MEM_OOMS: Final = "zoomer.gpu.memory.ooms"
MEM_DEVICE_ALLOCS: Final = "zoomer.gpu.memory.device_allocs"
GPU_UTILIZATION: Final = "zoomer.gpu.utilization"
BY_DEVICE_SUFFIX: Final = ".by_device"

# -- out of memory: span event and error type --------------------------------------------------------
OOM_EVENT: Final = "zoomer.gpu.oom"
OOM_DEVICE: Final = "zoomer.gpu.oom.device"
OOM_REQUESTED_BYTES: Final = "zoomer.gpu.oom.requested_bytes"
OOM_DEVICE_FREE_BYTES: Final = "zoomer.gpu.oom.device_free_bytes"
OOM_DEVICE_LIMIT_BYTES: Final = "zoomer.gpu.oom.device_limit_bytes"
OOM_ERROR_TYPE: Final = "torch.OutOfMemoryError"

# -- allocation events (child span of the request) ---------------------------------------------------
EVENTS_SPAN: Final = "zoomer.gpu.memory.events"
EVENTS_PREFIX: Final = "zoomer.gpu.memory.events."
ACTIONS: Final = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "oom")
EVENT_NAME: Final = "zoomer.gpu.memory.event"
EVENT_ACTION: Final = "zoomer.gpu.memory.event.action"
EVENT_SIZE: Final = "zoomer.gpu.memory.event.size"
EVENT_DEVICE: Final = "zoomer.gpu.memory.event.device"
EVENT_STREAM: Final = "zoomer.gpu.memory.event.stream"
EVENT_ADDR: Final = "zoomer.gpu.memory.event.addr"


def action_count(action: str) -> str:
    """``zoomer.gpu.memory.events.<action>.count``: number of trace entries of ``action``."""
    return f"{EVENTS_PREFIX}{action}.count"


def action_bytes(action: str) -> str:
    """``zoomer.gpu.memory.events.<action>.bytes``: sum of the entries' ``size`` (By)."""
    return f"{EVENTS_PREFIX}{action}.bytes"


# -- metrics: OpenTelemetry hardware semantic conventions ---------------------------------------------
HW_ID: Final = "hw.id"
HW_TYPE: Final = "hw.type"
HW_NAME: Final = "hw.name"
HW_PARENT: Final = "hw.parent"
HW_GPU_TASK: Final = "hw.gpu.task"
NETWORK_IO_DIRECTION: Final = "network.io.direction"

HW_GPU_UTILIZATION: Final = "hw.gpu.utilization"
HW_GPU_MEMORY_USAGE: Final = "hw.gpu.memory.usage"
HW_GPU_MEMORY_LIMIT: Final = "hw.gpu.memory.limit"
HW_GPU_MEMORY_UTILIZATION: Final = "hw.gpu.memory.utilization"
HW_GPU_IO: Final = "hw.gpu.io"
HW_POWER: Final = "hw.power"
HW_ENERGY: Final = "hw.energy"

# -- metrics: extras where no convention exists -------------------------------------------------------
GPU_MEMORY_BUSY: Final = "zoomer.gpu.memory.busy"
GPU_CLOCK_SM: Final = "zoomer.gpu.clock.sm"
GPU_TEMPERATURE: Final = "zoomer.gpu.temperature"
GPU_CLOCK_EVENT_ACTIVE: Final = "zoomer.gpu.clock_event.active"
CLOCK_EVENT_REASON: Final = "zoomer.gpu.clock_event.reason"
GPU_PROCESS_MEMORY_USAGE: Final = "zoomer.gpu.process.memory.usage"
GPU_BAR1_MEMORY_USAGE: Final = "zoomer.gpu.bar1.memory.usage"
GPU_BAR1_MEMORY_LIMIT: Final = "zoomer.gpu.bar1.memory.limit"
GPU_SM_OCCUPANCY: Final = "zoomer.gpu.sm.occupancy"
GPU_TENSOR_ACTIVITY: Final = "zoomer.gpu.tensor.activity"
GPU_DRAM_BANDWIDTH_UTILIZATION: Final = "zoomer.gpu.dram.bandwidth.utilization"
NVML_UNSUPPORTED: Final = "zoomer.gpu.nvml.unsupported"
NVML_FIELD: Final = "zoomer.gpu.nvml.field"
GPU_OOM_COUNT: Final = "zoomer.gpu.memory.oom"
EVENTS_UNATTRIBUTED: Final = "zoomer.gpu.memory.events.unattributed"
HISTORY_OVERRUNS: Final = "zoomer.gpu.memory.history.overruns"
PROCESS_PID: Final = "process.pid"
