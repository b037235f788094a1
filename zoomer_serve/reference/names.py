"""Every name zoomer-serve emits (span names, span and event attributes, metric names and their attributes,
resource attributes), with its unit and what it holds: the one machine-readable place for units of names that
have no instrument of their own. Names come from the code's constants where one exists, so a rename there
shows here and in the generated ``docs/reference/names.md`` (see :mod:`zoomer_serve.reference`).

``tests/test_docs_reference.py`` scans ``zoomer_serve/`` and ``interceptors/`` for names in the namespaces of
:data:`NAMESPACES` and fails on one that is neither in :data:`NAMES` nor in :data:`NOT_EMITTED`, and on an
entry of :data:`NAMES` that no code holds. A name with a ``<placeholder>`` is a family; its ``evidence`` is the
literal (or f-string pattern) in the code that builds it.
"""

from __future__ import annotations

from dataclasses import dataclass

from zoomer_serve.batching import names as bn
from zoomer_serve.host import names as hn
from zoomer_serve.telemetry import names as tn


@dataclass(frozen=True)
class Name:
    """One emitted name. ``kind``: one of :data:`KINDS`; ``unit``: UCUM as OpenTelemetry writes it (``By``,
    ``s``, ``ns``, ``1`` for a ratio, ``{thing}`` for a count; "" for text, booleans and identifiers);
    ``on``: where it appears; ``meaning``: Markdown; ``evidence``: for a family, what the code holds."""

    name: str
    kind: str
    unit: str
    on: str
    meaning: str
    group: str
    evidence: str = ""


KINDS = ("span", "span attribute", "span event", "event attribute", "link attribute", "metric",
         "metric attribute", "resource attribute")
NAMESPACES = ("zoomer.", "rpc.", "hw.", "network.", "server.", "error.", "exception.", "messaging.", "otel.",
              "system.", "process.", "cpython.", "service.", "host.", "telemetry.", "cpu.", "disk.", "k8s.",
              "container.")
"""Prefixes of the names the scan looks for (OpenTelemetry semantic-convention namespaces and ours)."""

_REMOVED = "removed from RPC spans by the semantic conventions (`zoomer_serve.semconv.REMOVED`): never emitted"

NOT_EMITTED: dict[str, str] = {
    "zoomer.duckdb": "a file name (the default store)",
    "zoomer.internal.dropped": "an internal key of span records; the encoder turns it into dropped counts",
    "system.network.dropped.packets": "the system-metrics instrumentation's configuration key; the metric "
                                      "is emitted as `system.network.dropped_packets`",
    "host.id": "read from other processes' resources by the fleet job",
    "host.ip": "read from other processes' resources by the fleet job",
    "k8s.pod.ip": "read from other processes' resources by the fleet job",
    "k8s.pod.name": "read from other processes' resources by the fleet job",
    "k8s.pod.uid": "read from other processes' resources by the fleet job",
    "container.id": "read from other processes' resources by the fleet job",
    "process.parent_pid": "read from other processes' resources by the fleet job",
    "service.version": "only in the fleet job's synthetic test data",
    "network.type": _REMOVED,
    "network.transport": _REMOVED,
    "network.protocol.name": _REMOVED,
    "network.protocol.version": _REMOVED,
    "zoomer.requests": "a key inside our speedscope files (their request table), not a telemetry name",
}
"""Names the code holds but does not emit, with the reason."""

_RPC = "RPC: request spans and metrics"
_PHASE = "Phases"
_RES = "Resource"
_EXP = "Export"
_GPU = "GPU telemetry: request spans"
_GPUM = "GPU telemetry: NVML metrics"
_HIST = "GPU telemetry: out of memory and allocation history"
_HOST = "Host telemetry"
_PROF = "Kernel profiling"
_CPU = "Kernel profiling: Python CPU profile"
_BATCH = "Dynamic batching"
_THRIFT = "Thrift"

_SERVER = "SERVER and CLIENT spans"
_METRICS = "RPC metrics"
_BOTH = f"{_SERVER}, {_METRICS}"
_PROFILE = "`zoomer.profile` span"
_PREQ = "`zoomer.profile.request` span"
_BOTHP = f"{_PROFILE}, {_PREQ}"
_NVML = "NVML metrics"

