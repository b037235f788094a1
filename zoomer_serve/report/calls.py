"""Calls per service, method and status code from the ``rpc.server.call.duration`` metric points in a store.

Why: spans are a sample when a head sampler keeps only some traces (``OTEL_TRACES_SAMPLER=traceidratio``), while
the recorder counts every call, sampled or not, in the ``rpc.server.call.duration`` histogram
(:mod:`zoomer_serve.export.rpc_metrics`). As OpenTelemetry and Jaeger users expect, the report and the store
analysis take request counts, rates and errors from the metric, and latency figures from the spans.

How the points add up to calls (the store keeps every data point the collector received,
:mod:`zoomer_serve.collector.store`): a series is one attribute set of one process (its resource attributes,
which hold ``service.instance.id``) and instrumentation scope since one start time (``start_ns``).

- A point received twice (an exporter retrying an export the collector had stored) counts once: points are
  de-duplicated on the series and ``time_ns``.
- CUMULATIVE (what zoomer-serve exports): each point holds the calls since the series' start, so a series counts
  its last point; a process that restarts starts new series (a new instance id and start time). A count lower than
  the one before it in the same series (a reset that kept its start time) closes a run: each run counts its last
  point.
- DELTA: each point holds the calls of its own interval: the points add up.

Several processes, instances and services add up per (``service.name``, method, status code). Errors follow the
recorder's span status (:func:`zoomer_serve.semconv.metric_error_sql`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import duckdb

from zoomer_serve.export.rpc_metrics import CALL_DROPPED, SPAN_EXPORTED
from zoomer_serve.report.model import COUNTS_FROM_METRIC, COUNTS_FROM_SPANS, ExportLosses
from zoomer_serve.semconv import RPC_SERVER_CALL_DURATION, method_sql, metric_error_sql, metric_status_sql

CALLS_METRIC = RPC_SERVER_CALL_DURATION
"""The metric whose data points count the calls (histogram, every call, sampled or not)."""

_CALLS_SQL = f"""
WITH pts AS (
    SELECT DISTINCT coalesce(service_name, 'unknown_service') AS service_name,
           {method_sql(fallback="'_OTHER'")} AS method, {metric_status_sql()} AS status,
           {metric_error_sql()} AS is_error,
           CAST(resource_attributes AS VARCHAR) AS resource, coalesce(scope_name, '') AS scope,
           CAST(attributes AS VARCHAR) AS attrs, coalesce(start_ns, 0) AS start_ns, time_ns, count,
           coalesce(aggregation_temporality, 'CUMULATIVE') AS temporality
    FROM metric_points
    WHERE metric_name = ? AND metric_type IN ('histogram', 'exponential_histogram') AND count IS NOT NULL
),
counted AS (
    SELECT *, CASE WHEN temporality = 'DELTA' THEN count
                   WHEN coalesce(lead(count) OVER series < count, true) THEN count
                   ELSE 0 END AS calls
    FROM pts
    WINDOW series AS (PARTITION BY service_name, resource, scope, attrs, start_ns, temporality
                      ORDER BY time_ns, count)
)
SELECT service_name, method, status, is_error, sum(calls) FROM counted
GROUP BY ALL ORDER BY service_name, method, status
"""


@dataclass
class MethodCalls:
    """The calls of one service and method, as the ``rpc.server.call.duration`` metric counted them.

    Attributes:
        calls: calls, every one, sampled or not.
        errors: calls that failed by the span-status rule (:func:`zoomer_serve.semconv.metric_error_sql`).
        status_counts: calls per status code (:func:`zoomer_serve.semconv.metric_status_sql`), most first.
    """

    calls: int = 0
    errors: int = 0
    status_counts: dict[str, int] = field(default_factory=dict)


def _has_metric_points(con: duckdb.DuckDBPyConnection) -> bool:
    """Whether the store has a ``metric_points`` table (a store written without metrics may have none)."""
    tables = {row[0] for row in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    return "metric_points" in tables


def read_calls(con: duckdb.DuckDBPyConnection) -> dict[tuple[str, str], MethodCalls]:
    """Per (``service.name``, method), the calls the store's ``rpc.server.call.duration`` points count (see the
    module docstring). Empty when the store has no ``metric_points`` table or no such points (metrics off, or
    data from another instrumentation). Raises ``duckdb.Error`` when the table has other columns."""
    if not _has_metric_points(con):
        return {}
    out: dict[tuple[str, str], MethodCalls] = {}
    for service, method, status, is_error, calls in con.execute(_CALLS_SQL, [CALLS_METRIC]).fetchall():
        n = int(calls or 0)
        if n <= 0:
            continue
        entry = out.setdefault((service, method), MethodCalls())
        entry.calls += n
        entry.errors += n if is_error else 0
        entry.status_counts[status] = entry.status_counts.get(status, 0) + n
    for entry in out.values():
        entry.status_counts = dict(sorted(entry.status_counts.items(), key=lambda kv: (-kv[1], kv[0])))
    return out


@dataclass(frozen=True)
class RequestCounts:
    """The request counts of one method as the report and the store analysis give them.

    Attributes:
        count / errors / status_counts: requests, failed requests, requests per status code.
        counts_from: :data:`~zoomer_serve.report.model.COUNTS_FROM_METRIC` (the metric's calls) or
            :data:`~zoomer_serve.report.model.COUNTS_FROM_SPANS`.
        spans: the method's SERVER spans.
    """

    count: int
    errors: int
    status_counts: dict[str, int]
    counts_from: str
    spans: int

    @property
    def span_sample_ratio(self) -> float | None:
        """``spans / count`` when counted by the metric (the sampling ratio seen), else None."""
        if self.counts_from != COUNTS_FROM_METRIC or not self.count:
            return None
        return self.spans / self.count


def request_counts(spans: int, span_errors: int, span_statuses: dict[str, int],
                   calls: MethodCalls | None) -> RequestCounts:
    """One method's counts: the metric's calls when it has any and at least as many as the spans (each span is a
    call; fewer calls means metric points were lost, :func:`short_metric`), else the spans."""
    if calls is not None and calls.calls >= spans:
        return RequestCounts(calls.calls, calls.errors, calls.status_counts, COUNTS_FROM_METRIC, spans)
    return RequestCounts(spans, span_errors, span_statuses, COUNTS_FROM_SPANS, spans)


def short_metric(service: str, method: str, calls: MethodCalls | None, spans: int) -> str | None:
    """The note for a method whose metric counted fewer calls than it has spans (an export of the metric lost, or
    a process stopped before its last one), which is then counted by its spans; None when there is nothing to
    say."""
    if calls is None or calls.calls >= spans:
        return None
    return (f"{service} {method}: {CALLS_METRIC} counts {calls.calls} calls but the store has {spans} spans "
            "(metric points lost?); counted by its spans")


SPANS_LOST_METRIC = SPAN_EXPORTED
CALLS_LOST_METRIC = CALL_DROPPED

_LOSSES_SQL = """
WITH pts AS (
    SELECT DISTINCT metric_name, coalesce(service_name, 'unknown_service') AS service_name,
           CAST(resource_attributes AS VARCHAR) AS resource, coalesce(scope_name, '') AS scope,
           attributes->>'$."error.type"' AS error_type, coalesce(start_ns, 0) AS start_ns, time_ns, value
    FROM metric_points
    WHERE metric_name IN (?, ?) AND metric_type = 'sum' AND value IS NOT NULL
      AND attributes->>'$."error.type"' IS NOT NULL
),
series AS (
    SELECT metric_name, service_name, resource, scope, error_type, start_ns, arg_max(value, time_ns) AS value
    FROM pts GROUP BY ALL
),
process AS (
    SELECT metric_name, error_type, max(value) AS value FROM series
    GROUP BY metric_name, service_name, resource, scope, error_type
)
SELECT metric_name, error_type, sum(value) FROM process GROUP BY ALL ORDER BY metric_name, error_type
"""


def read_losses(con: duckdb.DuckDBPyConnection) -> ExportLosses:
    """The store's export loss counters (see :class:`ExportLosses`); only non-zero counts. A process's counters
    are cumulative over its life, across export helper processes (each restarted one exports the counts of those
    before it), so each process counts the largest of its series' last points. Empty when the store has no
    ``metric_points`` table. Raises ``duckdb.Error`` when the table has other columns."""
    losses = ExportLosses()
    if not _has_metric_points(con):
        return losses
    for metric, error_type, value in con.execute(_LOSSES_SQL, [SPANS_LOST_METRIC, CALLS_LOST_METRIC]).fetchall():
        n = int(value or 0)
        if n > 0:
            (losses.spans if metric == SPANS_LOST_METRIC else losses.calls)[str(error_type)] = n
    return losses


_WHY = {"queue_full": "a full export queue", "too_large": "too large to export",
        "helper_lost": "an export helper process died holding them", "export_failed": "a failed export",
        "rejected": "rejected by the collector"}


def loss_notes(losses: ExportLosses, counted_by_metric: bool = True) -> list[str]:
    """The notes the report and the store analysis print for non-zero export losses: how many and why.
    ``counted_by_metric``: the request counts shown are every method's ``rpc.server.call.duration`` calls, so the
    calls missing from the metric are missing from them too (the note says so); where some are counted by their
    SERVER spans instead, a call missing from the metric may still have its span there."""
    notes = []
    if losses.calls_missing:
        counts = " and the counts above" if counted_by_metric else ""
        notes.append(f"{losses.calls_missing} calls are missing from {CALLS_METRIC}{counts} "
                     f"({_reasons(losses.calls)}; {CALLS_LOST_METRIC})")
    if losses.spans_lost:
        notes.append(f"{losses.spans_lost} spans were lost on the way to the store ({_reasons(losses.spans)}; "
                     f"{SPANS_LOST_METRIC} with error.type)")
    return notes


def _reasons(counts: dict[str, int]) -> str:
    return ", ".join(f"{_WHY.get(k, k)}: {v}" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
