"""The ``test.Echo`` service of :mod:`grpc_echo` on a ``grpc.aio`` server, with async handlers that take the
same status paths, plus read/write-style streaming methods (``*RW``) and the async health service; and
:class:`AioServerThread`, which runs an aio server on its own event loop in a background thread so that the
same sync test bodies can call either server."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from typing import Any

import grpc
import grpc_echo
from grpc_health.v1 import health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from zoomer_serve import phase

SERVICE = grpc_echo.SERVICE


@phase("async_deco")
async def _deco_sleep(seconds: float) -> None:
    await asyncio.sleep(seconds)


@phase("gen_deco")
def _deco_gen(n: int) -> Iterator[int]:
    for i in range(n):
        time.sleep(0.05)
        yield i


@phase("agen_deco")
async def _deco_agen(n: int) -> AsyncIterator[int]:
    for i in range(n):
        await asyncio.sleep(0.05)
        yield i


@phase("long")
async def _deco_long() -> None:
    await asyncio.sleep(0.15)


@phase("short")
async def _deco_short() -> None:
    await asyncio.sleep(0.05)


async def _unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    cmd = request.split(b":", 1)[0]
    if cmd == b"invalid":
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad feature count: expected 13, got 2")
    if cmd == b"setcode":
        context.set_code(grpc.StatusCode.NOT_FOUND)
        context.set_details("no such item")
        return b""
    if cmd == b"abortstatus":
        from grpc_status_shim import status_with_trailers

        await context.abort_with_status(status_with_trailers())
    if cmd == b"aborttrailers":
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", (("retry-after-ms", "100"),))
    if cmd == b"raise":
        raise ValueError("handler exploded")
    if cmd == b"internal":
        await context.abort(grpc.StatusCode.INTERNAL, "model crashed")
    if cmd == b"sleep":
        await asyncio.sleep(2.0)  # a cancel or a deadline cancels this task
        return b"slept"
    if cmd == b"phaseabort":
        with phase("preprocess"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad feature count")
    if cmd == b"phaseraise":
        with phase("preprocess"):
            raise ValueError("preprocess exploded")
    if cmd == b"phases":
        with phase("preprocess"):
            await asyncio.sleep(0.002)
        with phase("forward"):
            with phase("inner"):
                await asyncio.sleep(0.001)
        return b"ok"
    if cmd == b"decorated":  # phases as decorators: a coroutine, a generator, an async generator
        await _deco_sleep(0.2)
        assert list(_deco_gen(3)) == [0, 1, 2]
        assert [i async for i in _deco_agen(2)] == [0, 1]
        return b"ok"
    if cmd == b"decogather":  # two decorated coroutines of one request run at once; the shorter ends first
        await asyncio.gather(_deco_long(), _deco_short())
        return b"ok"
    if cmd == b"user_span":
        with grpc_echo._TRACER_PROVIDER[0].get_tracer("test").start_as_current_span("user.work"):
            pass
        return b"ok"
    return request


async def _unary_stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    n = int(request.split(b":")[1]) if b":" in request else 3
    slow = request.startswith(b"slow")
    for i in range(n):
        if slow:
            await asyncio.sleep(0.05)
        yield b"m%d" % i
    if request.startswith(b"fail"):
        raise RuntimeError("stream broke")


async def _unary_stream_rw(request: bytes, context: grpc.aio.ServicerContext) -> None:
    """Read/write style: writes through the context and returns nothing."""
    n = int(request.split(b":")[1]) if b":" in request else 3
    for i in range(n):
        if request.startswith(b"slow"):
            await asyncio.sleep(0.05)
        await context.write(b"m%d" % i)


async def _stream_unary(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
    return b"|".join([r async for r in requests])


async def _stream_unary_rw(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
    parts = []
    while (message := await context.read()) is not grpc.aio.EOF:
        parts.append(message)
    return b"|".join(parts)


async def _stream_stream(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
                         ) -> AsyncIterator[bytes]:
    """Async-generator bidi: one upper-cased reply per message, 10 ms after it arrived."""
    async for req in requests:
        await asyncio.sleep(0.01)
        yield req.upper()


async def _stream_stream_rw(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
    """Read/write style bidi: one upper-cased reply per message, then a short pause before returning, so a
    span that ended when the handler first returned (or before the last write) would show."""
    while (message := await context.read()) is not grpc.aio.EOF:
        await asyncio.sleep(0.01)
        await context.write(message.upper())


def handler() -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(SERVICE, {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary),
        "ServerStream": grpc.unary_stream_rpc_method_handler(_unary_stream),
        "ServerStreamRW": grpc.unary_stream_rpc_method_handler(_unary_stream_rw),
        "ClientStream": grpc.stream_unary_rpc_method_handler(_stream_unary),
        "ClientStreamRW": grpc.stream_unary_rpc_method_handler(_stream_unary_rw),
        "BidiStream": grpc.stream_stream_rpc_method_handler(_stream_stream),
        "BidiStreamRW": grpc.stream_stream_rpc_method_handler(_stream_stream_rw),
    })


class AioServerThread:
    """A ``grpc.aio`` server on its own event loop in a daemon thread.

    ``setup(server)`` (a coroutine function, optional) registers services before the server starts; ``options``
    are grpc server options (channel arguments).
    :meth:`run` runs a coroutine on the server's loop and returns its result (bounded by ``timeout_s``).
    ``stop()`` stops the server (``grace`` seconds, None = cancel now) and the loop; it returns when both did.
    """

    def __init__(self, interceptors: list[Any],
                 setup: Callable[[grpc.aio.Server], Coroutine[Any, Any, Any]] | None = None,
                 options: Sequence[tuple[str, Any]] = ()) -> None:
        self.loop = asyncio.new_event_loop()
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self._thread = threading.Thread(target=self.loop.run_forever, name="aio-server", daemon=True)
        self._thread.start()
        self.run(self._start(interceptors, setup, options))

    async def _start(self, interceptors: list[Any],
                     setup: Callable[[grpc.aio.Server], Coroutine[Any, Any, Any]] | None,
                     options: Sequence[tuple[str, Any]]) -> None:
        self.server = grpc.aio.server(interceptors=interceptors, options=[("grpc.so_reuseport", 0), *options])
        self.server.add_generic_rpc_handlers((handler(),))
        if setup is not None:
            await setup(self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def run(self, coro: Coroutine[Any, Any, Any], timeout_s: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self, grace: float | None = None) -> None:
        if not self._thread.is_alive():
            return
        try:
            if self.server is not None:
                self.run(self.server.stop(grace), timeout_s=10.0 + (grace or 0))
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self.loop.close()


def start_server(interceptors: list[Any], with_health: bool = False) -> tuple[AioServerThread, str]:
    """Like :func:`grpc_echo.start_server`, on a ``grpc.aio`` server; ``with_health`` adds the async health
    service (its servicer is ``server.health``)."""
    health = health_aio.HealthServicer() if with_health else None

    async def setup(server: grpc.aio.Server) -> None:
        if health is not None:
            health_pb2_grpc.add_HealthServicer_to_server(health, server)

    thread = AioServerThread(interceptors, setup)
    thread.health = health  # type: ignore[attr-defined]
    return thread, thread.target
