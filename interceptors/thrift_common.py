"""What the Thrift adapters share: names, status mapping, the per-connection state, the metered transport, the
``contrib.tracking`` request header, and protocol-error counting. The sync (:mod:`interceptors.thrift_server`)
and asyncio (:mod:`interceptors.thrift_aio`) processors both run :class:`ThriftTracer`, so both record the
same spans, and those have the shape of the gRPC ones (:mod:`interceptors.grpc_common`).

Span shape (semantic conventions for RPC, v1.40.0 stable names, as for gRPC):

- span name and ``rpc.method`` = ``Service/method`` (``Service`` is the IDL service name, or the name a
  ``TMultiplexedProcessor`` registered it under, or ``service_name=``); kind SERVER.
- ``rpc.system.name`` = ``thrift`` (:data:`RPC_SYSTEM`: semconv lists no value for Thrift; this is our
  documented custom value).
- ``rpc.response.status_code``: ``OK`` for a reply; for a declared (IDL ``throws``) exception, the
  exception's type name (``InvalidRequest``) and ``zoomer.rpc.business_error`` = that name (span status stays
  UNSET: the reply is a normal one, and so do the phases the exception left, :func:`is_idl_exception`); for a ``TApplicationException`` sent as an EXCEPTION message, its type
  name (``INTERNAL_ERROR``, ``UNKNOWN_METHOD``, ...), also set as ``error.type``, span status ERROR.
- an exception the processor does not answer (undeclared, a ``TTransportException`` from the handler's own
  downstream calls, an error in a oneway method, a reply that could not be written) has no status code:
  ``error.type`` = its type, span status ERROR, an ``exception`` event; it is then re-raised unchanged to
  thriftpy2's server loop (which closes the connection).
- ``zoomer.rpc.thrift.seqid`` (int), ``zoomer.rpc.thrift.oneway`` (bool), ``server.address``/``server.port``,
  ``network.peer.*``; ``zoomer.rpc.request.messages``/``zoomer.rpc.response.messages`` (1 and 1, or 0 replies
  for oneway calls) and, when the connection is metered (:class:`MeteredTransportFactory`, which the
  ``make_server`` helpers use), ``zoomer.rpc.request.bytes``/``zoomer.rpc.response.bytes``: bytes of the call
  as read from / written to the socket (the encoded message, plus the 4-byte frame length when framed and the
  tracking headers when sent). The export worker derives ``rpc.server.call.duration`` and the size
  histograms from them, as for gRPC. thriftpy2's transports read ahead; when a client sends its next call
  before the reply to the previous one (always after a oneway call, which has no reply), the bytes read
  ahead are handed back to the meter once the current message is decoded (:meth:`Meter.message_read`) and
  count with the call they belong to. Framed connections are never read past the frame being read, so a
  message is all the frames up to the one it ends in (two messages in one frame would count as the first).
- time: from the first byte of the message (metered connections; otherwise from when the message was
  decoded) to the reply written, or to the handler's return for oneway calls. The first bytes of a call that
  arrived with the previous one arrived no later than that one was decoded: its span starts then.

Unknown methods (and, on a multiplexed processor, methods of unknown services) are answered with a
``TApplicationException`` UNKNOWN_METHOD, the connection goes on, and get a span ``_OTHER`` with ``rpc.method``
= ``_OTHER`` and ``rpc.method_original`` = the name as it arrived (``Service:method`` when multiplexed).
Bytes that are not a Thrift message get no span: :func:`protocol_error_counts` (and the exported counter
``zoomer.rpc.server.protocol_errors``) count them by kind, the first of each kind is logged, and only that
connection is closed. A client that disconnects between calls is no error.
"""

from __future__ import annotations

import asyncio
import contextvars
import io
import logging
import socket
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from thriftpy2.contrib.aio.transport.buffered import TAsyncBufferedTransport
from thriftpy2.contrib.tracking import track_method, track_thrift
from thriftpy2.protocol.exc import TProtocolException
from thriftpy2.thrift import TApplicationException, TException
from thriftpy2.transport import TTransportException
from thriftpy2.transport.buffered import TBufferedTransport

from interceptors.grpc_common import (
    PROFILE_BAGGAGE_KEY,
    PROFILE_KEY,
    REQUEST_BYTES,
    REQUEST_MESSAGES,
    RESPONSE_BYTES,
    RESPONSE_MESSAGES,
    baggage_context,
    method_filter,
)
from zoomer_serve.config import ZoomerConfig
from zoomer_serve.recording import (
    RequestRecorder,
    RequestSpan,
    internal_error,
    parse_traceparent,
    register_quiet_exception,
)
from zoomer_serve.recording import records as r

logger = logging.getLogger("zoomer_serve")

RPC_SYSTEM = "thrift"
SEQID = "zoomer.rpc.thrift.seqid"
ONEWAY = "zoomer.rpc.thrift.oneway"
BUSINESS_ERROR = "zoomer.rpc.business_error"
OTHER_METHOD = "_OTHER"
PROTOCOL_ERRORS_METRIC = "zoomer.rpc.server.protocol_errors"
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
DEFAULT_READ_CHUNK_BYTES = 64 * 1024
_MAX_ORIGINAL_METHOD_CHARS = 256
_APP_EXC_NAMES = {value: name for name, value in vars(TApplicationException).items()
                  if name.isupper() and isinstance(value, int)}

try:
    from thriftpy2.transport.buffered.cybuffered import TCyBufferedTransport as _CyBuffered
except ImportError:  # thriftpy2 without its Cython extensions
    _CyBuffered = None

