"""C03: the collector is down, or hangs, while requests keep coming, then the server stops. The export thread is
stuck retrying one request; the batches that arrive meanwhile wait in its queue. At shutdown every span the
worker received must end in a counter: exported, dropped (never sent), or unknown (in flight when the budget ran
out: it may or may not have arrived). Before, only the spans already encoded were counted; the batches still
queued behind the stuck export vanished (a demo server stopped after 4 s of load against a closed port counted
2 048 of about 5 400 spans)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
from _never_lost import note
from _scripted_otlp import loopback_export_config
from _scripted_otlp import request_records as _records

from zoomer_serve.config import ExportConfig
from zoomer_serve.export import ExportPipeline, ExportWorker
from zoomer_serve.recording import RequestRecorder

BATCH = 10


@pytest.fixture
def closed_port() -> int:
    """A loopback port nothing listens on: every connection is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def hung_port() -> Iterator[int]:
    """A loopback port that takes connections (the kernel's backlog) and never answers a byte."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield s.getsockname()[1]


def _config(protocol: str, port: int, **over: object) -> ExportConfig:
    return loopback_export_config(protocol, port, **{"timeout_ms": 4000, "max_export_batch_size": BATCH, **over})


def _stuck_worker(cfg: ExportConfig, batches: int) -> ExportWorker:
    """A started worker whose thread is sending (retrying) its first request while ``batches - 1`` more wait.
    Waits, without a fixed sleep, until that request is in flight (the worker's own count of it)."""
    worker = ExportWorker(cfg, {"service.name": "c03"})
    worker.start()
    worker.put(_records(BATCH))  # a full request: the thread sends it at once and gets stuck on it
    deadline = time.monotonic() + 30
    while worker._in_flight != BATCH and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker._in_flight == BATCH, "the first request never went out"
    for _ in range(batches - 1):
        worker.put(_records(BATCH))
    return worker


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_c03_batches_queued_behind_an_export_to_a_closed_port_are_counted_at_shutdown(protocol, closed_port):
    """C03: connections refused. The four batches queued behind the request being retried were never sent:
    dropped. That request is given up when the shutdown stops the retries, and counted as dropped by the export
    thread itself within the budget's last quarter (on a machine too busy to let it, it is counted unknown)."""
    worker = _stuck_worker(_config(protocol, closed_port), batches=5)
    stats = worker.shutdown(2.0)
    note("C03", f"collector down, export stuck at shutdown ({protocol})", 5 * BATCH, stats.exported,
         stats.dropped_export + stats.unknown)
    assert stats.exported == 0 and stats.dropped_export + stats.unknown == 5 * BATCH, stats
    assert stats.unknown in (0, BATCH), stats


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_c03_a_request_in_flight_to_a_hung_collector_is_unknown_and_the_rest_dropped(protocol, hung_port):
    """C03: the collector takes the connection and never answers. At the end of the budget the request in
    flight may yet arrive: its spans are ``unknown``, never claimed lost or delivered; the batches behind it
    are dropped. The shutdown returns within its budget plus about a second all the same."""
    worker = _stuck_worker(_config(protocol, hung_port), batches=5)
    start = time.monotonic()
    stats = worker.shutdown(0.5)
    assert time.monotonic() - start < 0.5 + 1.5
    note("C03", f"collector hung, a request in flight at shutdown ({protocol})", 5 * BATCH, stats.exported,
         stats.dropped_export + stats.unknown)
    assert (stats.exported, stats.dropped_export, stats.unknown) == (0, 4 * BATCH, BATCH), stats


@pytest.mark.parametrize("collector", ["closed", "hung"])
def test_c03_a_helper_process_counts_what_it_had_queued_when_the_budget_ran_out(collector, request):
    """C03 through the default path: a helper process whose export is stuck at shutdown reports every span the
    server handed it, as exported, dropped or unknown (a helper that answered after the server's deadline had
    its final counters read as a progress line, and the spans it had called unknown were counted nowhere; its
    settle time now lies inside the budget the server gives it)."""
    port = request.getfixturevalue(f"{collector}_port")
    cfg = _config("grpc", port, mode="process", max_queue_size=2048)
    pipeline = ExportPipeline(cfg, {"service.name": "c03"})
    pipeline.start()
    recorder = RequestRecorder(sink=pipeline.submit, otel_context=False)
    total = 0
    for _ in range(8):
        for _ in range(BATCH * 3):
            recorder.start("svc.S/M").end()
            total += 1
        assert pipeline.hand_off(timeout_s=5.0)
        time.sleep(0.1)
    stats = pipeline.shutdown(0.5)
    note("C03", f"collector {collector}, helper process stuck at shutdown", total, stats.exported,
         stats.dropped + stats.unknown)
    assert stats.exported == 0 and stats.dropped + stats.unknown == total, stats


def test_a_helper_answering_a_long_flush_keeps_reading_the_servers_frames(hung_port):
    """C03/C12: while the helper process answers a flush that cannot end soon (a hung collector), it goes on
    reading the server's frames, so the server's writes never wait for the flush (before, the helper read no
    frame until the flush was over: the pipe filled up, the server's writer blocked on it, and a server under
    load, as during a shutdown's flush, filled its queue and dropped records as "queue full")."""
    cfg = _config("grpc", hung_port, mode="process", timeout_ms=60_000, max_queue_size=4096)
    pipeline = ExportPipeline(cfg, {"service.name": "c03"})
    pipeline.start()
    recorder = RequestRecorder(sink=pipeline.submit, otel_context=False)
    recorder.start("svc.S/M").end()
    flushing = threading.Thread(target=pipeline.flush, args=(60.0,), daemon=True)
    flushing.start()
    deadline = time.monotonic() + 30
    while pipeline._flush_seq == 0 and time.monotonic() < deadline:  # the FLUSH frame is written
        time.sleep(0.01)

    def send() -> None:  # about 2 MB: many times what the pipe holds
        for _ in range(100):
            for _ in range(2):
                span = recorder.start("svc.S/M")
                span.set_attribute("payload", "x" * 10_000)
                span.end()
            pipeline.hand_off(timeout_s=60.0)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    sender.join(30)
    try:
        assert not sender.is_alive() and flushing.is_alive()  # every write went through, the flush goes on
    finally:
        pipeline.shutdown(0.5)
