"""thriftpy2 sync servers: traced processors and a one-call server builder.

Usage (the one-call form mirrors ``thriftpy2.rpc.make_server``, which takes no processor of ours)::

    from interceptors.thrift_server import make_server

    server = make_server(ranker_thrift.Ranker, Handler(), "127.0.0.1", 0)
    server.start()            # or server.serve_forever() on this thread
    print(server.port)
    ...
    server.stop()

or, for a server you build yourself, the processor and (for sizes and limits) the transport factory::

    processor = TracedProcessor(ranker_thrift.Ranker, Handler())
    server = TThreadedServer(processor, TServerSocket("127.0.0.1", 9090),
                             itrans_factory=MeteredTransportFactory(TBufferedTransportFactory()))

:class:`TracedProcessor` subclasses ``thriftpy2.thrift.TProcessor`` and calls through to it: thriftpy2 still
decodes the call, runs the handler, answers declared exceptions and ``TApplicationException`` and lets other
exceptions reach the server loop; the processor only opens the span when the call is decoded, makes it
current while the handler runs, and ends it once the reply is written. The span shape is described in
:mod:`interceptors.thrift_common`. It also answers thriftpy2's ``contrib.tracking`` handshake, per connection,
so a ``TTrackedClient`` (:func:`interceptors.thrift_client.make_client`) propagates W3C trace context in its
request header; other clients are served as before.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from thriftpy2.protocol import TBinaryProtocolFactory
from thriftpy2.server import TThreadedServer
from thriftpy2.thrift import (
    TApplicationException,
    TException,
    TMessageType,
    TMultiplexedProcessor,
    TProcessor,
    TType,
)
from thriftpy2.transport import TBufferedTransportFactory, TServerSocket, TSSLServerSocket

from interceptors.thrift_common import (
    BoundServerInfo,
    Connection,
    MeteredTransportFactory,
    RequestHeader,
    ThriftLimits,
    ThriftTracer,
    _conn_var,
    _noop,
    with_tracking,
)
from zoomer_serve.recording import RequestRecorder, internal_error

__all__ = ["ThriftBindError", "TracedMultiplexedProcessor", "TracedProcessor", "TracedThreadedServer",
           "make_server"]


_BINARY = TBinaryProtocolFactory()  # thriftpy2's make_server defaults (stateless factories)
_BUFFERED = TBufferedTransportFactory()


class ThriftBindError(OSError):
    """The Thrift server could not listen on the requested address."""


class _TracingMixin:
    """The overrides shared by the traced sync processors; each calls through to thriftpy2."""

    _zoomer: ThriftTracer

    def process(self, iprot: Any, oprot: Any) -> None:
        conn = Connection.current(iprot, oprot)
        try:
            super().process(iprot, oprot)  # type: ignore[misc]
        except BaseException as exc:
            raised = self._zoomer.failed(conn, exc)
            if raised is exc:
                raise
            raise raised from exc
        self._zoomer.completed(conn)

    def process_in(self, iprot: Any) -> tuple[str, int, Any, Any]:
        conn = _conn_var.get()
        header = None
        if conn is not None and conn.tracking and conn.iprot is iprot:
            header = RequestHeader()
            iprot.read_struct(header)
        api, seqid, result, call = super().process_in(iprot)  # type: ignore[misc]
        if conn is None or conn.iprot is not iprot:  # called outside process(): leave it alone
            return api, seqid, result, call
        return self._zoomer.dispatch(conn, api, seqid, result, call, header, conn.invoke, _noop)


def _tracer(tracer: ThriftTracer | None, recorder: RequestRecorder | None, kwargs: dict[str, Any]) -> ThriftTracer:
    return tracer if tracer is not None else ThriftTracer(recorder, **kwargs)


class TracedProcessor(_TracingMixin, TProcessor):
    """``TProcessor`` that records one SERVER span per call (see the module docstring).

    Args:
        service: the thriftpy2 service class (``ranker_thrift.Ranker``).
        handler: the object whose methods serve it.
        service_name: the service part of span names (``<service_name>/<method>``); default the IDL name.
        recorder, server_address, server_port, excluded_methods, filter_, semconv_dup: see
            :class:`~interceptors.thrift_common.ThriftTracer`.
        tracer: share one tracer between processors instead (the keyword settings above are then unused).
    """

    def __init__(self, service: Any, handler: object, *, service_name: str | None = None,
                 recorder: RequestRecorder | None = None, tracer: ThriftTracer | None = None,
                 **tracer_kwargs: Any) -> None:
        super().__init__(with_tracking(service), handler)
        self._zoomer = _tracer(tracer, recorder, tracer_kwargs)
        self._zoomer.add_service(service, service_name)

    @property
    def tracer(self) -> ThriftTracer:
        return self._zoomer


class _MultiplexedProcessor(TMultiplexedProcessor):
    """``TMultiplexedProcessor`` that answers a call to a method its service lacks (a client on a newer IDL) as
    it answers one to an unknown service: a ``TApplicationException`` UNKNOWN_METHOD reply, the connection
    going on. thriftpy2's own looks the method's argument type up, fails, and the server loop closes the
    connection without a reply."""

    def process_in(self, iprot: Any) -> tuple[str, int, Any, Any]:
        name, mtype, seqid = iprot.read_message_begin()
        if mtype not in (TMessageType.CALL, TMessageType.ONEWAY):
            raise TException("TMultiplexed protocol only supports CALL & ONEWAY")
        service_name, separator, api = name.partition(self.SEPARATOR)
        if not separator:
            raise TException("Service name not found in message. You should use TMultiplexedProtocol in client.")
        processor = self.processors.get(service_name)
        if processor is None or api not in processor._service.thrift_services:
            iprot.skip(TType.STRUCT)
            iprot.read_message_end()
            conn = _conn_var.get()
            if conn is not None and conn.iprot is iprot:
                conn.wire_name = name
            return api, seqid, TApplicationException(TApplicationException.UNKNOWN_METHOD), None
        service = processor._service
        args = getattr(service, api + "_args")()
        args.read(iprot)
        iprot.read_message_end()
        result = getattr(service, api + "_result")()
        names = [spec[1] for spec in args.thrift_spec.values()]  # the IDL's argument order
        handler = processor._handler

        def call() -> Any:
            return getattr(handler, api)(*(args.__dict__[k] for k in names))

        return api, seqid, result, call


class TracedMultiplexedProcessor(_TracingMixin, _MultiplexedProcessor):
    """``TMultiplexedProcessor`` that records one SERVER span per call, named ``<registered name>/<method>``.

    Register services as with thriftpy2: ``register_processor("Ranker", TProcessor(Ranker, handler))`` (any
    processor carrying ``_service`` and ``_handler``, which is all ``TMultiplexedProcessor`` uses). One service
    class registered under two names is named after the first. A call to a method that the registered service
    lacks is answered UNKNOWN_METHOD and the connection goes on (thriftpy2's own processor closes it).
    """

    def __init__(self, *, recorder: RequestRecorder | None = None, tracer: ThriftTracer | None = None,
                 **tracer_kwargs: Any) -> None:
        super().__init__()
        self._zoomer = _tracer(tracer, recorder, tracer_kwargs)

    @property
    def tracer(self) -> ThriftTracer:
        return self._zoomer

    def register_processor(self, service_name: str, processor: TProcessor) -> None:
        service = processor._service
        super().register_processor(service_name, TProcessor(with_tracking(service), processor._handler))
        self._zoomer.add_service(service, service_name)


class _BindOnce:
    """A server socket that binds when asked (so that a port-0 server knows its port before serving) and
    whose ``listen`` is then idempotent (thriftpy2's ``serve`` calls it again)."""

    sock: Any
    unix_socket: str | None
    port: int | None

    def listen(self) -> None:
        if self.sock is not None:
            return
        super().listen()  # type: ignore[misc]
        if not self.unix_socket and self.sock is not None:
            self.port = self.sock.getsockname()[1]


class BoundServerSocket(_BindOnce, TServerSocket):
    """``TServerSocket`` with :class:`_BindOnce` behaviour."""


class BoundSSLServerSocket(_BindOnce, TSSLServerSocket):
    """``TSSLServerSocket`` with :class:`_BindOnce` behaviour."""


class TracedThreadedServer(BoundServerInfo, TThreadedServer):
    """``TThreadedServer`` (a thread per connection) that knows its bound port and stops cleanly.

    ``serve_forever()`` serves on the calling thread; ``start()`` serves on a daemon thread and returns;
    ``stop()`` stops accepting, ends open connections and waits for the accept loop.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._thread: threading.Thread | None = None

    def serve_forever(self) -> None:
        """Serve until :meth:`stop` (blocks)."""
        self.serve()

    def start(self) -> TracedThreadedServer:
        """Serve on a daemon thread; returns once the socket listens."""
        self.trans.listen()
        self._thread = threading.Thread(target=self.serve_forever, name="thrift-accept", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0, grace_s: float = 0.0) -> None:
        """Stop accepting, let calls in progress finish for up to ``grace_s`` seconds (metered connections),
        end every open connection, and wait up to ``timeout_s`` in all (plus ``grace_s``) for the accept loop
        and then for the connections' threads to close them. A call's span ends after its reply is written:
        without that last wait, a client could hold every reply while the last call's span had not ended, and
        a ``zoomer_serve.shutdown()`` right after ``stop()`` dropped it (counted)."""
        deadline = time.monotonic() + timeout_s + grace_s
        self.closed = True
        self._wake_accept()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.trans.close()
        metered = self.metered
        if metered is not None:
            metered.wait_idle(grace_s)
            metered.shutdown_all()
            metered.wait_closed(max(0.0, deadline - time.monotonic()))

    def _wake_accept(self) -> None:
        """Connect once to our own socket so that a blocked ``accept()`` returns and sees ``closed``."""
        trans = self.trans
        if trans.sock is None:
            return
        try:
            if trans.unix_socket:
                family, address = socket.AF_UNIX, trans.unix_socket
            else:
                host = trans.sock.getsockname()[0]
                if host in ("0.0.0.0", ""):
                    host = "127.0.0.1"
                elif host == "::":
                    host = "::1"
                family, address = trans.sock.family, (host, trans.port)
            with socket.socket(family, socket.SOCK_STREAM) as wake:
                wake.settimeout(1.0)
                wake.connect(address)
        except OSError as exc:
            internal_error("thrift_server.stop", exc)


def make_server(service: Any, handler: object, host: str = "localhost", port: int | None = 9090,
                unix_socket: str | None = None, proto_factory: Any = _BINARY,
                trans_factory: Any = _BUFFERED, client_timeout: int | None = 3000,
                certfile: str | None = None, socket_family: socket.AddressFamily = socket.AF_INET, *,
                service_name: str | None = None, recorder: RequestRecorder | None = None,
                limits: ThriftLimits | None = None, daemon: bool = True,
                excluded_methods: tuple[str, ...] | None = None, filter_: Callable[[str], bool] | None = None,
                semconv_dup: bool | None = None) -> TracedThreadedServer:
    """``thriftpy2.rpc.make_server`` with tracing: a :class:`TracedThreadedServer` around a
    :class:`TracedProcessor`, its connections metered and bounded (:class:`MeteredTransportFactory`).

    The positional parameters are thriftpy2's (``client_timeout`` in ms is each connection's socket timeout;
    port 0 picks a free port, which thriftpy2's own helper refuses). The socket is bound before returning:
    ``server.port`` is the real port. Keyword-only: ``service_name`` (span names), ``recorder``, ``limits``
    (:class:`ThriftLimits`), ``daemon`` (connection threads), and the tracer's filters.

    Raises:
        ValueError: neither host and port nor unix_socket given.
        ThriftBindError: the address cannot be bound (in use, not local, no permission).
    """
    if not unix_socket and not (host and port is not None):
        raise ValueError("make_server needs host and port, or unix_socket")
    if unix_socket:
        server_socket: Any = BoundServerSocket(unix_socket=unix_socket)
    elif certfile:
        server_socket = BoundSSLServerSocket(host=host, port=port, client_timeout=client_timeout,
                                             certfile=certfile, socket_family=socket_family)
    else:
        server_socket = BoundServerSocket(host=host, port=port, client_timeout=client_timeout,
                                          socket_family=socket_family)
    try:
        server_socket.listen()
    except OSError as exc:
        server_socket.close()
        where = unix_socket or f"{host}:{port}"
        raise ThriftBindError(exc.errno, f"cannot listen for Thrift on {where}: {exc.strerror or exc}") from exc
    processor = TracedProcessor(service, handler, service_name=service_name, recorder=recorder,
                                server_address=unix_socket or host, server_port=server_socket.port,
                                excluded_methods=excluded_methods, filter_=filter_, semconv_dup=semconv_dup)
    return TracedThreadedServer(processor, server_socket, iprot_factory=proto_factory,
                                itrans_factory=MeteredTransportFactory(trans_factory, limits), daemon=daemon)
