"""OTLP protobuf messages -> store rows (see :mod:`zoomer_serve.collector.store` for the columns).

Ids become lowercase hex, ``AnyValue`` becomes JSON (documented in the store module), the resource
attributes ``service.name`` and ``service.instance.id`` get their own columns. Spans whose trace or span id
is malformed (wrong length or all zero), or that end before they start, are rejected and counted, as are
histogram points whose bucket counts do not match their bounds; the OTLP ``partial_success`` response tells the
sender how many.

Spans are the bulk of the traffic, so binary trace exports are parsed with :data:`RawAttributeTraces`
(:func:`parse_traces`): the official ``TracesData`` schema (wire-compatible with
``ExportTraceServiceRequest``) except that ``Span.attributes`` stays a list of serialized ``KeyValue``
messages. A model server's spans repeat the same attribute pairs, so the JSON of each pair is cached by those
bytes (:func:`attributes_json`) instead of being rebuilt from message objects for every span (measured by
``benchmarks/collector_cost.py``; see ``benchmarks/COLLECTOR.md``).
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1 import metrics_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

INT64_MAX = (1 << 63) - 1

SPAN_KINDS = {
    trace_pb2.Span.SPAN_KIND_UNSPECIFIED: "UNSPECIFIED",
    trace_pb2.Span.SPAN_KIND_INTERNAL: "INTERNAL",
    trace_pb2.Span.SPAN_KIND_SERVER: "SERVER",
    trace_pb2.Span.SPAN_KIND_CLIENT: "CLIENT",
    trace_pb2.Span.SPAN_KIND_PRODUCER: "PRODUCER",
    trace_pb2.Span.SPAN_KIND_CONSUMER: "CONSUMER",
}
STATUS_CODES = {
    trace_pb2.Status.STATUS_CODE_UNSET: "UNSET",
    trace_pb2.Status.STATUS_CODE_OK: "OK",
    trace_pb2.Status.STATUS_CODE_ERROR: "ERROR",
}
TEMPORALITIES = {
    metrics_pb2.AGGREGATION_TEMPORALITY_DELTA: "DELTA",
    metrics_pb2.AGGREGATION_TEMPORALITY_CUMULATIVE: "CUMULATIVE",
}

_EMPTY_LIST_JSON = "[]"
_EMPTY_OBJECT_JSON = "{}"


@dataclass
class Decoded:
    """Rows decoded from one export request, plus what was rejected.

    ``rejected`` counts spans / data points that could not be stored; ``errors`` holds up to a few
    human-readable reasons for them (sent back in ``partial_success.error_message``).
    """

    rows: list[tuple[Any, ...]] = field(default_factory=list)
    rejected: int = 0
    errors: list[str] = field(default_factory=list)

    def reject(self, reason: str, n: int = 1) -> None:
        self.rejected += n
        if len(self.errors) < 3 and reason not in self.errors:
            self.errors.append(reason)

    @property
    def error_message(self) -> str:
        return "; ".join(self.errors)


# ---- values ----------------------------------------------------------------------------------------------


def _json_float(x: float) -> float | str:
    """A float JSON can hold: NaN and infinities become the strings protobuf's JSON mapping uses."""
    if math.isfinite(x):
        return x
    if math.isnan(x):
        return "NaN"
    return "Infinity" if x > 0 else "-Infinity"


def any_value(v: AnyValue) -> Any:
    """Convert an OTLP ``AnyValue`` to a JSON-able Python value (bytes -> base64 str, empty -> None)."""
    kind = v.WhichOneof("value")
    if kind == "string_value":
        return v.string_value
    if kind == "int_value":
        return v.int_value
    if kind == "bool_value":
        return v.bool_value
    if kind == "double_value":
        return _json_float(v.double_value)
    if kind == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return attributes_dict(v.kvlist_value.values)
    if kind == "bytes_value":
        return base64.b64encode(v.bytes_value).decode("ascii")
    return None


