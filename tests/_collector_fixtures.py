"""Helpers shared by test_collector.py and test_report.py: real OpenTelemetry SDK pipelines pointed at a
running EmbeddedCollector, and raw OTLP requests for what the SDK cannot produce."""

from __future__ import annotations

import http.client
import random
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.exporter.otlp.proto.http import Compression as HttpCompression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from zoomer_serve.collector import EmbeddedCollector, StoreConfig, open_readonly

TRACE_EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
METRICS_EXPORT = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"
LOGS_EXPORT = "/opentelemetry.proto.collector.logs.v1.LogsService/Export"


@contextmanager
def running_collector(tmp_path: Path, max_message_bytes: int = 1 << 20,
                      store_config: StoreConfig | None = None) -> Iterator[EmbeddedCollector]:
    """An EmbeddedCollector on 127.0.0.1 with free ports and a fresh store under ``tmp_path``."""
    collector = EmbeddedCollector(tmp_path / "store.duckdb", grpc_port=0, http_port=0,
                                  max_message_bytes=max_message_bytes, store_config=store_config)
    collector.start()
    try:
        yield collector
    finally:
        collector.stop()


def tracer_provider(collector: EmbeddedCollector, transport: str, service: str = "ranker",
                    batch: int = 512, gzip: bool = False) -> TracerProvider:
    """A TracerProvider exporting to ``collector`` over ``transport`` ('grpc' or 'http') in batches."""
    if transport == "grpc":
        exporter: Any = GrpcSpanExporter(endpoint=f"127.0.0.1:{collector.grpc_port}", insecure=True,
                                         compression=grpc.Compression.Gzip if gzip else None)
    else:
        exporter = HttpSpanExporter(endpoint=f"http://127.0.0.1:{collector.http_port}/v1/traces",
                                    compression=HttpCompression.Gzip if gzip else None)
    provider = TracerProvider(resource=Resource.create({"service.name": service,
                                                        "service.instance.id": f"{service}-1"}))
    provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=20_000,
                                                   max_export_batch_size=batch, schedule_delay_millis=50))
    return provider


def query(store: Path, sql: str, params: list[Any] | None = None) -> list[tuple[Any, ...]]:
    """Run ``sql`` on a read-only connection to the store."""
    con = open_readonly(store)
    try:
        return con.execute(sql, params or []).fetchall()
    finally:
        con.close()


def kv(key: str, value: AnyValue) -> KeyValue:
    return KeyValue(key=key, value=value)


def raw_trace_request(n_spans: int, service: str = "raw", attrs: Mapping[str, AnyValue] | None = None,
                      ) -> ExportTraceServiceRequest:
    """An ExportTraceServiceRequest with ``n_spans`` valid SERVER spans (random ids, 1 ms each)."""
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.append(kv("service.name", AnyValue(string_value=service)))
    ss = rs.scope_spans.add()
    ss.scope.name = "raw-scope"
    for i in range(n_spans):
        span = ss.spans.add()
        span.trace_id = random.randbytes(15) + b"\x01"
        span.span_id = random.randbytes(7) + b"\x01"
        span.name = f"raw-{i}"
        span.kind = span.SPAN_KIND_SERVER
        span.start_time_unix_nano = 1_700_000_000_000_000_000 + i
        span.end_time_unix_nano = span.start_time_unix_nano + 1_000_000
        for key, value in (attrs or {}).items():
            span.attributes.append(kv(key, value))
    return req


def http_post(port: int, path: str, body: bytes, headers: Mapping[str, str] | None = None,
              method: str = "POST") -> tuple[int, dict[str, str], bytes]:
    """One HTTP request to the collector; returns (status, headers, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        hdrs = {"Content-Type": "application/x-protobuf", **(headers or {})}
        conn.request(method, path, body=body, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()
