"""What a handler does to OpenTelemetry's current span (``trace.get_current_span()``) reaches the request span
zoomer-serve records: attributes, events and recorded exceptions, as with any OpenTelemetry instrumentation. Real
gRPC server on 127.0.0.1, real OTLP into the collector."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from opentelemetry import trace

import zoomer_serve
from interceptors import ZoomerServerInterceptor

sys.path.insert(0, str(Path(__file__).parent))
import grpc_echo


@pytest.fixture
def echo(telemetry):
    server, target = grpc_echo.start_server([ZoomerServerInterceptor(excluded_methods=())])
    client = grpc_echo.Client(target)
    yield client
    client.close()
    server.stop(None)


def test_attributes_events_and_exceptions_set_on_the_current_span_are_stored(echo, collector):
    """Every call's attributes and events set through the OpenTelemetry API are on its stored server span (10
    sent, 10 stored), the span says it is recording, and the interceptor's own attributes are still there."""
    for _ in range(10):
        assert echo.unary(b"otel_api", timeout=10) == b"recording"
    spans = collector.spans("SERVER")
    assert len(spans) == 10
    for span in spans:
        attrs = span["attributes"]
        assert (attrs["model.version"], attrs["model.batch"], attrs["model.warm"]) == ("v3", 4, True)
        assert attrs["rpc.method"] == "Unary" or attrs["rpc.method"].endswith("Unary")
        events = {e["name"]: e for e in span["events"]}
        assert events["cache_miss"]["attributes"] == {"cache.key": "abc"}
        exc = events["exception"]["attributes"]
        assert exc["exception.type"] == "ValueError" and exc["exception.message"] == "soft failure"
        assert exc["retry"] == 1
        assert span["status_code"] == "UNSET"


def test_outside_a_request_the_current_span_is_not_ours():
    """Outside a request, the current span is OpenTelemetry's invalid span: nothing recorded, nothing raised."""
    zoomer_serve.RequestRecorder(sink=lambda record: None)
    span = trace.get_current_span()
    assert not span.is_recording()
    span.set_attribute("x", 1)


def test_status_links_and_recording_follow_the_request_span():
    """Through the current span: ``set_status`` (a StatusCode or a Status) and ``add_link`` reach the request
    span; it is recording while the request is open and sampled, not once it ended, and never when unsampled."""
    from opentelemetry.trace import SpanContext, Status, StatusCode, TraceFlags

    from zoomer_serve.recording import records as r

    records: list = []
    recorder = zoomer_serve.RequestRecorder(records.append)
    request = recorder.start("svc/Method")
    request.activate()
    try:
        span = trace.get_current_span()
        assert span.is_recording()
        span.set_status(StatusCode.ERROR, "model crashed")
        assert (request.status, request.status_message) == (r.STATUS_ERROR, "model crashed")
        span.set_status(Status(StatusCode.OK))
        assert (request.status, request.status_message) == (r.STATUS_OK, None)
        span.set_status("not a status")  # ignored, as the SDK ignores what it cannot read
        assert request.status == r.STATUS_OK
        other = SpanContext(0xABC, 0xDEF, False, TraceFlags(1))
        span.add_link(other, {"why": "batch"})
        assert request.links == [(0xABC, 0xDEF, {"why": "batch"})]
        span.end()  # the adapter ends the request span, not the handler
        assert request.is_open
    finally:
        request.deactivate()
    request.end()
    assert not span.is_recording()

    quiet = recorder.start("svc/Method", sampled=False)
    quiet.activate()
    try:
        assert not trace.get_current_span().is_recording()
    finally:
        quiet.deactivate()
    quiet.end()
