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

from interceptors.grpc_common import (
    REQUEST_BYTES,
    REQUEST_MESSAGES,
    RESPONSE_BYTES,
    RESPONSE_MESSAGES,
    MethodNames,
    PeerParser,
    apply_status,
    baggage_context,
    message_size,
    method_filter,
    parent_from_metadata,
    static_attributes,
)
from zoomer_serve.config import ZoomerConfig
from zoomer_serve.recording import RequestRecorder, RequestSpan, internal_error

_OK = grpc.StatusCode.OK


def _is_abort(exc: BaseException) -> bool:
    """``context.abort()`` raises a bare ``Exception()`` after setting the code."""
    return type(exc) is Exception and not exc.args


class _CallTracer:
    """Starts and finishes the spans of one method's calls (shared by the four RPC-kind wrappers)."""

    def __init__(self, interceptor: ZoomerServerInterceptor, names: MethodNames) -> None:
        self.recorder = interceptor.recorder
        self.dup = interceptor.semconv_dup
        self.peers = interceptor.peers
        self.static = static_attributes(names, interceptor.server_address, interceptor.server_port, self.dup)
        self.name = names.rpc_method

    def start(self, context: grpc.ServicerContext) -> RequestSpan | None:
        try:
            parent, baggage = parent_from_metadata(context.invocation_metadata())
            attrs = dict(self.static)
            attrs.update(self.peers(context.peer()))
            span = self.recorder.start(self.name, attributes=attrs, parent=parent)
            if baggage:
                span.otel_parent_context = baggage_context(baggage)
            return span
        except Exception as exc:
            internal_error("grpc_server.start", exc)
            return None

    def finish(self, span: RequestSpan | None, context: grpc.ServicerContext, exc: BaseException | None,
               counts: list[int]) -> None:
        if span is None or not span.is_open:
            return
        try:
            code, details, error_type = _final_status(context, exc)
            if exc is not None and not _is_abort(exc) and not isinstance(exc, GeneratorExit):
                span.record_exception(exc)
            attrs = span.attributes
            attrs[REQUEST_MESSAGES], attrs[REQUEST_BYTES] = counts[0], counts[1]
            attrs[RESPONSE_MESSAGES], attrs[RESPONSE_BYTES] = counts[2], counts[3]
            apply_status(span, code, details, self.dup, error_type)
            span.end()
        except Exception as err:
            internal_error("grpc_server.finish", err)


def _final_status(context: grpc.ServicerContext, exc: BaseException | None
                  ) -> tuple[grpc.StatusCode, str | None, str | None]:
    """The status the client sees: the code the handler set (``set_code``, ``abort``), else CANCELLED /
    DEADLINE_EXCEEDED when the call is no longer active, else UNKNOWN for an exception, else OK."""
    code = context.code()
    raw = context.details()
    details = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    if code is not None and code is not _OK:
        return code, details, None
    if not context.is_active():
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            return grpc.StatusCode.DEADLINE_EXCEEDED, details, None
        return grpc.StatusCode.CANCELLED, details, None
    if exc is not None and not isinstance(exc, GeneratorExit):
        return grpc.StatusCode.UNKNOWN, f"{type(exc).__name__}: {exc}", type(exc).__qualname__
    return code or _OK, details, None


def _counting(iterator: Iterator[Any], counts: list[int]) -> Iterator[Any]:
    for message in iterator:
        counts[0] += 1
        counts[1] += message_size(message)
        yield message


def _wrap_unary_response(tracer: _CallTracer, behavior: Callable[..., Any], streaming_request: bool
                         ) -> Callable[[Any, grpc.ServicerContext], Any]:
    def call(request: Any, context: grpc.ServicerContext) -> Any:
        span = tracer.start(context)
        counts = [0, 0, 0, 0]
        if streaming_request:
            request = _counting(request, counts)
        else:
            counts[0], counts[1] = 1, message_size(request)
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


def _wrap_stream_response(tracer: _CallTracer, behavior: Callable[..., Any], streaming_request: bool
                          ) -> Callable[[Any, grpc.ServicerContext], Iterator[Any]]:
    def call(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        span = tracer.start(context)
        counts = [0, 0, 0, 0]
        if streaming_request:
            request = _counting(request, counts)
        else:
            counts[0], counts[1] = 1, message_size(request)
        if span is not None:
            try:
                context.add_callback(lambda: tracer.finish(span, context, None, counts))
            except Exception as exc:
                internal_error("grpc_server.add_callback", exc)
        return _traced_stream(tracer, span, behavior, request, context, counts)

    return call


def _traced_stream(tracer: _CallTracer, span: RequestSpan | None, behavior: Callable[..., Any], request: Any,
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


class ZoomerServerInterceptor(grpc.ServerInterceptor):
    """Records one SERVER span per gRPC call (see the module docstring).

    Args:
        recorder: the request recorder; default: the process's (configured from the environment on first use).
        server_address / server_port: recorded as ``server.address`` / ``server.port`` (the sync gRPC API does
            not tell a handler which address it was reached on).
        excluded_methods: globs over ``pkg.Service/Method`` not to trace; default from the config
            (``ZOOMER_EXCLUDED_METHODS``; health and reflection services).
        filter_: an extra predicate; methods for which it returns False are not traced.
        semconv_dup: also emit the older RPC attribute names; default from ``OTEL_SEMCONV_STABILITY_OPT_IN``.
    """

    def __init__(self, recorder: RequestRecorder | None = None, *, server_address: str | None = None,
                 server_port: int | None = None, excluded_methods: tuple[str, ...] | None = None,
                 filter_: Callable[[str], bool] | None = None, semconv_dup: bool | None = None) -> None:
        if recorder is None:
            from zoomer_serve.runtime import get_telemetry

            telemetry = get_telemetry()
            config = telemetry.config
            recorder = telemetry.recorder
        else:  # defaults from the environment, without configuring (and starting) any exporter
            config = ZoomerConfig.from_env()
        self.recorder = recorder
        self.server_address = server_address
        self.server_port = server_port
        self.semconv_dup = semconv_dup if semconv_dup is not None else config.semconv_rpc_dup
        excluded = excluded_methods if excluded_methods is not None else config.excluded_methods
        self.traced = method_filter(excluded, filter_)
        self.peers = PeerParser()
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
                          handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:  # unknown method: grpc answers UNIMPLEMENTED itself
            return None
        try:
            method = handler_call_details.method
            cached = self._wrapped.get(method)
            if cached is not None and cached[0] is handler:
                return cached[1]
            wrapped = self._wrap(handler, method)
            if len(self._wrapped) < 10_000:
                self._wrapped[method] = (handler, wrapped)
            return wrapped
        except Exception as exc:
            internal_error("grpc_server.intercept_service", exc)
            return handler

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        names = MethodNames.parse(method)
        if not self.traced(names.rpc_method):
            return handler
        tracer = _CallTracer(self, names)
        rs, ws = handler.request_streaming, handler.response_streaming
        des, ser = handler.request_deserializer, handler.response_serializer
        if not rs and not ws:
            return grpc.unary_unary_rpc_method_handler(_wrap_unary_response(tracer, handler.unary_unary, False),
                                                       des, ser)
        if rs and not ws:
            return grpc.stream_unary_rpc_method_handler(_wrap_unary_response(tracer, handler.stream_unary, True),
                                                        des, ser)
        if not rs and ws:
            return grpc.unary_stream_rpc_method_handler(_wrap_stream_response(tracer, handler.unary_stream, False),
                                                        des, ser)
        return grpc.stream_stream_rpc_method_handler(_wrap_stream_response(tracer, handler.stream_stream, True),
                                                     des, ser)
