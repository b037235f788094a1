"""OTLP/HTTP receiver on the standard library's ``ThreadingHTTPServer``.

``POST /v1/traces``, ``/v1/metrics`` and ``/v1/logs`` with ``Content-Type: application/x-protobuf`` or
``application/json`` (OTLP/JSON: hex trace/span ids, enums as names or numbers), optionally
``Content-Encoding: gzip``. Responses follow the OTLP/HTTP spec, in the request's content type:

====== ==========================================================================================
status when
====== ==========================================================================================
200    stored; body ``Export*ServiceResponse`` (``partial_success`` set if some items were invalid)
400    malformed body, bad ``Content-Length``, corrupt gzip; body ``google.rpc.Status``
404    any other path
405    a method other than POST on an OTLP path (``Allow: POST``)
411    no ``Content-Length`` (chunked uploads are not accepted)
413    ``Content-Length`` or the gzip-decompressed size over ``max_message_bytes`` (checked before
       reading / while decompressing, so a gzip bomb never expands past the limit)
415    other content types or encodings
500    an unexpected error in the receiver (logged)
503    the store's queue is full or the collector is stopping (``Retry-After: 1``; retryable)
====== ==========================================================================================
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import socket
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.protobuf import json_format
from google.rpc import code_pb2, status_pb2

from zoomer_serve.collector.ingest import REQUEST_TYPES, Ingestor, IngestResult, Outcome, Signal

log = logging.getLogger(__name__)

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
PATHS = {f"/v1/{s.value}": s for s in Signal}
DRAIN_LIMIT_BYTES = 4 * 1024 * 1024  # after an error answer, at most this much of the body is read and dropped
DRAIN_TIMEOUT_S = 1.0  # ... waiting at most this long for each piece of it
IDLE_TIMEOUT_S = 30.0  # a connection silent this long is closed
MAX_CONCURRENT_BODIES = 8  # requests reading/decoding a body at once; bounds memory to ~2x this x max size
_HEX_ID_KEYS = frozenset({"traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id"})

_HTTP_STATUS = {Outcome.INVALID: 400, Outcome.TOO_LARGE: 413, Outcome.UNAVAILABLE: 503}
_RPC_CODE = {
    400: code_pb2.INVALID_ARGUMENT,
    404: code_pb2.NOT_FOUND,
    405: code_pb2.UNIMPLEMENTED,
    411: code_pb2.INVALID_ARGUMENT,
    413: code_pb2.RESOURCE_EXHAUSTED,
    415: code_pb2.INVALID_ARGUMENT,
    500: code_pb2.INTERNAL,
    503: code_pb2.UNAVAILABLE,
}


class HttpError(Exception):
    """Ends a request with HTTP ``status``; ``close`` drops the connection afterwards."""

    def __init__(self, status: int, message: str, close: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.close = close


def gunzip_capped(data: bytes, max_bytes: int) -> bytes:
    """Decompress gzip ``data`` (one or more members) without ever producing more than ``max_bytes``.

    Raises:
        HttpError: 413 when the output would exceed ``max_bytes``; 400 when the data is not valid gzip.
    """
    out: list[bytes] = []
    total = 0
    rest = data
    try:
        while rest:
            d = zlib.decompressobj(16 + zlib.MAX_WBITS)
            chunk = d.decompress(rest, max_bytes - total + 1)
            total += len(chunk)
            if total > max_bytes:
                raise HttpError(413, f"decompressed body is over the {max_bytes} byte limit")
            out.append(chunk)
            if not d.eof:
                raise HttpError(400, "truncated gzip body")
            rest = d.unused_data
    except zlib.error as exc:
        raise HttpError(400, f"invalid gzip body: {exc}") from exc
    return b"".join(out)


def _hex_ids_to_base64(node: Any) -> Any:
    """OTLP/JSON writes ids as hex; protobuf's JSON mapping wants base64 for bytes. Rewrite in place."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in _HEX_ID_KEYS and isinstance(value, str):
                try:
                    node[key] = base64.b64encode(bytes.fromhex(value)).decode("ascii")
                except ValueError as exc:
                    raise HttpError(400, f"{key} is not hex: {value[:40]!r}") from exc
            else:
                _hex_ids_to_base64(value)
    elif isinstance(node, list):
        for item in node:
            _hex_ids_to_base64(item)
    return node


