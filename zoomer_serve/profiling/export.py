"""A finished session as OpenTelemetry data: span records handed to the recorder's sink (the one export
path of request spans) and metrics on the SDK meter provider.

Spans:

- ``zoomer.profile`` (INTERNAL, a new trace; from the session's start to the end of its writing): links to
  every covered request span; attributes ``zoomer.profile.session_id``, ``.trigger`` (and
  ``zoomer.profile.trigger.*`` details), bounds ``.max_requests`` / ``.duration_ms``, ``.stop_reason``,
  ``.activities``, the options ``.record_shapes`` / ``.profile_memory`` / ``.with_stack`` / ``.with_flops``,
  ``zoomer.profile.trace.path`` / ``.bytes`` / ``.events``, ``zoomer.profile.requests`` (covered),
  ``.requests.incomplete`` (admitted but still running when the profiler stopped), the trace's GPU totals
  (below, plus ``zoomer.profile.kernel.attributed_time_us`` and ``.attributed_share``), the attributes of
  the session's companions (the Python CPU profile: ``zoomer.profile.cpu.*``, see
  :mod:`zoomer_serve.host.names`), and what the session cost: ``zoomer.profile.request.duration_p50_ms`` /
  ``_p99_ms`` of the covered requests and
  ``zoomer.profile.annotation.cpu_us`` (mean thread CPU µs per request spent opening and closing its range
  and counting it; the profiler's own per-operator cost comes on top, see the benchmark).
  Status ERROR with the reason when the session failed.
- ``zoomer.profile.request`` (INTERNAL), one per covered request, made after the fact: child of the request
  span, with the request's time range and sampling flag, linked to the ``zoomer.profile`` span; attributes
  ``zoomer.profile.session_id``, ``zoomer.profile.trace.path``, ``zoomer.profile.annotation.duration_us``
  and the request's GPU totals.

GPU totals (µs, bytes): ``zoomer.profile.kernel.count`` / ``.time_us``, ``zoomer.profile.cuda_runtime.count``
/ ``.time_us`` (CUDA runtime and driver API calls: launch cost on the CPU), ``zoomer.profile.memcpy.count`` /
``.time_us`` / ``.bytes``, ``zoomer.profile.memset.*`` likewise, ``zoomer.profile.cpu_op.count`` (per
request), and ``zoomer.profile.top_kernels.name`` / ``.count`` / ``.time_us`` (parallel arrays, most GPU time
first). Figures come from :func:`zoomer_serve.profiling.summary.summarize_events`.

Metrics: ``zoomer.profile.sessions`` (counter; ``zoomer.profile.trigger``, ``zoomer.profile.outcome``),
``zoomer.profile.request.kernel.duration`` and ``zoomer.profile.request.cuda_runtime.duration``
(histograms, unit ``s``, one point per covered request; ``rpc.method`` = the request span's name).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zoomer_serve.profiling.session import CoveredRequest, Session
from zoomer_serve.profiling.stats import percentile
from zoomer_serve.profiling.summary import GpuTotals, RequestProfile, TraceSummary
from zoomer_serve.recording import records as r
from zoomer_serve.recording.propagation import new_span_id, new_trace_id

PROFILE_SPAN_NAME = "zoomer.profile"
REQUEST_SPAN_NAME = "zoomer.profile.request"
KERNEL_BUCKETS_S = (0.00001, 0.00005, 0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0)


def gpu_attributes(totals: GpuTotals, top_n: int) -> dict[str, Any]:
    """The GPU-total attributes of a span (see the module docstring)."""
    top = totals.top_kernels(top_n)
    return {
        "zoomer.profile.kernel.count": totals.kernel_count,
        "zoomer.profile.kernel.time_us": round(totals.kernel_time_us, 3),
        "zoomer.profile.cuda_runtime.count": totals.cuda_runtime_count,
        "zoomer.profile.cuda_runtime.time_us": round(totals.cuda_runtime_time_us, 3),
        "zoomer.profile.memcpy.count": totals.memcpy_count,
        "zoomer.profile.memcpy.time_us": round(totals.memcpy_time_us, 3),
        "zoomer.profile.memcpy.bytes": totals.memcpy_bytes,
        "zoomer.profile.memset.count": totals.memset_count,
        "zoomer.profile.memset.time_us": round(totals.memset_time_us, 3),
        "zoomer.profile.memset.bytes": totals.memset_bytes,
        "zoomer.profile.top_kernels.name": [k.name for k in top],
        "zoomer.profile.top_kernels.count": [k.count for k in top],
        "zoomer.profile.top_kernels.time_us": [round(k.time_us, 3) for k in top],
    }


def profile_attributes(session: Session, summary: TraceSummary | None, top_n: int) -> dict[str, Any]:
    """Attributes of the ``zoomer.profile`` span of ``session`` (``summary`` None when it failed early)."""
    opts = session.options
    attrs: dict[str, Any] = {
        "zoomer.profile.session_id": session.session_id,
        "zoomer.profile.trigger": session.trigger,
        "zoomer.profile.max_requests": session.max_requests,
        "zoomer.profile.duration_ms": session.duration_ms,
        "zoomer.profile.activities": ["cpu", "cuda"] if session.cuda else ["cpu"],
        "zoomer.profile.record_shapes": opts.record_shapes,
        "zoomer.profile.profile_memory": opts.profile_memory,
        "zoomer.profile.with_stack": opts.with_stack,
        "zoomer.profile.with_flops": opts.with_flops,
        "zoomer.profile.requests": len(session.covered),
        "zoomer.profile.requests.incomplete": session.incomplete,
    }
    attrs.update({f"zoomer.profile.trigger.{k}": v for k, v in session.trigger_attributes.items()})
    attrs.update(session.extra_attributes)
    if session.stop_reason:
        attrs["zoomer.profile.stop_reason"] = session.stop_reason
    if session.trace_path:
        attrs["zoomer.profile.trace.path"] = session.trace_path
        attrs["zoomer.profile.trace.bytes"] = session.trace_bytes
    if session.covered:
        durations = sorted((c.end_ns - c.start_ns) / 1e6 for c in session.covered)
        attrs["zoomer.profile.request.duration_p50_ms"] = round(percentile(durations, 50), 3)
        attrs["zoomer.profile.request.duration_p99_ms"] = round(percentile(durations, 99), 3)
        attrs["zoomer.profile.annotation.cpu_us"] = round(session.wrapper_ns / len(session.covered) / 1e3, 3)
    if summary is not None:
        attrs["zoomer.profile.trace.events"] = summary.event_count
        attrs.update(gpu_attributes(summary.totals, top_n))
        attrs["zoomer.profile.kernel.attributed_time_us"] = round(summary.attributed.kernel_time_us, 3)
        if summary.attributed_share is not None:
            attrs["zoomer.profile.kernel.attributed_share"] = round(summary.attributed_share, 6)
    return attrs


def request_attributes(session: Session, profile: RequestProfile | None, top_n: int) -> dict[str, Any]:
    """Attributes of one covered request's ``zoomer.profile.request`` span."""
    attrs: dict[str, Any] = {"zoomer.profile.session_id": session.session_id}
    if session.trace_path:
        attrs["zoomer.profile.trace.path"] = session.trace_path
    attrs.update(gpu_attributes(profile or RequestProfile(), top_n))
    attrs["zoomer.profile.cpu_op.count"] = profile.cpu_op_count if profile is not None else 0
    attrs["zoomer.profile.annotation.duration_us"] = round(profile.duration_us, 3) if profile is not None else 0.0
    return attrs


