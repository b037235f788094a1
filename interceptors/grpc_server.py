"""``grpc.ServerInterceptor`` for the sync ``grpc.server``: one SERVER span per call, all four RPC kinds.

Usage::

    server = grpc.server(pool, interceptors=[ZoomerServerInterceptor()])

The interceptor wraps each method handler once (cached per method) so that every call opens a request span
through the shared recorder, makes it current for the handler (OpenTelemetry spans that the handler starts
become its children), and ends it exactly once: once grpc has serialized a unary response, after the last
streamed message, or when the call is cancelled or its deadline passes. Anything that goes wrong inside the
interceptor is counted and logged once; the call itself proceeds unchanged (fail open). Handler exceptions
are recorded on the span and re-raised unchanged.

Calls that fail before or around the handler (C16):

- a request message that the method's deserializer rejects (or turns into None): grpc would answer INTERNAL
  ``Exception deserializing request!`` before any handler runs. The interceptor's deserializer hands such a
  message on marked (:class:`~interceptors.grpc_common.UndecodableRequest`) and the traced handler answers
  exactly that, without calling the application, so the call has its span (status INTERNAL, the
  deserializer's exception as an ``exception`` event). In a request stream the application's handler sees
  the abort raised from its request iterator (grpc alone would end the iterator as if the client had
  finished, and answer INTERNAL all the same).
- a call with a streamed request whose handler ends normally ends its span when grpc has finished the call,
  not when the handler returns: only then does grpc know whether the end of the request stream was the
  client's last message or its cancel (the span then ends CANCELLED). Such spans end on grpc's thread, so
  they carry no ``zoomer.request.cpu_time_ns``.
- a response the method's serializer rejects (raises, or returns None): grpc answers INTERNAL ``Failed to
  serialize response!`` after the handler has returned. The interceptor hands grpc a wrapper of the method's
  serializer that ends the span so (the serializer's exception as an ``exception`` event); a unary response's
  span therefore ends once the response is serialized, with its serialized size
  (:mod:`interceptors.grpc_serialized`, which also says what happens when grpc does not call that wrapper).
- a message over ``grpc.max_receive_message_length`` never reaches Python: grpc's core answers
  RESOURCE_EXHAUSTED. A unary request's call is not seen at all (the handler never runs); in a request stream
  the handler sees a cancel, and the span ends CANCELLED.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from threading import get_ident
from time import monotonic_ns
from typing import Any, NoReturn

import grpc

from interceptors.grpc_common import (
    UNDECODABLE_DETAILS,
    ServerCallTracer,
    ServerInterceptorCore,
    UndecodableRequest,
    handler_details,
    message_size,
)
from interceptors.grpc_serialized import (
    Entry,
    end_left_calls,
    handler_returned,
    leave_for_serializer,
    unary_serializer,
)
from zoomer_serve.recording import RequestSpan, internal_error

try:  # grpc's own record of whether the client cancelled a call; the public API has no such question
    from grpc._server import _CANCELLED as _GRPC_CLIENT_CANCELLED
except ImportError:  # pragma: no cover - another grpc layout: request streams end as before (is_active())
    _GRPC_CLIENT_CANCELLED = None


SERIALIZE_FAILED_DETAILS = "Failed to serialize response!"
"""What grpc's sync server answers (INTERNAL) for a response its serializer rejects (raises, or returns None)."""

_STREAMING: dict[int, tuple[ServerCallTracer, RequestSpan, grpc.ServicerContext, list[int]]] = {}
"""Per grpc thread: the call whose response stream it is iterating (and serializing, message by message)."""
os.register_at_fork(after_in_child=_STREAMING.clear)  # the parent's calls are the parent's to end


def _client_cancelled(context: grpc.ServicerContext) -> bool | None:
    """Whether grpc has seen the client cancel the call (or its deadline pass, or the server stop), read from
    grpc's call state; None when this grpc keeps no such state where grpc 1.x does (``_Context._state.client``).
    ``context.is_active()`` cannot tell: it is False too once the status is sent."""
    client = getattr(getattr(context, "_state", None), "client", None)
    if client is None or _GRPC_CLIENT_CANCELLED is None:
        return None
    return bool(client == _GRPC_CLIENT_CANCELLED)