def parse_json_request(signal: Signal, body: bytes) -> Any:
    """Parse an OTLP/JSON export request (unknown fields ignored, as the spec requires).

    Raises:
        HttpError: 400 when the body is not valid OTLP/JSON.
    """
    try:
        tree = _hex_ids_to_base64(json.loads(body))
        message = REQUEST_TYPES[signal]()
        json_format.ParseDict(tree, message, ignore_unknown_fields=True)
    except HttpError:
        raise
    except (ValueError, TypeError, json_format.ParseError, binascii.Error, RecursionError) as exc:
        raise HttpError(400, f"invalid OTLP/JSON body: {exc}") from exc
    return message


class _InFlight:
    """Counts requests being handled so that stop() can wait for them."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._n = 0

    def __enter__(self) -> None:
        with self._cond:
            self._n += 1

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._n -= 1
            self._cond.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._n == 0, timeout_s)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], ingestor: Ingestor, max_message_bytes: int) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.ingestor = ingestor
        self.max_message_bytes = max_message_bytes
        self.in_flight = _InFlight()
        self.body_slots = threading.BoundedSemaphore(MAX_CONCURRENT_BODIES)
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    timeout = IDLE_TIMEOUT_S
    server_version = "zoomer-serve-otlp"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("otlp-http %s - %s", self.address_string(), format % args)

    # ---- dispatch ------------------------------------------------------------------------------------

    def do_POST(self) -> None:
        self._body_read = False
        with self.server.in_flight:
            self.server.ingestor.count("http_requests")
            try:
                signal = self._signal()
                with self.server.body_slots:
                    body = self._read_body()
                    content_type = self._content_type()
                    result = self._ingest(signal, content_type, body)
                    del body
                self._respond_result(result, content_type)
            except HttpError as exc:
                self._fail(exc)
            except Exception as exc:  # never let a request kill the connection thread silently
                log.exception("OTLP/HTTP request failed")
                self._fail(HttpError(500, f"internal error: {type(exc).__name__}", close=True))

    def _other_method(self) -> None:
        self._body_read = False
        self.server.ingestor.count("http_requests")
        try:
            self._signal()
            raise HttpError(405, f"{self.command} not allowed; OTLP/HTTP uses POST")
        except HttpError as exc:
            self._fail(exc)

    do_GET = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _other_method

    def do_HEAD(self) -> None:
        self._other_method()

    # ---- request parts -------------------------------------------------------------------------------

    def _signal(self) -> Signal:
        path = self.path.split("?", 1)[0]
        signal = PATHS.get(path)
        if signal is None:
            raise HttpError(404, f"no OTLP endpoint at {path[:200]!r}; use /v1/traces, /v1/metrics or /v1/logs")
        return signal

    def _content_type(self) -> str:
        raw = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        if raw in (PROTOBUF, JSON):
            return raw
        raise HttpError(415, f"unsupported Content-Type {raw!r}; use {PROTOBUF} or {JSON}")

    def _read_body(self) -> bytes:
        limit = self.server.max_message_bytes
        if self.headers.get("Transfer-Encoding"):
            raise HttpError(411, "chunked bodies are not accepted; send Content-Length", close=True)
        raw_length = self.headers.get("Content-Length")
        if raw_length is None:
            raise HttpError(411, "Content-Length is required", close=True)
        try:
            length = int(raw_length)
            if length < 0:
                raise ValueError(raw_length)
        except ValueError as exc:
            raise HttpError(400, f"bad Content-Length {raw_length[:40]!r}", close=True) from exc
        if length > limit:
            raise HttpError(413, f"body of {length} bytes is over the {limit} byte limit", close=True)
        body = self.rfile.read(length)
        self._body_read = True
        if len(body) != length:
            raise HttpError(400, "body shorter than Content-Length", close=True)
        encoding = (self.headers.get("Content-Encoding") or "identity").strip().lower()
        if encoding == "gzip":
            return gunzip_capped(body, limit)
        if encoding != "identity":
            raise HttpError(415, f"unsupported Content-Encoding {encoding!r}; use gzip or none")
        return body

    def _discard_body(self) -> None:
        """Read and drop an unread body (up to DRAIN_LIMIT_BYTES) so that closing the connection does not
        reset it before the client has read our answer."""
        self._body_read = True
        try:
            self.connection.settimeout(DRAIN_TIMEOUT_S)
            left = min(int(self.headers.get("Content-Length") or 0), DRAIN_LIMIT_BYTES)
            while left > 0:
                chunk = self.rfile.read(min(left, 1 << 16))
                if not chunk:
                    return
                left -= len(chunk)
        except (ValueError, OSError):
            return

    def _ingest(self, signal: Signal, content_type: str, body: bytes) -> IngestResult:
        ingestor = self.server.ingestor
        if content_type == PROTOBUF:
            return ingestor.ingest_bytes(signal, body)
        try:
            message = parse_json_request(signal, body)
        except HttpError as exc:
            return ingestor.reject(Outcome.INVALID, exc.message)
        return ingestor.ingest_message(signal, message)

    # ---- responses -----------------------------------------------------------------------------------

    def _respond_result(self, result: IngestResult, content_type: str) -> None:
        if result.outcome is Outcome.OK:
            assert result.response is not None
            self._send(200, result.response, content_type)
            return
        status = _HTTP_STATUS[result.outcome]
        self._send_status(status, result.message, content_type, close=False)

    def _fail(self, exc: HttpError) -> None:
        """Answer an error raised before ingestion; counted as ``http_<status>`` (and ``rejected_invalid`` /
        ``rejected_too_large`` for 400 / 413). A connection whose body was not read is closed."""
        ingestor = self.server.ingestor
        ingestor.count(f"http_{exc.status}")
        if exc.status == 400:
            ingestor.count("rejected_invalid")
        elif exc.status == 413:
            ingestor.count("rejected_too_large")
        if self._body_read:
            self._send_status(exc.status, exc.message, self._reply_type(), close=exc.close)
            return
        # answer at once (a client may declare gigabytes and send nothing), then drain briefly so that closing
        # does not reset the connection before the client has read the answer
        self._send_status(exc.status, exc.message, self._reply_type(), close=True)
        self._discard_body()

    def _reply_type(self) -> str:
        raw = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        return JSON if raw == JSON else PROTOBUF

    def _send_status(self, status: int, message: str, content_type: str, close: bool) -> None:
        body = status_pb2.Status(code=_RPC_CODE.get(status, code_pb2.UNKNOWN), message=message)
        extra = {"Retry-After": "1"} if status == 503 else {}
        if status == 405:
            extra["Allow"] = "POST"
        self._send(status, body, content_type, close=close, headers=extra)

    def _send(self, status: int, message: Any, content_type: str, close: bool = False,
              headers: dict[str, str] | None = None) -> None:
        if content_type == JSON:
            payload = json_format.MessageToJson(message, indent=None).encode()
        else:
            payload = message.SerializeToString()
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(payload)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)
        except OSError:  # the client went away; nothing to answer
            self.close_connection = True


class HttpReceiver:
    """Serves OTLP/HTTP on ``host:port`` (port 0 picks a free port; see :attr:`port` after :meth:`start`)."""

    def __init__(self, ingestor: Ingestor, host: str, port: int, max_message_bytes: int) -> None:
        self._ingestor = ingestor
        self._host = host
        self._requested_port = port
        self._max_message_bytes = max_message_bytes
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    def start(self) -> int:
        """Bind and start serving in a background thread; returns the bound port.

        Raises:
            OSError: the address cannot be bound (port in use, unknown host).
        """
        server = _Server((self._host, self._requested_port), self._ingestor, self._max_message_bytes)
        self._server = server
        self.port = server.server_address[1]
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="otlp-http", daemon=True)
        self._thread.start()
        log.info("OTLP/HTTP receiver listening on %s:%s", self._host, self.port)
        return self.port

    def stop(self, grace_s: float) -> None:
        """Stop accepting connections, wait up to ``grace_s`` s for requests being handled. Idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if not server.in_flight.wait_idle(grace_s):
            log.warning("OTLP/HTTP receiver stopped with requests still in flight after %.1f s", grace_s)
        if self._thread is not None:
            self._thread.join(grace_s)
