"""The fleet's span data (a Parquet dataset the collectors wrote, :mod:`zoomer_serve.collector.parquet`): per
replica latency, errors, allocator retries, host CPU and GPU utilization, and the replica-by-time matrices of
the heat maps. DuckDB aggregates; what comes back is one row per replica (and method, and time bucket).

Requests are SERVER spans, de-duplicated on ``(trace_id, span_id)`` as the report does; a replica is
(``service.name``, ``service.instance.id``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import duckdb

from zoomer_serve.analysis import labels as L
from zoomer_serve.fleet.aggregate import FleetAggregator
from zoomer_serve.semconv import error_sql, method_sql

HEATMAP_BUCKETS = 48
LATENCY_BUCKETS_PER_DOUBLING = 8
"""Per replica and method, request counts per latency bucket ``floor(8 log2(duration_ns))`` (9 % wide): how
many requests lie above a threshold, for :mod:`~zoomer_serve.fleet.detect`'s sample-size check."""
PROCESS_CPU_UTILIZATION = "process.cpu.utilization"


@dataclass
class HeatMap:
    """A matrix for a heat map: ``rows`` (labels, e.g. replicas), ``columns`` (labels, e.g. bucket start times as
    ISO 8601 UTC), ``values`` (rows x columns, None where there is no data), ``unit``, ``title``, and for each row
    its peer group (``groups``)."""

    name: str
    title: str
    unit: str
    rows: list[str] = field(default_factory=list)
    columns: list[str] = field(default_factory=list)
    values: list[list[float | None]] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "title": self.title, "unit": self.unit, "rows": self.rows,
                "columns": self.columns, "values": self.values, "groups": self.groups}


_REQ = f"""
WITH req AS (
    SELECT coalesce(service_name, 'unknown_service') AS service, coalesce(service_instance_id, '') AS instance,
           {method_sql()} AS method, start_ns, duration_ns,
           {error_sql()} AS is_error,
           coalesce(TRY_CAST(attributes->>'$."{{retries}}"' AS DOUBLE), 0) AS retries,
           CAST(resource_attributes AS VARCHAR) AS resource
    FROM spans WHERE kind = 'SERVER' AND start_ns >= ?
    QUALIFY row_number() OVER (PARTITION BY trace_id, span_id ORDER BY received_ns) = 1
)
"""


def _req_cte() -> str:
    return _REQ.replace("{retries}", L.GPU_MEMORY_ALLOC_RETRIES)


def _buckets(t0: int, t1: int, n: int) -> int:
    return max(1, (t1 - t0 + n - 1) // n)


def read_spans(con: duckdb.DuckDBPyConnection, agg: FleetAggregator, since_ns: int = 0) -> dict[str, HeatMap]:
    """Fill the span-side figures of ``agg``'s replicas (adding replicas that have spans but no trace) and
    return the heat maps ``latency_p99`` and ``gpu_utilization`` (replica x time)."""
    cte = _req_cte()
    for service, instance, method, n, p50, p99, errors, retries, resource in con.execute(cte + """
        SELECT service, instance, method, count(*), quantile_cont(duration_ns, 0.5) / 1e6,
               quantile_cont(duration_ns, 0.99) / 1e6, count(*) FILTER (WHERE is_error), sum(retries),
               any_value(resource)
        FROM req GROUP BY ALL ORDER BY service, instance, method""", [since_ns]).fetchall():
        r = agg.replica(service, instance)
        r.methods[method] = {"count": int(n), "p50_ms": float(p50), "p99_ms": float(p99), "errors": int(errors)}
        r.span_requests += int(n)
        r.span_errors += int(errors)
        r.alloc_retries += float(retries or 0)
        if not r.resource and resource:
            try:
                r.resource = {k: v for k, v in json.loads(resource).items()}
            except ValueError:
                pass
        r.gpu_model = r.gpu_model or str(r.resource.get("zoomer.gpu.model") or "")
        r.host = r.host or str(r.resource.get("host.name") or "")
    for service, instance, method, bucket, n in con.execute(cte + f"""
        SELECT service, instance, method, CAST(floor(log2(greatest(duration_ns, 1)) * {LATENCY_BUCKETS_PER_DOUBLING})
               AS INTEGER) AS bucket, count(*)
        FROM req GROUP BY ALL""", [since_ns]).fetchall():
        buckets = agg.replica(service, instance).methods[method].setdefault("latency_buckets", {})
        buckets[int(bucket)] = int(n)
    metrics = f"""
        SELECT coalesce(service_name, 'unknown_service') AS service, coalesce(service_instance_id, '') AS instance,
               metric_name, avg(value) FROM metric_points
        WHERE metric_name IN ('{PROCESS_CPU_UTILIZATION}', '{L.METRIC_GPU_UTILIZATION}') AND value IS NOT NULL
          AND time_ns >= ?
        GROUP BY ALL"""
    for service, instance, name, value in con.execute(metrics, [since_ns]).fetchall():
        r = agg.replica(service, instance)
        if name == PROCESS_CPU_UTILIZATION:
            r.host_cpu = float(value)
        else:
            r.gpu_utilization = float(value)
    return {"latency_p99": _latency_heatmap(con, cte, since_ns), "gpu_utilization": _gpu_heatmap(con, since_ns)}


def _iso(ns: int) -> str:
    import time

    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ns / 1e9))


