"""Analysis of profiler traces and of the request store: tables, findings with evidence and
recommendations, and reports (terminal, JSON, HTML, merged Perfetto trace).

- :func:`load_trace` reads a Kineto / Chrome trace JSON (plain or gzip) into columnar tables.
- Analyzers (each returns a :class:`Table`): :func:`gpu_utilization`, :func:`kernel_breakdown`,
  :func:`kind_breakdown`, :func:`launch_stats`, :func:`memcpy_bandwidth`, :func:`annotation_gpu_time`,
  :func:`request_gpu_time`, :func:`idle_gaps`.
- Detectors return :class:`Finding` lists: :func:`detect_trace` (trace), :func:`analyze_store` (store).
- :func:`render_findings` prints findings with rich; ``zoomer-serve analyze`` is the command line.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zoomer_serve.analysis.api import AnalysisResult, TraceReport, analyze, analyze_store, analyze_trace
    from zoomer_serve.analysis.findings import DETECTOR_IDS, Finding, sort_findings
    from zoomer_serve.analysis.kernels import kernel_breakdown, kernel_kind, kind_breakdown
    from zoomer_serve.analysis.kineto import KinetoTrace, TraceFormatError, load_trace
    from zoomer_serve.analysis.labels import REQUEST_LABEL_PREFIX, parse_request_label, request_label
    from zoomer_serve.analysis.render import render_findings
    from zoomer_serve.analysis.table import Table
    from zoomer_serve.analysis.timeline import (
        annotation_gpu_time,
        gpu_utilization,
        idle_gaps,
        launch_stats,
        memcpy_bandwidth,
        request_gpu_time,
    )
    from zoomer_serve.analysis.trace_detectors import detect_trace

# Loaded on first use (PEP 562): reading a trace needs neither the store (DuckDB) nor rich.
_LAZY = {
    **dict.fromkeys(("AnalysisResult", "TraceReport", "analyze", "analyze_store", "analyze_trace"), "api"),
    **dict.fromkeys(("DETECTOR_IDS", "Finding", "sort_findings"), "findings"),
    **dict.fromkeys(("kernel_breakdown", "kernel_kind", "kind_breakdown"), "kernels"),
    **dict.fromkeys(("KinetoTrace", "TraceFormatError", "load_trace"), "kineto"),
    **dict.fromkeys(("REQUEST_LABEL_PREFIX", "parse_request_label", "request_label"), "labels"),
    "render_findings": "render", "Table": "table", "detect_trace": "trace_detectors",
    **dict.fromkeys(("annotation_gpu_time", "gpu_utilization", "idle_gaps", "launch_stats", "memcpy_bandwidth",
                     "request_gpu_time"), "timeline"),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'zoomer_serve.analysis' has no attribute {name!r}")
    value = getattr(import_module(f"zoomer_serve.analysis.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "DETECTOR_IDS", "REQUEST_LABEL_PREFIX", "AnalysisResult", "Finding", "KinetoTrace", "Table",
    "TraceFormatError", "TraceReport", "analyze", "analyze_store", "analyze_trace", "annotation_gpu_time",
    "detect_trace", "gpu_utilization", "idle_gaps", "kernel_breakdown", "kernel_kind", "kind_breakdown",
    "launch_stats", "load_trace", "memcpy_bandwidth", "parse_request_label", "render_findings", "request_gpu_time",
    "request_label", "sort_findings",
]
