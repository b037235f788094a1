"""Compute a :class:`Report` with SQL over the collector's DuckDB store.

Request counts, rates and errors come from the ``rpc.server.call.duration`` metric points when the store has them
for a method (every call, sampled or not: :mod:`zoomer_serve.report.calls`), else from the SERVER spans; latency
percentiles, phases, batching and the slowest traces come from the SERVER spans, a sample of the calls under a
head sampler (``MethodStats.spans``, ``span_sample_ratio``). A span exported twice (an OTLP client retrying an
export the collector had already stored) is counted once: rows are de-duplicated on (trace_id, span_id).
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

import duckdb

from zoomer_serve.artifacts.storage import StorageError
from zoomer_serve.batching import names as bn
from zoomer_serve.collector.parquet import open_source
from zoomer_serve.collector.store import StoreError
from zoomer_serve.report.calls import (
    MethodCalls,
    loss_notes,
    read_calls,
    read_losses,
    request_counts,
    short_metric,
)
from zoomer_serve.report.model import (
    COUNTS_FROM_METRIC,
    COUNTS_FROM_MIXED,
    COUNTS_FROM_SPANS,
    BatchingStats,
    MethodStats,
    PhaseStats,
    Report,
    ServiceBatching,
    SlowTrace,
)
from zoomer_serve.semconv import error_sql, method_sql, status_sql

NS_PER_MS = 1_000_000.0
NS_PER_S = 1_000_000_000.0
MIN_RATE_WINDOW_S = 1.0
"""The shortest first-start to last-end window a request rate is given for, s: 50 requests within 23 ms are
50 requests, not "2159.6 req/s" (shorter windows get no rate: None, shown as "-")."""


class ReportError(RuntimeError):
    """The store cannot be read as a zoomer store (not a DuckDB file, locked, no ``spans`` table)."""


# Unique spans, then request spans with their method / status labels and error flag (span status ERROR, as the
# recorder set it: zoomer_serve.semconv.error_sql).
_REQUESTS_CTE = f"""
WITH uspans AS (
    SELECT * FROM spans
    QUALIFY row_number() OVER (PARTITION BY trace_id, span_id ORDER BY received_ns) = 1
),
req AS (
    SELECT trace_id, span_id, start_ns, end_ns, duration_ns,
           coalesce(service_name, 'unknown_service') AS service_name,
           {method_sql()} AS method,
           {status_sql()} AS status,
           {error_sql()} AS is_error
    FROM uspans WHERE kind = 'SERVER'
)
"""

_METHODS_SQL = _REQUESTS_CTE + """
SELECT service_name, method, count(*) AS n, min(start_ns), max(end_ns),
       count(*) FILTER (WHERE is_error) AS errors,
       quantile_cont(duration_ns, [0.5, 0.9, 0.99]) AS q,
       max(duration_ns), avg(duration_ns), sum(duration_ns)
FROM req GROUP BY service_name, method ORDER BY service_name, method
"""

_STATUS_SQL = _REQUESTS_CTE + """
SELECT service_name, method, status, count(*) FROM req
GROUP BY ALL ORDER BY service_name, method, count(*) DESC, status
"""

_PHASES_SQL = _REQUESTS_CTE + """
, phase AS (
    SELECT trace_id, parent_span_id, duration_ns, attributes->>'$."zoomer.phase"' AS phase
    FROM uspans WHERE attributes->>'$."zoomer.phase"' IS NOT NULL AND parent_span_id IS NOT NULL
)
SELECT r.service_name, r.method, p.phase, count(*), sum(p.duration_ns), avg(p.duration_ns)
FROM req r JOIN phase p ON p.trace_id = r.trace_id AND p.parent_span_id = r.span_id
GROUP BY ALL
"""

BATCH_MESSAGES_CTE = _REQUESTS_CTE + f"""
, batch_size AS (
    SELECT span_id AS batch_id, TRY_CAST(attributes->>'$."{bn.SIZE}"' AS BIGINT) AS size
    FROM uspans WHERE kind = 'INTERNAL' AND attributes->>'$."{bn.CUT_REASON}"' IS NOT NULL
),
messages AS (
    SELECT r.service_name, r.method, r.trace_id, r.span_id, r.duration_ns, q.duration_ns AS wait_ns,
           q.attributes->>'$."{bn.BATCH_ID}"' AS batch_id,
           coalesce(b.size, TRY_CAST(u.attributes->>'$."{bn.SIZE}"' AS BIGINT)) AS size
    FROM req r
    JOIN uspans q ON q.trace_id = r.trace_id AND q.parent_span_id = r.span_id
    JOIN uspans u ON u.trace_id = r.trace_id AND u.span_id = r.span_id
    LEFT JOIN batch_size b ON b.batch_id = q.attributes->>'$."{bn.BATCH_ID}"'
    WHERE q.attributes->>'$."zoomer.phase"' = '{bn.QUEUE_PHASE}' AND q.attributes->>'$."{bn.BATCH_ID}"' IS NOT NULL
)
"""
"""One row per batched message: a request's ``queue`` child spans (one per message it queued: one for a unary call,
one per message of a stream; :mod:`zoomer_serve.batching.names`) with the request's service, method, ids and
duration (ns), the message's queue wait (``wait_ns``, the ``queue`` span's duration: enqueue to batch start), its
``batch_id`` and its batch's ``size`` (the batch span's ``zoomer.batch.size``; the request's own attribute, its last
message's, when the batch span is not in the store). The request spans' ``zoomer.batch.*`` attributes alone would
see a stream's last message only."""

