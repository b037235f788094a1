"""Locust users for gRPC and Thrift services whose calls carry W3C trace context (imports locust, which
monkeypatches the standard library with gevent; import from a locustfile only).

Every call made through :attr:`GrpcUser.stub` (or :attr:`GrpcUser.channel`) or :attr:`ThriftUser.client`
fires exactly one ``request`` event on the user's ``environment.events``:

- ``request_type``: ``grpc`` or ``thrift``; ``name``: the RPC method, ``pkg.Service/Method`` (the server
  span's ``rpc.method``); ``response_time``: ms from the call to its last response message (perf counter);
  ``response_length``: bytes of the response messages (protobuf ``ByteSize()``; Thrift: the binary-protocol
  encoding of the result); ``exception``: None for status OK, else a :class:`GrpcStatusError` /
  :class:`ThriftCallError`; ``context``: the user's ``context()`` plus ``trace_id`` (32 hex digits) of the
  call, which is also the trace id of the server's span.
- A call that did not end OK raises that same exception after the event; it is a locust ``RescheduleTask``,
  so when the task does not catch it locust moves on to the next task without counting an error twice.
- A call interrupted because locust stopped the user (``--stop-timeout`` 0, the default, kills users
  mid-call) still fires its event, as ``CANCELLED`` (gRPC) or a ``ThriftCallError(GreenletExit)``, with its
  trace id. The server has a span for it only if the call reached a handler before the cancellation did (a
  gRPC call still waiting for a server worker thread never runs its handler). Give locust a
  ``--stop-timeout`` to let calls in flight finish instead (a user that locust finds waiting is stopped
  before its next call starts: :func:`let_a_pending_stop_land`).

Trace context: gRPC channels carry :class:`interceptors.ZoomerClientInterceptor` (a CLIENT span per call,
``traceparent`` sent in the metadata); Thrift clients are ``contrib.tracking`` clients
(:func:`interceptors.make_thrift_client`) and each call runs inside a CLIENT span recorded here with the same
shape. The spans go wherever this process's zoomer-serve telemetry exports (``OTEL_*`` variables; set
``ZOOMER_EXPORT_MODE=none`` to export nothing: context is still sent).

gevent: grpcio's gevent integration is initialised when this module is imported
(:func:`~zoomer_serve.loadtest.gevent_grpc.init_grpc_gevent`, case C11); a GrpcUser refuses to start without it.
Streaming calls are consumed whole: unary-stream and stream-stream calls return the list of responses.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable
from typing import Any, ClassVar

import gevent
import locust  # noqa: F401  (before grpc: importing locust makes gevent patch the standard library)
from gevent import GreenletExit
from locust import User
from locust.exception import RescheduleTask

from zoomer_serve.loadtest.gevent_grpc import init_grpc_gevent, require_grpc_gevent

init_grpc_gevent()

import grpc  # noqa: E402

from interceptors import ZoomerClientInterceptor, make_thrift_client  # noqa: E402
from interceptors.grpc_common import (  # noqa: E402
    REQUEST_MESSAGES,
    RESPONSE_BYTES,
    RESPONSE_MESSAGES,
    message_size,
)
from interceptors.thrift_common import BUSINESS_ERROR, RPC_SYSTEM  # noqa: E402
from zoomer_serve.config import ConfigError  # noqa: E402
from zoomer_serve.loadtest.config import grpc_target  # noqa: E402
from zoomer_serve.recording import parse_traceparent  # noqa: E402
from zoomer_serve.recording import records as r  # noqa: E402


def let_a_pending_stop_land() -> None:
    """Yield to gevent's hub once before a call starts. locust's graceful stop (a stop timeout) kills a user
    that it finds waiting, but the kill lands at the user's next switch: when the wait had just ended, that is
    inside the call the user starts next, which then counts as a CANCELLED failure. Yielding first runs the
    pending kill here, before anything is sent (a few µs per call)."""
    gevent.sleep(0)


STOPPED_DURING_CALL = "the locust user was stopped during the call"
TRACE_ID = "trace_id"
"""Key of the call's trace id (32 hex digits) in the request event's ``context``."""

_sent_traceparent: contextvars.ContextVar[str | None] = contextvars.ContextVar("zoomer_locust_tp", default=None)


class GrpcStatusError(RescheduleTask):
    """A gRPC call ended with a status other than OK: ``code`` (``grpc.StatusCode``) and ``details``. Its
    ``repr`` names only the code, so that locust groups failures by status."""

    def __init__(self, code: grpc.StatusCode | None, details: str | None) -> None:
        self.code = code
        self.details = details or ""
        super().__init__(f"{self.code_name}: {self.details}")

    @property
    def code_name(self) -> str:
        return self.code.name if self.code is not None else "UNKNOWN"

    def __repr__(self) -> str:
        return f"GrpcStatusError({self.code_name})"


class ThriftCallError(RescheduleTask):
    """A Thrift call raised ``error`` (a declared exception, ``TApplicationException``, a transport error);
    its ``repr`` names only the error's type."""

    def __init__(self, error: BaseException) -> None:
        self.error = error
        super().__init__(f"{type(error).__name__}: {error}")

    def __repr__(self) -> str:
        return f"ThriftCallError({type(self.error).__name__})"


