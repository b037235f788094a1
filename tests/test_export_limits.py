"""Oversized data and a dying export helper (C14): limits per OpenTelemetry's span-limit variables, bounded frames,
and an export that never stops for good; counted against what the real embedded collector stored."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from concurrent import futures
from typing import Any

import duckdb
import grpc
import pytest
from _never_lost import note

import zoomer_serve
from interceptors import ZoomerServerInterceptor
from zoomer_serve import current_request, phase
from zoomer_serve.export import rpc_metrics

MB = 1_000_000


def _handler(request: bytes, context: Any) -> bytes:
    cmd, _, arg = request.partition(b":")
    if cmd == b"raise":
        raise ValueError(("boom " * (int(arg) // 5 + 1))[: int(arg)])
    if cmd == b"odd":  # values and keys no OTLP reader takes as they are
        span = current_request()
        assert span is not None
        span.set_attribute("my.bigint", 2**70)
        span.set_attribute("my.list", [1, 2**64])
        span.set_attribute(7, "an int key")
        with phase(123):
            pass
        return request
    if cmd == b"huge":  # an attribute and an event of arg bytes each, and a phase: one record over a frame
        span = current_request()
        assert span is not None
        span.set_attribute("my.huge", "A" * int(arg))
        span.add_event("my.huge.event", {"v": "B" * int(arg)})
        with phase("huge.work"):
            pass
        return b"huge"
    if cmd == b"attrs":
        span = current_request()
        assert span is not None
        for i in range(200):
            span.set_attribute(f"big.{i}", "v" * 10_000)
    return request


def _serve(recorder: Any) -> tuple[grpc.Server, int]:
    generic = grpc.method_handlers_generic_handler("t.Big", {"Call": grpc.unary_unary_rpc_method_handler(_handler),
                                                                 "Huge": grpc.unary_unary_rpc_method_handler(_handler)})
    server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=[ZoomerServerInterceptor(recorder=recorder)])
    server.add_generic_rpc_handlers((generic,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


@pytest.mark.slow
def test_bursts_of_huge_exceptions_and_attributes_never_stop_export(collector, monkeypatch):
    """C14: handlers raise exceptions with 100 KB and 1 MB messages in bursts, and set 200 attributes of 10 KB,
    between ordinary calls: every call has its span (the ordinary ones before and after the burst too); exception
    text is bounded by default (ZOOMER_EXCEPTION_VALUE_LENGTH_LIMIT), attribute values and counts by the
    OpenTelemetry limits set in the environment; nothing was dropped."""
    monkeypatch.setenv("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "1000")
    telemetry = zoomer_serve.configure(service_name="big", endpoint=collector.grpc_endpoint, schedule_delay_ms=200,
                                       timeout_ms=10_000, set_global_providers=False)
    server, port = _serve(telemetry.recorder)
    sent = {"ok": 0, "raise": 0, "attrs": 0}
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/t.Big/Call")

            def ordinary(n: int) -> None:
                for _ in range(n):
                    call(b"ok", timeout=30)
                    sent["ok"] += 1

            ordinary(30)
            for size in (100_000, MB) * 10:
                try:
                    call(f"raise:{size}".encode(), timeout=30)
                except grpc.RpcError as err:  # grpc sends the message as a trailer: a long one exceeds the
                    assert err.code() in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.RESOURCE_EXHAUSTED)  # client's limit
                sent["raise"] += 1
                ordinary(2)
            for _ in range(10):
                call(b"attrs", timeout=30)
                sent["attrs"] += 1
            ordinary(30)
    finally:
        server.stop(None)
    stats = zoomer_serve.shutdown()
    assert stats is not None and stats.dropped == 0 and stats.unknown == 0, stats
    spans = collector.spans("SERVER")
    note("C14", "bursts of 100 KB / 1 MB exceptions and 200 x 10 KB attributes among ordinary calls",
         sum(sent.values()), len(spans), stats.dropped)
    assert len(spans) == sum(sent.values())
    errors = [s for s in spans if s["status_code"] == "ERROR"]
    assert len(errors) == sent["raise"]
    for span in errors:
        (event,) = [e for e in span["events"] if e["name"] == "exception"]
        assert len(event["attributes"]["exception.message"]) <= 1000  # the value length limit, when lower
        assert len(span["status_message"]) <= 8192 + 100
    big = [s for s in spans if any(k.startswith("big.") for k in s["attributes"])]
    assert len(big) == sent["attrs"]
    for span in big:
        assert len(span["attributes"]) == 128  # OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT's default
        assert all(len(v) <= 1000 for v in span["attributes"].values() if isinstance(v, str))


def _last_counts(collector: Any, metric: str) -> dict[tuple[str, str], int]:
    """``metric``'s count per (method, status code): the last cumulative point of each attribute set."""
    counts: dict[tuple[str, str], int] = {}
    for p in collector.metric_points(metric):
        key = (p["attributes"]["rpc.method"], p["attributes"]["rpc.response.status_code"])
        counts[key] = max(counts.get(key, 0), p["count"])
    return counts