_mono_ns = time.monotonic_ns  # when a message began: the span's start, on the monotonic clock
_conn_var: contextvars.ContextVar[Connection | None] = contextvars.ContextVar("zoomer_thrift_conn", default=None)
_meter_var: contextvars.ContextVar[Meter | None] = contextvars.ContextVar("zoomer_thrift_meter", default=None)
_upgrade_args_var: contextvars.ContextVar[Any] = contextvars.ContextVar("zoomer_thrift_upgrade", default=None)


# -- limits -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ThriftLimits:
    """Bounds on what one connection may make the server read.

    Attributes:
        max_message_bytes: largest message accepted, in bytes, however it arrives: unframed, in one frame or
            spread over several frames, first on its connection or not. A frame header announcing more
            (framed transports) closes the connection as a protocol error before anything that large is
            allocated; so does reading more than ``max_message_bytes + read_chunk_bytes`` bytes for one
            message (thriftpy2's transports read ahead by up to one chunk, which may belong to the next
            message, so that much is allowed for: a message is refused by the time that much is read).
        read_chunk_bytes: most bytes asked of the socket in one read, whatever the transport asks for (a
            declared length of gigabytes then costs only the bytes that really arrive).

    Raises:
        ValueError: a limit below 1 (the message names it).
    """

    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    read_chunk_bytes: int = DEFAULT_READ_CHUNK_BYTES

    def __post_init__(self) -> None:
        for name in ("max_message_bytes", "read_chunk_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ThriftLimits.{name} must be an int >= 1, got {value!r}")


# -- protocol errors ----------------------------------------------------------------------------------------
_protocol_errors: Counter[str] = Counter()
_protocol_lock = threading.Lock()
_metered_providers: weakref.WeakSet[Any] = weakref.WeakSet()


class ProtocolErrorClosed(TTransportException):
    """Raised to thriftpy2's server loop in place of a decoding error (the cause is chained): the connection
    is closed; the error was counted (:func:`protocol_error_counts`)."""


class MessageTooLarge(TTransportException):
    """A frame header or an unframed message exceeds ``ThriftLimits.max_message_bytes``."""


class InvalidFrame(TTransportException):
    """A frame header announces a size below 1 byte."""


def protocol_error_counts() -> dict[str, int]:
    """Connections closed because their bytes were not a Thrift message, by kind (``truncated``,
    ``message_too_large``, ``invalid_frame``, ``timed_out``, or the decoder's exception type such as
    ``ProtocolError`` / ``TProtocolException`` / ``TDecodeException``), in this process since start."""
    with _protocol_lock:
        return dict(_protocol_errors)


def count_protocol_error(kind: str, exc: BaseException) -> None:
    """Count one protocol error of ``kind``; log the first of each kind (WARNING), the others at DEBUG."""
    with _protocol_lock:
        _protocol_errors[kind] += 1
        first = _protocol_errors[kind] == 1
    if first:
        logger.warning("zoomer-serve: closed a Thrift connection after a protocol error (%s): %r "
                       "(first of this kind; all are counted in %s)", kind, exc, PROTOCOL_ERRORS_METRIC)
    else:
        logger.debug("zoomer-serve: Thrift protocol error (%s): %r", kind, exc)


def register_protocol_error_metric(meter_provider: Any) -> None:
    """Export :func:`protocol_error_counts` as the observable counter ``zoomer.rpc.server.protocol_errors``
    (unit ``{error}``, attributes ``rpc.system.name`` and ``error.type`` = the kind) on ``meter_provider``
    (once per provider)."""
    if meter_provider is None or meter_provider in _metered_providers:
        return
    from opentelemetry.metrics import Observation

    def observe(options: Any) -> list[Any]:
        return [Observation(n, {"rpc.system.name": RPC_SYSTEM, "error.type": kind})
                for kind, n in protocol_error_counts().items()]

    meter_provider.get_meter("zoomer_serve.thrift").create_observable_counter(
        PROTOCOL_ERRORS_METRIC, callbacks=[observe], unit="{error}",
        description="Thrift connections closed because their bytes were not a valid message")
    _metered_providers.add(meter_provider)


def is_idl_exception(exc: BaseException) -> bool:
    """An exception of the IDL (``exception Foo {...}``), which a handler raises to answer a declared ``throws``: a
    normal reply, so the phases it leaves keep status UNSET as the request does (as gRPC's ``abort()``). Not the
    Thrift framework's own (TApplicationException, transport and protocol errors). An IDL exception that the
    method does not declare still makes its request ERROR; its phases then stay UNSET too."""
    return isinstance(exc, TException) and not isinstance(
        exc, (TApplicationException, TTransportException, TProtocolException))


register_quiet_exception(is_idl_exception)


def classify_failure(exc: BaseException, in_message: bool | None) -> str | None:
    """The protocol-error kind of an exception raised while a message was read, or None when it is no
    error: a client that went away (end of file, reset, idle timeout) before sending a byte of a new message
    (``in_message`` False, or None when the connection is not metered), or the server stopping."""
    if isinstance(exc, (MessageTooLarge, MemoryError)):  # MemoryError: thriftpy2 refused a declared length
        return "message_too_large"
    if isinstance(exc, InvalidFrame):
        return "invalid_frame"
    if isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt, SystemExit, GeneratorExit)):
        return None
    if isinstance(exc, TTransportException):
        if not in_message:
            return None
        return "timed_out" if exc.type == TTransportException.TIMED_OUT else "truncated"
    if isinstance(exc, OSError):
        return ("timed_out" if isinstance(exc, TimeoutError) else "truncated") if in_message else None
    return type(exc).__name__


