"""OTLP/HTTP receiver: one asyncio event loop (``h11`` parses HTTP/1.1) and a small pool of ingest threads.

``POST /v1/traces``, ``/v1/metrics`` and ``/v1/logs`` with ``Content-Type: application/x-protobuf`` or
``application/json`` (OTLP/JSON: hex trace/span ids, enums as names or numbers), optionally
``Content-Encoding: gzip``. Responses follow the OTLP/HTTP spec, in the request's content type:

====== ==========================================================================================
status when
====== ==========================================================================================
200    stored (committed); body ``Export*ServiceResponse`` (``partial_success`` set if some items were
       invalid)
400    malformed request or body, bad ``Content-Length``, corrupt gzip; body ``google.rpc.Status``
401    a token is configured and the request has no / a wrong ``authorization: Bearer`` header
       (``WWW-Authenticate: Bearer``; the body is not read)
404    any other path
405    a method other than POST on an OTLP path (``Allow: POST``)
408    the headers or the body did not arrive within their deadline (the connection is closed)
411    no ``Content-Length`` (chunked uploads are not accepted)
413    ``Content-Length`` or the gzip-decompressed size over ``max_message_bytes`` (checked before
       reading / while decompressing, so a gzip bomb never expands past the limit)
415    other content types or encodings
431    the request line and headers are over ``max_header_bytes`` (the connection is closed)
500    an unexpected error in the receiver (logged)
503    the store's queue is full, the collector is stopping, or the receiver's body buffer stayed full
       (``Retry-After: 1``; retryable)
====== ==========================================================================================

Slow, idle and hostile clients (:class:`HttpLimits`)
---------------------------------------------------
No client holds a thread: connections live on the event loop, and only complete request bodies are handed
to the ``ingest_threads`` (parse, decode, wait for the store's commit). Each connection is bounded in time
and the receiver in size:

- *idle*: a connection waiting for the first byte of its next request (a new one, or keep-alive between
  requests) is closed after ``idle_timeout_s`` (counted in ``http_idle_closed``);
- *headers*: from its first byte, a request's whole header block must arrive within ``header_timeout_s``
  (and be at most ``max_header_bytes``, else 431), else 408 and close (``http_headers_timeouts``);
- *body*: from the end of the headers, the whole body must arrive within ``body_timeout_s``, however it is
  cut into pieces, else 408 and close (``http_body_timeouts``);
- *connections*: at most ``max_connections`` open at once; past it a new connection is closed at once,
  counted in ``http_connections_refused`` and logged once (again only after the receiver had room);
- *memory*: body bytes held by the receiver (received, not yet ingested) are bounded by
  ``body_buffer_bytes``, counted as they arrive, so a client that sends two bytes of a 16 MiB body holds two
  bytes. A piece that does not fit waits (within the body deadline) for room, else the request gets 503.
  Decompression happens in the ingest threads, at most ``ingest_threads`` x ``max_message_bytes``. Besides
  that a connection holds at most ``max_header_bytes`` of unparsed headers and one 64 KiB read buffer.
  A client that sends most of a large body and stalls holds what it sent until its body deadline: a few
  such clients can fill the budget, and requests that find no room wait for it (503 after their own body
  deadline); the bound on memory holds either way.

A TLS handshake must complete within ``header_timeout_s``. Settings and their ``ZOOMER_COLLECTOR_*``
variables: :class:`HttpLimits`; authentication and TLS: :mod:`zoomer_serve.collector.security`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import math
import os
import socket
import threading
import zlib
from collections import deque
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import h11
from google.protobuf import json_format
from google.rpc import code_pb2, status_pb2

from zoomer_serve import envvars
from zoomer_serve.collector.ingest import REQUEST_TYPES, Ingestor, IngestResult, Outcome, Signal
from zoomer_serve.collector.security import UNAUTHENTICATED_MESSAGE, ReceiverSecurity
from zoomer_serve.config import ConfigError
from zoomer_serve.netaddr import BindError, bind_failure_reason, format_hostport

log = logging.getLogger(__name__)

MiB = 1024 * 1024
PROTOBUF = "application/x-protobuf"
JSON = "application/json"
PATHS = {f"/v1/{s.value}": s for s in Signal}
DRAIN_LIMIT_BYTES = 4 * MiB  # after an early error answer, at most this much of the body is read and dropped
DRAIN_TIMEOUT_S = 1.0  # ... within this long in all
WRITE_TIMEOUT_S = 10.0  # a response not taken by the client within this long closes the connection
READ_CHUNK_BYTES = 64 * 1024
_HEX_ID_KEYS = frozenset({"traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id"})

_HTTP_STATUS = {Outcome.INVALID: 400, Outcome.TOO_LARGE: 413, Outcome.UNAVAILABLE: 503}
_RPC_CODE = {
    400: code_pb2.INVALID_ARGUMENT,
    401: code_pb2.UNAUTHENTICATED,
    404: code_pb2.NOT_FOUND,
    405: code_pb2.UNIMPLEMENTED,
    408: code_pb2.DEADLINE_EXCEEDED,
    411: code_pb2.INVALID_ARGUMENT,
    413: code_pb2.RESOURCE_EXHAUSTED,
    415: code_pb2.INVALID_ARGUMENT,
    431: code_pb2.INVALID_ARGUMENT,
    500: code_pb2.INTERNAL,
    503: code_pb2.UNAVAILABLE,
}
_REASONS = {200: b"OK", 400: b"Bad Request", 401: b"Unauthorized", 404: b"Not Found",
            405: b"Method Not Allowed", 408: b"Request Timeout", 411: b"Length Required",
            413: b"Content Too Large", 415: b"Unsupported Media Type",
            431: b"Request Header Fields Too Large", 500: b"Internal Server Error",
            503: b"Service Unavailable"}


@dataclass(frozen=True)
class HttpLimits:
    """Bounds of the OTLP/HTTP receiver (see the module docstring). Times in seconds, sizes in bytes.

    ======================= ============================================= ========================
    attribute               ``zoomer-serve collector`` flag / variable    default
    ======================= ============================================= ========================
    max_connections         ``--max-connections`` /                       4096
                            ``ZOOMER_COLLECTOR_MAX_CONNECTIONS``
    header_timeout_s        ``--header-timeout-s`` /                      10 s
                            ``ZOOMER_COLLECTOR_HEADER_TIMEOUT_S``
    body_timeout_s          ``--body-timeout-s`` /                        30 s
                            ``ZOOMER_COLLECTOR_BODY_TIMEOUT_S``
    idle_timeout_s          ``--idle-timeout-s`` /                        60 s
                            ``ZOOMER_COLLECTOR_IDLE_TIMEOUT_S``
    max_header_bytes        (code only)                                   16 KiB
    body_buffer_bytes       (code only; raised to ``max_message_bytes``)  64 MiB
    ingest_threads          (code only)                                   4
    ======================= ============================================= ========================

    Each open connection needs a file descriptor: ``zoomer-serve collector`` raises its soft
    ``RLIMIT_NOFILE`` towards the hard limit when ``max_connections`` needs it; an embedding process keeps
    its own, and the receiver logs a warning when it is too low.

    Raises:
        ConfigError: a value that is not positive.
    """

    max_connections: int = 4096
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    idle_timeout_s: float = 60.0
    max_header_bytes: int = 16 * 1024
    body_buffer_bytes: int = 64 * MiB
    ingest_threads: int = 4

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_header_bytes", "body_buffer_bytes", "ingest_threads"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"HTTP receiver limit {name} must be > 0, got {getattr(self, name)!r}")
        for name in ("header_timeout_s", "body_timeout_s", "idle_timeout_s"):  # inf would turn a defence off
            if not 0 < getattr(self, name) < math.inf:
                raise ConfigError(f"HTTP receiver limit {name} must be a finite number > 0, got {getattr(self, name)!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> HttpLimits:
        """The ``ZOOMER_COLLECTOR_*`` variables of the table above from ``env`` (default ``os.environ``),
        then ``overrides`` that are not None.

        Raises:
            ConfigError: a value that is not a positive number, naming the variable.
        """
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        if (env.get("ZOOMER_COLLECTOR_MAX_CONNECTIONS") or "").strip():
            values["max_connections"] = envvars.integer(env, "ZOOMER_COLLECTOR_MAX_CONNECTIONS", 0, ConfigError,
                                                        minimum=1)
        for name in ("header_timeout_s", "body_timeout_s", "idle_timeout_s"):
            var = f"ZOOMER_COLLECTOR_{name.upper()}"
            raw = (env.get(var) or "").strip()
            if raw:
                try:
                    values[name] = float(raw)
                except ValueError:
                    raise ConfigError(f"{var} must be a number of seconds, got {raw!r}") from None
                if not 0 < values[name] < math.inf:
                    raise ConfigError(f"{var} must be a finite number of seconds > 0, got {raw!r}")
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


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
        if not isinstance(tree, dict):  # ParseDict takes a list (or a string) for an empty message
            raise HttpError(400, f"invalid OTLP/JSON body: the top level is a {type(tree).__name__}, not an object")
        message = REQUEST_TYPES[signal]()
        json_format.ParseDict(tree, message, ignore_unknown_fields=True)
    except HttpError:
        raise
    except (ValueError, TypeError, json_format.ParseError, binascii.Error, RecursionError) as exc:
        raise HttpError(400, f"invalid OTLP/JSON body: {exc}") from exc
    return message


class _ByteBudget:
    """Bytes of request bodies held by the receiver; lives on the event loop (no locks)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.free = capacity
        self._waiters: deque[asyncio.Future[None]] = deque()

    async def acquire(self, n: int, timeout_s: float) -> bool:
        """Take ``n`` bytes, waiting up to ``timeout_s`` for room; False on timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.free < n:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, remaining)
            except asyncio.TimeoutError:
                return False
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        self.free -= n
        return True

    def release(self, n: int) -> None:
        self.free += n
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)


class _Timeout(Exception):
    """A connection missed a deadline; ``what`` is 'idle', 'headers' or 'body'."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


