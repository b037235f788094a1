"""The demo ``Ranker`` over Thrift (``ranker.thrift``, thriftpy2), sync or asyncio, with the zoomer middleware.

The handlers call the same ``RankerCore`` as the gRPC servicer (validation, the ``preprocess`` /
``forward`` / ``postprocess`` phases, the model call); an invalid request raises the IDL's declared
``InvalidRequest`` (a normal reply with the exception field set, the Thrift counterpart of gRPC's
INVALID_ARGUMENT). Spans are named ``zoomer.demo.v1.Ranker/Predict`` like the gRPC ones and carry
``rpc.system.name`` = ``thrift``.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import thriftpy2

from interceptors.thrift_aio import TracedAsyncServer, make_aio_server
from interceptors.thrift_common import ThriftLimits
from interceptors.thrift_server import ThriftBindError, TracedThreadedServer, make_server
from zoomer_serve.recording import RequestRecorder

from .model import DLRM, build_model
from .service import InvalidRequestError, RankerCore, ServerBindError, ServiceConfig

IDL_PATH = Path(__file__).with_name("ranker.thrift")
SERVICE_NAME = "zoomer.demo.v1.Ranker"  # the span names of the gRPC service
SYNC_CLIENT_TIMEOUT_MS = 60_000

ThriftServer = TracedThreadedServer | TracedAsyncServer


@functools.lru_cache(maxsize=1)
def ranker_thrift() -> ModuleType:
    """The ``ranker.thrift`` module (loaded once, registered as ``zoomer_demo_ranker_thrift`` so that its
    structs pickle)."""
    return thriftpy2.load(str(IDL_PATH), module_name="zoomer_demo_ranker_thrift")


class RankerHandler:
    """Sync handler of ``Ranker`` over a ``RankerCore``."""

    def __init__(self, core: RankerCore) -> None:
        self.core = core
        self._thrift = ranker_thrift()

    def _respond(self, request_id: str, scores: list[float]) -> Any:
        return self._thrift.PredictResponse(request_id=request_id, scores=scores,
                                            model_version=self.core.config.model_version)

    def Predict(self, request: Any) -> Any:
        """One score per candidate; raises the declared ``InvalidRequest`` for a request that cannot be
        scored."""
        try:
            return self.core.score(request, functools.partial(self._respond, request.request_id))
        except InvalidRequestError as err:
            raise self._thrift.InvalidRequest(message=str(err)) from None


class AsyncRankerHandler:
    """asyncio handler of ``Ranker``: runs the sync handler in a worker thread (``asyncio.to_thread`` copies
    the context, so the request span and its phases follow); with a dynamic batcher, awaits the request's
    batch instead of holding a thread (``RankerCore.score_async``)."""

    def __init__(self, core: RankerCore) -> None:
        self._sync = RankerHandler(core)
        self._core = core

    async def Predict(self, request: Any) -> Any:
        if self._core.batcher is None:
            return await asyncio.to_thread(self._sync.Predict, request)
        try:
            return await self._core.score_async(request, functools.partial(self._sync._respond, request.request_id))
        except InvalidRequestError as err:
            raise self._sync._thrift.InvalidRequest(message=str(err)) from None


def build_thrift_server(model: DLRM | None = None, host: str = "127.0.0.1", port: int = 0, aio: bool = False,
                        *, config: ServiceConfig | None = None, recorder: RequestRecorder | None = None,
                        limits: ThriftLimits | None = None) -> ThriftServer:
    """Build and bind (not start) the traced Thrift ``Ranker`` server.

    Args:
        model: the model; None builds ``build_model()``.
        host, port: where to listen; port 0 picks a free port (``server.port`` tells which).
        aio: serve with ``thriftpy2.contrib.aio`` (handler coroutines) instead of a thread per connection.
        config: serving limits; recorder: default the process's; limits: wire limits (``ThriftLimits``).

    Returns:
        A server with ``port``, ``serve_forever()`` (blocks), ``start()`` (serves on a daemon thread) and
        ``stop(timeout_s)``. Buffered transport, binary protocol; idle connections are closed after 60 s
        (sync server); the asyncio server keeps them until they close or the server stops.

    Raises:
        ServerBindError (an OSError): the address cannot be bound.
    """
    core = RankerCore(model if model is not None else build_model(), config=config)
    thrift = ranker_thrift()
    try:
        if aio:
            return make_aio_server(thrift.Ranker, AsyncRankerHandler(core), host, port, client_timeout=None,
                                   service_name=SERVICE_NAME, recorder=recorder, limits=limits)
        return make_server(thrift.Ranker, RankerHandler(core), host, port, client_timeout=SYNC_CLIENT_TIMEOUT_MS,
                           service_name=SERVICE_NAME, recorder=recorder, limits=limits)
    except ThriftBindError as err:
        raise ServerBindError(str(err)) from err


def serve_thrift_forever(host: str = "127.0.0.1", port: int = 0, stop_event: threading.Event | None = None, *,
                         model: DLRM | None = None, aio: bool = False, config: ServiceConfig | None = None,
                         grace_s: float = 5.0, on_ready: Callable[[int], None] | None = None) -> None:
    """Serve the demo Ranker over Thrift until ``stop_event`` is set (None: until interrupted), then stop,
    letting calls in progress finish for up to ``grace_s`` seconds. Telemetry is not shut down here (the
    caller owns it). The counterpart of ``aio_server.serve_aio_forever``.

    Args:
        aio: the ``thriftpy2.contrib.aio`` server instead of a thread per connection.
        on_ready: called with the bound port once the server accepts calls.

    Raises:
        ServerBindError: the address cannot be bound.
    """
    server = build_thrift_server(model, host, port, aio, config=config).start()
    try:
        if on_ready is not None:
            assert server.port is not None
            on_ready(server.port)
        (stop_event or threading.Event()).wait()
    finally:
        server.stop(grace_s=grace_s)
