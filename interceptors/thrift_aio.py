"""``thriftpy2.contrib.aio`` servers: a traced ``TAsyncProcessor`` and a one-call server builder.

Usage (mirrors ``thriftpy2.contrib.aio.rpc.make_server``)::

    from interceptors.thrift_aio import make_aio_server

    server = make_aio_server(ranker_thrift.Ranker, AsyncHandler(), "127.0.0.1", 0, client_timeout=None)
    server.start()            # serves on its own event loop thread; or server.serve_forever()
    ...
    server.stop()

:class:`TracedAsyncProcessor` subclasses ``TAsyncProcessor`` and calls through to it, exactly as the sync
:class:`~interceptors.thrift_server.TracedProcessor` does, and records the same spans
(:mod:`interceptors.thrift_common`). One difference from thriftpy2: a ``TApplicationException`` raised by a
handler is answered with an EXCEPTION message, as thriftpy2's sync ``TProcessor`` does (thriftpy2's
``TAsyncProcessor`` lets it close the connection instead).

Note that thriftpy2's asyncio server socket applies ``client_timeout`` to a connection's whole life, not to
each read: with the default of 3000 ms a connection is closed 3 s after it opened, even in the middle of a
call. Pass ``client_timeout=None`` for long-lived client connections.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable
from typing import Any

from thriftpy2.contrib.aio.processor import TAsyncProcessor
from thriftpy2.contrib.aio.protocol.binary import TAsyncBinaryProtocolFactory
from thriftpy2.contrib.aio.server import TAsyncServer
from thriftpy2.contrib.aio.socket import TAsyncServerSocket
from thriftpy2.contrib.aio.transport.buffered import TAsyncBufferedTransportFactory
from thriftpy2.thrift import TApplicationException

from interceptors.thrift_common import (
    DISPATCHED,
    BoundServerInfo,
    Connection,
    MeteredTransportFactory,
    RequestHeader,
    ThriftLimits,
    ThriftTracer,
    _anoop,
    _conn_var,
    with_tracking,
)
from interceptors.thrift_server import ThriftBindError
from zoomer_serve.recording import RequestRecorder

__all__ = ["TracedAsyncProcessor", "TracedAsyncServer", "make_aio_server"]


_BINARY = TAsyncBinaryProtocolFactory()  # thriftpy2's aio make_server defaults (stateless factories)
_BUFFERED = TAsyncBufferedTransportFactory()


class TracedAsyncProcessor(TAsyncProcessor):
    """``TAsyncProcessor`` that records one SERVER span per call (see the module docstring).

    Args: as :class:`~interceptors.thrift_server.TracedProcessor` (the handler's methods are coroutines).
    """

    def __init__(self, service: Any, handler: object, *, service_name: str | None = None,
                 recorder: RequestRecorder | None = None, tracer: ThriftTracer | None = None,
                 **tracer_kwargs: Any) -> None:
        super().__init__(with_tracking(service), handler)
        self._zoomer = tracer if tracer is not None else ThriftTracer(recorder, **tracer_kwargs)
        self._zoomer.add_service(service, service_name)

    @property
    def tracer(self) -> ThriftTracer:
        return self._zoomer

    async def process(self, iprot: Any, oprot: Any) -> None:
        conn = Connection.current(iprot, oprot)
        tracer = self._zoomer
        try:
            await super().process(iprot, oprot)
        except BaseException as exc:
            if not (isinstance(exc, TApplicationException) and conn.exc is exc and conn.phase == DISPATCHED
                    and not conn.oneway):
                raised = tracer.failed(conn, exc)
                if raised is exc:
                    raise
                raise raised from exc
            try:  # answer it as the sync TProcessor does
                await self.send_exception(oprot, conn.api, exc, conn.seqid)
            except BaseException as err:
                tracer.failed(conn, err)
                raise
        tracer.completed(conn)

    async def process_in(self, iprot: Any) -> tuple[str, int, Any, Any]:
        conn = _conn_var.get()
        header = None
        if conn is not None and conn.tracking and conn.iprot is iprot:
            header = RequestHeader()
            await iprot.read_struct(header)
        api, seqid, result, call = await super().process_in(iprot)
        if conn is None or conn.iprot is not iprot:
            return api, seqid, result, call
        return self._zoomer.dispatch(conn, api, seqid, result, call, header, conn.ainvoke, _anoop)


class BoundAsyncServerSocket(TAsyncServerSocket):
    """``TAsyncServerSocket`` that binds when asked (the port of a port-0 server is known before serving);
    ``listen`` is then idempotent."""

    raw_sock: Any = None

    def listen(self) -> None:
        if self.raw_sock is not None:
            return
        super().listen()
        if not self.unix_socket and self.raw_sock is not None:
            self.port = self.raw_sock.getsockname()[1]


class TracedAsyncServer(BoundServerInfo, TAsyncServer):
    """``TAsyncServer`` that knows its bound port, serves on a loop of its own and stops cleanly.

    ``serve_forever()`` runs the event loop on the calling thread until :meth:`stop`; ``start()`` runs it on a
    daemon thread and returns once the server accepts connections.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._grace_s = 0.0

    def serve_forever(self) -> None:
        """Run the server's event loop on this thread until :meth:`stop`; then close it."""
        loop = self.loop
        if loop is None:
            loop = self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            self.init_server()
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            self._done.set()
            raise
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            try:
                loop.run_until_complete(self._shutdown())
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()
                self._done.set()

    async def _shutdown(self) -> None:
        grace_s = self._grace_s
        if self.server is not None:
            await self.close()
        metered = self.metered
        if metered is not None:
            deadline = asyncio.get_running_loop().time() + grace_s
            while any(not m.idle for m in list(metered.active)) and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
            metered.shutdown_all()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if tasks:  # connections end once their sockets are closed; cancel what does not within a second
            _, pending = await asyncio.wait(tasks, timeout=1.0)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)

    def start(self, timeout_s: float = 10.0) -> TracedAsyncServer:
        """Serve on a daemon thread; returns once the server accepts connections.

        Raises:
            RuntimeError: it did not start within ``timeout_s`` (the cause is chained when known).
        """
        self._thread = threading.Thread(target=self._serve_quietly, name="thrift-aio", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s) or self._error is not None:
            raise RuntimeError("the Thrift asyncio server did not start") from self._error
        return self

    def _serve_quietly(self) -> None:
        try:
            self.serve_forever()
        except BaseException as exc:  # reported by start()
            self._error = exc

    def stop(self, timeout_s: float = 5.0, grace_s: float = 0.0) -> None:
        """Stop accepting, let calls in progress finish for up to ``grace_s`` seconds, end open connections
        (their tasks are cancelled if they do not end within a second) and close the loop; waits up to
        ``timeout_s`` (plus ``grace_s``) when the loop runs on another thread."""
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        self._grace_s = grace_s
        try:
            loop.call_soon_threadsafe(loop.stop)
        except RuntimeError:  # closed meanwhile
            return
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s + grace_s)


