"""Each signal's own OTLP connection settings (the OpenTelemetry exporter specification): for traces and for
metrics, the protocol, endpoint, headers, timeout and compression are the signal's ``OTEL_EXPORTER_OTLP_<SIGNAL>_*``
variable when set, else the general ``OTEL_EXPORTER_OTLP_*`` one, else the default. A trace setting never
reaches the metrics' requests, nor a metrics setting the traces'.

They were not: every ``..._METRICS_*`` variable but the endpoint was ignored and the metrics went with the traces'
protocol, headers, timeout and compression, so metrics meant for an OTLP/HTTP port were sent as gRPC (and all
lost), and the trace vendor's key went to the metrics endpoint."""

from __future__ import annotations

import pytest
from _scripted_otlp import ScriptedOtlp

import zoomer_serve
from zoomer_serve.config import ConfigError, ExportConfig, ZoomerConfig
from zoomer_serve.export import rpc_metrics
from zoomer_serve.export.transport import (
    _sdk_exporter_kwargs,
    make_sender,
    sdk_metric_exporter,
    sdk_span_exporter,
)
from zoomer_serve.export.worker import SCOPE_NAME


def _record_calls(n: int, name: str = "svc.S/M") -> None:
    recorder = zoomer_serve.get_recorder()
    for i in range(n):
        span = recorder.start(name, attributes={"rpc.method": name, "rpc.system.name": "grpc", "i": i})
        span.set_attribute("rpc.response.status_code", "OK")
        span.end()


@pytest.mark.parametrize("metrics_over", ["http/protobuf", "grpc"])
def test_metrics_go_over_their_own_protocol_while_traces_go_over_the_other(collector, monkeypatch, metrics_over):
    """The new user's setup: the general endpoint is the collector's gRPC port and the metrics have their own
    ``http/protobuf`` protocol and endpoint (its HTTP port), or the other way round. Every call is in the metrics
    the collector stored (there were 0: the metrics were sent as gRPC to the HTTP port, "Failed parsing
    HTTP/2"), and every span too. Through the export helper process, as a server runs."""
    traces_over = "grpc" if metrics_over == "http/protobuf" else "http/protobuf"
    endpoints = {"grpc": collector.grpc_endpoint, "http/protobuf": collector.http_endpoint}
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", traces_over)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoints[traces_over])
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", metrics_over)
    metrics_endpoint = endpoints[metrics_over] + ("/v1/metrics" if metrics_over == "http/protobuf" else "")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", metrics_endpoint)
    tel = zoomer_serve.configure(service_name="split", export_mode="process", schedule_delay_ms=50,
                                 timeout_ms=5000, set_global_providers=False)
    assert tel.config.export.otlp("metrics").protocol == metrics_over
    _record_calls(40)
    calls = sum(p["count"] for p in collector.metric_points("rpc.server.call.duration"))
    exported = collector.metric_points(rpc_metrics.SPAN_EXPORTED)
    assert calls == 40
    assert max(p["value"] for p in exported if not p["attributes"]) == 40
    assert len(collector.spans()) == 40


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_each_signal_carries_its_own_headers_and_never_the_other_signals(monkeypatch, protocol):
    """``OTEL_EXPORTER_OTLP_TRACES_HEADERS`` holds the trace vendor's key and ``..._METRICS_HEADERS`` the metrics
    backend's: every metrics request (zoomer-serve's own and the OpenTelemetry SDK's) carries the metrics key
    and never the trace key, every trace request the trace key and never the metrics key. (Metrics carried
    the trace vendor's key to the metrics endpoint, and lacked their own.) A real OTLP receiver records the
    headers (HTTP) or metadata (gRPC) of each request."""
    with ScriptedOtlp(protocol) as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{receiver.port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-shared=GENERAL")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "x-trace-vendor-key=TRACE_SECRET")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_HEADERS", "x-metrics-key=METRICS_SECRET")
        zoomer_serve.configure(service_name="keys", export_mode="process", schedule_delay_ms=50, timeout_ms=5000,
                               set_global_providers=False)
        _record_calls(10)
        assert zoomer_serve.shutdown(timeout_s=5) is not None
        traces, metrics = receiver.requests("traces"), receiver.requests("metrics")
    assert traces and sum(r.items for r in traces) == 10
    assert metrics
    scopes = {sm.scope.name for r in metrics for rm in r.request.resource_metrics for sm in rm.scope_metrics}
    # zoomer-serve's own metrics and the SDK meter provider's (host telemetry) both went to the receiver
    assert SCOPE_NAME in scopes and scopes - {SCOPE_NAME}, scopes
    for r in traces:
        assert r.headers.get("x-trace-vendor-key") == "TRACE_SECRET", r.headers
        assert "x-metrics-key" not in r.headers and "x-shared" not in r.headers, r.headers
    for r in metrics:
        assert r.headers.get("x-metrics-key") == "METRICS_SECRET", r.headers
        assert "x-trace-vendor-key" not in r.headers and "x-shared" not in r.headers, r.headers
        assert not any("TRACE_SECRET" in value for value in r.headers.values()), r.headers


