"""The embedded OTLP collector, end to end: real OpenTelemetry SDK exporters -> receivers -> DuckDB store."""

from __future__ import annotations

import argparse
import gzip
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from _collector_fixtures import (
    LOGS_EXPORT,
    METRICS_EXPORT,
    TRACE_EXPORT,
    http_post,
    kv,
    query,
    raw_trace_request,
    running_collector,
    tracer_provider,
)
from google.rpc import code_pb2, status_pb2
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcMetricExporter
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetricExporter
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValueList
from opentelemetry.proto.metrics.v1.metrics_pb2 import AGGREGATION_TEMPORALITY_DELTA
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.trace import SpanKind, Status, StatusCode

from zoomer_serve.collector import (
    SCHEMA,
    EmbeddedCollector,
    Store,
    StoreConfig,
    StoreError,
    WriteStatus,
    default_store_path,
    open_readonly,
)
from zoomer_serve.collector import cli as collector_cli

REPO_ROOT = Path(__file__).resolve().parents[1]
T0 = 1_800_000_000_000_000_000  # a fixed epoch time in ns for spans with explicit times


def _emit_request_tree(tracer: trace.Tracer, method: str, start_ns: int, error: bool) -> None:
    """One SERVER span (10 ms) with two phase children, times given explicitly."""
    attrs = {"rpc.method": method, "rpc.system": "grpc", "zoomer.batch": 4, "zoomer.ratio": 0.5,
             "zoomer.warm": True, "zoomer.tags": ["a", "b"]}
    parent = tracer.start_span("ranker/" + method, kind=SpanKind.SERVER, attributes=attrs, start_time=start_ns)
    parent.add_event("queued", {"depth": 3}, timestamp=start_ns + 1_000)
    ctx = trace.set_span_in_context(parent)
    for phase, (a, b) in {"preprocess": (0, 2_000_000), "forward": (2_000_000, 9_000_000)}.items():
        child = tracer.start_span(phase, context=ctx, attributes={"zoomer.phase": phase}, start_time=start_ns + a)
        child.end(end_time=start_ns + b)
    if error:
        parent.set_status(Status(StatusCode.ERROR, "boom"))
    parent.end(end_time=start_ns + 10_000_000)