def attributes_dict(kvs: Iterable[KeyValue]) -> dict[str, Any]:
    """``repeated KeyValue`` -> dict (a repeated key keeps its last value)."""
    out: dict[str, Any] = {}
    for kv in kvs:
        v = kv.value
        kind = v.WhichOneof("value")
        # Inline fast path for the common scalar kinds (this loop runs for every attribute of every span).
        if kind == "string_value":
            out[kv.key] = v.string_value
        elif kind == "int_value":
            out[kv.key] = v.int_value
        elif kind == "bool_value":
            out[kv.key] = v.bool_value
        else:
            out[kv.key] = any_value(v)
    return out


_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
"""Compact JSON text of a JSON-able value (one shared encoder: ``json.dumps`` with options builds a new one
per call)."""
_dumps_str = json.encoder.encode_basestring
"""JSON text of a str, exactly as ``_dumps`` writes it (the C function ``_dumps`` itself calls)."""


def _value_json(v: AnyValue) -> str:
    """JSON text of an ``AnyValue``, identical to ``_dumps(any_value(v))`` (scalars without the encoder)."""
    kind = v.WhichOneof("value")
    if kind == "string_value":
        return _dumps_str(v.string_value)
    if kind == "int_value":
        return str(v.int_value)
    if kind == "bool_value":
        return "true" if v.bool_value else "false"
    return _dumps(any_value(v))


def _attrs_json(kvs: Any) -> str:
    return _dumps(attributes_dict(kvs)) if len(kvs) else _EMPTY_OBJECT_JSON


def _clamp(ns: int) -> int:
    """fixed64/uint64 -> BIGINT: values above the int64 range (after year 2262) are clamped."""
    return ns if ns <= INT64_MAX else INT64_MAX


@dataclass(frozen=True)
class _Resource:
    service_name: str | None
    service_instance_id: str | None
    attributes_json: str


def _resource(kvs: Any) -> _Resource:
    attrs = attributes_dict(kvs)
    name = attrs.get("service.name")
    instance = attrs.get("service.instance.id")
    return _Resource(
        None if name is None else str(name),
        None if instance is None else str(instance),
        _dumps(attrs),
    )


# ---- traces ----------------------------------------------------------------------------------------------


def _raw_attribute_traces_class() -> type[Message]:
    """``TracesData`` whose ``Span.attributes`` (field 9) is ``repeated bytes``: one serialized ``KeyValue``
    per element. Built from the official descriptors in a private pool, so nothing else sees it."""
    pool = descriptor_pool.DescriptorPool()
    for module in (common_pb2, resource_pb2, trace_pb2):
        proto = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(proto)
        if module is trace_pb2:
            span = next(m for m in proto.message_type if m.name == "Span")
            attributes = next(f for f in span.field if f.name == "attributes")
            attributes.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
            attributes.ClearField("type_name")
        pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("opentelemetry.proto.trace.v1.TracesData"))


RawAttributeTraces = _raw_attribute_traces_class()
"""Parses the bytes of an ``ExportTraceServiceRequest`` (same wire format as ``TracesData``)."""


def parse_traces(payload: bytes) -> Message:
    """Parse a binary ``ExportTraceServiceRequest`` for :func:`span_rows`.

    Raises:
        google.protobuf.message.DecodeError: not a valid message (a malformed attribute ``KeyValue`` is
            only found by :func:`span_rows`, which raises the same error).
    """
    return RawAttributeTraces.FromString(payload)


_ATTR_CACHE_MAX = 8192  # entries; the cache is emptied when full (a few MB at most)
_ATTR_CACHE_MAX_BYTES = 256  # longer KeyValues are decoded every time, not cached
_CACHED_INT_LIMIT = 1 << 16  # int values below it (counts, sizes, ports) are cached; others (ns, ids) are not
_attr_cache: dict[bytes, tuple[str, str]] = {}


