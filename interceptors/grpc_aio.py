"""``grpc.aio.ServerInterceptor`` for the asyncio ``grpc.aio.server``: one SERVER span per call, all four RPC
kinds, both streaming handler styles.

Usage::

    server = grpc.aio.server(interceptors=[ZoomerAioServerInterceptor()])

The spans are those of the sync interceptor (:mod:`interceptors.grpc_server`): both run the same
:class:`~interceptors.grpc_common.ServerCallTracer` (start, final status, counts, end) and
:class:`~interceptors.grpc_common.ServerInterceptorCore` (settings, per-method handler cache, dispatch), so
names, attributes, status mapping, request observers (GPU memory, profiling) and metrics are identical.
Only how a handler is driven differs:

- ``async def`` unary-response handlers: the span ends when the coroutine raises, or once grpc has serialized
  the response it returned (see below).
- async-generator handlers (``yield`` responses): the span is current around each step and ends after the
  last message (or on an exception, or when the call is cancelled).
- read/write-style handlers (``await context.read()`` / ``await context.write()``, returning nothing): the
  handler gets a context proxy that counts the messages read and written; the span ends when the coroutine
  returns, which is after its last write (C01).

The span is made current for the task that runs the handler (contextvars are per task), so OpenTelemetry
spans, :func:`zoomer_serve.phase` and :func:`zoomer_serve.current_request` inside the handler see it; code
the handler sends to an executor sees it when run with ``asyncio.to_thread`` (which copies the context).
Cancellation (client cancel, deadline, server stop) reaches the handler as ``asyncio.CancelledError``; the
span then ends with CANCELLED or DEADLINE_EXCEEDED. For streaming responses a done-callback on the call
ends any span still open when the call is over, so no span outlives its call. ``abort()`` (with or without
trailing metadata) passes through unchanged; its code and details are the span's. Sync handler functions on
an aio server (grpc runs them in its migration thread pool) are left untraced, with one warning per method.
Anything that goes wrong inside the interceptor is counted and logged once; the call proceeds (fail open).

Calls that fail before or around the handler (C16; the sync module's docstring has the sync side):

- a request message that the method's deserializer rejects: grpc.aio raises the deserializer's exception in
  the call's task before any handler runs (it then logs it and answers UNKNOWN). The interceptor's
  deserializer hands the message on marked (:class:`~interceptors.grpc_common.UndecodableRequest`) and the
  traced handler raises the same exception there, without calling the application, so grpc does and answers
  the same and the call has its span (UNKNOWN, ``error.type`` = the exception's type, an ``exception``
  event). In a request stream the exception is raised from the handler's read, as grpc.aio raises it.
- a response the method's serializer rejects: grpc.aio raises the serializer's exception in the call's task
  (it then logs it and answers UNKNOWN, or the code the handler set). The interceptor's wrapper of the
  serializer ends the span so; a unary response's span ends once the response is serialized, with its
  serialized size (:mod:`interceptors.grpc_serialized`, shared with the sync server). A read/write-style
  handler gets the exception from its ``write`` and ends as it handles it.
- a client's cancel (or grpc's size limit cutting a request stream) reaches a handler blocked on its next
  request message as the end of the stream as often as not; the wrapper yields to the event loop once before
  it reports such a call complete, so that grpc's cancel of the task arrives first in most of them (see
  :func:`_let_a_cancel_arrive`).
"""

from __future__ import annotations

import abc
import asyncio
import contextvars
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from time import monotonic_ns
from typing import Any, NoReturn

import grpc

from interceptors.grpc_common import ServerCallTracer, ServerInterceptorCore, UndecodableRequest, message_size
from interceptors.grpc_serialized import (
    Entry,
    end_left_calls,
    handler_returned,
    leave_for_serializer,
    unary_serializer,
)
from zoomer_serve.recording import RequestSpan, internal_error

logger = logging.getLogger("zoomer_serve")
_EOF = grpc.aio.EOF
_SERIALIZED = (None, grpc.StatusCode.OK)  # the codes (``context.code()``) with which grpc.aio serializes a response