@pytest.mark.parametrize("transport,gzip_on", [("grpc", False), ("http", False), ("grpc", True), ("http", True)])
def test_sdk_spans_are_stored_exactly(tmp_path: Path, transport: str, gzip_on: bool) -> None:
    with running_collector(tmp_path) as collector:
        provider = tracer_provider(collector, transport, gzip=gzip_on)
        tracer = provider.get_tracer("zoomer.test", "1.0")
        _emit_request_tree(tracer, "Predict", T0, error=False)
        _emit_request_tree(tracer, "Rank", T0 + 50_000_000, error=True)
        provider.shutdown()
        stats = collector.stop()
    assert stats["spans_received"] == 6
    assert stats["store_written"] == 6
    assert stats[f"{transport}_requests"] >= 1

    store = collector.store_path
    rows = query(store, "SELECT name, kind, start_ns, end_ns, duration_ns, status_code, status_message, "
                        "service_name, service_instance_id, scope_name, span_id, parent_span_id, trace_id "
                        "FROM spans ORDER BY start_ns, name")
    by_name = {r[0]: r for r in rows}
    assert set(by_name) == {"ranker/Predict", "ranker/Rank", "preprocess", "forward"} and len(rows) == 6
    predict = by_name["ranker/Predict"]
    assert predict[1:8] == ("SERVER", T0, T0 + 10_000_000, 10_000_000, "UNSET", "", "ranker")
    assert predict[8:10] == ("ranker-1", "zoomer.test")
    assert len(predict[12]) == 32 and len(predict[10]) == 16 and predict[11] is None
    rank = by_name["ranker/Rank"]
    assert rank[5:7] == ("ERROR", "boom")

    # Each phase child hangs under its own request span, in the same trace.
    children = query(store, "SELECT c.name, c.duration_ns, p.name FROM spans c JOIN spans p "
                            "ON c.parent_span_id = p.span_id AND c.trace_id = p.trace_id ORDER BY p.name, c.name")
    assert children == [
        ("forward", 7_000_000, "ranker/Predict"), ("preprocess", 2_000_000, "ranker/Predict"),
        ("forward", 7_000_000, "ranker/Rank"), ("preprocess", 2_000_000, "ranker/Rank"),
    ]
    attrs, events, res = query(store, "SELECT attributes, events, resource_attributes FROM spans "
                                      "WHERE name = 'ranker/Predict'")[0]
    assert json.loads(attrs) == {"rpc.method": "Predict", "rpc.system": "grpc", "zoomer.batch": 4,
                                 "zoomer.ratio": 0.5, "zoomer.warm": True, "zoomer.tags": ["a", "b"]}
    assert json.loads(events) == [{"name": "queued", "time_ns": T0 + 1_000, "attributes": {"depth": 3}}]
    assert json.loads(res)["service.name"] == "ranker"
    # JSON columns are queryable with DuckDB's JSON functions.
    assert query(store, "SELECT count(*) FROM spans WHERE attributes->>'$.\"zoomer.phase\"' = 'forward'") == [(2,)]


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_sdk_metrics_histogram_sum_gauge(tmp_path: Path, transport: str) -> None:
    with running_collector(tmp_path) as collector:
        if transport == "grpc":
            exporter = GrpcMetricExporter(endpoint=f"127.0.0.1:{collector.grpc_port}", insecure=True)
        else:
            exporter = HttpMetricExporter(endpoint=f"http://127.0.0.1:{collector.http_port}/v1/metrics")
        reader = PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)
        provider = MeterProvider(metric_readers=[reader], resource=Resource.create({"service.name": "ranker"}))
        meter = provider.get_meter("zoomer.metrics")
        hist = meter.create_histogram("rpc.server.duration", unit="ms", description="latency",
                                      explicit_bucket_boundaries_advisory=[1.0, 5.0, 10.0])
        for value in (0.5, 2.0, 3.0, 7.0, 20.0, 30.0):
            hist.record(value, {"rpc.method": "Predict"})
        counter = meter.create_counter("rpc.server.requests", unit="{request}")
        counter.add(3, {"rpc.method": "Predict"})
        counter.add(2, {"rpc.method": "Rank"})
        gauge = meter.create_gauge("gpu.memory.used", unit="By")
        gauge.set(1234.5)
        provider.shutdown()  # final collection and export
        stats = collector.stop()
    assert stats["metric_points_received"] == 4
    store = collector.store_path
    h = query(store, "SELECT metric_type, unit, description, count, sum, min, max, bucket_counts, explicit_bounds, "
                     "aggregation_temporality, attributes, service_name, scope_name FROM metric_points "
                     "WHERE metric_name = 'rpc.server.duration'")
    assert len(h) == 1
    mtype, unit, desc, count, total, lo, hi, buckets, bounds, temporality, attrs, service, scope = h[0]
    assert (mtype, unit, desc, count, total, lo, hi) == ("histogram", "ms", "latency", 6, 62.5, 0.5, 30.0)
    assert json.loads(buckets) == [1, 2, 1, 2] and json.loads(bounds) == [1.0, 5.0, 10.0]
    assert temporality == "CUMULATIVE" and json.loads(attrs) == {"rpc.method": "Predict"}
    assert (service, scope) == ("ranker", "zoomer.metrics")
    sums = query(store, "SELECT attributes->>'$.\"rpc.method\"', value, is_monotonic, aggregation_temporality "
                        "FROM metric_points WHERE metric_type = 'sum' ORDER BY 1")
    assert sums == [("Predict", 3.0, True, "CUMULATIVE"), ("Rank", 2.0, True, "CUMULATIVE")]
    assert query(store, "SELECT value, is_monotonic, count FROM metric_points WHERE metric_type = 'gauge'") == [
        (1234.5, None, None)]


