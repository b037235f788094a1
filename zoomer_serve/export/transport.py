"""Senders of pre-encoded OTLP requests (traces or metrics): OTLP/gRPC and OTLP/HTTP (protobuf), following the
OTLP exporter rules of opentelemetry-proto ``docs/specification.md``.

A sender takes the bytes of one ``ExportTraceServiceRequest`` (or ``ExportMetricsServiceRequest``) and a
deadline (``time.monotonic()``) and returns a :class:`SendResult`. It never raises for network or server errors.

- Retryable: gRPC ``CANCELLED``, ``DEADLINE_EXCEEDED``, ``ABORTED``, ``OUT_OF_RANGE``, ``UNAVAILABLE``,
  ``DATA_LOSS``, and ``RESOURCE_EXHAUSTED`` only when the server sends ``google.rpc.RetryInfo`` (in the
  ``grpc-status-details-bin`` trailer); HTTP 429, 502, 503, 504 and a connection that fails or breaks.
  Anything else fails at once.
- The delay before a retry: the server's (``RetryInfo.retry_delay``, HTTP ``Retry-After`` in seconds or as
  an HTTP date) when it names one, else exponential back-off from 100 ms doubling up to 5 s. A delay that
  would end past the deadline ends the send at once (FAILED): the export timeout bounds everything.
- Too large: HTTP 413, and gRPC ``RESOURCE_EXHAUSTED`` about the message size (grpc's "... larger than max
  (N vs. M)", from the server or from the client's own channel limit) return TOO_LARGE, never retried as is:
  the caller splits the batch (:class:`zoomer_serve.export.worker.ExportWorker`).
- Credentials refused: gRPC ``UNAUTHENTICATED`` / ``PERMISSION_DENIED`` and HTTP 401 / 403 fail at once (an
  ``export_failed`` like any failed export); the error says that the collector refused the credentials and how
  to send them (``OTEL_EXPORTER_OTLP_HEADERS=authorization=Bearer%20<token>``).
- Each signal is sent with its own connection settings (:meth:`zoomer_serve.config.ExportConfig.otlp`: endpoint,
  protocol, headers, timeout, compression): the traces' never go with the metrics, nor the metrics' with the traces.
- TLS: an ``https`` endpoint is reached over TLS (a secure gRPC channel, HTTPS) whose root of trust is the
  signal's ``certificate`` file (``OTEL_EXPORTER_OTLP_CERTIFICATE`` and its per-signal forms) when set, else the
  system's trusted CAs; with ``client_certificate`` and ``client_key`` (``..._CLIENT_CERTIFICATE``,
  ``..._CLIENT_KEY``) the exporter presents that certificate (mTLS). An ``http`` endpoint never uses them (a
  gRPC endpoint set without a scheme is already ``https`` or, by ``OTEL_EXPORTER_OTLP_INSECURE=true``,
  ``http``: :mod:`zoomer_serve.config`). A
  server certificate that does not verify (``CERTIFICATE_VERIFY_FAILED``) fails at once, not retried: the error
  says which variable names the certificate to trust.
- Accepted: ``partial_success`` of the response (``rejected_spans`` / ``rejected_data_points`` and
  ``error_message``) is returned in the result; such a response is never retried.
"""

from __future__ import annotations

import email.utils
import enum
import gzip
import http.client
import re
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from zoomer_serve import envvars
from zoomer_serve.config import ExportConfig, OtlpConnection

_GRPC_METHODS = {
    "traces": "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
    "metrics": "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export",
}
_RETRYABLE_HTTP = {429, 502, 503, 504}
_TOO_LARGE_HTTP = 413
_TOO_LARGE_TEXT = re.compile(r"larger than max|too large", re.IGNORECASE)  # grpc core's size errors
_CREDENTIALS_HTTP = {401, 403}
_STATUS_DETAILS_KEY = "grpc-status-details-bin"
_FIRST_BACKOFF_S = 0.1
_MAX_BACKOFF_S = 5.0


class Outcome(enum.Enum):
    """How one send ended."""

    ACCEPTED = "accepted"  # the collector answered success (possibly a partial success)
    TOO_LARGE = "too_large"  # refused for its size: split the batch and send the halves
    FAILED = "failed"  # not retryable, retries exhausted, or the deadline came first


