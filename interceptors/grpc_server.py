"""``grpc.ServerInterceptor`` for the sync ``grpc.server``: one SERVER span per call, all four RPC kinds.

Usage::

    server = grpc.server(pool, interceptors=[ZoomerServerInterceptor()])

The interceptor wraps each method handler once (cached per method) so that every call opens a request span
through the shared recorder, makes it current for the handler (OpenTelemetry spans that the handler starts
become its children), and ends it exactly once: after the response for unary responses, after the last
streamed message, or when the call is cancelled or its deadline passes. Anything that goes wrong inside the
interceptor is counted and logged once; the call itself proceeds unchanged (fail open). Handler exceptions
are recorded on the span and re-raised unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc

from interceptors.grpc_common import ServerCallTracer, ServerInterceptorCore, message_size
from zoomer_serve.recording import RequestSpan, internal_error


def _counting(iterator: Iterator[Any], counts: list[int]) -> Iterator[Any]:
    for message in iterator:
        counts[0] += 1
        counts[1] += message_size(message)
        yield message


def _open_call(tracer: ServerCallTracer, request: Any, context: grpc.ServicerContext, streaming_request: bool,
               sized: bool) -> tuple[RequestSpan | None, Any, list[int]]:
    """Start the call's span; ``counts`` = [request messages, request bytes, response messages, response
    bytes], with a streamed request wrapped so that its messages are counted as the handler reads them;
    ``sized``: the request is ``(message, bytes received)``. Returns the request the handler gets."""
    span = tracer.start(context)
    counts = [0, 0, 0, 0]
    if streaming_request:
        request = _counting(request, counts)
    elif sized:
        request, counts[1] = request
        counts[0] = 1
    else:
        counts[0], counts[1] = 1, message_size(request)
    return span, request, counts


def _wrap_unary_response(tracer: ServerCallTracer, behavior: Callable[..., Any], streaming_request: bool,
                         sized: bool) -> Callable[[Any, grpc.ServicerContext], Any]:
    def call(request: Any, context: grpc.ServicerContext) -> Any:
        span, request, counts = _open_call(tracer, request, context, streaming_request, sized)
        if span is not None:
            span.activate()
        try:
            response = behavior(request, context)
        except BaseException as exc:
            if span is not None:
                span.deactivate()
            tracer.finish(span, context, exc, counts)
            raise
        if span is not None:
            span.deactivate()
        if response is not None:
            counts[2], counts[3] = 1, message_size(response)
        tracer.finish(span, context, None, counts)
        return response

    return call


def _wrap_stream_response(tracer: ServerCallTracer, behavior: Callable[..., Any], streaming_request: bool,
                          sized: bool) -> Callable[[Any, grpc.ServicerContext], Iterator[Any]]:
    def call(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        span, request, counts = _open_call(tracer, request, context, streaming_request, sized)
        if span is not None:
            try:
                context.add_callback(lambda: tracer.finish(span, context, None, counts))
            except Exception as exc:
                internal_error("grpc_server.add_callback", exc)
        return _traced_stream(tracer, span, behavior, request, context, counts)

    return call


def _traced_stream(tracer: ServerCallTracer, span: RequestSpan | None, behavior: Callable[..., Any], request: Any,
                   context: grpc.ServicerContext, counts: list[int]) -> Iterator[Any]:
    """Runs the handler's response iterator with the span current around each step; ends the span after
    the last message, on an exception, or when grpc stops iterating (client cancel: GeneratorExit)."""
    error: BaseException | None = None
    try:
        if span is not None:
            span.activate()
        try:
            iterator = iter(behavior(request, context))
        finally:
            if span is not None:
                span.deactivate()
        while True:
            if span is not None:
                span.activate()
            try:
                message = next(iterator)
            except StopIteration:
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


class ZoomerServerInterceptor(ServerInterceptorCore, grpc.ServerInterceptor):
    """Records one SERVER span per gRPC call (see the module docstring).

    Args: see :class:`~interceptors.grpc_common.ServerInterceptorCore` (``recorder``, ``server_address``,
    ``server_port``, ``excluded_methods``, ``filter_``, ``semconv_dup``).
    """

    place = "grpc_server"
    sized_requests = True

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
                          handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        return self._handler_for(continuation(handler_call_details), handler_call_details.method)

    def _call_over(self, context: Any, exc: BaseException | None) -> bool:
        return not context.is_active()

    def _wrap_behavior(self, tracer: ServerCallTracer, behavior: Callable[..., Any], request_streaming: bool,
                       response_streaming: bool, sized: bool) -> Callable[..., Any]:
        if response_streaming:
            return _wrap_stream_response(tracer, behavior, request_streaming, sized)
        return _wrap_unary_response(tracer, behavior, request_streaming, sized)
