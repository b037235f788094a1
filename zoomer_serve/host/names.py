"""The names host telemetry writes: one place for each (the analysis imports them from here).

Per-request span attribute
--------------------------
``zoomer.request.cpu_time_ns`` (int, ns): CPU time of the thread that ran the request between the start and
the end of its SERVER span (``time.thread_time_ns`` at the end minus at the start: user + system time of that
OS thread). Set only when the span starts and ends on the same OS thread outside an asyncio event loop (a sync
gRPC or threaded Thrift server; on an event loop the thread runs many requests at once, so the figure would
not be the request's). Wall time is the span's own duration; ``cpu_time_ns / duration`` near 1 means the
request computed (or held the interpreter lock) throughout, near 0 that it waited. Measured on every sampled
request while a profiling session runs and otherwise on 1 in N sampled traces (``trace_id % N == 0``,
``ZOOMER_HOST_REQUEST_CPU_TIME_ONE_IN``, default 16; :mod:`zoomer_serve.host.request_cpu`): a span that was not
measured has no such attribute (never a zero), so figures over it describe a sample of the requests.

Profile span attributes (``zoomer.profile``)
--------------------------------------------
Written for the Python CPU profile recorded during each profiling session (see
:mod:`zoomer_serve.host.cpu_profile`); the ``top`` attributes are parallel arrays, most own samples first.
"""

from __future__ import annotations

REQUEST_CPU_TIME = "zoomer.request.cpu_time_ns"

# -- zoomer.profile span: the Python CPU profile of the session ------------------------------------------
CPU_SAMPLER = "zoomer.profile.cpu.sampler"
"""``py-spy`` (a helper process sampling from outside), ``in-process`` (a sampler thread) or ``none``."""
CPU_UNAVAILABLE = "zoomer.profile.cpu.unavailable"
"""Why py-spy could not be used (missing binary, no ptrace permission, ...); set on every session it applies to."""
CPU_ERROR = "zoomer.profile.cpu.error"
"""Why no CPU profile was written although a sampler ran (it failed, wrote nothing, post-processing failed)."""
CPU_RATE_HZ = "zoomer.profile.cpu.rate_hz"
CPU_PATH = "zoomer.profile.cpu.path"
"""The speedscope JSON file (absolute path)."""
CPU_COLLAPSED_PATH = "zoomer.profile.cpu.collapsed_path"
"""The collapsed-stacks text file (``frame;frame;... count`` per line, root first) for flame graph tools."""
CPU_PPROF_PATH = "zoomer.profile.cpu.pprof_path"
"""The pprof file (``.cpu.pb.gz``: gzip of a ``perftools.profiles.Profile``, the collapsed file's samples with
``thread`` and, where known, ``trace_id`` / ``span_id`` / ``rpc.method`` labels; :mod:`zoomer_serve.host.pprof`)."""
CPU_SAMPLES = "zoomer.profile.cpu.samples"
"""Active samples (a thread running Python or native code on a CPU); the shares below are of these."""
CPU_IDLE_SAMPLES = "zoomer.profile.cpu.idle_samples"
"""Samples of idle threads (waiting); only the in-process sampler records them (py-spy leaves them out)."""
CPU_THREADS = "zoomer.profile.cpu.threads"
"""Threads with at least one active sample."""
CPU_SAMPLER_ERRORS = "zoomer.profile.cpu.sampler_errors"
"""Samples py-spy could not read (it reads without pausing the process)."""
CPU_DROPPED_SAMPLES = "zoomer.profile.cpu.dropped_samples"
"""Thread samples the in-process sampler did not keep (its table of distinct stacks was full)."""
CPU_TOP_FUNCTION = "zoomer.profile.cpu.top.function"
"""Function (qualified name) of each top entry."""
CPU_TOP_LOCATION = "zoomer.profile.cpu.top.location"
"""``file:line`` of each top entry: the file shortened to its package path, the function's first line."""
CPU_TOP_SELF_SHARE = "zoomer.profile.cpu.top.self_share"
"""Share (0..1) of active samples whose innermost Python frame is the function (its own time)."""
CPU_TOP_TOTAL_SHARE = "zoomer.profile.cpu.top.total_share"
"""Share (0..1) of active samples with the function anywhere on the stack (own time plus callees)."""

CPU_ATTRIBUTES = (CPU_SAMPLER, CPU_UNAVAILABLE, CPU_ERROR, CPU_RATE_HZ, CPU_PATH, CPU_COLLAPSED_PATH, CPU_PPROF_PATH,
                  CPU_SAMPLES,
                  CPU_IDLE_SAMPLES, CPU_THREADS, CPU_SAMPLER_ERRORS, CPU_DROPPED_SAMPLES, CPU_TOP_FUNCTION, CPU_TOP_LOCATION,
                  CPU_TOP_SELF_SHARE, CPU_TOP_TOTAL_SHARE)