# -- contrib.tracking ----------------------------------------------------------------------------------------
TRACK_METHOD = track_method
RequestHeader = track_thrift.RequestHeader
ResponseHeader = track_thrift.ResponseHeader
TRACKING_VERSION = 2  # thriftpy2's VersionMixin.CURRENT: request headers (1) and response headers (2)
_EMPTY_RESPONSE_HEADER = ResponseHeader()


class UpgradeArgs(track_thrift.UpgradeArgs):  # type: ignore[misc,valid-type,name-defined]
    """The arguments of the tracking handshake; the processor that decodes one finds it afterwards in a
    context variable (thriftpy2's ``process_in`` keeps its arguments to itself)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _upgrade_args_var.set(self)


class UpgradeResult(track_thrift.UpgradeReply):  # type: ignore[misc,valid-type,name-defined]
    """The handshake's reply: ``UpgradeReply`` as a two-way call's result."""

    oneway = False


def with_tracking(service: Any) -> Any:
    """``service`` plus the ``contrib.tracking`` handshake method, so that thriftpy2's own ``process_in``
    decodes the handshake of a ``TTrackedClient`` (or :func:`interceptors.thrift_client.make_client`)
    instead of answering UNKNOWN_METHOD."""
    if TRACK_METHOD in service.thrift_services:
        return service
    attrs = {TRACK_METHOD + "_args": UpgradeArgs, TRACK_METHOD + "_result": UpgradeResult,
             "thrift_services": [*service.thrift_services, TRACK_METHOD],
             "__module__": service.__module__, "__qualname__": service.__qualname__}
    return type(service.__name__, (service,), attrs)


def _noop() -> None:
    return None


async def _anoop() -> None:
    return None


# -- the per-connection state ----------------------------------------------------------------------------------
READING, DISPATCHED = 0, 1
OUT_OK, OUT_UNKNOWN_METHOD = 0, 1


class Connection:
    """What the processor keeps about one connection (found through a context variable: each connection is
    served by its own thread, or its own asyncio task, one call after the other)."""

    __slots__ = ("iprot", "oprot", "meter", "linked", "peer", "tracking", "phase", "span", "call", "exc",
                 "outcome", "api", "seqid", "oneway", "invoke", "ainvoke", "base_attrs", "wire_name")

    def __init__(self, iprot: Any, oprot: Any = None) -> None:
        self.iprot = iprot
        self.oprot = oprot
        self.meter: Meter | None = None
        self.linked = False
        self.base_attrs: dict[Any, dict[str, Any]] = {}  # per method: its static attributes + the peer's
        self.peer: dict[str, Any] | None = None
        self.tracking = 0  # negotiated contrib.tracking version, 0 = none
        self.phase = READING
        self.span: RequestSpan | None = None
        self.call: Callable[[], Any] = _noop
        self.exc: BaseException | None = None
        self.outcome = OUT_OK
        self.api = ""
        self.seqid = 0
        self.oneway = False
        self.invoke = self._invoke
        self.ainvoke = self._ainvoke
        self.wire_name: str | None = None  # an unknown method's name as it arrived, when the processor kept it

    @classmethod
    def current(cls, iprot: Any, oprot: Any) -> Connection:
        """The state of the connection whose protocols are ``iprot``/``oprot`` (new for a new connection),
        ready to read a message."""
        conn = _conn_var.get()
        if conn is None or conn.iprot is not iprot:
            conn = cls(iprot, oprot)
            _conn_var.set(conn)
        conn.phase = READING
        conn.span = None
        return conn

    def _invoke(self) -> Any:
        """Run the handler with the request span current (phases and OpenTelemetry spans inside attach to it);
        the exception it raises is noted and re-raised unchanged for thriftpy2 to handle."""
        span = self.span
        if span is not None:
            span.activate()
        try:
            return self.call()
        except BaseException as exc:
            self.exc = exc
            raise
        finally:
            if span is not None:
                span.deactivate()

    async def _ainvoke(self) -> Any:
        span = self.span
        if span is not None:
            span.activate()
        try:
            return await self.call()
        except BaseException as exc:
            self.exc = exc
            raise
        finally:
            if span is not None:
                span.deactivate()

    def in_message(self) -> bool | None:
        return None if self.meter is None else not self.meter.idle

    def end_message(self) -> None:
        if self.meter is not None:
            self.meter.end_message()


def _link_meter(conn: Connection) -> None:
    """Attach the meter that the connection's first read published on this thread or task, unless it
    belongs to another connection already."""
    meter = _meter_var.get()
    if meter is not None and meter.conn is None:
        meter.conn = conn
        conn.meter = meter


def current_connection() -> Connection | None:
    """The connection state of the processor call running on this thread or task, or None."""
    return _conn_var.get()


# -- the tracer --------------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class _Method:
    rpc_method: str
    static: dict[str, Any] | None  # None: not traced (excluded)
    oneway: bool


class ThriftTracer:
    """Settings, the method names of the served services, and the per-call span logic shared by the sync and
    the asyncio processors (they differ only in how the handler is awaited).

    Args:
        recorder: the request recorder; default: the process's (configured from the environment on first
            use), whose meter provider then also exports the protocol-error counter.
        server_address / server_port: recorded as ``server.address`` / ``server.port``.
        excluded_methods: globs over ``Service/method`` not to trace; default from ``ZOOMER_EXCLUDED_METHODS``.
        filter_: an extra predicate over ``Service/method``; False = not traced.
        semconv_dup: also emit ``rpc.system`` and ``rpc.service``; default from ``OTEL_SEMCONV_STABILITY_OPT_IN``.
    """

    place = "thrift_server"

    def __init__(self, recorder: RequestRecorder | None = None, *, server_address: str | None = None,
                 server_port: int | None = None, excluded_methods: tuple[str, ...] | None = None,
                 filter_: Callable[[str], bool] | None = None, semconv_dup: bool | None = None) -> None:
        if recorder is None:
            from zoomer_serve.runtime import get_telemetry

            telemetry = get_telemetry()
            config = telemetry.config
            recorder = telemetry.recorder
            try:
                register_protocol_error_metric(telemetry.meter_provider)
            except Exception as exc:
                internal_error(self.place + ".metric", exc)
        else:
            config = ZoomerConfig.from_env()
        self.recorder = recorder
        self.server_address = server_address
        self.server_port = server_port
        self.semconv_dup = semconv_dup if semconv_dup is not None else config.semconv_rpc_dup
        excluded = excluded_methods if excluded_methods is not None else config.excluded_methods
        self.traced = method_filter(excluded, filter_)
        self._methods: dict[type, Any] = {}
        self._services: list[tuple[Any, str]] = []

    # names
    def add_service(self, service: Any, service_name: str | None = None) -> None:
        """Name the methods of ``service`` (a thriftpy2 service class) ``<service_name>/<method>``
        (default: the IDL service name). A service class added twice keeps its first name."""
        name = service_name or service.__name__
        self._services.append((service, name))
        self._build_methods(service, name)

    def _build_methods(self, service: Any, name: str) -> None:
        for api in service.thrift_services:
            if api == TRACK_METHOD:
                continue
            result_cls = getattr(service, api + "_result", None)
            if result_cls is None or result_cls in self._methods:
                continue
            rpc_method = f"{name}/{api}"
            oneway = bool(getattr(result_cls, "oneway", False))
            static = self._static(rpc_method, name, oneway) if self.traced(rpc_method) else None
            self._methods[result_cls] = _Method(rpc_method, static, oneway)

    def set_server_address(self, address: str | None, port: int | None) -> None:
        """Change ``server.address`` / ``server.port`` (e.g. once a port-0 server is bound)."""
        self.server_address, self.server_port = address, port
        self._methods.clear()
        for service, name in self._services:
            self._build_methods(service, name)

    def _static(self, rpc_method: str, service: str, oneway: bool) -> dict[str, Any]:
        attrs: dict[str, Any] = {"rpc.system.name": RPC_SYSTEM, "rpc.method": rpc_method, ONEWAY: oneway}
        if self.server_address:
            attrs["server.address"] = self.server_address
        if self.server_port:
            attrs["server.port"] = self.server_port
        if self.semconv_dup:
            attrs["rpc.system"] = RPC_SYSTEM
            attrs["rpc.service"] = service
        return attrs

    # per call
    def read_header(self, conn: Connection) -> Any:
        """A fresh ``RequestHeader`` to decode when the connection negotiated tracking, else None."""
        return RequestHeader() if conn.tracking else None

    def dispatch(self, conn: Connection, api: str, seqid: int, result: Any, call: Any, header: Any,
                 invoke: Any, noop: Any) -> tuple[str, int, Any, Any]:
        """Called with what thriftpy2's ``process_in`` returned: open the call's span and hand back the
        call to run (``invoke``, which runs the original ``call`` with the span current), or the handshake's
        ``noop``. Never raises; on an internal error the call goes on untraced."""
        conn.phase = DISPATCHED
        conn.api = api
        conn.seqid = seqid
        conn.exc = None
        conn.outcome = OUT_OK
        try:
            if not conn.linked:  # the connection's first message: its meter (if any) has read by now
                conn.linked = True
                _link_meter(conn)
            if conn.meter is not None:
                conn.meter.message_read()
            method = self._methods.get(type(result))
            if method is None:
                conn.oneway = False
                if type(result) is UpgradeResult:
                    return api, seqid, self._handshake(conn, result), noop
                if isinstance(result, TApplicationException):
                    conn.outcome = OUT_UNKNOWN_METHOD
                    wire_name, conn.wire_name = conn.wire_name or api, None
                    conn.span = self._start(conn, None, self._other_static(wire_name), seqid, header)
                    if conn.tracking >= 2:
                        conn.oprot.write_struct(_EMPTY_RESPONSE_HEADER)
                return api, seqid, result, call
            oneway = conn.oneway = method.oneway
            conn.call = call
            if conn.tracking >= 2 and not oneway:
                # thriftpy2's tracking client reads a ResponseHeader before every reply: buffer it now, the
                # reply that thriftpy2 writes next is flushed with it
                conn.oprot.write_struct(_EMPTY_RESPONSE_HEADER)
            if method.static is not None:  # else not traced, still run through ``invoke`` to see the outcome
                conn.span = self._start(conn, method, method.static, seqid, header)
            return api, seqid, result, invoke
        except Exception as exc:
            internal_error(self.place + ".dispatch", exc)
            conn.span = None
            return api, seqid, result, call

    def _other_static(self, api: str) -> dict[str, Any]:
        attrs = self._static(OTHER_METHOD, "", False)
        attrs.pop("rpc.service", None)
        attrs["rpc.method_original"] = str(api)[:_MAX_ORIGINAL_METHOD_CHARS]
        return attrs

    def _handshake(self, conn: Connection, result: Any) -> Any:
        args = _upgrade_args_var.get()
        version = getattr(args, "version", None)
        conn.tracking = 1
        if version:
            conn.tracking = max(1, min(int(version), TRACKING_VERSION))
            result.version = TRACKING_VERSION
        return result

    def _start(self, conn: Connection, method: _Method | None, static: dict[str, Any], seqid: int,
               header: Any) -> RequestSpan:
        base = conn.base_attrs.get(method) if method is not None else None
        if base is None:
            peer = conn.peer
            if peer is None:
                peer = conn.peer = conn.meter.peer if conn.meter is not None else peer_of(conn.iprot)
            base = {**static, **peer}
            if method is not None and len(conn.base_attrs) < 1000:
                conn.base_attrs[method] = base
        attrs = base.copy()
        attrs[SEQID] = seqid
        name = method.rpc_method if method is not None else OTHER_METHOD
        parent = baggage = None
        if header is not None:
            meta = header.meta
            if meta:
                tp = meta.get("traceparent")
                if tp is not None:
                    parent = parse_traceparent(tp, meta.get("tracestate"))
                baggage = meta.get("baggage")
        meter = conn.meter
        start = meter.msg_start_mono_ns if meter is not None and meter.msg_start_mono_ns else None
        span = self.recorder.start(name, attributes=attrs, parent=parent, start_mono_ns=start)
        if baggage and isinstance(baggage, str):
            span.otel_parent_context = baggage_context(baggage)
            if PROFILE_BAGGAGE_KEY in baggage:
                from zoomer_serve.profiling.on_request import asked_in_baggage

                asked_in_baggage(span)
        if header is not None and header.meta and PROFILE_KEY in header.meta:
            from zoomer_serve.profiling.on_request import asked

            asked(span, header.meta[PROFILE_KEY])
        return span

    def completed(self, conn: Connection) -> None:
        """``process`` returned: end the span (reply written, or oneway handler done)."""
        span = conn.span
        meter = conn.meter
        if span is not None:
            try:
                if conn.exc is None and conn.outcome == OUT_OK:  # the common case, inline
                    attrs = span.attributes
                    attrs[REQUEST_MESSAGES] = 1
                    attrs[RESPONSE_MESSAGES] = 0 if conn.oneway else 1
                    if meter is not None:
                        attrs[REQUEST_BYTES] = meter.bytes_in
                        attrs[RESPONSE_BYTES] = meter.bytes_out
                    attrs["rpc.response.status_code"] = "OK"
                    span.end()
                else:
                    self._finish(conn, span, None)
            except Exception as exc:
                internal_error(self.place + ".finish", exc)
        if meter is not None:
            meter.end_message()

    def failed(self, conn: Connection, exc: BaseException) -> BaseException:
        """``process`` raised ``exc``; returns what to raise to thriftpy2's server loop, which closes the
        connection. Before a message was decoded, bytes that are not a Thrift message are a protocol error:
        counted, and raised as a :class:`ProtocolErrorClosed` transport error (chained to ``exc``) so that the
        loop closes the connection without logging a traceback per bad client. After, the call's span ends
        with ``exc``, which is raised unchanged."""
        try:
            if conn.phase == READING:
                if conn.meter is None:
                    _link_meter(conn)
                kind = classify_failure(exc, conn.in_message())
                if kind is not None:
                    count_protocol_error(kind, exc)
                    if not isinstance(exc, TTransportException):
                        closed = ProtocolErrorClosed(TTransportException.UNKNOWN,
                                                     f"zoomer-serve: Thrift protocol error ({kind}): {exc!r}")
                        closed.__cause__ = exc
                        return closed
            elif conn.span is not None:
                self._finish(conn, conn.span, exc)
        except Exception as err:
            internal_error(self.place + ".failed", err)
        return exc

    def _finish(self, conn: Connection, span: RequestSpan, raised: BaseException | None) -> None:
        if not span.is_open:
            return
        attrs = span.attributes
        replied = raised is None and not conn.oneway
        attrs[REQUEST_MESSAGES] = 1
        attrs[RESPONSE_MESSAGES] = 1 if replied else 0
        meter = conn.meter
        if meter is not None:
            attrs[REQUEST_BYTES] = meter.bytes_in
            attrs[RESPONSE_BYTES] = meter.bytes_out
        exc = conn.exc
        if conn.outcome == OUT_UNKNOWN_METHOD:
            _app_error(span, TApplicationException.UNKNOWN_METHOD, "Unknown method")
        elif exc is None:
            if raised is None:
                attrs["rpc.response.status_code"] = "OK"
        elif raised is not exc:  # the processor answered the handler's exception
            if isinstance(exc, TApplicationException):
                span.record_exception(exc)
                _app_error(span, exc.type, str(exc))
            else:  # declared in the IDL: a normal reply with the exception field set
                name = type(exc).__name__
                attrs["rpc.response.status_code"] = name
                attrs[BUSINESS_ERROR] = name
        if raised is not None:
            quiet = isinstance(raised, asyncio.CancelledError)
            if not quiet:
                span.record_exception(raised)
            attrs["error.type"] = type(raised).__qualname__
            if not quiet:
                span.set_status(r.STATUS_ERROR, f"{type(raised).__name__}: {raised}")
        span.end()


def _app_error(span: RequestSpan, app_type: int, message: str) -> None:
    name = _APP_EXC_NAMES.get(app_type, "UNKNOWN")
    span.attributes["rpc.response.status_code"] = name
    span.attributes["error.type"] = name
    span.set_status(r.STATUS_ERROR, message or name)


# -- peers ----------------------------------------------------------------------------------------------------------
def peer_attributes(address: Any, family: int | None) -> dict[str, Any]:
    """``network.peer.address`` / ``.port`` of a socket peer address (a Unix socket: its path or "", no
    port)."""
    if family == getattr(socket, "AF_UNIX", None):
        return {"network.peer.address": address or ""}
    if isinstance(address, tuple) and len(address) >= 2:
        return {"network.peer.address": str(address[0]), "network.peer.port": int(address[1])}
    return {}


def _socket_peer(sock: Any) -> dict[str, Any]:
    try:
        return peer_attributes(sock.getpeername(), sock.family)
    except Exception:
        return {}


def peer_of(iprot: Any) -> dict[str, Any]:
    """Peer attributes from a protocol's transport socket (unmetered connections); {} when unknown."""
    try:
        sock = iprot.trans.sock
    except Exception:
        return {}
    return _socket_peer(sock) if sock is not None else {}