NAMES: tuple[Name, ...] = (
    # -- RPC ------------------------------------------------------------------------------------------------------
    Name("rpc.system.name", "span attribute", "", _BOTH, "`grpc` or `thrift`", _RPC),
    Name("rpc.method", "span attribute", "", _BOTH, "`pkg.Service/Method` (`_OTHER` for a method the server "
         "lacks)", _RPC),
    Name("rpc.response.status_code", "span attribute", "", _BOTH, "status code name: `OK`, `INVALID_ARGUMENT`, ...",
         _RPC),
    Name("error.type", "span attribute", "", _BOTH, "code name of a server error, or the exception type", _RPC),
    Name("server.address", "span attribute", "", _BOTH, "as passed to the interceptor", _RPC),
    Name("server.port", "span attribute", "", _BOTH, "as passed to the interceptor", _RPC),
    Name("network.peer.address", "span attribute", "", _SERVER, "the peer (`context.peer()`)", _RPC),
    Name("network.peer.port", "span attribute", "", _SERVER, "the peer's port", _RPC),
    Name("rpc.status_code", "span attribute", "", _BOTH, "the unreleased conventions' name of "
         "`rpc.response.status_code`: instead of it with `OTEL_SEMCONV_STABILITY_OPT_IN=rpc`, beside it with "
         "`rpc/dup`", _RPC),
    Name("rpc.system", "span attribute", "", _SERVER, "older name, with `OTEL_SEMCONV_STABILITY_OPT_IN=rpc/dup`",
         _RPC),
    Name("rpc.service", "span attribute", "", _SERVER, "older name, with `OTEL_SEMCONV_STABILITY_OPT_IN=rpc/dup`",
         _RPC),
    Name("rpc.grpc.status_code", "span attribute", "", _SERVER, "older name (int), with "
         "`OTEL_SEMCONV_STABILITY_OPT_IN=rpc/dup`", _RPC),
    Name("zoomer.rpc.request.messages", "span attribute", "{message}", _SERVER, "messages received", _RPC),
    Name("zoomer.rpc.response.messages", "span attribute", "{message}", _SERVER, "messages sent", _RPC),
    Name("zoomer.rpc.request.bytes", "span attribute", "By", _SERVER, "uncompressed size of the request messages, "
         "summed", _RPC),
    Name("zoomer.rpc.response.bytes", "span attribute", "By", _SERVER, "uncompressed size of the response "
         "messages, summed", _RPC),
    Name("exception", "span event", "", _SERVER, "a handler's exception (re-raised unchanged)", _RPC,
         evidence="exception"),
    Name("exception.type", "event attribute", "", "`exception` event", "the exception's type", _RPC),
    Name("exception.message", "event attribute", "", "`exception` event", "its message (bounded by "
         "`ZOOMER_EXCEPTION_VALUE_LENGTH_LIMIT`)", _RPC),
    Name("exception.stacktrace", "event attribute", "", "`exception` event", "its stack trace (bounded likewise)",
         _RPC),
    Name("rpc.<side>.call.duration", "metric", "s", "histogram", "`rpc.server.call.duration` / "
         "`rpc.client.call.duration`: every call, sampled or not; buckets 5 ms to 10 s", _RPC,
         evidence="rpc.*.call.duration"),
    Name("rpc.<side>.request.size", "metric", "By", "histogram", "`rpc.server.request.size` / "
         "`rpc.client.request.size`: payload bytes of all request messages of a call (deprecated in v1.40: "
         "only with `OTEL_SEMCONV_STABILITY_OPT_IN=rpc/dup`)", _RPC,
         evidence="rpc.*.request.size"),
    Name("rpc.<side>.response.size", "metric", "By", "histogram", "`rpc.server.response.size` / "
         "`rpc.client.response.size`: payload bytes of all response messages of a call (deprecated in "
         "v1.40: only with `OTEL_SEMCONV_STABILITY_OPT_IN=rpc/dup`)", _RPC,
         evidence="rpc.*.response.size"),
    # -- phases ---------------------------------------------------------------------------------------------------
    Name("zoomer.phase", "span attribute", "", "phase spans (INTERNAL)", "the phase's name "
         "(`zoomer_serve.phase(name)`)", _PHASE),
    # -- Thrift ---------------------------------------------------------------------------------------------------
    Name("zoomer.rpc.thrift.seqid", "span attribute", "", _SERVER, "the Thrift message's sequence id", _THRIFT),
    Name("zoomer.rpc.thrift.oneway", "span attribute", "", _SERVER, "true for a oneway call", _THRIFT),
    Name("zoomer.rpc.business_error", "span attribute", "", _SERVER, "the declared (IDL `throws`) exception a "
         "handler raised; status stays UNSET", _THRIFT),
    Name("rpc.method_original", "span attribute", "", _SERVER, "the method name as called, when `rpc.method` is "
         "`_OTHER`", _THRIFT),
    Name("zoomer.rpc.server.protocol_errors", "metric", "{error}", "observable counter", "connections closed "
         "for bad bytes on the wire, by `error.type` (e.g. `message_too_large`)", _THRIFT),
    # -- resource -------------------------------------------------------------------------------------------------
    Name("service.name", "resource attribute", "", "every span and metric", "`OTEL_SERVICE_NAME`", _RES),
    Name("service.instance.id", "resource attribute", "", "every span and metric", "a UUID per process", _RES),
    Name("host.name", "resource attribute", "", "every span and metric", "`socket.gethostname()`", _RES),
    Name("process.pid", "resource attribute", "", "every span and metric; also an attribute of "
         "`zoomer.gpu.process.memory.usage`", "the process id", _RES),
    Name("process.runtime.name", "resource attribute", "", "every span and metric", "`cpython`", _RES),
    Name("process.runtime.version", "resource attribute", "", "every span and metric", "the Python version", _RES),
    Name("telemetry.sdk.name", "resource attribute", "", "every span and metric", "`zoomer-serve`", _RES),
    Name("telemetry.sdk.language", "resource attribute", "", "every span and metric", "`python`", _RES),
    Name("telemetry.sdk.version", "resource attribute", "", "every span and metric", "zoomer-serve's version", _RES),
    Name("zoomer.torch.version", "resource attribute", "", "every span and metric (a process with torch)",
         "`torch.__version__`", _RES),
    Name("zoomer.gpu.model", "resource attribute", "", "every span and metric (with CUDA)",
         "`torch.cuda.get_device_name(0)`", _RES),
    Name("zoomer.gpu.count", "resource attribute", "{device}", "every span and metric (with CUDA)",
         "`torch.cuda.device_count()`", _RES),
    Name("zoomer.gpu.driver_version", "resource attribute", "", "every span and metric (with CUDA)",
         "the NVIDIA driver's version", _RES),
    # -- export ---------------------------------------------------------------------------------------------------
    Name("otel.sdk.exporter.span.exported", "metric", "{span}", "counter", "spans whose export finished; with "
         "`error.type` (`rejected`, `too_large`, `export_failed`, `queue_full`, `helper_lost`) those lost", _EXP),
    Name("otel.sdk.exporter.metric_data_point.exported", "metric", "{data_point}", "counter",
         "the same for metric data points", _EXP),
    Name("zoomer.exporter.call.dropped", "metric", "{call}", "counter",
         "calls missing from `rpc.server.call.duration` (and the other call metrics) because their records were "
         "lost on the way to the exporter, by `error.type`: `queue_full`, `too_large`, `helper_lost` (an export "
         "helper process died before a metric export covered them); calls in the metric + these = calls answered",
         _EXP),
    # -- GPU: request spans ---------------------------------------------------------------------------------------
    Name(tn.GPU_DEVICES, "span attribute", "", "SERVER span", "the watched CUDA device indices (int list)", _GPU),
    Name(tn.MEM_ALLOCATED_START, "span attribute", "By", "SERVER span",
         "`memory_stats()[\"allocated_bytes.all.current\"]` at the start", _GPU),
    Name(tn.MEM_ALLOCATED_END, "span attribute", "By", "SERVER span", "the same at the end", _GPU),
    Name(tn.MEM_RESERVED_START, "span attribute", "By", "SERVER span",
         "`memory_stats()[\"reserved_bytes.all.current\"]` at the start", _GPU),
    Name(tn.MEM_RESERVED_END, "span attribute", "By", "SERVER span", "the same at the end", _GPU),
    Name(tn.MEM_PEAK, "span attribute", "By", "SERVER span", "the device's allocated peak over the request's "
         "window", _GPU),
    Name(tn.MEM_PEAK_SHARED, "span attribute", "", "SERVER span", "true when another request was in flight "
         "during the window", _GPU),
    Name(tn.MEM_ALLOC_RETRIES, "span attribute", "{retry}", "SERVER span", "delta of `num_alloc_retries`", _GPU),
    Name(tn.MEM_OOMS, "span attribute", "{oom}", "SERVER span", "delta of `num_ooms`", _GPU),
    Name(tn.MEM_DEVICE_ALLOCS, "span attribute", "{call}", "SERVER span", "delta of `num_device_alloc` "
         "(cudaMalloc / cuMemMap)", _GPU),
    Name(tn.GPU_UTILIZATION, "span attribute", "1", "SERVER span", "latest NVML utilization sample at the span's "
         "end, max over devices", _GPU),
    Name(f"<attribute>{tn.BY_DEVICE_SUFFIX}", "span attribute", "as the attribute", "SERVER span",
         "each `zoomer.gpu.memory.*` figure per device (int list), with more than one device", _GPU,
         evidence=tn.BY_DEVICE_SUFFIX),
    # -- GPU: OOM and history ---------------------------------------------------------------------------------------
    Name(tn.OOM_EVENT, "span event", "", "SERVER span", "the request's allocation failed with CUDA out of memory",
         _HIST),
    Name(tn.OOM_DEVICE, "event attribute", "", "`zoomer.gpu.oom` event", "the CUDA index", _HIST),
    Name(tn.OOM_REQUESTED_BYTES, "event attribute", "By", "`zoomer.gpu.oom` event", "the failed request's size",
         _HIST),
    Name(tn.OOM_DEVICE_FREE_BYTES, "event attribute", "By", "`zoomer.gpu.oom` event", "CUDA's free memory", _HIST),
    Name(tn.OOM_DEVICE_LIMIT_BYTES, "event attribute", "By", "`zoomer.gpu.oom` event",
         "device total, or the `set_per_process_memory_fraction` limit", _HIST),
    Name(tn.GPU_OOM_COUNT, "metric", "{oom}", "counter", "CUDA out-of-memory errors, by `hw.id`", _HIST),
    Name(tn.EVENTS_SPAN, "span", "", "child of a request (or batch) span", "the allocator events of one request, "
         "from its first to its last entry", _HIST),
    Name(f"{tn.EVENTS_PREFIX}<action>.count", "span attribute", "{entry}", "`zoomer.gpu.memory.events` span",
         "entries of each action (`" + "`, `".join(tn.ACTIONS) + "`)", _HIST, evidence=tn.EVENTS_PREFIX),
    Name(f"{tn.EVENTS_PREFIX}<action>.bytes", "span attribute", "By", "`zoomer.gpu.memory.events` span",
         "sum of the entries' `size`", _HIST, evidence=tn.EVENTS_PREFIX),
    Name(tn.EVENT_NAME, "span event", "", "`zoomer.gpu.memory.events` span", "one of the largest entries", _HIST),
    Name(tn.EVENT_ACTION, "event attribute", "", "`zoomer.gpu.memory.event` event", "the entry's action", _HIST),
    Name(tn.EVENT_SIZE, "event attribute", "By", "`zoomer.gpu.memory.event` event", "the entry's size", _HIST),
    Name(tn.EVENT_DEVICE, "event attribute", "", "`zoomer.gpu.memory.event` event", "the CUDA index", _HIST),
    Name(tn.EVENT_STREAM, "event attribute", "", "`zoomer.gpu.memory.event` event", "the CUDA stream", _HIST),
    Name(tn.EVENT_ADDR, "event attribute", "", "`zoomer.gpu.memory.event` event", "the address (`device_free` for "
         "`oom`)", _HIST),
    Name(tn.EVENTS_UNATTRIBUTED, "metric", "{entry}", "observable counter", "entries without a known request tag",
         _HIST),
    Name(tn.HISTORY_OVERRUNS, "metric", "{drain}", "observable counter", "drains that found the ring buffer "
         "wrapped past unread entries", _HIST),
    # -- GPU: NVML ----------------------------------------------------------------------------------------------
    Name(tn.HW_ID, "metric attribute", "", _NVML, "NVML UUID (`GPU-...` / `MIG-...`)", _GPUM),
    Name(tn.HW_TYPE, "metric attribute", "", _NVML, "`gpu`", _GPUM),
    Name(tn.HW_NAME, "metric attribute", "", _NVML, "the device's name", _GPUM),
    Name(tn.HW_PARENT, "metric attribute", "", _NVML, "a MIG instance's GPU UUID", _GPUM),
    Name(tn.HW_GPU_TASK, "metric attribute", "", "`hw.gpu.utilization`", "`general`", _GPUM),
    Name(tn.NETWORK_IO_DIRECTION, "metric attribute", "", "`hw.gpu.io`, `system.network.*`",
         "`receive` / `transmit`", _GPUM),
    Name(tn.HW_GPU_UTILIZATION, "metric", "1", "gauge", "`nvmlDeviceGetUtilizationRates().gpu / 100`", _GPUM),
    Name(tn.HW_GPU_MEMORY_USAGE, "metric", "By", "up-down counter", "`nvmlDeviceGetMemoryInfo().used`", _GPUM),
    Name(tn.HW_GPU_MEMORY_LIMIT, "metric", "By", "up-down counter", "`nvmlDeviceGetMemoryInfo().total`", _GPUM),
    Name(tn.HW_GPU_MEMORY_UTILIZATION, "metric", "1", "gauge", "used / total", _GPUM),
    Name(tn.HW_GPU_IO, "metric", "By", "counter", "PCIe throughput x seconds between samples (an estimate)", _GPUM),
    Name(tn.HW_POWER, "metric", "W", "gauge", "`nvmlDeviceGetPowerUsage` / 1000", _GPUM),
    Name(tn.HW_ENERGY, "metric", "J", "counter", "`nvmlDeviceGetTotalEnergyConsumption` / 1000", _GPUM),
    Name(tn.GPU_MEMORY_BUSY, "metric", "1", "gauge", "time device memory was read or written", _GPUM),
    Name(tn.GPU_CLOCK_SM, "metric", "MHz", "gauge", "SM clock", _GPUM),
    Name(tn.GPU_TEMPERATURE, "metric", "Cel", "gauge", "GPU temperature", _GPUM),
    Name(tn.GPU_CLOCK_EVENT_ACTIVE, "metric", "1", "gauge", "1 while a clock event (throttle reason) is active",
         _GPUM),
    Name(tn.CLOCK_EVENT_REASON, "metric attribute", "", "`zoomer.gpu.clock_event.active`", "the reason "
         "(`sw_power_cap`, `hw_slowdown`, ...)", _GPUM),
    Name(tn.GPU_PROCESS_MEMORY_USAGE, "metric", "By", "up-down counter", "this process's `usedGpuMemory`", _GPUM),
    Name(tn.GPU_BAR1_MEMORY_USAGE, "metric", "By", "up-down counter", "BAR1 memory used", _GPUM),
    Name(tn.GPU_BAR1_MEMORY_LIMIT, "metric", "By", "up-down counter", "BAR1 memory total", _GPUM),
    Name(tn.GPU_SM_OCCUPANCY, "metric", "1", "gauge", "GPM SM occupancy (Hopper or newer)", _GPUM),
    Name(tn.GPU_TENSOR_ACTIVITY, "metric", "1", "gauge", "GPM tensor-core activity", _GPUM),
    Name(tn.GPU_DRAM_BANDWIDTH_UTILIZATION, "metric", "1", "gauge", "GPM DRAM bandwidth utilization", _GPUM),
    Name(tn.NVML_UNSUPPORTED, "metric", "1", "gauge", "1 for each field the device does not answer", _GPUM),
    Name(tn.NVML_FIELD, "metric attribute", "", "`zoomer.gpu.nvml.unsupported`", "the field", _GPUM),
    # -- host ---------------------------------------------------------------------------------------------------
    Name(hn.REQUEST_CPU_TIME, "span attribute", "ns", "SERVER span", "the thread's CPU time between the span's "
         "start and end (same OS thread only)", _HOST),
    Name("system.cpu.time", "metric", "s", "counter", "per `cpu.mode` and `cpu.logical_number`", _HOST),
    Name("system.cpu.utilization", "metric", "1", "gauge", "per `cpu.mode` and `cpu.logical_number`", _HOST),
    Name("process.cpu.time", "metric", "s", "counter", "per `cpu.mode`", _HOST),
    Name("process.cpu.utilization", "metric", "1", "gauge", "this process", _HOST),
    Name("system.memory.usage", "metric", "By", "up-down counter", "per `system.memory.state`", _HOST),
    Name("system.memory.utilization", "metric", "1", "gauge", "per `system.memory.state`", _HOST),
    Name("system.swap.usage", "metric", "By", "up-down counter", "per `system.paging.state`", _HOST),
    Name("system.swap.utilization", "metric", "1", "gauge", "per `system.paging.state`", _HOST),
    Name("process.memory.usage", "metric", "By", "up-down counter", "resident set size", _HOST),
    Name("process.memory.virtual", "metric", "By", "up-down counter", "virtual memory", _HOST),
    Name("system.disk.io", "metric", "By", "counter", "per `system.device`, `disk.io.direction`", _HOST),
    Name("system.disk.operations", "metric", "{operation}", "counter", "per `system.device`, `disk.io.direction`",
         _HOST),
    Name("system.disk.time", "metric", "s", "counter", "per `system.device`, `disk.io.direction`", _HOST),
    Name("process.disk.io", "metric", "By", "counter", "per `disk.io.direction`", _HOST),
    Name("system.network.io", "metric", "By", "counter", "per `network.interface.name`, `network.io.direction`",
         _HOST),
    Name("system.network.errors", "metric", "{error}", "counter", "per interface and direction", _HOST),
    Name("system.network.packets", "metric", "{packet}", "counter", "per interface and direction", _HOST),
    Name("system.network.dropped_packets", "metric", "{packet}", "counter", "per interface and direction", _HOST),
    Name("process.open_file_descriptor.count", "metric", "{file_descriptor}", "up-down counter",
         "open file descriptors", _HOST),
    Name("process.thread.count", "metric", "{thread}", "up-down counter", "threads", _HOST),
    Name("process.context_switches", "metric", "{context_switch}", "counter", "per "
         "`process.context_switch_type`", _HOST),
    Name("cpython.gc.collections", "metric", "{collection}", "counter", "per `cpython.gc.generation`", _HOST),
    Name("cpython.gc.collected_objects", "metric", "{object}", "counter", "per `cpython.gc.generation`", _HOST),
    Name("cpython.gc.uncollectable_objects", "metric", "{object}", "counter", "per `cpython.gc.generation`", _HOST),
    Name(hn.GC_PAUSE_TIME, "metric", "s", "observable counter", "time inside the garbage collector "
         "(`gc.callbacks`), per `cpython.gc.generation`", _HOST),
    Name("cpu.mode", "metric attribute", "", "CPU time metrics", "`user`, `system`, `idle`, ...", _HOST),
    Name("cpu.logical_number", "metric attribute", "", "system CPU metrics", "the core (0-based)", _HOST),
    Name("system.memory.state", "metric attribute", "", "system memory metrics", "`used`, `free`, `cached`, "
         "`buffers`", _HOST),
    Name("system.paging.state", "metric attribute", "", "swap metrics", "`used`, `free`", _HOST),
    Name("system.device", "metric attribute", "", "disk metrics", "the disk", _HOST),
    Name("disk.io.direction", "metric attribute", "", "disk metrics", "`read` / `write`", _HOST),
    Name("network.interface.name", "metric attribute", "", "network metrics", "the interface", _HOST),
    Name("process.context_switch_type", "metric attribute", "", "`process.context_switches`", "`voluntary` / "
         "`involuntary`", _HOST),
    Name(hn.GC_GENERATION, "metric attribute", "", "GC metrics", "0, 1 or 2", _HOST),
    # -- profiling ----------------------------------------------------------------------------------------------
    Name("zoomer.profile", "span", "", "a trace of its own", "one profiling session, linked to every covered "
         "request span", _PROF),
    Name("zoomer.profile.request", "span", "", "child of each covered request span", "that request's part of the "
         "trace", _PROF),
    Name("zoomer.profile.session_id", "span attribute", "", _BOTHP, "the session", _PROF),
    Name("zoomer.profile.trigger", "span attribute", "", _PROFILE + "; `zoomer.profile.sessions`",
         "what started it (`on_demand`, `steady_state`, `latency_slo`, `load_test`, `request`, `latency_threshold`)", _PROF),
    Name("zoomer.profile.trigger.<key>", "span attribute", "", _PROFILE, "the trigger's details "
         "(e.g. `threshold_ms`)", _PROF, evidence="zoomer.profile.trigger.*"),
    Name("zoomer.profile.max_requests", "span attribute", "{request}", _PROFILE, "the session's request bound",
         _PROF),
    Name("zoomer.profile.duration_ms", "span attribute", "ms", _PROFILE, "the session's time bound", _PROF),
    Name("zoomer.profile.stop_reason", "span attribute", "", _PROFILE, "why it stopped", _PROF),
    Name("zoomer.profile.activities", "span attribute", "", _PROFILE, "`cpu`, `cuda`", _PROF),
    Name("zoomer.profile.record_shapes", "span attribute", "", _PROFILE, "torch.profiler option", _PROF),
    Name("zoomer.profile.profile_memory", "span attribute", "", _PROFILE, "torch.profiler option", _PROF),
    Name("zoomer.profile.with_stack", "span attribute", "", _PROFILE, "torch.profiler option", _PROF),
    Name("zoomer.profile.with_flops", "span attribute", "", _PROFILE, "torch.profiler option", _PROF),
    Name("zoomer.profile.requests", "span attribute", "{request}", _PROFILE, "requests covered", _PROF),
    Name("zoomer.profile.requests.incomplete", "span attribute", "{request}", _PROFILE,
         "admitted but still running when the profiler stopped", _PROF),
    Name("zoomer.profile.trace.path", "span attribute", "", _BOTHP, "the `.pt.trace.json.gz` file", _PROF),
    Name("zoomer.profile.trace.bytes", "span attribute", "By", _PROFILE, "its size", _PROF),
    Name("zoomer.profile.trace.events", "span attribute", "{event}", _PROFILE, "events in the trace", _PROF),
    Name("zoomer.profile.request.duration_p50_ms", "span attribute", "ms", _PROFILE, "p50 of the covered requests",
         _PROF),
    Name("zoomer.profile.request.duration_p99_ms", "span attribute", "ms", _PROFILE, "p99 of the covered requests",
         _PROF),
    Name("zoomer.profile.annotation.cpu_us", "span attribute", "us", _PROFILE, "mean thread CPU per request for "
         "its profiler range", _PROF),
    Name("zoomer.profile.annotation.duration_us", "span attribute", "us", _PREQ, "the request's range in the trace",
         _PROF),
    Name("zoomer.profile.kernel.count", "span attribute", "{kernel}", _BOTHP, "kernels launched", _PROF),
    Name("zoomer.profile.kernel.time_us", "span attribute", "us", _BOTHP, "their GPU time", _PROF),
    Name("zoomer.profile.kernel.attributed_time_us", "span attribute", "us", _PROFILE, "kernel time that belongs "
         "to some request", _PROF),
    Name("zoomer.profile.kernel.attributed_share", "span attribute", "1", _PROFILE, "its share of all kernel time",
         _PROF),
    Name("zoomer.profile.cuda_runtime.count", "span attribute", "{call}", _BOTHP, "CUDA runtime and driver calls",
         _PROF),
    Name("zoomer.profile.cuda_runtime.time_us", "span attribute", "us", _BOTHP, "their CPU time", _PROF),
    Name("zoomer.profile.memcpy.count", "span attribute", "{copy}", _BOTHP, "GPU copies", _PROF),
    Name("zoomer.profile.memcpy.time_us", "span attribute", "us", _BOTHP, "their time", _PROF),
    Name("zoomer.profile.memcpy.bytes", "span attribute", "By", _BOTHP, "their bytes", _PROF),
    Name("zoomer.profile.memset.count", "span attribute", "{set}", _BOTHP, "GPU memsets", _PROF),
    Name("zoomer.profile.memset.time_us", "span attribute", "us", _BOTHP, "their time", _PROF),
    Name("zoomer.profile.memset.bytes", "span attribute", "By", _BOTHP, "their bytes", _PROF),
    Name("zoomer.profile.top_kernels.name", "span attribute", "", _BOTHP, "kernel names, most GPU time first", _PROF),
    Name("zoomer.profile.top_kernels.count", "span attribute", "{kernel}", _BOTHP, "their counts", _PROF),
    Name("zoomer.profile.top_kernels.time_us", "span attribute", "us", _BOTHP, "their GPU times", _PROF),
    Name("zoomer.profile.cpu_op.count", "span attribute", "{operator}", _PREQ, "ATen operators run", _PROF),
    Name("zoomer.profile.asked", "span attribute", "", "SERVER span", "what became of the request's ask to be "
         "profiled (`zoomer-profile` metadata or baggage): `covered`, `started`, `busy`, `refused`, `failed`, "
         "`unavailable`", _PROF),
    Name("zoomer.profile.captured", "span attribute", "", "SERVER span", "`latency_threshold`: the request was "
         "captured as slower than `--profile-over-ms`", _PROF),
    Name("zoomer.profile.artifacts.url", "span attribute", "", _PROFILE, "where the session's files were "
         "uploaded", _PROF),
    Name("zoomer.profile.artifacts.files", "span attribute", "{file}", _PROFILE, "files uploaded", _PROF),
    Name("zoomer.profile.artifacts.error", "span attribute", "", _PROFILE, "why an upload failed", _PROF),
    Name("zoomer.profile.trace.url", "span attribute", "", _PROFILE, "the uploaded trace's URL", _PROF),
    Name("zoomer.profile.sessions", "metric", "{session}", "counter", "sessions that ended, by "
         "`zoomer.profile.trigger` and `zoomer.profile.outcome`", _PROF),
    Name("zoomer.profile.outcome", "metric attribute", "", "`zoomer.profile.sessions`", "how the session ended",
         _PROF),
    Name("zoomer.profile.request.kernel.duration", "metric", "s", "histogram", "GPU kernel time of one profiled "
         "request", _PROF),
    Name("zoomer.profile.request.cuda_runtime.duration", "metric", "s", "histogram", "CUDA runtime and driver time "
         "of one profiled request", _PROF),
    # -- CPU profile ------------------------------------------------------------------------------------------
    Name(hn.CPU_SAMPLER, "span attribute", "", _PROFILE, "`py-spy`, `in-process` or `none`", _CPU),
    Name(hn.CPU_UNAVAILABLE, "span attribute", "", _PROFILE, "why py-spy could not be used", _CPU),
    Name(hn.CPU_ERROR, "span attribute", "", _PROFILE, "why no CPU profile was written", _CPU),
    Name(hn.CPU_RATE_HZ, "span attribute", "Hz", _PROFILE, "sampling rate", _CPU),
    Name(hn.CPU_PATH, "span attribute", "", _PROFILE, "the speedscope JSON file", _CPU),
    Name(hn.CPU_COLLAPSED_PATH, "span attribute", "", _PROFILE, "the collapsed-stacks file", _CPU),
    Name(hn.CPU_PPROF_PATH, "span attribute", "", _PROFILE, "the pprof file (`.cpu.pb.gz`: samples labelled "
         "`thread`, and `trace_id`, `span_id`, `rpc.method` where the sampler knew the request)", _CPU),
    Name(hn.CPU_SAMPLES, "span attribute", "{sample}", _PROFILE, "active samples", _CPU),
    Name(hn.CPU_IDLE_SAMPLES, "span attribute", "{sample}", _PROFILE, "idle samples (in-process sampler)", _CPU),
    Name(hn.CPU_THREADS, "span attribute", "{thread}", _PROFILE, "threads with an active sample", _CPU),
    Name(hn.CPU_SAMPLER_ERRORS, "span attribute", "{sample}", _PROFILE, "samples py-spy could not read", _CPU),
    Name(hn.CPU_DROPPED_SAMPLES, "span attribute", "{sample}", _PROFILE, "samples the in-process sampler did not "
         "keep", _CPU),
    Name(hn.CPU_TOP_FUNCTION, "span attribute", "", _PROFILE, "top functions (array)", _CPU),
    Name(hn.CPU_TOP_LOCATION, "span attribute", "", _PROFILE, "their `package/file.py:line` (array)", _CPU),
    Name(hn.CPU_TOP_SELF_SHARE, "span attribute", "1", _PROFILE, "their own share of active samples (array)", _CPU),
    Name(hn.CPU_TOP_TOTAL_SHARE, "span attribute", "1", _PROFILE, "their share with callees (array)", _CPU),
    # -- batching -----------------------------------------------------------------------------------------------
    Name(bn.MESSAGING_OPERATION_TYPE, "span attribute", "", "batch span", "`process`", _BATCH),
    Name(bn.MESSAGING_DESTINATION, "span attribute", "", "batch span", "the queue's name", _BATCH),
    Name(bn.MESSAGING_BATCH_COUNT, "span attribute", "{request}", "batch span", "member requests", _BATCH),
    Name(bn.SIZE, "span attribute", "{request}", "batch span, member spans; also a histogram metric",
         "members of the batch (metric: the size of the batch each request ran in)", _BATCH),
    Name(bn.ITEMS, "span attribute", "{item}", "batch span, member spans", "items of all members / of this "
         "member", _BATCH),
    Name(bn.MAX_SIZE, "span attribute", "{request}", "batch span", "the batcher's maximum", _BATCH),
    Name(bn.FILL, "span attribute", "1", "batch span", "size / max_size", _BATCH),
    Name(bn.MAX_DELAY_MS, "span attribute", "ms", "batch span", "the batcher's longest wait", _BATCH),
    Name(bn.CUT_REASON, "span attribute", "", "batch span", "`full`, `delay` or the batcher's word", _BATCH),
    Name(bn.SHARE_RULE, "span attribute", "", "batch span", "`items` or `equal`", _BATCH),
    Name(bn.QUEUE_WAIT_MAX, "span attribute", "ns", "batch span", "the longest member queue wait", _BATCH),
    Name(bn.UNTRACED, "span attribute", "{request}", "batch span", "members without a request span", _BATCH),
    Name(bn.BATCH_ID, "span attribute", "", "member spans and their children", "the batch span's id", _BATCH),
    Name(bn.INDEX, "link attribute", "", "batch span links; member spans", "position in the batch", _BATCH),
    Name(bn.SHARE, "link attribute", "1", "batch span links; member spans", "the member's share of the batch",
         _BATCH),
    Name(bn.QUEUE_WAIT, "span attribute", "ns", "member spans", "from enqueue to the batch's start", _BATCH),
    Name(bn.PHASE_NAMES, "span attribute", "", "member spans", "the batch's phases (array)", _BATCH),
    Name(bn.PHASE_SHARE_NS, "span attribute", "ns", "member spans", "its share of each phase (array)", _BATCH),
    Name(bn.GPU_PEAK_SHARE, "span attribute", "By", "member spans", "its share of the batch's GPU working memory",
         _BATCH),
    Name(bn.GPU_DEVICE_ALLOCS_SHARE, "span attribute", "{call}", "member spans", "its share of the batch's "
         "device allocations", _BATCH),
    Name(bn.METRIC_QUEUE_WAIT, "metric", "s", "histogram", "queue wait of each batched request", _BATCH),
)
