"""The demo ``zoomer.demo.v1.Ranker`` service on an asyncio ``grpc.aio`` server.

Same requests, responses, validation, phases and errors as the sync server in ``service`` (the scoring is
``RankerServicer.score_async`` from there). Where the model runs: in the event loop's default executor
(``asyncio.to_thread``), not inline; with a dynamic batcher (``ServiceConfig.batch_max_size``), the preprocess
phase runs there, the request's task awaits its batch (run by the batcher's thread) and builds its response on
the loop. Inline, every forward pass (about 1-3 ms on CPU, longer on big batches)
would stop the loop: no other call could be accepted, read or streamed meanwhile, and the health service
would stall. ``asyncio.to_thread`` copies the task's context into the worker thread, so the request span
made current by ``ZoomerAioServerInterceptor`` is current there too: ``phase()`` spans (preprocess, forward,
postprocess) and OpenTelemetry spans inside the model code are children of the request span, as on the sync
server, and inside a profiling session those phases open the request's profiler range on the worker
thread, so its operators and kernels are attributed to the request. Concurrency of model calls is bounded by
the default executor (``min(32, cpus + 4)`` threads); torch releases the GIL inside its kernels.

Entry points: :func:`build_aio_server` (a coroutine, inside a running loop), :func:`serve_aio_forever`
(blocking, for a CLI: runs its own loop until a ``threading.Event`` is set) and :func:`aio_server_in_thread`
(``serve_aio_forever`` in a background thread, for tests and checks).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import grpc

from . import ranker_pb2, ranker_pb2_grpc
from .model import DLRM, build_model
from .service import (
    ExtraServicer,
    InvalidRequestError,
    RankerServicer,
    ServerBindError,
    ServiceConfig,
    _address,
)

_STOP_POLL_S = 0.05


class AioRankerServicer(ranker_pb2_grpc.RankerServicer):
    """``Ranker`` with ``async`` handlers; the scoring is a sync ``RankerServicer``'s, run in the default
    executor (see the module docstring). Args as ``RankerServicer``."""

    def __init__(self, model: DLRM, device: Any = None, config: ServiceConfig | None = None) -> None:
        self.scorer = RankerServicer(model, device=device, config=config)

    async def _score_or_abort(self, request: ranker_pb2.PredictRequest,
                              context: grpc.aio.ServicerContext) -> ranker_pb2.PredictResponse:
        try:
            return await self.scorer.score_async(request)
        except InvalidRequestError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
            raise  # not reached: abort raises

    async def Predict(self, request: ranker_pb2.PredictRequest,
                      context: grpc.aio.ServicerContext) -> ranker_pb2.PredictResponse:
        """Unary: one response with one score per candidate; INVALID_ARGUMENT on a bad request."""
        return await self._score_or_abort(request, context)

    async def PredictStream(self, request_iterator: AsyncIterator[ranker_pb2.PredictRequest],
                            context: grpc.aio.ServicerContext) -> AsyncIterator[ranker_pb2.PredictResponse]:
        """Bidirectional: one response per request message, in order; the first bad message ends the stream
        with INVALID_ARGUMENT (responses already sent stay delivered)."""
        async for request in request_iterator:
            yield await self._score_or_abort(request, context)


def _register_extra(server: grpc.aio.Server, extra: ExtraServicer) -> None:
    if callable(extra):
        extra(server)
        return
    add_fn, servicer = extra
    add_fn(servicer, server)


async def build_aio_server(
    model: DLRM | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    *,
    config: ServiceConfig | None = None,
    extra_servicers: Iterable[ExtraServicer] = (),
    on_bound: Callable[[int], None] | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Build, bind and start a ``grpc.aio`` server hosting :class:`AioRankerServicer`; call it inside the
    event loop that will run the server.

    Args:
        model: the model to serve; None builds ``build_model()`` (default config, seed 0, CUDA if available).
        host, port: where to listen; port 0 picks a free port.
        interceptors: ``grpc.aio`` server interceptors, outermost first.
        config: serving limits; None means ``ServiceConfig()``.
        extra_servicers: more services (async health, ...): each a callable ``f(server)`` or a pair
            ``(add_XServicer_to_server, servicer)``.
        on_bound: called with the bound port after binding, before the server accepts calls (to tell an
            interceptor its ``server_port``).

    Returns:
        ``(server, bound_port)``; the server is started, stop it with ``await server.stop(grace)``.

    Raises:
        ServerBindError (an OSError): the address cannot be bound (SO_REUSEPORT is off, so a port held by
            another server is reported rather than shared).
    """
    model = model if model is not None else build_model()
    server = grpc.aio.server(interceptors=list(interceptors), options=[("grpc.so_reuseport", 0)])
    ranker_pb2_grpc.add_RankerServicer_to_server(AioRankerServicer(model, config=config), server)
    for extra in extra_servicers:
        _register_extra(server, extra)
    address = _address(host, port)
    try:
        bound_port = server.add_insecure_port(address)
    except RuntimeError as err:
        await server.stop(None)
        raise ServerBindError(f"cannot bind gRPC server to {address}: {err}") from err
    if bound_port == 0:
        await server.stop(None)
        raise ServerBindError(f"cannot bind gRPC server to {address}")
    if on_bound is not None:
        on_bound(bound_port)
    await server.start()
    return server, bound_port


