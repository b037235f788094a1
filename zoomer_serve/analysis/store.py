"""Request-level analysis over the collector's DuckDB store: load requests, phases and GPU memory samples,
and the detectors that work on them (tail latency, slow replicas, CPU-bound phases, GPU memory).

The CPU-bound-phase finding names the function behind it from the Python CPU profile of a profiling session
that covered those requests (the top functions on its ``zoomer.profile`` span, linked to the request spans),
and says how much of the requests' wall time their thread spent on a CPU (``zoomer.request.cpu_time_ns``).

Requests are SERVER-kind spans (de-duplicated on ``(trace_id, span_id)`` as the report does), a sample of the calls
under a head sampler; request counts and errors come, as in the report, from the ``rpc.server.call.duration`` metric
where the store has it (:mod:`zoomer_serve.report.calls`, :func:`request_percentiles`). Their method
is ``rpc.method`` (``pkg.Service/Method``; :func:`zoomer_serve.semconv.method_sql`), else the span name; their
replica is the resource attribute ``service.instance.id``. Phases are the direct children of a request that carry ``zoomer.phase``.
Latencies are in milliseconds, times in Unix epoch nanoseconds.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import numpy as np

from zoomer_serve.analysis import labels as L
from zoomer_serve.analysis.findings import AT_STAKE, Finding, severity_for_share
from zoomer_serve.analysis.table import Table
from zoomer_serve.artifacts.storage import StorageError
from zoomer_serve.batching.names import QUEUE_PHASE
from zoomer_serve.collector.parquet import open_source
from zoomer_serve.collector.store import StoreError
from zoomer_serve.report.calls import (
    MethodCalls,
    RequestCounts,
    loss_notes,
    read_calls,
    read_losses,
    request_counts,
)
from zoomer_serve.report.model import COUNTS_FROM_METRIC, COUNTS_FROM_SPANS, ExportLosses
from zoomer_serve.semconv import error_sql, method_sql, status_sql

NS_PER_MS = 1e6

# request.tail-latency
TAIL_MIN_REQUESTS = 20
TAIL_RATIO = 3.0
# request.slow-replica
REPLICA_MIN_REQUESTS = 10
REPLICA_RATIO = 1.5
REPLICA_MIN_DIFF_MS = 1.0
# request.cpu-bound-phase: phase mean / forward mean
PHASE_RATIO = 1.0
CPU_PHASES = (L.PHASE_PREPROCESS, L.PHASE_POSTPROCESS)
# gpu.memory-fragmentation: reserved / peak-allocated and reserved - peak
FRAGMENTATION_RATIO = 1.5
FRAGMENTATION_MIN_BYTES = 256 << 20
MAX_ITEMS = 10


class StoreAnalysisError(RuntimeError):
    """The store cannot be read (locked by a running collector, not DuckDB, no ``spans`` table)."""


_UNIQUE = """
WITH uspans AS (
    SELECT * FROM spans
    QUALIFY row_number() OVER (PARTITION BY trace_id, span_id ORDER BY received_ns) = 1
)
"""

_REQUESTS_SQL = _UNIQUE + f"""
SELECT trace_id, span_id, {method_sql()} AS method,
       coalesce(service_name, 'unknown_service') AS service,
       coalesce(service_instance_id, '') AS instance, start_ns, duration_ns,
       {status_sql()} AS status, {error_sql()} AS is_error,
       CAST(attributes AS VARCHAR) AS attributes,
       (coalesce(attributes->>'$."{L.ERROR_TYPE}"', '') LIKE '%{L.OOM_ERROR_MARKER}%'
        OR coalesce(status_message, '') LIKE '%{L.OOM_ERROR_MARKER}%'
        OR coalesce(CAST(events AS VARCHAR), '') LIKE '%{L.OOM_ERROR_MARKER}%'
        OR coalesce(CAST(events AS VARCHAR), '') LIKE '%"{L.GPU_OOM_EVENT}"%') AS oom
FROM uspans WHERE kind = 'SERVER'
ORDER BY start_ns, trace_id, span_id
"""

_PHASES_SQL = _UNIQUE + f"""
SELECT trace_id, parent_span_id, attributes->>'$."{L.PHASE_ATTRIBUTE}"' AS phase, duration_ns, start_ns
FROM uspans WHERE attributes->>'$."{L.PHASE_ATTRIBUTE}"' IS NOT NULL AND parent_span_id IS NOT NULL
"""


def _attr_int(name: str) -> str:
    return "TRY_CAST(attributes->>'$.\"" + name + "\"' AS BIGINT)"


def _attr_present(name: str) -> str:
    return "attributes->>'$.\"" + name + "\"' IS NOT NULL"


_ANY_MEMORY_ATTRIBUTE = " OR ".join(_attr_present(a) for a in L.GPU_MEMORY_ATTRIBUTES)


_MEMORY_SQL = _UNIQUE + f"""
SELECT end_ns, coalesce(service_instance_id, '') AS instance, trace_id, span_id,
       {_attr_int(L.GPU_MEMORY_ALLOCATED)}, {_attr_int(L.GPU_MEMORY_RESERVED)}, {_attr_int(L.GPU_MEMORY_PEAK)},
       {_attr_int(L.GPU_MEMORY_ALLOC_RETRIES)}, {_attr_int(L.GPU_MEMORY_OOMS)}
FROM uspans
WHERE {_ANY_MEMORY_ATTRIBUTE}
ORDER BY end_ns
"""

_CPU_PROFILES_SQL = _UNIQUE + f"""
SELECT coalesce(service_name, 'unknown_service') AS service, attributes->>'$."{L.PROFILE_SESSION_ID}"' AS session,
       CAST(links AS VARCHAR) AS links, CAST(attributes AS VARCHAR) AS attributes
