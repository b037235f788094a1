"""The names zoomer-serve emits against the semantic-conventions release it follows (zoomer_serve.semconv,
v1.44.0): a real gRPC server (sync and aio) and a real Thrift server, their spans and metrics exported over
real OTLP to the embedded collector, with and without OTEL_SEMCONV_STABILITY_OPT_IN."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from thriftpy2.transport import TTransportException

import zoomer_serve
from zoomer_serve import semconv as sc
from zoomer_serve.export.otlp_wire import SpanEncoder
from zoomer_serve.export.rpc_metrics import MetricsRequestEncoder, RpcMetrics

sys.path.insert(0, str(Path(__file__).parent))
import grpc_echo
from test_grpc_server import start_echo  # noqa: F401  (fixture)
from test_thrift_server import T, _client, mode, serve  # noqa: F401  (fixtures)

OURS = ("zoomer.",)


@pytest.fixture
def opt_in(request: Any, collector: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Telemetry configured with ``OTEL_SEMCONV_STABILITY_OPT_IN`` = the parameter ("" for none)."""
    value = getattr(request, "param", "")
    monkeypatch.setenv("OTEL_SEMCONV_STABILITY_OPT_IN", value)
    zoomer_serve.configure(service_name="test-svc", endpoint=collector.grpc_endpoint, protocol="grpc",
                           export_mode="process", schedule_delay_ms=100, timeout_ms=5000,
                           set_global_providers=False)
    yield value
    zoomer_serve.shutdown(timeout_s=2)


def _grpc_calls(start: Any) -> None:
    server, target = start(server_address="127.0.0.1")
    client = grpc_echo.Client(target)
    try:
        assert client.unary(b"hello") == b"hello"
        with pytest.raises(grpc.RpcError):
            client.unary(b"invalid")
        with pytest.raises(grpc.RpcError):
            client.unary(b"raise")
    finally:
        client.close()
        server.stop(None)


def _thrift_calls(start: Any) -> None:
    server = start()
    client = _client(server.port)
    try:
        assert client.echo("hi") == "hi"
        with pytest.raises(T.Declined):
            client.echo("declined")
        with pytest.raises(TTransportException):  # an undeclared exception: the server closes the connection
            client.echo("value")
    finally:
        client.close()


def _rpc_names(attributes: dict[str, Any]) -> set[str]:
    return {k for k in attributes if not k.startswith(OURS)}


def _check_v1_44(spans: list[dict[str, Any]], system: str) -> None:
    assert len(spans) == 3
    for span in spans:
        attrs = span["attributes"]
        names = _rpc_names(attrs)
        assert names <= sc.RPC_SPAN_ATTRIBUTES, names - sc.RPC_SPAN_ATTRIBUTES
        assert not names & (sc.REMOVED | sc.DEPRECATED | {sc.RPC_STATUS_CODE})
        assert {sc.RPC_SYSTEM_NAME, sc.RPC_METHOD, sc.NETWORK_PEER_ADDRESS, sc.NETWORK_PEER_PORT} <= names
        # conditionally required "if available": a Thrift call whose handler raised got no reply, so no status
        assert sc.RPC_RESPONSE_STATUS_CODE in names or (system == "thrift" and span["events"])
        assert attrs[sc.RPC_SYSTEM_NAME] == system
        for event in span["events"] or []:
            assert event["name"] == sc.EXCEPTION_EVENT
            assert set(event["attributes"]) <= {"exception.type", "exception.message", "exception.stacktrace"}
    assert sum(1 for s in spans if s["events"]) == 1  # the one call that raised in the handler


def _metric_names(collector: Any) -> set[str]:
    collector.finish()
    from zoomer_serve.collector.store import open_readonly

    con = open_readonly(collector.store_path)
    try:
        return {row[0] for row in con.execute("SELECT DISTINCT metric_name FROM metric_points").fetchall()}
    finally:
        con.close()


def test_grpc_names_are_those_of_v1_44(opt_in: str, start_echo: Any, collector: Any) -> None:  # noqa: F811
    _grpc_calls(start_echo)
    _check_v1_44(collector.spans("SERVER"), "grpc")
    metrics = {m for m in _metric_names(collector) if m.startswith("rpc.")}
    assert metrics == {sc.RPC_SERVER_CALL_DURATION}  # no deprecated size histograms
    (point, *_) = collector.metric_points(sc.RPC_SERVER_CALL_DURATION)
    assert set(point["attributes"]) <= {sc.RPC_SYSTEM_NAME, sc.RPC_METHOD, sc.RPC_RESPONSE_STATUS_CODE,
                                        sc.ERROR_TYPE, sc.SERVER_ADDRESS, sc.SERVER_PORT}


