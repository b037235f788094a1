"""Exporters trust a TLS collector's certificate: ``OTEL_EXPORTER_OTLP_CERTIFICATE`` (and its ``_TRACES_`` /
``_METRICS_`` forms, resolved like the other per-signal settings) is the root of trust of https endpoints, for
zoomer-serve's own senders (gRPC and OTLP/HTTP) and for the OpenTelemetry SDK's exporters; a file that does not
exist or holds no PEM certificate is a ConfigError naming the variable and the path, at configuration time.

It was silently ignored: a collector started with ``--tls-cert`` / ``--tls-key`` (a self-signed certificate)
refused every export (``CERTIFICATE_VERIFY_FAILED``), exported=0, and a certificate path that did not exist was
not flagged."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from _collector_fixtures import raw_trace_request
from _scripted_otlp import ScriptedOtlp, request_records
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

import zoomer_serve
from zoomer_serve.collector import EmbeddedCollector
from zoomer_serve.collector.security import ReceiverSecurity
from zoomer_serve.config import ConfigError, ExportConfig, ZoomerConfig
from zoomer_serve.export import ExportWorker
from zoomer_serve.export.transport import Outcome, make_sender, sdk_metric_exporter, sdk_span_exporter

N = 7


def _self_signed(tmp_path: Path, name: str = "cert") -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 / localhost and its key (as a collector's ``--tls-cert``)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    cert, key = tmp_path / f"{name}.pem", tmp_path / f"{name}-key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
    return cert, key


@contextmanager
def tls_collector(tmp_path: Path) -> Iterator[tuple[EmbeddedCollector, Path]]:
    """A real embedded collector whose both receivers speak TLS only, and its certificate."""
    cert, key = _self_signed(tmp_path)
    security = ReceiverSecurity(tls_cert=cert, tls_key=key)
    with EmbeddedCollector(tmp_path / "s.duckdb", grpc_port=0, http_port=0, security=security) as collector:
        yield collector, cert


def _env(collector: EmbeddedCollector, protocol: str, **more: str) -> dict[str, str]:
    port = collector.grpc_port if protocol == "grpc" else collector.http_port
    return {"OTEL_EXPORTER_OTLP_PROTOCOL": protocol, "OTEL_EXPORTER_OTLP_ENDPOINT": f"https://127.0.0.1:{port}",
            "OTEL_EXPORTER_OTLP_TIMEOUT": "3000", "OTEL_BSP_SCHEDULE_DELAY": "50", "ZOOMER_EXPORT_MODE": "thread",
            "OTEL_METRICS_EXPORTER": "none", **more}


def _export(cfg: ExportConfig, n: int, budget_s: float = 8.0) -> tuple[int, str]:
    worker = ExportWorker(cfg, {"service.name": "tls"})
    worker.start()
    worker.put(request_records(n))
    stats = worker.shutdown(budget_s)
    return stats.exported, stats.last_error or ""


def _spans_received(collector: EmbeddedCollector, n: int) -> int:
    deadline = time.monotonic() + 20
    while collector.stats()["spans_received"] < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return int(collector.stats()["spans_received"])


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_spans_reach_a_tls_collector_that_the_certificate_variable_trusts(tmp_path: Path, protocol: str) -> None:
    """With ``OTEL_EXPORTER_OTLP_CERTIFICATE`` naming the collector's self-signed certificate, all N spans of
    zoomer-serve's sender and the OpenTelemetry SDK's span exporter are stored; without it the same export is
    refused at once (certificate verify failed, not retried), the error naming the variable, and nothing is
    stored."""
    with tls_collector(tmp_path) as (collector, cert):
        started = time.monotonic()
        exported, error = _export(ZoomerConfig.from_env(_env(collector, protocol)).export, N)
        assert exported == 0 and "CERTIFICATE_VERIFY_FAILED" in error.upper().replace(" ", "_"), error
        # not retried until the budget runs out: the error names the variable to set
        assert "set OTEL_EXPORTER_OTLP_CERTIFICATE" in error and time.monotonic() - started < 5, error
        assert collector.stats()["spans_received"] == 0

        cfg = ZoomerConfig.from_env(_env(collector, protocol, OTEL_EXPORTER_OTLP_CERTIFICATE=str(cert))).export
        assert cfg.otlp("traces").certificate == str(cert)
        exported, error = _export(cfg, N)
        assert exported == N, error
        assert _spans_received(collector, N) == N

        # the SDK's exporter (spans user code starts with the OpenTelemetry API) gets the same trust
        provider = TracerProvider(resource=Resource.create({"service.name": "tls-sdk"}))
        provider.add_span_processor(SimpleSpanProcessor(sdk_span_exporter(cfg)))
        for i in range(3):
            with provider.get_tracer("t").start_as_current_span(f"sdk-{i}"):
                pass
        provider.shutdown()
        assert _spans_received(collector, N + 3) == N + 3


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_the_traces_certificate_applies_to_traces_only(tmp_path: Path, protocol: str) -> None:
    """``OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE`` is the traces' root of trust and never the metrics' (nor
    ``..._METRICS_CERTIFICATE`` the traces'): real sends of each signal to the TLS collector."""
    with tls_collector(tmp_path) as (collector, cert):
        cfg = ZoomerConfig.from_env(_env(collector, protocol,
                                         OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE=str(cert))).export
        assert cfg.otlp("traces").certificate == str(cert) and cfg.otlp("metrics").certificate is None
        stop = threading.Event()
        payload = raw_trace_request(4).SerializeToString()
        traces = make_sender(cfg, stop, "traces")
        try:
            result = traces.send(payload, time.monotonic() + 5)
        finally:
            traces.close()
        assert result.outcome is Outcome.ACCEPTED, result
        metrics = make_sender(cfg, stop, "metrics")
        try:
            # a trace request on the metrics' connection: refused by TLS before any OTLP is read
            failed = metrics.send(b"", time.monotonic() + 1)
        finally:
            metrics.close()
        assert failed.outcome is Outcome.FAILED and "CERTIFICATE_VERIFY_FAILED" in \
            failed.message.upper().replace(" ", "_"), failed

        other = ZoomerConfig.from_env(_env(collector, protocol,
                                           OTEL_EXPORTER_OTLP_METRICS_CERTIFICATE=str(cert))).export
        assert other.otlp("metrics").certificate == str(cert) and other.otlp("traces").certificate is None
        exported, error = _export(other, 2)
        assert exported == 0 and error, error
    assert _spans_received(collector, 4) == 4


def test_the_certificate_reaches_the_export_helper_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through ``configure()`` with the export helper process (as a server runs): the path travels to the helper
    and every span reaches the TLS collector over gRPC."""
    with tls_collector(tmp_path) as (collector, cert):
        for name, value in _env(collector, "grpc", OTEL_EXPORTER_OTLP_CERTIFICATE=str(cert)).items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("ZOOMER_EXPORT_MODE", "process")
        zoomer_serve.configure(service_name="tls-helper", set_global_providers=False)
        recorder = zoomer_serve.get_recorder()
        for i in range(N):
            span = recorder.start("svc.S/M", attributes={"rpc.method": "svc.S/M", "rpc.system.name": "grpc", "i": i})
            span.end()
        assert zoomer_serve.shutdown(timeout_s=10) is not None
        assert _spans_received(collector, N) == N


@pytest.mark.parametrize("variable", ["OTEL_EXPORTER_OTLP_CERTIFICATE", "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE",
                                      "OTEL_EXPORTER_OTLP_METRICS_CERTIFICATE"])
def test_a_certificate_file_that_is_missing_or_not_pem_is_a_config_error(tmp_path: Path, variable: str) -> None:
    """At configuration time, naming the variable and the path: a file that does not exist, one that holds no
    PEM certificate. ``configure()`` raises it too (before any export starts)."""
    missing = tmp_path / "no-such-cert.pem"
    with pytest.raises(ConfigError, match=f"{variable}.*{missing}"):
        ZoomerConfig.from_env({variable: str(missing)})
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match=f"{variable}.*{junk}"):
        ZoomerConfig.from_env({variable: str(junk)})
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_CERTIFICATE"):
        ExportConfig(certificate=str(missing))


def test_tls_files_are_checked_once_by_export_config_naming_where_each_path_came_from(tmp_path: Path) -> None:
    """One check (ExportConfig's) for the environment and for code: a path read from the environment is named by
    its variable, also in the config the export helper rebuilds from the spec it is sent; one set in code by its
    field; the metrics' path taken from the shared field by that field."""
    from dataclasses import asdict, replace

    cert, _ = _self_signed(tmp_path)
    cfg = ZoomerConfig.from_env({"OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE": str(cert)}).export
    assert cfg.read_from["certificate"] == "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE"
    assert cfg.read_from["metrics_certificate"] == "OTEL_EXPORTER_OTLP_CERTIFICATE"  # (unset: none)
    assert ExportConfig(**asdict(cfg)) == cfg  # as the helper process rebuilds it
    cert.unlink()
    with pytest.raises(ConfigError, match=f"^OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE='{cert}': cannot read"):
        ExportConfig(**asdict(cfg))
    with pytest.raises(ConfigError, match=r"^ExportConfig.certificate \(OTEL_EXPORTER_OTLP_CERTIFICATE\)="):
        replace(cfg, certificate=str(tmp_path / "other.pem"), read_from={})
    with pytest.raises(ConfigError, match=r"^ExportConfig.certificate \(OTEL_EXPORTER_OTLP_CERTIFICATE\)="):
        ExportConfig(certificate=str(cert), metrics_certificate=None)  # the metrics' file is the shared field's
    with pytest.raises(ConfigError, match=r"^ExportConfig.metrics_certificate \(OTEL_EXPORTER_OTLP_METRICS_"):
        ExportConfig(metrics_certificate=str(cert))


def test_client_key_and_certificate_are_checked_and_go_together(tmp_path: Path) -> None:
    """mTLS: ``..._CLIENT_KEY`` and ``..._CLIENT_CERTIFICATE`` name a matching PEM key and certificate, both or
    neither (per signal, like the others); a missing file names its variable."""
    cert, key = _self_signed(tmp_path, "client")
    env = {"OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": str(cert), "OTEL_EXPORTER_OTLP_CLIENT_KEY": str(key)}
    exp = ZoomerConfig.from_env(env).export
    for signal in ("traces", "metrics"):
        assert (exp.otlp(signal).client_certificate, exp.otlp(signal).client_key) == (str(cert), str(key))
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_CLIENT_KEY"):
        ZoomerConfig.from_env({"OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": str(cert)})
    with pytest.raises(ConfigError, match=f"OTEL_EXPORTER_OTLP_METRICS_CLIENT_KEY.*{tmp_path / 'nope.pem'}"):
        ZoomerConfig.from_env({**env, "OTEL_EXPORTER_OTLP_METRICS_CLIENT_KEY": str(tmp_path / "nope.pem")})
    other, other_key = _self_signed(tmp_path, "other")
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE"):
        ZoomerConfig.from_env({"OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": str(cert),
                               "OTEL_EXPORTER_OTLP_CLIENT_KEY": str(other_key)})
    traces_only = ZoomerConfig.from_env({"OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE": str(other),
                                         "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY": str(other_key)}).export
    assert traces_only.otlp("traces").client_key == str(other_key) and traces_only.otlp("metrics").client_key is None


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_a_client_certificate_reaches_a_server_that_requires_one(tmp_path: Path, protocol: str) -> None:
    """mTLS: a real OTLP receiver that requires a client certificate signed by its CA takes every span when
    ``OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE`` / ``..._CLIENT_KEY`` name it (with the server's certificate
    trusted), and refuses them all without it."""
    server_cert, server_key = _self_signed(tmp_path, "server")
    client_cert, client_key = _self_signed(tmp_path, "client")
    with ScriptedOtlp(protocol, mtls=(str(server_cert), str(server_key), str(client_cert))) as receiver:
        endpoint = f"https://127.0.0.1:{receiver.port}"
        env = {"OTEL_EXPORTER_OTLP_PROTOCOL": protocol, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
               "OTEL_EXPORTER_OTLP_TIMEOUT": "2000", "OTEL_BSP_SCHEDULE_DELAY": "50",
               "ZOOMER_EXPORT_MODE": "thread", "OTEL_METRICS_EXPORTER": "none",
               "OTEL_EXPORTER_OTLP_CERTIFICATE": str(server_cert)}
        exported, error = _export(ZoomerConfig.from_env(env).export, 3, budget_s=2.0)  # refused: retried to the end
        assert exported == 0 and error, error
        mtls = {**env, "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE": str(client_cert),
                "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY": str(client_key)}
        exported, error = _export(ZoomerConfig.from_env(mtls).export, N)
        assert exported == N, error
        assert sum(r.items for r in receiver.requests("traces")) == N


# -- OTEL_EXPORTER_OTLP_INSECURE: a gRPC endpoint without a scheme -----------------------------------------------

@contextmanager
def plain_collector(tmp_path: Path) -> Iterator[EmbeddedCollector]:
    """A real embedded collector whose receivers speak plaintext only."""
    with EmbeddedCollector(tmp_path / "plain.duckdb", grpc_port=0, http_port=0) as collector:
        yield collector


def _grpc_env(endpoint: str, **more: str) -> dict[str, str]:
    return {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
            "OTEL_EXPORTER_OTLP_TIMEOUT": "3000", "OTEL_BSP_SCHEDULE_DELAY": "50", "ZOOMER_EXPORT_MODE": "thread",
            "OTEL_METRICS_EXPORTER": "none", **more}


def _sdk_spans(cfg: ExportConfig, n: int) -> None:
    """``n`` spans through the OpenTelemetry SDK's exporter that zoomer-serve configures from ``cfg``."""
    provider = TracerProvider(resource=Resource.create({"service.name": "insecure-sdk"}))
    provider.add_span_processor(SimpleSpanProcessor(sdk_span_exporter(cfg)))
    for i in range(n):
        with provider.get_tracer("t").start_as_current_span(f"sdk-{i}"):
            pass
    provider.shutdown()


def _sdk_metric_points(cfg: ExportConfig) -> None:
    """One counter point through the OpenTelemetry SDK's metric exporter that zoomer-serve configures."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    reader = PeriodicExportingMetricReader(sdk_metric_exporter(cfg), export_interval_millis=3_600_000)
    provider = MeterProvider(metric_readers=[reader], resource=Resource.create({"service.name": "insecure-sdk"}))
    provider.get_meter("t").create_counter("insecure.test").add(1)
    provider.shutdown()


@pytest.mark.parametrize("insecure", ["false", None])
def test_a_scheme_less_grpc_endpoint_is_tls_unless_insecure_is_true(tmp_path: Path, insecure: str | None) -> None:
    """``OTEL_EXPORTER_OTLP_ENDPOINT=127.0.0.1:<port>`` (no scheme) with ``OTEL_EXPORTER_OTLP_INSECURE=false``, or
    unset (the spec's default, as the OpenTelemetry Python SDK does), is TLS: with the collector's certificate
    every span of zoomer-serve's sender (N) and of the SDK's exporter (3) is stored over TLS, and the SDK's metric
    point too. It was a ConfigError (not an http:// or https:// URL)."""
    with tls_collector(tmp_path) as (collector, cert):
        more = {"OTEL_EXPORTER_OTLP_CERTIFICATE": str(cert)}
        if insecure is not None:
            more["OTEL_EXPORTER_OTLP_INSECURE"] = insecure
        cfg = ZoomerConfig.from_env(_grpc_env(f"127.0.0.1:{collector.grpc_port}", **more)).export
        assert cfg.otlp("traces").secure and cfg.otlp("metrics").secure
        exported, error = _export(cfg, N)
        assert exported == N, error
        _sdk_spans(cfg, 3)
        assert _spans_received(collector, N + 3) == N + 3
        _sdk_metric_points(cfg)
        assert collector.stats()["metric_points_received"] >= 1


def test_insecure_true_sends_plaintext_to_a_scheme_less_endpoint(tmp_path: Path) -> None:
    """``OTEL_EXPORTER_OTLP_INSECURE=true`` (any case) with a scheme-less gRPC endpoint: plaintext, every span of
    zoomer-serve's sender, of the SDK's exporter and the SDK's metric point stored by a plaintext collector; the
    same endpoint without it (TLS, the default) stores nothing."""
    with plain_collector(tmp_path) as collector:
        endpoint = f"127.0.0.1:{collector.grpc_port}"
        tls = ZoomerConfig.from_env(_grpc_env(endpoint, OTEL_EXPORTER_OTLP_TIMEOUT="1000")).export
        exported, error = _export(tls, 2, budget_s=1.5)
        assert exported == 0 and error, error
        assert collector.stats()["spans_received"] == 0

        cfg = ZoomerConfig.from_env(_grpc_env(endpoint, OTEL_EXPORTER_OTLP_INSECURE=" True ")).export
        assert not cfg.otlp("traces").secure and not cfg.otlp("metrics").secure
        exported, error = _export(cfg, N)
        assert exported == N, error
        _sdk_spans(cfg, 3)
        assert _spans_received(collector, N + 3) == N + 3
        _sdk_metric_points(cfg)
        assert collector.stats()["metric_points_received"] >= 1


def test_insecure_reaches_the_export_helper_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through ``configure()`` with the export helper process (as a server runs): a scheme-less endpoint with
    ``OTEL_EXPORTER_OTLP_TRACES_INSECURE=true`` sends every span in plaintext to the plaintext collector."""
    with plain_collector(tmp_path) as collector:
        for name, value in _grpc_env(f"127.0.0.1:{collector.grpc_port}",
                                     OTEL_EXPORTER_OTLP_TRACES_INSECURE="true").items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("ZOOMER_EXPORT_MODE", "process")
        zoomer_serve.configure(service_name="insecure-helper", set_global_providers=False)
        recorder = zoomer_serve.get_recorder()
        for i in range(N):
            span = recorder.start("svc.S/M", attributes={"rpc.method": "svc.S/M", "rpc.system.name": "grpc", "i": i})
            span.end()
        assert zoomer_serve.shutdown(timeout_s=10) is not None
        assert _spans_received(collector, N) == N


def test_a_scheme_wins_over_insecure(tmp_path: Path) -> None:
    """The spec: insecure applies only to an endpoint without a scheme. ``http://`` with ``INSECURE=false`` is
    plaintext (all N stored by the plaintext collector; the OpenTelemetry Python SDK alone would use TLS there),
    ``https://`` with ``INSECURE=true`` is TLS (all N stored by the TLS collector)."""
    with plain_collector(tmp_path) as collector:
        cfg = ZoomerConfig.from_env(_grpc_env(f"http://127.0.0.1:{collector.grpc_port}",
                                              OTEL_EXPORTER_OTLP_INSECURE="false")).export
        assert not cfg.otlp("traces").secure
        exported, error = _export(cfg, N)
        assert exported == N, error
        _sdk_spans(cfg, 3)
        assert _spans_received(collector, N + 3) == N + 3
    with tls_collector(tmp_path) as (collector, cert):
        cfg = ZoomerConfig.from_env(_grpc_env(f"https://127.0.0.1:{collector.grpc_port}",
                                              OTEL_EXPORTER_OTLP_INSECURE="true",
                                              OTEL_EXPORTER_OTLP_CERTIFICATE=str(cert))).export
        assert cfg.otlp("traces").secure
        exported, error = _export(cfg, N)
        assert exported == N, error
        _sdk_spans(cfg, 3)
        assert _spans_received(collector, N + 3) == N + 3


def test_insecure_is_per_signal_and_a_bad_value_names_its_variable() -> None:
    """``..._TRACES_INSECURE`` / ``..._METRICS_INSECURE`` are read first for their signal only; a value other than
    true or false (any case; empty is unset) is a ConfigError naming the variable; a scheme-less endpoint needs a
    port and the grpc protocol (OTLP/HTTP endpoints are URLs)."""
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4317", "OTEL_EXPORTER_OTLP_INSECURE": "FALSE",
           "OTEL_EXPORTER_OTLP_TRACES_INSECURE": "true"}
    exp = ZoomerConfig.from_env(env).export
    assert (exp.otlp("traces").endpoint, exp.otlp("metrics").endpoint) == \
        ("http://collector:4317", "https://collector:4317")
    exp = ZoomerConfig.from_env({**env, "OTEL_EXPORTER_OTLP_TRACES_INSECURE": "",
                                 "OTEL_EXPORTER_OTLP_METRICS_INSECURE": "true"}).export
    assert (exp.otlp("traces").secure, exp.otlp("metrics").secure) == (True, False)
    exp = ZoomerConfig.from_env({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "[::1]:4317",
                                 "OTEL_EXPORTER_OTLP_INSECURE": "true"}).export
    assert exp.otlp("traces").endpoint == "http://[::1]:4317"
    for variable in ("OTEL_EXPORTER_OTLP_INSECURE", "OTEL_EXPORTER_OTLP_TRACES_INSECURE",
                     "OTEL_EXPORTER_OTLP_METRICS_INSECURE"):
        for bad in ("yes", "1", "on"):
            with pytest.raises(ConfigError, match=f"{variable}='{bad}'.*true or false"):
                ZoomerConfig.from_env({variable: bad})
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_ENDPOINT.*port"):
        ZoomerConfig.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "collector"})
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_TRACES_ENDPOINT.*port"):
        ZoomerConfig.from_env({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "collector:http"})
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_ENDPOINT"):
        ZoomerConfig.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318",
                               "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
