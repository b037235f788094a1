"""What the collector acknowledged survives: SIGKILL (C17) and being stopped by the signals a terminal, an
orchestrator or an init system send (C12), for a real ``zoomer-serve collector`` process fed over real OTLP
(gRPC and HTTP) by concurrent exporters that record every acknowledged span and metric point."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import grpc
import pytest
from _collector_process import SIGNALS, AckedExporter, CollectorProcess, start_collector, stored_names
from _never_lost import note

from zoomer_serve.collector import open_readonly

EXPORTERS = (("grpc", 2), ("http", 2))  # transport, threads


def _export_until(collector: CollectorProcess, exporter: AckedExporter, stop: threading.Event,
                  enough: threading.Event, acks_wanted: int) -> list[threading.Thread]:
    """Start exporter threads that send until ``stop``; ``enough`` is set right after the acknowledgement
    that brings the count of acknowledged trace exports to ``acks_wanted``."""

    def loop(transport: str) -> None:
        channel = grpc.insecure_channel(f"127.0.0.1:{collector.grpc_port}") if transport == "grpc" else None
        try:
            while not stop.is_set():
                ok = exporter.export_once(transport, channel)
                if ok and len(exporter.acked_spans) >= acks_wanted * exporter.spans_per_request:
                    enough.set()
                if not ok and not stop.is_set() and collector.proc.poll() is not None:
                    return
        finally:
            if channel is not None:
                channel.close()

    threads = [threading.Thread(target=loop, args=(t,), daemon=True) for t, n in EXPORTERS for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def _stored(store: Path) -> tuple[set[str], set[str]]:
    con = open_readonly(store)
    try:
        return stored_names(con)
    finally:
        con.close()


def test_sigkill_keeps_every_acknowledged_span_and_point(tmp_path: Path) -> None:
    """C17: the collector is killed (SIGKILL) right after an acknowledgement while exporters keep sending;
    started again on the same store, it opens cleanly and holds every acknowledged span and metric point."""
    store = tmp_path / "killed.duckdb"
    collector = start_collector(store)
    exporter = AckedExporter(collector.grpc_port, collector.http_port)
    stop, enough = threading.Event(), threading.Event()
    try:
        threads = _export_until(collector, exporter, stop, enough, acks_wanted=40)
        assert enough.wait(120), f"only {len(exporter.acked_spans)} spans acknowledged"
        collector.proc.kill()  # SIGKILL, exporters still sending
        collector.proc.wait(30)
        stop.set()
        for t in threads:
            t.join(60)
    finally:
        stop.set()
        collector.kill()
    acked_spans, acked_points = set(exporter.acked_spans), set(exporter.acked_points)
    assert len(acked_spans) >= 40 * exporter.spans_per_request and acked_points

    # Started again on the same store: it opens (DuckDB replays its log), serves, and stops cleanly.
    again = start_collector(store)
    try:
        again.signal_pid(signal.SIGTERM)
        code, _, err = again.wait()
    finally:
        again.kill()
    assert code == 0, err
    spans, points = _stored(store)
    note("C17", "embedded collector killed (kill -9) while exporters send: acknowledged spans",
         len(acked_spans), len(acked_spans & spans))
    note("C17", "embedded collector killed (kill -9) while exporters send: acknowledged metric points",
         len(acked_points), len(acked_points & points), unit="points")
    assert acked_spans - spans == set(), f"{len(acked_spans - spans)} acknowledged spans lost"
    assert acked_points - points == set(), f"{len(acked_points - points)} acknowledged points lost"
    assert spans <= exporter.sent_spans  # nothing invented, and each span once:
    con = open_readonly(store)
    try:
        assert con.execute("SELECT count(*) = count(DISTINCT name) FROM spans").fetchone() == (True,)
    finally:
        con.close()


@pytest.mark.parametrize("how", list(SIGNALS))
@pytest.mark.slow
def test_stopped_by_signal_keeps_everything_acknowledged(tmp_path: Path, how: str) -> None:
    """C12: ``zoomer-serve collector`` stopped by Ctrl+C (SIGINT to its process group), SIGTERM to its pid,
    or SIGTERM to its process group while exporters are sending: exit 0, no traceback, a ``stopped`` line
    whose counters match the store, and every acknowledged span and metric point in the store."""
    sig, group = SIGNALS[how]
    store = tmp_path / f"{how}.duckdb"
    collector = start_collector(store)
    exporter = AckedExporter(collector.grpc_port, collector.http_port)
    stop, enough = threading.Event(), threading.Event()
    try:
        threads = _export_until(collector, exporter, stop, enough, acks_wanted=20)
        assert enough.wait(120), f"only {len(exporter.acked_spans)} spans acknowledged"
        (collector.signal_group if group else collector.signal_pid)(sig)
        code, out, err = collector.wait()
        stop.set()
        for t in threads:
            t.join(60)
    finally:
        stop.set()
        collector.kill()
    assert code == 0, err
    assert "Traceback" not in err, err
    stopped = json.loads(out.strip().splitlines()[-1])
    assert stopped["event"] == "stopped"
    spans, points = _stored(store)
    note("C12", f"zoomer-serve collector, {how}: acknowledged spans", len(exporter.acked_spans),
         len(exporter.acked_spans & spans))
    assert exporter.acked_spans - spans == set(), f"{len(exporter.acked_spans - spans)} acknowledged spans lost"
    assert exporter.acked_points - points == set()
    assert spans <= exporter.sent_spans
    assert stopped["spans_received"] == len(spans) and stopped["metric_points_received"] == len(points)
    assert stopped["store_failed"] == 0 and stopped["store_queued"] == 0
