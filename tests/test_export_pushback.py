"""C15: the backend pushes back. The export worker against a scripted OTLP receiver (a real grpc.server or
http.server on 127.0.0.1) follows the OTLP exporter specification: partial successes count their rejected
spans and points as dropped and log their message once, only retryable errors are retried, the server's retry
delay is honoured within the export timeout, requests refused for their size are split, and the exporter's own
counters say where every span went."""

from __future__ import annotations

import logging
import re
import threading
import time
from datetime import datetime, timezone

import grpc
import pytest
from _never_lost import note
from _scripted_otlp import Reply, ScriptedOtlp
from _scripted_otlp import request_records as _records

from zoomer_serve.config import ExportConfig
from zoomer_serve.export import ExportStats, ExportWorker
from zoomer_serve.export.transport import retry_after_s

PROTOCOLS = ["grpc", "http/protobuf"]


def _export(receiver: ScriptedOtlp, records: list[tuple], shutdown_s: float = 20.0, **cfg) -> ExportStats:
    worker = ExportWorker(receiver.export_config(**cfg), {"service.name": "c15"})
    worker.start()
    worker.put(records)
    return worker.shutdown(shutdown_s)


def _span_counters(receiver: ScriptedOtlp) -> dict[str, int]:
    """The ``otel.sdk.exporter.span.exported`` points of the last metrics request, by ``error.type``
    ("" for the exported spans)."""
    request = receiver.requests("metrics")[-1].request
    out = {}
    for metric in request.resource_metrics[0].scope_metrics[0].metrics:
        if metric.name == "otel.sdk.exporter.span.exported":
            for dp in metric.sum.data_points:
                attrs = {kv.key: kv.value.string_value for kv in dp.attributes}
                out[attrs.get("error.type", "")] = dp.as_int
    return out


def _warnings(caplog, needle: str) -> list[str]:
    return [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.WARNING and needle in rec.getMessage()]


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.slow
def test_partial_success_counts_rejected_spans_as_dropped_and_logs_its_message_once(protocol, caplog):
    """C15: two partial successes (3 and 2 spans rejected) of 100 spans in two requests: 95 exported, 5
    dropped as ``rejected``, nothing retried, the message logged once, the counters agree."""
    script = [Reply(rejected=3, message="spans older than 1h"), Reply(rejected=2, message="spans older than 1h")]
    with caplog.at_level(logging.WARNING, logger="zoomer_serve.export"), \
            ScriptedOtlp(protocol, traces=script) as receiver:
        stats = _export(receiver, _records(100), max_export_batch_size=50)
    assert [req.items for req in receiver.requests("traces")] == [50, 50]
    assert receiver.accepted("traces") == 95
    note("C15", f"partial success: the backend rejects 5 of 100 spans ({protocol})", 100,
         receiver.accepted("traces"), stats.dropped_rejected)
    assert (stats.exported, stats.dropped_export, stats.dropped_rejected) == (95, 5, 5)
    assert stats.exported + stats.dropped == 100
    assert len(_warnings(caplog, "spans older than 1h")) == 1
    assert _span_counters(receiver) == {"": 95, "rejected": 5, "export_failed": 0, "too_large": 0, "queue_full": 0,
                                       "helper_lost": 0}


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.slow
def test_metrics_partial_success_counts_rejected_points_and_logs_its_message_once(protocol, caplog):
    """C15: metric exports answered with ``rejected_data_points``: counted in the stats, logged once."""
    script = [Reply(rejected=4, message="point limit reached")] * 2
    with caplog.at_level(logging.WARNING, logger="zoomer_serve.export"), \
            ScriptedOtlp(protocol, metrics=script) as receiver:
        worker = ExportWorker(receiver.export_config(metric_export_interval_ms=100), {"service.name": "c15"})
        worker.start()
        worker.put(_records(10))
        assert len(receiver.wait_for("metrics", 2)) >= 2
        stats = worker.shutdown(20.0)
    requests = receiver.requests("metrics")
    points = sum(req.items for req in requests)
    assert stats.metric_points_rejected == 8
    assert stats.metric_points_exported == points - 8 == receiver.accepted("metrics")
    assert stats.metric_points_dropped == 8
    assert len(_warnings(caplog, "point limit reached")) == 1
    assert stats.exported == 10 and stats.dropped == 0


@pytest.mark.parametrize(("protocol", "reply"), [
    ("grpc", Reply(grpc_code="RESOURCE_EXHAUSTED", message="quota exceeded")),
    ("grpc", Reply(grpc_code="INVALID_ARGUMENT", message="bad data")),
    ("http/protobuf", Reply(http_status=400, message="bad data")),
])
@pytest.mark.slow
def test_an_error_that_is_not_retryable_is_sent_once_and_its_spans_are_counted(protocol, reply):
    """C15: RESOURCE_EXHAUSTED without RetryInfo is not retryable (nor are INVALID_ARGUMENT, HTTP 400): one
    request, every span counted as ``export_failed``."""
    with ScriptedOtlp(protocol, traces=[reply]) as receiver:
        stats = _export(receiver, _records(40))
    assert len(receiver.requests("traces")) == 1
    assert receiver.accepted("traces") == 0
    assert (stats.exported, stats.dropped_export) == (0, 40)
    assert _span_counters(receiver)["export_failed"] == 40
    assert reply.message in (stats.last_error or "")


