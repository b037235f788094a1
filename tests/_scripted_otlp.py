"""A scripted OTLP receiver for the exporter's pushback tests: a real ``grpc.server`` or a real
``http.server`` on 127.0.0.1 (port 0) that answers each export request with the next scripted :class:`Reply`
(success when the script is used up) and records what it received.

It answers as the OTLP specification lets a server answer: a partial success, gRPC errors with or without
``google.rpc.RetryInfo`` in the ``grpc-status-details-bin`` trailer, HTTP errors with ``Retry-After``, and
requests over ``max_request_bytes`` (none by default, not even grpc's own 4 MiB) refused as the real receivers do (grpc core's RESOURCE_EXHAUSTED "Received
message larger than max"; HTTP 413).
"""

from __future__ import annotations

import gzip
import http.server
import ssl
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from zoomer_serve.config import ExportConfig
from zoomer_serve.recording import RequestRecorder

_SERVICES = {"traces": "opentelemetry.proto.collector.trace.v1.TraceService",
             "metrics": "opentelemetry.proto.collector.metrics.v1.MetricsService"}


@dataclass(frozen=True)
class Reply:
    """One scripted answer. Success (with a partial success when ``rejected`` or ``message``) unless
    ``grpc_code`` (a ``grpc.StatusCode`` name, for gRPC) or ``http_status`` (for HTTP) is set; ``retry_s`` is
    sent as RetryInfo (gRPC) or as ``Retry-After`` seconds (HTTP); ``retry_after`` as a raw ``Retry-After``."""

    rejected: int = 0
    message: str = ""
    grpc_code: str | None = None
    http_status: int | None = None
    retry_s: float | None = None
    retry_after: str | None = None


@dataclass
class Received:
    """One request the receiver answered: its signal, size in bytes (uncompressed), items (spans or data
    points), when (``time.monotonic()``), the reply, the parsed request for metrics, and the headers it came
    with (HTTP headers or gRPC metadata, names lower-cased)."""

    signal: str
    size: int
    items: int
    at: float
    reply: Reply
    request: Any = None
    headers: dict[str, str] = field(default_factory=dict)


def _parse(signal: str, payload: bytes) -> tuple[int, Any]:
    if signal == "traces":
        req = ExportTraceServiceRequest.FromString(payload)
        return sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans), None
    mreq = ExportMetricsServiceRequest.FromString(payload)
    points = 0
    for rm in mreq.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                data = getattr(metric, metric.WhichOneof("data"))
                points += len(data.data_points)
    return points, mreq


def _response(signal: str, reply: Reply) -> bytes:
    if signal == "traces":
        resp = ExportTraceServiceResponse()
        if reply.rejected or reply.message:
            resp.partial_success.rejected_spans = reply.rejected
            resp.partial_success.error_message = reply.message
        return resp.SerializeToString()
    mresp = ExportMetricsServiceResponse()
    if reply.rejected or reply.message:
        mresp.partial_success.rejected_data_points = reply.rejected
        mresp.partial_success.error_message = reply.message
    return mresp.SerializeToString()