@dataclass(frozen=True)
class SendResult:
    """The result of :meth:`Sender.send`: ``rejected`` items (spans or data points) and ``message`` from the
    response's ``partial_success`` when ACCEPTED; otherwise ``message`` is the error."""

    outcome: Outcome
    rejected: int = 0
    message: str = ""


@dataclass(frozen=True)
class _Attempt:
    """One request's result: ``response`` (the body) when accepted, else how to go on."""

    response: bytes | None = None
    retryable: bool = False
    too_large: bool = False
    retry_after_s: float | None = None  # the delay the server asked for


def _partial_success(signal: str, body: bytes) -> tuple[int, str]:
    """(rejected items, error_message) of an ``Export*ServiceResponse``; (0, "") for an empty or unparsable
    body (the request was accepted: a proxy's body that is not protobuf does not undo that)."""
    if not body:
        return 0, ""
    from google.protobuf.message import DecodeError

    if signal == "traces":
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

        try:
            partial = ExportTraceServiceResponse.FromString(body).partial_success
        except DecodeError:
            return 0, ""
        return max(0, partial.rejected_spans), partial.error_message
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse

    try:
        points = ExportMetricsServiceResponse.FromString(body).partial_success
    except DecodeError:
        return 0, ""
    return max(0, points.rejected_data_points), points.error_message


class Sender:
    """Base class: ``send(payload, deadline)`` and ``close()``; ``signal`` is ``"traces"`` or ``"metrics"``, whose
    connection settings (``otlp``: endpoint, headers, compression) it sends with.
    ``stop`` set means the worker is shutting down: no retry after that (the send returns FAILED).

    Raises (constructor):
        ValueError: ``signal`` is neither ``"traces"`` nor ``"metrics"``.
    """

    def __init__(self, cfg: ExportConfig, stop: threading.Event, signal: str = "traces") -> None:
        self.cfg = cfg
        self.stop = stop
        self.signal = signal
        self.otlp = cfg.otlp(signal)
        self.endpoint = self.otlp.endpoint
        self.last_error: str | None = None

    def send(self, payload: bytes, deadline: float) -> SendResult:
        """Send one request, retrying as the module docstring says, until ``deadline``."""
        backoff = _FIRST_BACKOFF_S
        while True:
            attempt = self._attempt(payload, deadline)
            if attempt.response is not None:
                self.last_error = None
                rejected, message = _partial_success(self.signal, attempt.response)
                return SendResult(Outcome.ACCEPTED, rejected, message)
            if attempt.too_large:
                return SendResult(Outcome.TOO_LARGE, message=self.last_error or "")
            if not attempt.retryable or self.stop.is_set():
                return SendResult(Outcome.FAILED, message=self.last_error or "")
            delay = backoff if attempt.retry_after_s is None else attempt.retry_after_s
            if time.monotonic() + delay >= deadline:
                if attempt.retry_after_s is not None:
                    self.last_error = (f"{self.last_error} (the server asked to retry in {delay:.3g} s, past the "
                                       "export timeout)")
                return SendResult(Outcome.FAILED, message=self.last_error or "")
            self.stop.wait(delay)
            backoff = min(max(backoff, delay) * 2, _MAX_BACKOFF_S)

    def _attempt(self, payload: bytes, deadline: float) -> _Attempt:
        raise NotImplementedError

    def close(self) -> None:
        pass


HEADERS_HINT = envvars.BEARER_HEADERS_HINT
"""How an exporter of this project sends a collector's bearer token (``ZOOMER_COLLECTOR_TOKEN``); the collector's
refusal says the same (:data:`zoomer_serve.collector.security.UNAUTHENTICATED_MESSAGE`)."""


def credentials_refused(status: str, message: str, headers: Mapping[str, str], signal: str = "traces") -> str:
    """The error of an export whose credentials the collector refused (``status``: its gRPC status or HTTP code;
    ``message``: its answer, left out when it already gives this hint, as a zoomer-serve collector's does),
    saying whether an ``authorization`` header was sent (``headers``: those of ``signal``'s requests) and how to
    send the right one."""
    if message and HEADERS_HINT not in message:
        status = f"{status}: {message}"
    if any(name.lower() == "authorization" for name in headers):
        sent = (f"the authorization header set by OTEL_EXPORTER_OTLP_HEADERS (or ..._{signal.upper()}_HEADERS) is "
                "not the one it expects")
    else:
        sent = "no authorization header was sent"
    return (f"the collector refused the credentials ({status}): {sent}; set {HEADERS_HINT} with the collector's "
            "token (its ZOOMER_COLLECTOR_TOKEN)")