def _refuse(span: RequestSpan | None, request: UndecodableRequest, context: grpc.ServicerContext) -> NoReturn:
    """End a call whose request message could not be deserialized as grpc's sync server does without the
    interceptor (INTERNAL, grpc's details); the deserializer's exception becomes the span's ``exception``
    event. Raises what ``context.abort`` raises."""
    if span is not None and request.error is not None:
        span.record_exception(request.error)
    context.abort(grpc.StatusCode.INTERNAL, UNDECODABLE_DETAILS)
    raise AssertionError("grpc abort() returned")  # it raises


def _counting(iterator: Iterator[Any], counts: list[int], span: RequestSpan | None,
              context: grpc.ServicerContext) -> Iterator[Any]:
    """The request stream as the handler gets it: counts messages and bytes; a message that could not be
    deserialized ends the call (:func:`_refuse`)."""
    for message in iterator:
        counts[0] += 1
        if message.__class__ is UndecodableRequest:
            _refuse(span, message, context)
        counts[1] += message_size(message)
        yield message


def _open_call(tracer: ServerCallTracer, request: Any, context: grpc.ServicerContext, streaming_request: bool,
               sized: bool) -> tuple[RequestSpan | None, Any, list[int]]:
    """Start the call's span; ``counts`` = [request messages, request bytes, response messages, response
    bytes, 1 once the handler has ended normally (set where :func:`_end_when_done` decides)], with a streamed
    request wrapped so that its messages are counted as the handler reads them; ``sized``: the unary request
    is ``(message, bytes received)``. Returns the request the handler gets."""
    span = tracer.start(context)
    if streaming_request:
        counts = [0, 0, 0, 0, 0]
        request = _counting(request, counts, span, context)
    elif sized:
        counts = [1, 0, 0, 0, 0]
        request, counts[1] = request
    else:
        counts = [1, message_size(request), 0, 0, 0]
    return span, request, counts


def _end_when_done(tracer: ServerCallTracer, span: RequestSpan | None, context: grpc.ServicerContext,
                   counts: list[int]) -> bool:
    """Have grpc end the span once it has finished the call, unless it has ended by then: a call that grpc
    ended under its handler (cancel, deadline, server stop) ends CANCELLED / DEADLINE_EXCEEDED. Returns True
    when the callback can also decide for a handler that ended normally (``counts[4]`` = 1): whether grpc
    then sent its status or the client had cancelled, which for a streamed request the handler cannot know
    (a cancel ends its request iterator as the client's last message does)."""
    if span is None:
        return False
    readable = _client_cancelled(context) is not None

    def done() -> None:
        call_over = not counts[4] or bool(_client_cancelled(context))
        tracer.finish(span, context, None, counts, call_over=call_over)

    try:
        return bool(context.add_callback(done)) and readable
    except Exception as exc:
        internal_error("grpc_server.add_callback", exc)
        return False


def _wrap_unary_response(tracer: ServerCallTracer, behavior: Callable[..., Any], streaming_request: bool,
                         sized: bool) -> Callable[[Any, grpc.ServicerContext], Any]:
    refuse = not streaming_request  # a unary request is checked here, a streamed one by _counting

    def call(request: Any, context: grpc.ServicerContext) -> Any:
        if streaming_request:
            span, request, counts = _open_call(tracer, request, context, True, sized)
        else:  # _open_call's unary request, without its call
            span = tracer.start(context)
            if sized:
                request, size = request
            else:
                size = message_size(request)
            counts = [1, size, 0, 0, 0]
        deferred = streaming_request and _end_when_done(tracer, span, context, counts)
        if span is not None:
            span.activate()
        try:
            if refuse and request.__class__ is UndecodableRequest:
                _refuse(span, request, context)
            response = behavior(request, context)
        except BaseException as exc:
            if span is not None:
                span.deactivate()
            tracer.finish(span, context, exc, counts)
            raise
        if span is not None:
            span.deactivate()
            if tracer.late_end:
                if deferred:  # counted now: grpc's callback ends the span, unless the serializer ends it first
                    handler_returned(tracer, span, context, counts, True, response)
                leave_for_serializer((tracer, span, context, counts, deferred, response, monotonic_ns()))
                return response
        handler_returned(tracer, span, context, counts, deferred, response)
        return response

    return call


def _not_serialized(entry: Entry, exc: BaseException | None) -> None:
    """A unary response that the serializer rejected."""
    tracer, span, context, counts, _deferred, response = entry[:6]
    counts[2] = counts[3] = 0  # never sent (a deferred call counted it when its handler returned)
    _abort_for_serializer(tracer, span, context, counts, exc, response is None)


