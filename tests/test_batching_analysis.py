"""Findings and report figures about batching: a real batching demo server whose delay is far too long for its load,
batches recorded through the real export pipeline, and a synthetic kernel trace of small batches."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from interceptors import ZoomerServerInterceptor
from zoomer_serve.analysis import analyze_store, analyze_trace
from zoomer_serve.batching import BatchRecorder, QueuedRequest
from zoomer_serve.demo.load import drive_load
from zoomer_serve.demo.model import build_model
from zoomer_serve.demo.service import ServiceConfig, build_server
from zoomer_serve.profiling.labels import batch_label, member_label
from zoomer_serve.report import build_report

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _finding_claims import check_finding, checked_ids

PREDICT = "zoomer.demo.v1.Ranker/Predict"


def _ids(findings: list[Any]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for f in findings:
        out.setdefault(f.id, []).append(f)
    return out


@pytest.mark.slow
def test_two_clients_cannot_fill_batches_of_eight_an_under_filled_finding_and_the_report_figures(collector,
                                                                                                     telemetry):
    """Two clients, one call at a time each, batches of up to 8 with a 50 ms delay: a batch never holds more than
    two requests and every one is cut by the delay, whatever the machine's speed."""
    server, port = build_server(build_model(device="cpu"), interceptors=[ZoomerServerInterceptor(telemetry.recorder)],
                                max_workers=4, config=ServiceConfig(batch_max_size=8, batch_max_delay_ms=50))
    try:
        result = drive_load(f"127.0.0.1:{port}", 60.0, clients=2, batch_size=8, max_requests=24, stream_share=0.0,
                            invalid_share=0.0)
    finally:
        server.stop(None).wait(5)
    assert result.unexpected == 0
    collector.finish()
    findings = analyze_store(collector.store_path)
    checked_ids(findings, gpu=False)
    found = _ids(findings)
    (under,) = found["batch.under-filled"]
    assert under.evidence["mean_fill"] <= 0.25 and under.evidence["max_size"] == 8
    assert under.evidence["cut_by_delay_share"] == 1.0 and under.evidence["max_delay_ms"] == 50.0
    assert under.scope == "test-svc ranker" and under.evidence["batches_count"] >= 12
    assert "batch.share-outlier" not in found  # all requests alike
    report = build_report(collector.store_path)
    (method,) = [m for m in report.methods if m.method == PREDICT]
    b = method.batching
    assert b is not None and b.requests == 24 and b.batches == under.evidence["batches_count"]
    assert b.mean_batch_size == 24 / b.batches
    assert 0 < b.queue_wait_p50_ms <= b.queue_wait_p99_ms and 0 < b.queue_wait_share < 1
    assert any(p.phase == "queue" for p in method.phases)


def test_requests_that_mostly_wait_for_their_batch_give_a_queue_wait_finding(collector, telemetry):
    """Requests enqueued 2 s before their batch starts (their spans start then too) and a batch that does nothing:
    the queue wait is all of their time."""
    rec = telemetry.recorder
    batching = BatchRecorder("slowfill", max_size=8, max_delay_ms=2000, recorder=rec)
    for _ in range(12):
        past = time.monotonic_ns() - 2_000_000_000
        spans = [rec.start("svc/Wait", start_mono_ns=past, attributes={"rpc.method": "svc/Wait"}) for _ in range(2)]
        tickets = [QueuedRequest(s, 1, past) for s in spans]
        with batching.begin(tickets, "delay"):
            pass
        for s in spans:
            s.end()
    collector.finish()
    (wait,) = _ids(analyze_store(collector.store_path))["batch.queue-wait"]
    check_finding(wait, gpu=False)
    assert wait.scope == "test-svc svc/Wait" and wait.severity == "high"
    assert wait.evidence["requests_count"] == 24 and wait.evidence["queue_wait_share"] > 0.9
    assert wait.evidence["cut_by_delay_share"] == 1.0 and wait.evidence["mean_fill"] == 0.25
    assert wait.evidence["queue_wait_p50_ms"] >= 2000