def test_raw_metric_types_and_partial_success(tmp_path: Path) -> None:
    req = ExportMetricsServiceRequest()
    rm = req.resource_metrics.add()
    rm.resource.attributes.append(kv("service.name", AnyValue(string_value="raw")))
    sm = rm.scope_metrics.add()
    summary = sm.metrics.add(name="latency.summary", unit="s")
    point = summary.summary.data_points.add(time_unix_nano=T0, count=4, sum=2.5)
    point.quantile_values.add(quantile=0.5, value=0.4)
    point.quantile_values.add(quantile=1.0, value=1.5)
    exp = sm.metrics.add(name="latency.exp")
    exp.exponential_histogram.aggregation_temporality = AGGREGATION_TEMPORALITY_DELTA
    ep = exp.exponential_histogram.data_points.add(time_unix_nano=T0, count=3, sum=7.0, scale=2, zero_count=1)
    ep.positive.offset = 5
    ep.positive.bucket_counts.extend([1, 1])
    bad = sm.metrics.add(name="latency.bad")
    bad.histogram.data_points.add(time_unix_nano=T0, count=1, bucket_counts=[1, 0, 0], explicit_bounds=[1.0])
    gauge = sm.metrics.add(name="queue.depth")
    gauge.gauge.data_points.add(time_unix_nano=T0, as_int=7)
    with running_collector(tmp_path) as collector:
        status, _, body = http_post(collector.http_port, "/v1/metrics", req.SerializeToString())
        stats = collector.stop()
    assert status == 200
    reply = ExportMetricsServiceResponse.FromString(body)
    assert reply.partial_success.rejected_data_points == 1 and "latency.bad" in reply.partial_success.error_message
    assert stats["metric_points_received"] == 3 and stats["metric_points_rejected"] == 1
    rows = query(collector.store_path, "SELECT metric_name, metric_type, count, sum, value, quantile_values, "
                                       "exponential_buckets, aggregation_temporality, start_ns, time_ns "
                                       "FROM metric_points ORDER BY metric_name")
    assert [r[:5] for r in rows] == [("latency.exp", "exponential_histogram", 3, 7.0, None),
                                     ("latency.summary", "summary", 4, 2.5, None),
                                     ("queue.depth", "gauge", None, None, 7.0)]
    assert json.loads(rows[1][5]) == [{"quantile": 0.5, "value": 0.4}, {"quantile": 1.0, "value": 1.5}]
    assert json.loads(rows[0][6]) == {"scale": 2, "zero_count": 1, "zero_threshold": 0.0,
                                      "positive": {"offset": 5, "bucket_counts": [1, 1]},
                                      "negative": {"offset": 0, "bucket_counts": []}}
    assert rows[0][7] == "DELTA" and rows[2][8:] == (None, T0)


