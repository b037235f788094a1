"""What the gRPC adapters share: method names, status mapping, peer parsing, context extraction, filters.

Semantic conventions followed: OpenTelemetry RPC and gRPC conventions as of semconv v1.40.0 (stable
names): span name and ``rpc.method`` = ``pkg.Service/Method``, ``rpc.system.name`` = ``grpc``,
``rpc.response.status_code`` = the status code name (``OK``, ``INVALID_ARGUMENT``), ``error.type`` = the
status code name for server errors (or the exception type). With ``OTEL_SEMCONV_STABILITY_OPT_IN=rpc/dup``
the older ``rpc.system``, ``rpc.service`` and ``rpc.grpc.status_code`` (int) are emitted too.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc

from zoomer_serve.recording import ParentContext, parse_traceparent
from zoomer_serve.recording import records as r

# Codes that mean the server failed (span status ERROR); others (client errors, cancellation) are not.
SERVER_ERROR_CODES = frozenset({
    grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS,
})
REQUEST_MESSAGES = "zoomer.rpc.request.messages"
REQUEST_BYTES = "zoomer.rpc.request.bytes"
RESPONSE_MESSAGES = "zoomer.rpc.response.messages"
RESPONSE_BYTES = "zoomer.rpc.response.bytes"
_MAX_PEERS = 4096


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
    ``network.peer.address``, ``network.peer.port``, ``network.type``, ``network.transport`` attributes;
    results are cached (bounded)."""

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
        out: dict[str, Any] = {"network.peer.address": host, "network.type": kind, "network.transport": "tcp"}
        if port.isdigit():
            out["network.peer.port"] = int(port)
        return out
    if kind == "unix":
        return {"network.peer.address": rest, "network.transport": "unix"}
    return {"network.peer.address": peer}


def parent_from_metadata(metadata: Iterable[Any] | None) -> tuple[ParentContext | None, str | None]:
    """The caller's W3C ``traceparent``/``tracestate`` and raw ``baggage`` from gRPC invocation metadata.
    Malformed values give ``(None, ...)``; never raises for bad input."""
    traceparent = tracestate = baggage = None
    if metadata:
        for item in metadata:
            key = item[0]
            if key == "traceparent":
                traceparent = item[1]
            elif key == "tracestate":
                tracestate = item[1]
            elif key == "baggage":
                baggage = item[1]
    if traceparent is None:
        return None, baggage if isinstance(baggage, str) else None
    return parse_traceparent(traceparent, tracestate), baggage if isinstance(baggage, str) else None


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
                 error_type: str | None = None) -> None:
    """Set ``rpc.response.status_code`` (and ``error.type`` / ERROR status for server errors)."""
    attrs = span.attributes
    attrs["rpc.response.status_code"] = code.name
    if dup:
        attrs["rpc.grpc.status_code"] = code.value[0]
    if code in SERVER_ERROR_CODES:
        attrs["error.type"] = error_type or code.name
        span.set_status(r.STATUS_ERROR, details or code.name)
    elif code is not grpc.StatusCode.OK and error_type:
        attrs["error.type"] = error_type


def message_size(message: Any) -> int:
    """Serialized size in bytes of a protobuf message (``ByteSize()``), or of bytes; 0 when unknown."""
    try:
        return message.ByteSize()
    except AttributeError:
        return len(message) if isinstance(message, (bytes, bytearray)) else 0
