"""Entry points: analyse trace files and/or a store, returning tables and findings."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zoomer_serve.analysis.breakdown import kernel_type_breakdown, time_breakdown
from zoomer_serve.analysis.conventions import Conventions, apply_conventions, profiler_steps
from zoomer_serve.analysis.findings import Finding, sort_findings
from zoomer_serve.analysis.kernels import kernel_breakdown, kind_breakdown
from zoomer_serve.analysis.kineto import KinetoTrace, load_trace
from zoomer_serve.analysis.table import Table
from zoomer_serve.analysis.timeline import (
    annotation_gpu_time,
    counter_summary,
    gpu_utilization,
    launch_stats,
    memcpy_bandwidth,
    request_gpu_time,
)
from zoomer_serve.analysis.trace_detectors import detect_trace

if TYPE_CHECKING:
    from zoomer_serve.analysis.store import StoreData


@dataclass
class TraceReport:
    """Everything computed for one trace: the analyzer tables and the findings."""

    trace: KinetoTrace
    tables: dict[str, Table]
    findings: list[Finding]


@dataclass
class AnalysisResult:
    """The outcome of :func:`analyze`: per-trace reports, the store's data and tables, the tables across
    traces (``collective_tables``: collectives, communication overlap and stragglers per rank, with two or
    more traces), all findings (most severe first)."""

    traces: list[TraceReport] = field(default_factory=list)
    store: StoreData | None = None
    store_tables: dict[str, Table] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    collective_tables: dict[str, Table] = field(default_factory=dict)

    def _store_counts(self) -> dict[str, int]:
        """``requests`` (as the report counts them: the ``rpc.server.call.duration`` metric where the store has it,
        else the SERVER spans) and ``spans`` (the SERVER spans)."""
        from zoomer_serve.analysis.store import request_totals

        spans = len(self.store.requests) if self.store is not None else 0
        table = self.store_tables.get("request_percentiles")
        return {"requests": request_totals(table)[0] if table is not None else spans, "spans": spans}

    def to_dict(self, rows: int | None = None) -> dict[str, Any]:
        """JSON-ready: findings, and each table with every row (at most ``rows`` when given)."""
        from zoomer_serve.analysis.store import store_loss_notes

        return {
            "findings": [f.to_dict() for f in self.findings],
            "traces": [{"summary": r.trace.summary(), "tables": {k: t.to_dict(rows) for k, t in r.tables.items()}}
                       for r in self.traces],
            "store": None if self.store is None else {
                "path": str(self.store.path), **self._store_counts(),
                "export_losses": asdict(self.store.losses),
                "notes": store_loss_notes(self.store.losses, self.store_tables.get("request_percentiles")),
                "tables": {k: t.to_dict(rows) for k, t in self.store_tables.items()}},
            "collectives": {k: t.to_dict(rows) for k, t in self.collective_tables.items()} or None,
        }


def trace_tables(trace: KinetoTrace) -> dict[str, Table]:
    """Every trace analyzer's table, by name."""
    return {
        "gpu_utilization": gpu_utilization(trace),
        "time_breakdown": time_breakdown(trace),
        "kernel_type_breakdown": kernel_type_breakdown(trace),
        "profiler_steps": profiler_steps(trace),
        "kind_breakdown": kind_breakdown(trace),
        "kernel_breakdown": kernel_breakdown(trace),
        "launch_stats": launch_stats(trace),
        "memcpy_bandwidth": memcpy_bandwidth(trace),
        "annotation_gpu_time": annotation_gpu_time(trace),
        "request_gpu_time": request_gpu_time(trace),
        "counters": counter_summary(trace),
    }


def analyze_trace(trace: KinetoTrace | str | os.PathLike[str],
                  conventions: Conventions | None = None) -> TraceReport:
    """Load (when given a path) and analyse one Kineto trace, counting what ``conventions`` count (ours and
    all profiler steps by default; see :mod:`zoomer_serve.analysis.conventions`).

    Raises:
        FileNotFoundError / TraceFormatError: see :func:`~zoomer_serve.analysis.kineto.load_trace`.
    """
    t = trace if isinstance(trace, KinetoTrace) else load_trace(trace)
    t = apply_conventions(t, conventions or Conventions())
    return TraceReport(t, trace_tables(t), sort_findings(detect_trace(t)))


def analyze_store(store_path: str | os.PathLike[str]) -> list[Finding]:
    """Request-level findings from a zoomer-serve store (tail latency, slow replicas, CPU-bound phases, GPU
    memory), most severe first. Run it after the collector has stopped (DuckDB allows one writer).

    Raises:
        FileNotFoundError: no such file.
        StoreAnalysisError: the store cannot be read.
    """
    from zoomer_serve.analysis.store import detect_store, load_store

    return sort_findings(detect_store(load_store(store_path)))


def analyze(traces: Sequence[str | os.PathLike[str]] | None = None,
            store_path: str | os.PathLike[str] | None = None,
            conventions: Conventions | None = None) -> AnalysisResult:
    """Analyse any number of trace files and, optionally, a store (``conventions``: see
    :func:`analyze_trace`)."""
    result = AnalysisResult()
    findings: list[Finding] = []
    for path in traces or []:
        report = analyze_trace(Path(path), conventions)
        result.traces.append(report)
        findings.extend(report.findings)
    if len(result.traces) >= 2:  # the ranks of a distributed job (or unrelated traces: tables then empty)
        from zoomer_serve.analysis.collectives import collective_tables, detect_collectives

        loaded = [r.trace for r in result.traces]
        result.collective_tables = collective_tables(loaded)
        findings.extend(detect_collectives(loaded, result.collective_tables))
    if store_path is not None:
        from zoomer_serve.analysis.render import has_gpu_work
        from zoomer_serve.analysis.store import detect_store, load_store, request_percentiles

        data = load_store(store_path)
        # a trace analysed with the store that ran GPU work says the service has a GPU, even where the store has
        # no GPU telemetry (GPU advice follows the device: docs/analysis.md)
        data.gpu = data.gpu or any(has_gpu_work(r.trace) for r in result.traces)
        result.store = data
        result.store_tables = {"request_percentiles": request_percentiles(data)}
        findings.extend(detect_store(data))
    result.findings = sort_findings(findings)
    return result
