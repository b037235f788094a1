"""``grpc.aio.ServerInterceptor`` for the asyncio ``grpc.aio.server``: one SERVER span per call, all four RPC
kinds, both streaming handler styles.

Usage::

    server = grpc.aio.server(interceptors=[ZoomerAioServerInterceptor()])

The spans are those of the sync interceptor (:mod:`interceptors.grpc_server`): both run the same
:class:`~interceptors.grpc_common.ServerCallTracer` (start, final status, counts, end) and
:class:`~interceptors.grpc_common.ServerInterceptorCore` (settings, per-method handler cache, dispatch), so
names, attributes, status mapping, request observers (GPU memory, profiling) and metrics are identical.
Only how a handler is driven differs:

- ``async def`` unary-response handlers: the span ends when the coroutine returns or raises.
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
"""

from __future__ import annotations

import abc
import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn

import grpc

from interceptors.grpc_common import ServerCallTracer, ServerInterceptorCore, message_size
from zoomer_serve.recording import RequestSpan, internal_error

logger = logging.getLogger("zoomer_serve")
_EOF = grpc.aio.EOF


def _delegate(name: str) -> Callable[..., Any]:
    def method(self: _HandlerContext, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._context, name)(*args, **kwargs)

    method.__name__ = name
    return method


class _HandlerContext(grpc.aio.ServicerContext):
    """The handler's view of an aio ``ServicerContext``: the same context, except that

    - messages passing through ``read()`` / ``write()`` are counted into ``counts`` = [request messages,
      request bytes, response messages, response bytes] (read/write-style handlers);
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
        if message is not _EOF:
            counts = self._counts
            counts[0] += 1
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


class _CountingRequests:
    """An async iterator over the request stream that counts messages and bytes into ``counts[0:2]``."""

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
        message = await self._iterator.__anext__()
        counts = self._counts
        counts[0] += 1
        counts[1] += message_size(message)
        return message


def _inputs(tracer: ServerCallTracer, span: RequestSpan | None, request: Any, context: grpc.aio.ServicerContext,
            streaming_request: bool, counts: list[int]) -> tuple[Any, _HandlerContext]:
    """The request (or a counting request iterator) and the context the handler gets."""
    if streaming_request:
        request = _CountingRequests(request, counts)
    else:
        counts[0], counts[1] = 1, message_size(request)
    return request, _HandlerContext(context, counts, tracer, span)


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


def _wrap_coroutine(tracer: ServerCallTracer, behavior: Callable[..., Awaitable[Any]], streaming_request: bool,
                    streaming_response: bool) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
    """``async def`` handlers: unary responses (returned), or read/write style streams (written through the
    context; the coroutine returns nothing after the last write)."""

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        span = tracer.start(context)
        counts = [0, 0, 0, 0]
        request, handler_context = _inputs(tracer, span, request, context, streaming_request, counts)
        if streaming_response:
            _finish_when_done(tracer, span, context, counts)
        if span is not None:
            span.activate()
        try:
            response = await behavior(request, handler_context)
        except BaseException as exc:
            if span is not None:
                span.deactivate()
            tracer.finish(span, context, exc, counts)
            raise
        if span is not None:
            span.deactivate()
        if response is not None and not streaming_response:
            counts[2], counts[3] = 1, message_size(response)
        tracer.finish(span, context, None, counts)
        return response

    return call


def _wrap_async_generator(tracer: ServerCallTracer, behavior: Callable[..., AsyncIterator[Any]],
                          streaming_request: bool) -> Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]:
    """Async-generator handlers: the span is current around each step of the handler and ends after its
    last message, on its exception, or when the call is cancelled."""

    async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        span = tracer.start(context)
        counts = [0, 0, 0, 0]
        request, handler_context = _inputs(tracer, span, request, context, streaming_request, counts)
        _finish_when_done(tracer, span, context, counts)
        error: BaseException | None = None
        try:
            if span is not None:
                span.activate()
            try:
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
                    return
                finally:
                    if span is not None:
                        span.deactivate()
                counts[2] += 1
                counts[3] += message_size(message)
                yield message
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
        logger.warning("zoomer-serve: %s has a sync handler on a grpc.aio server; it is not traced", tracer.name)
        return None