def test_each_setting_is_the_signals_own_variable_else_the_general_one_else_the_default():
    """``ZoomerConfig.from_env``: each signal's protocol, endpoint, headers, timeout (ms) and compression."""
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317",
        "OTEL_EXPORTER_OTLP_HEADERS": "x-shared=both",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "7000",
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "x-trace-vendor-key=TRACE_SECRET",
        "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": "gzip",
        "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "HTTP/Protobuf",
        "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT": "2500",
    }
    exp = ZoomerConfig.from_env(env).export
    traces, metrics = exp.otlp("traces"), exp.otlp("metrics")
    assert (traces.protocol, traces.endpoint) == ("grpc", "http://collector:4317")
    assert dict(traces.headers) == {"x-trace-vendor-key": "TRACE_SECRET"}
    assert (traces.timeout_ms, traces.compression) == (7000, "gzip")
    # the general endpoint is a base URL: http/protobuf appends the metrics' path to it
    assert (metrics.protocol, metrics.endpoint) == ("http/protobuf", "http://collector:4317/v1/metrics")
    assert dict(metrics.headers) == {"x-shared": "both"}
    assert (metrics.timeout_ms, metrics.compression) == (2500, "none")
    # the metrics' own headers replace the general ones, as the traces' do
    metrics = ZoomerConfig.from_env({**env, "OTEL_EXPORTER_OTLP_METRICS_HEADERS": "x-metrics-key=M%20S",
                                     "OTEL_EXPORTER_OTLP_METRICS_COMPRESSION": "GZIP"}).export.otlp("metrics")
    assert dict(metrics.headers) == {"x-metrics-key": "M S"} and metrics.compression == "gzip"
    # nothing set: the defaults, the same for both
    exp = ZoomerConfig.from_env({}).export
    assert exp.otlp("traces") == exp.otlp("metrics")
    assert (exp.otlp("metrics").protocol, exp.otlp("metrics").timeout_ms) == ("grpc", 10_000)
    # a default endpoint follows the signal's own protocol
    exp = ZoomerConfig.from_env({"OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/protobuf"}).export
    assert exp.otlp("traces").endpoint == "http://localhost:4317"
    assert exp.otlp("metrics").endpoint == "http://localhost:4318/v1/metrics"


def test_the_senders_and_the_sdk_exporters_use_their_signals_settings():
    """The worker's senders and the OpenTelemetry SDK's exporters each take their own signal's settings."""
    import threading

    from zoomer_serve.export.transport import GrpcSender, HttpSender

    exp = ZoomerConfig.from_env({
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "x-trace-vendor-key=T",
        "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_METRICS_HEADERS": "x-metrics-key=M",
        "OTEL_EXPORTER_OTLP_METRICS_COMPRESSION": "gzip",
    }).export
    stop = threading.Event()
    traces, metrics = make_sender(exp, stop, "traces"), make_sender(exp, stop, "metrics")
    try:
        assert isinstance(traces, GrpcSender) and isinstance(metrics, HttpSender)
        assert metrics.endpoint == "http://localhost:4318/v1/metrics"
        assert dict(metrics.otlp.headers) == {"x-metrics-key": "M"} and metrics.otlp.compression == "gzip"
        assert dict(traces.otlp.headers) == {"x-trace-vendor-key": "T"}
    finally:
        traces.close()
        metrics.close()
    span_exporter, metric_exporter = sdk_span_exporter(exp), sdk_metric_exporter(exp)
    try:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
            OTLPMetricExporter as HttpMetricExporter,
        )

        assert ".grpc." in type(span_exporter).__module__ and isinstance(metric_exporter, HttpMetricExporter)
        kwargs = _sdk_exporter_kwargs(exp.otlp("metrics"))
        assert (kwargs["endpoint"], kwargs["headers"]) == ("http://localhost:4318/v1/metrics", {"x-metrics-key": "M"})
        assert kwargs["compression"].value == "gzip"
        assert _sdk_exporter_kwargs(exp.otlp("traces"))["headers"] == {"x-trace-vendor-key": "T"}
    finally:
        span_exporter.shutdown()
        metric_exporter.shutdown()