_STREAMING: contextvars.ContextVar[tuple[ServerCallTracer, RequestSpan, grpc.aio.ServicerContext, list[int]] | None] \
    = contextvars.ContextVar("zoomer_streaming", default=None)
"""The call whose async-generator responses grpc.aio is serializing (in the call's task)."""


def _delegate(name: str) -> Callable[..., Any]:
    def method(self: _HandlerContext, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._context, name)(*args, **kwargs)

    method.__name__ = name
    return method


class _HandlerContext(grpc.aio.ServicerContext):
    """The handler's view of an aio ``ServicerContext``: the same context, except that

    - messages passing through ``read()`` / ``write()`` are counted into ``counts`` = [request messages,
      request bytes, response messages, response bytes, 1 once the request stream has ended] (read/write-style
      handlers); a message that could not be deserialized raises its exception here, as grpc.aio would;
    - ``abort()`` / ``abort_with_status()`` end the span with the given code and details first: grpc.aio
      sends the status to the client inside ``abort()``, before it raises, so the span must be complete by
      then (as with the sync server, where the status leaves after the handler).

    Every other method is the real context's, unchanged.
    """

    __slots__ = ("_context", "_counts", "_tracer", "_span")

    def __init__(self, context: grpc.aio.ServicerContext, counts: list[int], tracer: ServerCallTracer,
                 span: RequestSpan | None) -> None:
        self._context = context
        self._counts = counts
        self._tracer = tracer
        self._span = span

    async def read(self) -> Any:
        message = await self._context.read()
        counts = self._counts
        if message is _EOF:
            counts[4] = 1
            return message
        counts[0] += 1
        if message.__class__ is UndecodableRequest:
            _refuse(message)
        counts[1] += message_size(message)
        return message

    async def write(self, message: Any) -> None:
        counts = self._counts  # counted when handed to grpc, like a yielded message
        counts[2] += 1
        counts[3] += message_size(message)
        await self._context.write(message)

    async def abort(self, code: grpc.StatusCode, details: str = "", *args: Any, **kwargs: Any) -> NoReturn:
        self._end_for_abort(code, details)
        await self._context.abort(code, details, *args, **kwargs)
        raise AssertionError("grpc.aio abort() returned")  # it raises; satisfies NoReturn

    async def abort_with_status(self, status: grpc.Status) -> NoReturn:
        self._end_for_abort(status.code, status.details)
        await self._context.abort_with_status(status)
        raise AssertionError("grpc.aio abort_with_status() returned")

    def _end_for_abort(self, code: Any, details: str | None) -> None:
        if self._span is None or not self._span.is_open:
            return
        try:
            if not isinstance(code, grpc.StatusCode):  # grpc rejects it; let the real abort() say so
                return
            details = details or self._context.details() or None
            self._tracer.finish(self._span, self._context, None, self._counts, status=(code, details, None))
        except Exception as exc:
            internal_error(self._tracer.place + ".abort", exc)

    def __getattr__(self, name: str) -> Any:  # anything the real context has beyond the public API
        return getattr(self._context, name)


for _name in dir(grpc.aio.ServicerContext):
    if not _name.startswith("_") and _name not in _HandlerContext.__dict__:
        setattr(_HandlerContext, _name, _delegate(_name))
abc.update_abstractmethods(_HandlerContext)


def _refuse(request: UndecodableRequest) -> NoReturn:
    """A request message that the method's deserializer rejected: raise its exception in the handler's task,
    where grpc.aio would have raised it without the interceptor (it then logs it and answers UNKNOWN)."""
    if request.error is None:  # not produced on grpc.aio (the asyncio flavour hands None results on)
        raise RuntimeError("zoomer-serve: request could not be deserialized")
    raise request.error