# -- the metered transport ---------------------------------------------------------------------------------------
class Meter:
    """Sits between a connection's socket and thriftpy2's transports: counts the bytes of each call, notes
    when the first byte of a message arrived, asks the socket for at most ``read_chunk_bytes`` at a time, and
    closes the connection (a :class:`MessageTooLarge` / :class:`InvalidFrame` transport error) on a frame
    header (framed transports) or a message, in any number of frames or none, beyond ``max_message_bytes``
    (see :class:`ThriftLimits`). Socket errors become
    ``TTransportException`` so that thriftpy2's server loop closes the connection without a traceback.

    Bytes count with a message when they are handed to the transport above, and each message gets only its own:
    on a framed connection the meter hands over no byte past the end of the frame being read (it keeps the rest
    for the next read); on an unframed one, once the processor has decoded a message it takes back what the
    transport read ahead (:meth:`message_read`), which then counts with the next message, started when those
    bytes were taken back.

    The subclasses define what thriftpy2's transports call on the socket below them (``read``, ``write``,
    ``flush``, ``open``, ``close``; the sync one also ``is_open`` and ``sock``) and nothing else passes
    through: no catch-all ``__getattr__``, which on this class kept the interpreter from specializing the
    attribute reads of every call (Python 3.11+ specializes only classes without it) and cost about 7 µs of
    server CPU per call in a busy server (benchmarks/RESULTS.md)."""

    __slots__ = ("inner", "limits", "framed", "idle", "msg_start_mono_ns", "bytes_in", "bytes_out", "conn", "peer",
                 "published", "_frame_left", "_header", "_owner", "_bound", "_pending", "_pending_ns", "_probe",
                 "_take_back", "_transport", "__weakref__")

    def __init__(self, inner: Any, limits: ThriftLimits, framed: bool, owner: MeteredTransportFactory,
                 peer: dict[str, Any]) -> None:
        self.inner = inner
        self.limits = limits
        self.framed = framed
        self.idle = True
        self.msg_start_mono_ns = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.conn: Connection | None = None
        self.peer = peer
        self.published = False
        self._frame_left = 0
        self._header = b""
        self._owner = owner
        self._bound = limits.max_message_bytes + limits.read_chunk_bytes  # see ThriftLimits
        self._pending = b""  # read from the socket, not yet handed to the transport: the next bytes it gets
        self._pending_ns = 0  # when the pending bytes were read
        self._probe = _PROBE_OFF
        self._take_back: Callable[[Meter, Any], None] | None = None
        self._transport: Any = None

    def end_message(self) -> None:
        """The processor finished a call: the next byte read starts the next message (or the bytes kept back,
        which already did)."""
        self.bytes_in = 0
        self.bytes_out = 0
        if self._pending:
            self.idle = False
            self.msg_start_mono_ns = self._pending_ns
        else:
            self.idle = True
            self.msg_start_mono_ns = 0

    def watch(self, transport: Any) -> None:
        """``transport`` reads from this meter: learn how to take back what it reads ahead (unframed buffered
        transports of thriftpy2; others are left as they are)."""
        self._transport = transport
        self._take_back = _take_back_for(transport, self)

    def message_read(self) -> None:
        """The processor decoded a whole message: the bytes that the transport read past it belong to the next
        message; take them back (they are handed over again on the next reads) and stop counting them here."""
        take_back = self._take_back
        if take_back is not None:
            take_back(self, self._transport)

    def _keep(self, data: bytes) -> None:
        """Put ``data`` (taken back from the transport, or read past a frame) before the pending bytes."""
        if not self._pending:
            self._pending_ns = _mono_ns()
        self._pending = data + self._pending

    def _give_back(self, data: bytes) -> None:
        """``data`` was counted with this message but belongs to the next one."""
        self.bytes_in -= len(data)
        self._keep(data)

    def _hand_over(self, sz: int, data: bytes | None) -> bytes:
        """The bytes for one read of ``sz`` by the transport: ``data`` just read from the socket (None: from the
        pending bytes), cut at the end of the current frame on a framed connection, counted."""
        if data is None:
            data, arrived_ns = self._pending, self._pending_ns
            self._pending = b""
            if 0 < sz < len(data):
                self._pending = data[sz:]
                data = data[:sz]
        else:
            arrived_ns = 0
        if self.framed:
            cut = self._frame_cut(data)
            if cut < len(data):
                if not arrived_ns:
                    arrived_ns = _mono_ns()
                self._pending, self._pending_ns = data[cut:] + self._pending, arrived_ns
                data = data[:cut]
        self._received(data, arrived_ns)
        return data

    def _probe_read(self) -> bytes:
        """A read while :func:`_take_back_cy` probes the transport's buffer: one filler byte the first time (the
        buffer was empty: the transport takes it and is empty again), then end of file (nothing is taken)."""
        if self._probe == _PROBE_FILL:
            self._probe = _PROBE_ASKED
            return b"\0"
        return b""

    def _received(self, data: bytes, arrived_ns: int = 0) -> None:
        if self.idle:
            self.idle = False
            self.msg_start_mono_ns = arrived_ns or _mono_ns()
            if not self.published:
                self._publish()
        self.bytes_in += len(data)
        if self.framed:
            self._scan_frames(data)
        # only while a traced processor serves the connection: it ends each message (end_message), without
        # which bytes_in would grow over the connection's life
        if self.bytes_in > self._bound and self.conn is not None:
            raise MessageTooLarge(TTransportException.UNKNOWN, f"zoomer-serve: Thrift message over "
                                  f"max_message_bytes={self.limits.max_message_bytes} ({self.bytes_in} bytes "
                                  f"read for it{' in several frames' if self.framed else ''})")

    def _publish(self) -> None:
        """The connection's first read. It happens inside the traced processor's ``process``, on the thread or
        task that serves the connection: link this meter to that connection's state now, so that the size
        bound holds from the first message on. Also publish it (:func:`_link_meter` finds it there when the
        processor had no connection state yet)."""
        self.published = True
        _meter_var.set(self)
        conn = _conn_var.get()
        if conn is not None and conn.meter is None and self.conn is None:
            conn.meter = self
            self.conn = conn

    def _frame_cut(self, data: bytes) -> int:
        """How many bytes at the start of ``data`` (the next on the wire) belong to the frame being read, its
        4-byte length included: all of it until the length is known. A bad length is left to
        :meth:`_scan_frames`."""
        if self._frame_left:
            return self._frame_left
        need = 4 - len(self._header)
        if len(data) < need:
            return len(data)
        return need + max(0, int.from_bytes(self._header + data[:need], "big", signed=True))

    def _scan_frames(self, data: bytes) -> None:
        """Follow the frame boundaries of the byte stream and check each 4-byte frame length."""
        i, n = 0, len(data)
        while i < n:
            if self._frame_left:
                take = min(self._frame_left, n - i)
                self._frame_left -= take
                i += take
                continue
            need = 4 - len(self._header)
            self._header += data[i:i + need]
            i += need
            if len(self._header) < 4:
                return
            size = int.from_bytes(self._header, "big", signed=True)
            self._header = b""
            if size < 1:
                raise InvalidFrame(TTransportException.UNKNOWN, f"zoomer-serve: Thrift frame header announces "
                                   f"{size} bytes")
            if size > self.limits.max_message_bytes:
                raise MessageTooLarge(TTransportException.UNKNOWN, f"zoomer-serve: Thrift frame of {size} bytes "
                                      f"over max_message_bytes={self.limits.max_message_bytes}")
            self._frame_left = size

    def _ask(self, sz: int) -> int:
        chunk = self.limits.read_chunk_bytes
        return sz if 0 < sz <= chunk else chunk

    def closed(self) -> None:
        self._owner.active.discard(self)