_VERIFY_FAILED = "CERTIFICATE_VERIFY_FAILED"


def certificate_not_trusted(detail: str, otlp: OtlpConnection, signal: str = "traces") -> str:
    """The error of an export whose server certificate did not verify (``detail``: the TLS error), saying which
    variable names the certificate to trust and, when one is set, that it does not verify this server."""
    variable = f"OTEL_EXPORTER_OTLP_CERTIFICATE (or ..._{signal.upper()}_CERTIFICATE)"
    if otlp.certificate:
        advice = (f"the certificate file set by {variable}, {otlp.certificate}, does not verify it (the collector's "
                  "certificate, or its CA, and its names must include the endpoint's host)")
    else:
        advice = f"set {variable} to the PEM file of the collector's certificate (or its CA)"
    return f"the server's TLS certificate is not trusted ({detail}): {advice}"


def _retry_info(err: Any) -> tuple[bool, float | None]:
    """(RetryInfo present, its delay in seconds or None when zero) from a grpc error's
    ``grpc-status-details-bin`` trailer (a ``google.rpc.Status``)."""
    try:
        trailers = err.trailing_metadata() or ()
    except Exception:
        return False, None
    for key, value in trailers:
        if key != _STATUS_DETAILS_KEY:
            continue
        from google.protobuf.message import DecodeError
        from google.rpc import error_details_pb2, status_pb2

        try:
            status = status_pb2.Status.FromString(value)
        except DecodeError:
            return False, None
        for detail in status.details:
            if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                info = error_details_pb2.RetryInfo()
                detail.Unpack(info)
                delay = info.retry_delay.seconds + info.retry_delay.nanos / 1e9
                return True, delay if delay > 0 else None
    return False, None