_BATCHING_SQL = BATCH_MESSAGES_CTE + """
, requests AS (SELECT DISTINCT service_name, method, trace_id, span_id, duration_ns FROM messages),
per AS (
    SELECT service_name, method, grouping(method) AS total, count(DISTINCT (trace_id, span_id)) AS requests,
           count(*) AS messages, count(DISTINCT batch_id) AS batches, avg(size) AS size,
           quantile_cont(wait_ns, [0.5, 0.99]) AS q, avg(wait_ns) AS mean_ns, sum(wait_ns) AS wait_ns
    FROM messages GROUP BY GROUPING SETS ((service_name, method), (service_name))
),
request_time AS (
    SELECT service_name, method, grouping(method) AS total, sum(duration_ns) AS request_ns
    FROM requests GROUP BY GROUPING SETS ((service_name, method), (service_name))
)
SELECT p.service_name, p.method, p.total, p.requests, p.messages, p.batches, p.size, p.q, p.mean_ns, p.wait_ns,
       t.request_ns
FROM per p JOIN request_time t
  ON t.service_name = p.service_name AND t.total = p.total AND t.method IS NOT DISTINCT FROM p.method
ORDER BY p.service_name, p.total, p.method
"""

_SLOWEST_SQL = _REQUESTS_CTE + """
SELECT trace_id, service_name, method, duration_ns, status FROM req
QUALIFY row_number() OVER (PARTITION BY trace_id ORDER BY duration_ns DESC, span_id) = 1
ORDER BY duration_ns DESC, trace_id
LIMIT ?
"""


