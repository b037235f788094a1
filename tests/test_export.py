"""The export path: protocols, modes, compression, bounded queue, configuration errors."""

from __future__ import annotations

import pytest

import zoomer_serve
from zoomer_serve.config import ConfigError, ExportConfig, ZoomerConfig
from zoomer_serve.export import ExportPipeline


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


def test_sdk_disabled_records_nothing(monkeypatch):
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    tel = zoomer_serve.configure(set_global_providers=False)
    assert tel.pipeline is None and tel.tracer_provider is None
    _record_spans(3)
    assert zoomer_serve.shutdown().exported == 0


@pytest.mark.parametrize(("env", "needle"), [
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "thrift"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "localhost:4317"}, "OTEL_EXPORTER_OTLP_ENDPOINT"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:notaport"}, "invalid port"),
    ({"OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER"),
    ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"}, "OTEL_TRACES_SAMPLER_ARG"),
    ({"OTEL_BSP_MAX_QUEUE_SIZE": "-1"}, "OTEL_BSP_MAX_QUEUE_SIZE"),
    ({"OTEL_BSP_SCHEDULE_DELAY": "soon"}, "OTEL_BSP_SCHEDULE_DELAY"),
    ({"OTEL_RESOURCE_ATTRIBUTES": "novalue"}, "OTEL_RESOURCE_ATTRIBUTES"),
    ({"OTEL_EXPORTER_OTLP_COMPRESSION": "zstd"}, "OTEL_EXPORTER_OTLP_COMPRESSION"),
    ({"ZOOMER_EXPORT_MODE": "carrier-pigeon"}, "ZOOMER_EXPORT_MODE"),
    ({"OTEL_BSP_MAX_QUEUE_SIZE": "10", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "20"}, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE"),
])
def test_bad_configuration_names_the_variable(env, needle):
    with pytest.raises(ConfigError, match=needle):
        ZoomerConfig.from_env(env)


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
    assert cfg.semconv_rpc_dup is True
    assert cfg.excluded_methods == ("a.B/*", "c.D/E")
    assert ZoomerConfig.from_env({"OTEL_SERVICE_NAME": "svc", "OTEL_RESOURCE_ATTRIBUTES": "service.name=x"}
                                 ).service_name == "svc"