def retry_after_s(value: str | None, now: datetime | None = None) -> float | None:
    """An HTTP ``Retry-After`` value in seconds: delay-seconds, or an HTTP date (the time until then, at least
    0). None when absent or unreadable (the caller backs off as usual)."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, (when - (now or datetime.now(timezone.utc))).total_seconds())


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
            self._channel = grpc.secure_channel(target, grpc_credentials(self.otlp))
        else:
            self._channel = grpc.insecure_channel(target)
        self._call = self._channel.unary_unary(_GRPC_METHODS[signal], request_serializer=None,
                                               response_deserializer=None)
        self._metadata = tuple((k.lower(), v) for k, v in self.otlp.headers.items())
        self._compression = grpc.Compression.Gzip if self.otlp.compression == "gzip" else None
        self._retryable = {
            grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED,
            grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS,
        }

    def _attempt(self, payload: bytes, deadline: float) -> _Attempt:
        timeout = max(0.05, deadline - time.monotonic())
        try:
            response = self._call(payload, timeout=timeout, metadata=self._metadata, compression=self._compression)
            return _Attempt(response=bytes(response or b""))
        except self._grpc.RpcError as err:
            code = err.code() if hasattr(err, "code") else None
            details = str(err.details() if hasattr(err, "details") else err)
            self.last_error = f"{code}: {details}"
            if code in (self._grpc.StatusCode.UNAUTHENTICATED, self._grpc.StatusCode.PERMISSION_DENIED):
                self.last_error = credentials_refused(str(code), details, self.otlp.headers, self.signal)
                return _Attempt()
            if code == self._grpc.StatusCode.UNAVAILABLE and _VERIFY_FAILED in details:
                self.last_error = certificate_not_trusted(f"{code}: {details}", self.otlp, self.signal)
                return _Attempt()
            has_retry_info, delay = _retry_info(err)
            if code == self._grpc.StatusCode.RESOURCE_EXHAUSTED:
                if _TOO_LARGE_TEXT.search(details):
                    return _Attempt(too_large=True)
                return _Attempt(retryable=has_retry_info, retry_after_s=delay)
            return _Attempt(retryable=code in self._retryable, retry_after_s=delay)
        except Exception as err:  # a broken channel must not kill the exporter
            self.last_error = repr(err)
            return _Attempt(retryable=True)

    def close(self) -> None:
        self._channel.close()


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def grpc_credentials(otlp: OtlpConnection) -> Any:
    """The ``grpc.ChannelCredentials`` of a secure channel to ``otlp``'s endpoint: its ``certificate`` file as the
    root certificates (else grpc's default roots), its client key and certificate chain when set (mTLS)."""
    import grpc

    return grpc.ssl_channel_credentials(root_certificates=_read(otlp.certificate),
                                        private_key=_read(otlp.client_key),
                                        certificate_chain=_read(otlp.client_certificate))


def ssl_context(otlp: OtlpConnection) -> ssl.SSLContext | None:
    """The TLS context of HTTPS requests to ``otlp``'s endpoint when it sets a certificate or a client
    certificate: trusting the ``certificate`` file (else the system's CAs), presenting the client certificate
    and key when set. None for an ``http`` endpoint or when neither is set (urllib's default context)."""
    if not otlp.secure or not (otlp.certificate or otlp.client_certificate):
        return None
    ctx = ssl.create_default_context(cafile=otlp.certificate)
    if otlp.client_certificate and otlp.client_key:
        ctx.load_cert_chain(otlp.client_certificate, otlp.client_key)
    return ctx


class HttpSender(Sender):
    """OTLP/HTTP with ``Content-Type: application/x-protobuf`` (and gzip when configured)."""

    def __init__(self, cfg: ExportConfig, stop: threading.Event, signal: str = "traces") -> None:
        super().__init__(cfg, stop, signal)
        self._context = ssl_context(self.otlp)

    def _attempt(self, payload: bytes, deadline: float) -> _Attempt:
        headers = {"Content-Type": "application/x-protobuf", **self.otlp.headers}
        body = payload
        if self.otlp.compression == "gzip":
            body = gzip.compress(payload)
            headers["Content-Encoding"] = "gzip"
        req = urllib.request.Request(self.endpoint, data=body, headers=headers, method="POST")
        timeout = max(0.05, deadline - time.monotonic())
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=self._context) as resp:
                return _Attempt(response=resp.read())
        except urllib.error.HTTPError as err:
            message = _status_message(err)
            self.last_error = f"HTTP {err.code}{message}"
            if err.code in _CREDENTIALS_HTTP:
                self.last_error = credentials_refused(f"HTTP {err.code}", message.removeprefix(": "),
                                                      self.otlp.headers, self.signal)
                return _Attempt()
            if err.code == _TOO_LARGE_HTTP:
                return _Attempt(too_large=True)
            return _Attempt(retryable=err.code in _RETRYABLE_HTTP,
                            retry_after_s=retry_after_s(err.headers.get("Retry-After") if err.headers else None))
        except (urllib.error.URLError, OSError, TimeoutError) as err:
            reason = getattr(err, "reason", err)
            if isinstance(reason, ssl.SSLCertVerificationError):
                self.last_error = certificate_not_trusted(repr(reason), self.otlp, self.signal)
                return _Attempt()
            self.last_error = repr(reason)
            return _Attempt(retryable=True)
        except http.client.HTTPException as err:  # a reply that is not HTTP, or cut short: retried as a refusal
            self.last_error = (f"not an OTLP/HTTP answer from {self.endpoint} ({type(err).__name__}: "
                               f"{str(err)[:120]!r}); is it the OTLP/gRPC port (4317) or another service?")
            return _Attempt(retryable=True)
        except Exception as err:  # anything else from a broken endpoint must not kill the exporter either
            self.last_error = repr(err)
            return _Attempt(retryable=True)


def _status_message(err: urllib.error.HTTPError) -> str:
    """``: <message>`` of the ``google.rpc.Status`` body of an OTLP/HTTP error response, or ""."""
    try:
        body = err.read(64 * 1024)
    except Exception:
        return ""
    from google.protobuf.message import DecodeError
    from google.rpc import status_pb2

    try:
        message = status_pb2.Status.FromString(body).message if body else ""
    except DecodeError:
        return ""
    return f": {message}" if message else ""


