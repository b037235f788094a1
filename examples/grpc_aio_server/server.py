"""The example Ranker on ``grpc.aio``: the servicer of ``examples/grpc_server`` as coroutines, wrapped with
zoomer-serve's asyncio interceptor (the same spans as the sync one), stopped on Ctrl+C or SIGTERM after the
calls in flight finished.

It uses the proto, its generated code and ``model.py`` of ``examples/grpc_server`` (copy those files next to
this one if you take it elsewhere). From the repository root::

    OTEL_SERVICE_NAME=example-ranker-aio OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317 \\
        python examples/grpc_aio_server/server.py --port 50052
    python examples/grpc_aio_server/client.py --target 127.0.0.1:50052 --calls 10

It prints ``Ranker (grpc.aio) listening on HOST:PORT`` once it accepts calls (``--port 0``, the default,
picks a free port). The signal handlers below replace zoomer-serve's SIGINT/SIGTERM ones (installed when the
interceptor is made); the normal exit that follows flushes the spans (README.md, "Stopping it without losing
data").
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "grpc_server"))

import grpc
import ranker_pb2
import ranker_pb2_grpc
import torch
from model import InvalidRequest, build_model, to_response, to_tensor

from interceptors import ZoomerAioServerInterceptor
from zoomer_serve import phase


class Ranker(ranker_pb2_grpc.RankerServicer):
    """Scores the candidates of a request; the forward pass runs on a worker thread, so the event loop keeps
    serving other calls meanwhile (``asyncio.to_thread`` carries the request's span along)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def _forward(self, batch: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(batch).squeeze(1)

    async def Rank(self, request: ranker_pb2.RankRequest,
                   context: grpc.aio.ServicerContext) -> ranker_pb2.RankResponse:
        with phase("preprocess"):
            try:
                batch = to_tensor(request)
            except InvalidRequest as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        with phase("forward"):
            scores = await asyncio.to_thread(self._forward, batch)
        with phase("postprocess"):
            return to_response(request, scores)


async def serve(host: str, port: int) -> None:
    # so_reuseport 0: a port in use is an error, not shared with the server already there (grpc's default)
    server = grpc.aio.server(interceptors=[ZoomerAioServerInterceptor()], options=[("grpc.so_reuseport", 0)])
    ranker_pb2_grpc.add_RankerServicer_to_server(Ranker(build_model()), server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as exc:  # the port is in use (or the address is not this host's)
        raise SystemExit(f"cannot listen on {host}:{port}: {exc}") from None
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    print(f"Ranker (grpc.aio) listening on {host}:{bound}", flush=True)
    await stop.wait()
    await server.stop(grace=5)  # calls in flight finish (5 s at most); new ones are refused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default 0: a free one)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    asyncio.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
