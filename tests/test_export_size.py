"""C14 (the export side): every OTLP request the export worker sends, traces and metrics, is bounded by bytes
(``ZOOMER_EXPORT_MAX_REQUEST_BYTES``, 3 MiB by default: under the OpenTelemetry Collector's 4 MiB gRPC limit),
so a burst of large spans goes out as several requests; a span too large for any request is dropped and
counted, never fatal; the RPC metrics at their attribute-set cap are split over several requests and arrive
whole."""

from __future__ import annotations

from dataclasses import replace

import pytest
from _collector_fixtures import query, running_collector
from _never_lost import note
from _scripted_otlp import ScriptedOtlp, request_records
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from zoomer_serve.config import DEFAULT_MAX_REQUEST_BYTES, ConfigError, ExportConfig, ZoomerConfig
from zoomer_serve.export import ExportStats, ExportWorker, rpc_metrics
from zoomer_serve.recording import RequestRecorder
from zoomer_serve.recording import records as r
from zoomer_serve.recording.sampling import Sampler

MiB = 1024 * 1024
PROTOCOLS = ["grpc", "http/protobuf"]


def _records(n: int, payload_bytes: int = 0, name: str = "svc.S/Ordinary") -> list[tuple]:
    return request_records(n, payload_bytes, name)


def _collector_config(collector, protocol: str, **over) -> ExportConfig:
    grpc_on = protocol == "grpc"
    base = f"http://127.0.0.1:{collector.grpc_port if grpc_on else collector.http_port}"
    return ExportConfig(protocol=protocol, mode="thread", timeout_ms=20_000, schedule_delay_ms=50,
                        traces_endpoint=base if grpc_on else base + "/v1/traces",
                        metrics_endpoint=base if grpc_on else base + "/v1/metrics", **over)


def _export(cfg: ExportConfig, batches: list[list[tuple]], shutdown_s: float = 60.0) -> ExportStats:
    worker = ExportWorker(cfg, {"service.name": "c14"})
    worker.start()
    for batch in batches:
        worker.put(batch)
    return worker.shutdown(shutdown_s)


def _spans_by_name(store) -> dict[str, int]:
    return dict(query(store, "SELECT name, count(*) FROM spans GROUP BY name"))


def test_the_request_size_is_configurable_and_bad_values_name_the_variable():
    """C14: ``ZOOMER_EXPORT_MAX_REQUEST_BYTES`` (3 MiB by default, under the Collector's 4 MiB)."""
    assert ZoomerConfig.from_env({}).export.max_request_bytes == DEFAULT_MAX_REQUEST_BYTES == 3 * MiB
    assert ZoomerConfig.from_env({"ZOOMER_EXPORT_MAX_REQUEST_BYTES": "65536"}).export.max_request_bytes == 65536
    for bad in ("lots", "100", "-1"):
        with pytest.raises(ConfigError, match="ZOOMER_EXPORT_MAX_REQUEST_BYTES"):
            ZoomerConfig.from_env({"ZOOMER_EXPORT_MAX_REQUEST_BYTES": bad})
    with pytest.raises(ConfigError, match="ZOOMER_EXPORT_MAX_REQUEST_BYTES"):
        ExportConfig(max_request_bytes=1000)


