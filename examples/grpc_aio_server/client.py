"""Calls the Ranker from asyncio (``grpc.aio`` channel with zoomer-serve's client interceptors), a few calls
at a time, and prints the best item of each answer::

    python examples/grpc_aio_server/client.py --target 127.0.0.1:50052 --calls 10 --concurrency 4

Each call is a CLIENT span, the parent of the server's span. It uses ``model.py`` and the generated code of
``examples/grpc_server``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "grpc_server"))

import grpc
import ranker_pb2_grpc
from model import make_request

from interceptors import aio_client_interceptors


async def run(target: str, calls: int, concurrency: int) -> None:
    rng = random.Random(0)
    requests = [make_request(rng, rng.randint(4, 32), f"call-{i}") for i in range(calls)]
    limit = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(target, interceptors=aio_client_interceptors(target=target)) as channel:
        stub = ranker_pb2_grpc.RankerStub(channel)

        async def call(request: object) -> None:
            async with limit:
                response = await stub.Rank(request, timeout=10)
            best = response.items[0]
            print(f"{response.request_id}: {len(response.items)} items, best {best.item_id} ({best.score:.3f})")

        await asyncio.gather(*(call(r) for r in requests))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="the server, HOST:PORT")
    parser.add_argument("--calls", type=int, default=10, help="requests to send (default 10)")
    parser.add_argument("--concurrency", type=int, default=4, help="calls in flight at once (default 4)")
    args = parser.parse_args()
    try:
        asyncio.run(run(args.target, args.calls, args.concurrency))
    except grpc.RpcError as err:  # no server there, or it failed: say so in one line
        sys.exit(f"client.py: {args.target}: {err.code().name}: {err.details()}")


if __name__ == "__main__":
    main()
