"""The OpenTelemetry SDK's OTLP metric exporter as zoomer-serve builds it (GPU and host telemetry go through it):
its failures counted, its log kept to the first failed export, then a real collector takes the totals."""

from __future__ import annotations

import logging
import socket

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

from zoomer_serve.config import ZoomerConfig
from zoomer_serve.export.sdk_metrics import SDK_EXPORTER_LOGGERS
from zoomer_serve.export.transport import sdk_metric_exporter


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_a_collector_that_is_down_gets_one_failure_logged_and_every_failed_export_counted(
        protocol: str, caplog: pytest.LogCaptureFixture) -> None:
    """With the collector down, the SDK's exporter logged a warning per retry and an error per export, every
    export interval, for as long as it was down (a trial's ``serve-demo`` without a collector), beside
    zoomer-serve's own "logged once" line. Now: the first failed export's lines as the SDK writes them, none
    from the 3 after it, one line of ours at the first failure, and at shutdown the count of failed exports and
    of the data points in them (here 1 + 2 + 3 + 3: one more series each round, the last export at shutdown)."""
    port = _closed_port()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_EXPORTER_OTLP_TIMEOUT": "1000",
           "OTEL_EXPORTER_OTLP_PROTOCOL": protocol}

    def sdk_lines_so_far() -> int:  # this exporter's (an earlier test's SDK provider may still be retrying)
        if protocol == "grpc":
            return sum(r.name in SDK_EXPORTER_LOGGERS and str(port) in r.getMessage() for r in caplog.records)
        return sum(r.name.endswith(".http.metric_exporter") for r in caplog.records)

    exporter = sdk_metric_exporter(ZoomerConfig.from_env(env).export)
    provider = MeterProvider(metric_readers=[PeriodicExportingMetricReader(
        exporter, export_interval_millis=10**8, export_timeout_millis=1000)])
    counter = provider.get_meter("t").create_counter("calls")
    caplog.set_level(logging.INFO)
    sdk_lines = []
    for i in range(3):
        counter.add(1, {"round": str(i)})
        provider.force_flush()
        sdk_lines.append(sdk_lines_so_far())
    provider.shutdown()
    ours = [r.getMessage() for r in caplog.records if r.name == "zoomer_serve.export" and str(port) in r.getMessage()]
    assert sdk_lines[0] >= 1 and sdk_lines[0] == sdk_lines[1] == sdk_lines[2], sdk_lines
    assert sdk_lines_so_far() == sdk_lines[0]
    assert (exporter.exports, exporter.failed_exports, exporter.failed_points) == (4, 4, 9)
    assert len(ours) == 2 and "could not export the OpenTelemetry SDK's metrics" in ours[0], ours
    assert "4 of 4 exports" in ours[1] and "9 data points" in ours[1], ours


def test_exports_that_succeed_are_counted_and_log_nothing(collector, caplog: pytest.LogCaptureFixture) -> None:
    """The same exporter against the embedded collector: every export counted, none failed, nothing logged, and
    the counter's points are in the store."""
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.grpc_endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    exporter = sdk_metric_exporter(ZoomerConfig.from_env(env).export)
    provider = MeterProvider(metric_readers=[PeriodicExportingMetricReader(exporter, export_interval_millis=10**8)])
    counter = provider.get_meter("t").create_counter("zoomer.test.calls")
    caplog.set_level(logging.INFO)
    counter.add(5)
    provider.force_flush()
    provider.shutdown()
    assert (exporter.exports, exporter.failed_exports) == (2, 0)
    assert not [r for r in caplog.records if r.name == "zoomer_serve.export" or r.name in SDK_EXPORTER_LOGGERS]
    assert max(p["value"] for p in collector.metric_points("zoomer.test.calls")) == 5


def test_the_telemetrys_shutdown_sums_up_the_failures_even_when_the_sdk_is_still_retrying(
        caplog: pytest.LogCaptureFixture) -> None:
    """``configure()`` with the collector down: the SDK meter provider's final export is still being retried
    when zoomer-serve's shutdown deadline passes (the provider is left behind on its thread); the summary of the
    failed exports is logged all the same (``serve-demo`` failing to bind its port printed none)."""
    import zoomer_serve

    tel = zoomer_serve.configure(service_name="sdk-down", endpoint=f"http://127.0.0.1:{_closed_port()}",
                                 protocol="grpc")
    try:
        tel.meter_provider.get_meter("t").create_counter("zoomer.test.calls").add(1)
        caplog.set_level(logging.INFO)
        tel.force_flush(1.0)
    finally:
        tel.shutdown(timeout_s=1.0)
    ours = [r.getMessage() for r in caplog.records if r.name == "zoomer_serve.export"]
    assert any("exports of the OpenTelemetry SDK's metrics" in m and "failed" in m for m in ours), ours
