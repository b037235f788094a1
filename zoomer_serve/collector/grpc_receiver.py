"""OTLP/gRPC receiver: the Trace, Metrics and Logs ``Export`` methods on one ``grpc.server``.

Handlers take the raw request bytes (no grpc-side deserializer) and parse them themselves, so that a
malformed payload is answered with ``INVALID_ARGUMENT`` as the OTLP spec asks, not with grpc's own
deserialization failure. Status codes:

- ``INVALID_ARGUMENT``: the payload is not a valid export request (not retryable);
- ``RESOURCE_EXHAUSTED``: the (decompressed) message is over ``max_message_bytes``; grpc core enforces this
  before the handler runs, so these are not in the collector's counters;
- ``UNAVAILABLE``: the store's queue is full, the collector is stopping, or the store did not commit in time
  (retryable: the client retries, nothing acknowledged is lost);
- ``UNAUTHENTICATED``: a token is configured and the call's ``authorization`` metadata is missing or wrong
  (:mod:`zoomer_serve.collector.security`).

gzip-compressed requests are decompressed by grpc. With TLS configured the port speaks TLS only
(``ssl_server_credentials``). Connections are grpc-core's (polled, no thread each); ``max_workers`` threads
run the handlers, each of which waits for its export's commit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from zoomer_serve.collector.ingest import GRPC_SERVICES, Ingestor, Outcome, Signal
from zoomer_serve.collector.security import UNAUTHENTICATED_MESSAGE, ReceiverSecurity
from zoomer_serve.netaddr import BindError, bind_probe, format_hostport

__all__ = ["BindError", "GrpcReceiver", "format_hostport"]

log = logging.getLogger(__name__)

_STATUS = {
    Outcome.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    Outcome.TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Outcome.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}


def _serialize(message: Any) -> bytes:
    return message.SerializeToString()


class GrpcReceiver:
    """Serves OTLP/gRPC on ``host:port`` (port 0 picks a free port; see :attr:`port` after :meth:`start`)."""

    def __init__(self, ingestor: Ingestor, host: str, port: int, max_message_bytes: int,
                 max_workers: int = 8, security: ReceiverSecurity | None = None) -> None:
        self._ingestor = ingestor
        self._security = security or ReceiverSecurity()
        self._host = host
        self._requested_port = port
        self._max_message_bytes = max_message_bytes
        self._max_workers = max_workers
        self._server: grpc.Server | None = None
        self.port: int | None = None

    def _handler(self, signal: Signal) -> Callable[[bytes, grpc.ServicerContext], Any]:
        ingestor = self._ingestor
        security = self._security

        def export(payload: bytes, context: grpc.ServicerContext) -> Any:
            ingestor.count("grpc_requests")
            if security.token is not None:
                metadata = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
                if not security.authorized(metadata.get("authorization")):
                    ingestor.count("rejected_unauthenticated")
                    context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
            result = ingestor.ingest_bytes(signal, payload)
            if result.outcome is Outcome.OK:
                return result.response
            context.abort(_STATUS[result.outcome], result.message)

        return export

    def _generic_handlers(self) -> list[grpc.GenericRpcHandler]:
        handlers = []
        for signal, service in GRPC_SERVICES.items():
            method = grpc.unary_unary_rpc_method_handler(
                self._handler(signal), request_deserializer=None, response_serializer=_serialize
            )
            handlers.append(grpc.method_handlers_generic_handler(service, {"Export": method}))
        return handlers

    def start(self) -> int:
        """Bind and start serving; returns the bound port.

        Raises:
            BindError: the address cannot be bound (its message names the receiver, the address and why).
            zoomer_serve.config.ConfigError: the TLS certificate or key cannot be read.
        """
        pem = self._security.pem_pair()
        options = [
            ("grpc.max_receive_message_length", self._max_message_bytes),
            ("grpc.so_reuseport", 0),  # fail on a port in use instead of sharing it with another server
        ]
        server = grpc.server(ThreadPoolExecutor(max_workers=self._max_workers, thread_name_prefix="otlp-grpc"),
                             handlers=self._generic_handlers(), options=options)
        address = format_hostport(self._host, self._requested_port)
        try:
            if pem is None:
                port = server.add_insecure_port(address)
            else:
                port = server.add_secure_port(address, grpc.ssl_server_credentials([pem]))
        except RuntimeError as exc:
            failure: str | None = str(exc)
        else:
            failure = None if port else "grpc bound no port"
        if failure is not None:
            server.stop(None)
            # grpc's error only says "Failed to bind to address ...; set GRPC_VERBOSITY=debug ...": ask the OS why
            reason = bind_probe(self._host, self._requested_port) or failure
            raise BindError("OTLP/gRPC", address, reason, "grpc_port")
        server.start()
        self._server = server
        self.port = port
        log.info("OTLP/gRPC receiver listening on %s", format_hostport(self._host, port))
        return port

    def stop(self, grace_s: float) -> None:
        """Stop accepting calls, let running calls finish for up to ``grace_s`` seconds. Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.stop(grace_s).wait(grace_s + 1.0)
