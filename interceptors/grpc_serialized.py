"""Ending a unary response's SERVER span once grpc has serialized the response (the sync and the aio server).

grpc serializes a unary response after the handler has returned, with the method's response serializer, and
answers an error when that fails: INTERNAL on the sync server, UNKNOWN on grpc.aio. So that the span says
what the client got, each server interceptor hands grpc a wrapper of the serializer (:func:`unary_serializer`)
and, when the handler returns, leaves the call's span for it (:func:`leave_for_serializer`) instead of ending
it. Both grpc flavours call the serializer on the thread (grpc.aio: in the event-loop step) that ran the handler,
right after it returned, so the span waits in a slot per thread.

When grpc does not call the wrapper after the handler (an interceptor around zoomer-serve's raised, or gave
grpc a serializer of its own), the next call left on the same thread finds the span still there: both end as
their handlers returned, with the time they returned, and the method's later calls end there too
(``ServerCallTracer.late_end``). At shutdown, telemetry ends any span still left (:func:`end_left_calls`).
No span is lost or ended twice.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from threading import get_ident
from typing import Any

from interceptors.grpc_common import ServerCallTracer, message_size
from zoomer_serve.recording import RequestSpan

Entry = tuple[ServerCallTracer, RequestSpan, Any, list[int], bool, Any, int]
"""A call left for the serializer: ``(tracer, span, context, counts, deferred, response, returned_mono_ns)``;
``deferred``: grpc's done-callback ends the span (sync, streamed request), the serializer only ends it when it
fails; ``returned_mono_ns``: when the handler returned, a ``time.monotonic_ns()`` reading (made the span's time only
where a span ends then)."""
Failed = Callable[[Entry, "BaseException | None"], None]
"""Ends an entry's span as grpc answers a response that its serializer rejected (the exception, or None when
the serializer returned None)."""

_LEFT: dict[int, Entry] = {}
os.register_at_fork(after_in_child=_LEFT.clear)  # the parent's calls are the parent's to end (a thread id recurs)


def handler_returned(tracer: ServerCallTracer, span: RequestSpan | None, context: Any, counts: list[int],
                     deferred: bool, response: Any, end_ns: int | None = None) -> None:
    """A unary-response handler returned ``response``: count it and end the span (``deferred``: mark it
    ended normally; grpc's callback ends it). ``end_ns``: when it returned, for a span ended later; such a span
    ends with the code the handler set, else OK (the call is over by then, which is not a cancel)."""
    if response is not None:
        counts[2], counts[3] = 1, message_size(response)
    if deferred:
        counts[4] = 1
    elif end_ns is None:
        tracer.finish(span, context, None, counts)
    else:
        tracer.finish(span, context, None, counts, call_over=False, end_ns=end_ns)


def leave_for_serializer(entry: Entry) -> None:
    """Leave the call's span for this thread's next call of a :func:`unary_serializer` wrapper. A span still
    left there by an earlier call was never serialized through it: that span, and this one, end as their
    handlers returned, and the earlier call's method no longer leaves its spans (``late_end``)."""
    ident = get_ident()
    stale = _LEFT.get(ident)
    _LEFT[ident] = entry
    if stale is not None:
        stale[0].late_end = False
        _end_as_returned(stale)
        if _LEFT.pop(ident, None) is entry:  # this call's serializer may not come either
            _end_as_returned(entry)


def _end_as_returned(entry: Entry) -> None:
    tracer, span, context, counts, deferred, response, returned_mono_ns = entry
    handler_returned(tracer, span, context, counts, deferred, response, span.time_at(returned_mono_ns))


def end_left_calls() -> None:
    """End every span still left for a serializer as its handler returned (telemetry's shutdown calls it)."""
    for ident in list(_LEFT):
        left = _LEFT.pop(ident, None)
        if left is not None:
            _end_as_returned(left)


def unary_serializer(tracer: ServerCallTracer, serializer: Callable[[Any], bytes] | None,
                     failed: Failed) -> Callable[[Any], Any]:
    """The method's response serializer (None: grpc sends the handler's bytes as they are), ending the span
    that its call left (:func:`leave_for_serializer`): OK with the serialized size in bytes, or by ``failed``
    when ``serializer`` raises (re-raised unchanged: grpc answers as it would) or returns None. A span left by
    a call of another method on this thread is not this call's and stays."""

    def serialize(response: Any) -> Any:
        ident = get_ident()
        entry = _LEFT.get(ident)
        if entry is not None and (entry[0] is not tracer or _LEFT.pop(ident, None) is not entry):
            entry = None  # another method's call, or ended by shutdown meanwhile
        try:
            data = response if serializer is None else serializer(response)
        except BaseException as exc:
            if entry is not None:
                failed(entry, exc)
            raise
        if entry is not None:
            if data.__class__ is bytes and not entry[4]:  # _serialized's common path, without its call
                counts = entry[3]
                counts[2], counts[3] = 1, len(data)
                tracer.finish(entry[1], entry[2], None, counts)
            else:
                _serialized(entry, data, failed)
        return data

    return serialize


def _serialized(entry: Entry, data: Any, failed: Failed) -> None:
    tracer, span, context, counts, deferred, response, _end_ns = entry
    if data is None:
        failed(entry, None)
    elif not deferred:
        try:
            counts[2], counts[3] = 1, len(data)
        except TypeError:  # a serializer that returns no bytes: grpc fails the call later, as without zoomer-serve
            counts[2], counts[3] = 1, message_size(response)
        tracer.finish(span, context, None, counts)
