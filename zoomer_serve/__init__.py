"""zoomer-serve: always-on profiling middleware for PyTorch inference servers.

The public API of the core:

- :func:`configure` / :func:`shutdown`: telemetry setup from ``OTEL_*`` / ``ZOOMER_*`` and code;
  :func:`force_flush`: export what was recorded so far.
- :func:`phase`: time a block of request work (preprocess, forward, ...) as a child span and a
  torch.profiler range.
- :func:`current_request`: the request span active on this thread or task.
- :func:`get_recorder`: the framework-neutral request recorder that transport adapters call.
"""

__version__ = "0.1.0"

from zoomer_serve.config import ConfigError, ExportConfig, ZoomerConfig
from zoomer_serve.recording import RequestRecorder, RequestSpan, current_request, phase
from zoomer_serve.runtime import Telemetry, configure, force_flush, get_recorder, get_telemetry, shutdown

__all__ = [
    "ConfigError",
    "ExportConfig",
    "RequestRecorder",
    "RequestSpan",
    "Telemetry",
    "ZoomerConfig",
    "__version__",
    "configure",
    "current_request",
    "force_flush",
    "get_recorder",
    "get_telemetry",
    "phase",
    "shutdown",
]
