"""zoomer-serve: always-on profiling middleware for PyTorch inference servers.

The public API of the core:

- :func:`configure` / :func:`shutdown`: telemetry setup from ``OTEL_*`` / ``ZOOMER_*`` and code;
  :func:`force_flush`: export what was recorded so far.
- :func:`phase`: time a block of request work (preprocess, forward, ...) as a child span and a
  torch.profiler range.
- :func:`current_request`: the request span active on this thread or task.
- :func:`get_recorder`: the framework-neutral request recorder that transport adapters call (one per
  process, kept across :func:`configure` calls); :func:`records_after_shutdown`: requests it dropped while no
  telemetry was active.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from zoomer_serve.config import ConfigError, ExportConfig, ZoomerConfig
    from zoomer_serve.recording import RequestRecorder, RequestSpan, current_request, phase
    from zoomer_serve.runtime import (
        Telemetry,
        configure,
        force_flush,
        get_recorder,
        get_telemetry,
        records_after_shutdown,
        shutdown,
    )

# Loaded on first use (PEP 562), so that importing a subpackage (``zoomer_serve.analysis`` reading a trace)
# does not pay for the export pipeline and OpenTelemetry (0.3 s).
_LAZY = {
    "ConfigError": "zoomer_serve.config", "ExportConfig": "zoomer_serve.config", "ZoomerConfig": "zoomer_serve.config",
    "RequestRecorder": "zoomer_serve.recording", "RequestSpan": "zoomer_serve.recording",
    "current_request": "zoomer_serve.recording", "phase": "zoomer_serve.recording",
    "Telemetry": "zoomer_serve.runtime", "configure": "zoomer_serve.runtime", "force_flush": "zoomer_serve.runtime",
    "get_recorder": "zoomer_serve.runtime",
    "get_telemetry": "zoomer_serve.runtime", "shutdown": "zoomer_serve.runtime",
    "records_after_shutdown": "zoomer_serve.runtime",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'zoomer_serve' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


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
    "records_after_shutdown",
    "shutdown",
]
