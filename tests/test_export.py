"""The export path: protocols, modes, compression, bounded queue, configuration errors."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from _never_lost import note

import zoomer_serve
from zoomer_serve.config import ConfigError, ExportConfig, ZoomerConfig
from zoomer_serve.export import ExportPipeline, rpc_metrics
from zoomer_serve.recording import records as r


def _record_spans(n: int, name: str = "svc.S/M") -> None:
    recorder = zoomer_serve.get_recorder()
    for i in range(n):
        span = recorder.start(name, attributes={"rpc.method": name, "rpc.system.name": "grpc", "i": i})
        span.set_attribute("rpc.response.status_code", "OK")
        span.end()


@pytest.mark.parametrize(("protocol", "mode", "compression"), [
    ("http/protobuf", "process", "none"),
    ("grpc", "thread", "gzip"),
    ("http/protobuf", "thread", "gzip"),
])
@pytest.mark.slow
def test_protocols_modes_and_compression_deliver_every_span(collector, monkeypatch, protocol, mode, compression):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", compression)
    endpoint = collector.http_endpoint if protocol == "http/protobuf" else collector.grpc_endpoint
    zoomer_serve.configure(service_name="exp", endpoint=endpoint, protocol=protocol, export_mode=mode,
                           schedule_delay_ms=50, set_global_providers=False)
    _record_spans(1200)  # more than one export batch (512)
    spans = collector.spans()
    assert len(spans) == 1200
    assert sorted(s["attributes"]["i"] for s in spans) == list(range(1200))
    assert {s["service_name"] for s in spans} == {"exp"}


def test_queue_is_bounded_and_drops_are_counted():
    """C03 (memory stays bounded): with the writer not draining, the queue never holds more than its size."""
    cfg = ExportConfig(max_queue_size=100, max_export_batch_size=50, mode="none")
    pipeline = ExportPipeline(cfg, {"service.name": "x"})  # not started: nothing drains
    rec = zoomer_serve.RequestRecorder(sink=pipeline.submit, otel_context=False)
    for _ in range(1000):
        rec.start("a/b").end()
    assert len(pipeline._queue) == 100
    assert pipeline.dropped == 900
    stats = pipeline.shutdown(0.5)
    assert stats.dropped_queue == 900


def test_unsampled_records_that_do_not_fit_count_as_lost_records_not_as_spans():
    """An unsampled request exports no span, only its RPC metrics: when the queue drops it, the span counters
    stay at 0 (they once counted it as a span) and ``dropped_records`` says that a call is missing from the
    metrics."""
    from zoomer_serve.recording.sampling import Sampler

    cfg = ExportConfig(max_queue_size=10, max_export_batch_size=5, mode="none")
    pipeline = ExportPipeline(cfg, {"service.name": "x"})  # not started: nothing drains
    unsampled = zoomer_serve.RequestRecorder(sink=pipeline.submit, sampler=Sampler("always_off"),
                                             otel_context=False)
    sampled = zoomer_serve.RequestRecorder(sink=pipeline.submit, otel_context=False)
    for _ in range(10):
        sampled.start("a/fills").end()
    for _ in range(30):
        unsampled.start("a/b").end()
    span = sampled.start("a/c")
    span.add_child("preprocess", 1, 2, {})
    span.end()
    assert pipeline.dropped == 2 and pipeline.dropped_records == 31
    stats = pipeline.shutdown(0.5)
    assert (stats.dropped_queue, stats.dropped_records) == (2, 31)


def test_records_that_come_once_shutdown_began_are_counted_as_such_not_as_queue_full(caplog):
    """C12: a request that ends while the pipeline shuts down (a server still answering) is counted and logged
    as ended after shutdown began, never as "queue full" (whose advice, a larger queue, would not help)."""
    cfg = ExportConfig(max_queue_size=100, max_export_batch_size=50, mode="none")
    pipeline = ExportPipeline(cfg, {"service.name": "x"})
    rec = zoomer_serve.RequestRecorder(sink=pipeline.submit, otel_context=False)
    rec.start("a/before").end()
    pipeline._closing = True  # as shutdown() sets it first
    for _ in range(3):
        rec.start("a/after").end()
    with caplog.at_level(logging.WARNING, logger="zoomer_serve.export"):
        stats = pipeline.shutdown(0.5)
    assert (stats.records_after_shutdown, stats.dropped_queue, stats.dropped_records) == (3, 0, 0)
    assert "3 requests ended after telemetry began shutting down" in caplog.text
    assert "queue full" not in caplog.text


def _records(n: int, attributes: dict | None = None) -> list[tuple]:
    got: list[tuple] = []
    recorder = zoomer_serve.RequestRecorder(sink=got.append, otel_context=False)
    for i in range(n):
        recorder.start("a/b", attributes={"i": i, **(attributes or {})}).end()
    return got


def _decode_frames(frames: list[bytes]) -> list[tuple]:
    import pickle
    import struct

    decoded = []
    for frame in frames:
        (length,) = struct.unpack(">I", frame[:4])
        assert length == len(frame) - 4
        decoded.append(pickle.loads(frame[4:]))
    return decoded


def test_the_writer_pickles_a_large_batch_in_frames_of_at_most_128_records():
    """Each pickle.dumps holds the interpreter lock, so a batch goes to the helper in bounded frames, each a
    4-byte big-endian length and a pickled ``("records", (the server side's loss counters, records))``, in
    order."""
    pipeline = ExportPipeline(ExportConfig(mode="none"), {"service.name": "x"})
    pipeline.dropped = 7
    batch = _records(300)
    made = list(pipeline._frames(batch))
    decoded = _decode_frames([f.data for f in made])
    assert [f.records for f in made] == [128, 128, 44] and [f.spans for f in made] == [128, 128, 44]
    assert [f.calls for f in made] == [128, 128, 44]
    assert {kind for kind, _ in decoded} == {"records"}
    assert [len(records) for _, (_, records) in decoded] == [128, 128, 44]
    assert {counters["queue_full"] for _, (counters, _) in decoded} == {7}
    assert [rec for _, (_, records) in decoded for rec in records] == batch


def test_frames_are_bounded_by_bytes_and_a_record_too_large_for_any_frame_loses_its_spans_only(monkeypatch):
    """C14: a burst of large records goes to the helper as several frames, each within MAX_FRAME_BYTES (once a
    75 MB frame made the helper exit for the rest of the process's life); a single request record over the bound
    loses its spans, counted, and goes on reduced to what the RPC metrics read, unsampled (it was dropped whole,
    and its call with it); a record that is no request's is dropped whole and counted."""
    from zoomer_serve.export import frames as frames_mod

    monkeypatch.setattr(frames_mod, "MAX_FRAME_BYTES", 200_000)
    pipeline = ExportPipeline(ExportConfig(mode="none"), {"service.name": "x"})
    small = _records(50)
    large = _records(10, {"blob": "x" * 60_000})
    huge = _records(2, {"blob": "y" * 300_000, "rpc.method": "a/b", "zoomer.rpc.request.bytes": 7})
    not_request: list[tuple] = []
    zoomer_serve.RequestRecorder(sink=not_request.append, otel_context=False).start(
        "op", attributes={"blob": "z" * 300_000}, is_request=False).end()
    batch = small[:25] + large[:5] + huge[:1] + large[5:] + not_request + huge[1:] + small[25:]
    made = list(pipeline._frames(batch))
    assert all(len(f.data) - 4 <= 200_000 for f in made)
    assert len(made) >= 4
    sent = [rec for _, (_, records) in _decode_frames([f.data for f in made]) for rec in records]
    reduced = [rpc_metrics.metrics_only(rec) for rec in huge]
    assert sent == small[:25] + large[:5] + reduced[:1] + large[5:] + reduced[1:] + small[25:]
    for rec, whole in zip(reduced, huge):
        assert rec[r.R_ATTRS] == {"rpc.method": "a/b", "zoomer.rpc.request.bytes": 7}
        assert rec[r.R_FLAGS] == r.F_REQUEST and r.exported_spans(rec) == 0
        assert rec[r.R_START_NS:r.R_STATUS + 1] == whole[r.R_START_NS:r.R_STATUS + 1]
    assert sum(f.records for f in made) == 62 and sum(f.spans for f in made) == 60
    assert sum(f.calls for f in made) == 62  # the reduced request records are calls still
    assert (pipeline.dropped_record_too_large, pipeline.dropped_records, pipeline.dropped_calls) == (3, 1, 0)
    stats = pipeline.shutdown(0.5)
    assert stats.dropped_record_too_large == 3 and stats.dropped >= 3


def test_sdk_disabled_records_nothing(monkeypatch):
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    tel = zoomer_serve.configure(set_global_providers=False)
    assert tel.pipeline is None and tel.tracer_provider is None
    _record_spans(3)
    assert zoomer_serve.shutdown().exported == 0


@pytest.mark.parametrize(("env", "needle"), [
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "thrift"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
    # a scheme-less gRPC endpoint is host:port (OTEL_EXPORTER_OTLP_INSECURE; tests/test_export_tls.py), never bare
    # and never OTLP/HTTP's
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "localhost"}, "OTEL_EXPORTER_OTLP_ENDPOINT"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "localhost:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
     "OTEL_EXPORTER_OTLP_ENDPOINT"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:notaport"}, "invalid port"),
    ({"OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER"),
    ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"}, "OTEL_TRACES_SAMPLER_ARG"),
    ({"OTEL_BSP_MAX_QUEUE_SIZE": "-1"}, "OTEL_BSP_MAX_QUEUE_SIZE"),
    ({"OTEL_BSP_SCHEDULE_DELAY": "soon"}, "OTEL_BSP_SCHEDULE_DELAY"),
    ({"OTEL_RESOURCE_ATTRIBUTES": "novalue"}, "OTEL_RESOURCE_ATTRIBUTES"),
    ({"OTEL_EXPORTER_OTLP_COMPRESSION": "zstd"}, "OTEL_EXPORTER_OTLP_COMPRESSION"),
    ({"ZOOMER_EXPORT_MODE": "carrier-pigeon"}, "ZOOMER_EXPORT_MODE"),
    ({"OTEL_BSP_MAX_QUEUE_SIZE": "10", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "20"}, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://[::1"}, "OTEL_EXPORTER_OTLP_ENDPOINT is not a valid URL"),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://[::1"}, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
    ({"OTEL_EXPORTER_OTLP_HEADERS": "bad header=x"}, "not a valid header name"),
    ({"OTEL_EXPORTER_OTLP_HEADERS": "a=line1%0Aline2"}, "cannot carry"),
])
def test_bad_configuration_names_the_variable(env, needle):
    with pytest.raises(ConfigError, match=needle):
        ZoomerConfig.from_env(env)


@pytest.mark.parametrize(("variable", "value"), [
    ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "thrift"),
    ("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "zstd"),
    ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "soon"),
    ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "-1"),
    ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "novalue"),
    ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "bad header=x"),
])
def test_a_bad_per_signal_variable_is_named_itself_not_its_general_form(variable, value):
    """The error names the variable the value came from: a bad ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` is not
    reported as ``OTEL_EXPORTER_OTLP_PROTOCOL`` (which may be unset, or set to a good value)."""
    general = variable.replace("_TRACES_", "_")
    with pytest.raises(ConfigError) as err:
        ZoomerConfig.from_env({variable: value})
    assert variable in str(err.value) and general + "=" not in str(err.value), str(err.value)
    with pytest.raises(ConfigError, match=variable):
        ZoomerConfig.from_env({variable: value, general: "grpc" if "PROTOCOL" in general else ""})