_PROBE_OFF, _PROBE_FILL, _PROBE_ASKED, _PROBE_EOF = 0, 1, 2, 3
_PROBE_CHUNK = 4096  # thriftpy2's buffer size: reads of at most this much never grow the transport's buffer


def _take_back_cy(meter: Meter, transport: Any) -> None:
    """Take back what a Cython ``TCyBufferedTransport`` holds unread (its buffer is not visible from Python).
    One ``read(1)``: when the buffer is empty (no call pipelined, the usual case) the transport asks the meter,
    which hands it one filler byte that this read consumes, and the buffer is empty again. Otherwise that byte
    was real, and reads that the meter answers with end of file (on which the transport consumes nothing)
    drain the rest, halving the size asked after each refusal."""
    meter._probe = _PROBE_FILL
    taken: list[bytes] = []
    try:
        first = transport.read(1)
        if meter._probe == _PROBE_ASKED:
            return
        taken.append(first)
        meter._probe = _PROBE_EOF
        size = _PROBE_CHUNK
        while size:
            try:
                taken.append(transport.read(size))
            except TTransportException:
                size //= 2
    finally:
        meter._probe = _PROBE_OFF
        if taken:  # also when something failed: what was taken must not be lost to the connection
            meter._give_back(b"".join(taken))