@dataclass
class ScriptedOtlp:
    """The receiver for ``protocol`` (``grpc`` or ``http/protobuf``); use as a context manager. ``mtls``: (server
    certificate, server key, client CA) PEM paths: TLS that requires a client certificate signed by that CA."""

    protocol: str
    traces: Iterable[Reply] = ()
    metrics: Iterable[Reply] = ()
    max_request_bytes: int | None = None
    received: list[Received] = field(default_factory=list)
    mtls: tuple[str, str, str] | None = None

    def __post_init__(self) -> None:
        self._scripts = {"traces": list(self.traces), "metrics": list(self.metrics)}
        self._lock = threading.Lock()
        self._grpc: grpc.Server | None = None
        self._http: http.server.ThreadingHTTPServer | None = None
        self.port = 0

    # -- what was received ------------------------------------------------------------------------------
    def requests(self, signal: str) -> list[Received]:
        with self._lock:
            return [r for r in self.received if r.signal == signal]

    def accepted(self, signal: str = "traces") -> int:
        """Items the receiver accepted: those of successful replies less the rejected ones."""
        return sum(r.items - min(r.reply.rejected, r.items) for r in self.requests(signal)
                   if r.reply.grpc_code is None and r.reply.http_status is None)

    def wait_for(self, signal: str, n: int, timeout_s: float = 30.0) -> list[Received]:
        deadline = time.monotonic() + timeout_s
        while len(self.requests(signal)) < n and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.requests(signal)

    # -- answering ------------------------------------------------------------------------------------------
    def _answer(self, signal: str, payload: bytes, headers: Iterable[tuple[str, Any]] = ()) -> Reply:
        items, parsed = _parse(signal, payload)
        seen = {str(k).lower(): v for k, v in headers if isinstance(v, str)}
        with self._lock:
            script = self._scripts[signal]
            reply = script.pop(0) if script else Reply()
            self.received.append(Received(signal, len(payload), items, time.monotonic(), reply, parsed, seen))
        return reply

    def _grpc_handler(self, signal: str) -> Any:
        def export(payload: bytes, context: grpc.ServicerContext) -> bytes:
            reply = self._answer(signal, payload, context.invocation_metadata() or ())
            if reply.grpc_code is None:
                return _response(signal, reply)
            code = grpc.StatusCode[reply.grpc_code]
            if reply.retry_s is not None:
                status = status_pb2.Status(code=code.value[0], message=reply.message or reply.grpc_code)
                info = error_details_pb2.RetryInfo()
                info.retry_delay.seconds = int(reply.retry_s)
                info.retry_delay.nanos = int(round((reply.retry_s % 1) * 1e9))
                status.details.add().Pack(info)
                context.set_trailing_metadata((("grpc-status-details-bin", status.SerializeToString()),))
            context.abort(code, reply.message or reply.grpc_code)
            return b""  # not reached: abort raises

        return grpc.unary_unary_rpc_method_handler(export, request_deserializer=None, response_serializer=None)

    def _start_grpc(self) -> None:
        limit = -1 if self.max_request_bytes is None else self.max_request_bytes  # -1: none (grpc's own is 4 MiB)
        options = [("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", limit)]
        server = grpc.server(ThreadPoolExecutor(max_workers=4), options=options, handlers=[
            grpc.method_handlers_generic_handler(service, {"Export": self._grpc_handler(signal)})
            for signal, service in _SERVICES.items()])
        if self.mtls is None:
            self.port = server.add_insecure_port("127.0.0.1:0")
        else:
            cert, key, client_ca = (open(path, "rb").read() for path in self.mtls)
            creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca, require_client_auth=True)
            self.port = server.add_secure_port("127.0.0.1:0", creds)
        server.start()
        self._grpc = server

    def _start_http(self) -> None:
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                signal = self.path.rsplit("/", 1)[-1]
                if receiver.max_request_bytes is not None and len(body) > receiver.max_request_bytes:
                    self._send(413, status_pb2.Status(message="request body too large").SerializeToString())
                    return
                reply = receiver._answer(signal, body, self.headers.items())
                if reply.http_status is None:
                    self._send(200, _response(signal, reply))
                    return
                headers = {}
                if reply.retry_s is not None:
                    headers["Retry-After"] = str(int(reply.retry_s))
                if reply.retry_after is not None:
                    headers["Retry-After"] = reply.retry_after
                self._send(reply.http_status, status_pb2.Status(message=reply.message).SerializeToString(), headers)

            def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(body)))
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(body)

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        if self.mtls is not None:
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=self.mtls[2])
            ctx.verify_mode = ssl.CERT_REQUIRED
            ctx.load_cert_chain(self.mtls[0], self.mtls[1])
            server.socket = ctx.wrap_socket(server.socket, server_side=True)
        self.port = server.server_address[1]
        threading.Thread(target=server.serve_forever, name="scripted-otlp-http", daemon=True).start()
        self._http = server

    def __enter__(self) -> ScriptedOtlp:
        self._start_grpc() if self.protocol == "grpc" else self._start_http()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._grpc is not None:
            self._grpc.stop(None)
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()

    def export_config(self, **over: Any) -> ExportConfig:
        """An ExportConfig that sends both signals here (see :func:`loopback_export_config`)."""
        return loopback_export_config(self.protocol, self.port, **over)


def request_records(n: int, payload_bytes: int = 0, name: str = "svc.S/M") -> list[tuple]:
    """``n`` sampled request records (each one span), with a ``payload`` attribute of ``payload_bytes``."""
    out: list[tuple] = []
    recorder = RequestRecorder(sink=out.append, otel_context=False)
    for i in range(n):
        span = recorder.start(name, attributes={"rpc.method": name, "rpc.system.name": "grpc", "i": i})
        if payload_bytes:
            span.set_attribute("payload", "x" * payload_bytes)
        span.set_attribute("rpc.response.status_code", "OK")
        span.end()
    return out


def loopback_export_config(protocol: str, port: int, **over: Any) -> ExportConfig:
    """An ExportConfig that sends both signals to 127.0.0.1:``port`` over ``protocol`` (thread mode; short
    timeouts unless overridden)."""
    base = f"http://127.0.0.1:{port}"
    grpc_on = protocol == "grpc"
    settings: dict[str, Any] = {
        "protocol": protocol, "mode": "thread", "timeout_ms": 10_000, "schedule_delay_ms": 50,
        "traces_endpoint": base if grpc_on else base + "/v1/traces",
        "metrics_endpoint": base if grpc_on else base + "/v1/metrics",
    }
    settings.update(over)
    return ExportConfig(**settings)