class _CountingRequests:
    """An async iterator over the request stream that counts messages and bytes into ``counts[0:2]`` and
    notes its end in ``counts[4]``; a message that could not be deserialized raises its exception here."""

    __slots__ = ("_requests", "_iterator", "_counts")

    def __init__(self, requests: Any, counts: list[int]) -> None:
        self._requests = requests
        self._iterator: Any = None
        self._counts = counts

    def __aiter__(self) -> _CountingRequests:
        return self

    async def __anext__(self) -> Any:
        if self._iterator is None:
            self._iterator = self._requests.__aiter__()
        counts = self._counts
        try:
            message = await self._iterator.__anext__()
        except StopAsyncIteration:
            counts[4] = 1
            raise
        counts[0] += 1
        if message.__class__ is UndecodableRequest:
            _refuse(message)
        counts[1] += message_size(message)
        return message


def _inputs(tracer: ServerCallTracer, span: RequestSpan | None, request: Any, context: grpc.aio.ServicerContext,
            streaming_request: bool) -> tuple[Any, _HandlerContext, list[int]]:
    """The request (or a counting request iterator), the context the handler gets, and ``counts`` =
    [request messages, request bytes, response messages, response bytes, 1 once the request stream ended].
    A unary request that could not be deserialized stays an :class:`UndecodableRequest` (see the wrappers)."""
    if streaming_request:
        counts = [0, 0, 0, 0, 0]
        request = _CountingRequests(request, counts)
    else:
        counts = [1, message_size(request), 0, 0, 0]
    return request, _HandlerContext(context, counts, tracer, span), counts


def _finish_when_done(tracer: ServerCallTracer, span: RequestSpan | None, context: grpc.aio.ServicerContext,
                      counts: list[int]) -> None:
    """Safety net for streaming responses: when the call is over, end the span if the handler has not
    (the call ended under it: cancelled, or the deadline passed)."""
    if span is None:
        return
    try:
        context.add_done_callback(lambda _ctx: tracer.finish(span, context, None, counts, call_over=True))
    except Exception as exc:
        internal_error(tracer.place + ".add_done_callback", exc)


async def _let_a_cancel_arrive(counts: list[int]) -> None:
    """Before a call whose request stream has ended is reported complete, yield to the event loop once. A
    client's cancel reaches grpc.aio twice: as the end of the request stream (the pending read returns EOF)
    and as the cancel of the call's task; when the handler sees the EOF first and returns, grpc's status then
    fails silently and the call would look OK. The yield lets the task's cancel arrive in most such calls (it
    is raised here: the span ends CANCELLED); grpc.aio offers Python no other sign of it."""
    if counts[4]:
        await asyncio.sleep(0)


def _wrap_coroutine(tracer: ServerCallTracer, behavior: Callable[..., Awaitable[Any]], streaming_request: bool,
                    streaming_response: bool) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
    """``async def`` handlers: unary responses (returned), or read/write style streams (written through the
    context; the coroutine returns nothing after the last write)."""
    refuse = not streaming_request  # a unary request is checked here, a streamed one as it is read

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        span = tracer.start(context)
        request, handler_context, counts = _inputs(tracer, span, request, context, streaming_request)
        if streaming_response:
            _finish_when_done(tracer, span, context, counts)
        if span is not None:
            span.activate()
        try:
            if refuse and request.__class__ is UndecodableRequest:
                _refuse(request)
            response = await behavior(request, handler_context)
            if streaming_request:
                await _let_a_cancel_arrive(counts)
        except BaseException as exc:
            if span is not None:
                span.deactivate()
            tracer.finish(span, context, exc, counts)
            raise
        if span is not None:
            span.deactivate()
            if not streaming_response and tracer.late_end and span.is_open and context.code() in _SERIALIZED:
                leave_for_serializer((tracer, span, context, counts, False, response, monotonic_ns()))
                return response
        handler_returned(tracer, span, context, counts, False, None if streaming_response else response)
        return response

    return call


def _not_serialized(entry: Entry, exc: BaseException | None) -> None:
    """grpc.aio answers a response its serializer rejects as an exception in the handler (UNKNOWN)."""
    tracer, span, context, counts = entry[:4]
    tracer.finish(span, context, exc, counts, call_over=False)