def _take_back_bytesio(meter: Meter, transport: Any) -> None:
    """Take back what thriftpy2's pure-Python buffered transport (sync or asyncio) holds unread."""
    rest = transport._rbuf.read()
    if rest:
        meter._give_back(rest)


def _take_back_for(transport: Any, meter: Meter) -> Callable[[Meter, Any], None] | None:
    if _CyBuffered is not None and type(transport) is _CyBuffered:
        return _take_back_cy
    if isinstance(transport, (TBufferedTransport, TAsyncBufferedTransport)) and \
            getattr(transport, "_trans", None) is meter and isinstance(getattr(transport, "_rbuf", None), io.BytesIO):
        return _take_back_bytesio
    return None


def _transport_error(exc: OSError) -> TTransportException:
    kind = TTransportException.TIMED_OUT if isinstance(exc, TimeoutError) else TTransportException.END_OF_FILE
    return TTransportException(kind, f"{type(exc).__name__}: {exc}")


class SocketMeter(Meter):
    """:class:`Meter` over a sync thriftpy2 ``TSocket``."""

    __slots__ = ()

    @property
    def sock(self) -> Any:
        return self.inner.sock

    def read(self, sz: int) -> bytes:
        if self._probe:
            return self._probe_read()
        if self._pending:
            return self._hand_over(sz, None)
        try:
            data = self.inner.read(self._ask(sz))
        except OSError as exc:
            raise _transport_error(exc) from exc
        if self.framed:
            return self._hand_over(sz, data)
        self._received(data)
        return data

    def write(self, buf: bytes) -> None:
        self.bytes_out += len(buf)
        try:
            self.inner.write(buf)
        except OSError as exc:
            raise _transport_error(exc) from exc

    def flush(self) -> None:
        try:
            self.inner.flush()
        except OSError as exc:
            raise _transport_error(exc) from exc

    def is_open(self) -> bool:
        return bool(self.inner.is_open())

    def open(self) -> Any:
        return self.inner.open()

    def close(self) -> None:
        self.closed()
        self.inner.close()

    def shutdown(self) -> None:
        """Make the connection's pending read end (server stop)."""
        sock = self.inner.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class StreamMeter(Meter):
    """:class:`Meter` over a ``thriftpy2.contrib.aio`` ``StreamHandler``."""

    __slots__ = ()

    async def read(self, sz: int) -> bytes:
        if self._pending:
            return self._hand_over(sz, None)
        try:
            data = await self.inner.read(self._ask(sz))
        except OSError as exc:
            raise _transport_error(exc) from exc
        if self.framed:
            return self._hand_over(sz, data)
        self._received(data)
        return data

    def write(self, buf: bytes) -> None:
        self.bytes_out += len(buf)
        self.inner.write(buf)

    async def flush(self) -> None:
        try:
            await self.inner.flush()
        except OSError as exc:
            raise _transport_error(exc) from exc

    async def open(self) -> Any:
        return await self.inner.open()

    def close(self) -> None:
        self.closed()
        self.inner.close()

    def shutdown(self) -> None:
        self.inner.close()


