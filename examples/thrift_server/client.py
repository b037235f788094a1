"""Calls the Thrift Ranker (``server.py`` next to this file) and prints the best item of each answer::

    python examples/thrift_server/client.py --target 127.0.0.1:9090 --calls 10 --invalid 1

``make_thrift_client`` is thriftpy2's ``make_client`` that also sends the caller's W3C trace context (in
thriftpy2's request header), so a call made inside a traced request continues its trace. ``--invalid N``
also sends N requests without candidates, which the server answers with the IDL's ``InvalidRequest``.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import thriftpy2
from thriftpy2.transport import TTransportException

from interceptors import make_thrift_client

ranker_thrift = thriftpy2.load(str(Path(__file__).with_name("ranker.thrift")), module_name="ranker_thrift")
NUM_FEATURES = 8


def make_request(rng: random.Random, candidates: int, request_id: str) -> ranker_thrift.RankRequest:
    return ranker_thrift.RankRequest(request_id=request_id, candidates=[
        ranker_thrift.Candidate(item_id=f"item-{rng.randrange(10**6)}",
                                features=[rng.uniform(-1.0, 1.0) for _ in range(NUM_FEATURES)])
        for _ in range(candidates)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="the server, HOST:PORT")
    parser.add_argument("--calls", type=int, default=10, help="valid requests to send (default 10)")
    parser.add_argument("--invalid", type=int, default=0, help="invalid requests to send after them (default 0)")
    args = parser.parse_args()

    host, _, port = args.target.rpartition(":")
    rng = random.Random(0)
    try:
        client = make_thrift_client(ranker_thrift.Ranker, host, int(port), timeout=10_000)
    except TTransportException as exc:  # no server there: say so in one line
        sys.exit(f"client.py: {args.target}: {exc.message}")
    try:
        for i in range(args.calls):
            response = client.Rank(make_request(rng, rng.randint(4, 32), f"call-{i}"))
            best = response.items[0]
            print(f"{response.request_id}: {len(response.items)} items, best {best.item_id} ({best.score:.3f})")
        for i in range(args.invalid):
            try:
                client.Rank(ranker_thrift.RankRequest(request_id=f"invalid-{i}", candidates=[]))
            except ranker_thrift.InvalidRequest as exc:
                print(f"invalid-{i}: InvalidRequest: {exc.message}")
    finally:
        client.close()


if __name__ == "__main__":
    main()