# -- metrics -----------------------------------------------------------------------------------------------
GC_PAUSE_TIME = "cpython.gc.pause.time"
"""Observable counter, unit ``s``, per ``cpython.gc.generation``: time spent inside CPython's garbage
collector since host telemetry started (measured with ``gc.callbacks``). Not (yet) in the semantic
conventions; modelled on ``dotnet.gc.pause.time``, next to the conventional ``cpython.gc.collections``."""
GC_GENERATION = "cpython.gc.generation"

METRIC_GROUPS: dict[str, tuple[str, ...]] = {
    "cpu": ("system.cpu.time", "system.cpu.utilization", "process.cpu.time", "process.cpu.utilization"),
    "memory": ("system.memory.usage", "system.memory.utilization", "system.swap.usage", "system.swap.utilization",
               "process.memory.usage", "process.memory.virtual"),
    "disk": ("system.disk.io", "system.disk.operations", "system.disk.time", "process.disk.io"),
    "network": ("system.network.io", "system.network.errors", "system.network.packets",
                "system.network.dropped.packets"),
    "process": ("process.open_file_descriptor.count", "process.thread.count", "process.context_switches"),
    "gc": ("cpython.gc.collections", "cpython.gc.collected_objects", "cpython.gc.uncollectable_objects",
           GC_PAUSE_TIME),
}
"""Metric groups of ``ZOOMER_HOST_METRICS``: each name is a key of the instrumentation's configuration
(``SystemMetricsInstrumentor(config=...)``), plus :data:`GC_PAUSE_TIME` which is ours."""

INSTRUMENTATION_CONFIG: dict[str, list[str] | None] = {
    "system.cpu.time": ["idle", "user", "system", "irq", "softirq", "nice", "iowait", "steal"],
    "system.cpu.utilization": ["idle", "user", "system", "irq", "softirq", "nice", "iowait", "steal"],
    "system.memory.usage": ["used", "free", "cached", "buffers"],
    "system.memory.utilization": ["used", "free", "cached", "buffers"],
    "system.swap.usage": ["used", "free"],
    "system.swap.utilization": ["used", "free"],
    "system.disk.io": ["read", "write"],
    "system.disk.operations": ["read", "write"],
    "system.disk.time": ["read", "write"],
    "system.network.dropped.packets": ["transmit", "receive"],
    "system.network.packets": ["transmit", "receive"],
    "system.network.errors": ["transmit", "receive"],
    "system.network.io": ["transmit", "receive"],
    "process.context_switches": ["involuntary", "voluntary"],
    "process.cpu.time": ["user", "system"],
    "process.cpu.utilization": None,
    "process.memory.usage": None,
    "process.memory.virtual": None,
    "process.open_file_descriptor.count": None,
    "process.thread.count": None,
    "process.disk.io": ["read", "write"],
    "cpython.gc.collections": None,
    "cpython.gc.collected_objects": None,
    "cpython.gc.uncollectable_objects": None,
}
"""What each configuration key asks of the instrumentation (the states / directions it reports)."""

# The instrumentation's own units and attribute keys predate the current semantic conventions in places; the
# meter zoomer-serve hands it rewrites them (metric names stay the instrumentation's). Metric name (as
# created) -> (conventional unit, {instrumentation attribute key: conventional key}).
_CPU = {"state": "cpu.mode", "cpu": "cpu.logical_number"}
_DISK = {"device": "system.device", "direction": "disk.io.direction"}
_NET = {"device": "network.interface.name", "direction": "network.io.direction"}
SEMCONV: dict[str, tuple[str | None, dict[str, str]]] = {
    "system.cpu.time": ("s", _CPU),
    "system.cpu.utilization": ("1", _CPU),
    "system.memory.usage": ("By", {"state": "system.memory.state"}),
    "system.memory.utilization": ("1", {"state": "system.memory.state"}),
    "system.swap.usage": ("By", {"state": "system.paging.state"}),
    "system.swap.utilization": ("1", {"state": "system.paging.state"}),
    "system.disk.io": ("By", _DISK),
    "system.disk.operations": ("{operation}", _DISK),
    "system.disk.time": ("s", _DISK),
    "system.network.dropped_packets": ("{packet}", _NET),
    "system.network.packets": ("{packet}", _NET),
    "system.network.errors": ("{error}", _NET),
    "system.network.io": ("By", _NET),
    "process.cpu.time": ("s", {"type": "cpu.mode"}),
    "process.cpu.utilization": ("1", {}),
    "process.context_switches": ("{context_switch}", {"type": "process.context_switch_type"}),
    "process.memory.usage": ("By", {}),
    "process.memory.virtual": ("By", {}),
    "process.open_file_descriptor.count": ("{file_descriptor}", {}),
    "process.thread.count": ("{thread}", {}),
    "process.disk.io": ("By", {"direction": "disk.io.direction"}),
    "cpython.gc.collections": ("{collection}", {"generation": ""}),
    "cpython.gc.collected_objects": ("{object}", {"generation": ""}),
    "cpython.gc.uncollectable_objects": ("{object}", {"generation": ""}),
}
"""An empty conventional key drops the attribute (the instrumentation's duplicate ``generation`` string next to
``cpython.gc.generation``). ``cpu.logical_number`` is 0-based (the instrumentation counts CPUs from 1)."""