def _raw_call(port: int, method: str, payload: bytes, compression: grpc.Compression | None = None) -> bytes:
    with grpc.insecure_channel(f"127.0.0.1:{port}",
                               options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        return call(payload, timeout=10, compression=compression)


def test_grpc_rejections_and_recovery(tmp_path: Path) -> None:
    with running_collector(tmp_path, max_message_bytes=64 * 1024) as collector:
        port = collector.grpc_port
        for garbage in (b"\xff\xff\xff\xff", b"\x0a\x05abc", os.urandom(200)):
            with pytest.raises(grpc.RpcError) as err:
                _raw_call(port, TRACE_EXPORT, garbage)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as err:
            _raw_call(port, METRICS_EXPORT, b"\x0a\x03\xff\xff\xff")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        big = raw_trace_request(1, attrs={"blob": AnyValue(string_value="x" * 100_000)}).SerializeToString()
        with pytest.raises(grpc.RpcError) as err:
            _raw_call(port, TRACE_EXPORT, big)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Small on the wire, too large once decompressed: a gzip bomb is refused too.
        bomb = raw_trace_request(1, attrs={"blob": AnyValue(string_value="0" * 4_000_000)}).SerializeToString()
        with pytest.raises(grpc.RpcError) as err:
            _raw_call(port, TRACE_EXPORT, bomb, compression=grpc.Compression.Gzip)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        # The collector still serves the next good export, and answers with the OTLP response message.
        reply = _raw_call(port, TRACE_EXPORT, raw_trace_request(3).SerializeToString())
        assert not ExportTraceServiceResponse.FromString(reply).HasField("partial_success")
        logs = ExportLogsServiceRequest()
        logs.resource_logs.add().scope_logs.add().log_records.add().body.string_value = "hello"
        _raw_call(port, LOGS_EXPORT, logs.SerializeToString())
        stats = collector.stop()
    assert stats["rejected_invalid"] == 4
    assert stats["log_records_received"] == 1
    assert stats["spans_received"] == 3
    assert query(collector.store_path, "SELECT count(*) FROM spans") == [(3,)]


def _export_once(tmp_path: Path, req: Any) -> tuple[Any, ExportTraceServiceResponse, dict[str, Any]]:
    """Send ``req`` over OTLP/gRPC to a fresh collector and stop it: (the collector, its reply, its stats)."""
    with running_collector(tmp_path) as collector:
        reply = ExportTraceServiceResponse.FromString(
            _raw_call(collector.grpc_port, TRACE_EXPORT, req.SerializeToString()))
        stats = collector.stop()
    return collector, reply, stats


def test_invalid_ids_get_partial_success(tmp_path: Path) -> None:
    req = raw_trace_request(3)
    spans = req.resource_spans[0].scope_spans[0].spans
    spans[0].trace_id = b"\x00" * 16
    spans[1].span_id = b"\x01\x02"
    collector, reply, stats = _export_once(tmp_path, req)
    assert reply.partial_success.rejected_spans == 2
    assert "invalid" in reply.partial_success.error_message
    assert stats["spans_rejected"] == 2 and stats["spans_received"] == 1
    assert query(collector.store_path, "SELECT name FROM spans") == [("raw-2",)]


def test_a_span_that_ends_before_it_starts_gets_partial_success(tmp_path: Path) -> None:
    """OTLP expects ``end_time_unix_nano >= start_time_unix_nano``; a span that ends 10 ms before it starts was
    stored, and ``report`` and ``analyze`` then printed a p50 of -10 ms. It is rejected and counted like a span
    with an invalid id, the reason sent back in the partial success; a span of zero length is kept."""
    req = raw_trace_request(3)
    spans = req.resource_spans[0].scope_spans[0].spans
    spans[0].end_time_unix_nano = spans[0].start_time_unix_nano - 10_000_000
    spans[1].end_time_unix_nano = spans[1].start_time_unix_nano
    collector, reply, stats = _export_once(tmp_path, req)
    assert reply.partial_success.rejected_spans == 1
    assert "ends before it starts" in reply.partial_success.error_message
    assert stats["spans_rejected"] == 1 and stats["spans_received"] == 2
    assert query(collector.store_path, "SELECT name, duration_ns FROM spans ORDER BY name") == [
        ("raw-1", 0), ("raw-2", spans[2].end_time_unix_nano - spans[2].start_time_unix_nano)]


def _status(body: bytes) -> status_pb2.Status:
    return status_pb2.Status.FromString(body)


def test_http_rejections(tmp_path: Path) -> None:
    limit = 64 * 1024
    with running_collector(tmp_path, max_message_bytes=limit) as collector:
        port = collector.http_port
        status, _, body = http_post(port, "/v1/traces", b"\xff\xff\xff\xff")
        assert status == 400 and _status(body).code == code_pb2.INVALID_ARGUMENT
        status, _, body = http_post(port, "/v1/traces", b"{not json", {"Content-Type": "application/json"})
        assert status == 400 and json.loads(body)["code"] == code_pb2.INVALID_ARGUMENT
        for top in (b"[]", b'"x"', b"3"):  # JSON, but no object: "[]" was answered 200 (an empty export)
            status, _, body = http_post(port, "/v1/traces", top, {"Content-Type": "application/json"})
            assert status == 400 and "not an object" in json.loads(body)["message"], (top, body)

        status, headers, body = http_post(port, "/v1/traces", b"\0" * (limit + 1))
        assert status == 413 and _status(body).code == code_pb2.RESOURCE_EXHAUSTED
        assert headers["connection"] == "close"
        bomb = gzip.compress(b"\0" * (50 * limit))  # ~3 MiB of zeros in a few KiB
        assert len(bomb) < limit
        status, _, _ = http_post(port, "/v1/traces", bomb, {"Content-Encoding": "gzip"})
        assert status == 413
        status, _, _ = http_post(port, "/v1/traces", b"\x1f\x8b garbage", {"Content-Encoding": "gzip"})
        assert status == 400

        assert http_post(port, "/v1/spans", b"")[0] == 404
        assert http_post(port, "/", b"x" * 10)[0] == 404
        status, headers, _ = http_post(port, "/v1/traces", b"", method="GET")
        assert status == 405 and headers["allow"] == "POST"
        assert http_post(port, "/v1/traces", b"x", {"Content-Type": "text/plain"})[0] == 415
        assert http_post(port, "/v1/traces", b"x", {"Content-Encoding": "br"})[0] == 415

        # Still serving: a good protobuf export and a good OTLP/JSON export (hex ids).
        good = raw_trace_request(2)
        status, headers, body = http_post(port, "/v1/traces", gzip.compress(good.SerializeToString()),
                                          {"Content-Encoding": "gzip"})
        assert status == 200 and headers["content-type"] == "application/x-protobuf"
        ExportTraceServiceResponse.FromString(body)
        doc = {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name",
                                                                "value": {"stringValue": "json-svc"}}]},
                                  "scopeSpans": [{"spans": [{
                                      "traceId": "5b8efff798038103d269b633813fc60c", "spanId": "eee19b7ec3c1b174",
                                      "parentSpanId": "eee19b7ec3c1b173", "name": "json-span", "kind": 2,
                                      "startTimeUnixNano": "1544712660000000000",
                                      "endTimeUnixNano": "1544712661000000000", "unknownField": 1}]}]}]}
        status, _, body = http_post(port, "/v1/traces", json.dumps(doc).encode(),
                                    {"Content-Type": "application/json"})
        assert status == 200, body
        stats = collector.stop()
    assert stats["rejected_invalid"] == 6 and stats["rejected_too_large"] == 2
    assert stats["http_404"] == 2 and stats["http_405"] == 1 and stats["http_415"] == 2
    # every refusal has its http_<status>: the gzip bomb's 413 and the undecodable bodies' 400s were answered after
    # ingestion and were counted as rejected only (a trial saw rejected_too_large 2 beside http_413 1)
    assert (stats["http_413"], stats["http_400"]) == (2, 6), stats
    rows = query(collector.store_path, "SELECT trace_id, span_id, parent_span_id, kind, duration_ns, service_name "
                                       "FROM spans WHERE name = 'json-span'")
    assert rows == [("5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174", "eee19b7ec3c1b173", "SERVER",
                     1_000_000_000, "json-svc")]
    assert query(collector.store_path, "SELECT count(*) FROM spans") == [(3,)]