@dataclass
class _Request:
    """One request being served: its h11 event and what was decided from its headers."""

    event: h11.Request
    headers: dict[str, str]
    content_type: str = PROTOBUF
    encoding: str = "identity"
    length: int = 0


class _Connection:
    """Serves one client connection: a sequence of requests, each within its deadlines."""

    def __init__(self, receiver: HttpReceiver, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.receiver = receiver
        self.reader = reader
        self.writer = writer
        self.limits = receiver.limits
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_header_bytes)
        self.loop = asyncio.get_running_loop()
        self.ingesting = False  # a complete request is being ingested or answered: stop() lets it finish

    # ---- reading -------------------------------------------------------------------------------------

    async def _receive(self, deadline: float, what: str) -> None:
        """Feed the next piece of the stream to h11, waiting until ``deadline`` (loop time) at most."""
        remaining = deadline - self.loop.time()
        if remaining <= 0:
            raise _Timeout(what)
        try:
            data = await asyncio.wait_for(self.reader.read(READ_CHUNK_BYTES), remaining)
        except asyncio.TimeoutError:
            raise _Timeout(what) from None
        self.h11.receive_data(data)

    async def _next_request(self) -> h11.Request | None:
        """Wait for the next request's headers (idle deadline until its first byte, then the headers
        deadline); None when the client closed the connection between requests."""
        deadline = self.loop.time() + self.limits.idle_timeout_s
        started = False
        while True:
            event = self.h11.next_event()
            if isinstance(event, h11.Request):
                # h11 bounds headers that are still arriving; one read can hold a whole block over the bound
                size = len(event.target) + sum(len(k) + len(v) + 4 for k, v in event.headers)
                if size > self.limits.max_header_bytes:
                    raise h11.RemoteProtocolError(
                        f"headers of {size} bytes are over the {self.limits.max_header_bytes} byte limit",
                        error_status_hint=431)
                return event
            if isinstance(event, h11.ConnectionClosed):
                return None
            if event is not h11.NEED_DATA:  # pragma: no cover - a server only receives requests here
                raise h11.RemoteProtocolError(f"unexpected {type(event).__name__}")
            if not started and self.h11.trailing_data[0]:
                started = True
                deadline = self.loop.time() + self.limits.header_timeout_s
            await self._receive(deadline, "headers" if started else "idle")

    async def _read_body(self, req: _Request, held: list[int]) -> bytes:
        """The whole body, within the body deadline; its bytes are taken from the receiver's body budget as
        they arrive (``held[0]`` says how many, for the caller to give back)."""
        deadline = self.loop.time() + self.limits.body_timeout_s
        if self.h11.they_are_waiting_for_100_continue:
            await self._send_bytes(self.h11.send(h11.InformationalResponse(status_code=100, headers=[])))
        parts: list[bytes] = []
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                await self._receive(deadline, "body")
                continue
            if isinstance(event, h11.Data):
                n = len(event.data)
                if not await self.receiver.budget.acquire(n, max(0.0, deadline - self.loop.time())):
                    raise HttpError(503, "the collector's request buffer is full; retry later", close=True)
                held[0] += n
                parts.append(bytes(event.data))
                continue
            if isinstance(event, h11.EndOfMessage):
                return b"".join(parts)
            if isinstance(event, h11.ConnectionClosed):
                raise HttpError(400, "body shorter than Content-Length", close=True)
            raise h11.RemoteProtocolError(f"unexpected {type(event).__name__}")  # pragma: no cover

    async def _drain(self) -> None:
        """Read and drop what the client still sends (at most DRAIN_LIMIT_BYTES, DRAIN_TIMEOUT_S in all), so
        that closing does not reset the connection before the client has read our answer."""
        deadline = self.loop.time() + DRAIN_TIMEOUT_S
        left = DRAIN_LIMIT_BYTES
        try:
            while left > 0:
                remaining = deadline - self.loop.time()
                if remaining <= 0:
                    return
                chunk = await asyncio.wait_for(self.reader.read(min(left, READ_CHUNK_BYTES)), remaining)
                if not chunk:
                    return
                left -= len(chunk)
        except (asyncio.TimeoutError, OSError):
            return

    # ---- writing -------------------------------------------------------------------------------------

    async def _send_bytes(self, data: bytes | None) -> None:
        if data:
            self.writer.write(data)
            await asyncio.wait_for(self.writer.drain(), WRITE_TIMEOUT_S)

    async def _send(self, status: int, payload: bytes, content_type: str, close: bool,
                    headers: Mapping[str, str] | None = None) -> None:
        hdrs = [(b"Content-Type", content_type.encode()), (b"Content-Length", str(len(payload)).encode())]
        hdrs += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
        if close:
            hdrs.append((b"Connection", b"close"))
        out = self.h11.send(h11.Response(status_code=status, headers=hdrs, reason=_REASONS.get(status, b"")))
        out = (out or b"") + (self.h11.send(h11.Data(data=payload)) if payload else b"") + (
            self.h11.send(h11.EndOfMessage()) or b"")
        await self._send_bytes(out)

    async def _send_status(self, status: int, message: str, content_type: str, close: bool,
                           method: bytes = b"POST") -> None:
        body = status_pb2.Status(code=_RPC_CODE.get(status, code_pb2.UNKNOWN), message=message)
        payload = (json_format.MessageToJson(body, indent=None).encode() if content_type == JSON
                   else body.SerializeToString())
        extra = {"Retry-After": "1"} if status == 503 else {}
        if status == 405:
            extra["Allow"] = "POST"
        if status == 401:
            extra["WWW-Authenticate"] = 'Bearer realm="OTLP"'
        await self._send(status, b"" if method == b"HEAD" else payload, content_type, close, extra)

    # ---- serving -------------------------------------------------------------------------------------

    async def serve(self) -> None:
        """Serve requests until the client closes, a deadline passes, or an error closes the connection."""
        count = self.receiver.ingestor.count
        try:
            while True:
                event = await self._next_request()
                if event is None:
                    return
                if not await self._serve_request(event):
                    return
                if self.h11.our_state is h11.MUST_CLOSE or self.h11.their_state is h11.MUST_CLOSE:
                    return
                self.h11.start_next_cycle()
        except _Timeout as exc:
            if exc.what == "idle":
                count("http_idle_closed")
                return
            count(f"http_{exc.what}_timeouts")
            count("http_408")
            await self._try_send_status(408, f"the request's {exc.what} did not arrive within "
                                             f"{self._deadline_s(exc.what):g} s")
        except h11.RemoteProtocolError as exc:
            status = exc.error_status_hint if exc.error_status_hint in (400, 431) else 400
            count(f"http_{status}")
            count("rejected_invalid")
            await self._try_send_status(status, f"malformed HTTP request: {exc}")
            await self._drain()
        except (OSError, asyncio.TimeoutError, h11.LocalProtocolError):
            return  # the client went away or stopped reading: nothing to answer

    def _deadline_s(self, what: str) -> float:
        return self.limits.header_timeout_s if what == "headers" else self.limits.body_timeout_s

    async def _try_send_status(self, status: int, message: str) -> None:
        if self.h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        try:
            await self._send_status(status, message, PROTOBUF, close=True)
        except (OSError, asyncio.TimeoutError, h11.LocalProtocolError):
            pass

    async def _serve_request(self, event: h11.Request) -> bool:
        """Answer one request; False when the connection must close."""
        receiver = self.receiver
        receiver.ingestor.count("http_requests")
        req = _Request(event, {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in event.headers})
        reply_type = JSON if _media_type(req.headers.get("content-type")) == JSON else PROTOBUF
        held = [0]
        try:
            signal = self._check_headers(req)
            try:
                body = await self._read_body(req, held)
            except BaseException:
                receiver.budget.release(held[0])
                raise
            self.ingesting = True
            receiver.in_flight += 1
            try:
                try:
                    result = await self.loop.run_in_executor(receiver.pool, receiver.ingest, signal,
                                                             req.content_type, req.encoding, body)
                finally:
                    del body
                    receiver.budget.release(held[0])
                await self._respond_result(result, req.content_type)
            finally:
                receiver.in_flight -= 1
                self.ingesting = False
            return True
        except HttpError as exc:
            return await self._fail(exc, req, reply_type)

    def _check_headers(self, req: _Request) -> Signal:
        """Everything decided before reading the body; returns the request's signal. Raises HttpError."""
        receiver = self.receiver
        path = req.event.target.decode("latin-1").split("?", 1)[0]
        signal = PATHS.get(path)
        if signal is None:
            raise HttpError(404, f"no OTLP endpoint at {path[:200]!r}; use /v1/traces, /v1/metrics or /v1/logs")
        if req.event.method != b"POST":
            raise HttpError(405, f"{req.event.method.decode('latin-1')} not allowed; OTLP/HTTP uses POST")
        if receiver.stopping:
            raise HttpError(503, "the collector is stopping; retry later", close=True)
        if not receiver.security.authorized(req.headers.get("authorization")):
            receiver.ingestor.count("rejected_unauthenticated")
            raise HttpError(401, UNAUTHENTICATED_MESSAGE, close=True)
        if req.headers.get("transfer-encoding"):
            raise HttpError(411, "chunked bodies are not accepted; send Content-Length", close=True)
        raw_length = req.headers.get("content-length")
        if raw_length is None:
            raise HttpError(411, "Content-Length is required", close=True)
        req.length = int(raw_length)  # h11 has checked it is a number
        limit = receiver.max_message_bytes
        if req.length > limit:
            raise HttpError(413, f"body of {req.length} bytes is over the {limit} byte limit", close=True)
        req.content_type = _media_type(req.headers.get("content-type"))
        if req.content_type not in (PROTOBUF, JSON):
            raise HttpError(415, f"unsupported Content-Type {req.content_type!r}; use {PROTOBUF} or {JSON}")
        req.encoding = (req.headers.get("content-encoding") or "identity").strip().lower()
        if req.encoding not in ("gzip", "identity"):
            raise HttpError(415, f"unsupported Content-Encoding {req.encoding!r}; use gzip or none")
        return signal

    async def _respond_result(self, result: IngestResult, content_type: str) -> None:
        if result.outcome is Outcome.OK:
            assert result.response is not None
            payload = (json_format.MessageToJson(result.response, indent=None).encode() if content_type == JSON
                       else result.response.SerializeToString())
            await self._send(200, payload, content_type, close=False)
            return
        status = _HTTP_STATUS[result.outcome]
        self.receiver.ingestor.count(f"http_{status}")  # the ingestor counted it as rejected_* already
        await self._send_status(status, result.message, content_type, close=False)

    async def _fail(self, exc: HttpError, req: _Request, reply_type: str) -> bool:
        """Answer an error raised before ingestion; counted as ``http_<status>`` (and ``rejected_invalid`` /
        ``rejected_too_large`` for 400 / 413). Returns False when the connection is to be closed."""
        count = self.receiver.ingestor.count
        count(f"http_{exc.status}")
        if exc.status == 400:
            count("rejected_invalid")
        elif exc.status == 413:
            count("rejected_too_large")
        body_unread = not exc.close and not self._skip_buffered_body()
        close = exc.close or body_unread
        await self._send_status(exc.status, exc.message, reply_type, close=close, method=req.event.method)
        if close and self.h11.their_state is h11.SEND_BODY:
            await self._drain()
        return not close

    def _skip_buffered_body(self) -> bool:
        """Drop the rest of the request body if it is already here (an empty or small body); True when the
        request was read to its end, so the connection can serve the next one."""
        while self.h11.their_state is h11.SEND_BODY:
            event = self.h11.next_event()
            if event is h11.NEED_DATA or isinstance(event, h11.ConnectionClosed):
                return False
        return True