def _framed_factory_types() -> tuple[type, ...]:
    from thriftpy2.contrib.aio.transport.framed import TAsyncFramedTransportFactory
    from thriftpy2.transport import framed

    types: list[type] = [TAsyncFramedTransportFactory, framed.TFramedTransportFactory]
    cy = getattr(framed, "TCyFramedTransportFactory", None)
    if cy is not None:
        types.append(cy)
    return tuple(types)


def _wait_until(done: Callable[[], bool], timeout_s: float) -> bool:
    """Poll ``done`` every 10 ms until it is true or ``timeout_s`` seconds have passed; its last answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        if done():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


class MeteredTransportFactory:
    """A thriftpy2 transport factory (sync or asyncio) whose connections are metered (see :class:`Meter`).

    Wrap the server's transport factory with it (the ``make_server`` helpers do): ``TThreadedServer(processor,
    server_socket, itrans_factory=MeteredTransportFactory(TBufferedTransportFactory()))``. The input and the
    output transport of one connection share one meter.

    Args:
        inner: the transport factory to wrap (buffered, framed, ...).
        limits: size limits; default :class:`ThriftLimits`.
        framed: whether ``inner`` frames messages (checks frame headers); default: recognised from its type.
        aio: wrap ``thriftpy2.contrib.aio`` stream handlers instead of sync sockets.
    """

    def __init__(self, inner: Any, limits: ThriftLimits | None = None, *, framed: bool | None = None,
                 aio: bool = False) -> None:
        self.inner = inner
        self.limits = limits or ThriftLimits()
        self.framed = isinstance(inner, _framed_factory_types()) if framed is None else framed
        self.aio = aio
        self.active: set[Meter] = set()
        self._by_client: weakref.WeakKeyDictionary[Any, Meter] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def get_transport(self, client: Any) -> Any:
        with self._lock:
            meter = self._by_client.get(client)
            if meter is None:
                meter = self._meter(client)
                self._by_client[client] = meter
                self.active.add(meter)
                transport = self.inner.get_transport(meter)
                meter.watch(transport)  # the server asks for the input transport first
                return transport
        return self.inner.get_transport(meter)

    def _meter(self, client: Any) -> Meter:
        if self.aio:
            peer: dict[str, Any] = {}
            try:
                sock = client.writer.get_extra_info("socket")
                peer = peer_attributes(client.writer.get_extra_info("peername"), getattr(sock, "family", None))
            except Exception:
                pass
            return StreamMeter(client, self.limits, self.framed, self, peer)
        sock = getattr(client, "sock", None)
        return SocketMeter(client, self.limits, self.framed, self, _socket_peer(sock) if sock is not None else {})

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until no connection is in the middle of a call; True if none is."""
        return _wait_until(lambda: all(meter.idle for meter in list(self.active)), timeout_s)

    def wait_closed(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until every connection has been closed by the thread or task serving it
        (which closes it after its last call has ended its span); True if all were."""
        return _wait_until(lambda: not self.active, timeout_s)

    def shutdown_all(self) -> None:
        """End every open connection's pending read (the server is stopping)."""
        for meter in list(self.active):
            try:
                meter.shutdown()  # type: ignore[attr-defined]
            except Exception as exc:
                internal_error("thrift_server.shutdown", exc)


class BoundServerInfo:
    """What the sync and asyncio traced Thrift servers tell about themselves (mixed into both; they hold
    thriftpy2's ``trans`` (the server socket) and ``itrans_factory``)."""

    trans: Any
    itrans_factory: Any

    @property
    def port(self) -> int | None:
        """The bound TCP port (None for a unix socket)."""
        return self.trans.port  # type: ignore[no-any-return]

    @property
    def metered(self) -> MeteredTransportFactory | None:
        """The metered transport factory counting bytes and protocol errors, when the server has one."""
        factory = self.itrans_factory
        return factory if isinstance(factory, MeteredTransportFactory) else None