def test_attribute_value_encoding(tmp_path: Path) -> None:
    attrs = {
        "bytes": AnyValue(bytes_value=b"\x00\xffzoomer"),
        "nan": AnyValue(double_value=float("nan")),
        "inf": AnyValue(double_value=float("-inf")),
        "list": AnyValue(array_value=ArrayValue(values=[AnyValue(int_value=1), AnyValue(string_value="x")])),
        "map": AnyValue(kvlist_value=KeyValueList(values=[kv("k", AnyValue(bool_value=False))])),
        "empty": AnyValue(),
        "utf8": AnyValue(string_value="größe ✓"),
    }
    with running_collector(tmp_path) as collector:
        http_post(collector.http_port, "/v1/traces", raw_trace_request(1, attrs=attrs).SerializeToString())
    (value,) = query(collector.store_path, "SELECT attributes FROM spans")[0]
    assert json.loads(value) == {"bytes": "AP96b29tZXI=", "nan": "NaN", "inf": "-Infinity", "list": [1, "x"],
                                 "map": {"k": False}, "empty": None, "utf8": "größe ✓"}


@pytest.mark.parametrize("transport", ["grpc", "http"])
@pytest.mark.slow
def test_loses_nothing_it_acknowledged(tmp_path: Path, transport: str) -> None:
    with running_collector(tmp_path) as collector:
        provider = tracer_provider(collector, transport, batch=100)
        tracer = provider.get_tracer("load")
        for i in range(5_000):
            tracer.start_span("req", kind=SpanKind.SERVER, attributes={"i": i}).end()
        provider.shutdown()  # returns once every export was acknowledged
        stats = collector.stop()  # immediately: the queue may still hold rows
    assert stats["spans_received"] == 5_000 and stats["store_written"] == 5_000
    assert stats["store_dropped"] == 0 and stats["store_failed"] == 0
    assert query(collector.store_path, "SELECT count(*), count(DISTINCT attributes->>'$.i') FROM spans") == [
        (5_000, 5_000)]


