"""Under a head sampler the spans are a sample: the report and the store analysis count requests, rates and errors
from the ``rpc.server.call.duration`` metric (every call, sampled or not) and say on how many spans the latency
figures rest. Real parts: a gRPC server behind ``ZoomerServerInterceptor`` exporting through the helper process to
the embedded collector; the OpenTelemetry SDK's OTLP exporters for the temporalities and restarts zoomer-serve does
not produce itself."""

from __future__ import annotations

import argparse
import io
import json
import re
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import pytest
from _collector_fixtures import METRICS_EXPORT, running_collector, tracer_provider
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1 import metrics_pb2
from opentelemetry.sdk.metrics import Histogram, MeterProvider
from opentelemetry.sdk.metrics.export import AggregationTemporality, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.trace import SpanKind
from rich.console import Console

import zoomer_serve
from interceptors import ZoomerServerInterceptor
from zoomer_serve.analysis.api import analyze
from zoomer_serve.analysis.store import load_store, request_percentiles, requests_note
from zoomer_serve.report import build_report, render_report
from zoomer_serve.report import cli as report_cli

sys.path.insert(0, str(Path(__file__).parent))
import grpc_echo
from _span_wait import SpanWatch

METHOD = "test.Echo/Unary"
DURATION = "rpc.server.call.duration"
# request -> (status code, calls): 600 OK, 20 server errors (INTERNAL, UNKNOWN), 10 client errors (no error)
CALLS = {b"ok": (grpc.StatusCode.OK, 600), b"internal": (grpc.StatusCode.INTERNAL, 12),
         b"raise": (grpc.StatusCode.UNKNOWN, 8), b"invalid": (grpc.StatusCode.INVALID_ARGUMENT, 10)}
SENT = sum(n for _, n in CALLS.values())
ERRORS = 12 + 8
RATIO = 0.25