@pytest.mark.parametrize(("max_request_bytes", "payload_bytes", "spans"), [
    (DEFAULT_MAX_REQUEST_BYTES, 200_000, 40),  # 8 MB of spans at the default bound
    (200_000, 20_000, 60),  # 1.2 MB at a small bound
])
def test_a_burst_of_large_spans_goes_out_as_several_requests_each_within_the_bound(max_request_bytes, payload_bytes,
                                                                                    spans):
    """C14: spans far over one request's worth go out as several requests, none over the bound, all
    accepted."""
    with ScriptedOtlp("grpc") as receiver:
        stats = _export(receiver.export_config(max_request_bytes=max_request_bytes),
                        [_records(spans, payload_bytes)])
    sizes = [req.size for req in receiver.requests("traces")]
    assert len(sizes) >= spans * payload_bytes // max_request_bytes + 1
    assert max(sizes) <= max_request_bytes
    assert receiver.accepted("traces") == spans
    assert (stats.exported, stats.dropped) == (spans, 0)
    for req in receiver.requests("metrics"):
        assert req.size <= max_request_bytes


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("max_request_bytes", [DEFAULT_MAX_REQUEST_BYTES, 256 * 1024])
@pytest.mark.slow
def test_spans_with_1mb_attributes_between_ordinary_ones_never_stop_export(tmp_path, protocol, max_request_bytes):
    """C14: 300 ordinary spans with five 1 MB spans among them, to the embedded collector limited to
    512 KiB per request. With the default bound the collector refuses the big requests (RESOURCE_EXHAUSTED /
    HTTP 413) and the worker splits them; with a 256 KiB bound the worker drops the big spans before
    sending. Either way every ordinary span is stored and the five are counted as too large."""
    ordinary = _records(300)
    huge = _records(5, payload_bytes=1_000_000, name="svc.S/Huge")
    batches = [ordinary[i * 60:(i + 1) * 60] + [huge[i]] for i in range(5)]
    batches.append(_records(10, name="svc.S/After"))  # export goes on after the burst
    with running_collector(tmp_path, max_message_bytes=512 * 1024) as collector:
        stats = _export(_collector_config(collector, protocol, max_request_bytes=max_request_bytes), batches)
    stored = _spans_by_name(tmp_path / "store.duckdb")
    note("C14", f"five 1 MB spans among 310 ordinary ones, {protocol}, requests bounded at {max_request_bytes} "
         "bytes, collector limit 512 KiB", 315, sum(stored.values()), stats.dropped_too_large)
    assert stored == {"svc.S/Ordinary": 300, "svc.S/After": 10}
    assert (stats.exported, stats.dropped_too_large, stats.dropped_export) == (310, 5, 5)
    assert stats.records == 315


def _cap_records(n_methods: int, calls_per_method: int = 1) -> list[tuple]:
    """Unsampled server request records of ``n_methods`` methods (with request and response sizes): with the
    size histograms on (``OTEL_SEMCONV_STABILITY_OPT_IN=rpc/dup``, the worst case) each method makes three
    attribute sets (call duration, request size, response size)."""
    out: list[tuple] = []
    recorder = RequestRecorder(sink=out.append, sampler=Sampler("always_off"), otel_context=False)
    for i in range(n_methods):
        method = f"zoomer.demo.v1.RankingService/ScoreCandidatesForSurface{i:05d}"
        for _ in range(calls_per_method):
            span = recorder.start(method, attributes={
                "rpc.system.name": "grpc", "rpc.method": method, "rpc.response.status_code": "OK",
                "server.address": "model-server-7f9c5d8b6-x2x7q.ranking.svc.cluster.local", "server.port": 50051,
                rpc_metrics.REQUEST_BYTES: 1000 + i, rpc_metrics.RESPONSE_BYTES: 20_000 + i})
            span.end()
    return out