@pytest.mark.slow
def test_a_call_whose_span_is_too_large_for_a_frame_loses_its_span_only_and_stays_in_the_rpc_metrics(
        collector, monkeypatch, caplog):
    """C14: handlers set a 5 MB and a 10 MB attribute plus an event as large, so their records are over a frame
    to the export helper (8 MiB): the record was dropped whole, and with it the call from
    ``rpc.server.call.duration`` (the report showed no such call at all). Now the span (and its phase) is
    dropped and counted as too large, and the call is still counted, with its method and status, in the call
    duration and request / response size histograms; nothing is logged as missing from the RPC metrics."""
    monkeypatch.setenv("OTEL_SEMCONV_STABILITY_OPT_IN", "rpc/dup")  # the size histograms too
    telemetry = zoomer_serve.configure(service_name="huge", endpoint=collector.grpc_endpoint,
                                       schedule_delay_ms=200, timeout_ms=20_000, set_global_providers=False)
    server, port = _serve(telemetry.recorder)
    ordinary, huge = 12, 4
    with caplog.at_level(logging.WARNING, logger="zoomer_serve"):
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                call, big = channel.unary_unary("/t.Big/Call"), channel.unary_unary("/t.Big/Huge")
                for i in range(ordinary):
                    assert call(b"ok", timeout=30) == b"ok"
                    if i % 3 == 0 and i // 3 < huge:
                        assert big(f"huge:{(5 if i % 2 else 10) * MB}".encode(), timeout=60) == b"huge"
        finally:
            server.stop(None)
        stats = zoomer_serve.shutdown()
    assert stats is not None
    spans = collector.spans()
    note("C14", "spans over a frame to the export helper (5 and 10 MB attribute and event) among ordinary calls",
         ordinary + huge, len(spans), stats.dropped_record_too_large, unit="spans (calls all in the metrics)")
    assert sorted(s["name"] for s in spans) == ["t.Big/Call"] * ordinary
    expected = {("t.Big/Call", "OK"): ordinary, ("t.Big/Huge", "OK"): huge}
    assert _last_counts(collector, "rpc.server.call.duration") == expected
    assert _last_counts(collector, "rpc.server.request.size") == expected
    assert _last_counts(collector, "rpc.server.response.size") == expected
    assert (stats.dropped_record_too_large, stats.dropped_records, stats.dropped) == (2 * huge, 0, 2 * huge), stats
    points = collector.metric_points("otel.sdk.exporter.span.exported")
    assert max(p["value"] for p in points if p["attributes"] == {"error.type": "too_large"}) == 2 * huge
    assert max(p["value"] for p in points if not p["attributes"]) == ordinary
    logged = caplog.text
    assert "missing from the RPC metrics" not in logged and "did not reach the exporter" not in logged, logged