@pytest.mark.parametrize(("protocol", "reply"), [
    ("grpc", Reply(grpc_code="RESOURCE_EXHAUSTED", retry_s=0.6)),
    ("grpc", Reply(grpc_code="UNAVAILABLE", retry_s=0.6)),
    ("http/protobuf", Reply(http_status=429, retry_s=1)),
    ("http/protobuf", Reply(http_status=503, retry_s=1)),
])
@pytest.mark.slow
def test_the_retry_delay_the_server_names_is_honoured(protocol, reply):
    """C15: RetryInfo (gRPC RESOURCE_EXHAUSTED or UNAVAILABLE) and Retry-After (HTTP 429, 503): the retry
    comes no sooner than the delay named (the default back-off would retry after 0.1 s), and succeeds."""
    with ScriptedOtlp(protocol, traces=[reply]) as receiver:
        stats = _export(receiver, _records(30))
    first, second = receiver.requests("traces")
    assert second.at - first.at >= reply.retry_s
    what = reply.grpc_code or f"HTTP {reply.http_status}"
    note("C15", f"backend pushes back ({what} with a {reply.retry_s} s retry delay): retried after it", 30,
         receiver.accepted("traces"), stats.dropped)
    assert receiver.accepted("traces") == 30
    assert (stats.exported, stats.dropped) == (30, 0)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.slow
def test_the_last_flush_at_shutdown_retries_within_its_budget(protocol):
    """C15: spans still pending at shutdown (no scheduled export came first) meet a throttled collector: the
    shutdown's own flush honours the delay within its budget instead of dropping them."""
    reply = Reply(grpc_code="UNAVAILABLE", http_status=503, retry_s=1)
    with ScriptedOtlp(protocol, traces=[reply]) as receiver:
        stats = _export(receiver, _records(15), shutdown_s=20.0, schedule_delay_ms=600_000)
    first, second = receiver.requests("traces")
    assert second.at - first.at >= 1
    assert (stats.exported, stats.dropped) == (15, 0)


@pytest.mark.parametrize(("protocol", "reply"), [
    ("grpc", Reply(grpc_code="UNAVAILABLE", retry_s=60)),
    ("grpc", Reply(grpc_code="RESOURCE_EXHAUSTED", retry_s=60)),
    ("http/protobuf", Reply(http_status=503, retry_s=60)),
])
@pytest.mark.slow
def test_a_retry_delay_past_the_export_timeout_gives_up_at_once_and_counts(protocol, reply):
    """C15: a delay that ends past the export timeout (2 s) is not waited for: the worker gives up at once
    (its counters say so long before the delay would end) and counts the spans as failed."""
    with ScriptedOtlp(protocol, traces=[reply]) as receiver:
        worker = ExportWorker(receiver.export_config(timeout_ms=2000), {"service.name": "c15"})
        worker.start()
        worker.put(_records(25))
        deadline = time.monotonic() + 30.0  # generous, and still half the delay the server asked for
        while worker.stats.dropped_export < 25 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.stats.dropped_export == 25
        stats = worker.shutdown(10.0)
    assert len(receiver.requests("traces")) == 1
    assert (stats.exported, stats.dropped_export) == (0, 25)
    assert "past the export timeout" in (stats.last_error or "")


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.slow
def test_a_request_refused_for_its_size_is_split_in_halves_and_a_span_too_large_alone_is_counted(protocol):
    """C15: a receiver that refuses requests over 50 kB (gRPC RESOURCE_EXHAUSTED "larger than max", HTTP
    413): the worker sends halves until they fit; every ordinary span arrives, the one 60 kB span is dropped
    and counted as ``too_large``."""
    records = _records(100, payload_bytes=2000)
    records[37:37] = _records(1, payload_bytes=60_000)
    with ScriptedOtlp(protocol, max_request_bytes=50_000) as receiver:
        stats = _export(receiver, records)
    sizes = [req.size for req in receiver.requests("traces")]
    assert sizes and max(sizes) <= 50_000
    assert receiver.accepted("traces") == 100
    note("C15", f"requests refused for their size (HTTP 413 / RESOURCE_EXHAUSTED, {protocol}): split", 101,
         receiver.accepted("traces"), stats.dropped_too_large)
    assert (stats.exported, stats.dropped_export, stats.dropped_too_large) == (100, 1, 1)
    assert _span_counters(receiver) == {"": 100, "too_large": 1, "export_failed": 0, "rejected": 0,
                                        "queue_full": 0, "helper_lost": 0}