def test_thrift_names_are_those_of_v1_44(opt_in: str, serve: Any, collector: Any) -> None:  # noqa: F811
    _thrift_calls(serve)
    _check_v1_44(collector.spans("SERVER"), "thrift")
    assert {m for m in _metric_names(collector) if m.startswith("rpc.")} == {sc.RPC_SERVER_CALL_DURATION}


@pytest.mark.parametrize("opt_in", ["http,rpc"], indirect=True)
def test_opt_in_rpc_emits_the_unreleased_status_name_instead(opt_in: str, start_echo: Any,  # noqa: F811
                                                             collector: Any) -> None:
    """``rpc``: the rename only the conventions' main has (``rpc.status_code``), in spans and metrics."""
    _grpc_calls(start_echo)
    spans = collector.spans("SERVER")
    assert sorted(s["attributes"][sc.RPC_STATUS_CODE] for s in spans) == ["INVALID_ARGUMENT", "OK", "UNKNOWN"]
    assert not any(sc.RPC_RESPONSE_STATUS_CODE in s["attributes"] for s in spans)
    points = collector.metric_points(sc.RPC_SERVER_CALL_DURATION)
    assert {p["attributes"][sc.RPC_STATUS_CODE] for p in points} == {"INVALID_ARGUMENT", "OK", "UNKNOWN"}
    # the report and the analysis read either name
    from zoomer_serve.analysis.store import load_store

    assert sorted(load_store(collector.store_path).requests["status"].tolist()) == ["INVALID_ARGUMENT", "OK",
                                                                                    "UNKNOWN"]


@pytest.mark.parametrize("opt_in", ["rpc,rpc/dup"], indirect=True)
def test_opt_in_dup_emits_every_name(opt_in: str, serve: Any, collector: Any) -> None:  # noqa: F811
    _thrift_calls(serve)
    spans = collector.spans("SERVER")
    assert sum(1 for s in spans if sc.RPC_STATUS_CODE in s["attributes"]) == 2  # the two calls with a reply
    for span in spans:
        attrs = span["attributes"]
        assert attrs.get(sc.RPC_STATUS_CODE) == attrs.get(sc.RPC_RESPONSE_STATUS_CODE)
        assert attrs[sc.RPC_SYSTEM] == "thrift" and sc.RPC_SERVICE in attrs
        assert not _rpc_names(attrs) & sc.REMOVED
    assert {m for m in _metric_names(collector) if m.startswith("rpc.")} == {
        sc.RPC_SERVER_CALL_DURATION, "rpc.server.request.size", "rpc.server.response.size"}


def test_opt_in_values_are_read_as_opentelemetry_does() -> None:
    assert [sc.rpc_opt_in(v) for v in (None, "", "http", "rpc", " http , rpc ", "rpc/dup", "rpc,rpc/dup",
                                        "rpc/dup,rpc", "rpcx")] == [
        "default", "default", "default", "next", "next", "dup", "dup", "dup", "default"]


def test_every_exported_scope_carries_the_schema_url() -> None:
    spans = ExportTraceServiceRequest.FromString(SpanEncoder({"service.name": "s"}, "zoomer", "1").encode_request([]))
    assert [ss.schema_url for rs in spans.resource_spans for ss in rs.scope_spans] == [sc.SCHEMA_URL]
    assert sc.SCHEMA_URL == "https://opentelemetry.io/schemas/1.44.0"
    encoder = MetricsRequestEncoder({"service.name": "s"}, "zoomer", "1")
    points = RpcMetrics().data_points(0, 1, {"otel.sdk.exporter.span.exported": {(): 1}})
    metrics = ExportMetricsServiceRequest.FromString(encoder.encode_request(points))
    assert [sm.schema_url for rm in metrics.resource_metrics for sm in rm.scope_metrics] == [sc.SCHEMA_URL]


def test_asking_for_exceptions_as_logs_is_answered_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """v1.40's exception log records need a log export zoomer-serve lacks: the opt-in is not silently ignored."""
    from zoomer_serve.config import ZoomerConfig

    caplog.set_level(logging.WARNING, logger="zoomer_serve")
    ZoomerConfig.from_env({"OTEL_SEMCONV_EXCEPTION_SIGNAL_OPT_IN": "logs/dup"})
    (record,) = [r for r in caplog.records if "EXCEPTION_SIGNAL" in r.getMessage()]
    assert "exceptions stay span events" in record.getMessage()
    caplog.clear()
    ZoomerConfig.from_env({"OTEL_SEMCONV_EXCEPTION_SIGNAL_OPT_IN": ""})
    assert not [r for r in caplog.records if "EXCEPTION_SIGNAL" in r.getMessage()]