@pytest.mark.slow
def test_an_int_past_int64_or_a_key_that_is_no_string_loses_no_span_of_the_batch(collector):
    """C14: one handler set ``2**70`` (and an int key, and a phase named 123) among 20 ordinary calls: the export
    request that held it was refused whole by the collector ("Wire format was corrupt"), 0 of 21 stored, or the
    record was lost to the encoder. Now every call's span is stored, the odd values as their strings."""
    telemetry = zoomer_serve.configure(service_name="odd", endpoint=collector.grpc_endpoint, schedule_delay_ms=60_000,
                                       timeout_ms=10_000, set_global_providers=False)
    server, port = _serve(telemetry.recorder)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/t.Big/Call")
            for i in range(21):  # one export request: the schedule delay is longer than the test
                call(b"odd" if i == 10 else b"ok", timeout=30)
    finally:
        server.stop(None)
    stats = zoomer_serve.shutdown()
    assert stats is not None and stats.dropped == 0 and stats.unknown == 0, stats
    spans = collector.spans("SERVER")
    note("C14", "an int past int64, an int attribute key and a phase named 123 among 20 ordinary calls",
         21, len(spans), stats.dropped)
    assert len(spans) == 21
    (odd,) = [s for s in spans if "my.bigint" in s["attributes"]]
    assert odd["attributes"]["my.bigint"] == str(2**70) and odd["attributes"]["my.list"] == [1, str(2**64)]
    assert odd["attributes"]["7"] == "an int key"
    assert [s["name"] for s in collector.spans("INTERNAL") if s["parent_span_id"] == odd["span_id"]] == ["123"]


def test_exception_text_is_bounded_by_default_keeping_the_end_of_the_stack(collector):
    """C14: with no limit set, an exception's message and stack trace are still bounded (8192 characters by
    default); the stack trace keeps its end, where the exception and its innermost frame are."""
    telemetry = zoomer_serve.configure(service_name="exc", endpoint=collector.grpc_endpoint, schedule_delay_ms=200,
                                       set_global_providers=False)
    server, port = _serve(telemetry.recorder)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                channel.unary_unary("/t.Big/Call")(f"raise:{MB}".encode(), timeout=30)
            except grpc.RpcError:
                pass
    finally:
        server.stop(None)
    (span,) = collector.spans("SERVER")
    (event,) = span["events"]
    message, stack = event["attributes"]["exception.message"], event["attributes"]["exception.stacktrace"]
    assert message.startswith("boom boom") and len(message) < 8192 + 100 and "characters cut" in message
    assert len(stack) < 8192 + 100 and "ValueError: boom boom" in stack and "in _handler" in stack


@pytest.mark.slow
def test_a_killed_helper_is_started_again_and_what_it_took_is_counted(collector):
    """C14: the export helper process is killed (OOM killer, ``kill -9``) with spans in it: the server starts a
    new one, later spans arrive, and the spans the dead one took are counted (``lost_in_helper``), never
    silently gone: stored + counted as lost = sent."""
    telemetry = zoomer_serve.configure(service_name="phoenix", endpoint=collector.grpc_endpoint,
                                       schedule_delay_ms=60_000, set_global_providers=False)
    pipeline = telemetry.pipeline
    assert pipeline is not None
    first_helper = pipeline.helper_pid
    for _ in range(40):
        telemetry.recorder.start("before/kill").end()
    deadline = time.monotonic() + 30
    while pipeline.submitted < 40 and time.monotonic() < deadline:
        time.sleep(0.05)  # until the writer handed them to the helper (it wakes every 500 ms)
    assert pipeline.submitted == 40
    os.kill(first_helper, signal.SIGKILL)
    for _ in range(25):
        telemetry.recorder.start("after/kill").end()
    while pipeline.helper_pid in (None, first_helper) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pipeline.helper_pid not in (None, first_helper)
    stats = zoomer_serve.shutdown()
    assert stats is not None
    stored = collector.spans()
    names = {s["name"] for s in stored}
    assert sum(s["name"] == "after/kill" for s in stored) == 25
    assert stats.helper_restarts == 1
    note("C14", "export helper process killed (kill -9) holding spans", 65, len(stored), stats.lost_in_helper)
    assert len(stored) + stats.lost_in_helper == 65, (len(stored), stats)
    assert stats.lost_in_helper == 40 and names == {"after/kill"}