FROM uspans WHERE name = '{L.PROFILE_SPAN}' AND attributes->>'$."{L.CPU_TOP_FUNCTION}"' IS NOT NULL
ORDER BY start_ns
"""

_GPU_SEEN_SQL = _UNIQUE + f"""
SELECT count(*) FROM (SELECT 1 FROM uspans
WHERE {_attr_present(L.GPU_DEVICES)} OR coalesce({_attr_int(L.PROFILE_KERNEL_COUNT)}, 0) > 0 LIMIT 1)
"""

_METRICS_SQL = f"""
SELECT metric_name, coalesce(service_instance_id, '') AS instance,
       coalesce(attributes->>'$."{L.METRIC_HW_ID}"', '') AS hw_id, time_ns, value
FROM metric_points WHERE metric_name IN ('{L.METRIC_GPU_UTILIZATION}', '{L.METRIC_GPU_MEMORY_USAGE}')
  AND value IS NOT NULL
ORDER BY time_ns
"""


@dataclass
class CpuProfile:
    """The Python CPU profile of one profiling session, as its ``zoomer.profile`` span tells it: ``service``,
    ``session_id``, ``path`` (speedscope file), ``samples`` (active), ``top`` (dicts ``function``, ``location``,
    ``self_share``, ``total_share``; most own samples first) and ``requests`` (the linked request spans'
    ``(trace_id, span_id)`` as hex)."""

    service: str
    session_id: str
    path: str
    samples: int
    top: list[dict[str, Any]]
    requests: set[tuple[str, str]]


def _cpu_profile(service: str, session: str | None, links: str | None, attributes: str | None) -> CpuProfile | None:
    try:
        attrs = json.loads(attributes or "{}")
        linked = json.loads(links or "[]") or []
    except ValueError:
        return None
    columns = [attrs.get(k) or [] for k in (L.CPU_TOP_FUNCTION, L.CPU_TOP_LOCATION, L.CPU_TOP_SELF_SHARE,
                                            L.CPU_TOP_TOTAL_SHARE)]
    top = [{"function": f, "location": loc, "self_share": float(s), "total_share": float(t)}
           for f, loc, s, t in zip(*columns)]
    requests = {(str(k.get("trace_id")), str(k.get("span_id"))) for k in linked if isinstance(k, dict)}
    return CpuProfile(service, session or "", str(attrs.get(L.CPU_PROFILE_PATH, "")),
                      int(attrs.get(L.CPU_PROFILE_SAMPLES) or 0), top, requests)


@dataclass
class StoreData:
    """What the request-level analysis reads from a store.

    Attributes:
        path: the store file, or the Parquet dataset's folder (a URL stays a string).
        requests: one row per request span: ``trace_id``, ``span_id``, ``method``, ``service``,
            ``instance`` (``service.instance.id``, "" when absent), ``start_ns``, ``duration_ms``,
            ``status`` (the status code, :func:`~zoomer_serve.semconv.status_sql`), ``is_error`` (span status
            ERROR, :func:`~zoomer_serve.semconv.error_sql`), ``oom`` (failed with CUDA out-of-memory),
            ``attributes`` (JSON text).
        phases: one row per phase span directly under a request: ``request`` (row index in
            ``requests``), ``phase``, ``start_ns``, ``duration_ms``.
        memory: GPU memory samples from span attributes: ``time_ns``, ``instance``, ``trace_id``,
            ``allocated_bytes``, ``reserved_bytes``, ``peak_bytes`` (-1 when absent), ``alloc_retries``,
            ``ooms`` (0 when absent).
        gpu_metrics: ``hw.gpu.*`` metric points: ``metric``, ``instance``, ``hw_id``, ``time_ns``, ``value``.
        cpu_profiles: one :class:`CpuProfile` per ``zoomer.profile`` span that carries a CPU profile's top-N.
        gpu: whether the service ran on a GPU, as the store tells it: a span carries GPU memory attributes
            (``zoomer.gpu.*``, written only when CUDA is available), a profiling session recorded kernels
            (``zoomer.profile.kernel.count`` > 0), or there are ``hw.gpu.*`` metric points. Detectors give GPU
            advice only when it is true.
        calls: per (service, method), the calls the ``rpc.server.call.duration`` metric counted, every one,
            sampled or not (:func:`zoomer_serve.report.calls.read_calls`); empty when the store has no such metric
            (and for a time window of a store, whose calls the cumulative points cannot tell).
        losses: what the exporters counted as lost on the way to the store: calls missing from the metric and
            spans (:func:`zoomer_serve.report.calls.read_losses`).
    """

    path: Path | str
    requests: Table
    phases: Table
    memory: Table
    gpu_metrics: Table
    cpu_profiles: list[CpuProfile] = field(default_factory=list)
    gpu: bool = False
    calls: dict[tuple[str, str], MethodCalls] = field(default_factory=dict)
    losses: ExportLosses = field(default_factory=ExportLosses)
    _attrs: list[dict[str, Any]] | None = field(default=None, repr=False, init=False)
    _parsed: np.ndarray | None = field(default=None, repr=False, init=False)

    def attributes(self, i: int) -> dict[str, Any]:
        """Parsed attributes of request row ``i``."""
        if self._attrs is None or self._parsed is None:
            self._attrs = [{} for _ in range(len(self.requests))]
            self._parsed = np.zeros(len(self.requests), dtype=bool)
        if not self._parsed[i]:
            raw = self.requests["attributes"][i]
            try:
                self._attrs[i] = json.loads(raw) if raw else {}
            except ValueError:
                self._attrs[i] = {}
            self._parsed[i] = True
        return self._attrs[i]


def load_store(store_path: str | os.PathLike[str]) -> StoreData:
    """Read requests, phases, GPU memory samples and GPU metrics from a zoomer-serve store: a DuckDB file, or a
    Parquet dataset the collector wrote (folder or URL, :mod:`zoomer_serve.collector.parquet`).

    Raises:
        FileNotFoundError: no such file.
        StoreAnalysisError: it cannot be opened read-only (a collector still writes it, not DuckDB) or has
            no ``spans`` table.
    """
    path = os.fspath(store_path)  # a str: Path("") would be the working directory
    try:
        con = open_source(path)
    except StorageError as exc:
        raise StoreAnalysisError(str(exc)) from None
    except StoreError as exc:
        raise StoreAnalysisError(str(exc)) from exc
    try:
        tables = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
        if "spans" not in tables:
            raise StoreAnalysisError(f"{path} is not a zoomer-serve store (no 'spans' table)")
        req = con.execute(_REQUESTS_SQL).fetchall()
        ph = con.execute(_PHASES_SQL).fetchall()
        mem = con.execute(_MEMORY_SQL).fetchall()
        met = con.execute(_METRICS_SQL).fetchall() if "metric_points" in tables else []
        cpu = con.execute(_CPU_PROFILES_SQL).fetchall()
        gpu_spans = con.execute(_GPU_SEEN_SQL).fetchone()
        calls = read_calls(con)
        losses = read_losses(con)
    except duckdb.Error as exc:
        raise StoreAnalysisError(f"cannot read {path}: {exc}") from exc
    finally:
        con.close()
    requests = Table.from_rows(
        "requests", ("trace_id", "span_id", "method", "service", "instance", "start_ns", "duration_ms", "status",
                     "is_error", "attributes", "oom"),
        [(r[0], r[1], r[2], r[3], r[4], int(r[5]), int(r[6]) / NS_PER_MS, str(r[7]), bool(r[8]), r[9] or "",
          bool(r[10])) for r in req],
        units={"start_ns": "ns", "duration_ms": "ms"},
        dtypes={"trace_id": object, "span_id": object, "method": object, "service": object, "instance": object,
                "start_ns": np.int64, "duration_ms": np.float64, "status": object, "is_error": bool,
                "attributes": object, "oom": bool})
    index = {(t, s): i for i, (t, s) in enumerate(zip(requests["trace_id"].tolist(), requests["span_id"].tolist()))}
    phase_rows = [(index[(t, p)], str(name), int(start), int(d) / NS_PER_MS)
                  for t, p, name, d, start in ph if (t, p) in index]
    phases = Table.from_rows("phases", ("request", "phase", "start_ns", "duration_ms"), phase_rows,
                             units={"start_ns": "ns", "duration_ms": "ms"},
                             dtypes={"request": np.int64, "phase": object, "start_ns": np.int64,
                                     "duration_ms": np.float64})
    memory = Table.from_rows(
        "gpu_memory", ("time_ns", "instance", "trace_id", "allocated_bytes", "reserved_bytes", "peak_bytes",
                       "alloc_retries", "ooms"),
        [(int(r[0]), r[1], r[2], _i(r[4], -1), _i(r[5], -1), _i(r[6], -1), _i(r[7], 0), _i(r[8], 0)) for r in mem],
        units={"time_ns": "ns", "allocated_bytes": "bytes", "reserved_bytes": "bytes", "peak_bytes": "bytes"},
        dtypes={"time_ns": np.int64, "instance": object, "trace_id": object, "allocated_bytes": np.int64,
                "reserved_bytes": np.int64, "peak_bytes": np.int64, "alloc_retries": np.int64, "ooms": np.int64})
    metrics = Table.from_rows(
        "gpu_metrics", ("metric", "instance", "hw_id", "time_ns", "value"),
        [(r[0], r[1], r[2], int(r[3]), float(r[4])) for r in met], units={"time_ns": "ns"},
        dtypes={"metric": object, "instance": object, "hw_id": object, "time_ns": np.int64, "value": np.float64})
    profiles = [p for p in (_cpu_profile(*row) for row in cpu) if p is not None]
    gpu = bool(len(memory) or len(metrics) or (gpu_spans and gpu_spans[0]))
    return StoreData(path, requests, phases, memory, metrics, profiles, gpu, calls, losses)


def _i(value: Any, default: int) -> int:
    return int(value) if value is not None else default


def _groups(data: StoreData) -> dict[tuple[str, str], np.ndarray]:
    """Row indices of requests per (service, method)."""
    out: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, key in enumerate(zip(data.requests["service"].tolist(), data.requests["method"].tolist())):
        out[key].append(i)
    return {k: np.array(v, dtype=np.int64) for k, v in out.items()}


def _phase_matrix(data: StoreData, rows: np.ndarray) -> dict[str, np.ndarray]:
    """Phase name -> summed phase time (ms) per request in ``rows`` (0 where the request lacks it)."""
    pos = np.full(len(data.requests), -1, dtype=np.int64)
    pos[rows] = np.arange(len(rows))
    out: dict[str, np.ndarray] = {}
    ph = data.phases
    where = pos[ph["request"]] if len(ph) else np.empty(0, dtype=np.int64)
    for name in np.unique(ph["phase"]) if len(ph) else []:
        sel = (ph["phase"] == name) & (where >= 0)
        if not sel.any():
            continue
        acc = np.zeros(len(rows))
        np.add.at(acc, where[sel], ph["duration_ms"][sel])
        out[str(name)] = acc
    return out


def method_counts(data: StoreData, service: str, method: str, rows: np.ndarray) -> RequestCounts:
    """The request counts of one method (``rows``: its request spans' row indices), as the report gives them:
    the calls the ``rpc.server.call.duration`` metric counted where the store has it, else the spans
    (:func:`zoomer_serve.report.calls.request_counts`)."""
    req = data.requests
    statuses = Counter(str(s) for s in req["status"][rows].tolist())
    return request_counts(len(rows), int(req["is_error"][rows].sum()), dict(statuses),
                          data.calls.get((service, method)))


def request_percentiles(data: StoreData) -> Table:
    """Per service and method: ``count`` and ``errors`` (requests and failed ones: the calls the
    ``rpc.server.call.duration`` metric counted where the store has it, else the SERVER spans, as the report;
    ``counts_from`` says which), ``spans`` (the SERVER spans the latency figures rest on: a sample of the requests
    under a head sampler), ``sampled_share`` (spans / count when counted by the metric, else NaN), and the spans'
    ``p50_ms``, ``p90_ms``, ``p99_ms``, ``max_ms``, ``p99_over_p50`` (linear interpolation, as the report; NaN for a
    method with calls but no span)."""
    rows = []
    groups = _groups(data)
    for service, method in sorted(set(groups) | set(data.calls)):
        idx = groups.get((service, method), np.empty(0, dtype=np.int64))
        counts = method_counts(data, service, method, idx)
        ratio = counts.span_sample_ratio
        d = data.requests["duration_ms"][idx]
        p50, p90, p99 = (float(x) for x in np.quantile(d, [0.5, 0.9, 0.99])) if len(d) else (math.nan,) * 3
        rows.append((service, method, counts.count, counts.errors, len(idx),
                     math.nan if ratio is None else ratio, counts.counts_from, p50, p90, p99,
                     float(d.max()) if len(d) else math.nan, p99 / p50 if p50 > 0 else math.nan))
    return Table.from_rows(
        "request_percentiles", ("service", "method", "count", "errors", "spans", "sampled_share", "counts_from",
                                "p50_ms", "p90_ms", "p99_ms", "max_ms", "p99_over_p50"), rows,
        units={"sampled_share": "ratio", "p50_ms": "ms", "p90_ms": "ms", "p99_ms": "ms", "max_ms": "ms",
               "p99_over_p50": "x"},
        description=("count, errors: requests (counts_from: the rpc.server.call.duration metric, every call, or "
                     "the SERVER spans); spans: the SERVER spans the latency percentiles rest on"),
        dtypes={"service": object, "method": object, "count": np.int64, "errors": np.int64, "spans": np.int64,
                "sampled_share": np.float64, "counts_from": object, "p50_ms": np.float64, "p90_ms": np.float64,
                "p99_ms": np.float64, "max_ms": np.float64, "p99_over_p50": np.float64})


def _scope(service: str, method: str, instance: str | None = None) -> str:
    s = f"{service} {method}"
    return f"{s} @ {instance}" if instance else s


_TIME_SUFFIXES = ("_ns", "_us", "_ms", "_s")
"""Attributes whose names end so hold times (queue wait, CPU time): outcomes of a slow request, not traits
that explain it; the phases stand for them."""
OUTSIDE_PHASES = "(outside phases)"


def _largest_part(phases: dict[str, np.ndarray], durations: np.ndarray, j: int) -> tuple[str, float]:
    """The phase in which request ``j`` (an index into ``durations`` and the phase arrays) spent most time, or
    :data:`OUTSIDE_PHASES` when the time outside its phases is larger; with that time in ms."""
    parts = {p: float(v[j]) for p, v in phases.items()}
    parts[OUTSIDE_PHASES] = max(float(durations[j]) - sum(parts.values()), 0.0)
    return max(parts.items(), key=lambda kv: kv[1])


def _traits(data: StoreData, rows: np.ndarray, slow: np.ndarray) -> list[dict[str, Any]]:
    """What the slow requests (indices into ``rows``) share, as list of trait dicts, strongest first."""
    traits: list[dict[str, Any]] = []
    n_all, n_slow = len(rows), len(slow)
    req = data.requests
    # categorical: replica, status, string/bool attributes with few distinct values
    cats: dict[str, list[Any]] = {"service.instance.id": req["instance"][rows].tolist(),
                                  "status": req["status"][rows].tolist()}
    numeric: dict[str, list[float]] = {}
    keys: Counter[str] = Counter()
    attrs = [data.attributes(int(i)) for i in rows]
    for a in attrs:
        keys.update(a.keys())
    for key, c in keys.items():
        if key in (L.RPC_METHOD, L.REQUEST_CPU_TIME) or key.endswith(_TIME_SUFFIXES) or c < n_all * 0.5:
            continue
        values = [a.get(key) for a in attrs]
        sample = next((v for v in values if v is not None), None)
        if isinstance(sample, bool) or isinstance(sample, str):
            cats[key] = values
        elif isinstance(sample, (int, float)):
            numeric[key] = [float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan
                            for v in values]
    for key, values in cats.items():
        if len(set(values)) > 20 or len(set(values)) < 2:
            continue
        slow_vals = Counter(values[i] for i in slow)
        value, count = slow_vals.most_common(1)[0]
        share_slow = count / n_slow
        share_all = sum(1 for v in values if v == value) / n_all
        if share_slow >= 0.5 and share_slow >= 2 * share_all:
            traits.append({"trait": f"{key} = {value}", "kind": "attribute", "key": key, "value": value,
                           "share_of_slow": share_slow, "share_of_all": share_all, "lift": share_slow / share_all})
    for key, nums in numeric.items():
        arr = np.array(nums)
        if np.isnan(arr).all():
            continue
        med_all = float(np.nanmedian(arr))
        med_slow = float(np.nanmedian(arr[slow])) if not np.isnan(arr[slow]).all() else math.nan
        if med_all > 0 and med_slow >= 2 * med_all:
            traits.append({"trait": f"larger {key} (median {med_slow:g} vs {med_all:g})", "kind": "numeric",
                           "key": key, "median_slow": med_slow, "median_all": med_all,
                           "lift": med_slow / med_all})
    # warm-up: slow requests among the first requests of their replica
    inst = req["instance"][rows]
    first = np.zeros(n_all, dtype=bool)
    for value in np.unique(inst):
        sel = np.flatnonzero(inst == value)
        first[sel[np.argsort(req["start_ns"][rows][sel], kind="stable")[:max(1, len(sel) // 100)]]] = True
    share_first = float(first[slow].mean())
    if share_first >= 0.5 and share_first >= 2 * float(first.mean()):
        traits.append({"trait": "first requests of their replica (warm-up)", "kind": "warmup",
                       "share_of_slow": share_first, "share_of_all": float(first.mean()),
                       "lift": share_first / max(float(first.mean()), 1e-9)})
    # phases: which phase grows most in the slow requests, named only when it is also where most of the slow
    # requests spend their time (their largest part)
    phases = _phase_matrix(data, rows)
    if phases:
        excess = {p: float(np.median(v[slow]) - np.median(v)) for p, v in phases.items()}
        p, ex = max(excess.items(), key=lambda kv: kv[1])
        total_excess = float(np.median(req["duration_ms"][rows][slow]) - np.median(req["duration_ms"][rows]))
        largest = Counter(_largest_part(phases, req["duration_ms"][rows], j)[0] for j in slow)
        if ex > 0 and total_excess > 0 and largest[p] * 2 > len(slow):
            traits.append({"trait": f"more time in phase {p} (+{ex:.1f} ms at the median)", "kind": "phase",
                           "phase": p, "excess_ms": ex, "share_of_excess": ex / total_excess, "lift": ex / total_excess})
    traits.sort(key=lambda t: -float(t.get("lift", 0)))
    return traits


def detect_tail_latency(data: StoreData) -> list[Finding]:
    """``request.tail-latency``: methods (>= 20 requests) whose p99 is >= 3x their p50, with the slowest
    traces and what the slowest 1% share (replica, status, attributes, warm-up, the phase that grew)."""
    out = []
    req = data.requests
    for (service, method), rows in sorted(_groups(data).items()):
        if len(rows) < TAIL_MIN_REQUESTS:
            continue
        d = req["duration_ms"][rows]
        p50, p90, p99 = (float(x) for x in np.quantile(d, [0.5, 0.9, 0.99]))
        if p50 <= 0 or p99 / p50 < TAIL_RATIO:
            continue
        ratio = p99 / p50
        slow = np.flatnonzero(d >= p99)
        traits = _traits(data, rows, slow)
        phases = _phase_matrix(data, rows)
        order = np.argsort(-d, kind="stable")[:max(MAX_ITEMS, len(slow))]
        items = []
        for j in order:
            i = rows[j]
            item: dict[str, Any] = {"trace_id": req["trace_id"][i], "duration_ms": float(d[j]),
                                    "slowest_1pct": bool(d[j] >= p99), "instance": req["instance"][i],
                                    "status": req["status"][i]}
            if phases:
                item["largest_phase"], item["largest_phase_ms"] = _largest_part(phases, d, int(j))
            items.append(item)
        at_stake = float((d[slow] - p50).sum() / d.sum()) if d.sum() > 0 else 0.0
        shared = "; ".join(t["trait"] for t in traits[:3]) or "no common trait found"
        counts = method_counts(data, service, method, rows)
        out.append(Finding(
            id="request.tail-latency", title=f"Tail latency of {method}", severity=severity_for_share(at_stake),
            summary=(f"p99 {p99:.1f} ms is {ratio:.1f}x the median {p50:.1f} ms over {_sample_text(counts)}; the "
                     f"slowest {len(slow)} share: {shared}."),
            evidence={"requests_count": int(len(rows)), **_calls_evidence(counts), "p50_ms": p50, "p90_ms": p90,
                      "p99_ms": p99, "max_ms": float(d.max()), "p99_over_p50": ratio,
                      "slow_requests_count": int(len(slow)), "shared_traits": traits, AT_STAKE: at_stake},
            items=items, recommendation=_tail_advice(traits), source=str(data.path), scope=_scope(service, method)))
    return out


def _sample_text(counts: RequestCounts) -> str:
    """The requests a span-based figure rests on: "1459 sampled requests (25.1% of 5808 calls)" when the spans are
    fewer than the calls the ``rpc.server.call.duration`` metric counted, else "N requests"."""
    if counts.span_sample_ratio is not None and counts.spans < counts.count:
        return f"{counts.spans} sampled requests ({counts.span_sample_ratio:.1%} of {counts.count} calls)"
    return f"{counts.spans} requests"


def _calls_evidence(counts: RequestCounts) -> dict[str, Any]:
    """``calls_count`` (every call, the metric) and ``sampled_share`` (spans / calls) when the metric counted the
    method's calls; nothing when its counts are its spans."""
    ratio = counts.span_sample_ratio
    return {} if ratio is None else {"calls_count": counts.count, "sampled_share": ratio}


def request_totals(table: Table) -> tuple[int, int, int]:
    """(requests, errors, spans) over every method of a :func:`request_percentiles` table: requests and errors as
    the report counts them (the metric where the store has it, else the spans), spans the SERVER spans."""
    if not len(table):
        return 0, 0, 0
    return int(table["count"].sum()), int(table["errors"].sum()), int(table["spans"].sum())


def store_loss_notes(losses: ExportLosses, table: Table | None) -> list[str]:
    """The notes on what was lost on the way to the store (:func:`~zoomer_serve.report.calls.loss_notes`), for the
    Requests table ``table`` (:func:`request_percentiles`; None when there is none): calls missing from the metric
    are said to be missing from its counts only where every row is counted by the metric."""
    sources = set(table["counts_from"].tolist()) if table is not None and len(table) else set()
    return loss_notes(losses, counted_by_metric=sources == {COUNTS_FROM_METRIC})


def requests_note(table: Table) -> str:
    """The caption of the Requests table (:func:`request_percentiles`): where its counts come from and how many
    spans its latency figures rest on (a sample, with the ratio seen, when fewer than the calls)."""
    sources = set(table["counts_from"].tolist()) if len(table) else set()
    spans = int(table["spans"].sum()) if len(table) else 0
    if sources <= {COUNTS_FROM_SPANS}:
        return f"counted from SERVER spans ({spans})"
    metric = table["counts_from"] == COUNTS_FROM_METRIC
    calls, metric_spans = int(table["count"][metric].sum()), int(table["spans"][metric].sum())
    where = "" if sources == {COUNTS_FROM_METRIC} else " where the store has it, else from SERVER spans"
    sample = (f"{spans} sampled spans, {metric_spans / calls:.1%} of the calls" if metric_spans < calls
              else f"{spans} spans")
    return f"counted by the {COUNTS_FROM_METRIC} metric{where}; latency from {sample}"


def _tail_advice(traits: list[dict[str, Any]]) -> str:
    base = ("Open the listed traces (zoomer-serve analyze --perfetto, or the store) and compare them with a median "
            "request. ")
    if not traits:
        return base + ("With no shared trait, look for process-wide pauses: garbage collection (gc.freeze() after "
                       "warm-up), thread-pool queueing (server max_workers vs concurrency), lock contention and "
                       "noisy neighbours.")
    t = traits[0]
    if t["kind"] == "attribute" and t["key"] == "service.instance.id":
        return base + (f"The slow requests come mostly from replica {t['value']}: compare its host and load with the "
                       "other replicas'.")
    if t["kind"] == "phase" and t["phase"] == QUEUE_PHASE:
        return base + ("The tail waits in the batching queue: the batches ahead of these requests were busy or "
                       "the queue was longer than one batch; add capacity (replicas, a larger maximum batch) or "
                       "shed load before the queue grows.")
    if t["kind"] == "phase":
        return base + (f"The tail is spent in phase {t['phase']}: profile that phase on the slow requests "
                       "(input sizes, cache misses, contention).")
    if t["kind"] == "numeric":
        return base + (f"Slow requests carry larger {t['key']}: bucket or cap request sizes, split large batches, "
                       "or route them to a separate pool.")
    if t["kind"] == "warmup":
        return base + ("The tail is warm-up: run a few warm-up requests (all input shapes, torch.compile / cuDNN "
                       "autotuning) before marking the replica ready.")
    return base + f"The slow requests share {t['trait']}: start there."


def detect_slow_replicas(data: StoreData) -> list[Finding]:
    """``request.slow-replica``: per method, replicas (``service.instance.id``, >= 10 requests) whose median
    latency is >= 1.5x (and >= 1 ms above) the median of the other replicas' medians, with the phase that
    differs most."""
    out = []
    req = data.requests
    for (service, method), rows in sorted(_groups(data).items()):
        inst = req["instance"][rows]
        stats = []
        for value in np.unique(inst):
            sel = rows[inst == value]
            if value == "" or len(sel) < REPLICA_MIN_REQUESTS:
                continue
            d = req["duration_ms"][sel]
            stats.append({"instance": str(value), "requests": int(len(sel)), "p50_ms": float(np.median(d)),
                          "p99_ms": float(np.quantile(d, 0.99)), "errors": int(req["is_error"][sel].sum()),
                          "_rows": sel})
        if len(stats) < 2:
            continue
        fleet = float(np.median([s["p50_ms"] for s in stats]))
        method_ms = float(req["duration_ms"][rows].sum())
        for s in stats:
            others = float(np.median([o["p50_ms"] for o in stats if o is not s]))
            if others <= 0:
                continue
            ratio = s["p50_ms"] / others
            if ratio < REPLICA_RATIO or s["p50_ms"] - others < REPLICA_MIN_DIFF_MS:
                continue
            phase_diff = _phase_difference(data, s["_rows"], np.concatenate([o["_rows"] for o in stats if o is not s]))
            items = [{k: v for k, v in o.items() if k != "_rows"} for o in sorted(stats, key=lambda o: -o["p50_ms"])]
            mine = req["duration_ms"][s["_rows"]]
            at_stake = float(np.clip(mine - others, 0, None).sum()) / method_ms if method_ms > 0 else 0.0
            where = (f"; phase {phase_diff['phase']} takes {phase_diff['replica_ms']:.1f} ms there vs "
                     f"{phase_diff['others_ms']:.1f} ms elsewhere") if phase_diff else ""
            out.append(Finding(
                id="request.slow-replica", title=f"Slow replica {s['instance']} for {method}",
                severity=severity_for_share(at_stake),
                summary=(f"Replica {s['instance']} answers {method} with median {s['p50_ms']:.1f} ms, {ratio:.1f}x "
                         f"the other replicas' {others:.1f} ms (fleet median {fleet:.1f} ms, {len(stats)} "
                         f"replicas){where}."),
                evidence={"instance": s["instance"], "p50_ms": s["p50_ms"], "p99_ms": s["p99_ms"],
                          "others_p50_ms": others, "fleet_p50_ms": fleet, "ratio": ratio,
                          "replicas_count": len(stats), "requests_count": s["requests"],
                          "phase_difference": phase_diff, AT_STAKE: at_stake},
                items=items,
                recommendation=("Compare this replica's host with the others: CPU throttling or noisy neighbours, "
                                + ("GPU clocks / thermal throttling or a different GPU (hw.gpu.* metrics), "
                                   if data.gpu else "")
                                + "driver, library or configuration versions (thread counts, torch.compile cache, "
                                "batch settings), and its load balancer weight. Drain and restart it if it stays an "
                                "outlier."),
                source=str(data.path), scope=_scope(service, method, s["instance"])))
    return out


def _phase_difference(data: StoreData, mine: np.ndarray, others: np.ndarray) -> dict[str, Any] | None:
    rows = np.concatenate([mine, others])
    phases = _phase_matrix(data, rows)
    if not phases:
        return None
    n = len(mine)
    best: tuple[float, dict[str, Any]] | None = None
    for p, v in phases.items():
        a, b = float(np.median(v[:n])), float(np.median(v[n:]))
        if best is None or a - b > best[0]:
            best = (a - b, {"phase": p, "replica_ms": a, "others_ms": b, "difference_ms": a - b})
    return best[1] if best is not None and best[0] > 0 else None


def detect_cpu_bound_phases(data: StoreData) -> list[Finding]:
    """``request.cpu-bound-phase``: per method, a CPU phase (preprocess / postprocess) whose mean time per
    request is at least the forward pass's."""
    out = []
    for (service, method), rows in sorted(_groups(data).items()):
        phases = _phase_matrix(data, rows)
        fwd = phases.get(L.PHASE_FORWARD)
        if fwd is None or not (fwd > 0).any():
            continue
        has_fwd = fwd > 0
        fwd_mean = float(fwd[has_fwd].mean())
        total = float(data.requests["duration_ms"][rows][has_fwd].mean())
        for name in CPU_PHASES:
            v = phases.get(name)
            if v is None:
                continue
            mean = float(v[has_fwd].mean())
            ratio = mean / fwd_mean if fwd_mean > 0 else math.inf
            if ratio < PHASE_RATIO:
                continue
            cpu = _cpu_evidence(data, rows[has_fwd], service)
            share = mean / total if total > 0 else math.nan
            evidence = {"phase": name, "phase_mean_ms": mean, "forward_mean_ms": fwd_mean, "ratio": ratio,
                        "request_mean_ms": total, "phase_share": share,
                        "requests_count": int(has_fwd.sum()),
                        "phase_p99_ms": float(np.quantile(v[has_fwd], 0.99)), **cpu, "gpu": data.gpu,
                        AT_STAKE: share}
            hot = cpu.get("cpu_top_functions") or []
            named = (f" The CPU profile of profiling session {cpu['cpu_profile_sessions'][0]} (covering "
                     f"{cpu['cpu_profile_requests_count']} of these requests) spends {hot[0]['self_share']:.0%} "
                     f"of its samples in {hot[0]['function']} ({hot[0]['location']})." if hot else "")
            on_cpu = (f" The requests' threads are on a CPU for {cpu['request_cpu_share']:.0%} of their time "
                      f"(thread CPU time measured on {cpu['request_cpu_measured_count']} of these "
                      f"{int(has_fwd.sum())} requests)." if "request_cpu_share" in cpu else "")
            out.append(Finding(
                id="request.cpu-bound-phase", title=f"{name} outweighs the forward pass in {method}",
                severity=severity_for_share(share),
                summary=(f"{name} takes {mean:.2f} ms per request on average, {ratio:.1f}x the forward pass "
                         f"({fwd_mean:.2f} ms) and {mean / total:.0%} of the request time ({int(has_fwd.sum())} "
                         f"requests).{named}{on_cpu}"),
                evidence=evidence,
                items=[{"phase": p, "mean_ms": float(x[has_fwd].mean()), "p99_ms": float(np.quantile(x[has_fwd], 0.99))}
                       for p, x in sorted(phases.items(), key=lambda kv: -kv[1][has_fwd].mean())],
                recommendation=((f"Start with {hot[0]['function']} ({hot[0]['location']}), the hottest Python "
                                 "function while these requests ran. " if hot else "")
                                + _phase_advice(name, data.gpu)),
                source=str(data.path), scope=_scope(service, method)))
    return out


def _phase_advice(phase: str, gpu: bool) -> str:
    """What to do about a CPU phase that outweighs the forward pass: with a GPU, the GPU idles meanwhile; on a
    CPU-only service the phase and the model share the same cores."""
    common = ("Vectorise it (tensor ops instead of Python loops), batch it, and cache repeated work "
              "(tokenisation, feature lookups)")
    if not gpu:
        return (f"The model runs on the CPU too, so {phase} takes cores from the forward passes of other "
                f"requests. {common}; moving it to worker processes helps only while cores are idle (it frees the "
                "GIL, not CPU time).")
    where = ("keep results on the GPU until one copy at the end" if phase == L.PHASE_POSTPROCESS
             else "move it onto the GPU")
    return (f"The GPU waits while {phase} runs on the CPU. {common}, move it to a pool of worker processes or "
            f"threads that overlaps with the forward pass of other requests, or {where}.")


def _cpu_evidence(data: StoreData, rows: np.ndarray, service: str) -> dict[str, Any]:
    """CPU figures for the requests ``rows``: ``request_cpu_share`` (mean thread CPU time / wall time of those
    carrying ``zoomer.request.cpu_time_ns``: a sample, every request of a profiling session and 1 in N outside,
    see :mod:`zoomer_serve.host.request_cpu`) with ``request_cpu_measured_count`` (how many carried it; absent
    with the share when none did) and, from the CPU profiles of the service's profiling sessions
    linked to any of them, ``cpu_top_functions`` (own-sample shares merged over those profiles, weighted by
    their active samples), ``cpu_profile_sessions``, ``cpu_profile_paths``, ``cpu_profile_requests_count``."""
    out: dict[str, Any] = {}
    shares = []
    for i in rows.tolist():
        cpu_ns = data.attributes(int(i)).get(L.REQUEST_CPU_TIME)
        wall_ms = float(data.requests["duration_ms"][i])
        if isinstance(cpu_ns, (int, float)) and wall_ms > 0:
            shares.append(min(float(cpu_ns) / NS_PER_MS / wall_ms, 1.0))
    if shares:
        out["request_cpu_share"] = float(np.mean(shares))
        out["request_cpu_measured_count"] = len(shares)
    ids = {(data.requests["trace_id"][i], data.requests["span_id"][i]) for i in rows.tolist()}
    profiles = [(p, len(p.requests & ids)) for p in data.cpu_profiles if p.service == service]
    profiles = sorted([(p, k) for p, k in profiles if k > 0 and p.top], key=lambda pk: -pk[1])
    if not profiles:
        return out
    weight = sum(max(p.samples, 1) for p, _ in profiles)
    merged: dict[tuple[str, str], list[float]] = {}
    for p, _ in profiles:
        w = max(p.samples, 1) / weight
        for row in p.top:
            acc = merged.setdefault((row["function"], row["location"]), [0.0, 0.0])
            acc[0] += row["self_share"] * w
            acc[1] += row["total_share"] * w
    top = sorted(merged.items(), key=lambda kv: (-kv[1][0], -kv[1][1], kv[0]))[:MAX_ITEMS]
    out["cpu_top_functions"] = [{"function": f, "location": loc, "self_share": s, "total_share": t}
                                for (f, loc), (s, t) in top]
    out["cpu_profile_sessions"] = [p.session_id for p, _ in profiles]
    out["cpu_profile_paths"] = [p.path for p, _ in profiles]
    out["cpu_profile_requests_count"] = sum(k for _, k in profiles)
    return out


def detect_gpu_memory(data: StoreData) -> list[Finding]:
    """``gpu.oom``, ``gpu.alloc-retries`` and ``gpu.memory-fragmentation`` per replica, from the
    ``zoomer.gpu.memory.*`` span attributes and out-of-memory request errors."""
    out = []
    mem = data.memory
    req = data.requests
    instances = sorted(set(mem["instance"].tolist()) | set(req["instance"][req["oom"]].tolist()))
    for inst in instances:
        msel = mem["instance"] == inst
        rsel = req["instance"] == inst
        scope = f"replica {inst}" if inst else "all replicas"
        oom_requests = int((req["oom"] & rsel).sum())
        oom_count = int(mem["ooms"][msel].sum())
        if oom_requests or oom_count:
            ids = req["trace_id"][req["oom"] & rsel][:MAX_ITEMS].tolist()
            n_rsel = int(rsel.sum())
            oom_share = oom_requests / n_rsel if n_rsel else 1.0
            out.append(Finding(
                id="gpu.oom", title=f"CUDA out of memory on {scope}", severity=severity_for_share(oom_share),
                summary=(f"{oom_requests} requests failed with CUDA out-of-memory and the allocator counted "
                         f"{oom_count} OOMs on {scope}."),
                evidence={"oom_requests_count": oom_requests, "num_ooms": oom_count,
                          "requests_count": int(rsel.sum()), AT_STAKE: oom_share},
                items=[{"trace_id": t} for t in ids],
                recommendation=("Bound the memory a request can need: cap batch size and sequence length, bucket "
                                "shapes, run under torch.inference_mode(), and leave headroom for the caching "
                                "allocator; with varying shapes set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                                "to reduce fragmentation."),
                source=str(data.path), scope=scope))
        retries = int(mem["alloc_retries"][msel].sum())
        if retries:
            n_req = int((mem["alloc_retries"][msel] > 0).sum())
            retry_share = n_req / max(int(msel.sum()), 1)
            out.append(Finding(
                id="gpu.alloc-retries", title=f"Allocator retries on {scope}",
                severity=severity_for_share(retry_share),
                summary=(f"cudaMalloc failed and was retried after flushing the cache {retries} times, during "
                         f"{n_req} of {int(msel.sum())} sampled requests on {scope}."),
                evidence={"alloc_retries": retries, "requests_with_retries_count": n_req,
                          "sampled_requests_count": int(msel.sum()), AT_STAKE: retry_share},
                items=[{"trace_id": t, "alloc_retries": int(r)} for t, r in
                       zip(mem["trace_id"][msel].tolist(), mem["alloc_retries"][msel].tolist()) if r][:MAX_ITEMS],
                recommendation=("Each retry synchronises the device and frees every cached block: the requests "
                                "that hit one stall. The process runs close to the memory limit or fragments it: "
                                "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, lower the batch size or "
                                "the memory of other processes on the GPU, and avoid torch.cuda.empty_cache() in the "
                                "request path."),
                source=str(data.path), scope=scope))
        reserved = mem["reserved_bytes"][msel]
        allocated = mem["allocated_bytes"][msel]
        peak = mem["peak_bytes"][msel]
        ok = reserved >= 0
        if not ok.any():
            continue
        r_max = int(reserved[ok].max())
        base = peak[ok] if (peak[ok] >= 0).all() else allocated[ok]
        used = int(base.max()) if len(base) else 0
        ratio = r_max / used if used > 0 else math.inf
        alloc_ratio = float(np.median(reserved[ok] / np.maximum(allocated[ok], 1)))
        if ratio >= FRAGMENTATION_RATIO and r_max - used >= FRAGMENTATION_MIN_BYTES:
            out.append(Finding(
                id="gpu.memory-fragmentation", title=f"Reserved GPU memory far above what tensors use on {scope}",
                severity=severity_for_share((r_max - used) / r_max),
                summary=(f"The caching allocator reserves up to {r_max / 2**30:.2f} GiB but tensors peak at "
                         f"{used / 2**30:.2f} GiB ({ratio:.1f}x); at request end reserved is {alloc_ratio:.1f}x "
                         f"allocated (median over {int(ok.sum())} requests)."),
                evidence={"reserved_max_bytes": r_max, "peak_allocated_bytes": used, "reserved_over_peak": ratio,
                          "reserved_over_allocated_median": alloc_ratio, "unused_reserved_bytes": r_max - used,
                          "samples_count": int(ok.sum()), AT_STAKE: (r_max - used) / r_max},
                items=[],
                recommendation=("Cached blocks that cannot be reused for new sizes pile up (fragmentation), "
                                "typically with varying input shapes. Set "
                                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True so segments grow in place, "
                                "bucket or pad request shapes to a few sizes, and check torch.cuda.memory_summary() "
                                "for the block sizes involved."),
                source=str(data.path), scope=scope))
    return out


def detect_batching(data: StoreData) -> list[Finding]:
    """``batch.*`` findings (:mod:`zoomer_serve.analysis.batching`)."""
    from zoomer_serve.analysis.batching import detect_batching as detect

    return detect(data)


STORE_DETECTORS = (detect_tail_latency, detect_slow_replicas, detect_cpu_bound_phases, detect_gpu_memory,
                   detect_batching)


def detect_store(data: StoreData) -> list[Finding]:
    """Run every request-level detector over loaded store data (unsorted)."""
    out: list[Finding] = []
    for detector in STORE_DETECTORS:
        out.extend(detector(data))
    return out