def _varint(data: bytes) -> int | None:
    """The int64 (two's complement) that ``data`` holds as exactly one protobuf varint, else None."""
    if not 0 < len(data) <= 10 or (len(data) == 10 and data[-1] > 1):
        return None
    value = 0
    for shift, byte in enumerate(data):
        value |= (byte & 0x7F) << (7 * shift)
        if byte < 0x80:
            break
    if byte >= 0x80 or shift != len(data) - 1:  # unterminated, or bytes after the end
        return None
    return value - (1 << 64) if value >> 63 else value


_BOOL_JSON = {b"\x00": ("false", True), b"\x01": ("true", True)}


def _scalar_json(tag: int, body: bytes) -> tuple[str, bool] | None:
    """(JSON text, worth caching) of an ``AnyValue`` whose only field is ``tag`` followed by ``body``: a
    string shorter than 128 bytes, a bool or an int. None for anything else."""
    if tag == 0x18:  # int_value
        value = _varint(body)
        return None if value is None else (str(value), 0 <= value < _CACHED_INT_LIMIT)
    if tag == 0x10:  # bool_value
        return _BOOL_JSON.get(body)
    if tag == 0x0A and body and body[0] == len(body) - 1:  # string_value (its length fits one byte)
        try:
            return _dumps_str(body[1:].decode()), True
        except UnicodeDecodeError:
            return None
    return None


def _scalar_member(raw: bytes) -> tuple[str, str, bool] | None:
    """(key, '"key":value', worth caching) of a serialized ``KeyValue`` of the usual shape, read straight
    from the wire: field 1 (the key) then field 2 (the value), both shorter than 128 bytes, the value as
    :func:`_scalar_json` reads it. None for anything else, which the official parser then decodes (or
    rejects)."""
    n = len(raw)
    if n < 5 or raw[0] != 0x0A or raw[1] > 0x7F:
        return None
    p = raw[1] + 2  # the value field's tag
    if p + 3 > n or raw[p] != 0x12 or raw[p + 1] != n - p - 2:  # (a two-byte length never equals this)
        return None
    value = _scalar_json(raw[p + 2], raw[p + 3:])
    if value is None:
        return None
    try:
        key = raw[2:p].decode()
    except UnicodeDecodeError:
        return None
    return key, f"{_dumps_str(key)}:{value[0]}", value[1]


def _attribute_member(raw: bytes) -> tuple[str, str]:
    """``(key, '"key":value')`` of one serialized ``KeyValue`` missing from the cache; caches it unless it
    is long or a large int (thread-safe: a dict's get / set / clear are atomic, and a lost race only costs a
    repeated decode).

    Raises:
        google.protobuf.message.DecodeError: ``raw`` is not a valid ``KeyValue``.
    """
    scalar = _scalar_member(raw)
    if scalar is None:
        kv = KeyValue.FromString(raw)
        key, text, keep = kv.key, f"{_dumps_str(kv.key)}:{_value_json(kv.value)}", True
    else:
        key, text, keep = scalar
    if keep and len(raw) <= _ATTR_CACHE_MAX_BYTES:
        if len(_attr_cache) >= _ATTR_CACHE_MAX:
            _attr_cache.clear()
        _attr_cache[raw] = (key, text)
    return key, text


def attributes_json(raw_kvs: Any) -> str:
    """JSON object text of serialized ``KeyValue`` messages, identical to ``_dumps(attributes_dict(...))``
    of the parsed messages (a repeated key keeps its first position and its last value)."""
    if not len(raw_kvs):
        return _EMPTY_OBJECT_JSON
    members: dict[str, str] = {}
    get = _attr_cache.get
    for raw in raw_kvs:
        key, text = get(raw) or _attribute_member(raw)
        members[key] = text
    return "{" + ",".join(members.values()) + "}"


def _id_hex(raw: bytes, size: int) -> str | None:
    """Hex of a ``size``-byte id, or None when it has the wrong length or is all zero (invalid)."""
    if len(raw) != size or not any(raw):
        return None
    return raw.hex()


def _events_json(events: Any) -> str:
    if not len(events):
        return _EMPTY_LIST_JSON
    return _dumps([
        {"name": e.name, "time_ns": _clamp(e.time_unix_nano), "attributes": attributes_dict(e.attributes)}
        for e in events
    ])


