"""Recording: the framework-neutral request recorder, phases, W3C context parsing, head sampling."""

from zoomer_serve.recording.errors import internal_error, internal_error_counts
from zoomer_serve.recording.propagation import ParentContext, format_traceparent, parse_traceparent
from zoomer_serve.recording.recorder import (
    RequestObserver,
    RequestRecorder,
    RequestSpan,
    ThreadJoin,
    current_request,
    phase,
    register_quiet_exception,
)
from zoomer_serve.recording.sampling import Sampler

__all__ = [
    "ParentContext",
    "RequestObserver",
    "RequestRecorder",
    "RequestSpan",
    "Sampler",
    "ThreadJoin",
    "current_request",
    "format_traceparent",
    "internal_error",
    "internal_error_counts",
    "parse_traceparent",
    "phase",
    "register_quiet_exception",
]
