"""Client interceptors for ``grpc`` (sync) and ``grpc.aio``: one CLIENT span per call, with the caller's trace
context sent along, so that the caller's span and the server's span sit in one trace.

Usage::

    channel = grpc.intercept_channel(grpc.insecure_channel(target), ZoomerClientInterceptor(target=target))
    channel = grpc.aio.insecure_channel(target, interceptors=aio_client_interceptors(target=target))

Each call records a CLIENT span (semantic conventions for RPC, as the server side: name and ``rpc.method``
= ``pkg.Service/Method``, ``rpc.system.name`` = ``grpc``, ``server.address`` / ``server.port`` from
``target``, ``rpc.response.status_code``; on the client every code but OK is an error: span status ERROR and
``error.type`` = the code name). The export worker derives ``rpc.client.call.duration`` (and the size
histograms) from these records (:mod:`zoomer_serve.export.rpc_metrics`); unsampled calls count too.

Parent: the current OpenTelemetry span when there is one (which, inside a handler traced by the zoomer
server interceptors, is the request span or a user span under it), else the current zoomer request span,
else none (a new trace). Sent in the metadata: ``traceparent`` (this client span, so it becomes the
server span's parent) and ``tracestate``, replacing any already there, and ``baggage`` from the current
OpenTelemetry context unless the caller set one.

The span ends when the call is over: for unary responses when the response (or error) arrived; for
streamed responses when the stream is done, after the caller read the last message (messages read are
counted), or when the call is cancelled. The sync interceptor returns for streamed responses a proxy of
grpc's call object (same methods; ``isinstance(x, grpc.Call)`` holds). The aio unary-unary interceptor
waits for the response inside the interceptor (as ``opentelemetry-instrumentation-grpc`` does), so
``initial_metadata()`` of such a call is available only once the call is over; for aio stream-unary calls
the response size is not recorded (the response is not visible to an interceptor that must return at once).
Anything that goes wrong inside the interceptor is counted and logged once; the call proceeds (fail open).
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc
from opentelemetry import baggage as otel_baggage
from opentelemetry import trace as otel_trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator

from interceptors.grpc_common import (
    CLIENT_ERROR_CODES,
    REQUEST_BYTES,
    REQUEST_MESSAGES,
    RESPONSE_BYTES,
    RESPONSE_MESSAGES,
    MethodNames,
    apply_status,
    message_size,
    recorder_and_config,
    static_attributes,
)
from zoomer_serve.recording import (
    ParentContext,
    RequestRecorder,
    RequestSpan,
    current_request,
    format_traceparent,
    internal_error,
)
from zoomer_serve.recording import records as r

_OK = grpc.StatusCode.OK
_REPLACED_KEYS = ("traceparent", "tracestate")
_BAGGAGE = W3CBaggagePropagator()
_MAX_METHODS = 10_000


def parse_target(target: str | None) -> tuple[str | None, int | None]:
    """``server.address`` and ``server.port`` of a gRPC channel target: ``host:port``, ``dns:///host:port``,
    ``dns://resolver/host:port``, ``ipv4:1.2.3.4:50051``, ``[::1]:50051``, ``unix:/path`` (no port)."""
    if not target:
        return None, None
    t = target.strip()
    if t.startswith("dns:///"):
        t = t[len("dns:///"):]
    elif t.startswith("dns://"):
        t = t[len("dns://"):].partition("/")[2]
    elif t.startswith(("dns:", "ipv4:", "ipv6:")):
        t = t.partition(":")[2]
    elif t.startswith("unix"):
        path = t.partition(":")[2].lstrip("/")
        return ("/" + path if path else None), None
    t = t.split(",", 1)[0]  # ipv4:a:1,b:2 lists several addresses; the first names the server
    if t.startswith("["):
        host, _, rest = t[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif t.count(":") == 1:
        host, _, port = t.partition(":")
    else:  # a bare host name or a bare IPv6 address
        host, port = t, ""
    return host or None, int(port) if port.isdigit() else None


def current_parent() -> ParentContext | None:
    """The parent of a client span started now: the current OpenTelemetry span (the innermost one; inside a
    traced handler it is the request span or a user span under it), else the current zoomer request span."""
    span_context = otel_trace.get_current_span().get_span_context()
    if span_context.is_valid:
        state = span_context.trace_state.to_header() if span_context.trace_state else ""
        return ParentContext(span_context.trace_id, span_context.span_id, int(span_context.trace_flags),
                             state or None, remote=span_context.is_remote)
    request = current_request()
    if request is not None:
        return ParentContext(request.trace_id, request.span_id, request.trace_flags, request.trace_state,
                             remote=False)
    return None


def outgoing_metadata(metadata: Any, span: RequestSpan) -> list[tuple[str, Any]]:
    """The caller's metadata with ``traceparent`` / ``tracestate`` of ``span`` (replacing any) and the
    current OpenTelemetry ``baggage`` (unless the caller set one)."""
    out = []
    has_baggage = False
    for item in metadata or ():
        key = item[0]
        if key in _REPLACED_KEYS:
            continue
        if key == "baggage":
            has_baggage = True
        out.append((key, item[1]))
    out.append(("traceparent", format_traceparent(span.trace_id, span.span_id, span.trace_flags)))
    if span.trace_state:
        out.append(("tracestate", span.trace_state))
    if not has_baggage and otel_baggage.get_all():
        carrier: dict[str, str] = {}
        _BAGGAGE.inject(carrier)
        if carrier.get("baggage"):
            out.append(("baggage", carrier["baggage"]))
    return out


class ClientCallTracer:
    """Starts and finishes CLIENT spans; shared by the sync and the aio client interceptors.

    Args:
        recorder: the request recorder; default: the process's (configured from the environment on first use).
        target: the channel target (``host:port``, ``dns:///host:port``, ...), recorded as ``server.address``
            / ``server.port``; optional.
        semconv_dup: also emit the older RPC attribute names; default from ``OTEL_SEMCONV_STABILITY_OPT_IN``.
    """

    def __init__(self, recorder: RequestRecorder | None = None, *, target: str | None = None,
                 semconv_dup: bool | None = None) -> None:
        self.recorder, config = recorder_and_config(recorder)
        self.dup = semconv_dup if semconv_dup is not None else config.semconv_rpc_dup
        self.server_address, self.server_port = parse_target(target)
        self._static: dict[str, tuple[str, dict[str, Any]]] = {}

    def _static_for(self, method: str | bytes) -> tuple[str, dict[str, Any]]:
        hit = self._static.get(method)  # type: ignore[arg-type]
        if hit is None:
            text = method.decode("utf-8", "replace") if isinstance(method, bytes) else method
            names = MethodNames.parse(text)
            hit = (names.rpc_method, static_attributes(names, self.server_address, self.server_port, self.dup))
            if len(self._static) < _MAX_METHODS:
                self._static[method] = hit  # type: ignore[index]
        return hit

    def start(self, method: str | bytes, metadata: Any) -> tuple[RequestSpan | None, list[tuple[str, Any]]]:
        """Open the CLIENT span of a call to ``method`` (``/pkg.Service/Method``); returns it (None if that
        failed: counted, and the call goes on untraced) and the metadata to send."""
        try:
            name, static = self._static_for(method)
            span = self.recorder.start(name, kind=r.KIND_CLIENT, attributes=dict(static), parent=current_parent())
            return span, outgoing_metadata(metadata, span)
        except Exception as exc:
            internal_error("grpc_client.start", exc)
            return None, list(metadata or ())

    def finish(self, span: RequestSpan | None, code: grpc.StatusCode | None, details: str | None,
               counts: list[int | None], exc: BaseException | None = None) -> None:
        """End ``span`` (once) with the call's status and ``counts`` = [request messages, request bytes,
        response messages, response bytes] (None: unknown, not recorded). ``exc``: an exception the call
        raised in the interceptor chain: an ``Exception`` is recorded and, when no code is known, the call is
        UNKNOWN; any other ``BaseException`` (gevent's ``GreenletExit`` when locust stops a user mid-call,
        ``KeyboardInterrupt``, ``SystemExit``) means the caller gave the call up: CANCELLED."""
        if span is None or not span.is_open:
            return
        try:
            error_type = None
            if isinstance(exc, Exception):
                span.record_exception(exc)
                if code is None:
                    code, details, error_type = grpc.StatusCode.UNKNOWN, f"{type(exc).__name__}: {exc}", \
                        type(exc).__qualname__
            elif exc is not None and code is None:
                code, details = grpc.StatusCode.CANCELLED, f"the caller gave up the call ({type(exc).__name__})"
            attrs = span.attributes
            for key, value in zip((REQUEST_MESSAGES, REQUEST_BYTES, RESPONSE_MESSAGES, RESPONSE_BYTES), counts):
                if value is not None:
                    attrs[key] = value
            apply_status(span, code or grpc.StatusCode.UNKNOWN, details or None, self.dup, error_type,
                         CLIENT_ERROR_CODES)
            span.end()
        except Exception as err:
            internal_error("grpc_client.finish", err)


# -- sync ---------------------------------------------------------------------------------------------------

class _SyncCallDetails(
        collections.namedtuple("_SyncCallDetails",
                               ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
        grpc.ClientCallDetails):
    pass


def _sync_details(details: grpc.ClientCallDetails, metadata: list[tuple[str, Any]]) -> grpc.ClientCallDetails:
    return _SyncCallDetails(details.method, details.timeout, metadata, details.credentials,
                            getattr(details, "wait_for_ready", None), getattr(details, "compression", None))


def _counting(requests: Iterator[Any], counts: list[Any]) -> Iterator[Any]:
    for message in requests:
        counts[0] += 1
        counts[1] += message_size(message)
        yield message


def _finish_unary_outcome(tracer: ClientCallTracer, span: RequestSpan, outcome: Any, counts: list[Any]) -> None:
    try:
        code = outcome.code()
        if code is _OK:
            counts[2], counts[3] = 1, message_size(outcome.result())
        tracer.finish(span, code, outcome.details(), counts)
    except Exception as exc:
        internal_error("grpc_client.done", exc)


class _ResponseStream:
    """grpc's call object for a streamed response as the caller gets it: iterating counts the messages; the
    span ends when the call is done and the caller is not in the middle of reading a message (grpc may report
    the call done while handing over the last message). Every other attribute is the call's."""

    __slots__ = ("_tracer", "_span", "_call", "_counts", "_lock", "_reading", "_done_pending")

    def __init__(self, tracer: ClientCallTracer, span: RequestSpan, call: Any, counts: list[Any]) -> None:
        self._tracer = tracer
        self._span = span
        self._call = call
        self._counts = counts
        self._lock = threading.Lock()
        self._reading = False
        self._done_pending = False

    def __iter__(self) -> _ResponseStream:
        return self

    def __next__(self) -> Any:
        with self._lock:
            self._reading = True
        try:
            message = next(self._call)
        except BaseException:
            self._stop_reading()
            raise
        self._counts[2] += 1
        self._counts[3] += message_size(message)
        self._stop_reading()
        return message

    def _stop_reading(self) -> None:
        with self._lock:
            self._reading = False
            pending, self._done_pending = self._done_pending, False
        if pending:
            self._finish()

    def on_done(self, _call: Any) -> None:
        with self._lock:
            if self._reading:
                self._done_pending = True
                return
        self._finish()

    def _finish(self) -> None:
        try:
            self._tracer.finish(self._span, self._call.code(), self._call.details(), self._counts)
        except Exception as exc:
            internal_error("grpc_client.done", exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)


for _abc in (grpc.Call, grpc.Future, grpc.RpcContext):
    _abc.register(_ResponseStream)


class ZoomerClientInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                              grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Records one CLIENT span per call on a sync channel and sends the trace context (module docstring).

    Args: see :class:`ClientCallTracer` (``recorder``, ``target``, ``semconv_dup``).
    """

    def __init__(self, recorder: RequestRecorder | None = None, *, target: str | None = None,
                 semconv_dup: bool | None = None) -> None:
        self.tracer = ClientCallTracer(recorder, target=target, semconv_dup=semconv_dup)

    def intercept_unary_unary(self, continuation: Callable[..., Any], client_call_details: grpc.ClientCallDetails,
                              request: Any) -> Any:
        return self._unary_response(continuation, client_call_details, request, False)

    def intercept_stream_unary(self, continuation: Callable[..., Any], client_call_details: grpc.ClientCallDetails,
                               request_iterator: Iterator[Any]) -> Any:
        return self._unary_response(continuation, client_call_details, request_iterator, True)

    def intercept_unary_stream(self, continuation: Callable[..., Any], client_call_details: grpc.ClientCallDetails,
                               request: Any) -> Any:
        return self._stream_response(continuation, client_call_details, request, False)

    def intercept_stream_stream(self, continuation: Callable[..., Any], client_call_details: grpc.ClientCallDetails,
                                request_iterator: Iterator[Any]) -> Any:
        return self._stream_response(continuation, client_call_details, request_iterator, True)

    def _begin(self, details: grpc.ClientCallDetails, request: Any, streaming_request: bool
               ) -> tuple[RequestSpan | None, grpc.ClientCallDetails, Any, list[Any]]:
        span, metadata = self.tracer.start(details.method, details.metadata)
        counts: list[Any] = [0, 0, 0, 0]
        if span is None:
            return None, details, request, counts
        if streaming_request:
            request = _counting(request, counts)
        else:
            counts[0], counts[1] = 1, message_size(request)
        return span, _sync_details(details, metadata), request, counts

    def _unary_response(self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, request: Any,
                        streaming_request: bool) -> Any:
        span, details, request, counts = self._begin(details, request, streaming_request)
        if span is None:
            return continuation(details, request)
        try:
            outcome = continuation(details, request)
        except BaseException as exc:
            self.tracer.finish(span, None, None, counts, exc)
            raise
        try:
            outcome.add_done_callback(lambda done: _finish_unary_outcome(self.tracer, span, done, counts))
        except Exception as exc:
            internal_error("grpc_client.add_done_callback", exc)
        return outcome

    def _stream_response(self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, request: Any,
                         streaming_request: bool) -> Any:
        span, details, request, counts = self._begin(details, request, streaming_request)
        if span is None:
            return continuation(details, request)
        try:
            call = continuation(details, request)
        except BaseException as exc:
            self.tracer.finish(span, None, None, counts, exc)
            raise
        try:
            stream = _ResponseStream(self.tracer, span, call, counts)
            call.add_done_callback(stream.on_done)
            return stream
        except Exception as exc:
            internal_error("grpc_client.add_done_callback", exc)
            return call


# -- asyncio ------------------------------------------------------------------------------------------------

def _aio_details(details: grpc.aio.ClientCallDetails, metadata: list[tuple[str, Any]]
                 ) -> grpc.aio.ClientCallDetails:
    return grpc.aio.ClientCallDetails(details.method, details.timeout, grpc.aio.Metadata(*metadata),
                                      details.credentials, details.wait_for_ready)


def _counting_any(requests: Any, counts: list[Any]) -> Any:
    """A counting wrapper of an aio request stream (an async or a plain iterable)."""
    if hasattr(requests, "__aiter__"):
        return _counting_async(requests, counts)
    return _counting(iter(requests), counts)


async def _counting_async(requests: Any, counts: list[Any]) -> AsyncIterator[Any]:
    async for message in requests:
        counts[0] += 1
        counts[1] += message_size(message)
        yield message


def _completed(awaitable: Any) -> Any:
    """The value of a coroutine that finishes without suspending (a finished call's ``code()``)."""
    try:
        awaitable.send(None)
    except StopIteration as stop:
        return stop.value
    awaitable.close()
    raise RuntimeError("the call's status is not available yet")


def _finish_done_aio(tracer: ClientCallTracer, span: RequestSpan, call: Any, counts: list[Any]) -> None:
    """Done-callback of an aio call: end the span with the call's status (read without waiting: the call is
    over; if grpc ever makes that wait, a task reads it)."""
    if not span.is_open:
        return
    try:
        code, details = _completed(call.code()), _completed(call.details())
    except RuntimeError:
        asyncio.ensure_future(_finish_later(tracer, span, call, counts))
        return
    except Exception as exc:
        internal_error("grpc_client.done", exc)
        return
    tracer.finish(span, code, details, counts)


async def _finish_later(tracer: ClientCallTracer, span: RequestSpan, call: Any, counts: list[Any]) -> None:
    try:
        tracer.finish(span, await call.code(), await call.details(), counts)
    except Exception as exc:
        internal_error("grpc_client.done", exc)


async def _counting_responses(call: Any, counts: list[Any]) -> AsyncIterator[Any]:
    async for message in call:
        counts[2] += 1
        counts[3] += message_size(message)
        yield message


class _AioClientInterceptor:
    def __init__(self, tracer: ClientCallTracer) -> None:
        self.tracer = tracer

    def _begin(self, details: grpc.aio.ClientCallDetails, request: Any, streaming_request: bool
               ) -> tuple[RequestSpan | None, grpc.aio.ClientCallDetails, Any, list[Any]]:
        span, metadata = self.tracer.start(details.method, details.metadata)
        counts: list[Any] = [0, 0, 0, 0]
        if span is None:
            return None, details, request, counts
        if streaming_request:
            request = _counting_any(request, counts)
        else:
            counts[0], counts[1] = 1, message_size(request)
        return span, _aio_details(details, metadata), request, counts

    async def _start_call(self, continuation: Callable[..., Any], details: grpc.aio.ClientCallDetails,
                          request: Any, streaming_request: bool) -> tuple[Any, RequestSpan | None, list[Any]]:
        span, details, request, counts = self._begin(details, request, streaming_request)
        try:
            call = await continuation(details, request)
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                self.tracer.finish(span, grpc.StatusCode.CANCELLED, None, counts)
            else:
                self.tracer.finish(span, getattr(exc, "code", lambda: None)(), None, counts, exc)
            raise
        return call, span, counts

    def _end_when_done(self, span: RequestSpan | None, call: Any, counts: list[Any]) -> None:
        if span is None:
            return
        try:
            call.add_done_callback(lambda done: _finish_done_aio(self.tracer, span, done, counts))
        except Exception as exc:
            internal_error("grpc_client.add_done_callback", exc)


class ZoomerAioUnaryUnaryClientInterceptor(_AioClientInterceptor, grpc.aio.UnaryUnaryClientInterceptor):
    """The unary-unary part of :func:`aio_client_interceptors`."""

    async def intercept_unary_unary(self, continuation: Callable[..., Any],
                                    client_call_details: grpc.aio.ClientCallDetails, request: Any) -> Any:
        call, span, counts = await self._start_call(continuation, client_call_details, request, False)
        if span is None:
            return call
        try:
            response = await call
        except asyncio.CancelledError:
            self.tracer.finish(span, grpc.StatusCode.CANCELLED, None, counts)
            raise
        except grpc.aio.AioRpcError as err:
            self.tracer.finish(span, err.code(), err.details(), counts)
            return call  # awaiting it raises the same error to the caller
        except Exception as exc:
            self.tracer.finish(span, None, None, counts, exc)
            return call
        counts[2], counts[3] = 1, message_size(response)
        self.tracer.finish(span, _OK, None, counts)
        return call


class ZoomerAioStreamUnaryClientInterceptor(_AioClientInterceptor, grpc.aio.StreamUnaryClientInterceptor):
    """The stream-unary part of :func:`aio_client_interceptors` (no response size: see the module docs)."""

    async def intercept_stream_unary(self, continuation: Callable[..., Any],
                                     client_call_details: grpc.aio.ClientCallDetails, request_iterator: Any) -> Any:
        call, span, counts = await self._start_call(continuation, client_call_details, request_iterator, True)
        counts[2] = counts[3] = None
        self._end_when_done(span, call, counts)
        return call


class ZoomerAioUnaryStreamClientInterceptor(_AioClientInterceptor, grpc.aio.UnaryStreamClientInterceptor):
    """The unary-stream part of :func:`aio_client_interceptors`."""

    async def intercept_unary_stream(self, continuation: Callable[..., Any],
                                     client_call_details: grpc.aio.ClientCallDetails, request: Any) -> Any:
        call, span, counts = await self._start_call(continuation, client_call_details, request, False)
        if span is None:
            return call
        self._end_when_done(span, call, counts)
        return _counting_responses(call, counts)


class ZoomerAioStreamStreamClientInterceptor(_AioClientInterceptor, grpc.aio.StreamStreamClientInterceptor):
    """The stream-stream part of :func:`aio_client_interceptors`."""

    async def intercept_stream_stream(self, continuation: Callable[..., Any],
                                      client_call_details: grpc.aio.ClientCallDetails, request_iterator: Any) -> Any:
        call, span, counts = await self._start_call(continuation, client_call_details, request_iterator, True)
        if span is None:
            return call
        self._end_when_done(span, call, counts)
        return _counting_responses(call, counts)


def aio_client_interceptors(recorder: RequestRecorder | None = None, *, target: str | None = None,
                            semconv_dup: bool | None = None) -> list[grpc.aio.ClientInterceptor]:
    """The four ``grpc.aio`` client interceptors (grpc.aio takes one object per RPC kind), sharing one
    :class:`ClientCallTracer`; pass them all as ``grpc.aio.insecure_channel(target, interceptors=...)``.
    Args: see :class:`ClientCallTracer`."""
    tracer = ClientCallTracer(recorder, target=target, semconv_dup=semconv_dup)
    return [ZoomerAioUnaryUnaryClientInterceptor(tracer), ZoomerAioUnaryStreamClientInterceptor(tracer),
            ZoomerAioStreamUnaryClientInterceptor(tracer), ZoomerAioStreamStreamClientInterceptor(tracer)]
