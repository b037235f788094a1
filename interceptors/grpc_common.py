"""What the gRPC adapters share: method names, status mapping, peer parsing, context extraction, filters,
and the server-side core (:class:`ServerCallTracer`, :class:`ServerInterceptorCore`) that the sync
(:mod:`interceptors.grpc_server`) and the asyncio (:mod:`interceptors.grpc_aio`) server interceptors both
run, so that both record exactly the same spans (and whatever request observers add to them).

Semantic conventions followed: OpenTelemetry RPC and gRPC conventions of the release named in
:mod:`zoomer_serve.semconv` (v1.44.0): span name and ``rpc.method`` = ``pkg.Service/Method``, ``rpc.system.name`` = ``grpc``,
``rpc.response.status_code`` = the status code name (``OK``, ``INVALID_ARGUMENT``), ``error.type`` = the
status code name for errors (or the exception type): on SERVER spans the codes in
:data:`SERVER_ERROR_CODES`, on CLIENT spans every code but OK (:data:`CLIENT_ERROR_CODES`); the peer as
``network.peer.address`` / ``.port`` (``network.type`` and ``network.transport`` are no longer RPC
attributes). With ``OTEL_SEMCONV_STABILITY_OPT_IN=rpc/dup`` the deprecated ``rpc.system``, ``rpc.service`` and
``rpc.grpc.status_code`` (int) are emitted too.
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc

from zoomer_serve.config import ZoomerConfig
from zoomer_serve.recording import (
    ParentContext,
    RequestRecorder,
    RequestSpan,
    internal_error,
    parse_traceparent,
    register_quiet_exception,
)
from zoomer_serve.recording import records as r
from zoomer_serve.semconv import GRPC_SERVER_ERROR_CODES

# Codes that mean the server failed (span status ERROR); others (client errors, cancellation) are not. The names
# live in zoomer_serve.semconv, where the report judges the rpc.server.call.duration points by the same set.
SERVER_ERROR_CODES = frozenset(grpc.StatusCode[name] for name in GRPC_SERVER_ERROR_CODES)
# A call that ends under its handler with at most this much time left (seconds, the server's clock) ended by its
# deadline: the server's deadline is the client's plus the request's way there (grpc sends the time left), so the
# cancel a client sends when its own deadline passes can arrive first, with that much time still left.
DEADLINE_SLACK_S = 0.1
# On the client side every code but OK means the call failed (span status ERROR).
CLIENT_ERROR_CODES = frozenset(code for code in grpc.StatusCode if code is not grpc.StatusCode.OK)
REQUEST_MESSAGES = "zoomer.rpc.request.messages"
REQUEST_BYTES = "zoomer.rpc.request.bytes"
RESPONSE_MESSAGES = "zoomer.rpc.response.messages"
RESPONSE_BYTES = "zoomer.rpc.response.bytes"
STATUS_CODE = "rpc.response.status_code"
# zoomer_serve.profiling.on_request.PROFILE_KEY and BAGGAGE_KEY (not imported on the request path)
PROFILE_KEY = "zoomer-profile"
PROFILE_BAGGAGE_KEY = "zoomer.profile"
_MAX_PEERS = 4096
_OK = grpc.StatusCode.OK
_NO_ASKS: tuple[None, None, None] = (None, None, None)
_OK_STATUS: tuple[grpc.StatusCode, None, None] = (grpc.StatusCode.OK, None, None)
_NO_CODE_OR_OK = (None, _OK)  # what ``context.code()`` says when the handler set no error code


@dataclass(frozen=True)
class MethodNames:
    """Names of one RPC method: ``rpc_method`` = ``pkg.Service/Method``; ``service``; ``method``."""

    rpc_method: str
    service: str
    method: str

    @classmethod
    def parse(cls, full_method: str) -> MethodNames:
        """From gRPC's ``/pkg.Service/Method`` path (a malformed path keeps what is there)."""
        path = full_method.lstrip("/")
        service, _, method = path.rpartition("/")
        return cls(path, service, method or path)


