"""What counts as an error in the report and the store analysis: the span status ERROR that the recorder wrote,
not every status code but OK. Real servers (a gRPC server behind ``ZoomerServerInterceptor``, a thriftpy2 server
behind the traced processor) export over real OTLP to the embedded collector; the report reads its store.

By the OpenTelemetry RPC conventions a gRPC server span is ERROR only for UNKNOWN, DEADLINE_EXCEEDED,
UNIMPLEMENTED, INTERNAL, UNAVAILABLE and DATA_LOSS; INVALID_ARGUMENT or NOT_FOUND leave it UNSET, and so does a
Thrift exception declared in the IDL (a normal reply, C10). Those codes still show in the per-code breakdown."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import grpc
import pytest
import thriftpy2
from rich.console import Console
from thriftpy2.rpc import make_client as plain_client
from thriftpy2.thrift import TApplicationException

from interceptors import ZoomerServerInterceptor
from interceptors.thrift_server import make_server
from zoomer_serve.analysis.store import load_store, request_percentiles
from zoomer_serve.report import build_report, render_report

sys.path.insert(0, str(Path(__file__).parent))
import grpc_echo
from _span_wait import SpanWatch

IDL = """
exception Declined { 1: string reason }
service Scorer { string score(1: string text) throws (1: Declined declined) }
"""
T = thriftpy2.load_fp(io.StringIO(IDL), module_name="zoomer_test_report_errors_thrift")
GRPC_METHOD = "test.Echo/Unary"
THRIFT_METHOD = "Scorer/score"
GRPC_CALLS = {b"ok": (grpc.StatusCode.OK, 5), b"invalid": (grpc.StatusCode.INVALID_ARGUMENT, 4),
              b"setcode": (grpc.StatusCode.NOT_FOUND, 2), b"internal": (grpc.StatusCode.INTERNAL, 3)}
THRIFT_CALLS = {"fine": 3, "declined": 4, "app": 2}


class _Scorer:
    def score(self, text: str) -> str:
        if text == "declined":
            raise T.Declined(reason="no candidates")
        if text == "app":
            raise TApplicationException(TApplicationException.INTERNAL_ERROR, "model crashed")
        return text


def _call_grpc(target: str) -> None:
    client = grpc_echo.Client(target)
    try:
        grpc_echo.send_calls(client, GRPC_CALLS)
    finally:
        client.close()


def _call_thrift(port: int) -> None:
    client = plain_client(T.Scorer, "127.0.0.1", port, timeout=5000)
    try:
        for text, n in THRIFT_CALLS.items():
            for _ in range(n):
                if text == "declined":
                    with pytest.raises(T.Declined):
                        client.score(text)
                elif text == "app":
                    with pytest.raises(TApplicationException):
                        client.score(text)
                else:
                    assert client.score(text) == text
    finally:
        client.close()


def test_report_errors_follow_the_span_status_not_the_status_code(telemetry, collector):
    """C10: 14 gRPC calls (5 OK, 4 INVALID_ARGUMENT, 2 NOT_FOUND, 3 INTERNAL) and 9 Thrift calls (3 replies, 4
    declared ``Declined`` exceptions, 2 TApplicationException INTERNAL_ERROR): the report counts 3 + 2 errors,
    the calls whose server span is ERROR; the per-code breakdown still lists every code. The store analysis
    (``analyze --store``) counts the same."""
    watch = SpanWatch(telemetry.recorder)
    grpc_server, target = grpc_echo.start_server([ZoomerServerInterceptor(server_address="127.0.0.1")])
    thrift_server = make_server(T.Scorer, _Scorer(), "127.0.0.1", 0).start()
    try:
        _call_grpc(target)
        _call_thrift(thrift_server.port)
    finally:
        grpc_server.stop(None)
        thrift_server.stop()
    sent = sum(n for _, n in GRPC_CALLS.values()) + sum(THRIFT_CALLS.values())
    assert watch.wait_ended(sent)
    spans = collector.spans("SERVER")  # flushes telemetry and stops the collector
    assert len(spans) == sent
    by_code: dict[tuple[str, str], set[str]] = {}
    for span in spans:
        by_code.setdefault((span["name"], span["attributes"]["rpc.response.status_code"]), set()).add(
            span["status_code"])
    assert by_code == {  # what the recorder wrote, the fact the report must follow
        (GRPC_METHOD, "OK"): {"UNSET"}, (GRPC_METHOD, "INVALID_ARGUMENT"): {"UNSET"},
        (GRPC_METHOD, "NOT_FOUND"): {"UNSET"}, (GRPC_METHOD, "INTERNAL"): {"ERROR"},
        (THRIFT_METHOD, "OK"): {"UNSET"}, (THRIFT_METHOD, "Declined"): {"UNSET"},
        (THRIFT_METHOD, "INTERNAL_ERROR"): {"ERROR"}}

    report = build_report(collector.store_path)
    methods = {m.method: m for m in report.methods}
    assert set(methods) == {GRPC_METHOD, THRIFT_METHOD}
    unary, score = methods[GRPC_METHOD], methods[THRIFT_METHOD]
    assert (unary.count, unary.error_count) == (14, 3)
    assert unary.error_rate == pytest.approx(3 / 14)
    assert unary.status_counts == {"OK": 5, "INVALID_ARGUMENT": 4, "INTERNAL": 3, "NOT_FOUND": 2}
    assert (score.count, score.error_count) == (9, 2)
    assert score.error_rate == pytest.approx(2 / 9)
    assert score.status_counts == {"Declined": 4, "OK": 3, "INTERNAL_ERROR": 2}
    assert (report.total_requests, report.total_errors) == (23, 5)
    # counted by the rpc.server.call.duration metric, whose points are judged by the same rule as the span status
    assert {m.counts_from for m in report.methods} == {"rpc.server.call.duration"} and report.total_spans == 23
    assert report.to_dict()["total_errors"] == 5

    text = io.StringIO()
    render_report(report, Console(file=text, width=250, color_system=None))
    assert "23 requests, 5 errors" in text.getvalue()
    for needle in ("INVALID_ARGUMENT 4", "NOT_FOUND 2", "INTERNAL 3", "Declined 4", "INTERNAL_ERROR 2"):
        assert needle in text.getvalue(), needle

    data = load_store(collector.store_path)
    assert int(data.requests["is_error"].sum()) == 5
    table = request_percentiles(data)
    errors = {row["method"]: (row["count"], row["errors"], row["counts_from"]) for row in table.rows()}
    assert errors == {GRPC_METHOD: (14, 3, "rpc.server.call.duration"), THRIFT_METHOD: (9, 2, "rpc.server.call.duration")}