@pytest.mark.parametrize("variable", ["OTEL_EXPORTER_OTLP_TIMEOUT", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
                                      "OTEL_BSP_SCHEDULE_DELAY", "OTEL_METRIC_EXPORT_INTERVAL",
                                      "OTEL_BSP_MAX_QUEUE_SIZE", "ZOOMER_GPU_NVML_PERIOD_MS",
                                      "ZOOMER_CPU_PROFILE_ATTACH_TIMEOUT_MS", "ZOOMER_GPU_MEMORY_HISTORY_DRAIN_MS"])
@pytest.mark.parametrize("value", ["9999999999999", "99999999999999999999999"])
def test_an_integer_too_large_to_use_is_refused_naming_the_variable(variable, value):
    """A huge value (a timeout of 317 years overflows ``threading`` waits at shutdown) stops start-up with a
    ConfigError naming the variable and the largest value taken, not an OverflowError when the server stops."""
    with pytest.raises(ConfigError, match=f"{variable} must be <= 2147483647, got '{value}'"):
        ZoomerConfig.from_env({variable: value})
    assert ZoomerConfig.from_env({variable: "2147483647"}) is not None


@pytest.mark.parametrize("value", ["\u0661\u0660\u0660", "1_000", "0x10", "1e3"])
def test_an_integer_is_plain_ascii_digits(value):
    """int() took Arabic-Indic digits ("١٠٠") and "1_000": an OTEL_* integer is ASCII digits, as other SDKs read
    it."""
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_TIMEOUT must be an integer"):
        ZoomerConfig.from_env({"OTEL_EXPORTER_OTLP_TIMEOUT": value})
    assert ZoomerConfig.from_env({"OTEL_EXPORTER_OTLP_TIMEOUT": " +250 "}).export.timeout_ms == 250


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"timeout_ms": 10**16}, "configure(timeout_ms=...) must be an integer between 1 and 2147483647 (ms)"),
    ({"schedule_delay_ms": 10**16}, "configure(schedule_delay_ms=...) must be an integer between 1 and"),
    ({"metric_export_interval_ms": 10**16}, "configure(metric_export_interval_ms=...) must be an integer"),
    ({"timeout_ms": 1.5}, "configure(timeout_ms=...) must be an integer between 1 and 2147483647 (ms), got 1.5"),
    ({"timeout_ms": True}, "configure(timeout_ms=...) must be an integer between 1 and 2147483647 (ms), got True"),
    ({"timeout_ms": "100"}, "configure(timeout_ms=...) must be an integer"),
    ({"timeout_ms": 0}, "configure(timeout_ms=...) must be an integer between 1 and 2147483647 (ms), got 0"),
    ({"endpoint": 5}, "configure(endpoint=...) must be a URL string, got 5"),
    ({"protocol": "thrift"}, "configure(protocol=...) must be one of"),
    ({"protocol": 1}, "configure(protocol=...) must be one of"),
    ({"export_mode": "x"}, "configure(export_mode=...) must be one of ('process', 'thread', 'none'), got 'x'"),
    ({"sampler": 3}, "configure(sampler=...) must be a string"),
    ({"sampler_ratio": "a"}, "configure(sampler_ratio=...) must be a number between 0 and 1, got 'a'"),
    ({"sampler_ratio": 1.5}, "configure(sampler_ratio=...) must be a number between 0 and 1, got 1.5"),
    ({"sampler_ratio": float("nan")}, "configure(sampler_ratio=...) must be a number between 0 and 1"),
    ({"resource_attributes": "k=v"}, "configure(resource_attributes=...) must be a mapping of str to str"),
    ({"resource_attributes": {"k": 1}}, "configure(resource_attributes=...) must be a mapping of str to str"),
])
def test_a_bad_configure_argument_is_refused_naming_the_argument(kwargs, needle):
    """configure() took any value: a timeout of 10**16 ms failed at shutdown with an OverflowError (and the
    helper process crashed), ``endpoint=5`` raised an AttributeError, ``sampler_ratio='a'`` a TypeError, and
    ``export_mode='x'`` was reported as ZOOMER_EXPORT_MODE. Each is a ConfigError naming the argument, with the
    ranges the environment variables have; nothing starts."""
    with pytest.raises(ConfigError) as err:
        zoomer_serve.configure(set_global_providers=False, **kwargs)
    assert needle in str(err.value), str(err.value)