def make_aio_server(service: Any, handler: object, host: str = "localhost", port: int | None = 9090,
                    unix_socket: str | None = None, proto_factory: Any = _BINARY,
                    trans_factory: Any = _BUFFERED, client_timeout: int | None = 3000,
                    certfile: str | None = None, keyfile: str | None = None, ssl_context: Any = None,
                    loop: asyncio.AbstractEventLoop | None = None,
                    socket_family: socket.AddressFamily = socket.AF_INET, *, service_name: str | None = None,
                    recorder: RequestRecorder | None = None, limits: ThriftLimits | None = None,
                    excluded_methods: tuple[str, ...] | None = None, filter_: Callable[[str], bool] | None = None,
                    semconv_dup: bool | None = None) -> TracedAsyncServer:
    """``thriftpy2.contrib.aio.rpc.make_server`` with tracing: a :class:`TracedAsyncServer` around a
    :class:`TracedAsyncProcessor`, its connections metered and bounded.

    The positional parameters are thriftpy2's (``client_timeout`` in ms bounds each connection's whole life,
    see the module docstring; port 0 picks a free port). The socket is bound before returning. Keyword-only
    parameters as for :func:`interceptors.thrift_server.make_server`.

    Raises:
        ValueError: neither host and port nor unix_socket given.
        ThriftBindError: the address cannot be bound.
    """
    if not unix_socket and not (host and port is not None):
        raise ValueError("make_aio_server needs host and port, or unix_socket")
    if unix_socket:
        server_socket = BoundAsyncServerSocket(unix_socket=unix_socket)
    else:
        server_socket = BoundAsyncServerSocket(host=host, port=port, client_timeout=client_timeout,
                                               certfile=certfile, keyfile=keyfile, ssl_context=ssl_context,
                                               socket_family=socket_family)
    try:
        server_socket.listen()
    except OSError as exc:
        server_socket.close()
        where = unix_socket or f"{host}:{port}"
        raise ThriftBindError(exc.errno, f"cannot listen for Thrift on {where}: {exc.strerror or exc}") from exc
    processor = TracedAsyncProcessor(service, handler, service_name=service_name, recorder=recorder,
                                     server_address=unix_socket or host, server_port=server_socket.port,
                                     excluded_methods=excluded_methods, filter_=filter_, semconv_dup=semconv_dup)
    return TracedAsyncServer(processor, server_socket, iprot_factory=proto_factory,
                             itrans_factory=MeteredTransportFactory(trans_factory, limits, aio=True), loop=loop)
