"""The fleet report's data: what ``zoomer-serve fleet analyze`` prints with ``--json`` and draws in HTML."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zoomer_serve.analysis.findings import Finding, _clean
from zoomer_serve.fleet.spans import HeatMap


@dataclass
class FleetReport:
    """Everything the fleet job found.

    Attributes:
        source: the storage root analysed; ``run_id``; ``engine`` ("local" or "ray"); ``since_ns`` (None: all).
        counts: ``manifests`` (trace manifests listed), ``traces_analyzed``, ``traces_failed``,
            ``traces_skipped`` (ended before ``since``), ``replicas``, ``peer_groups``, ``span_requests``.
        replicas: one row per replica (:meth:`~zoomer_serve.fleet.aggregate.ReplicaFigures.row`).
        outliers: the ranked outlier list (:func:`~zoomer_serve.fleet.detect.outliers`): one entry per replica,
            metric and method, largest robust z first.
        findings: fleet findings, most severe first.
        heatmaps: ``latency_p99`` and ``gpu_utilization`` (replica x time), ``kernel_time`` (kernel x replica,
            µs per request).
        failed: artifacts that could not be analysed: ``url`` (the manifest), ``artifact`` (the trace), ``error``,
            ``attempts``.
        drilldown: instance -> the reports made for it: ``session_id``, ``trace_url``, ``html``, ``timeline``
            (paths relative to the report) or ``error``.
        outputs: where the job wrote its results (``traces``, ``replicas`` Parquet parts, ``report_json``,
            ``report_html``).
        timings: seconds since the job started at which each step ended: ``list_s`` (manifests listed),
            ``first_result_s`` (the first task back: engine start-up included), ``tasks_s`` (every task back),
            ``spans_s`` (span data read), ``detect_s`` (findings), ``total_s`` (outputs written; not in the
            written report.json, which is written before).
    """

    source: str
    run_id: str
    engine: str
    since_ns: int | None
    counts: dict[str, int] = field(default_factory=dict)
    replicas: list[dict[str, Any]] = field(default_factory=list)
    outliers: list[dict[str, Any]] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    heatmaps: dict[str, HeatMap] = field(default_factory=dict)
    failed: list[dict[str, Any]] = field(default_factory=list)
    drilldown: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    outputs: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        """Nothing to report: no trace in the window was analysed or failed, and the span data in it holds no
        request (trace artifacts that ended before ``since_ns`` count as ``traces_skipped``, not here)."""
        c = self.counts
        return not (c.get("traces_analyzed") or c.get("traces_failed") or c.get("span_requests"))

    @property
    def outlier_instances(self) -> list[str]:
        """The replicas on the outlier list, best ranked first, each once."""
        seen: dict[str, None] = {}
        for o in self.outliers:
            seen.setdefault(o["instance"], None)
        return list(seen)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (infinite z-scores become null)."""
        return _clean({
            "source": self.source, "run_id": self.run_id, "engine": self.engine, "since_ns": self.since_ns,
            "counts": self.counts, "outliers": self.outliers, "findings": [f.to_dict() for f in self.findings],
            "replicas": self.replicas, "heatmaps": {k: h.to_dict() for k, h in self.heatmaps.items()},
            "failed": self.failed, "drilldown": self.drilldown, "outputs": self.outputs, "timings": self.timings})