def test_full_queue_answers_retryable_errors_and_keeps_what_it_accepted(tmp_path: Path) -> None:
    # The writer lingers (30 s) waiting for a 1000-row batch, so the 5-row queue fills deterministically; the
    # first export waits for its commit meanwhile (acknowledged means committed).
    cfg = StoreConfig(max_queued_rows=5, batch_rows=1000, linger_s=30.0)
    with running_collector(tmp_path, store_config=cfg) as collector:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(http_post, collector.http_port, "/v1/traces",
                                raw_trace_request(4).SerializeToString())
            _wait_for(lambda: collector.stats()["store_queued"] == 4)
            assert not first.done()  # not answered before its rows are committed
            status, headers, body = http_post(collector.http_port, "/v1/traces",
                                              raw_trace_request(2).SerializeToString())
            assert status == 503 and headers["retry-after"] == "1"
            assert _status(body).code == code_pb2.UNAVAILABLE
            with pytest.raises(grpc.RpcError) as err:
                _raw_call(collector.grpc_port, TRACE_EXPORT, raw_trace_request(2).SerializeToString())
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert collector.flush(timeout_s=60)  # cuts the linger short: the first export is committed
            assert first.result(timeout=60)[0] == 200
        stats = collector.stop()
    assert stats["rejected_unavailable"] == 2 and stats["store_dropped"] == 4
    assert stats["store_written"] == 4
    assert query(collector.store_path, "SELECT count(*) FROM spans") == [(4,)]