def _media_type(raw: str | None) -> str:
    return (raw or "").split(";", 1)[0].strip().lower()


class HttpReceiver:
    """Serves OTLP/HTTP on ``host:port`` (port 0 picks a free port; see :attr:`port` after :meth:`start`)."""

    def __init__(self, ingestor: Ingestor, host: str, port: int, max_message_bytes: int,
                 limits: HttpLimits | None = None, security: ReceiverSecurity | None = None) -> None:
        self.ingestor = ingestor
        self.max_message_bytes = max_message_bytes
        self.limits = limits or HttpLimits()
        self.security = security or ReceiverSecurity()
        self._host = host
        self._requested_port = port
        self.budget = _ByteBudget(max(self.limits.body_buffer_bytes, max_message_bytes))
        self.pool: ThreadPoolExecutor | None = None
        self.in_flight = 0  # complete requests being ingested or answered (on the loop)
        self.stopping = False
        self.open_connections = 0
        self.peak_connections = 0
        self._at_limit_logged = False
        self._connections: set[_Connection] = set()
        self._handlers: set[asyncio.Task[None]] = set()  # a connection's handler until it ends
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    def ingest(self, signal: Signal, content_type: str, encoding: str, body: bytes) -> IngestResult:
        """Decompress, parse and store one body (in an ingest thread)."""
        ingestor = self.ingestor
        try:
            if encoding == "gzip":
                body = gunzip_capped(body, self.max_message_bytes)
            if content_type == PROTOBUF:
                return ingestor.ingest_bytes(signal, body)
            message = parse_json_request(signal, body)
        except HttpError as exc:
            return ingestor.reject(Outcome.TOO_LARGE if exc.status == 413 else Outcome.INVALID, exc.message)
        except Exception as exc:  # an answer for every request, whatever the input
            log.exception("OTLP/HTTP request failed")
            return ingestor.reject(Outcome.INVALID, f"internal error: {type(exc).__name__}")
        return ingestor.ingest_message(signal, message)

    # ---- lifecycle -----------------------------------------------------------------------------------

    def start(self) -> int:
        """Bind and start serving in a background thread; returns the bound port.

        Raises:
            BindError: the address cannot be bound (port in use, unknown host); an OSError naming the
                receiver, the address and why.
            ConfigError: the TLS certificate or key cannot be loaded.
        """
        ssl_context = self.security.server_ssl_context()
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        try:
            sock = socket.create_server((self._host, self._requested_port), family=family,
                                        backlog=min(socket.SOMAXCONN, self.limits.max_connections))
        except OSError as exc:
            raise BindError("OTLP/HTTP", format_hostport(self._host, self._requested_port),
                            bind_failure_reason(exc), "http_port") from exc
        self._check_fd_limit()
        self.port = sock.getsockname()[1]
        self.pool = ThreadPoolExecutor(self.limits.ingest_threads, thread_name_prefix="otlp-http")
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            self._server = loop.run_until_complete(asyncio.start_server(
                self._accept, sock=sock, ssl=ssl_context, limit=READ_CHUNK_BYTES,
                ssl_handshake_timeout=self.limits.header_timeout_s if ssl_context else None))
        except BaseException:
            sock.close()
            loop.close()
            self.pool.shutdown(wait=False)
            raise
        self._thread = threading.Thread(target=loop.run_forever, name="otlp-http-loop", daemon=True)
        self._thread.start()
        log.info("OTLP/HTTP receiver listening on %s:%s%s", self._host, self.port, " (TLS)" if ssl_context else "")
        return self.port

    def _check_fd_limit(self) -> None:
        try:
            import resource

            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        except (ImportError, OSError, ValueError):  # pragma: no cover - not on POSIX
            return
        if soft != resource.RLIM_INFINITY and soft < self.limits.max_connections + 64:
            log.warning("OTLP/HTTP receiver: max_connections is %d but this process may open only %d files "
                        "(RLIMIT_NOFILE); connections past that fail to be accepted", self.limits.max_connections,
                        soft)

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The server's callback for a new connection: starts its handler as a task of ours. Handed a coroutine
        instead, Python 3.11's stream protocol reads the handler task's exception when it ends, which raises
        for a task cancelled before its first step (what :meth:`stop` does to a connection accepted just then)
        and logs "Exception in callback" with a traceback."""
        task = asyncio.get_running_loop().create_task(self._on_connection(reader, writer))
        self._handlers.add(task)

        def done(task: asyncio.Task[None]) -> None:
            self._handlers.discard(task)
            if task.cancelled():  # before its first step: nothing of it was read
                writer.transport.abort()

        task.add_done_callback(done)

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        count = self.ingestor.count
        if self.open_connections >= self.limits.max_connections or self.stopping:
            count("http_connections_refused")
            if not self._at_limit_logged and not self.stopping:
                self._at_limit_logged = True
                log.warning("OTLP/HTTP receiver has %d connections open, its limit: closing new ones at once "
                            "(counted in http_connections_refused; logged again once it had room)",
                            self.open_connections)
            writer.transport.abort()
            return
        count("http_connections")
        self.open_connections += 1
        self.peak_connections = max(self.peak_connections, self.open_connections)
        conn = _Connection(self, reader, writer)
        self._connections.add(conn)
        try:
            await conn.serve()
        except asyncio.CancelledError:
            pass
        except Exception:  # pragma: no cover - serve() answers what it can; never lose the loop
            log.exception("OTLP/HTTP connection failed")
        finally:
            self._connections.discard(conn)
            self.open_connections -= 1
            if self.open_connections < self.limits.max_connections:
                self._at_limit_logged = False
            _close(writer)

    def stats(self) -> dict[str, int]:
        """``http_connections_open`` and ``http_connections_peak`` (gauges)."""
        return {"http_connections_open": self.open_connections, "http_connections_peak": self.peak_connections}

    def stop(self, grace_s: float) -> None:
        """Stop accepting connections, close idle ones, wait up to ``grace_s`` s for requests being read or
        ingested, then close the rest. Idempotent."""
        loop, self._loop = self._loop, None
        if loop is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(grace_s), loop).result(grace_s + 5.0)
        except Exception:  # pragma: no cover - the loop is stopped below whatever happened
            log.exception("OTLP/HTTP receiver did not shut down cleanly")
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(5.0)
        if not loop.is_running():
            loop.close()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)

    async def _shutdown(self, grace_s: float) -> None:
        self.stopping = True
        if self._server is not None:
            self._server.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while True:
            for conn in list(self._connections):
                if not conn.ingesting:  # idle, or still receiving: nothing of it was acknowledged
                    conn.writer.transport.abort()
            if self.in_flight == 0 or loop.time() >= deadline:
                break
            await asyncio.sleep(0.02)
        if self.in_flight:
            log.warning("OTLP/HTTP receiver stopped with %d requests still in flight after %.1f s",
                        self.in_flight, grace_s)
        for conn in list(self._connections):
            conn.writer.transport.abort()
        tasks = [t for t in asyncio.all_tasks(loop) if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _close(writer: asyncio.StreamWriter) -> None:
    """Close gracefully (flushing what is buffered); abort if that has not finished within a second."""
    transport = writer.transport
    if transport.is_closing():
        return
    writer.close()
    asyncio.get_running_loop().call_later(1.0, transport.abort)  # a no-op once closed