def _call_n(port: int, n: int) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary("/t.Big/Call")
        for _ in range(n):
            assert call(b"ok", timeout=30) == b"ok"


def _calls_dropped(collector: Any) -> dict[str, int]:
    """The store's ``zoomer.exporter.call.dropped`` counts by ``error.type``, non-zero ones: the largest point of
    each (cumulative over the process's life: each helper's series carries the counts of those before it)."""
    out: dict[str, int] = {}
    for p in collector.metric_points(rpc_metrics.CALL_DROPPED):
        kind = p["attributes"]["error.type"]
        out[kind] = max(out.get(kind, 0), int(p["value"]))
    return {k: v for k, v in out.items() if v}


def _metered(collector: Any) -> tuple[Any, Any, Any]:
    """Telemetry exporting to ``collector`` whose spans and RPC metrics go out only when flushed (600 s
    schedule delay and interval: a killed helper takes both with it, and the report cannot count its calls by their
    spans either): ``(telemetry, pipeline, helper)``, the helper process running."""
    telemetry = zoomer_serve.configure(service_name="metered", endpoint=collector.grpc_endpoint,
                                       schedule_delay_ms=600_000, metric_export_interval_ms=600_000,
                                       set_global_providers=False)
    pipeline = telemetry.pipeline
    assert pipeline is not None and pipeline._helper is not None
    return telemetry, pipeline, pipeline._helper


def _wait_handed_over(helper: Any, records: int) -> None:
    """Wait until the writer has handed ``records`` records in all to ``helper`` (it wakes every 500 ms)."""
    deadline = time.monotonic() + 30
    while helper.sent_records < records and time.monotonic() < deadline:
        time.sleep(0.05)
    assert helper.sent_records == records


def _calls_in_metric(collector: Any) -> int:
    """Calls in the store's ``rpc.server.call.duration`` (as the report counts them)."""
    from zoomer_serve.report.calls import read_calls

    con = duckdb.connect(str(collector.store_path), read_only=True)
    try:
        return sum(c.calls for c in read_calls(con).values())
    finally:
        con.close()