@pytest.mark.parametrize(("variable", "value", "needle"), [
    ("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "thrift", "is not supported"),
    ("OTEL_EXPORTER_OTLP_METRICS_COMPRESSION", "zstd", "is not supported"),
    ("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "soon", "must be an integer"),
    ("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "0", ">= 1"),
    ("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "9999999999999", "must be <= 2147483647"),
    ("OTEL_EXPORTER_OTLP_METRICS_HEADERS", "novalue", "expected key=value pairs"),
    ("OTEL_EXPORTER_OTLP_METRICS_HEADERS", "bad header=x", "not a valid header name"),
    ("OTEL_EXPORTER_OTLP_METRICS_HEADERS", "a=line1%0Aline2", "cannot carry"),
])
def test_a_bad_metrics_variable_is_refused_naming_it(variable, value, needle):
    """A bad value of a metrics variable is a ConfigError naming that variable, as the traces' are; a good
    value of the traces' or the general variable does not hide it."""
    with pytest.raises(ConfigError, match=needle) as err:
        ZoomerConfig.from_env({variable: value})
    assert variable in str(err.value), str(err.value)
    for other in (variable.replace("_METRICS_", "_TRACES_"), variable.replace("_METRICS_", "_")):
        good = "grpc" if "PROTOCOL" in other else "gzip" if "COMPRESSION" in other else \
            "100" if "TIMEOUT" in other else "k=v"
        with pytest.raises(ConfigError, match=variable):
            ZoomerConfig.from_env({variable: value, other: good})


def test_configure_arguments_apply_to_both_signals():
    """``configure(protocol=..., endpoint=..., timeout_ms=...)`` set both signals' settings, as they did when
    there was one set (the metrics' own variables do not outweigh an argument given in code)."""
    env = {"OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT": "2500"}
    cfg = ZoomerConfig.from_env(env)
    tel = zoomer_serve.configure(config=cfg, export_mode="none", protocol="grpc", endpoint="http://h:4317",
                                 timeout_ms=1234, set_global_providers=False)
    try:
        for signal in ("traces", "metrics"):
            otlp = tel.config.export.otlp(signal)
            assert (otlp.protocol, otlp.endpoint, otlp.timeout_ms) == ("grpc", "http://h:4317", 1234), signal
    finally:
        zoomer_serve.shutdown(timeout_s=1)
    # without the arguments each keeps its own; endpoint= is a base URL, its path per signal's protocol
    tel = zoomer_serve.configure(config=cfg, export_mode="none", endpoint="http://h:4318",
                                 set_global_providers=False)
    try:
        exp = tel.config.export
        assert exp.otlp("traces").endpoint == "http://h:4318"
        assert exp.otlp("metrics").endpoint == "http://h:4318/v1/metrics"
        assert (exp.otlp("traces").timeout_ms, exp.otlp("metrics").timeout_ms) == (10_000, 2500)
    finally:
        zoomer_serve.shutdown(timeout_s=1)


def test_an_export_config_built_in_code_keeps_its_meaning_and_checks_the_metrics_fields():
    """``ExportConfig(protocol=..., headers=..., timeout_ms=..., compression=...)`` in code still sets both
    signals (the ``metrics_*`` fields left None take them); a bad ``metrics_*`` field is refused naming it."""
    exp = ExportConfig(protocol="http/protobuf", headers={"k": "v"}, timeout_ms=300, compression="gzip",
                       traces_endpoint="http://h:4318/v1/traces", metrics_endpoint="http://h:4318/v1/metrics")
    metrics = exp.otlp("metrics")
    assert (metrics.protocol, dict(metrics.headers), metrics.timeout_ms, metrics.compression) == \
        ("http/protobuf", {"k": "v"}, 300, "gzip")
    assert ExportConfig(timeout_ms=300, metrics_timeout_ms=9000).export_budget_ms == 9000
    with pytest.raises(ConfigError, match=r"ExportConfig.metrics_protocol \(OTEL_EXPORTER_OTLP_METRICS_PROTOCOL\)"):
        ExportConfig(metrics_protocol="thrift")
    with pytest.raises(ConfigError, match=r"ExportConfig.metrics_compression"):
        ExportConfig(metrics_compression="zstd")
    with pytest.raises(ConfigError, match=r"ExportConfig.metrics_timeout_ms \(OTEL_EXPORTER_OTLP_METRICS_TIMEOUT\)"):
        ExportConfig(metrics_timeout_ms=0)
    with pytest.raises(ValueError, match="signal"):
        exp.otlp("logs")