def _wait_for(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_store_refuses_after_close_and_reports_lock(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "s.duckdb"
    store = Store(path)
    store.close()
    assert store.submit("spans", [("x",)]) is False
    assert store.stats().dropped == 1
    con = open_readonly(path)
    assert {r[0] for r in con.execute("SHOW TABLES").fetchall()} >= {"spans", "metric_points", "zoomer_meta"}
    con.close()
    with pytest.raises(FileNotFoundError, match="missing.duckdb"):
        open_readonly(tmp_path / "missing.duckdb")
    assert "CREATE TABLE IF NOT EXISTS spans" in SCHEMA


def _rows(n: int, start: int = 0) -> list[tuple[object, ...]]:
    return [(f"{i:032x}", f"{i:016x}", None, "svc/M", "SERVER", i, i + 5, 5, "UNSET", None, "svc", None, "scope",
             f'{{"i":{i},"rpc.method":"svc/M"}}', '{"service.name":"svc"}', "[]", "[]", i) for i in range(start, start + n)]


def _wal_bytes(path: Path) -> int:
    wal = Path(f"{path}.wal")
    return wal.stat().st_size if wal.exists() else 0


def _checkpoint_threshold(store: Store) -> str:
    con = store.cursor()
    try:
        return str(con.execute("SELECT current_setting('checkpoint_threshold')").fetchone()[0])
    finally:
        con.close()


def test_store_checkpoints_once_per_row_group(tmp_path: Path) -> None:
    """The writer checkpoints after ``checkpoint_rows`` rows went into a table (one DuckDB row group by
    default), not when DuckDB's log passes 16 MiB: those checkpoints fell inside row groups and cost 80 ms to
    1.6 s of CPU each, more as the table grew (benchmarks/COLLECTOR.md)."""
    path = tmp_path / "s.duckdb"
    store = Store(path, StoreConfig(checkpoint_rows=1000))
    try:
        assert _checkpoint_threshold(store) == "256.0 MiB"
        for k in range(2):
            assert store.write("spans", _rows(400, 400 * k)).status is WriteStatus.COMMITTED
        assert store.stats().checkpoints == 0 and _wal_bytes(path) > 0  # 800 rows: still in the log
        store.write("spans", _rows(400, 800))
        _wait_for(lambda: store.stats().checkpoints == 1)  # 1200 rows >= 1000: moved into the file
        assert _wal_bytes(path) == 0
        store.write("spans", _rows(400, 1200))
        store.write("metric_points", [])  # nothing written: counts for nothing
        assert store.flush(timeout_s=60) and store.stats().checkpoints == 1  # 400 since: none yet
        assert _wal_bytes(path) > 0
    finally:
        stats = store.close()
    assert (stats.written, stats.checkpoints) == (1600, 1)
    assert query(path, "SELECT count(*), count(DISTINCT span_id) FROM spans") == [(1600, 1600)]


def test_store_leaves_checkpoints_to_duckdb_when_asked(tmp_path: Path) -> None:
    path = tmp_path / "s.duckdb"
    store = Store(path, StoreConfig(checkpoint_rows=0))
    try:
        assert _checkpoint_threshold(store) == "16.0 MiB"
        store.write("spans", _rows(1200))
        assert store.stats().checkpoints == 0 and _wal_bytes(path) > 0
    finally:
        store.close()
    assert query(path, "SELECT count(*) FROM spans") == [(1200,)]
    with pytest.raises(ValueError, match="checkpoint_rows"):
        StoreConfig(checkpoint_rows=-1)


@pytest.mark.parametrize("suffix", ["json", "csv", "parquet"])
def test_a_data_file_is_refused_as_a_store(tmp_path: Path, suffix: str) -> None:
    """DuckDB opens an existing JSON, CSV or Parquet file as an in-memory database that reads it: a collector
    given one acknowledged every span and kept none, and said it wrote them. Refused, the file untouched."""
    import duckdb

    path = tmp_path / f"data.{suffix}"
    if suffix == "parquet":
        con = duckdb.connect()
        con.execute(f"COPY (SELECT 1 AS a) TO '{path}' (FORMAT parquet)")
        con.close()
    else:
        path.write_text('{"a": 1}\n' if suffix == "json" else "a,b\n1,2\n")
    before = path.read_bytes()
    with pytest.raises(StoreError, match="not a DuckDB file"):
        Store(path)
    with pytest.raises(StoreError, match="not a DuckDB file") as read:
        open_readonly(path)
    # read-only, DuckDB says "Cannot launch in-memory database in read-only mode!": true, and no help to a user
    assert "read-only mode" not in str(read.value) and "data file" in str(read.value)
    with pytest.raises(StoreError, match="not a DuckDB file"):
        EmbeddedCollector(path, grpc_port=0, http_port=None).start()
    assert path.read_bytes() == before


def test_default_store_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ZOOMER_STORE", str(tmp_path / "x.duckdb"))
    assert default_store_path() == tmp_path / "x.duckdb"
    monkeypatch.delenv("ZOOMER_STORE")
    monkeypatch.chdir(tmp_path)
    assert default_store_path() == tmp_path / "zoomer-data" / "zoomer.duckdb"


def test_port_in_use_fails_cleanly_and_leaves_no_store_it_created(tmp_path: Path) -> None:
    """A start that fails removes the store file, its write-ahead log and the folders it created; a store
    that was there before is closed again, untouched."""
    with running_collector(tmp_path) as first:
        for grpc_port, http_port in ((0, first.http_port), (first.grpc_port, 0)):
            fresh = tmp_path / "new" / "deeper" / "other.duckdb"
            second = EmbeddedCollector(fresh, grpc_port=grpc_port, http_port=http_port)
            with pytest.raises(OSError):
                second.start()
            assert not second.running
            assert not (tmp_path / "new").exists(), sorted(map(str, (tmp_path / "new").rglob("*")))
        existing = tmp_path / "existing.duckdb"
        store = Store(existing)
        assert store.write("spans", _rows(1)).status is WriteStatus.COMMITTED
        store.close()
        third = EmbeddedCollector(existing, grpc_port=0, http_port=first.http_port)
        with pytest.raises(OSError):
            third.start()
        # the store of the failed collector was closed again, its rows kept: it can be opened by someone else
        assert query(existing, "SELECT count(*) FROM spans") == [(1,)]


def _collector_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    collector_cli.register(parser.add_subparsers(dest="command"))
    return parser


def _run_cli(*argv: str) -> int:
    args = _collector_parser().parse_args(["collector", *argv])
    return int(args.func(args))


def test_cli_refuses_the_same_port_for_both_receivers_before_creating_the_store(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "s.duckdb"
    assert _run_cli("--store", str(store), "--grpc-port", "45678", "--http-port", "45678") == 2
    err = capsys.readouterr().err
    assert "--grpc-port" in err and "--http-port" in err and "45678" in err, err
    assert "Errno" not in err and "Traceback" not in err, err
    assert not store.exists() and list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="grpc_port and http_port"):
        EmbeddedCollector(store, grpc_port=45678, http_port=45678)
    EmbeddedCollector(store, grpc_port=0, http_port=0)  # 0 twice: two free ports


@pytest.mark.parametrize("receiver", ["grpc", "http"])
def test_cli_port_in_use_names_the_receiver_address_and_option_and_leaves_no_store(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], receiver: str) -> None:
    import socket

    store = tmp_path / "data" / "s.duckdb"
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        ports = {"grpc": "0", "http": "0", receiver: str(port)}
        assert _run_cli("--store", str(store), "--grpc-port", ports["grpc"], "--http-port", ports["http"]) == 1
    ours = [line for line in capsys.readouterr().err.splitlines() if line.startswith("zoomer-serve collector:")]
    assert len(ours) == 1, ours
    name, option = {"grpc": ("OTLP/gRPC", "--grpc-port"), "http": ("OTLP/HTTP", "--http-port")}[receiver]
    assert name in ours[0] and f"127.0.0.1:{port}" in ours[0] and option in ours[0], ours[0]
    assert "in use" in ours[0] and "GRPC_VERBOSITY" not in ours[0], ours[0]
    assert list(tmp_path.iterdir()) == []


def test_cli_ready_line_and_clean_stop_on_sigterm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "cli.duckdb"
    script = ("import argparse, sys\n"
              "from zoomer_serve.collector import cli\n"
              "p = argparse.ArgumentParser(); sub = p.add_subparsers(dest='command'); cli.register(sub)\n"
              "a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))\n")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", script, "collector", "--store", str(store), "--grpc-port", "0",
                             "--http-port", "0", "--max-message-bytes", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        ready = json.loads(proc.stdout.readline())
        assert ready["event"] == "ready" and ready["store"] == str(store.resolve())
        assert http_post(ready["http_port"], "/v1/traces", raw_trace_request(7).SerializeToString())[0] == 200
        _raw_call(ready["grpc_port"], TRACE_EXPORT, raw_trace_request(3).SerializeToString())
        # While the collector process holds the file, other processes can neither write nor read it.
        with pytest.raises(StoreError, match="cli.duckdb"):
            Store(store)
        with pytest.raises(StoreError, match="cli.duckdb"):
            open_readonly(store)
        args = _collector_parser().parse_args(["collector", "--store", str(store), "--grpc-port", "0",
                                               "--http-port", "0"])
        assert args.func(args) == 1
        assert "cli.duckdb" in capsys.readouterr().err
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    stopped = json.loads(out.strip().splitlines()[-1])
    assert stopped["event"] == "stopped" and stopped["spans_received"] == 10 and stopped["store_written"] == 10
    assert query(store, "SELECT count(*) FROM spans") == [(10,)]


def test_a_duckdb_file_whose_spans_table_is_another_tools_is_refused(tmp_path: Path) -> None:
    """Another tool's DuckDB file with a ``spans`` table of its own columns: the collector said it was ready, then
    refused every span it was sent, three log lines each (trial). Refused at open, naming the table and what it
    lacks; the file left as it was."""
    import duckdb

    path = tmp_path / "theirs.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE spans (a INTEGER)")
    con.close()
    with pytest.raises(StoreError, match="not a zoomer-serve store .its table 'spans' has no column trace_id"):
        Store(path)
    con = duckdb.connect(str(path), read_only=True)
    try:
        assert [t for (t,) in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()] == ["spans"]
    finally:
        con.close()


def test_a_store_with_a_table_named_like_the_writers_batch_is_refused(tmp_path: Path) -> None:
    """The writer inserts each batch by reading a Python variable by its name; DuckDB looks a name up in the
    file's catalog first, so a table of that name would be inserted instead of the batch. Refused, the file
    left without the store's tables."""
    import duckdb

    from zoomer_serve.collector.store import BATCH_NAME

    path = tmp_path / "theirs.duckdb"
    con = duckdb.connect(str(path))
    con.execute(f"CREATE TABLE {BATCH_NAME} AS SELECT 1 AS a")
    con.close()
    with pytest.raises(StoreError, match=f"table or view named '{BATCH_NAME}'"):
        Store(path)
    con = duckdb.connect(str(path), read_only=True)
    try:
        assert [t for (t,) in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()] == [BATCH_NAME]
    finally:
        con.close()
