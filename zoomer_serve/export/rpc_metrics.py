"""RPC metrics computed from span records in the export worker, aggregated there and sent as OTLP.

Instruments (semantic conventions for RPC, stable names), cumulative temporality:

- ``rpc.server.call.duration`` / ``rpc.client.call.duration``: histogram, unit ``s``, buckets
  0.005 … 10 s as the conventions advise; attributes ``rpc.system.name``, ``rpc.method``,
  ``rpc.response.status_code`` (``rpc.status_code`` under the opt-in, :mod:`zoomer_serve.semconv`),
  ``error.type`` (when an error), ``server.address``, ``server.port``.
- ``rpc.server.request.size`` / ``rpc.server.response.size`` (and ``rpc.client.*``): histogram, unit
  ``By``, the uncompressed protobuf (or Thrift) payload bytes of all messages of one call; deprecated by
  semantic conventions v1.40, so only with ``OTEL_SEMCONV_STABILITY_OPT_IN=rpc/dup`` (the spans carry
  ``zoomer.rpc.request.bytes`` / ``.response.bytes`` always).
- ``zoomer.batch.queue_wait.duration`` (histogram, unit ``s``) and ``zoomer.batch.size`` (histogram, unit
  ``{request}``): for a request that ran in a batch (:mod:`zoomer_serve.batching`), its queue wait and the size of
  its batch, with the attributes of the call-duration histogram.
- ``otel.sdk.exporter.span.exported``: counter, unit ``{span}``, spans whose export finished: without
  ``error.type`` those the collector accepted; with ``error.type`` = ``rejected`` (a partial success),
  ``too_large`` (too large for any export request), ``export_failed`` or ``queue_full`` those it lost.
- ``otel.sdk.exporter.metric_data_point.exported``: counter, unit ``{data_point}``, the same for the metric
  data points of earlier exports (``rejected``; ``export_failed`` for the rest, too large ones included).
- ``zoomer.exporter.call.dropped``: counter, unit ``{call}``, calls (request records, sampled or not) missing from
  ``rpc.server.call.duration`` and the other call metrics, by ``error.type``: ``queue_full`` (a full queue on the
  way to the exporter), ``too_large`` (a record too large for a frame to the export helper process),
  ``helper_lost`` (an export helper process died before a metric export covering them succeeded). Calls in the
  metric + these = calls the server answered (those that ended after shutdown began are only logged).

Every request record counts, sampled or not. The worker records one histogram point per record here
(a dict lookup and a ``bisect``: about 2 µs) instead of going through the OpenTelemetry SDK's
``Histogram.record`` (about 13 µs per call, three calls per request). Each export serializes every data point
with the official ``opentelemetry.proto`` messages and frames them into requests by hand
(:class:`MetricsRequestEncoder`), so that the points can go out in several requests bounded by bytes: at the
attribute-set cap (10,000 sets of about 440 bytes each) one request would be over 4 MiB. Same cost as one
protobuf request: about 120 ms for the 10,000 sets, every ``OTEL_METRIC_EXPORT_INTERVAL``.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.common.v1.common_pb2 import KeyValue
from opentelemetry.proto.metrics.v1 import metrics_pb2

from zoomer_serve import semconv as sc
from zoomer_serve.batching import names as batch_names
from zoomer_serve.export.otlp_wire import FIELD_FRAMING_BYTES, encode_key_value, length_delimited
from zoomer_serve.recording import records as r

DURATION_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
SIZE_BUCKETS_BYTES = (0, 100, 1000, 10_000, 100_000, 1_000_000, 10_000_000, 100_000_000)
QUEUE_WAIT_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
METRIC_ATTRIBUTE_KEYS = (sc.RPC_SYSTEM_NAME, sc.RPC_METHOD, sc.RPC_RESPONSE_STATUS_CODE, sc.RPC_STATUS_CODE,
                         sc.ERROR_TYPE, sc.SERVER_ADDRESS, sc.SERVER_PORT)
REQUEST_BYTES = "zoomer.rpc.request.bytes"
RESPONSE_BYTES = "zoomer.rpc.response.bytes"
_MAX_ATTRIBUTE_SETS = 10_000  # bounded: a flood of distinct methods cannot grow memory forever
_CUMULATIVE = metrics_pb2.AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE
_SIDES = {r.KIND_SERVER: "server", r.KIND_CLIENT: "client"}
# span kind -> (call duration, request size, response size) metric names
_NAMES = {kind: (f"rpc.{side}.call.duration", f"rpc.{side}.request.size", f"rpc.{side}.response.size")
          for kind, side in _SIDES.items()}


@dataclass
class HistogramPoint:
    """A cumulative explicit-bucket histogram for one attribute set: ``bucket_counts`` has
    ``len(bounds) + 1`` entries (the last is the overflow bucket above the largest bound)."""

    bounds: tuple[float, ...]
    bucket_counts: list[int] = field(default_factory=list)
    count: int = 0
    total: float = 0.0
    min: float = float("inf")
    max: float = float("-inf")

    def __post_init__(self) -> None:
        if not self.bucket_counts:
            self.bucket_counts = [0] * (len(self.bounds) + 1)

    def record(self, value: float) -> None:
        self.bucket_counts[bisect.bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.total += value
        if value < self.min:
            self.min = value
        if value > self.max:
            self.max = value


class RpcMetrics:
    """Aggregates the RPC histograms of request records; :meth:`encode` builds the OTLP export request."""

    def __init__(self, size_metrics: bool = False) -> None:
        """``size_metrics``: also the request / response size histograms, which semantic conventions v1.40
        deprecated (emitted with ``OTEL_SEMCONV_STABILITY_OPT_IN=rpc/dup``)."""
        # (metric name, attribute key tuple) -> point; attribute key tuples follow METRIC_ATTRIBUTE_KEYS
        self._points: dict[tuple[str, tuple[Any, ...]], HistogramPoint] = {}
        self.size_metrics = size_metrics
        self.dropped_attribute_sets = 0

    def record(self, rec: tuple[Any, ...]) -> None:
        """Record one request record (a no-op for records without the ``F_REQUEST`` flag)."""
        if not rec[r.R_FLAGS] & r.F_REQUEST:
            return
        names = _NAMES.get(rec[r.R_KIND])
        if names is None:
            return
        attrs = rec[r.R_ATTRS]
        key = tuple(map(attrs.get, METRIC_ATTRIBUTE_KEYS))
        self._point(names[0], key, DURATION_BUCKETS_S).record((rec[r.R_END_NS] - rec[r.R_START_NS]) / 1e9)
        if self.size_metrics:
            req_bytes = attrs.get(REQUEST_BYTES)
            if req_bytes is not None:
                self._point(names[1], key, SIZE_BUCKETS_BYTES).record(req_bytes)
            resp_bytes = attrs.get(RESPONSE_BYTES)
            if resp_bytes is not None:
                self._point(names[2], key, SIZE_BUCKETS_BYTES).record(resp_bytes)
        wait_ns = attrs.get(_QUEUE_WAIT)
        if wait_ns is not None:
            self._point(_METRIC_QUEUE_WAIT, key, QUEUE_WAIT_BUCKETS_S).record(wait_ns / 1e9)
            size = attrs.get(_BATCH_SIZE)
            if size is not None:
                self._point(_METRIC_BATCH_SIZE, key, BATCH_SIZE_BUCKETS).record(size)

    def _point(self, name: str, key: tuple[Any, ...], bounds: tuple[float, ...]) -> HistogramPoint:
        point = self._points.get((name, key))
        if point is None:
            if len(self._points) >= _MAX_ATTRIBUTE_SETS:
                self.dropped_attribute_sets += 1
                key = ("_OTHER",) * len(METRIC_ATTRIBUTE_KEYS)  # overflow set, as the SDK's cardinality limit
                point = self._points.get((name, key))
            if point is None:
                point = self._points[(name, key)] = HistogramPoint(bounds)
        return point

    def data_points(self, start_ns: int, now_ns: int,
                    counters: Mapping[str, Mapping[tuple[tuple[str, str], ...], int]]) -> list[MetricPoint]:
        """Every histogram point (cumulative since ``start_ns``, Unix epoch ns) and the given monotonic counters
        (name -> {attributes: value}), one :data:`MetricPoint` each, the points of one metric next to each
        other (see :class:`MetricsRequestEncoder`)."""
        by_name: dict[str, list[bytes]] = {}
        for (name, key), point in self._points.items():
            dp = metrics_pb2.HistogramDataPoint(
                start_time_unix_nano=start_ns, time_unix_nano=now_ns, count=point.count, sum=point.total,
                min=point.min, max=point.max, bucket_counts=point.bucket_counts, explicit_bounds=point.bounds)
            dp.attributes.extend(_key_values((k, v) for k, v in zip(METRIC_ATTRIBUTE_KEYS, key) if v is not None))
            by_name.setdefault(name, []).append(dp.SerializeToString())
        out: list[MetricPoint] = []
        for name, points in by_name.items():
            head = _histogram_head(name)
            out.extend((head, dp) for dp in points)
        for name, values in counters.items():
            head = _counter_head(name)
            for attributes, value in values.items():
                dp = metrics_pb2.NumberDataPoint(start_time_unix_nano=start_ns, time_unix_nano=now_ns, as_int=value)
                dp.attributes.extend(_key_values(attributes))
                out.append((head, dp.SerializeToString()))
        return out

    def encode(self, resource: Mapping[str, Any], scope_name: str, scope_version: str, start_ns: int,
               now_ns: int, counters: Mapping[str, Mapping[tuple[tuple[str, str], ...], int]]) -> bytes:
        """One serialized ``ExportMetricsServiceRequest`` with every point of :meth:`data_points`, whatever
        its size (the export worker sends them in requests bounded by bytes instead: see
        :meth:`MetricsRequestEncoder.pack`)."""
        encoder = MetricsRequestEncoder(resource, scope_name, scope_version)
        return encoder.encode_request(self.data_points(start_ns, now_ns, counters))


@dataclass(frozen=True)
class MetricHead:
    """The fields of one OTLP ``Metric`` other than its data points, encoded: ``prefix`` (name, description,
    unit), ``data_tag`` (the tag byte of its ``histogram`` or ``sum`` field) and ``suffix`` (the fields of that
    message after its data points: temporality, monotonicity)."""

    prefix: bytes
    data_tag: int
    suffix: bytes

    @property
    def framing(self) -> int:
        """The most bytes this metric adds to a request around its data points."""
        return len(self.prefix) + len(self.suffix) + 2 * FIELD_FRAMING_BYTES


MetricPoint = tuple[MetricHead, bytes]  # one serialized data point (HistogramDataPoint or NumberDataPoint)


class MetricsRequestEncoder:
    """Builds ``ExportMetricsServiceRequest`` bytes (one resource, one scope) from :data:`MetricPoint` lists,
    and packs a list into requests bounded by bytes (:meth:`pack`)."""

    def __init__(self, resource: Mapping[str, Any], scope_name: str, scope_version: str) -> None:
        resource_body = b"".join(length_delimited(0x0A, encode_key_value(str(k), v)) for k, v in resource.items())
        self._resource_field = length_delimited(0x0A, resource_body)  # ResourceMetrics.resource
        scope = length_delimited(0x0A, scope_name.encode()) + length_delimited(0x12, scope_version.encode())
        self._scope_field = length_delimited(0x0A, scope)  # ScopeMetrics.scope
        self._schema_field = length_delimited(0x1A, sc.SCHEMA_URL.encode())  # ScopeMetrics.schema_url
        self.request_overhead = (len(self._resource_field) + len(self._scope_field) + len(self._schema_field)
                                 + 2 * FIELD_FRAMING_BYTES)

    def encode_request(self, points: Sequence[MetricPoint]) -> bytes:
        """The request with ``points``; consecutive points of the same :class:`MetricHead` share one
        ``Metric``. Its length is at most :meth:`size` of ``points``."""
        metrics = []
        for head, group in itertools.groupby(points, key=operator.itemgetter(0)):
            data = b"".join(length_delimited(0x0A, dp) for _, dp in group) + head.suffix
            metrics.append(length_delimited(0x12, head.prefix + length_delimited(head.data_tag, data)))
        scope_metrics = self._scope_field + b"".join(metrics) + self._schema_field  # scope, metrics, schema_url
        return length_delimited(0x0A, self._resource_field + length_delimited(0x12, scope_metrics))

    def pack(self, points: Sequence[MetricPoint], max_bytes: int) -> tuple[list[list[MetricPoint]], int]:
        """Split ``points`` (in order) into requests of at most ``max_bytes`` bytes each, as few as the order
        allows. Returns (the requests' points, how many points were left out because a request with that point
        alone would be larger than ``max_bytes``)."""
        requests: list[list[MetricPoint]] = []
        current: list[MetricPoint] = []
        size = self.request_overhead
        head: MetricHead | None = None
        too_large = 0
        for point in points:
            point_head, dp = point
            cost = len(dp) + FIELD_FRAMING_BYTES
            if self.request_overhead + point_head.framing + cost > max_bytes:
                too_large += 1
                continue
            if point_head is not head:
                cost += point_head.framing
            if current and size + cost > max_bytes:
                requests.append(current)
                current, size = [], self.request_overhead
                if point_head is head:
                    cost += point_head.framing
            current.append(point)
            size += cost
            head = point_head
        if current:
            requests.append(current)
        return requests, too_large


_CUMULATIVE_FIELD = b"\x10" + bytes((_CUMULATIVE,))  # aggregation_temporality (field 2)


@functools.lru_cache(maxsize=64)
def _histogram_head(name: str) -> MetricHead:
    spec = _BATCH_HISTOGRAMS.get(name)
    if spec is not None:
        return MetricHead(_metric_prefix(name, *spec), 0x4A, _CUMULATIVE_FIELD)
    unit = "s" if name.endswith(".duration") else "By"
    return MetricHead(_metric_prefix(name, _DESCRIPTIONS[name.split(".", 2)[2]], unit), 0x4A, _CUMULATIVE_FIELD)


@functools.lru_cache(maxsize=64)
def _counter_head(name: str) -> MetricHead:
    description, unit = _COUNTERS.get(name, ("", "1"))
    return MetricHead(_metric_prefix(name, description, unit), 0x3A, _CUMULATIVE_FIELD + b"\x18\x01")


def _metric_prefix(name: str, description: str, unit: str) -> bytes:
    """``Metric.name``, ``.description`` and ``.unit`` (fields 1 to 3)."""
    return (length_delimited(0x0A, name.encode()) + length_delimited(0x12, description.encode())
            + length_delimited(0x1A, unit.encode()))


_DESCRIPTIONS = {
    "call.duration": "Duration of RPC calls",
    "request.size": "Uncompressed payload bytes of the request messages of a call",
    "response.size": "Uncompressed payload bytes of the response messages of a call",
}
_QUEUE_WAIT = batch_names.QUEUE_WAIT
_BATCH_SIZE = batch_names.SIZE
_METRIC_QUEUE_WAIT = batch_names.METRIC_QUEUE_WAIT
_METRIC_BATCH_SIZE = batch_names.METRIC_SIZE
# the batching histograms: name -> (description, unit)
_BATCH_HISTOGRAMS = {
    _METRIC_QUEUE_WAIT: ("Time a request waited in a batching queue, from its enqueue to its batch's start", "s"),
    _METRIC_BATCH_SIZE: ("Requests in the batch a request ran in", "{request}"),
}
SPAN_EXPORTED = "otel.sdk.exporter.span.exported"
METRIC_POINT_EXPORTED = "otel.sdk.exporter.metric_data_point.exported"
CALL_DROPPED = "zoomer.exporter.call.dropped"
# the exporter's own counters: name -> (description, unit)
_COUNTERS = {
    SPAN_EXPORTED: ("The number of spans for which the export has finished, either successful or failed", "{span}"),
    METRIC_POINT_EXPORTED: ("The number of metric data points for which the export has finished, either "
                            "successful or failed", "{data_point}"),
    CALL_DROPPED: ("The number of calls missing from the RPC call metrics because their records were lost on the "
                   "way to the exporter", "{call}"),
}


def _key_values(items: Any) -> list[KeyValue]:
    return [KeyValue.FromString(encode_key_value(str(k), v)) for k, v in items]


RECORD_ATTRIBUTE_KEYS = (*METRIC_ATTRIBUTE_KEYS, REQUEST_BYTES, RESPONSE_BYTES, _QUEUE_WAIT, _BATCH_SIZE)
"""Every attribute of a request record that :meth:`RpcMetrics.record` reads."""


def metrics_only(rec: Sequence[Any]) -> tuple[Any, ...]:
    """``rec`` reduced to what the RPC metrics read (:meth:`RpcMetrics.record`): its kind, times, flags and
    :data:`RECORD_ATTRIBUTE_KEYS` attributes, with no status message, events, links, children or scope, and not
    sampled (so no span is exported from it). For a record too large to hand to the export helper whole
    (:data:`zoomer_serve.export.frames.MAX_FRAME_BYTES`): its call still counts, its spans are dropped."""
    attrs = rec[r.R_ATTRS] or {}
    reduced = list(rec[:r.R_SCOPE])
    reduced[r.R_STATUS_MSG] = None
    reduced[r.R_ATTRS] = {key: attrs[key] for key in RECORD_ATTRIBUTE_KEYS if key in attrs}
    reduced[r.R_EVENTS] = reduced[r.R_LINKS] = reduced[r.R_CHILDREN] = None
    reduced[r.R_FLAGS] = rec[r.R_FLAGS] & ~r.F_SAMPLED
    return tuple(reduced)