def _links_json(links: Any) -> str:
    if not len(links):
        return _EMPTY_LIST_JSON
    return _dumps([
        {"trace_id": link.trace_id.hex(), "span_id": link.span_id.hex(),
         "attributes": attributes_dict(link.attributes)}
        for link in links
    ])


def span_rows(request: Message, received_ns: int) -> Decoded:
    """Decode every span of ``request`` into a row in :data:`store.SPAN_COLUMNS` order.

    ``request`` comes from :func:`parse_traces`; an official ``ExportTraceServiceRequest`` (OTLP/JSON) is
    re-read through its bytes.

    Raises:
        google.protobuf.message.DecodeError: a span attribute is not a valid ``KeyValue``.
    """
    if isinstance(request, ExportTraceServiceRequest):
        request = parse_traces(request.SerializeToString())
    out = Decoded()
    for rs in request.resource_spans:
        res = _resource(rs.resource.attributes)
        for ss in rs.scope_spans:
            scope_name = ss.scope.name
            for span in ss.spans:
                row = _span_row(span, res, scope_name, received_ns, out)
                if row is not None:
                    out.rows.append(row)
    return out


def _span_row(span: Any, res: _Resource, scope_name: str, received_ns: int,
              out: Decoded) -> tuple[Any, ...] | None:
    """One span's row, or None after counting it in ``out`` as rejected."""
    trace_id = _id_hex(span.trace_id, 16)
    span_id = _id_hex(span.span_id, 8)
    if trace_id is None or span_id is None:
        out.reject("span with an invalid trace_id or span_id (need 16 / 8 non-zero bytes)")
        return None
    parent = span.parent_span_id
    if parent and len(parent) != 8:
        out.reject("span with an invalid parent_span_id (need 8 bytes or empty)")
        return None
    start = _clamp(span.start_time_unix_nano)
    end = _clamp(span.end_time_unix_nano)
    if end < start:
        out.reject("span that ends before it starts (end_time_unix_nano < start_time_unix_nano)")
        return None
    status = span.status
    return (
        trace_id,
        span_id,
        parent.hex() if parent and any(parent) else None,
        span.name,
        SPAN_KINDS.get(span.kind, "UNSPECIFIED"),
        start,
        end,
        end - start,
        STATUS_CODES.get(status.code, "UNSET"),
        status.message,
        res.service_name,
        res.service_instance_id,
        scope_name,
        attributes_json(span.attributes),
        res.attributes_json,
        _events_json(span.events),
        _links_json(span.links),
        received_ns,
    )


# ---- metrics ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _MetricContext:
    name: str
    description: str
    unit: str
    resource: _Resource
    scope_name: str
    received_ns: int


def _opt(point: Any, name: str) -> float | None:
    """An optional double field (proto3 ``optional``) or None when unset; NaN stays NaN (stored as NULL)."""
    return getattr(point, name) if point.HasField(name) else None


def _point_row(ctx: _MetricContext, metric_type: str, point: Any, **values: Any) -> tuple[Any, ...]:
    start = point.start_time_unix_nano
    return (
        ctx.name,
        ctx.description,
        ctx.unit,
        metric_type,
        ctx.resource.service_name,
        ctx.resource.service_instance_id,
        ctx.scope_name,
        _clamp(start) if start else None,
        _clamp(point.time_unix_nano),
        _attrs_json(point.attributes),
        ctx.resource.attributes_json,
        values.get("value"),
        values.get("count"),
        values.get("sum"),
        values.get("min"),
        values.get("max"),
        values.get("bucket_counts"),
        values.get("explicit_bounds"),
        values.get("is_monotonic"),
        values.get("temporality"),
        values.get("quantile_values"),
        values.get("exponential_buckets"),
        ctx.received_ns,
    )


def _number(point: metrics_pb2.NumberDataPoint) -> float | None:
    kind = point.WhichOneof("value")
    if kind == "as_double":
        return point.as_double
    if kind == "as_int":
        return float(point.as_int)
    return None


