"""Host and CPU telemetry: system and process metrics, per-request thread CPU time, and a Python CPU profile
in every profiling session.

Switched on by :func:`zoomer_serve.configure` (``ZOOMER_HOST``, see :mod:`.config`). Names, units and
sources: :mod:`.names`; the metrics: :mod:`.metrics`; the CPU profile: :mod:`.cpu_profile`. Importing this
package imports neither psutil nor the instrumentation (they load when metrics are installed).
"""

from zoomer_serve.host.config import (
    CPU_PROFILE_MODES,
    HostConfig,
    HostConfigError,
    known_metrics,
    parse_metrics,
)
from zoomer_serve.host.cpu_profile import (
    CpuProfiler,
    CpuProfileRun,
    InProcessSampler,
    PySpySampler,
    SamplerUnavailable,
    find_pyspy,
)
from zoomer_serve.host.metrics import GcPauses, HostMetrics
from zoomer_serve.host.request_cpu import RequestCpuTimeObserver
from zoomer_serve.host.speedscope import CpuProfileSummary, TopFunction, read_speedscope, summarize
from zoomer_serve.host.telemetry import HostTelemetry, install_host_telemetry

__all__ = [
    "CPU_PROFILE_MODES",
    "CpuProfileRun",
    "CpuProfileSummary",
    "CpuProfiler",
    "GcPauses",
    "HostConfig",
    "HostConfigError",
    "HostMetrics",
    "HostTelemetry",
    "InProcessSampler",
    "PySpySampler",
    "RequestCpuTimeObserver",
    "SamplerUnavailable",
    "TopFunction",
    "find_pyspy",
    "install_host_telemetry",
    "known_metrics",
    "parse_metrics",
    "read_speedscope",
    "summarize",
]