def _trace_id_sent() -> str | None:
    parsed = parse_traceparent(_sent_traceparent.get())
    return f"{parsed.trace_id:032x}" if parsed is not None else None


class _TraceparentProbe(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                        grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Innermost interceptor: notes the ``traceparent`` the zoomer interceptor put in the call's metadata."""

    def _note(self, details: grpc.ClientCallDetails) -> None:
        _sent_traceparent.set(next((v for k, v in details.metadata or () if k == "traceparent"), None))

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        self._note(details)
        return continuation(details, request)

    intercept_unary_stream = intercept_unary_unary

    def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        self._note(details)
        return continuation(details, request_iterator)

    intercept_stream_stream = intercept_stream_unary


Fire = Callable[[str, float, float, int, BaseException | None, Any, str | None], None]


class _Measured:
    """A multicallable whose blocking calls are measured; ``future()`` is refused (use the blocking call: gevent
    makes it cooperative)."""

    def __init__(self, inner: Any, method: str, fire: Fire, timeout_s: float) -> None:
        self._inner = inner
        self._name = method.lstrip("/")
        self._fire = fire
        self._timeout_s = timeout_s

    def _run(self, call: Callable[[], tuple[Any, int]]) -> Any:
        let_a_pending_stop_land()
        _sent_traceparent.set(None)
        start_time = time.time()
        t0 = time.perf_counter()
        error: GrpcStatusError | None = None
        response, length = None, 0
        try:
            response, length = call()
        except grpc.RpcError as err:
            error = GrpcStatusError(err.code(), err.details())
        except GreenletExit:  # locust stopped the user mid-call: the call was started, count it
            self._fire(self._name, start_time, (time.perf_counter() - t0) * 1000.0, 0, GrpcStatusError(
                grpc.StatusCode.CANCELLED, STOPPED_DURING_CALL), None, _trace_id_sent())
            raise
        self._fire(self._name, start_time, (time.perf_counter() - t0) * 1000.0, length, error, response,
                   _trace_id_sent())
        if error is not None:
            raise error
        return response

    def _kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        kwargs.setdefault("timeout", self._timeout_s)
        return kwargs

    def future(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{self._name}: future() calls are not measured; call the method (it blocks "
                                  "only this locust user)")


class _UnaryResponse(_Measured):
    def __call__(self, request: Any, **kwargs: Any) -> Any:
        def call() -> tuple[Any, int]:
            response = self._inner(request, **self._kwargs(kwargs))
            return response, message_size(response)

        return self._run(call)

    def with_call(self, request: Any, **kwargs: Any) -> tuple[Any, Any]:
        def call() -> tuple[Any, int]:
            response, rpc = self._inner.with_call(request, **self._kwargs(kwargs))
            return (response, rpc), message_size(response)

        return self._run(call)


class _StreamResponse(_Measured):
    def __call__(self, request: Any, **kwargs: Any) -> list[Any]:
        def call() -> tuple[Any, int]:
            responses = list(self._inner(request, **self._kwargs(kwargs)))
            return responses, sum(message_size(m) for m in responses)

        return self._run(call)


class MeasuredChannel(grpc.Channel):
    """A ``grpc.Channel`` whose multicallables fire one locust ``request`` event per call (module docstring).

    Args:
        channel: the channel to call through (already intercepted).
        fire: ``fire(name, start_time, response_time_ms, response_length, exception, response, trace_id)``.
        timeout_s: deadline of calls that give none.
    """

    def __init__(self, channel: grpc.Channel, fire: Fire, timeout_s: float) -> None:
        self._channel = channel
        self._fire = fire
        self._timeout_s = timeout_s

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _UnaryResponse(self._channel.unary_unary(method, *args, **kwargs), method, self._fire, self._timeout_s)

    def stream_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _UnaryResponse(self._channel.stream_unary(method, *args, **kwargs), method, self._fire,
                              self._timeout_s)

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _StreamResponse(self._channel.unary_stream(method, *args, **kwargs), method, self._fire,
                               self._timeout_s)

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _StreamResponse(self._channel.stream_stream(method, *args, **kwargs), method, self._fire,
                               self._timeout_s)

    def subscribe(self, callback: Any, try_to_connect: bool = False) -> None:
        self._channel.subscribe(callback, try_to_connect)

    def unsubscribe(self, callback: Any) -> None:
        self._channel.unsubscribe(callback)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> MeasuredChannel:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _fire_on(user: User, request_type: str) -> Fire:
    def fire(name: str, start_time: float, response_time_ms: float, length: int, exc: BaseException | None,
             response: Any, trace_id: str | None) -> None:
        context = dict(user.context())
        if trace_id is not None:
            context[TRACE_ID] = trace_id
        user.environment.events.request.fire(
            request_type=request_type, name=name, response_time=response_time_ms, response_length=length,
            response=response, context=context, exception=exc, start_time=start_time, url=None)

    return fire


class GrpcUser(User):
    """A locust user calling a gRPC service at locust's ``--host`` (``host:port`` or ``grpc://host:port``).

    Set ``stub_class`` (e.g. ``ranker_pb2_grpc.RankerStub``) and use ``self.stub`` in tasks; or call
    ``self.channel`` directly. Class attributes: ``timeout_s`` (deadline of each call, default 30 s),
    ``channel_options`` (``grpc.insecure_channel`` options).

    Raises (when created): GeventSetupError (grpcio cannot cooperate with gevent: see
    :mod:`zoomer_serve.loadtest.gevent_grpc`), ConfigError (no usable ``--host``).
    """

    abstract = True
    stub_class: ClassVar[type | None] = None
    timeout_s: ClassVar[float] = 30.0
    channel_options: ClassVar[tuple[tuple[str, Any], ...]] = ()

    def __init__(self, environment: Any) -> None:
        super().__init__(environment)
        require_grpc_gevent()
        target = grpc_target(self.host)
        raw = grpc.insecure_channel(target, options=list(self.channel_options))
        intercepted = grpc.intercept_channel(raw, ZoomerClientInterceptor(target=target), _TraceparentProbe())
        self.channel = MeasuredChannel(intercepted, _fire_on(self, "grpc"), self.timeout_s)
        self.stub: Any = self.stub_class(self.channel) if self.stub_class is not None else None

    def on_stop(self) -> None:
        self.channel.close()


class _ThriftClient:
    """``client.<method>(...)`` for every method of a Thrift service: one connection (re-opened after a
    transport error), one CLIENT span and one request event per call."""

    def __init__(self, user: ThriftUser, host: str, port: int) -> None:
        self._user = user
        self._host, self._port = host, port
        self._service = user.thrift_service
        self._service_name = user.service_name or self._service.__name__
        self._conn: Any = None
        self._fire = _fire_on(user, RPC_SYSTEM)
        from zoomer_serve.runtime import get_recorder

        self._recorder = get_recorder()
        self._result_types = {api: getattr(self._service, f"{api}_result") for api in self._service.thrift_services}
        self._static = {"rpc.system.name": RPC_SYSTEM, "server.address": host, "server.port": port}

    def __getattr__(self, api: str) -> Callable[..., Any]:
        if api not in self._result_types:
            raise AttributeError(f"{self._service_name} has no method {api!r}")
        return lambda *args, **kwargs: self._call(api, args, kwargs)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _call(self, api: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        let_a_pending_stop_land()
        name = f"{self._service_name}/{api}"
        span = self._recorder.start(name, kind=r.KIND_CLIENT, attributes={**self._static, "rpc.method": name})
        start_time = time.time()
        t0 = time.perf_counter()
        error: BaseException | None = None
        response = None
        span.activate()
        try:
            if self._conn is None:
                self._conn = make_thrift_client(self._service, self._host, self._port,
                                                timeout=max(1, int(self._user.timeout_s * 1000)))
            response = getattr(self._conn, api)(*args, **kwargs)
        except Exception as exc:
            error = exc
        except GreenletExit as stopped:  # locust stopped the user mid-call: count the call, then stop
            error = stopped
        finally:
            span.deactivate()
        elapsed_ms = (time.perf_counter() - t0) * 1000.0
        length = self._finish(span, api, response, error)
        failure = ThriftCallError(error) if error is not None else None
        self._fire(name, start_time, elapsed_ms, length, failure, response, f"{span.trace_id:032x}")
        if isinstance(error, GreenletExit):
            raise error
        if failure is not None:
            raise failure
        return response

    def _finish(self, span: Any, api: str, response: Any, error: BaseException | None) -> int:
        """End the CLIENT span with the call's outcome (the server span's conventions); returns the response
        length in bytes."""
        from thriftpy2.thrift import TApplicationException, TException
        from thriftpy2.utils import serialize

        attrs = span.attributes
        attrs[REQUEST_MESSAGES] = 1
        result = self._result_types[api]()
        field = _declared_field(result, error) if isinstance(error, TException) \
            and not isinstance(error, TApplicationException) else None
        length = 0
        if error is None or field is not None:
            if field is not None:
                name = type(error).__name__
                attrs["rpc.response.status_code"] = name
                attrs[BUSINESS_ERROR] = name
                setattr(result, field, error)
            else:
                attrs["rpc.response.status_code"] = "OK"
                result.success = response
            length = len(serialize(result))
            attrs[RESPONSE_MESSAGES] = 1
            attrs[RESPONSE_BYTES] = length
        else:
            attrs[RESPONSE_MESSAGES] = 0
            span.record_exception(error)
            attrs["error.type"] = type(error).__qualname__
            if isinstance(error, TApplicationException):  # named as the server names it (thrift_common)
                app = {v: k for k, v in vars(TApplicationException).items() if k.isupper() and isinstance(v, int)}
                attrs["rpc.response.status_code"] = attrs["error.type"] = app.get(error.type, "UNKNOWN")
            span.set_status(r.STATUS_ERROR, f"{type(error).__name__}: {error}")
            if not isinstance(error, TApplicationException):
                self.close()  # a transport or protocol error leaves the connection unusable
        span.end()
        return length


def _declared_field(result: Any, error: BaseException) -> str | None:
    """The field of a Thrift ``<method>_result`` struct that holds ``error`` when the IDL declares it."""
    for spec in result.thrift_spec.values():
        if len(spec) > 2 and spec[1] != "success" and isinstance(spec[2], type) and isinstance(error, spec[2]):
            return str(spec[1])
    return None


class ThriftUser(User):
    """A locust user calling a Thrift service (thriftpy2, binary protocol, buffered transport) at locust's
    ``--host`` (``host:port``). Set ``thrift_service`` (the thriftpy2 service class) and use ``self.client``:
    ``self.client.Predict(request)``. ``service_name`` names the calls ``<service_name>/<method>`` (default the
    IDL service name; use what the server's ``service_name=`` is); ``timeout_s`` is the socket timeout.

    Raises (when created): ConfigError (no usable ``--host`` or no ``thrift_service``).
    """

    abstract = True
    thrift_service: ClassVar[Any] = None
    service_name: ClassVar[str | None] = None
    timeout_s: ClassVar[float] = 30.0

    def __init__(self, environment: Any) -> None:
        super().__init__(environment)
        if self.thrift_service is None:
            raise ConfigError(f"{type(self).__name__}.thrift_service is not set (a thriftpy2 service class)")
        host, _, port = grpc_target(self.host).rpartition(":")
        self.client = _ThriftClient(self, host.strip("[]"), int(port))

    def on_stop(self) -> None:
        self.client.close()