def _number_points(ctx: _MetricContext, metric_type: str, data: Any, out: Decoded,
                   **extra: Any) -> None:
    for p in data.data_points:
        out.rows.append(_point_row(ctx, metric_type, p, value=_number(p), **extra))


def _histogram_points(ctx: _MetricContext, data: metrics_pb2.Histogram, out: Decoded) -> None:
    temporality = TEMPORALITIES.get(data.aggregation_temporality)
    for p in data.data_points:
        counts = list(p.bucket_counts)
        bounds = [_json_float(b) for b in p.explicit_bounds]
        if counts and len(counts) != len(bounds) + 1:
            out.reject(f"histogram point of {ctx.name!r} with {len(counts)} buckets for {len(bounds)} bounds")
            continue
        out.rows.append(_point_row(
            ctx, "histogram", p, count=_clamp(p.count), sum=_opt(p, "sum"), min=_opt(p, "min"),
            max=_opt(p, "max"), bucket_counts=_dumps(counts), explicit_bounds=_dumps(bounds),
            temporality=temporality,
        ))


def _exp_buckets(b: metrics_pb2.ExponentialHistogramDataPoint.Buckets) -> dict[str, Any]:
    return {"offset": b.offset, "bucket_counts": list(b.bucket_counts)}


def _exp_histogram_points(ctx: _MetricContext, data: metrics_pb2.ExponentialHistogram, out: Decoded) -> None:
    temporality = TEMPORALITIES.get(data.aggregation_temporality)
    for p in data.data_points:
        buckets = {
            "scale": p.scale,
            "zero_count": p.zero_count,
            "zero_threshold": _json_float(p.zero_threshold),
            "positive": _exp_buckets(p.positive),
            "negative": _exp_buckets(p.negative),
        }
        out.rows.append(_point_row(
            ctx, "exponential_histogram", p, count=_clamp(p.count), sum=_opt(p, "sum"), min=_opt(p, "min"),
            max=_opt(p, "max"), exponential_buckets=_dumps(buckets), temporality=temporality,
        ))


def _summary_points(ctx: _MetricContext, data: metrics_pb2.Summary, out: Decoded) -> None:
    for p in data.data_points:
        quantiles = [{"quantile": _json_float(q.quantile), "value": _json_float(q.value)}
                     for q in p.quantile_values]
        out.rows.append(_point_row(ctx, "summary", p, count=_clamp(p.count), sum=p.sum,
                                   quantile_values=_dumps(quantiles)))


def _metric(ctx: _MetricContext, metric: metrics_pb2.Metric, out: Decoded) -> None:
    kind = metric.WhichOneof("data")
    if kind == "gauge":
        _number_points(ctx, "gauge", metric.gauge, out)
    elif kind == "sum":
        data = metric.sum
        _number_points(ctx, "sum", data, out, is_monotonic=data.is_monotonic,
                       temporality=TEMPORALITIES.get(data.aggregation_temporality))
    elif kind == "histogram":
        _histogram_points(ctx, metric.histogram, out)
    elif kind == "exponential_histogram":
        _exp_histogram_points(ctx, metric.exponential_histogram, out)
    elif kind == "summary":
        _summary_points(ctx, metric.summary, out)
    # A metric without data carries no points: nothing to store, nothing to reject.


def metric_rows(request: ExportMetricsServiceRequest, received_ns: int) -> Decoded:
    """Decode every data point of ``request`` into a row in :data:`store.METRIC_COLUMNS` order."""
    out = Decoded()
    for rm in request.resource_metrics:
        res = _resource(rm.resource.attributes)
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                ctx = _MetricContext(metric.name, metric.description, metric.unit, res, sm.scope.name,
                                     received_ns)
                _metric(ctx, metric, out)
    return out


# ---- logs ------------------------------------------------------------------------------------------------


def count_log_records(request: ExportLogsServiceRequest) -> int:
    """Number of log records in ``request`` (logs are counted, not stored)."""
    return sum(len(sl.log_records) for rl in request.resource_logs for sl in rl.scope_logs)