def test_metric_points_pack_into_requests_within_the_bound_and_keep_every_point():
    """C14: :meth:`MetricsRequestEncoder.pack` splits the points into requests of at most the bound; the
    requests together carry every point once, each metric's points under its own name and unit; a point too
    large for any request is left out and counted."""
    metrics = rpc_metrics.RpcMetrics(size_metrics=True)
    for rec in _cap_records(400):
        metrics.record(rec)
    points = metrics.data_points(10, 20, {rpc_metrics.SPAN_EXPORTED: {(): 7, (("error.type", "rejected"),): 1}})
    encoder = rpc_metrics.MetricsRequestEncoder({"service.name": "c14"}, "zoomer_serve", "1")
    whole = ExportMetricsServiceRequest.FromString(encoder.encode_request(points))
    requests, too_large = encoder.pack(points, 64 * 1024)
    assert too_large == 0 and len(requests) > 1
    seen = []
    for request in requests:
        payload = encoder.encode_request(request)
        assert len(payload) <= 64 * 1024
        sm = ExportMetricsServiceRequest.FromString(payload).resource_metrics[0].scope_metrics[0]
        for metric in sm.metrics:
            data = getattr(metric, metric.WhichOneof("data"))
            seen.extend((metric.name, metric.unit, dp.SerializeToString()) for dp in data.data_points)
    expected = []
    for metric in whole.resource_metrics[0].scope_metrics[0].metrics:
        data = getattr(metric, metric.WhichOneof("data"))
        expected.extend((metric.name, metric.unit, dp.SerializeToString()) for dp in data.data_points)
    assert sorted(seen) == sorted(expected) and len(expected) == 400 * 3 + 2

    big = rpc_metrics.RpcMetrics(size_metrics=True)
    big.record(_cap_records(1)[0][:r.R_ATTRS] + ({"rpc.method": "m" * 70_000, "rpc.system.name": "grpc"},)
               + _cap_records(1)[0][r.R_ATTRS + 1:])
    for rec in _cap_records(3):
        big.record(rec)
    requests, too_large = encoder.pack(big.data_points(10, 20, {}), 64 * 1024)
    assert too_large == 1 and sum(map(len, requests)) == 3 * 3


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.slow
def test_rpc_metrics_at_their_attribute_set_cap_arrive_whole_at_a_4mib_collector(tmp_path, protocol):
    """C14: 3,400 methods make 10,200 attribute sets, over the 10,000 cap (the rest go to the overflow set);
    encoded as one request they would be over 4 MiB. The worker sends them in several requests to the
    embedded collector limited to 4 MiB, and every point is stored: one row per attribute set, every call
    counted."""
    records = _cap_records(3400)
    probe = rpc_metrics.RpcMetrics(size_metrics=True)
    for rec in records:
        probe.record(rec)
    assert len(probe._points) >= rpc_metrics._MAX_ATTRIBUTE_SETS and probe.dropped_attribute_sets > 0
    assert len(probe.encode({"service.name": "c14"}, "zoomer_serve", "1", 10, 20, {})) > 4 * MiB
    with running_collector(tmp_path, max_message_bytes=4 * MiB) as collector:
        stats = _export(replace(_collector_config(collector, protocol), semconv_rpc="dup"),
                        [records[:1700], records[1700:]])
    store = tmp_path / "store.duckdb"
    rows = dict(query(store, "SELECT metric_name, count(*) FROM metric_points WHERE metric_name LIKE 'rpc.server.%' "
                             "GROUP BY metric_name"))
    expected_rows: dict[str, int] = {}
    for name, _key in probe._points:
        expected_rows[name] = expected_rows.get(name, 0) + 1
    assert rows == expected_rows and sum(rows.values()) == len(probe._points)
    (calls,) = query(store, "SELECT sum(count) FROM metric_points WHERE metric_name = 'rpc.server.call.duration'")[0]
    assert calls == 3400
    assert stats.metric_points_dropped == 0 and stats.metric_points_exported >= len(probe._points)


def test_rpc_metrics_at_the_cap_go_out_in_requests_within_the_bound():
    """C14: the worker itself bounds the metrics requests (a receiver without a limit gets several requests,
    none over 3 MiB, carrying every point once)."""
    records = _cap_records(3400)
    with ScriptedOtlp("grpc") as receiver:
        stats = _export(replace(receiver.export_config(), semconv_rpc="dup"), [records])
    requests = receiver.requests("metrics")
    assert len(requests) >= 2 and max(req.size for req in requests) <= DEFAULT_MAX_REQUEST_BYTES
    rpc_points = 0
    for req in requests:
        for metric in req.request.resource_metrics[0].scope_metrics[0].metrics:
            if metric.name.startswith("rpc.server."):
                rpc_points += len(metric.histogram.data_points)
    assert rpc_points == rpc_metrics._MAX_ATTRIBUTE_SETS + 3  # the cap, and one overflow set per metric
    assert stats.metric_points_exported == sum(req.items for req in requests)
