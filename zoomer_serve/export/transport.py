"""Senders of pre-encoded OTLP requests (traces or metrics): OTLP/gRPC and OTLP/HTTP (protobuf), with the
OTLP retry rules.

A sender takes the bytes of one ``ExportTraceServiceRequest`` (or ``ExportMetricsServiceRequest``) and a
deadline, retries retryable failures with exponential back-off until the deadline, and returns True when the
collector accepted the request. It never raises for network or server errors; those are returned as False
with ``last_error`` set.
"""

from __future__ import annotations

import gzip
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from zoomer_serve.config import ExportConfig

_GRPC_METHODS = {
    "traces": "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
    "metrics": "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export",
}
_RETRYABLE_HTTP = {429, 502, 503, 504}


class Sender:
    """Base class: ``send(payload, deadline)`` (deadline on ``time.monotonic()``) and ``close()``;
    ``signal`` is ``"traces"`` or ``"metrics"``."""

    def __init__(self, cfg: ExportConfig, stop: threading.Event, signal: str = "traces") -> None:
        self.cfg = cfg
        self.stop = stop
        self.signal = signal
        self.endpoint = cfg.traces_endpoint if signal == "traces" else cfg.metrics_endpoint
        self.last_error: str | None = None

    def send(self, payload: bytes, deadline: float) -> bool:
        delay = 0.1
        while True:
            ok, retryable = self._attempt(payload, deadline)
            if ok:
                self.last_error = None
                return True
            remaining = deadline - time.monotonic()
            if not retryable or remaining <= delay or self.stop.is_set():
                return False
            self.stop.wait(delay)
            delay = min(delay * 2, 5.0)

    def _attempt(self, payload: bytes, deadline: float) -> tuple[bool, bool]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class GrpcSender(Sender):
    """OTLP/gRPC: ``TraceService/Export`` (or ``MetricsService/Export``) with the payload passed through as
    raw bytes."""

    def __init__(self, cfg: ExportConfig, stop: threading.Event, signal: str = "traces") -> None:
        super().__init__(cfg, stop, signal)
        import grpc

        self._grpc = grpc
        url = urllib.parse.urlparse(self.endpoint)
        target = f"{url.hostname}:{url.port or (443 if url.scheme == 'https' else 4317)}"
        if url.hostname and ":" in url.hostname:
            target = f"[{url.hostname}]:{url.port or 4317}"
        if url.scheme == "https":
            self._channel = grpc.secure_channel(target, grpc.ssl_channel_credentials())
        else:
            self._channel = grpc.insecure_channel(target)
        self._call = self._channel.unary_unary(_GRPC_METHODS[signal], request_serializer=None,
                                               response_deserializer=None)
        self._metadata = tuple((k.lower(), v) for k, v in cfg.headers.items())
        self._compression = grpc.Compression.Gzip if cfg.compression == "gzip" else None
        self._retryable = {
            grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED,
            grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS,
        }

    def _attempt(self, payload: bytes, deadline: float) -> tuple[bool, bool]:
        timeout = max(0.05, deadline - time.monotonic())
        try:
            self._call(payload, timeout=timeout, metadata=self._metadata, compression=self._compression)
            return True, False
        except self._grpc.RpcError as err:
            code = err.code() if hasattr(err, "code") else None
            self.last_error = f"{code}: {err.details() if hasattr(err, 'details') else err}"
            return False, code in self._retryable
        except Exception as err:  # a broken channel must not kill the exporter
            self.last_error = repr(err)
            return False, True

    def close(self) -> None:
        self._channel.close()


class HttpSender(Sender):
    """OTLP/HTTP with ``Content-Type: application/x-protobuf`` (and gzip when configured)."""

    def _attempt(self, payload: bytes, deadline: float) -> tuple[bool, bool]:
        headers = {"Content-Type": "application/x-protobuf", **self.cfg.headers}
        body = payload
        if self.cfg.compression == "gzip":
            body = gzip.compress(payload)
            headers["Content-Encoding"] = "gzip"
        req = urllib.request.Request(self.endpoint, data=body, headers=headers, method="POST")
        timeout = max(0.05, deadline - time.monotonic())
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                resp.read()
            return True, False
        except urllib.error.HTTPError as err:
            self.last_error = f"HTTP {err.code}"
            return False, err.code in _RETRYABLE_HTTP
        except (urllib.error.URLError, OSError, TimeoutError) as err:
            self.last_error = repr(getattr(err, "reason", err))
            return False, True


def make_sender(cfg: ExportConfig, stop: threading.Event, signal: str = "traces") -> Sender:
    """The sender of ``signal`` (``"traces"`` or ``"metrics"``) for ``cfg.protocol``."""
    if cfg.protocol == "grpc":
        return GrpcSender(cfg, stop, signal)
    return HttpSender(cfg, stop, signal)


def sdk_metric_exporter(cfg: ExportConfig) -> Any:
    """The OpenTelemetry SDK's OTLP metric exporter for the same endpoint, protocol, headers and timeout."""
    if cfg.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc import metric_exporter
    else:
        from opentelemetry.exporter.otlp.proto.http import metric_exporter  # type: ignore[no-redef]
    return metric_exporter.OTLPMetricExporter(**_sdk_exporter_kwargs(cfg, cfg.metrics_endpoint))


def sdk_span_exporter(cfg: ExportConfig) -> Any:
    """The OpenTelemetry SDK's OTLP span exporter (for spans that user code starts with the API)."""
    if cfg.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc import trace_exporter
    else:
        from opentelemetry.exporter.otlp.proto.http import trace_exporter  # type: ignore[no-redef]
    return trace_exporter.OTLPSpanExporter(**_sdk_exporter_kwargs(cfg, cfg.traces_endpoint))


def _sdk_exporter_kwargs(cfg: ExportConfig, endpoint: str) -> dict[str, Any]:
    """Constructor arguments shared by the SDK's OTLP exporters of both protocols."""
    kwargs: dict[str, Any] = {"endpoint": endpoint, "headers": cfg.headers or None, "timeout": cfg.timeout_ms / 1000}
    gzip_on = cfg.compression == "gzip"
    if cfg.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.exporter import Compression as GrpcCompression

        kwargs["insecure"] = urllib.parse.urlparse(endpoint).scheme != "https"
        kwargs["compression"] = GrpcCompression.Gzip if gzip_on else None
    else:
        from opentelemetry.exporter.otlp.proto.http import Compression as HttpCompression

        kwargs["compression"] = HttpCompression.Gzip if gzip_on else HttpCompression.NoCompression
    return kwargs