def _abort_for_serializer(tracer: ServerCallTracer, span: RequestSpan, context: grpc.ServicerContext,
                          counts: list[int], exc: BaseException | None, none: bool) -> None:
    """End the span as grpc's sync server ends a call whose response its serializer rejected: with the code and
    details the handler set, if it set a code, else INTERNAL ``SERIALIZE_FAILED_DETAILS``. The serializer's
    exception is the span's ``exception`` event, except when the handler set a code other than OK and gave None
    (``none``), the usual way to answer an error without a message."""
    code = context.code()
    if code is None:
        status = (grpc.StatusCode.INTERNAL, SERIALIZE_FAILED_DETAILS, None)
    else:
        status = (code, handler_details(context) or SERIALIZE_FAILED_DETAILS, None)
        if none and code is not grpc.StatusCode.OK:
            exc = None
    tracer.finish(span, context, exc, counts, status=status)


def _serializer_of_stream(serializer: Callable[[Any], bytes] | None) -> Callable[[Any], bytes | None]:
    """A response stream's serializer: a message that ``serializer`` rejects (raises, or returns None) ends
    the stream's span INTERNAL, as grpc ends the call then (the exception as an ``exception`` event)."""

    def serialize(message: Any) -> bytes | None:
        try:
            data = message if serializer is None else serializer(message)
        except BaseException as exc:
            _stream_not_serialized(exc)
            raise
        if data is None:
            _stream_not_serialized(None)
        return data

    return serialize


def _stream_not_serialized(exc: BaseException | None) -> None:
    entry = _STREAMING.get(get_ident())
    if entry is not None:
        tracer, span, context, counts = entry
        if span.is_open:
            counts[2] -= 1  # counted when the handler gave it, never sent
        _abort_for_serializer(tracer, span, context, counts, exc, False)


def _wrap_stream_response(tracer: ServerCallTracer, behavior: Callable[..., Any], streaming_request: bool,
                          sized: bool) -> Callable[[Any, grpc.ServicerContext], Iterator[Any]]:
    refuse = not streaming_request

    def call(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        span, request, counts = _open_call(tracer, request, context, streaming_request, sized)
        deferred = _end_when_done(tracer, span, context, counts) and streaming_request
        return _traced_stream(tracer, span, behavior, request, context, counts, deferred, refuse)

    return call


def _traced_stream(tracer: ServerCallTracer, span: RequestSpan | None, behavior: Callable[..., Any], request: Any,
                   context: grpc.ServicerContext, counts: list[int], deferred: bool, refuse: bool) -> Iterator[Any]:
    """Runs the handler's response iterator with the span current around each step; ends the span after
    the last message (``deferred``: grpc's callback ends it once the status has gone or the cancel is known),
    on an exception, or when grpc stops iterating (client cancel: GeneratorExit)."""
    error: BaseException | None = None
    entry, ident = None, get_ident()  # the thread that iterates the stream and serializes its messages
    try:
        if span is not None:
            entry = _STREAMING[ident] = (tracer, span, context, counts)
            span.activate()
        try:
            if refuse and request.__class__ is UndecodableRequest:
                _refuse(span, request, context)
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
            if message is None:  # grpc's sync server ends the stream there, OK
                return
            counts[2] += 1
            counts[3] += message_size(message)
            yield message
    except BaseException as exc:
        error = exc
        raise
    finally:
        if entry is not None and _STREAMING.get(ident) is entry:
            del _STREAMING[ident]
        if deferred and error is None:
            counts[4] = 1
        else:
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
        # grpc's record of a client cancel (a passed deadline and a stopping server cancel too), read without
        # is_active()'s lock: four Python calls and a lock fewer per call. Where grpc keeps no such record,
        # is_active(); it also says False once the status is sent, which no caller of this has seen happen.
        cancelled = _client_cancelled(context)
        return not context.is_active() if cancelled is None else cancelled

    def _wrap_behavior(self, tracer: ServerCallTracer, behavior: Callable[..., Any], request_streaming: bool,
                       response_streaming: bool, sized: bool) -> Callable[..., Any]:
        if response_streaming:
            return _wrap_stream_response(tracer, behavior, request_streaming, sized)
        return _wrap_unary_response(tracer, behavior, request_streaming, sized)

    def _wrap_serializer(self, tracer: ServerCallTracer, serializer: Callable[[Any], bytes] | None,
                         response_streaming: bool) -> Callable[[Any], bytes | None]:
        self.recorder.add_before_shutdown(end_left_calls)
        if response_streaming:
            return _serializer_of_stream(serializer)
        return unary_serializer(tracer, serializer, _not_serialized)