def _configure(collector: Any, monkeypatch: pytest.MonkeyPatch, **env: str) -> zoomer_serve.Telemetry:
    """zoomer-serve as the conftest's ``telemetry`` fixture configures it, with ``env`` set first (the sampler and
    exporter variables are read from the environment, as a user sets them)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return zoomer_serve.configure(service_name="test-svc", endpoint=collector.grpc_endpoint, protocol="grpc",
                                  export_mode="process", schedule_delay_ms=100, timeout_ms=5000,
                                  set_global_providers=False)


def _serve_calls(telemetry: zoomer_serve.Telemetry) -> None:
    """Send every call of :data:`CALLS` to a traced gRPC server; return once every server span has ended and its
    record is in the export pipeline (sampled or not: the metric counts them all)."""
    watch = SpanWatch(telemetry.recorder)
    server, target = grpc_echo.start_server([ZoomerServerInterceptor(server_address="127.0.0.1")])
    client = grpc_echo.Client(target)
    try:
        grpc_echo.send_calls(client, CALLS)
    finally:
        client.close()
        server.stop(None)
    assert watch.wait_ended(SENT)


def _text(report: Any) -> str:
    out = io.StringIO()
    render_report(report, Console(file=out, width=400, color_system=None))
    return out.getvalue()


def test_sampled_spans_counts_come_from_the_call_duration_metric(collector, monkeypatch, capsys):
    """630 calls (600 OK, 12 INTERNAL, 8 UNKNOWN, 10 INVALID_ARGUMENT) with ``OTEL_TRACES_SAMPLER=traceidratio``
    at 0.25: the store holds about a quarter of the spans, and every call in the metric. The report's and the
    analysis' requests, errors and status codes are the calls sent; the spans column and the sampling ratio
    (spans / calls) are stated, in the model, the JSON and the text."""
    telemetry = _configure(collector, monkeypatch, OTEL_TRACES_SAMPLER="traceidratio",
                           OTEL_TRACES_SAMPLER_ARG=str(RATIO))
    _serve_calls(telemetry)
    points = collector.metric_points(DURATION)  # shuts zoomer-serve down (its last metric export) first
    assert sum(p["count"] for p in points) == SENT  # one cumulative export: the calls, all of them
    spans = collector.spans("SERVER")
    n = len(spans)
    assert 0 < n < SENT
    bound = round(RATIO * 2**64)  # the sampler's rule: what was stored was sampled
    assert all(int(s["trace_id"], 16) & (2**64 - 1) < bound for s in spans)

    report = build_report(collector.store_path)
    (m,) = report.methods
    assert (m.method, m.count, m.error_count, m.spans) == (METHOD, SENT, ERRORS, n)
    assert m.status_counts == {"OK": 600, "INTERNAL": 12, "INVALID_ARGUMENT": 10, "UNKNOWN": 8}
    assert m.error_rate == pytest.approx(ERRORS / SENT)
    assert m.counts_from == report.counts_from == DURATION
    assert m.span_sample_ratio == pytest.approx(n / SENT) and report.span_sample_ratio == pytest.approx(n / SENT)
    assert (report.total_requests, report.total_errors, report.total_spans) == (SENT, ERRORS, n)
    assert report.sampled and report.notes == []
    window_s = (max(s["end_ns"] for s in spans) - min(s["start_ns"] for s in spans)) / 1e9
    assert m.rate_per_s == (pytest.approx(SENT / window_s) if window_s >= 1.0 else None)  # calls / span window
    durations = sorted(s["duration_ns"] / 1e6 for s in spans)
    assert m.max_ms == pytest.approx(durations[-1])  # latency: the spans

    text = _text(report)
    assert f"{SENT} requests, {ERRORS} errors" in text
    share = f"{100 * n / SENT:.1f}%"
    assert f"counted by the {DURATION} metric; latency, phases and slowest traces from {n} sampled spans, " \
           f"{share} of the calls" in text
    # the Requests row: reqs, req/s, errors, err%, spans
    assert re.search(rf"{METHOD}\s+{SENT}\s+(-|[\d.]+)\s+{ERRORS}\s+{100 * ERRORS / SENT:.1f}%\s+{n}\s", text)
    assert "OK 600, INTERNAL 12, INVALID_ARGUMENT 10, UNKNOWN 8" in text

    parser = argparse.ArgumentParser()
    report_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["report", "--store", str(collector.store_path), "--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["total_requests"], out["total_errors"], out["total_spans"]) == (SENT, ERRORS, n)
    assert out["counts_from"] == DURATION and out["span_sample_ratio"] == pytest.approx(n / SENT)
    method = out["methods"][0]
    assert (method["count"], method["error_count"], method["spans"]) == (SENT, ERRORS, n)
    assert {"rate_per_s", "error_rate", "status_counts", "p50_ms", "p99_ms", "phases"} <= set(method)

    data = load_store(collector.store_path)
    table = request_percentiles(data)
    (row,) = table.rows()
    assert (row["count"], row["errors"], row["spans"], row["counts_from"]) == (SENT, ERRORS, n, DURATION)
    assert row["sampled_share"] == pytest.approx(n / SENT)
    assert requests_note(table) == f"counted by the {DURATION} metric; latency from {n} sampled spans, {share} of the calls"
    doc = analyze([], collector.store_path).to_dict()  # analyze --store --json
    assert (doc["store"]["requests"], doc["store"]["spans"]) == (SENT, n)


def test_without_the_metric_the_counts_are_spans_and_say_so(collector, monkeypatch):
    """Metrics off (``OTEL_METRICS_EXPORTER=none``), every trace sampled: the store has no call-duration points, so
    the report counts the 630 SERVER spans as before, and says that it counts spans."""
    telemetry = _configure(collector, monkeypatch, OTEL_METRICS_EXPORTER="none")
    _serve_calls(telemetry)
    assert collector.metric_points(DURATION) == []
    assert len(collector.spans("SERVER")) == SENT

    report = build_report(collector.store_path)
    (m,) = report.methods
    assert (m.count, m.error_count, m.spans, m.counts_from, m.span_sample_ratio) == (SENT, ERRORS, SENT, "spans", None)
    assert (report.counts_from, report.span_sample_ratio, report.sampled) == ("spans", None, False)
    text = _text(report)
    assert f"{SENT} requests, {ERRORS} errors" in text
    assert f"counted from SERVER spans; latency, phases and slowest traces from {SENT} spans" in text
    assert "Requests, latency in ms" in text and "Status codes" in text
    table = request_percentiles(load_store(collector.store_path))
    (row,) = table.rows()
    assert (row["count"], row["errors"], row["spans"], row["counts_from"], row["sampled_share"]) == \
        (SENT, ERRORS, SENT, "spans", None)
    assert requests_note(table) == f"counted from SERVER spans ({SENT})"


# -- temporalities, instances, restarts, duplicates ----------------------------------------------------------------
GRPC_OK = {"rpc.system.name": "grpc", "rpc.method": "pkg.S/M", "rpc.response.status_code": "OK"}


def _grpc(status: str) -> dict[str, str]:
    attrs = dict(GRPC_OK, **{"rpc.response.status_code": status})
    if status in ("INTERNAL", "UNAVAILABLE"):
        attrs["error.type"] = status
    return attrs


def _meters(port: int, instance: str, delta: bool) -> tuple[MeterProvider, Any]:
    """A MeterProvider of service ``svc`` / ``instance`` exporting to the collector when flushed, and its
    call-duration histogram."""
    temporality: dict[type, AggregationTemporality] = {Histogram: AggregationTemporality.DELTA} if delta else {}
    exporter = OTLPMetricExporter(endpoint=f"127.0.0.1:{port}", insecure=True, preferred_temporality=temporality)
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)
    provider = MeterProvider(metric_readers=[reader], resource=Resource.create(
        {"service.name": "svc", "service.instance.id": instance}))
    return provider, provider.get_meter("test").create_histogram(DURATION, unit="s")


def _record(histogram: Any, calls: dict[str, int], attrs: Any = _grpc) -> None:
    for status, n in calls.items():
        for _ in range(n):
            histogram.record(0.01, attrs(status))


def _delta_request(count: int, status: str) -> bytes:
    """One raw OTLP export: a DELTA call-duration point of ``count`` calls of pkg.S/M with ``status``."""
    req = ExportMetricsServiceRequest()
    rm = req.resource_metrics.add()
    rm.resource.attributes.extend([KeyValue(key="service.name", value=AnyValue(string_value="svc")),
                                   KeyValue(key="service.instance.id", value=AnyValue(string_value="raw"))])
    metric = rm.scope_metrics.add().metrics.add(name=DURATION, unit="s")
    metric.histogram.aggregation_temporality = metrics_pb2.AGGREGATION_TEMPORALITY_DELTA
    point = metric.histogram.data_points.add(start_time_unix_nano=1_000, time_unix_nano=2_000, count=count,
                                             sum=0.01 * count, bucket_counts=[count], explicit_bounds=[])
    point.attributes.extend(KeyValue(key=k, value=AnyValue(string_value=v)) for k, v in _grpc(status).items())
    return req.SerializeToString()


def _thrift(outcome: str) -> dict[str, str]:
    attrs = {"rpc.system.name": "thrift", "rpc.method": "Scorer/score"}
    if outcome in ("OK", "Declined"):
        attrs["rpc.response.status_code"] = outcome
    elif outcome == "INTERNAL_ERROR":
        attrs.update({"rpc.response.status_code": outcome, "error.type": outcome})
    else:  # raised: no status code, error.type = the exception's type
        attrs["error.type"] = outcome
    return attrs


def test_metric_points_add_up_over_exports_instances_restarts_and_temporalities(tmp_path):
    """The calls of one method from three series kinds: a cumulative instance exported twice (5, then 8 OK and 2
    INTERNAL: the last point counts) and restarted under the same instance id (a new start time: +4 OK); a DELTA
    instance exported twice (6 OK, then 2 OK and 1 UNAVAILABLE: they add up); a DELTA export the collector received
    twice (7 NOT_FOUND, counted once). 30 calls, 3 errors (INTERNAL, UNAVAILABLE; NOT_FOUND is a client error), and
    6 spans of them: the spans are a 20 % sample. Thrift points follow the span rule: a declared exception and a
    cancellation are no errors, TApplicationException and a raised exception are. A method with spans and no
    metric is counted by its spans: the report says its counts are mixed."""
    with running_collector(tmp_path) as collector:
        first, histogram = _meters(collector.grpc_port, "a", delta=False)
        _record(histogram, {"OK": 5})
        assert first.force_flush()
        _record(histogram, {"OK": 3, "INTERNAL": 2})
        assert first.force_flush()
        first.shutdown()
        restarted, histogram = _meters(collector.grpc_port, "a", delta=False)
        _record(histogram, {"OK": 4})
        _record(histogram, {"OK": 3, "Declined": 4, "INTERNAL_ERROR": 2, "CancelledError": 1, "ValueError": 1},
                _thrift)
        restarted.shutdown()
        delta, histogram = _meters(collector.grpc_port, "b", delta=True)
        _record(histogram, {"OK": 6})
        assert delta.force_flush()
        _record(histogram, {"OK": 2, "UNAVAILABLE": 1})
        delta.shutdown()
        with grpc.insecure_channel(f"127.0.0.1:{collector.grpc_port}") as channel:
            export = channel.unary_unary(METRICS_EXPORT)
            for _ in range(2):
                export(_delta_request(7, "NOT_FOUND"), timeout=10)
        spans = tracer_provider(collector, "grpc", service="svc")
        tracer = spans.get_tracer("test")
        for method, n in (("pkg.S/M", 6), ("pkg.S/Other", 2)):
            for _ in range(n):
                tracer.start_span(method, kind=SpanKind.SERVER, attributes={"rpc.method": method}).end()
        spans.shutdown()

    report = build_report(tmp_path / "store.duckdb")
    methods = {m.method: m for m in report.methods}
    m, other, score = methods["pkg.S/M"], methods["pkg.S/Other"], methods["Scorer/score"]
    assert m.status_counts == {"OK": 20, "NOT_FOUND": 7, "INTERNAL": 2, "UNAVAILABLE": 1}
    assert (m.count, m.error_count, m.spans, m.counts_from) == (30, 3, 6, DURATION)
    assert m.span_sample_ratio == pytest.approx(0.2)
    assert score.status_counts == {"Declined": 4, "OK": 3, "INTERNAL_ERROR": 2, "ERROR": 1, "UNSET": 1}
    assert (score.count, score.error_count, score.spans, score.p50_ms, score.rate_per_s) == (11, 3, 0, None, None)
    assert (other.count, other.spans, other.counts_from, other.span_sample_ratio) == (2, 2, "spans", None)
    assert (report.total_requests, report.total_errors, report.total_spans) == (43, 6, 8)
    assert report.counts_from == "mixed" and report.span_sample_ratio == pytest.approx(6 / 41)
    text = _text(report)
    assert f"counted by the {DURATION} metric where the store has it, else from SERVER spans" in text
    assert Counter(line.split()[1] for line in text.splitlines() if line.startswith("  svc")) == Counter(
        {"Scorer/score": 2, "pkg.S/M": 2, "pkg.S/Other": 2})  # each method in the Requests and Status tables


def _load_8_threads(request: bytes, per_thread: int = 150) -> int:
    """Call ``Unary`` with ``request`` from 8 client threads, ``per_thread`` times each, on a gRPC echo server
    behind the zoomer interceptor, each answer checked (b"ok"); returns the calls sent."""
    server, target = grpc_echo.start_server([ZoomerServerInterceptor(server_address="127.0.0.1")])

    def load() -> None:
        client = grpc_echo.Client(target)
        try:
            for _ in range(per_thread):
                assert client.unary(request) == b"ok"
        finally:
            client.close()

    clients = [threading.Thread(target=load) for _ in range(8)]
    try:
        for t in clients:
            t.start()
        for t in clients:
            t.join()
    finally:
        server.stop(None)
    return 8 * per_thread


def test_calls_and_spans_lost_on_a_full_queue_are_counted_and_the_report_and_analysis_say_so(
        collector, monkeypatch, capsys):
    """C12-style loss accounting: ``OTEL_BSP_MAX_QUEUE_SIZE=4`` under load from 8 client threads, so the server's
    export queue overflows. The trial: the server logged "N records did not reach the exporter", the store held
    ``otel.sdk.exporter.span.exported{error.type=queue_full}``, yet ``zoomer-serve report`` printed the calls left
    in the metric with no note. Now the calls missing from the metric are exported as
    ``zoomer.exporter.call.dropped{error.type=queue_full}``: calls sent = calls in the metric + calls counted
    missing, and spans sent = spans stored + spans counted lost; the report (terminal and ``--json``, key
    ``export_losses``) and ``analyze`` say how many and why."""
    _configure(collector, monkeypatch, OTEL_BSP_MAX_QUEUE_SIZE="4", OTEL_BSP_MAX_EXPORT_BATCH_SIZE="2")
    sent = _load_8_threads(b"ok")
    stats = zoomer_serve.shutdown()
    assert stats is not None and stats.dropped_records > 0, stats  # the queue did overflow
    stored = len(collector.spans("SERVER"))
    report = build_report(collector.store_path)
    missing = report.export_losses.calls
    assert missing == {"queue_full": stats.dropped_records}, (missing, stats)
    assert report.total_requests + stats.dropped_records == sent, (report.total_requests, stats)
    assert report.export_losses.spans == {"queue_full": stats.dropped_queue}, (report.export_losses, stats)
    assert stored + stats.dropped_queue == sent, (stored, stats)
    calls_note = (f"{stats.dropped_records} calls are missing from {DURATION} and the counts above (a full export "
                  f"queue: {stats.dropped_records}; zoomer.exporter.call.dropped)")
    spans_note = (f"{stats.dropped_queue} spans were lost on the way to the store (a full export queue: "
                  f"{stats.dropped_queue}; otel.sdk.exporter.span.exported with error.type)")
    assert report.notes == [calls_note, spans_note]
    text = _text(report)
    assert f"note: {calls_note}" in text and f"note: {spans_note}" in text

    parser = argparse.ArgumentParser()
    report_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["report", "--store", str(collector.store_path), "--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["export_losses"] == {"spans": {"queue_full": stats.dropped_queue},
                                    "calls": {"queue_full": stats.dropped_records}}
    assert out["total_requests"] == sent - stats.dropped_records and out["notes"] == [calls_note, spans_note]

    doc = analyze([], collector.store_path).to_dict()  # analyze --store --json
    assert doc["store"]["export_losses"] == out["export_losses"]
    assert doc["store"]["notes"] == [calls_note, spans_note]
    from zoomer_serve.analysis import cli as analysis_cli

    parser = argparse.ArgumentParser()
    analysis_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["analyze", "--store", str(collector.store_path)])
    assert args.func(args) == 0
    terminal = " ".join(capsys.readouterr().out.split())
    assert f"note: {calls_note}" in terminal and f"note: {spans_note}" in terminal


def test_a_store_that_holds_only_lost_calls_says_so_beside_no_requests_recorded(tmp_path):
    """A store whose processes lost every call on the way (here a process's exporter counted 12 calls dropped on
    a full queue, and 12 spans; the store holds those counters and no call nor span). The report printed "no
    requests recorded" and stopped there: nothing said that calls had been made and lost. Now it says so, as
    for a store with requests, but without "the counts above" (there are none); ``report --json`` and
    ``analyze --store`` give the same counts."""
    with running_collector(tmp_path) as collector:
        exporter = OTLPMetricExporter(endpoint=f"127.0.0.1:{collector.grpc_port}", insecure=True)
        provider = MeterProvider(metric_readers=[PeriodicExportingMetricReader(
            exporter, export_interval_millis=3_600_000)], resource=Resource.create({"service.name": "svc"}))
        meter = provider.get_meter("zoomer_serve")
        meter.create_counter("zoomer.exporter.call.dropped", unit="{call}").add(12, {"error.type": "queue_full"})
        meter.create_counter("otel.sdk.exporter.span.exported", unit="{span}").add(12, {"error.type": "queue_full"})
        provider.shutdown()

    report = build_report(tmp_path / "store.duckdb")
    assert report.empty and report.total_requests == 0
    assert report.export_losses.calls == {"queue_full": 12} and report.export_losses.spans == {"queue_full": 12}
    calls_note = f"12 calls are missing from {DURATION} (a full export queue: 12; zoomer.exporter.call.dropped)"
    assert report.notes[0] == calls_note, report.notes
    text = _text(report)
    assert text.splitlines()[0] == "no requests recorded"
    assert f"note: {calls_note}" in text and "note: 12 spans were lost on the way to the store" in text
    doc = analyze([], tmp_path / "store.duckdb").to_dict()
    assert doc["store"]["notes"] == report.notes


def test_spans_made_with_the_opentelemetry_api_that_are_dropped_are_no_calls_missing(collector, monkeypatch):
    """The same full queue (``OTEL_BSP_MAX_QUEUE_SIZE=4``, 8 client threads), with a handler that makes a span of
    its own with the OpenTelemetry API in every call (``user.work``): a second record per call, a span and no call.
    The server counted every record it dropped as a call missing from ``rpc.server.call.duration``: of 1200 calls,
    124 in the metric and 2151 counted missing. Now only request records count as calls: calls sent = calls in the
    metric + calls counted missing (server counters and store), and spans sent (two per call) = spans stored +
    spans counted lost."""
    telemetry = _configure(collector, monkeypatch, OTEL_BSP_MAX_QUEUE_SIZE="4", OTEL_BSP_MAX_EXPORT_BATCH_SIZE="2")
    monkeypatch.setattr(grpc_echo, "_TRACER_PROVIDER", [telemetry.tracer_provider])
    sent = _load_8_threads(b"user_span")
    stats = zoomer_serve.shutdown()
    assert stats is not None and stats.dropped_records > stats.dropped_calls > 0, stats  # both kinds were dropped
    stored = len(collector.spans())  # (the collector stops: its store can be read)
    report = build_report(collector.store_path)
    assert report.export_losses.calls == {"queue_full": stats.dropped_calls}, (report.export_losses, stats)
    assert report.total_requests + stats.dropped_calls == sent, (report.total_requests, stats)
    assert stored + stats.dropped_queue == 2 * sent, (stored, stats)