def _record_batches(telemetry: Any, sizes: list[list[tuple[str, int]]]) -> None:
    """One batch per entry of ``sizes`` (members as (method, items)), through the real recorder and export."""
    batching = BatchRecorder("mixed", max_size=8, max_delay_ms=2, recorder=telemetry.recorder)
    for members in sizes:
        spans = [telemetry.recorder.start(method, attributes={"rpc.method": method}) for method, _ in members]
        tickets = [batching.enqueue(items, span=s) for s, (_, items) in zip(spans, members)]
        with batching.begin(tickets, "full"):
            pass
        for s in spans:
            s.end()


@pytest.mark.slow
def test_one_request_type_dominating_the_batches_is_a_share_outlier(collector, telemetry):
    _record_batches(telemetry, [[("svc/Big", 60), ("svc/Small", 2), ("svc/Small", 2), ("svc/Small", 2)]] * 12)
    collector.finish()
    (outlier,) = _ids(analyze_store(collector.store_path))["batch.share-outlier"]
    check_finding(outlier, gpu=False)
    assert outlier.evidence["method"] == "svc/Big"
    assert abs(outlier.evidence["requests_share"] - 0.25) < 1e-9
    assert abs(outlier.evidence["time_share"] - 60 / 66) < 1e-6


def test_a_few_large_requests_of_one_method_are_share_outliers(collector, telemetry):
    batches = [[("svc/M", 2)] * 4] * 8 + [[("svc/M", 50)] + [("svc/M", 2)] * 3] * 4
    _record_batches(telemetry, batches)
    collector.finish()
    (outlier,) = _ids(analyze_store(collector.store_path))["batch.share-outlier"]
    check_finding(outlier, gpu=False)
    assert outlier.evidence["outliers_count"] == 4 and outlier.evidence["batched_requests_count"] == 48
    assert outlier.items[0]["items"] == 50


def _kernel(ts: float, dur: float, corr: int, grid: int, occ: float) -> dict[str, Any]:
    return {"ph": "X", "cat": "kernel", "name": "small_gemm", "ts": ts, "dur": dur, "pid": 0, "tid": 7,
            "args": {"correlation": corr, "device": 0, "stream": 7, "grid": [grid, 1, 1], "block": [128, 1, 1],
                     "est. achieved occupancy %": occ}}


def test_kernels_of_small_batches_in_small_grids_are_a_finding(tmp_path: Path):
    events: list[dict[str, Any]] = []
    for b in range(4):
        t0 = 1000.0 * b
        events.append({"ph": "X", "cat": "user_annotation", "name": batch_label(0xAB, 0x100 + b), "ts": t0,
                       "dur": 500, "pid": 1, "tid": 3, "args": {}})
        events.append({"ph": "X", "cat": "user_annotation", "name": member_label(0x100 + b, 0xC, 0xD + b, 8),
                       "ts": t0 + 1, "dur": 0, "pid": 1, "tid": 3, "args": {}})
        for j in range(3):
            corr = 10 * b + j + 1
            events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t0 + 10 + 50 * j,
                           "dur": 5, "pid": 1, "tid": 3, "args": {"correlation": corr}})
            events.append(_kernel(t0 + 20 + 50 * j, 30, corr, grid=16, occ=12.0))
    path = tmp_path / "small.json"
    path.write_text(json.dumps({"traceEvents": events, "deviceProperties": [{"id": 0, "numSms": 132}]}))
    report = analyze_trace(path)
    (small,) = [f for f in report.findings if f.id == "batch.small-for-gpu"]
    assert small.evidence["batches_count"] == 4 and small.evidence["kernels_count"] == 12
    assert small.evidence["small_grid_time_share"] == 1.0 and small.evidence["occupancy_pct"] == 12.0
    assert small.evidence["sm_count"] == 132
    check_finding(small)


STREAM = "zoomer.demo.v1.Ranker/PredictStream"