def static_attributes(names: MethodNames, server_address: str | None, server_port: int | None,
                      dup: bool) -> dict[str, Any]:
    """The attributes every call of one method shares."""
    attrs: dict[str, Any] = {"rpc.system.name": "grpc", "rpc.method": names.rpc_method}
    if server_address:
        attrs["server.address"] = server_address
    if server_port:
        attrs["server.port"] = server_port
    if dup:
        attrs["rpc.system"] = "grpc"
        attrs["rpc.service"] = names.service
    return attrs


class PeerParser:
    """Parses gRPC peer strings (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``, ``unix:/path``) into
    ``network.peer.address`` and ``network.peer.port`` attributes (a Unix socket has its path, or "", and no
    port); results are cached (bounded)."""

    def __init__(self) -> None:
        self._cache: dict[str, dict[str, Any]] = {}

    def __call__(self, peer: str | None) -> dict[str, Any]:
        if not peer:
            return {}
        hit = self._cache.get(peer)
        if hit is None:
            hit = _parse_peer(peer)
            if len(self._cache) < _MAX_PEERS:
                self._cache[peer] = hit
        return hit


def _parse_peer(peer: str) -> dict[str, Any]:
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        host, _, port = rest.rpartition(":")
        host = host.strip("[]")
        out: dict[str, Any] = {"network.peer.address": host}
        if port.isdigit():
            out["network.peer.port"] = int(port)
        return out
    if kind == "unix":
        return {"network.peer.address": rest}
    return {"network.peer.address": peer}


def caller_metadata(metadata: Iterable[Any]) -> tuple[ParentContext | None, str | None, Any]:
    """What the caller's gRPC invocation metadata asks, read in one pass: ``(parent, baggage, profile)``, the
    W3C ``traceparent``/``tracestate`` (None when absent or malformed), the raw ``baggage`` header (None unless
    text) and the ``zoomer-profile`` entry's value (None when absent). Never raises for bad input."""
    traceparent = tracestate = baggage = profile = None
    for item in metadata:
        key = item[0]
        if key == "traceparent":
            traceparent = item[1]
        elif key == "tracestate":
            tracestate = item[1]
        elif key == "baggage":
            baggage = item[1]
        elif key == PROFILE_KEY and profile is None:
            profile = item[1]
    if not isinstance(baggage, str):
        baggage = None
    if traceparent is None:
        return None, baggage, profile
    return parse_traceparent(traceparent, tracestate), baggage, profile


def baggage_context(baggage: str | None) -> Any:
    """An OpenTelemetry Context holding the W3C ``baggage`` header's entries (None when absent/invalid)."""
    if not baggage:
        return None
    try:
        from opentelemetry.baggage.propagation import W3CBaggagePropagator

        return W3CBaggagePropagator().extract({"baggage": baggage})
    except Exception:
        return None


def method_filter(excluded_globs: Iterable[str],
                  custom: Callable[[str], bool] | None = None) -> Callable[[str], bool]:
    """A predicate over ``pkg.Service/Method`` that is True for methods to trace: not matching any
    excluded glob (``grpc.health.v1.Health/*``), and accepted by ``custom`` when given."""
    globs = tuple(excluded_globs)
    cache: dict[str, bool] = {}

    def traced(rpc_method: str) -> bool:
        hit = cache.get(rpc_method)
        if hit is None:
            hit = not any(fnmatch.fnmatchcase(rpc_method, g) for g in globs)
            if hit and custom is not None:
                hit = bool(custom(rpc_method))
            if len(cache) < 10_000:
                cache[rpc_method] = hit
        return hit

    return traced