def _open(store_path: str) -> duckdb.DuckDBPyConnection:
    try:
        con = open_source(store_path)
    except StorageError as exc:
        raise ReportError(str(exc)) from None
    except StoreError as exc:
        raise ReportError(str(exc)) from exc
    tables = {row[0] for row in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    if "spans" not in tables:
        con.close()
        raise ReportError(f"{store_path} is not a zoomer-serve store (no 'spans' table)")
    return con


def _phases(con: duckdb.DuckDBPyConnection,
            request_ns: dict[tuple[str, str], float]) -> dict[tuple[str, str], list[PhaseStats]]:
    out: dict[tuple[str, str], list[PhaseStats]] = defaultdict(list)
    for service, method, phase, count, total_ns, mean_ns in con.execute(_PHASES_SQL).fetchall():
        denominator = request_ns.get((service, method)) or 0.0
        share = float(total_ns) / denominator if denominator > 0 else 0.0
        out[(service, method)].append(
            PhaseStats(phase, int(count), float(mean_ns) / NS_PER_MS, float(total_ns) / NS_PER_MS, share))
    for phases in out.values():
        phases.sort(key=lambda p: (-p.share, p.phase))
    return out


def _batching(con: duckdb.DuckDBPyConnection) -> tuple[dict[tuple[str, str], BatchingStats],
                                                      dict[str, BatchingStats]]:
    """Per (service, method) and per service (all its methods): the figures of :class:`BatchingStats`, from one row
    per batched message (:data:`BATCH_MESSAGES_CTE`)."""
    per_method, per_service = {}, {}
    for (service, method, total, n, messages, batches, size, q, mean_ns, wait_ns,
         request_ns) in con.execute(_BATCHING_SQL).fetchall():
        stats = BatchingStats(
            requests=int(n), messages=int(messages), batches=int(batches), mean_batch_size=float(size or 0.0),
            queue_wait_p50_ms=float(q[0] or 0.0) / NS_PER_MS, queue_wait_p99_ms=float(q[1] or 0.0) / NS_PER_MS,
            queue_wait_mean_ms=float(mean_ns or 0.0) / NS_PER_MS,
            queue_wait_share=float(wait_ns or 0) / float(request_ns) if request_ns else 0.0)
        if total:
            per_service[service] = stats
        else:
            per_method[(service, method)] = stats
    return per_method, per_service


def _latency(row: tuple[Any, ...] | None) -> dict[str, Any]:
    """The span-based fields of :class:`MethodStats` from a :data:`_METHODS_SQL` row (None: no span)."""
    if row is None:
        return {"p50_ms": None, "p90_ms": None, "p99_ms": None, "max_ms": None, "mean_ms": None, "spans": 0}
    _, _, n, _, _, _, q, max_ns, mean_ns, _ = row
    return {"p50_ms": q[0] / NS_PER_MS, "p90_ms": q[1] / NS_PER_MS, "p99_ms": q[2] / NS_PER_MS,
            "max_ms": max_ns / NS_PER_MS, "mean_ms": float(mean_ns) / NS_PER_MS, "spans": int(n)}


def _spans(row: tuple[Any, ...] | None) -> int:
    return int(row[2]) if row is not None else 0


def _method_stats(key: tuple[str, str], row: tuple[Any, ...] | None, statuses: dict[str, int],
                  calls: MethodCalls | None, phases: list[PhaseStats],
                  batching: BatchingStats | None = None) -> MethodStats:
    counts = request_counts(_spans(row), int(row[5]) if row is not None else 0, statuses, calls)
    count, errors = counts.count, counts.errors
    latency = _latency(row)
    window_s = (row[4] - row[3]) / NS_PER_S if row is not None else 0.0
    return MethodStats(
        service_name=key[0],
        method=key[1],
        count=count,
        rate_per_s=count / window_s if window_s >= MIN_RATE_WINDOW_S else None,
        error_count=errors,
        error_rate=errors / count if count else 0.0,
        status_counts=counts.status_counts,
        phases=phases,
        unattributed_share=1.0 - sum(p.share for p in phases) if phases else None,
        batching=batching,
        counts_from=counts.counts_from,
        span_sample_ratio=counts.span_sample_ratio,
        **latency,
    )


def _overall(methods: list[MethodStats]) -> tuple[str, float | None]:
    """``Report.counts_from`` and ``Report.span_sample_ratio`` over ``methods``."""
    sources = {m.counts_from for m in methods}
    metric = [m for m in methods if m.counts_from == COUNTS_FROM_METRIC]
    calls = sum(m.count for m in metric)
    ratio = sum(m.spans for m in metric) / calls if calls else None
    if sources == {COUNTS_FROM_METRIC}:
        return COUNTS_FROM_METRIC, ratio
    return (COUNTS_FROM_MIXED if metric else COUNTS_FROM_SPANS), ratio


def build_report(store_path: str | os.PathLike[str], slowest: int = 10) -> Report:
    """Read the store at ``store_path`` (a DuckDB file, or a Parquet dataset: folder or URL, see
    :mod:`zoomer_serve.collector.parquet`) and compute the report; ``slowest`` = how many slow traces to list.

    Raises:
        FileNotFoundError: the store file does not exist.
        ReportError: it cannot be opened read-only (locked by a running collector, not DuckDB) or has no
            ``spans`` table.
        ValueError: ``slowest`` < 0.
    """
    if slowest < 0:
        raise ValueError(f"slowest must be >= 0, got {slowest}")
    path = os.fspath(store_path)
    con = _open(path)
    try:
        rows = {(r[0], r[1]): r for r in con.execute(_METHODS_SQL).fetchall()}
        statuses: dict[tuple[str, str], dict[str, int]] = defaultdict(dict)
        for service, method, status, count in con.execute(_STATUS_SQL).fetchall():
            statuses[(service, method)][status] = int(count)
        request_ns = {key: float(r[9]) for key, r in rows.items()}
        phases = _phases(con, request_ns)
        batching, batching_services = _batching(con)
        slow = [SlowTrace(t, s, m, d / NS_PER_MS, st)
                for t, s, m, d, st in con.execute(_SLOWEST_SQL, [slowest]).fetchall()]
        calls = read_calls(con)
        losses = read_losses(con)
    except duckdb.Error as exc:  # a DuckDB file, but not a zoomer-serve store (other columns)
        raise ReportError(f"{path} is not a zoomer-serve store: {str(exc).splitlines()[0]}") from None
    finally:
        con.close()
    methods = [_method_stats(key, rows.get(key), statuses[key], calls.get(key), phases.get(key, []),
                             batching.get(key)) for key in sorted(set(rows) | set(calls))]
    counts_from, ratio = _overall(methods)
    return Report(
        store_path=str(path),
        total_requests=sum(m.count for m in methods),
        total_errors=sum(m.error_count for m in methods),
        window_start_ns=min((r[3] for r in rows.values()), default=None),
        window_end_ns=max((r[4] for r in rows.values()), default=None),
        methods=methods,
        slowest=slow,
        batching_totals=[ServiceBatching(s, b) for s, b in sorted(batching_services.items())],
        total_spans=sum(m.spans for m in methods),
        counts_from=counts_from,
        span_sample_ratio=ratio,
        notes=[note for (service, method), c in sorted(calls.items())
               if (note := short_metric(service, method, c, _spans(rows.get((service, method))))) is not None]
        + loss_notes(losses, counted_by_metric=counts_from == COUNTS_FROM_METRIC),
        export_losses=losses,
    )