def test_a_stream_s_every_message_counts_in_the_batching_table_and_its_batches_match_the_finding(collector,
                                                                                                   telemetry):
    """Streams of 2-5 messages, each message batched on its own: the Batching table's messages are the ones the
    client sent, its batches the batch spans that link the stream's requests, its wait share the queue phase's
    total over the batched requests' time, and the service's batch count the under-filled finding's."""
    import duckdb

    server, port = build_server(build_model(device="cpu"), interceptors=[ZoomerServerInterceptor(telemetry.recorder)],
                                max_workers=4, config=ServiceConfig(batch_max_size=8, batch_max_delay_ms=10))
    try:
        result = drive_load(f"127.0.0.1:{port}", 60.0, clients=2, batch_size=8, max_requests=24, stream_share=0.5,
                            invalid_share=0.0)
    finally:
        server.stop(None).wait(5)
    assert result.unexpected == 0 and result.stream_messages > result.count(method="PredictStream")
    collector.finish()
    con = duckdb.connect(str(collector.store_path), read_only=True)
    try:
        links = con.execute("SELECT span_id, CAST(links AS VARCHAR) FROM spans WHERE name = 'process ranker'").fetchall()
        requests = dict(con.execute("SELECT span_id, attributes->>'$.\"rpc.method\"' FROM spans WHERE kind = 'SERVER'"
                                    ).fetchall())
    finally:
        con.close()
    truth: dict[str, set[str]] = {}
    for batch_id, raw in links:
        for link in json.loads(raw):
            method = requests[link["span_id"]]
            truth.setdefault(method.rsplit("/", 1)[-1], set()).add(batch_id)
    report = build_report(collector.store_path)
    (stream,) = [m for m in report.methods if m.method == STREAM]
    b = stream.batching
    assert b is not None and b.requests == stream.count
    assert b.messages == result.stream_messages  # every message, not each stream's last
    assert b.batches == len(truth["PredictStream"])
    (queue,) = [p for p in stream.phases if p.phase == "queue"]
    assert queue.count == b.messages
    assert abs(b.queue_wait_share - queue.share) < 1e-9  # every request of the method ran in batches here
    assert abs(b.queue_wait_mean_ms - queue.mean_ms) < 1e-6
    (total,) = [t for t in report.batching_totals if t.service_name == "test-svc"]
    assert total.batching.batches == len(truth["Predict"] | truth["PredictStream"]) == len(links)
    assert total.batching.messages == b.messages + next(m for m in report.methods if m.method == PREDICT).count
    (under,) = _ids(analyze_store(collector.store_path))["batch.under-filled"]
    assert under.evidence["batches_count"] == total.batching.batches


def test_a_stream_whose_every_message_waits_gives_the_queue_wait_finding_the_report_s_share(collector, telemetry):
    """20 streams of 3 messages, each message 100 ms in the queue, in requests of about 400 ms: 75 % of their time
    waits, though each stream's last message alone (its span attributes) would say 25 %, below the threshold."""
    rec = telemetry.recorder
    batching = BatchRecorder("streams", max_size=8, max_delay_ms=100, recorder=rec)
    start = time.monotonic_ns() - 400_000_000
    spans = [rec.start("svc/Stream", start_mono_ns=start, attributes={"rpc.method": "svc/Stream"}) for _ in range(20)]
    for _ in range(3):
        for pair in zip(spans[::2], spans[1::2]):
            with batching.begin([QueuedRequest(s, 1, time.monotonic_ns() - 100_000_000) for s in pair], "delay"):
                pass
    for s in spans:
        s.end()
    collector.finish()
    (wait,) = _ids(analyze_store(collector.store_path))["batch.queue-wait"]
    check_finding(wait, gpu=False)
    assert wait.evidence["requests_count"] == 20 and wait.evidence["messages_count"] == 60
    assert wait.evidence["batches_count"] == 30
    (method,) = build_report(collector.store_path).methods
    b = method.batching
    assert b is not None and (b.requests, b.messages, b.batches) == (20, 60, 30) and b.mean_batch_size == 2
    assert abs(wait.evidence["queue_wait_share"] - b.queue_wait_share) < 1e-9
    assert 0.6 < b.queue_wait_share < 0.76