def apply_status(span: Any, code: grpc.StatusCode, details: str | None, dup: bool,
                 error_type: str | None = None, error_codes: frozenset[grpc.StatusCode] = SERVER_ERROR_CODES
                 ) -> None:
    """Set ``rpc.response.status_code`` (and ``error.type`` / ERROR status for the codes in ``error_codes``:
    :data:`SERVER_ERROR_CODES` for server spans, :data:`CLIENT_ERROR_CODES` for client spans)."""
    attrs = span.attributes
    attrs[STATUS_CODE] = code.name
    if dup:
        attrs["rpc.grpc.status_code"] = code.value[0]
    if code in error_codes:
        attrs["error.type"] = error_type or code.name
        span.set_status(r.STATUS_ERROR, details or code.name)
    elif code is not grpc.StatusCode.OK and error_type:
        attrs["error.type"] = error_type


class UndecodableRequest:
    """What a request deserializer wrapped by :func:`_checked` or :func:`_sized` hands on in place of a message
    that the application's deserializer rejected (``error``: the exception it raised; None when it returned
    None, which grpc's sync server also treats as a failure). The traced handler then ends the call as grpc
    would have without the wrapper, now with a span: see ``_refuse`` in each flavour (C16)."""

    __slots__ = ("error",)

    def __init__(self, error: Exception | None) -> None:
        self.error = error


# What the sync grpc.server answers (INTERNAL) and logs when a request cannot be deserialized (grpc/_server.py,
# grpc/_common.py); the sync interceptor answers and logs the same.
UNDECODABLE_DETAILS = "Exception deserializing request!"
_grpc_common_logger = logging.getLogger("grpc._common")


def _checked(deserializer: Callable[[bytes], Any], sync: bool) -> Callable[[bytes], Any]:
    """A request deserializer that hands on an :class:`UndecodableRequest` instead of raising, so that a
    request the application's deserializer rejects still reaches the traced handler, which knows the call
    (peer, trace context) and can give it a span: without the wrapper grpc answers such a call before any
    handler runs (C16). Messages it accepts pass unchanged. ``sync``: as grpc's sync server, log the exception
    (with grpc's logger and words) and treat a None result as a failure too; the asyncio server logs the
    exception when the traced handler raises it again, and hands None on."""

    def deserialize(data: bytes) -> Any:
        try:
            message = deserializer(data)
        except Exception as exc:
            if sync:
                _grpc_common_logger.exception("Exception deserializing message!")
            return UndecodableRequest(exc)
        if message is None and sync:
            return UndecodableRequest(None)
        return message

    return deserialize


def _sized(deserializer: Callable[[bytes], Any], sync: bool) -> Callable[[bytes], tuple[Any, int]]:
    """:func:`_checked` that also returns the size of the bytes it got (the message as received,
    uncompressed): ``(message, size)``. What ``ByteSize()`` of the parsed message would say, except for
    encodings longer than needed, without encoding the message again (about 4 µs for the demo's 1.6 KB
    request). The sync server's unary requests take this form (interceptors placed before this one in the
    server's list, which wrap its handler, see the pair). The same code as :func:`_checked`, not a call to it:
    one Python call fewer per request."""

    def deserialize(data: bytes) -> tuple[Any, int]:
        try:
            message = deserializer(data)
        except Exception as exc:
            if sync:
                _grpc_common_logger.exception("Exception deserializing message!")
            return UndecodableRequest(exc), len(data)
        if message is None and sync:
            return UndecodableRequest(None), len(data)
        return message, len(data)

    return deserialize


def message_size(message: Any) -> int:
    """Serialized size in bytes of a protobuf message (``ByteSize()``), or of bytes; 0 when unknown."""
    if message.__class__ is bytes:  # raw-bytes methods: no AttributeError raised and caught per message
        return len(message)
    try:
        return message.ByteSize()
    except AttributeError:
        return len(message) if isinstance(message, (bytes, bytearray)) else 0