def export_session(session: Session, summary: TraceSummary | None, end_ns: int, top_n: int,
                   sink: Callable[[tuple[Any, ...]], None]) -> tuple[int, int]:
    """Hand the ``zoomer.profile`` span and, when ``summary`` is given, one ``zoomer.profile.request`` span
    per covered request to ``sink``. Returns the profile span's ``(trace_id, span_id)``."""
    trace_id, span_id = new_trace_id(), new_span_id()
    failed = session.outcome == "failed"
    links = [(c.trace_id, c.span_id, None) for c in session.covered]
    sink((trace_id, span_id, 0, False, 1, None, PROFILE_SPAN_NAME, r.KIND_INTERNAL, session.start_ns or end_ns,
          end_ns, r.STATUS_ERROR if failed else r.STATUS_OK, session.error if failed else None,
          profile_attributes(session, summary, top_n), None, links or None, None, r.F_SAMPLED))
    if summary is None:
        return trace_id, span_id
    back_link = [(trace_id, span_id, None)]
    for c in session.covered:
        sink(_request_record(c, request_attributes(session, summary.requests.get((c.trace_id, c.span_id)), top_n),
                             back_link))
    return trace_id, span_id


def _request_record(c: CoveredRequest, attrs: dict[str, Any], links: list[Any]) -> tuple[Any, ...]:
    return (c.trace_id, new_span_id(), c.span_id, False, c.trace_flags, c.trace_state, REQUEST_SPAN_NAME,
            r.KIND_INTERNAL, c.start_ns, c.end_ns, r.STATUS_UNSET, None, attrs, None, links, None,
            r.F_SAMPLED if c.sampled else 0)


class ProfileMetrics:
    """The profiling instruments on ``meter_provider`` (an SDK ``MeterProvider``; None records nothing)."""

    def __init__(self, meter_provider: Any) -> None:
        self._sessions = self._kernel = self._runtime = None
        if meter_provider is None:
            return
        meter = meter_provider.get_meter("zoomer_serve.profiling")
        self._sessions = meter.create_counter("zoomer.profile.sessions", unit="{session}",
                                              description="Profiling sessions that ended, by trigger and outcome")
        self._kernel = meter.create_histogram(
            "zoomer.profile.request.kernel.duration", unit="s",
            description="GPU kernel time of one profiled request", explicit_bucket_boundaries_advisory=list(
                KERNEL_BUCKETS_S))
        self._runtime = meter.create_histogram(
            "zoomer.profile.request.cuda_runtime.duration", unit="s",
            description="CUDA runtime and driver API time (launch cost) of one profiled request",
            explicit_bucket_boundaries_advisory=list(KERNEL_BUCKETS_S))

    def record(self, session: Session, summary: TraceSummary | None) -> None:
        if self._sessions is None:
            return
        self._sessions.add(1, {"zoomer.profile.trigger": session.trigger,
                               "zoomer.profile.outcome": session.outcome or "failed"})
        if summary is None or self._kernel is None or self._runtime is None:
            return
        for c in session.covered:
            profile = summary.requests.get((c.trace_id, c.span_id))
            if profile is None:
                continue
            attrs = {"rpc.method": c.name, "zoomer.profile.trigger": session.trigger}
            self._kernel.record(profile.kernel_time_us / 1e6, attrs)
            self._runtime.record(profile.cuda_runtime_time_us / 1e6, attrs)