def serve_aio_forever(
    host: str = "127.0.0.1",
    port: int = 0,
    stop_event: threading.Event | None = None,
    *,
    model: DLRM | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] | None = None,
    config: ServiceConfig | None = None,
    grace_s: float = 5.0,
    on_ready: Callable[[int], None] | None = None,
) -> None:
    """Serve the demo Ranker on a ``grpc.aio`` server in this thread (its own event loop) until
    ``stop_event`` is set (checked every 50 ms; None: until interrupted), then stop, letting in-flight calls
    finish for up to ``grace_s`` seconds. Telemetry is not shut down here (the caller owns it).

    Args:
        interceptors: None means one ``ZoomerAioServerInterceptor`` recording ``server.address`` = ``host``
            and ``server.port`` = the bound port; pass ``()`` for none.
        on_ready: called with the bound port once the server accepts calls.

    Raises:
        ServerBindError: the address cannot be bound.
    """
    asyncio.run(_serve(host, port, stop_event or threading.Event(), model, interceptors, config, grace_s,
                       on_ready))


@contextmanager
def aio_server_in_thread(model: DLRM | None = None, host: str = "127.0.0.1", port: int = 0, *,
                         grace_s: float = 5.0, start_timeout_s: float = 30.0,
                         config: ServiceConfig | None = None) -> Iterator[int]:
    """:func:`serve_aio_forever` (with its default ``ZoomerAioServerInterceptor``) in a daemon thread; yields the
    bound port once the server accepts calls, and stops it when the block ends.

    Raises:
        RuntimeError: the server did not come up within ``start_timeout_s`` seconds (its error, such as a
            ServerBindError, is printed by the thread), or its thread did not end within ``grace_s`` + 10 s of
            the stop.
    """
    stop = threading.Event()
    ready: list[int] = []
    thread = threading.Thread(target=serve_aio_forever, args=(host, port, stop), daemon=True,
                              kwargs={"model": model, "on_ready": ready.append, "grace_s": grace_s,
                                      "config": config})
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not ready and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        if not ready:
            raise RuntimeError(f"the aio demo server did not come up within {start_timeout_s:.0f} s")
        yield ready[0]
    finally:
        stop.set()
        thread.join(grace_s + 10)
    if thread.is_alive():
        raise RuntimeError(f"the aio demo server did not stop within {grace_s + 10:.0f} s")


async def _serve(host: str, port: int, stop_event: threading.Event, model: DLRM | None,
                 interceptors: Sequence[grpc.aio.ServerInterceptor] | None, config: ServiceConfig | None,
                 grace_s: float, on_ready: Callable[[int], None] | None) -> None:
    own = None
    if interceptors is None:
        from interceptors import ZoomerAioServerInterceptor

        own = ZoomerAioServerInterceptor(server_address=host)
        interceptors = [own]

    def bound(bound_port: int) -> None:
        if own is not None:
            own.server_port = bound_port

    server, bound_port = await build_aio_server(model, host, port, interceptors, config=config, on_bound=bound)
    try:
        if on_ready is not None:
            on_ready(bound_port)
        while not stop_event.is_set():
            await asyncio.sleep(_STOP_POLL_S)
    finally:
        await server.stop(grace_s)