def make_sender(cfg: ExportConfig, stop: threading.Event, signal: str = "traces") -> Sender:
    """The sender of ``signal`` (``"traces"`` or ``"metrics"``) for that signal's protocol.

    Raises:
        ValueError: ``signal`` is neither.
    """
    if cfg.otlp(signal).protocol == "grpc":
        return GrpcSender(cfg, stop, signal)
    return HttpSender(cfg, stop, signal)


def sdk_metric_exporter(cfg: ExportConfig) -> Any:
    """The OpenTelemetry SDK's OTLP metric exporter, with the metrics' endpoint, protocol, headers, timeout and
    compression; its failures counted and its log kept to the first failure (:mod:`zoomer_serve.export.
    sdk_metrics`)."""
    from zoomer_serve.export.sdk_metrics import counted_exporter

    otlp = cfg.otlp("metrics")
    if otlp.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc import metric_exporter
    else:
        from opentelemetry.exporter.otlp.proto.http import metric_exporter  # type: ignore[no-redef]
    return counted_exporter(metric_exporter.OTLPMetricExporter, **_sdk_exporter_kwargs(otlp))


def sdk_span_exporter(cfg: ExportConfig) -> Any:
    """The OpenTelemetry SDK's OTLP span exporter with the traces' settings, for code that adds its own span
    processor. :func:`zoomer_serve.configure` does not use it: spans that user code starts with the API go through
    zoomer-serve's own export pipeline (:mod:`zoomer_serve.recording.sdk_spans`)."""
    otlp = cfg.otlp("traces")
    if otlp.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc import trace_exporter
    else:
        from opentelemetry.exporter.otlp.proto.http import trace_exporter  # type: ignore[no-redef]
    return trace_exporter.OTLPSpanExporter(**_sdk_exporter_kwargs(otlp))


def _session_keeping_verify() -> Any:
    """A ``requests.Session`` whose own ``verify`` (the certificate file the SDK's OTLP/HTTP exporter sets on it)
    is what every request verifies with: a plain session lets ``REQUESTS_CA_BUNDLE`` / ``CURL_CA_BUNDLE`` in the
    environment replace it (requests' ``merge_environment_settings``), so the collector's certificate was not
    trusted wherever those are set (as in many container images). Proxies still come from the environment."""
    import requests

    class _Session(requests.Session):
        def merge_environment_settings(self, url: Any, proxies: Any, stream: Any, verify: Any,
                                       cert: Any) -> dict[str, Any]:
            settings: dict[str, Any] = super().merge_environment_settings(url, proxies, stream, verify, cert)
            settings["verify"] = self.verify
            return settings

    return _Session()


def _sdk_exporter_kwargs(otlp: OtlpConnection) -> dict[str, Any]:
    """Constructor arguments shared by the SDK's OTLP exporters of both protocols, from one signal's settings
    (TLS: ``credentials`` for gRPC, ``certificate_file`` and the client's files for HTTP)."""
    kwargs: dict[str, Any] = {"endpoint": otlp.endpoint, "headers": dict(otlp.headers) or None,
                              "timeout": otlp.timeout_ms / 1000}
    gzip_on = otlp.compression == "gzip"
    if otlp.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.exporter import Compression as GrpcCompression

        kwargs["insecure"] = not otlp.secure  # the endpoint's scheme says (so the SDK never reads
        # OTEL_EXPORTER_OTLP_INSECURE itself: it would make http:// TLS with INSECURE=false)
        if otlp.secure:
            kwargs["credentials"] = grpc_credentials(otlp)
        kwargs["compression"] = GrpcCompression.Gzip if gzip_on else None
    else:
        from opentelemetry.exporter.otlp.proto.http import Compression as HttpCompression

        kwargs["compression"] = HttpCompression.Gzip if gzip_on else HttpCompression.NoCompression
        if otlp.secure and otlp.certificate:
            kwargs["certificate_file"] = otlp.certificate
            kwargs["session"] = _session_keeping_verify()
        if otlp.secure and otlp.client_certificate and otlp.client_key:
            kwargs["client_certificate_file"] = otlp.client_certificate
            kwargs["client_key_file"] = otlp.client_key
    return kwargs