def recorder_and_config(recorder: RequestRecorder | None) -> tuple[RequestRecorder, ZoomerConfig]:
    """The recorder an adapter uses (the process's when None: configured from the environment on first use)
    and the config its defaults come from (the environment's when a recorder is given, without configuring,
    and so starting, any exporter)."""
    if recorder is None:
        from zoomer_serve.runtime import get_telemetry

        telemetry = get_telemetry()
        return telemetry.recorder, telemetry.config
    return recorder, ZoomerConfig.from_env()


def is_quiet_exception(exc: BaseException) -> bool:
    """Exceptions that are how a call ends, not handler failures (no ``exception`` event): ``abort()``
    (the sync API raises a bare ``Exception()``, grpc.aio an ``AbortError``), generator close, task
    cancellation."""
    return (isinstance(exc, (GeneratorExit, asyncio.CancelledError, grpc.aio.AbortError))
            or (type(exc) is Exception and not exc.args))


register_quiet_exception(is_quiet_exception)  # nor do they fail the handler's phases


def final_status(context: Any, exc: BaseException | None, call_over: bool
                 ) -> tuple[grpc.StatusCode, str | None, str | None]:
    """The status the client sees, as ``(code, details, error_type)``: the code the handler set
    (``set_code``, ``abort``), else CANCELLED / DEADLINE_EXCEEDED when the call ended under the handler
    (``call_over``; DEADLINE_EXCEEDED when at most ``DEADLINE_SLACK_S`` remains), else UNKNOWN for an
    exception (``error_type`` = its type), else OK. ``context`` is a sync or an aio ``ServicerContext``."""
    code = context.code()
    if code is not None and code is not grpc.StatusCode.OK:
        return code, handler_details(context), None
    if call_over:
        remaining = context.time_remaining()
        if remaining is not None and remaining <= DEADLINE_SLACK_S:
            return grpc.StatusCode.DEADLINE_EXCEEDED, handler_details(context), None
        return grpc.StatusCode.CANCELLED, handler_details(context), None
    if exc is not None and not isinstance(exc, GeneratorExit):
        return grpc.StatusCode.UNKNOWN, f"{type(exc).__name__}: {exc}", type(exc).__qualname__
    return grpc.StatusCode.OK, None, None  # the common path reads no details (one lock fewer per call)


def handler_details(context: Any) -> str | None:
    """The details the handler set on ``context`` (``set_details``, ``abort``), as text; None when none."""
    raw = context.details()
    return (raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw) or None


CallOver = Callable[[Any, "BaseException | None"], bool]


