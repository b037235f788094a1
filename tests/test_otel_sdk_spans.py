"""Spans that handlers start with the OpenTelemetry API (the SDK tracer provider that :func:`zoomer_serve.configure`
builds) travel through zoomer-serve's own export pipeline: requests bounded by ``ZOOMER_EXPORT_MAX_REQUEST_BYTES``,
a span too large for any request dropped alone and counted, every loss in the same counters as zoomer's own spans.
Real gRPC server with the interceptor, real OTLP to the real embedded collector."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc_echo
import pytest
from _never_lost import note
from conftest import CollectorHandle

import zoomer_serve
from interceptors import ZoomerServerInterceptor
from zoomer_serve.collector import EmbeddedCollector

MB = 1_000_000


def _serve_calls(telemetry: zoomer_serve.Telemetry, sizes: list[int]) -> None:
    """One ``user_big:N`` call per size on a gRPC server with the interceptor: each handler starts a ``child-op``
    span with the OpenTelemetry API and an N-character attribute."""
    grpc_echo._TRACER_PROVIDER[0] = telemetry.tracer_provider
    server, target = grpc_echo.start_server([ZoomerServerInterceptor()])
    client = grpc_echo.Client(target)
    try:
        for size in sizes:
            assert client.unary(b"user_big:%d" % size, timeout=60) == b"ok"
    finally:
        client.close()
        server.stop(None)


def _too_large_points(collector: CollectorHandle) -> int:
    points = collector.metric_points("otel.sdk.exporter.span.exported")
    return max((p["value"] for p in points if p["attributes"] == {"error.type": "too_large"}), default=0)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["process", "thread"])
def test_a_huge_sdk_span_is_dropped_alone_and_counted(collector, mode):
    """C14: a handler's OpenTelemetry API span with a 20 MB attribute, after two small ones: the SDK's own
    exporter sent all three in one request, which the collector refused (RESOURCE_EXHAUSTED, larger than
    max): 0 of them stored and nothing counted. Now the two small ones are stored under their request spans
    (with their instrumentation scope), the big one is dropped alone and counted as too large."""
    telemetry = zoomer_serve.configure(service_name="sdk-big", endpoint=collector.grpc_endpoint, export_mode=mode,
                                       schedule_delay_ms=60_000, timeout_ms=10_000, set_global_providers=False)
    _serve_calls(telemetry, [10, 10, 20 * MB])
    stats = zoomer_serve.shutdown()
    assert stats is not None
    spans = collector.spans()
    servers = {s["span_id"]: s for s in spans if s["kind"] == "SERVER"}
    children = [s for s in spans if s["name"] == "child-op"]
    note("C14", f"2 small + 1 20 MB OpenTelemetry API spans of handlers ({mode})", 3, len(children),
         stats.dropped_too_large + stats.dropped_record_too_large)
    assert len(servers) == 3
    assert len(children) == 2
    for child in children:
        assert child["attributes"]["my.big"] == "x" * 10
        assert child["scope_name"] == "test.user"
        assert servers[child["parent_span_id"]]["trace_id"] == child["trace_id"]
    assert stats.dropped_too_large + stats.dropped_record_too_large == 1
    assert stats.dropped == 1 and stats.unknown == 0, stats
    assert _too_large_points(collector) == 1


@pytest.fixture
def small_collector(tmp_path: Path) -> Iterator[CollectorHandle]:
    """A collector that takes requests of at most 2 MB (the OpenTelemetry Collector's limit is 4 MiB)."""
    col = EmbeddedCollector(tmp_path / "store.duckdb", host="127.0.0.1", grpc_port=0, http_port=0,
                            max_message_bytes=2 * 1024 * 1024)
    col.start()
    handle = CollectorHandle(col, tmp_path / "store.duckdb")
    yield handle
    zoomer_serve.shutdown(timeout_s=2)
    handle.stop()


@pytest.mark.slow
def test_sdk_spans_over_the_request_bound_together_are_split_into_requests(small_collector, monkeypatch):
    """C14: 8 OpenTelemetry API spans of 300 KB each (2.4 MB together, each under the bound of 1 MB) in one
    export batch: the SDK's exporter sent them as one request, over the collector's 2 MB limit, and all 8 were
    lost uncounted. Now they go as several requests of at most ZOOMER_EXPORT_MAX_REQUEST_BYTES, all stored."""
    monkeypatch.setenv("ZOOMER_EXPORT_MAX_REQUEST_BYTES", str(MB))
    telemetry = zoomer_serve.configure(service_name="sdk-split", endpoint=small_collector.grpc_endpoint,
                                       schedule_delay_ms=60_000, timeout_ms=10_000, set_global_providers=False)
    _serve_calls(telemetry, [300_000] * 8)
    stats = zoomer_serve.shutdown()
    assert stats is not None
    requests = small_collector.collector.stats()["traces_requests"]
    children = [s for s in small_collector.spans() if s["name"] == "child-op"]
    note("C14", "8 OpenTelemetry API spans of 300 KB, over the request bound together", 8, len(children),
         stats.dropped)
    assert len(children) == 8
    assert all(len(c["attributes"]["my.big"]) == 300_000 for c in children)
    assert requests >= 3  # 2.4 MB of spans in requests of at most 1 MB
    assert stats.dropped == 0 and stats.unknown == 0, stats
    assert small_collector.collector.stats()["rejected_too_large"] == 0


def _sdk_spans() -> list[Any]:
    """Ended spans of a real SDK tracer provider: a parent (with attributes, an event, a link, an error status, a
    trace state) and its child, of two instrumentation scopes."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    remote = trace.SpanContext(0xAB, 0xCD, is_remote=True, trace_flags=trace.TraceFlags(1),
                               trace_state=trace.TraceState([("vendor", "x")]))
    tracer = provider.get_tracer("lib.one", "0.1", schema_url="https://opentelemetry.io/schemas/1.26.0",
                                 attributes={"lib.kind": "test"})
    with tracer.start_as_current_span("outer", context=trace.set_span_in_context(trace.NonRecordingSpan(remote)),
                                      kind=trace.SpanKind.CLIENT, links=[trace.Link(remote, {"why": "batch"})]) as sp:
        sp.set_attributes({"n": 3, "ratio": 0.5, "flag": True, "names": ("a", "b")})
        sp.add_event("cache_miss", {"key": "k"})
        sp.set_status(trace.Status(trace.StatusCode.ERROR, "bad input"))
        with provider.get_tracer("lib.two").start_as_current_span("inner"):
            pass
    return list(exporter.get_finished_spans())


def test_an_sdk_span_encodes_as_the_sdks_own_otlp_encoder_does():
    """The record of an SDK span (sdk_record) encoded by zoomer's encoder is, field for field, the span the SDK's
    own OTLP encoder makes, in a ScopeSpans of its own instrumentation scope beside zoomer's own spans; a request
    holding both stays within request_overhead plus request_bytes of each span."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from zoomer_serve.export.otlp_wire import SpanEncoder, request_bytes
    from zoomer_serve.recording import records as r
    from zoomer_serve.recording.sdk_spans import sdk_record

    spans = _sdk_spans()
    encoder = SpanEncoder({"service.name": "svc"}, "zoomer_serve", "9")
    own = (1, 2, 0, False, 1, None, "zoomer.op", r.KIND_SERVER, 10, 20, 0, None, {}, None, None, None, r.F_SAMPLED)
    encoded = [encoder.encode_span(own)] + [encoder.scoped(encoder.encode_span(sdk_record(s)), sdk_record(s))
                                            for s in spans]
    payload = encoder.encode_request(encoded)
    assert len(payload) <= encoder.request_overhead + sum(map(request_bytes, encoded))
    ours = {ss.scope.name: ss for ss in ExportTraceServiceRequest.FromString(payload).resource_spans[0].scope_spans}
    theirs = {ss.scope.name: ss for ss in encode_spans(spans).resource_spans[0].scope_spans}
    assert set(ours) == {"zoomer_serve", "lib.one", "lib.two"} and set(theirs) == {"lib.one", "lib.two"}
    assert [s.name for s in ours["zoomer_serve"].spans] == ["zoomer.op"]
    for name, scope_spans in theirs.items():
        assert ours[name].scope == scope_spans.scope and ours[name].schema_url == scope_spans.schema_url
        for mine, sdk in zip(ours[name].spans, scope_spans.spans, strict=True):
            # the same is-remote bits; ours also carries the W3C trace flags (bits 0-7), as OTLP's Span.flags says
            assert (mine.flags & 0x300, mine.flags & 0xFF) == (sdk.flags & 0x300, 1)
            mine.flags = sdk.flags
            for my_link, sdk_link in zip(mine.links, sdk.links, strict=True):
                assert (my_link.flags & 0x300, my_link.flags & 0xFF) == (sdk_link.flags & 0x300, 1)
                my_link.flags = sdk_link.flags
                assert my_link.trace_state == "vendor=x"  # the SDK's encoder leaves a link's trace state out
                my_link.trace_state = sdk_link.trace_state
            if not sdk.status.code and not sdk.status.message:  # an empty status is UNSET: ours leaves it out
                sdk.ClearField("status")
            assert mine == sdk
    assert theirs["lib.one"].scope.attributes[0].key == "lib.kind"
    assert theirs["lib.one"].spans[0].status.message == "bad input" and theirs["lib.one"].spans[0].links


def test_the_tracer_providers_force_flush_exports_api_spans_now(collector):
    """``tracer_provider.force_flush()`` (as a user calls it) exports the spans made with the API through the
    pipeline now, long before the schedule delay, and answers whether the collector took them."""
    telemetry = zoomer_serve.configure(service_name="sdk-flush", endpoint=collector.grpc_endpoint,
                                       schedule_delay_ms=60_000, timeout_ms=10_000, set_global_providers=False)
    tracer = telemetry.tracer_provider.get_tracer("test.flush")
    for i in range(5):
        with tracer.start_as_current_span(f"op-{i}"):
            pass
    assert telemetry.tracer_provider.force_flush(10_000) is True
    assert collector.collector.flush(10)
    assert collector.collector.stats()["spans_received"] == 5
    assert sorted(s["name"] for s in collector.spans()) == [f"op-{i}" for i in range(5)]


def test_an_api_span_that_ends_after_shutdown_is_counted(collector):
    """A span made with the API that ends once telemetry is shut down is counted with the records that came too
    late (records_after_shutdown), not lost silently in a stopped batch processor."""
    telemetry = zoomer_serve.configure(service_name="sdk-late", endpoint=collector.grpc_endpoint,
                                       set_global_providers=False)
    tracer = telemetry.tracer_provider.get_tracer("test.late")
    span = tracer.start_span("late-op")
    zoomer_serve.shutdown()
    before = zoomer_serve.runtime.records_after_shutdown()
    span.end()
    assert zoomer_serve.runtime.records_after_shutdown() == before + 1
