"""Kernel profiling linked to request spans: torch.profiler sessions started on demand (admin gRPC
service, CLI, API), once latency is steady, or when a latency SLO is broken.

Public API:

- :class:`ProfilerController` (:func:`install_profiler`): runs sessions; ``start`` / ``stop`` / ``status``.
- :class:`SessionOptions`, :class:`ProfilerConfig`, :class:`SteadyStateConfig`, :class:`LatencySloConfig`,
  :class:`AdminConfig`: settings.
- :data:`REQUEST_LABEL_PREFIX`, :func:`request_label`, :func:`parse_request_label`: the profiler range name
  that carries a request's trace and span ids.
- :func:`summarize_events`, :func:`load_trace`: per-request kernel summary of a Chrome trace.
- :mod:`zoomer_serve.profiling.admin` (the ``ProfilerControl`` gRPC service) and
  :mod:`zoomer_serve.profiling.client` (its client) are imported on demand, as is
  :mod:`zoomer_serve.profiling.on_request` (profiling one request on the client's ask, or the next one over a
  latency threshold).
"""

from zoomer_serve.profiling.config import (
    AdminConfig,
    LatencySloConfig,
    ProfilerConfig,
    SessionOptions,
    SteadyStateConfig,
)
from zoomer_serve.profiling.controller import ProfilerController, ProfilingError, install_profiler
from zoomer_serve.profiling.labels import REQUEST_LABEL_PREFIX, parse_request_label, request_label
from zoomer_serve.profiling.session import ControlReply, Result, SessionInfo, State
from zoomer_serve.profiling.summary import TraceSummary, load_trace, summarize_events

__all__ = [
    "REQUEST_LABEL_PREFIX",
    "AdminConfig",
    "ControlReply",
    "LatencySloConfig",
    "ProfilerConfig",
    "ProfilerController",
    "ProfilingError",
    "Result",
    "SessionInfo",
    "SessionOptions",
    "State",
    "SteadyStateConfig",
    "TraceSummary",
    "install_profiler",
    "load_trace",
    "parse_request_label",
    "request_label",
    "summarize_events",
]