class ServerCallTracer:
    """Starts and finishes the SERVER spans of one method's calls; the one piece of per-call span logic
    that the sync and the aio interceptors share (they differ only in how a handler is driven).

    ``call_over(context, exc)`` tells whether the call ended under the handler (client cancel, deadline):
    the sync API asks ``context.is_active()``, grpc.aio sees ``asyncio.CancelledError``.
    """

    __slots__ = ("recorder", "dup", "peers", "static", "name", "call_over", "place", "late_end", "_by_peer")

    def __init__(self, core: ServerInterceptorCore, names: MethodNames, call_over: CallOver) -> None:
        self.recorder = core.recorder
        self.dup = core.semconv_dup
        self.peers = core.peers
        self.static = static_attributes(names, core.server_address, core.server_port, self.dup)
        self.name = names.rpc_method
        self.call_over = call_over
        self.place = core.place
        # A unary response's span ends once grpc has serialized it (the flavour's serializer wrapper), until a
        # call shows that grpc does not call that wrapper after this method's handler (an interceptor around
        # this one that drops it or raises): then at the handler's return, as for every call before.
        self.late_end = True
        self._by_peer: dict[str | None, dict[str, Any]] = {}  # static + peer attributes, per peer string

    def start(self, context: Any) -> RequestSpan | None:
        """Open the span of a call that just arrived (caller's W3C context and baggage, peer); None if that
        failed (counted; the call goes on untraced)."""
        try:
            metadata = context.invocation_metadata()
            parent, baggage, profile = caller_metadata(metadata) if metadata else _NO_ASKS
            peer = context.peer()
            base = self._by_peer.get(peer)
            if base is None:
                base = self._base_attributes(peer)
            span = self.recorder.start(self.name, r.KIND_SERVER, base.copy(), parent)
            if baggage:
                span.otel_parent_context = baggage_context(baggage)
                if PROFILE_BAGGAGE_KEY in baggage:
                    from zoomer_serve.profiling.on_request import asked_in_baggage

                    asked_in_baggage(span)
            if profile is not None:
                from zoomer_serve.profiling.on_request import asked

                asked(span, profile)
            return span
        except Exception as exc:
            internal_error(self.place + ".start", exc)
            return None

    def _base_attributes(self, peer: str | None) -> dict[str, Any]:
        """The method's static attributes with the peer's (cached for up to ``_MAX_PEERS`` peers)."""
        base = dict(self.static)
        base.update(self.peers(peer))
        if len(self._by_peer) < _MAX_PEERS:
            self._by_peer[peer] = base
        return base

    def finish(self, span: RequestSpan | None, context: Any, exc: BaseException | None, counts: list[int],
               call_over: bool | None = None,
               status: tuple[grpc.StatusCode, str | None, str | None] | None = None,
               end_ns: int | None = None) -> None:
        """End ``span`` (once; later calls do nothing) with the call's final status, the exception (unless
        quiet, see :func:`is_quiet_exception`) and ``counts`` = [request messages, request bytes, response
        messages, response bytes]. ``call_over`` overrides the flavour's own test; ``status`` =
        ``(code, details, error_type)`` is used instead of reading it from the context (an aio ``abort()``
        that is about to send it, a response that grpc could not serialize); ``end_ns``: the end time (the
        span's clock, ns; default now)."""
        if span is None or not span._open:  # span.is_open without the property's call
            return
        try:
            if status is None:
                over = self.call_over(context, exc) if call_over is None else call_over
                if exc is None and not over and context.code() in _NO_CODE_OR_OK:
                    status = _OK_STATUS  # final_status's common path, without its call
                else:
                    status = final_status(context, exc, over)
            code, details, error_type = status
            if exc is not None and not is_quiet_exception(exc):
                span.record_exception(exc)
            attrs = span.attributes
            attrs[REQUEST_MESSAGES], attrs[REQUEST_BYTES] = counts[0], counts[1]
            attrs[RESPONSE_MESSAGES], attrs[RESPONSE_BYTES] = counts[2], counts[3]
            if code is _OK and not self.dup:
                attrs[STATUS_CODE] = "OK"  # the common path: what apply_status sets for OK
            else:
                apply_status(span, code, details, self.dup, error_type)
            span.end(end_ns)
        except Exception as err:
            internal_error(self.place + ".finish", err)


_HANDLER_FACTORIES = {
    (False, False): (grpc.unary_unary_rpc_method_handler, "unary_unary"),
    (True, False): (grpc.stream_unary_rpc_method_handler, "stream_unary"),
    (False, True): (grpc.unary_stream_rpc_method_handler, "unary_stream"),
    (True, True): (grpc.stream_stream_rpc_method_handler, "stream_stream"),
}
_MAX_CACHED_METHODS = 10_000


