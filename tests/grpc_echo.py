"""A small gRPC test service over raw bytes (no generated code): ``test.Echo`` with all four RPC kinds and
handlers that take every status path, for the interceptor tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
from opentelemetry import trace

from zoomer_serve import phase

SERVICE = "test.Echo"


DECO_BARRIER = threading.Barrier(2, timeout=10)  # "decothreads": two requests meet inside the decorated function


@phase("sync_deco")
def _deco_recurse(depth: int) -> int:
    if depth:
        return _deco_recurse(depth - 1)
    DECO_BARRIER.wait()  # both requests' threads are inside both their phases now
    time.sleep(0.05)
    return 0


def _unary(request: bytes, context: grpc.ServicerContext) -> bytes:
    cmd = request.split(b":", 1)[0]
    if cmd == b"invalid":
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad feature count: expected 13, got 2")
    if cmd == b"setcode":
        context.set_code(grpc.StatusCode.NOT_FOUND)
        context.set_details("no such item")
        return b""
    if cmd == b"abortstatus":
        from grpc_status_shim import status_with_trailers

        context.abort_with_status(status_with_trailers())
    if cmd == b"raise":
        raise ValueError("handler exploded")
    if cmd == b"internal":
        context.abort(grpc.StatusCode.INTERNAL, "model crashed")
    if cmd == b"sleep":
        deadline = time.monotonic() + 2.0
        while context.is_active() and time.monotonic() < deadline:
            time.sleep(0.01)
        return b"slept"
    if cmd == b"phaseabort":
        with phase("preprocess"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad feature count")
    if cmd == b"phaseraise":
        with phase("preprocess"):
            raise ValueError("preprocess exploded")
    if cmd == b"phases":
        with phase("preprocess"):
            time.sleep(0.002)
        with phase("forward"):
            with phase("inner"):
                time.sleep(0.001)
        return b"ok"
    if cmd == b"decothreads":  # a decorated function, re-entered once, whose inner call waits for another request
        assert _deco_recurse(1) == 0
        return b"ok"
    if cmd == b"otel_api":  # what an OpenTelemetry user does to the current span inside a handler
        span = trace.get_current_span()
        span.set_attribute("model.version", "v3")
        span.set_attributes({"model.batch": 4, "model.warm": True})
        span.add_event("cache_miss", {"cache.key": "abc"})
        span.record_exception(ValueError("soft failure"), attributes={"retry": 1})
        return b"recording" if span.is_recording() else b"not recording"
    if cmd == b"user_span":
        tracer_provider = _TRACER_PROVIDER[0]
        with tracer_provider.get_tracer("test").start_as_current_span("user.work"):
            pass
        return b"ok"
    if cmd == b"user_big":  # "user_big:N": a span started with the OpenTelemetry API, with an N-character attribute
        size = int(request.split(b":", 1)[1])
        with _TRACER_PROVIDER[0].get_tracer("test.user", "1.2").start_as_current_span("child-op") as span:
            span.set_attribute("my.big", "x" * size)
        return b"ok"
    return request


_TRACER_PROVIDER: list[Any] = [trace.get_tracer_provider()]


def _unary_stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
    n = int(request.split(b":")[1]) if b":" in request else 3
    slow = request.startswith(b"slow")
    for i in range(n):
        if slow:
            time.sleep(0.05)
            if not context.is_active():
                return
        yield b"m%d" % i
    if request.startswith(b"fail"):
        raise RuntimeError("stream broke")


def _stream_unary(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
    return b"|".join(requests)


def _stream_stream(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
    for req in requests:
        yield req.upper()


def handler() -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(SERVICE, {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary),
        "ServerStream": grpc.unary_stream_rpc_method_handler(_unary_stream),
        "ClientStream": grpc.stream_unary_rpc_method_handler(_stream_unary),
        "BidiStream": grpc.stream_stream_rpc_method_handler(_stream_stream),
    })


def start_server(interceptors: list[Any], workers: int = 8) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), interceptors=interceptors)
    server.add_generic_rpc_handlers((handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


class Client:
    """Raw-bytes stubs for ``test.Echo``."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self.unary = self.channel.unary_unary(f"/{SERVICE}/Unary")
        self.server_stream = self.channel.unary_stream(f"/{SERVICE}/ServerStream")
        self.client_stream = self.channel.stream_unary(f"/{SERVICE}/ClientStream")
        self.bidi = self.channel.stream_stream(f"/{SERVICE}/BidiStream")
        self.unknown = self.channel.unary_unary(f"/{SERVICE}/NoSuchMethod")

    def close(self) -> None:
        self.channel.close()


def send_calls(client: Client, calls: dict[bytes, tuple[grpc.StatusCode, int]]) -> None:
    """Call ``Unary`` with each request ``n`` times, checking each answer: the echo for OK, else an RpcError with
    the given code (``calls``: request -> (status code, n))."""
    import pytest

    for request, (code, n) in calls.items():
        for _ in range(n):
            if code is grpc.StatusCode.OK:
                assert client.unary(request) == request
                continue
            with pytest.raises(grpc.RpcError) as failed:
                client.unary(request)
            assert failed.value.code() is code