def test_an_export_config_built_in_code_is_checked_like_the_environment():
    """ExportConfig itself (built in code, or by ``dataclasses.replace``) refuses what the environment would:
    non-integers and integers past 2147483647, naming the field and its variable."""
    with pytest.raises(ConfigError, match=r"ExportConfig.timeout_ms \(OTEL_EXPORTER_OTLP_TIMEOUT\) must be an integer"):
        ExportConfig(timeout_ms=10**16)
    with pytest.raises(ConfigError, match=r"ExportConfig.max_queue_size \(OTEL_BSP_MAX_QUEUE_SIZE\)"):
        ExportConfig(max_queue_size=2.5)  # type: ignore[arg-type]
    assert ExportConfig(timeout_ms=2**31 - 1).timeout_ms == 2**31 - 1


def test_an_empty_sampler_argument_is_unset():
    """``OTEL_TRACES_SAMPLER_ARG=""`` was an error where every other empty OTEL_* variable counts as unset."""
    cfg = ZoomerConfig.from_env({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": " "})
    assert cfg.sampler_ratio == 1.0


def test_an_otel_boolean_other_than_true_or_false_warns_once_naming_it_and_reads_as_false(caplog):
    """The OpenTelemetry spec: a boolean variable is true only for "true" (any case); any other value is
    false, and a value other than true/false gets a warning."""
    with caplog.at_level(logging.WARNING):
        assert ZoomerConfig.from_env({"OTEL_SDK_DISABLED": "maybe"}).sdk_disabled is False
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1
    assert "OTEL_SDK_DISABLED" in warned[0] and "'maybe'" in warned[0] and "false" in warned[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        for value, expected in (("TRUE", True), (" true ", True), ("False", False), ("false", False),
                                ("", False)):
            assert ZoomerConfig.from_env({"OTEL_SDK_DISABLED": value}).sdk_disabled is expected, value
        assert ZoomerConfig.from_env({}).sdk_disabled is False
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.parametrize("variable", ["ZOOMER_HOST", "ZOOMER_HOST_REQUEST_CPU_TIME", "ZOOMER_GPU_PEAK",
                                      "ZOOMER_GPU_MEMORY_HISTORY", "ZOOMER_GPU_OOM"])
def test_a_zoomer_boolean_with_an_unknown_value_is_refused_naming_the_variable_and_the_value(variable):
    with pytest.raises(ConfigError, match=f"{variable} must be .*true.*false.*'maybe'"):
        ZoomerConfig.from_env({variable: "maybe"})


def test_environment_is_read_as_opentelemetry_defines_it():
    cfg = ZoomerConfig.from_env({
        "OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attrs,deployment.environment=prod%20eu",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/",
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://metrics:9999/v1/metrics",
        "OTEL_EXPORTER_OTLP_HEADERS": "api-key=s3cr%3Dt",
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "2500",
        "OTEL_SEMCONV_STABILITY_OPT_IN": "http,rpc/dup",
        "ZOOMER_EXCLUDED_METHODS": "a.B/*, c.D/E",
    })
    assert cfg.service_name == "from-attrs"
    assert cfg.resource_attributes["deployment.environment"] == "prod eu"
    assert cfg.export.traces_endpoint == "http://collector:4318/v1/traces"
    assert cfg.export.metrics_endpoint == "http://metrics:9999/v1/metrics"
    assert cfg.export.headers == {"api-key": "s3cr=t"}
    assert cfg.export.timeout_ms == 2500
    assert cfg.semconv_rpc_dup is True and cfg.export.semconv_rpc == "dup"
    assert cfg.excluded_methods == ("a.B/*", "c.D/E")
    assert ZoomerConfig.from_env({"OTEL_SERVICE_NAME": "svc", "OTEL_RESOURCE_ATTRIBUTES": "service.name=x"}
                                 ).service_name == "svc"


def test_the_protocol_is_read_case_insensitively():
    """The OpenTelemetry environment specification: enum values SHOULD be interpreted case-insensitively
    (``HTTP/PROTOBUF`` was refused while ``ALWAYS_ON`` and ``GZIP`` were taken)."""
    cfg = ZoomerConfig.from_env({"OTEL_EXPORTER_OTLP_PROTOCOL": "HTTP/Protobuf"})
    assert cfg.export.protocol == "http/protobuf"
    assert cfg.export.traces_endpoint == "http://localhost:4318/v1/traces"
    assert ZoomerConfig.from_env({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": " GRPC "}).export.protocol == "grpc"


def test_rpc_histograms_use_upper_inclusive_buckets_and_bound_cardinality(monkeypatch):
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    from zoomer_serve.export import rpc_metrics
    from zoomer_serve.recording import records as r

    def rec(duration_s, method="a.B/C", kind=r.KIND_SERVER, size=None):
        attrs = {"rpc.method": method, "rpc.system.name": "grpc", "rpc.response.status_code": "OK"}
        if size is not None:
            attrs[rpc_metrics.REQUEST_BYTES] = size
        return (1, 2, 0, False, 1, None, method, kind, 0, int(duration_s * 1e9), 0, None, attrs, None, None,
                None, r.F_REQUEST)

    plain = rpc_metrics.RpcMetrics()  # v1.44.0: the size histograms are deprecated, not emitted
    plain.record(rec(0.001, size=100))
    req = ExportMetricsServiceRequest.FromString(plain.encode({"service.name": "s"}, "zs", "1", 10, 20, {}))
    assert [x.name for x in req.resource_metrics[0].scope_metrics[0].metrics] == ["rpc.server.call.duration"]
    m = rpc_metrics.RpcMetrics(size_metrics=True)  # OTEL_SEMCONV_STABILITY_OPT_IN=rpc/dup
    for d in (0.001, 0.005, 0.0051, 20.0):
        m.record(rec(d, size=100))
    m.record(rec(0.5, kind=r.KIND_CLIENT))
    m.record(rec(0.5)[:16] + (0,))  # not a request record: not counted
    req = ExportMetricsServiceRequest.FromString(m.encode({"service.name": "s"}, "zs", "1", 10, 20, {}))
    metrics = {x.name: x for x in req.resource_metrics[0].scope_metrics[0].metrics}
    (dp,) = metrics["rpc.server.call.duration"].histogram.data_points
    assert dp.count == 4 and dp.bucket_counts[0] == 2 and dp.bucket_counts[1] == 1 and dp.bucket_counts[-1] == 1
    assert dp.min == 0.001 and dp.max == 20.0 and abs(dp.sum - 20.0111) < 1e-9
    assert list(metrics["rpc.server.request.size"].histogram.data_points[0].bucket_counts)[:2] == [0, 4]
    assert metrics["rpc.client.call.duration"].histogram.data_points[0].count == 1
    assert metrics["rpc.server.call.duration"].unit == "s" and metrics["rpc.server.request.size"].unit == "By"

    monkeypatch.setattr(rpc_metrics, "_MAX_ATTRIBUTE_SETS", 3)
    m2 = rpc_metrics.RpcMetrics()
    for i in range(10):
        m2.record(rec(0.01, method=f"m{i}"))
    assert m2.dropped_attribute_sets == 7
    req2 = ExportMetricsServiceRequest.FromString(m2.encode({}, "zs", "1", 10, 20, {}))
    points = req2.resource_metrics[0].scope_metrics[0].metrics[0].histogram.data_points
    assert sum(p.count for p in points) == 10


def test_exporter_self_metrics_count_exported_spans(collector):
    zoomer_serve.configure(service_name="self", endpoint=collector.grpc_endpoint, schedule_delay_ms=50,
                           set_global_providers=False)
    _record_spans(30)
    points = collector.metric_points("otel.sdk.exporter.span.exported")
    exported = [p for p in points if not p["attributes"]]
    assert exported and max(p["value"] for p in exported) == 30


@pytest.mark.parametrize("mode", ["process", "thread"])
@pytest.mark.parametrize("off", ["OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER"])
def test_an_exporter_set_to_none_sends_nothing_of_its_signal_and_all_of_the_other(collector, monkeypatch, off, mode):
    """``OTEL_TRACES_EXPORTER=none``: no span reaches the collector, every call is still in the RPC metrics;
    ``OTEL_METRICS_EXPORTER=none``: every span arrives and no metric point does (they were not read at all)."""
    monkeypatch.setenv(off, "none")
    zoomer_serve.configure(service_name="off", endpoint=collector.grpc_endpoint, export_mode=mode,
                           schedule_delay_ms=50, set_global_providers=False)
    _record_spans(25)
    spans = collector.spans()
    calls = sum(p["count"] for p in collector.metric_points("rpc.server.call.duration"))
    exported = collector.metric_points("otel.sdk.exporter.span.exported")
    if off == "OTEL_TRACES_EXPORTER":
        assert spans == [] and calls == 25
        assert max(p["value"] for p in exported if not p["attributes"]) == 0
    else:
        assert len(spans) == 25 and calls == 0 and exported == []


@pytest.mark.parametrize("value", ["console", "otlp,console", "zipkin", "none,otlp"])
def test_an_exporter_other_than_otlp_or_none_is_refused(value):
    for variable in ("OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER"):
        with pytest.raises(ConfigError, match=f"{variable}=.*exports OTLP only"):
            ZoomerConfig.from_env({variable: value})
    assert ZoomerConfig.from_env({"OTEL_TRACES_EXPORTER": " OTLP ", "OTEL_METRICS_EXPORTER": "None"}).export.metrics \
        is False


@pytest.mark.slow
def test_shutdown_budget_shorter_than_the_export_timeout_is_kept(caplog):
    """C03: shutdown(timeout_s) bounds the whole shutdown (helper process and SDK providers) even when the
    OTLP timeout is longer and the collector is unreachable, and the helper still reports its counters."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    zoomer_serve.configure(service_name="c03b", endpoint=f"http://127.0.0.1:{closed}", timeout_ms=10_000,
                           schedule_delay_ms=100, set_global_providers=False)
    _record_spans(50)
    start = time.monotonic()
    stats = zoomer_serve.shutdown(timeout_s=2.0)
    assert time.monotonic() - start < 2.0 + 1.0 + 0.5
    assert stats is not None and stats.last_error != "the export helper did not report"
    note("C03", "collector down (closed port) at shutdown", 50, 0, stats.dropped)
    assert stats.exported == 0 and stats.dropped == 50


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"endpoint": "garbage"}, r"configure\(endpoint=\.\.\.\) must be an http:// or https:// URL with a host"),
    ({"endpoint": "http://h:notaport"}, r"configure\(endpoint=\.\.\.\) has an invalid port"),
    ({"service_name": 123}, r"configure\(service_name=\.\.\.\) must be a non-empty string, got 123"),
    ({"service_name": " "}, r"configure\(service_name=\.\.\.\) must be a non-empty string"),
])
def test_configure_refuses_what_the_environment_refuses(kwargs, needle):
    """Values given in code are checked as the environment's are (``configure(endpoint="garbage")`` was taken, and
    every export then failed resolving it); nothing starts."""
    before = zoomer_serve.runtime._current()
    with pytest.raises(ConfigError, match=needle):
        zoomer_serve.configure(**kwargs)
    assert zoomer_serve.runtime._current() is before


@pytest.mark.parametrize("timeout_s", [float("inf"), float("nan"), -1, "abc", True])
def test_a_timeout_that_is_no_finite_number_of_seconds_is_refused(timeout_s):
    """``force_flush(timeout_s=inf)`` overflowed inside the SDK's and the threads' waits (a string failed deep
    inside); ``shutdown`` with one let go of the telemetry before failing. Both refuse it first."""
    tel = zoomer_serve.configure(export_mode="none", set_global_providers=False)
    with pytest.raises(ValueError, match=r"force_flush\(timeout_s=...\) must be a finite number of seconds"):
        zoomer_serve.force_flush(timeout_s=timeout_s)
    with pytest.raises(ValueError, match=r"shutdown\(timeout_s=...\) must be a finite number of seconds"):
        zoomer_serve.shutdown(timeout_s=timeout_s)
    assert zoomer_serve.get_telemetry() is tel and not tel.shut_down  # still the active one
    assert zoomer_serve.shutdown(timeout_s=1) is not None


def _numpy_handler(request: bytes, context: Any) -> bytes:
    """Sets NumPy scalars (alone, in a dict, in a list) on the request span, a phase and an event."""
    import numpy as np

    from zoomer_serve import current_request, phase

    i = int(request)
    span = current_request()
    assert span is not None
    span.set_attribute("app.score", np.float32(0.5))
    span.set_attribute("app.rank", np.int64(i))
    span.set_attribute("app.hit", np.bool_(i % 2 == 0))
    span.set_attribute("app.scores", [np.float32(0.25), np.float32(0.75)])
    span.set_attribute("app.detail", {"score": np.float32(0.25), "n": np.int64(3), "tag": "x"})
    span.add_event("app.scored", {"app.score": np.float32(0.5), "app.detail": {"ok": np.bool_(True)}})
    with phase("rank", {"app.score": np.float32(0.75), "app.detail": {"score": np.float32(0.25), "n": np.int64(3),
                                                                      "tag": "x"}}):
        pass
    return request


@pytest.mark.parametrize("mode", ["process", "thread"])
@pytest.mark.slow
def test_numpy_scalars_and_dicts_travel_as_native_otlp_values(collector: Any, mode: str) -> None:
    """``set_attribute("app.score", np.float32(0.5))``, np.int64, np.bool_ (also inside a list or a dict, on
    a phase and an event) were stored as strings ("0.5", "7", "True"): they arrive as double, int and bool.
    A dict value is a JSON object (OTLP kvlist) on the request span, its phase and its event alike. Every call
    sent has its request span and its phase span in the collector's store."""
    from concurrent import futures

    import grpc

    from interceptors import ZoomerServerInterceptor

    telemetry = zoomer_serve.configure(service_name="np", endpoint=collector.grpc_endpoint, protocol="grpc",
                                       export_mode=mode, schedule_delay_ms=50, set_global_providers=False)
    generic = grpc.method_handlers_generic_handler("t.Np", {"Call": grpc.unary_unary_rpc_method_handler(
        _numpy_handler)})
    server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=[ZoomerServerInterceptor(telemetry.recorder)])
    server.add_generic_rpc_handlers((generic,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    sent = 20
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/t.Np/Call")
            for i in range(sent):
                assert call(str(i).encode(), timeout=30) == str(i).encode()
    finally:
        server.stop(None).wait(5)
    rows = collector.spans()
    requests = [r for r in rows if r["kind"] == "SERVER"]
    phases = [r for r in rows if r["name"] == "rank"]
    assert len(requests) == sent and len(phases) == sent
    detail = {"score": 0.25, "n": 3, "tag": "x"}
    for row in requests:
        attrs = row["attributes"]
        i = attrs["app.rank"]
        assert type(i) is int and attrs["app.hit"] is (i % 2 == 0)
        assert type(attrs["app.score"]) is float and attrs["app.score"] == 0.5
        assert attrs["app.scores"] == [0.25, 0.75] and attrs["app.detail"] == detail
        (event,) = row["events"]
        assert event["attributes"] == {"app.score": 0.5, "app.detail": {"ok": True}}
    assert sorted(r["attributes"]["app.rank"] for r in requests) == list(range(sent))
    for row in phases:
        assert row["attributes"] == {"zoomer.phase": "rank", "app.score": 0.75, "app.detail": detail}