def _matrix(rows: list[tuple[Any, ...]], t0: int, width: int, n: int, name: str, title: str, unit: str) -> HeatMap:
    hm = HeatMap(name, title, unit, columns=[_iso(t0 + i * width) for i in range(n)])
    index: dict[tuple[str, str], int] = {}
    for service, instance, bucket, value in rows:
        key = (service, instance)
        if key not in index:
            index[key] = len(hm.rows)
            hm.rows.append(instance)
            hm.groups.append(service)
            hm.values.append([None] * n)
        b = min(max(int(bucket), 0), n - 1)
        hm.values[index[key]][b] = float(value)
    return hm


def _latency_heatmap(con: duckdb.DuckDBPyConnection, cte: str, since_ns: int) -> HeatMap:
    bounds = con.execute(cte + "SELECT min(start_ns), max(start_ns) FROM req", [since_ns]).fetchone()
    if not bounds or bounds[0] is None:
        return HeatMap("latency_p99", "p99 latency per replica over time", "ms")
    t0, t1 = int(bounds[0]), int(bounds[1]) + 1
    width = _buckets(t0, t1, HEATMAP_BUCKETS)
    rows = con.execute(cte + """
        SELECT service, instance, (start_ns - ?) // ? AS bucket, quantile_cont(duration_ns, 0.99) / 1e6
        FROM req GROUP BY ALL ORDER BY service, instance, bucket""", [since_ns, t0, width]).fetchall()
    return _matrix(rows, t0, width, HEATMAP_BUCKETS, "latency_p99", "p99 latency per replica over time", "ms")


def _gpu_heatmap(con: duckdb.DuckDBPyConnection, since_ns: int) -> HeatMap:
    name = L.METRIC_GPU_UTILIZATION
    where = f"metric_name = '{name}' AND value IS NOT NULL AND time_ns >= ?"
    bounds = con.execute(f"SELECT min(time_ns), max(time_ns) FROM metric_points WHERE {where}", [since_ns]).fetchone()
    if not bounds or bounds[0] is None:
        return HeatMap("gpu_utilization", "GPU utilization (NVML) per replica over time", "ratio")
    t0, t1 = int(bounds[0]), int(bounds[1]) + 1
    width = _buckets(t0, t1, HEATMAP_BUCKETS)
    rows = con.execute(f"""
        SELECT coalesce(service_name, 'unknown_service'), coalesce(service_instance_id, ''),
               (time_ns - ?) // ? AS bucket, avg(value)
        FROM metric_points WHERE {where} GROUP BY ALL ORDER BY 1, 2, 3""", [t0, width, since_ns]).fetchall()
    return _matrix(rows, t0, width, HEATMAP_BUCKETS, "gpu_utilization", "GPU utilization (NVML) per replica over time",
                   "ratio")
