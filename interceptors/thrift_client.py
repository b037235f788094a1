"""Thrift clients that propagate W3C trace context to a traced server.

thriftpy2's ``contrib.tracking`` protocol lets a client send a request header (a ``meta`` string map) before
each call, after a handshake on a connection; the traced processors (:mod:`interceptors.thrift_server`,
:mod:`interceptors.thrift_aio`) read ``traceparent``, ``tracestate`` and ``baggage`` from it. A server that
does not speak the protocol answers the handshake with UNKNOWN_METHOD and the client then sends plain calls.

- :func:`make_client`: ``thriftpy2.rpc.make_client`` returning a ``TTrackedClient`` with
  :class:`TraceContextTracker`.
- :func:`make_aio_client`: ``thriftpy2.contrib.aio.rpc.make_client`` returning a :class:`TracedAsyncClient`
  (thriftpy2 has no asyncio tracked client).

The context sent is that of the current OpenTelemetry span, or else of the request span current on this
thread or task (a call made from inside a traced handler continues the trace).
"""

from __future__ import annotations

import uuid
from typing import Any

from thriftpy2.contrib.aio.client import TAsyncClient
from thriftpy2.contrib.aio.rpc import make_client as _aio_make_client
from thriftpy2.contrib.tracking import TrackerBase, TTrackedClient
from thriftpy2.rpc import make_client as _sync_make_client
from thriftpy2.thrift import TApplicationException, TMessageType

from interceptors.thrift_common import (
    TRACK_METHOD,
    TRACKING_VERSION,
    RequestHeader,
    ResponseHeader,
    track_thrift,
)
from zoomer_serve.recording import current_request, format_traceparent

__all__ = ["TraceContextTracker", "TracedAsyncClient", "inject_trace_context", "make_aio_client", "make_client"]


def inject_trace_context(meta: dict[str, str]) -> dict[str, str]:
    """Add the current trace context to ``meta`` (``traceparent``, ``tracestate``, ``baggage``, through the
    OpenTelemetry global propagator; else from the current request span). Returns ``meta``."""
    try:
        from opentelemetry import propagate

        propagate.inject(meta)
    except Exception:
        pass
    if "traceparent" not in meta:
        request = current_request()
        if request is not None:
            meta["traceparent"] = format_traceparent(request.trace_id, request.span_id, request.trace_flags)
            if request.trace_state:
                meta["tracestate"] = request.trace_state
    return meta


class TraceContextTracker(TrackerBase):
    """A ``contrib.tracking`` tracker whose request headers carry W3C trace context in ``meta``."""

    def gen_header(self, header: Any) -> None:
        super().gen_header(header)
        header.meta = inject_trace_context(dict(header.meta or {}))


def make_client(service: Any, host: str = "localhost", port: int = 9090, *args: Any,
                tracker: TrackerBase | None = None, **kwargs: Any) -> TTrackedClient:
    """``thriftpy2.rpc.make_client(service, host, port, ...)`` (same arguments) returning a ``TTrackedClient``
    that sends trace context with every call (``tracker``: default :class:`TraceContextTracker`). The
    handshake is one round trip when the client is made.

    Raises: what ``thriftpy2.rpc.make_client`` raises (``TTransportException`` when nothing listens).
    """
    plain = _sync_make_client(service, host, port, *args, **kwargs)
    try:
        return TTrackedClient(tracker or TraceContextTracker(), service, plain._iprot, plain._oprot)
    except BaseException:
        plain.close()
        raise


class TracedAsyncClient(TAsyncClient):
    """``TAsyncClient`` speaking ``contrib.tracking``: call :meth:`negotiate` once after connecting (what
    :func:`make_aio_client` does); then each call carries a request header with the trace context."""

    def __init__(self, service: Any, iprot: Any, oprot: Any = None) -> None:
        super().__init__(service, iprot, oprot)
        self.tracking = 0

    async def negotiate(self) -> int:
        """The tracking handshake; returns the negotiated version (0: the server does not track)."""
        args = track_thrift.UpgradeArgs(version=TRACKING_VERSION)
        self._oprot.write_message_begin(TRACK_METHOD, TMessageType.CALL, self._seqid)
        self._oprot.write_struct(args)
        self._oprot.write_message_end()
        await self._oprot.trans.flush()
        _, msg_type, _ = await self._iprot.read_message_begin()
        if msg_type == TMessageType.EXCEPTION:
            exc = TApplicationException()
            await self._iprot.read_struct(exc)
            await self._iprot.read_message_end()
            if exc.type != TApplicationException.UNKNOWN_METHOD:
                raise exc
            return 0
        reply = track_thrift.UpgradeReply()
        await self._iprot.read_struct(reply)
        await self._iprot.read_message_end()
        self.tracking = min(reply.version, TRACKING_VERSION) if reply.version else 1
        return self.tracking

    async def _send(self, _api: str, **kwargs: Any) -> None:
        if self.tracking:
            header = RequestHeader(request_id=uuid.uuid4().hex, seq="1", meta=inject_trace_context({}))
            self._oprot.write_struct(header)
        await super()._send(_api, **kwargs)

    async def _recv(self, _api: str) -> Any:
        if self.tracking >= 2:
            await self._iprot.read_struct(ResponseHeader())
        return await super()._recv(_api)


async def make_aio_client(service: Any, host: str = "localhost", port: int = 9090, *args: Any,
                          **kwargs: Any) -> TracedAsyncClient:
    """``thriftpy2.contrib.aio.rpc.make_client`` (same arguments) returning a negotiated
    :class:`TracedAsyncClient`."""
    plain = await _aio_make_client(service, host, port, *args, **kwargs)
    client = TracedAsyncClient(service, plain._iprot, plain._oprot)
    try:
        await client.negotiate()
    except BaseException:
        client.close()
        raise
    return client