def _serializer_of_stream(serializer: Callable[[Any], bytes] | None) -> Callable[[Any], bytes]:
    """An async-generator response stream's serializer: a message that ``serializer`` rejects ends the
    stream's span as grpc.aio ends the call then (:func:`_not_serialized`). A read/write-style
    handler gets the exception from its ``write`` and decides itself."""

    def serialize(message: Any) -> bytes:
        try:
            return message if serializer is None else serializer(message)
        except BaseException as exc:
            entry = _STREAMING.get()
            if entry is not None:
                if entry[1].is_open:
                    entry[3][2] -= 1  # counted when the handler gave it, never sent
                _not_serialized((*entry, False, None, 0), exc)
            raise

    return serialize


def _wrap_async_generator(tracer: ServerCallTracer, behavior: Callable[..., AsyncIterator[Any]],
                          streaming_request: bool) -> Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]:
    """Async-generator handlers: the span is current around each step of the handler and ends after its
    last message, on its exception, or when the call is cancelled."""
    refuse = not streaming_request  # a unary request is checked here, a streamed one as it is read

    async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        span = tracer.start(context)
        request, handler_context, counts = _inputs(tracer, span, request, context, streaming_request)
        _finish_when_done(tracer, span, context, counts)
        error: BaseException | None = None
        try:
            if span is not None:
                _STREAMING.set((tracer, span, context, counts))
                span.activate()
            try:
                if refuse and request.__class__ is UndecodableRequest:
                    _refuse(request)
                iterator = behavior(request, handler_context).__aiter__()
            finally:
                if span is not None:
                    span.deactivate()
            while True:
                if span is not None:
                    span.activate()
                try:
                    message = await iterator.__anext__()
                except StopAsyncIteration:
                    break
                finally:
                    if span is not None:
                        span.deactivate()
                counts[2] += 1
                counts[3] += message_size(message)
                yield message
            if streaming_request:
                await _let_a_cancel_arrive(counts)
        except BaseException as exc:
            error = exc
            raise
        finally:
            tracer.finish(span, context, error, counts)

    return call


class ZoomerAioServerInterceptor(ServerInterceptorCore, grpc.aio.ServerInterceptor):
    """Records one SERVER span per call of a ``grpc.aio`` server (see the module docstring).

    Args: see :class:`~interceptors.grpc_common.ServerInterceptorCore` (``recorder``, ``server_address``,
    ``server_port``, ``excluded_methods``, ``filter_``, ``semconv_dup``); the same as the sync
    :class:`~interceptors.grpc_server.ZoomerServerInterceptor`.
    """

    place = "grpc_aio"
    sync_grpc = False

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        return self._handler_for(handler, handler_call_details.method)

    def _call_over(self, context: Any, exc: BaseException | None) -> bool:
        return isinstance(exc, asyncio.CancelledError) or context.cancelled()

    def _wrap_behavior(self, tracer: ServerCallTracer, behavior: Callable[..., Any], request_streaming: bool,
                       response_streaming: bool, sized: bool) -> Callable[..., Any] | None:
        # The same tests grpc.aio uses to pick how to drive a handler, so the wrapper is driven the same way.
        if response_streaming and inspect.isasyncgenfunction(behavior):
            return _wrap_async_generator(tracer, behavior, request_streaming)
        if inspect.iscoroutinefunction(behavior):
            return _wrap_coroutine(tracer, behavior, request_streaming, response_streaming)
        if getattr(behavior, "__module__", "").endswith("_pb2_grpc"):  # the generated servicer's default
            logger.warning("zoomer-serve: %s is not implemented by its servicer (the generated default answers "
                           "UNIMPLEMENTED); it is not traced", tracer.name)
        else:
            logger.warning("zoomer-serve: %s has a sync handler on a grpc.aio server; it is not traced",
                           tracer.name)
        return None

    def _wrap_serializer(self, tracer: ServerCallTracer, serializer: Callable[[Any], bytes] | None,
                         response_streaming: bool) -> Callable[[Any], Any]:
        self.recorder.add_before_shutdown(end_left_calls)
        if response_streaming:
            return _serializer_of_stream(serializer)
        return unary_serializer(tracer, serializer, _not_serialized)