def test_grpc_client_side_message_limit_splits_the_batch_too(monkeypatch):
    """C15: grpc's own client-side limit ("Sent message larger than max", RESOURCE_EXHAUSTED before anything
    is sent) is a size refusal like the server's: the batch is split and every span arrives."""
    real_channel = grpc.insecure_channel

    def limited_channel(target, options=None, compression=None):
        return real_channel(target, options=[*(options or ()), ("grpc.max_send_message_length", 40_000)],
                            compression=compression)

    monkeypatch.setattr(grpc, "insecure_channel", limited_channel)
    with ScriptedOtlp("grpc") as receiver:
        stats = _export(receiver, _records(60, payload_bytes=2000))
    sizes = [req.size for req in receiver.requests("traces")]
    assert len(sizes) >= 4 and max(sizes) <= 40_000
    assert receiver.accepted("traces") == 60
    assert (stats.exported, stats.dropped) == (60, 0)


def test_retry_after_reads_delay_seconds_and_http_dates():
    """C15: ``Retry-After`` is delay-seconds or an HTTP date (RFC 9110); a date in the past means now;
    anything else is ignored (the usual back-off applies)."""
    now = datetime(2026, 11, 3, 12, 0, 0, tzinfo=timezone.utc)
    assert retry_after_s("120") == 120.0
    assert retry_after_s(" 7 ") == 7.0
    assert retry_after_s("Tue, 03 Nov 2026 12:00:30 GMT", now=now) == 30.0
    assert retry_after_s("Tue, 03 Nov 2026 11:00:00 GMT", now=now) == 0.0
    assert retry_after_s("soon") is None
    assert retry_after_s("-5") is None
    assert retry_after_s(None) is None


@pytest.mark.slow
def test_an_http_date_retry_after_is_honoured():
    """C15: HTTP 429 with ``Retry-After`` as an HTTP date in the past: retried at once, and accepted."""
    with ScriptedOtlp("http/protobuf", traces=[Reply(http_status=429, retry_after="Wed, 21 Oct 2015 07:28:00 GMT")]
                      ) as receiver:
        stats = _export(receiver, _records(20))
    assert len(receiver.requests("traces")) == 2
    assert (stats.exported, stats.dropped) == (20, 0)



class _NotHttpFirst:
    """A TCP server on 127.0.0.1 that reads each request, then answers the first ``bad`` with ``reply`` (a line
    that is not HTTP, as an OTLP/gRPC port or another service sends back, or half a status line) and closes;
    later ones get ``HTTP/1.1 200`` with an empty body (an OTLP/HTTP success). Counts the requests it accepted."""

    def __init__(self, bad: int, reply: bytes) -> None:
        import socket

        self.bad, self.reply, self.accepted = bad, reply, 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                if not self._read_request(conn):
                    continue
                if self.bad > 0:
                    self.bad -= 1
                    conn.sendall(self.reply)
                else:
                    self.accepted += 1
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\n"
                                 b"Connection: close\r\n\r\n")

    @staticmethod
    def _read_request(conn) -> bool:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return False
            data += chunk
        head, body = data.split(b"\r\n\r\n", 1)
        length = int(re.search(rb"(?i)content-length:\s*(\d+)", head).group(1))
        while len(body) < length:
            body += conn.recv(65536)
        return True

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("reply", [b"SSH-2.0-OpenSSH_9.6\r\n", b"HTTP/1.1 2"])
@pytest.mark.slow
def test_an_http_endpoint_that_answers_with_no_http_is_retried_and_counted_never_fatal(reply, caplog):
    """An OTLP/HTTP export whose connection answers a line that is not HTTP (the OTLP/gRPC port, another
    service) or a cut status line: the export worker retries it like a refused connection and goes on
    exporting (it used to die with the error, and every later span waited for shutdown). A server that never
    answers HTTP: the spans are counted as failed, with an error that says what came back."""
    server = _NotHttpFirst(bad=1, reply=reply)
    try:
        cfg = dict(protocol="http/protobuf", mode="thread", timeout_ms=5_000, schedule_delay_ms=50,
                   traces_endpoint=f"http://127.0.0.1:{server.port}/v1/traces",
                   metrics_endpoint=f"http://127.0.0.1:{server.port}/v1/metrics")
        worker = ExportWorker(ExportConfig(**cfg), {"service.name": "c15"})
        worker.start()
        worker.put(_records(20))
        deadline = time.monotonic() + 10
        while worker.stats.exported < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.stats.exported == 20  # retried while running, not left for shutdown
        worker.put(_records(5))
        stats = worker.shutdown(10)
        assert (stats.exported, stats.dropped) == (25, 0)
    finally:
        server.close()
    never = _NotHttpFirst(bad=10**9, reply=reply)
    try:
        cfg.update(traces_endpoint=f"http://127.0.0.1:{never.port}/v1/traces",
                   metrics_endpoint=f"http://127.0.0.1:{never.port}/v1/metrics", timeout_ms=1_000)
        worker = ExportWorker(ExportConfig(**cfg), {"service.name": "c15"})
        worker.start()
        worker.put(_records(7))
        stats = worker.shutdown(5)
    finally:
        never.close()
    assert (stats.exported, stats.dropped_export) == (0, 7)
    assert "not an OTLP/HTTP answer" in (stats.last_error or ""), stats.last_error
