"""A gRPC model server of your own, wrapped with zoomer-serve: one interceptor, ``phase(...)`` around the
steps of the handler, and a stop that loses no data.

Run it from the repository root (any collector: here the embedded one, started first in another terminal
with ``zoomer-serve collector --store zoomer.duckdb``)::

    OTEL_SERVICE_NAME=example-ranker OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317 \\
        python examples/grpc_server/server.py --port 50051

It prints ``Ranker listening on HOST:PORT`` once it accepts calls (``--port 0``, the default, picks a free
port). Ctrl+C lets calls in flight finish (5 s at most), then the process exits and its spans reach the
collector; a SIGTERM (``kill``, ``docker stop``) flushes them too (README.md, "Stopping it without losing
data"). Call it with ``client.py`` next to this file.
"""

from __future__ import annotations

import argparse
from concurrent import futures

import grpc
import ranker_pb2
import ranker_pb2_grpc
import torch
from model import InvalidRequest, build_model, to_response, to_tensor

from interceptors import ZoomerServerInterceptor
from zoomer_serve import phase


class Ranker(ranker_pb2_grpc.RankerServicer):
    """Scores the candidates of a request with ``model``; each step is a phase of the request's span."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def Rank(self, request: ranker_pb2.RankRequest, context: grpc.ServicerContext) -> ranker_pb2.RankResponse:
        with phase("preprocess"):
            try:
                batch = to_tensor(request)
            except InvalidRequest as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        with phase("forward"), torch.inference_mode():
            scores = self.model(batch).squeeze(1)
        with phase("postprocess"):
            return to_response(request, scores)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default 0: a free one)")
    args = parser.parse_args()

    torch.set_num_threads(1)  # one request per thread: the 8 server threads share the cores
    # so_reuseport 0: a port in use is an error, not shared with the server already there (grpc's default)
    server = grpc.server(futures.ThreadPoolExecutor(8), interceptors=[ZoomerServerInterceptor()],
                         options=[("grpc.so_reuseport", 0)])
    ranker_pb2_grpc.add_RankerServicer_to_server(Ranker(build_model()), server)
    try:
        port = server.add_insecure_port(f"{args.host}:{args.port}")
    except RuntimeError as exc:  # the port is in use (or the address is not this host's)
        raise SystemExit(f"cannot listen on {args.host}:{args.port}: {exc}") from None
    server.start()
    print(f"Ranker listening on {args.host}:{port}", flush=True)
    try:
        server.wait_for_termination()
    except KeyboardInterrupt:  # Ctrl+C: let calls in flight finish
        server.stop(grace=5).wait()


if __name__ == "__main__":
    main()