def test_calls_a_killed_helper_aggregated_are_counted_missing_from_the_call_metric(collector):
    """C14, the calls: a real gRPC server's export helper process is killed (``kill -9``) after one export of the
    RPC metrics (30 calls) and holding 40 more calls it had aggregated but not exported in any metric export
    (``OTEL_METRIC_EXPORT_INTERVAL`` is long); 25 calls go through the helper started again. The trial: those 40
    calls were gone from ``rpc.server.call.duration`` and nothing said so. Now the server counts them
    (``records_lost_in_helper``, from the helper's last ``metric_records``), the new helper exports them as
    ``zoomer.exporter.call.dropped{error.type=helper_lost}``, and the report says so: calls sent = calls in the
    metric + calls counted missing, in the server's counters and in the store."""
    from zoomer_serve.report import build_report

    telemetry, pipeline, helper = _metered(collector)
    server, port = _serve(telemetry.recorder)
    try:
        _call_n(port, 30)
        assert pipeline.flush(30.0)  # the metrics export: the collector holds these 30 calls
        assert helper.counters["metric_records"] == 30
        _call_n(port, 40)
        _wait_handed_over(helper, 70)
        deadline = time.monotonic() + 30
        os.kill(helper.pid, signal.SIGKILL)
        _call_n(port, 25)
        while pipeline.helper_pid in (None, helper.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pipeline.helper_pid not in (None, helper.pid)
    finally:
        server.stop(None)
    stats = zoomer_serve.shutdown()
    assert stats is not None and stats.helper_restarts == 1, stats
    collector.finish()
    in_metric = _calls_in_metric(collector)
    dropped = _calls_dropped(collector)
    sent = 95
    note("C14", "calls of a killed export helper, in the metric or counted missing", sent, in_metric,
         sum(dropped.values()), unit="calls")
    assert (in_metric, dropped) == (30 + 25, {"helper_lost": 40}), (in_metric, dropped)
    assert in_metric + sum(dropped.values()) == sent
    assert stats.records_lost_in_helper == 40 and stats.dropped_records == 0, stats
    report = build_report(collector.store_path)  # what zoomer-serve report says
    assert report.total_requests == 55 and report.export_losses.calls == {"helper_lost": 40}
    assert any(n.startswith("40 calls are missing from rpc.server.call.duration") and "helper process died" in n
               for n in report.notes), report.notes


def test_calls_of_a_helper_killed_just_before_shutdown_are_counted_missing(collector):
    """C14, with no call after the kill: the export helper is killed (``kill -9``) holding 20 calls it had not
    exported in a metric export, and the server shuts down without writing to it again. Those calls are counted
    missing from the RPC metrics at shutdown (and logged); the store's metric holds the 30 of the export before:
    30 + 20 = the 50 calls sent. The store said nothing of the 20 (no helper ran to export the loss counters):
    now the shutdown starts one for them, and the store has them as ``zoomer.exporter.call.dropped``, with the
    20 spans the killed helper held as ``helper_lost``."""
    from zoomer_serve.report import build_report

    telemetry, pipeline, helper = _metered(collector)
    server, port = _serve(telemetry.recorder)
    try:
        _call_n(port, 30)
        assert pipeline.flush(30.0)
        _call_n(port, 20)
        _wait_handed_over(helper, 50)
        os.kill(helper.pid, signal.SIGKILL)
    finally:
        server.stop(None)
    stats = zoomer_serve.shutdown()
    assert stats is not None
    note("C14", "calls of an export helper killed just before shutdown", 50, 30, stats.records_lost_in_helper,
         unit="calls")
    assert stats.records_lost_in_helper == 20 and stats.lost_in_helper == 20 and stats.helper_restarts == 1, stats
    collector.finish()
    assert _calls_in_metric(collector) == 30
    assert _calls_dropped(collector) == {"helper_lost": 20}
    report = build_report(collector.store_path)
    assert report.export_losses.calls == {"helper_lost": 20} and report.export_losses.spans == {"helper_lost": 20}


def test_a_helper_reports_its_exports_without_being_asked_so_killing_it_after_counts_nothing_lost(collector):
    """C14, the other side: the helper's export thread reports its counters (a ``progress`` line) after the turn
    of its loop that exported, with no flush asked for and no thread of its own waking every second. A helper
    killed after that took nothing with it: all spans are stored and none is counted as lost in it."""
    telemetry = zoomer_serve.configure(service_name="reported", endpoint=collector.grpc_endpoint,
                                       schedule_delay_ms=200, set_global_providers=False)
    pipeline = telemetry.pipeline
    assert pipeline is not None and pipeline._helper is not None
    helper = pipeline._helper
    for _ in range(30):
        telemetry.recorder.start("reported/span").end()
    deadline = time.monotonic() + 30
    while helper.counters.get("exported", 0) < 30 and time.monotonic() < deadline:
        time.sleep(0.05)  # the writer hands them over (500 ms), the worker exports (200 ms), then reports
    assert helper.counters["exported"] == 30 and helper.counters["records"] == 30
    assert helper.unreported_spans() == 0
    os.kill(helper.pid, signal.SIGKILL)
    stats = zoomer_serve.shutdown()
    assert stats is not None
    assert stats.lost_in_helper == 0
    assert len(collector.spans()) == 30


def _phased_handler(calls: list[int]) -> Any:
    """A handler that records two phases (three spans a call) and counts its calls (server side)."""

    def handle(request: bytes, context: Any) -> bytes:
        with phase("preprocess"):
            pass
        with phase("forward"):
            pass
        calls.append(1)  # list.append is atomic: handlers run on several threads
        return request

    return handle


def _kill_helper_under_load(collector: Any) -> tuple[int, int, Any]:
    """A real gRPC server under continuous load from 4 client threads; the export helper is killed (``kill -9``)
    half a second after one of its progress lines arrived (mid-export: it exports every 100 ms). Returns (spans
    the server recorded, spans the collector stored, the final counters)."""
    telemetry = zoomer_serve.configure(service_name="killed-under-load", endpoint=collector.grpc_endpoint,
                                       schedule_delay_ms=100, set_global_providers=False)
    pipeline = telemetry.pipeline
    assert pipeline is not None and pipeline._helper is not None
    helper = pipeline._helper
    calls: list[int] = []
    generic = grpc.method_handlers_generic_handler(
        "t.Load", {"Call": grpc.unary_unary_rpc_method_handler(_phased_handler(calls))})
    server = grpc.server(futures.ThreadPoolExecutor(8),
                         interceptors=[ZoomerServerInterceptor(recorder=telemetry.recorder)])
    server.add_generic_rpc_handlers((generic,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stop = threading.Event()
    failures: list[BaseException] = []

    def load() -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/t.Load/Call")
            while not stop.is_set():
                try:
                    call(b"x", timeout=30)
                except grpc.RpcError as exc:  # pragma: no cover - reported below
                    failures.append(exc)

    clients = [threading.Thread(target=load) for _ in range(4)]
    try:
        for t in clients:
            t.start()
        deadline = time.monotonic() + 30
        while helper.counters.get("exported", 0) < 500 and time.monotonic() < deadline:
            time.sleep(0.01)  # exports are flowing and reported
        last = helper.counters
        while helper.counters == last and time.monotonic() < deadline:
            time.sleep(0.005)  # a progress line just came ...
        time.sleep(0.5)  # ... and the helper kept exporting since
        os.kill(helper.pid, signal.SIGKILL)
        while pipeline.helper_pid in (None, helper.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # load goes on through the new helper
    finally:
        stop.set()
        for t in clients:
            t.join()
        server.stop(None)
    assert not failures, failures[:3]
    stats = zoomer_serve.shutdown()
    assert stats is not None and stats.helper_restarts == 1, stats
    return 3 * len(calls), len(collector.spans()), stats


@pytest.mark.slow
def test_a_helper_killed_under_load_is_never_counted_as_losing_what_it_exported(collector):
    """C14: a real gRPC server under continuous load, its export helper killed (``kill -9``) mid-export. The
    server counted every span the dead helper had not yet reported as lost, also those it had already exported
    (the trial: 476 spans missing from the store, 5596 counted as lost). Now the spans it reported are never
    counted, those of the export request it was sending are ``unknown`` (the collector may have stored them), and
    only the rest is counted as lost. Every span has one outcome (exported + lost + unknown = sent), and the store
    agrees: lost <= sent - stored <= lost + unknown.
    """
    sent, stored, stats = _kill_helper_under_load(collector)
    note("C14", "export helper process killed (kill -9) under load", sent, stored, stats.dropped)
    assert stats.exported + stats.dropped + stats.unknown == sent, (sent, stored, stats)
    assert stats.exported <= stored <= stats.exported + stats.unknown, (sent, stored, stats)
    assert stats.dropped <= sent - stored, (sent, stored, stats)  # never counts as lost what was stored
    assert sent - stored <= stats.dropped + stats.unknown, (sent, stored, stats)
