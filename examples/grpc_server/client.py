"""Calls the example Ranker (``server.py`` next to this file) and prints the best item of each answer::

    OTEL_SERVICE_NAME=example-client OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317 \\
        python examples/grpc_server/client.py --target 127.0.0.1:50051 --calls 10

The channel carries zoomer-serve's client interceptor: each call is a CLIENT span, and the trace context it
sends makes it the parent of the server's span (one trace per call). ``--invalid N`` also sends N requests
without candidates, which the server refuses (INVALID_ARGUMENT).
"""

from __future__ import annotations

import argparse
import random
import sys

import grpc
import ranker_pb2
import ranker_pb2_grpc
from model import make_request

from interceptors import ZoomerClientInterceptor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="the server, HOST:PORT")
    parser.add_argument("--calls", type=int, default=10, help="valid requests to send (default 10)")
    parser.add_argument("--invalid", type=int, default=0, help="invalid requests to send after them (default 0)")
    args = parser.parse_args()

    rng = random.Random(0)
    channel = grpc.intercept_channel(grpc.insecure_channel(args.target),
                                     ZoomerClientInterceptor(target=args.target))
    with channel:
        stub = ranker_pb2_grpc.RankerStub(channel)
        for i in range(args.calls):
            try:
                response = stub.Rank(make_request(rng, rng.randint(4, 32), f"call-{i}"), timeout=10)
            except grpc.RpcError as err:  # no server there, or it failed: say so in one line
                sys.exit(f"client.py: {args.target}: {err.code().name}: {err.details()}")
            best = response.items[0]
            print(f"{response.request_id}: {len(response.items)} items, best {best.item_id} ({best.score:.3f})")
        for i in range(args.invalid):
            try:
                stub.Rank(ranker_pb2.RankRequest(request_id=f"invalid-{i}"), timeout=10)
            except grpc.RpcError as err:
                print(f"invalid-{i}: {err.code().name}: {err.details()}")


if __name__ == "__main__":
    main()