class ServerInterceptorCore:
    """Settings, the per-method cache of wrapped handlers and the RPC-kind dispatch of a server interceptor.

    A flavour (sync, aio) subclasses it together with grpc's interceptor base and implements
    :meth:`_wrap_behavior` (wrap one handler function) and :meth:`_call_over`. Each method's handler is
    wrapped once and reused while grpc hands over the same handler object, so a call costs a dict lookup.

    Args:
        recorder: the request recorder; default: the process's (configured from the environment on first use).
        server_address / server_port: recorded as ``server.address`` / ``server.port`` (grpc does not tell a
            handler which address it was reached on).
        excluded_methods: globs over ``pkg.Service/Method`` not to trace; default from the config
            (``ZOOMER_EXCLUDED_METHODS``; health and reflection services).
        filter_: an extra predicate; methods for which it returns False are not traced.
        semconv_dup: also emit the older RPC attribute names; default from ``OTEL_SEMCONV_STABILITY_OPT_IN``.
    """

    place = "grpc_server"  # where internal errors are counted
    sized_requests = False  # unary requests reach the behavior as (message, bytes received): see _sized
    sync_grpc = True  # the flavour serves grpc.server (else grpc.aio.server): how _checked handles failures

    def __init__(self, recorder: RequestRecorder | None = None, *, server_address: str | None = None,
                 server_port: int | None = None, excluded_methods: tuple[str, ...] | None = None,
                 filter_: Callable[[str], bool] | None = None, semconv_dup: bool | None = None) -> None:
        recorder, config = recorder_and_config(recorder)
        self.recorder = recorder
        self.server_address = server_address
        self.server_port = server_port
        self.semconv_dup = semconv_dup if semconv_dup is not None else config.semconv_rpc_dup
        excluded = excluded_methods if excluded_methods is not None else config.excluded_methods
        self.traced = method_filter(excluded, filter_)
        self.peers = PeerParser()
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def _call_over(self, context: Any, exc: BaseException | None) -> bool:
        raise NotImplementedError

    def _wrap_behavior(self, tracer: ServerCallTracer, behavior: Callable[..., Any], request_streaming: bool,
                       response_streaming: bool, sized: bool) -> Callable[..., Any] | None:
        """The traced version of one handler function, or None to leave the method untraced. Request messages
        may be :class:`UndecodableRequest` (the deserializer is wrapped by :func:`_checked`); ``sized``: the
        unary request arrives as ``(message, bytes received)`` (wrapped by :func:`_sized`)."""
        raise NotImplementedError

    def _wrap_serializer(self, tracer: ServerCallTracer, serializer: Callable[[Any], bytes] | None,
                         response_streaming: bool) -> Callable[[Any], bytes | None] | None:
        """The response serializer grpc gets with the traced handler (each flavour ends or marks the span of
        a response that fails to serialize there); the base class hands it on unchanged."""
        return serializer

    def _handler_for(self, handler: grpc.RpcMethodHandler | None, method: str) -> grpc.RpcMethodHandler | None:
        """The traced handler for ``handler`` (cached per method); None stays None (unknown method: grpc
        answers UNIMPLEMENTED itself, C02); on any internal error, the handler unchanged."""
        if handler is None:
            return None
        try:
            cached = self._wrapped.get(method)
            if cached is not None and cached[0] is handler:
                return cached[1]
            wrapped = self._wrap(handler, method)
            if len(self._wrapped) < _MAX_CACHED_METHODS:
                self._wrapped[method] = (handler, wrapped)
            return wrapped
        except Exception as exc:
            internal_error(self.place + ".intercept_service", exc)
            return handler

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        names = MethodNames.parse(method)
        if not self.traced(names.rpc_method):
            return handler
        kind = (bool(handler.request_streaming), bool(handler.response_streaming))
        factory, field = _HANDLER_FACTORIES[kind]
        tracer = ServerCallTracer(self, names, self._call_over)
        deserializer = handler.request_deserializer
        sized = self.sized_requests and not kind[0] and deserializer is not None
        behavior = self._wrap_behavior(tracer, getattr(handler, field), *kind, sized)
        if behavior is None:
            return handler
        if deserializer is not None:
            deserializer = (_sized if sized else _checked)(deserializer, self.sync_grpc)
        return factory(behavior, deserializer, self._wrap_serializer(tracer, handler.response_serializer, kind[1]))
